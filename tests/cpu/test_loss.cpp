// Loss family: cross_entropy forward/backward, the full_ce and linear_ce loss heads, and
// linear_ce's fused training pass (linear_ce_fused).
//
// Oracles: a naive double loss (explicit loops, no max trick) for the values; central finite
// differences in double (ref kernels instantiated with double) for every backward; full_ce as the
// paired baseline of linear_ce and linear_ce_fused across chunk sizes that do and do not divide T
// and V; the allocator's per-category peaks for the memory claim (one logits chunk alive).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "primitives/loss/cross_entropy.h"
#include "primitives/loss/cross_entropy_ref.h"
#include "primitives/loss/linear_ce.h"
#include "primitives/loss/loss_head.h"

namespace bb {

// Readable names for the parameterized chunk sizes in gtest output.
void PrintTo(const LossHeadConfig& c, std::ostream* os) {
  *os << "{chunk_tokens " << c.chunk_tokens << ", chunk_vocab " << c.chunk_vocab
      << ", fused_chunk_tokens " << c.fused_chunk_tokens << "}";
}

namespace {

// Random targets in [0, V); every `mask_every`-th position (if > 0) is masked with -1 / -100.
std::vector<int32_t> make_targets(int64_t T, int64_t V, uint64_t seed, int mask_every) {
  auto u = test::randu(static_cast<size_t>(T), seed, 0.0f, 1.0f);
  std::vector<int32_t> tg(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    tg[t] = std::min<int32_t>(static_cast<int32_t>(u[t] * static_cast<float>(V)),
                              static_cast<int32_t>(V - 1));
    if (mask_every > 0 && t % mask_every == 1) tg[t] = (t % 2) ? -100 : -1;
  }
  return tg;
}

// A loss-head problem: h [T, H], w [V, H], targets [T].
struct HeadCase {
  int64_t T, V, H;
  std::vector<float> h, w;
  std::vector<int32_t> targets;
};

HeadCase make_case(int64_t T, int64_t V, int64_t H, uint64_t seed, int mask_every = 4,
                   float w_std = 0.5f) {
  HeadCase c{T,
             V,
             H,
             test::randn(T * H, seed),
             test::randn(V * H, seed + 1, w_std),
             make_targets(T, V, seed + 2, mask_every)};
  return c;
}

// Loss in double by the textbook formula: log(sum exp) without the max shift (inputs are small).
double naive_loss(const HeadCase& c, int64_t* num_valid) {
  double loss = 0;
  *num_valid = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    if (c.targets[t] < 0) continue;
    double s = 0, tgt = 0;
    for (int64_t v = 0; v < c.V; ++v) {
      double x = 0;
      for (int64_t k = 0; k < c.H; ++k)
        x += static_cast<double>(c.h[t * c.H + k]) * c.w[v * c.H + k];
      s += std::exp(x);
      if (v == c.targets[t]) tgt = x;
    }
    loss += std::log(s) - tgt;
    ++*num_valid;
  }
  return loss;
}

enum class Head { full, linear, fused };

const char* head_name(Head k) {
  return k == Head::full ? "full_ce" : k == Head::linear ? "linear_ce" : "linear_ce_fused";
}

struct HeadOut {
  LossResult r;
  std::vector<float> lse, d_h, d_w;
};

// Forward + backward of one head (the fused head: its one pass; it has no lse to return). d_h
// starts as garbage (it must be written), d_w as d_w_init (it must be accumulated into).
HeadOut run_head(Head kind, const Tensor& h, const Tensor& w, const Tensor& tg, float scale,
                 const LossHeadConfig& cfg, const std::vector<float>& d_w_init,
                 DType d_h_dtype = DType::f32) {
  const int64_t T = h.size(0), H = h.size(1), V = w.size(0);
  HeadOut out;
  if (kind == Head::fused) {
    Tensor d_h = Tensor::from_floats(test::randn(T * H, 999, 7.0f), {T, H}, d_h_dtype);
    Tensor d_w = Tensor::from_floats(d_w_init, {V, H});
    out.r = linear_ce_fused(scale, h, w, tg, cfg, d_h, d_w);
    out.d_h = d_h.to_floats();
    out.d_w = d_w.to_floats();
    return out;
  }
  LossHeadSaved saved;
  out.r = kind == Head::full ? full_ce_forward(h, w, tg, &saved)
                             : linear_ce_forward(h, w, tg, cfg, &saved);
  out.lse = saved.lse.to_floats();
  Tensor d_h = Tensor::from_floats(test::randn(T * H, 999, 7.0f), {T, H}, d_h_dtype);
  Tensor d_w = Tensor::from_floats(d_w_init, {V, H});
  if (kind == Head::full)
    full_ce_backward(scale, h, w, tg, saved, d_h, d_w);
  else
    linear_ce_backward(scale, h, w, tg, cfg, saved, d_h, d_w);
  out.d_h = d_h.to_floats();
  out.d_w = d_w.to_floats();
  return out;
}

std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// ---- cross_entropy on logits ---------------------------------------------------------------

TEST(CrossEntropy, ForwardMatchesNaiveDouble) {
  const int64_t T = 9, V = 23;
  auto x = test::randn(T * V, 11, 2.0f);
  auto tg = make_targets(T, V, 12, 3);
  Tensor lse;
  LossResult r =
      cross_entropy_forward(Tensor::from_floats(x, {T, V}), Tensor::from_ints(tg, {T}), &lse);
  ASSERT_TRUE(lse.defined());
  EXPECT_EQ(lse.category(), MemCategory::activations);
  auto lv = lse.to_floats();
  double want = 0;
  int64_t valid = 0;
  for (int64_t t = 0; t < T; ++t) {
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(x[t * V + v]));
    EXPECT_NEAR(lv[t], std::log(s), 1e-5 * std::fabs(std::log(s)) + 1e-6) << "row " << t;
    if (tg[t] < 0) continue;
    want += std::log(s) - x[t * V + tg[t]];
    ++valid;
  }
  EXPECT_GT(valid, 0);
  EXPECT_LT(valid, T);  // some rows are masked
  EXPECT_EQ(r.num_valid, valid);
  EXPECT_NEAR(r.loss_sum, want, 1e-6 * std::fabs(want));
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const int64_t T = 7, V = 13;
  auto x = test::randn(T * V, 21, 1.5f);
  auto tg = make_targets(T, V, 22, 3);
  const float scale = 0.37f;
  Tensor logits = Tensor::from_floats(x, {T, V}), targets = Tensor::from_ints(tg, {T});
  Tensor lse;
  cross_entropy_forward(logits, targets, &lse);
  Tensor d = cross_entropy_backward(logits, targets, lse, scale);
  EXPECT_EQ(d.category(), MemCategory::logits);
  EXPECT_EQ(d.shape(), (Shape{T, V}));
  auto fd = test::finite_diff(
      [&](const std::vector<double>& xd) {
        double s;
        int64_t n;
        ref::cross_entropy_forward<double>(nullptr, &s, &n, xd.data(), tg.data(), T, V);
        return scale * s;
      },
      test::cast<double>(x));
  auto dv = d.to_floats();
  EXPECT_LT(test::rel_error(dv, fd), test::kGradTol);
  for (int64_t t = 0; t < T; ++t) {
    double row = 0;
    for (int64_t v = 0; v < V; ++v) row += dv[t * V + v];
    EXPECT_NEAR(row, 0.0, 1e-6);  // softmax - onehot sums to 0; masked rows are all 0
    if (tg[t] < 0)
      for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dv[t * V + v], 0.0f);
  }
}

TEST(CrossEntropy, Bf16LogitsAndLargeValues) {
  const int64_t T = 5, V = 17;
  auto x = test::randn(T * V, 31, 3.0f);
  auto tg = make_targets(T, V, 32, 0);
  Tensor targets = Tensor::from_ints(tg, {T});
  // bf16 storage gives the f32 result on the rounded values, exactly.
  std::vector<float> xr(x.size());
  for (size_t i = 0; i < x.size(); ++i) xr[i] = round_bf16(x[i]);
  LossResult rb =
      cross_entropy_forward(Tensor::from_floats(x, {T, V}, DType::bf16), targets, nullptr);
  LossResult rf = cross_entropy_forward(Tensor::from_floats(xr, {T, V}), targets, nullptr);
  EXPECT_EQ(rb.loss_sum, rf.loss_sum);
  // Shifting every logit by +1000 (exp would overflow without the max trick) leaves the loss.
  std::vector<float> xs(x.size());
  for (size_t i = 0; i < x.size(); ++i) xs[i] = x[i] + 1000.0f;
  LossResult r0 = cross_entropy_forward(Tensor::from_floats(x, {T, V}), targets, nullptr);
  Tensor lse;
  LossResult r1 = cross_entropy_forward(Tensor::from_floats(xs, {T, V}), targets, &lse);
  EXPECT_TRUE(std::isfinite(r1.loss_sum));
  EXPECT_NEAR(r1.loss_sum, r0.loss_sum, 1e-3 * T);  // f32 spacing at 1000 is 6e-5 per logit
  Tensor d = cross_entropy_backward(Tensor::from_floats(xs, {T, V}), targets, lse, 1.0f);
  for (float v : d.to_floats()) EXPECT_TRUE(std::isfinite(v));
}

// ---- loss heads ----------------------------------------------------------------------------

TEST(LossHead, LmHeadLogitsMatchesLoops) {
  HeadCase c = make_case(6, 19, 5, 41);
  Tensor logits =
      lm_head_logits(Tensor::from_floats(c.h, {c.T, c.H}), Tensor::from_floats(c.w, {c.V, c.H}));
  EXPECT_EQ(logits.shape(), (Shape{c.T, c.V}));
  EXPECT_EQ(logits.dtype(), DType::f32);
  EXPECT_EQ(logits.category(), MemCategory::logits);
  std::vector<double> want(c.T * c.V);
  ref::lm_head_logits<double>(want.data(), test::cast<double>(c.h).data(),
                              test::cast<double>(c.w).data(), c.T, c.V, c.H);
  EXPECT_LT(test::rel_error(logits.to_floats(), want), 1e-6);
}

TEST(LossHead, LossMatchesNaiveDouble) {
  HeadCase c = make_case(13, 29, 8, 51);
  int64_t valid = 0;
  const double want = naive_loss(c, &valid);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  LossHeadSaved saved;
  LossResult rf = full_ce_forward(h, w, tg, &saved);
  EXPECT_EQ(rf.num_valid, valid);
  EXPECT_NEAR(rf.loss_sum, want, 1e-5 * std::fabs(want));
  EXPECT_EQ(saved.logits.shape(), (Shape{c.T, c.V}));
  EXPECT_EQ(saved.logits.category(), MemCategory::logits);
  EXPECT_EQ(saved.lse.category(), MemCategory::activations);
  LossHeadSaved saved_lin;
  LossResult rl = linear_ce_forward(h, w, tg, LossHeadConfig{4, 6}, &saved_lin);
  EXPECT_EQ(rl.num_valid, valid);
  EXPECT_NEAR(rl.loss_sum, want, 1e-5 * std::fabs(want));
  EXPECT_FALSE(saved_lin.logits.defined());  // linear_ce saves lse only
  EXPECT_EQ(saved_lin.lse.shape(), (Shape{c.T}));
  EXPECT_EQ(saved_lin.lse.category(), MemCategory::activations);
  // Without `saved` (evaluation) the result is the same.
  EXPECT_EQ(full_ce_forward(h, w, tg, nullptr).loss_sum, rf.loss_sum);
  EXPECT_EQ(linear_ce_forward(h, w, tg, LossHeadConfig{4, 6}, nullptr).loss_sum, rl.loss_sum);
}

// FD check of d_h and d_w for one head and one chunking, with masked targets; d_w pre-filled to
// check += and d_h pre-filled with garbage to check =.
void check_head_gradients(Head kind, const LossHeadConfig& cfg) {
  HeadCase c = make_case(7, 13, 5, 61, 3);
  const float scale = 1.0f / 5.0f;
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 62);
  HeadOut o = run_head(kind, h, w, tg, scale, cfg, d_w0);
  EXPECT_GT(o.r.num_valid, 0);
  EXPECT_LT(o.r.num_valid, c.T);
  const int64_t nh = c.T * c.H;
  std::vector<double> x0 = test::cast<double>(c.h);
  for (float v : c.w) x0.push_back(v);
  auto fd = test::finite_diff(
      [&](const std::vector<double>& x) {
        std::vector<double> logits(c.T * c.V);
        ref::lm_head_logits<double>(logits.data(), x.data(), x.data() + nh, c.T, c.V, c.H);
        double s;
        int64_t n;
        ref::cross_entropy_forward<double>(nullptr, &s, &n, logits.data(), c.targets.data(), c.T,
                                           c.V);
        return scale * s;
      },
      x0);
  std::vector<double> fd_h(fd.begin(), fd.begin() + nh), fd_w(fd.begin() + nh, fd.end());
  EXPECT_LT(test::rel_error(o.d_h, fd_h), test::kGradTol);
  EXPECT_LT(test::rel_error(minus(o.d_w, d_w0), fd_w), test::kGradTol);
  for (int64_t t = 0; t < c.T; ++t)  // masked rows get no gradient
    if (c.targets[t] < 0)
      for (int64_t k = 0; k < c.H; ++k) EXPECT_EQ(o.d_h[t * c.H + k], 0.0f);
}

TEST(FullCe, GradientsMatchFiniteDifferences) {
  check_head_gradients(Head::full, {});
}

TEST(LinearCe, GradientsMatchFiniteDifferences) {
  for (LossHeadConfig cfg : {LossHeadConfig{3, 5}, LossHeadConfig{1, 1}, LossHeadConfig{100, 4}}) {
    SCOPED_TRACE("chunks " + std::to_string(cfg.chunk_tokens) + "x" +
                 std::to_string(cfg.chunk_vocab));
    check_head_gradients(Head::linear, cfg);
  }
}

// linear_ce against its paired baseline full_ce, chunkings that do and do not divide T and V.
class LinearCeVsFullCe : public ::testing::TestWithParam<LossHeadConfig> {};

TEST_P(LinearCeVsFullCe, SameLossAndGradients) {
  const LossHeadConfig cfg = GetParam();
  HeadCase c = make_case(37, 101, 16, 71, 5);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 72, 0.1f);
  const float scale = 1.0f / 30.0f;
  HeadOut f = run_head(Head::full, h, w, tg, scale, cfg, d_w0);
  HeadOut l = run_head(Head::linear, h, w, tg, scale, cfg, d_w0);
  EXPECT_EQ(l.r.num_valid, f.r.num_valid);
  EXPECT_NEAR(l.r.loss_sum, f.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
  EXPECT_LT(test::rel_error(l.lse, f.lse), 1e-6);
  EXPECT_LT(test::rel_error(l.d_h, f.d_h), 1e-5);
  EXPECT_LT(test::rel_error(minus(l.d_w, d_w0), minus(f.d_w, d_w0)), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Chunks, LinearCeVsFullCe,
                         ::testing::Values(LossHeadConfig{37, 101}, LossHeadConfig{8, 16},
                                           LossHeadConfig{5, 7}, LossHeadConfig{1, 1},
                                           LossHeadConfig{64, 1000}, LossHeadConfig{4096, 32768}),
                         [](const ::testing::TestParamInfo<LossHeadConfig>& i) {
                           return "ct" + std::to_string(i.param.chunk_tokens) + "_cv" +
                                  std::to_string(i.param.chunk_vocab);
                         });

TEST(LinearCe, LargeLogitsStayFinite) {
  // w with std 40 gives logits in the hundreds: exp overflows f32 without the running max.
  HeadCase c = make_case(11, 31, 6, 81, 4, 40.0f);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = std::vector<float>(c.V * c.H, 0.0f);
  HeadOut f = run_head(Head::full, h, w, tg, 1.0f, {}, d_w0);
  HeadOut l = run_head(Head::linear, h, w, tg, 1.0f, LossHeadConfig{3, 4}, d_w0);
  ASSERT_TRUE(std::isfinite(l.r.loss_sum));
  EXPECT_GT(l.r.loss_sum, 10.0);  // the logits really are large
  EXPECT_NEAR(l.r.loss_sum, f.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
  for (float v : l.d_h) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LT(test::rel_error(l.d_h, f.d_h), 1e-5);
  EXPECT_LT(test::rel_error(l.d_w, f.d_w), 1e-5);
}

TEST(LossHead, Bf16InputsAndBf16Dh) {
  HeadCase c = make_case(10, 23, 8, 91);
  Tensor hb = Tensor::from_floats(c.h, {c.T, c.H}, DType::bf16);
  Tensor wb = Tensor::from_floats(c.w, {c.V, c.H}, DType::bf16);
  Tensor hr = hb.to_dtype(DType::f32), wr = wb.to_dtype(DType::f32);  // the rounded values
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 92);
  const LossHeadConfig cfg{3, 5, 4};
  for (Head kind : {Head::full, Head::linear, Head::fused}) {
    SCOPED_TRACE(head_name(kind));
    HeadOut ref_f32 = run_head(kind, hr, wr, tg, 0.25f, cfg, d_w0);
    HeadOut b = run_head(kind, hb, wb, tg, 0.25f, cfg, d_w0, DType::bf16);
    EXPECT_EQ(b.r.loss_sum, ref_f32.r.loss_sum);  // bf16 is converted to exactly these f32
    EXPECT_EQ(b.d_w, ref_f32.d_w);
    for (size_t i = 0; i < b.d_h.size(); ++i) EXPECT_EQ(b.d_h[i], round_bf16(ref_f32.d_h[i]));
  }
}

TEST(LossHead, AllMaskedGivesZeroLossAndGrads) {
  HeadCase c = make_case(9, 14, 4, 101);
  std::vector<int32_t> masked(c.T, -100);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(masked, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 102);
  for (Head kind : {Head::full, Head::linear, Head::fused}) {
    SCOPED_TRACE(head_name(kind));
    HeadOut o = run_head(kind, h, w, tg, 1.0f, LossHeadConfig{4, 5, 4}, d_w0);
    EXPECT_EQ(o.r.loss_sum, 0.0);
    EXPECT_EQ(o.r.num_valid, 0);
    for (float v : o.d_h) EXPECT_EQ(v, 0.0f);  // written (the garbage is gone), and zero
    EXPECT_EQ(o.d_w, d_w0);                    // nothing added
  }
  Tensor lse;
  LossResult r = cross_entropy_forward(Tensor::from_floats(c.h, {c.T, c.H}), tg, &lse);
  EXPECT_EQ(r.loss_sum, 0.0);
  EXPECT_EQ(r.num_valid, 0);
}

TEST(LossHead, DhAllocatedWhenUndefined) {
  HeadCase c = make_case(5, 9, 3, 111);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  LossHeadSaved saved;
  linear_ce_forward(h, w, tg, {2, 2}, &saved);
  Tensor d_h, d_w = Tensor::zeros({c.V, c.H}, DType::f32, Device::cpu(), MemCategory::grads);
  linear_ce_backward(1.0f, h, w, tg, {2, 2}, saved, d_h, d_w);
  ASSERT_TRUE(d_h.defined());
  EXPECT_EQ(d_h.shape(), (Shape{c.T, c.H}));
  EXPECT_EQ(d_h.dtype(), DType::f32);
  EXPECT_EQ(d_h.category(), MemCategory::activations);
}

// ---- memory accounting (the reason linear_ce exists) ----------------------------------------

TEST(LinearCe, LogitsPeakIsExactlyOneChunk) {
  const int64_t T = 64, V = 96, H = 8;
  const LossHeadConfig cfg{16, 32};  // full chunks: 4 x 3 of them
  HeadCase c = make_case(T, V, H, 121);
  Tensor h = Tensor::from_floats(c.h, {T, H}), w = Tensor::from_floats(c.w, {V, H});
  Tensor tg = Tensor::from_ints(c.targets, {T});
  Allocator& a = allocator_for(Device::cpu());
  ASSERT_EQ(a.stats().live_of(MemCategory::logits), 0) << "a logits tensor leaked from elsewhere";

  a.reset_peak();
  {
    LossHeadSaved saved;
    linear_ce_forward(h, w, tg, cfg, &saved);
    Tensor d_h, d_w = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
    linear_ce_backward(1.0f, h, w, tg, cfg, saved, d_h, d_w);
  }
  const int64_t linear_peak = a.stats().peak_of(MemCategory::logits);

  a.reset_peak();
  {
    LossHeadSaved saved;
    full_ce_forward(h, w, tg, &saved);
    Tensor d_h, d_w = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
    full_ce_backward(1.0f, h, w, tg, saved, d_h, d_w);
  }
  const int64_t full_peak = a.stats().peak_of(MemCategory::logits);
  EXPECT_EQ(a.stats().live_of(MemCategory::logits), 0);

  std::printf(
      "logits peak: linear_ce %lld bytes (chunk %lld x %lld x 4), full_ce %lld bytes "
      "(T x V x 4 = %lld)\n",
      static_cast<long long>(linear_peak), static_cast<long long>(cfg.chunk_tokens),
      static_cast<long long>(cfg.chunk_vocab), static_cast<long long>(full_peak),
      static_cast<long long>(T * V * 4));
  EXPECT_EQ(linear_peak, cfg.chunk_tokens * cfg.chunk_vocab * 4);
  EXPECT_EQ(linear_peak, linear_ce_logits_bytes(T, V, cfg));
  EXPECT_GE(full_peak, T * V * 4);
  EXPECT_EQ(full_peak, 2 * T * V * 4);  // saved logits + d_logits during the backward
  // Chunks larger than the problem are clamped to it.
  EXPECT_EQ(linear_ce_logits_bytes(T, V, LossHeadConfig{1000, 50}), T * 50 * 4);
}

// ---- linear_ce_fused: the one-pass training mode --------------------------------------------

LossHeadConfig fused_cfg(int64_t fused_chunk_tokens) {
  LossHeadConfig cfg;
  cfg.fused_chunk_tokens = fused_chunk_tokens;
  return cfg;
}

TEST(LinearCeFused, GradientsMatchFiniteDifferences) {
  for (int64_t ct : {3, 1, 7, 100}) {  // T = 7: divides, single rows, exact, clamped
    SCOPED_TRACE("fused_chunk_tokens " + std::to_string(ct));
    check_head_gradients(Head::fused, fused_cfg(ct));
  }
}

TEST(LinearCeFused, DefaultChunkIs2048Tokens) {
  EXPECT_EQ(LossHeadConfig{}.fused_chunk_tokens, 2048);
  // The bench shape: one [2048, 151936] f32 block, 1.16 GiB (full_ce holds 2 x [T, V] f32).
  EXPECT_EQ(linear_ce_fused_logits_bytes(32768, 151936, LossHeadConfig{}),
            int64_t{2048} * 151936 * 4);
  EXPECT_LE(linear_ce_fused_logits_bytes(32768, 151936, LossHeadConfig{}) * 16,
            int64_t{2} * 32768 * 151936 * 4);
}

// linear_ce_fused against full_ce (forward + backward) and against the two-pass linear_ce, for
// token chunks that do and do not divide T; masked targets; d_w accumulates onto nonzero values.
class LinearCeFusedVsFullCe : public ::testing::TestWithParam<int64_t> {};

TEST_P(LinearCeFusedVsFullCe, SameLossAndGradients) {
  const LossHeadConfig cfg = fused_cfg(GetParam());
  HeadCase c = make_case(36, 101, 16, 171, 5);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 172, 0.1f);
  const float scale = 1.0f / 30.0f;
  HeadOut f = run_head(Head::full, h, w, tg, scale, cfg, d_w0);
  HeadOut l = run_head(Head::linear, h, w, tg, scale, LossHeadConfig{5, 7}, d_w0);
  HeadOut u = run_head(Head::fused, h, w, tg, scale, cfg, d_w0);
  EXPECT_GT(u.r.num_valid, 0);
  EXPECT_LT(u.r.num_valid, c.T);  // some rows are masked
  EXPECT_EQ(u.r.num_valid, f.r.num_valid);
  EXPECT_NEAR(u.r.loss_sum, f.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
  EXPECT_NEAR(u.r.loss_sum, l.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
  EXPECT_LT(test::rel_error(u.d_h, f.d_h), 1e-5);
  EXPECT_LT(test::rel_error(u.d_h, l.d_h), 1e-5);
  const auto inc_u = minus(u.d_w, d_w0), inc_f = minus(f.d_w, d_w0);
  EXPECT_LT(test::rel_error(inc_u, inc_f), 1e-5);
  EXPECT_LT(test::rel_error(inc_u, minus(l.d_w, d_w0)), 1e-5);
  EXPECT_GT(test::rel_error(u.d_w, inc_u), 0.1);  // d_w0 is really there (+=, not =)
  for (int64_t t = 0; t < c.T; ++t)  // masked rows get no gradient
    if (c.targets[t] < 0)
      for (int64_t k = 0; k < c.H; ++k) ASSERT_EQ(u.d_h[t * c.H + k], 0.0f) << "row " << t;
}

INSTANTIATE_TEST_SUITE_P(Chunks, LinearCeFusedVsFullCe, ::testing::Values(36, 12, 7, 5, 1, 2048),
                         [](const ::testing::TestParamInfo<int64_t>& i) {
                           return "ct" + std::to_string(i.param);
                         });

TEST(LinearCeFused, Bf16InputsMatchFullCe) {
  HeadCase c = make_case(19, 53, 12, 181, 4);
  Tensor hb = Tensor::from_floats(c.h, {c.T, c.H}, DType::bf16);
  Tensor wb = Tensor::from_floats(c.w, {c.V, c.H}, DType::bf16);
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 182, 0.2f);
  for (DType dh_dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dh_dt));
    HeadOut f = run_head(Head::full, hb, wb, tg, 0.1f, {}, d_w0, dh_dt);
    HeadOut u = run_head(Head::fused, hb, wb, tg, 0.1f, fused_cfg(6), d_w0, dh_dt);
    EXPECT_EQ(u.r.num_valid, f.r.num_valid);
    EXPECT_NEAR(u.r.loss_sum, f.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
    // bf16 d_h: both round the same f32 values, up to GEMM blocking; allow one bf16 ulp.
    EXPECT_LT(test::rel_error(u.d_h, f.d_h), dh_dt == DType::f32 ? 1e-5 : 4e-3);
    EXPECT_LT(test::rel_error(minus(u.d_w, d_w0), minus(f.d_w, d_w0)), 1e-5);
  }
}

// overwrite_dw (the model's lazily zeroed lm_head gradient): d_w is written, whatever it held
// (NaN here), bitwise what accumulating into zeros gives; through the LossHead interface too,
// for both members.
TEST(LossHead, OverwriteDwIgnoresWhatDwHeld) {
  HeadCase c = make_case(23, 67, 12, 193);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  const float scale = 1.0f / 17.0f;
  LossHeadConfig cfg = fused_cfg(6);
  const std::vector<float> zeros(c.V * c.H, 0.0f), nans(c.V * c.H, std::nanf(""));
  const HeadOut ref = run_head(Head::fused, h, w, tg, scale, cfg, zeros);
  Tensor d_h = Tensor::empty({c.T, c.H}, DType::f32, Device::cpu(), MemCategory::activations);
  Tensor d_w = Tensor::from_floats(nans, {c.V, c.H});
  const LossResult r = linear_ce_fused(scale, h, w, tg, cfg, d_h, d_w, /*overwrite_dw=*/true);
  EXPECT_EQ(r.loss_sum, ref.r.loss_sum);
  EXPECT_EQ(d_h.to_floats(), ref.d_h);
  EXPECT_EQ(d_w.to_floats(), ref.d_w);
  for (auto make : {make_linear_ce_head, make_full_ce_head}) {
    const auto head = make(cfg);
    Tensor dh1, dh2;
    Tensor dw1 = Tensor::from_floats(zeros, {c.V, c.H}), dw2 = Tensor::from_floats(nans, {c.V, c.H});
    head->train(scale, h, w, tg, dh1, dw1, false);
    head->train(scale, h, w, tg, dh2, dw2, true);
    EXPECT_EQ(dw2.to_floats(), dw1.to_floats());
    EXPECT_EQ(dh2.to_floats(), dh1.to_floats());
  }
}

// primitives.loss_logits = "bf16": every linear_ce path takes the logits at bf16 precision. The
// reference is full_ce on explicitly bf16-rounded logits (the same softmax code, double sums), so
// the one-pass, the two-pass forward / backward and that reference agree to fp32 rounding; and
// the loss moves from the f32-logits one by about what rounding the logits does (|x| 2^-9), not
// more.
TEST(LinearCe, Bf16LogitsAreRoundedLogits) {
  HeadCase c = make_case(23, 67, 12, 191, 4, 1.5f);  // logits of a few units: rounding matters
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = test::randn(c.V * c.H, 192, 0.1f);
  const float scale = 1.0f / 17.0f;
  LossHeadConfig bf = fused_cfg(6);
  bf.chunk_tokens = 5;
  bf.chunk_vocab = 16;
  bf.bf16_logits = true;
  // The reference: logits = round_bf16(h w^T), then cross_entropy_forward / backward on them.
  Tensor logits = lm_head_logits(h, w);
  std::vector<float> lr = logits.to_floats();
  for (float& x : lr) x = round_bf16(x);
  Tensor rl = Tensor::from_floats(lr, {c.T, c.V});
  Tensor lse;
  const LossResult ref = cross_entropy_forward(rl, tg, &lse);
  Tensor d_logits = cross_entropy_backward(rl, tg, lse, scale);
  std::vector<double> ref_dh(c.T * c.H, 0.0), ref_dw(c.V * c.H, 0.0);
  const auto dl = d_logits.to_floats();
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t v = 0; v < c.V; ++v)
      for (int64_t k = 0; k < c.H; ++k) {
        ref_dh[t * c.H + k] += double(dl[t * c.V + v]) * c.w[v * c.H + k];
        ref_dw[v * c.H + k] += double(dl[t * c.V + v]) * c.h[t * c.H + k];
      }
  HeadOut u = run_head(Head::fused, h, w, tg, scale, bf, d_w0);
  HeadOut l = run_head(Head::linear, h, w, tg, scale, bf, d_w0);
  HeadOut f32 = run_head(Head::fused, h, w, tg, scale, fused_cfg(6), d_w0);
  for (const HeadOut* o : {&u, &l}) {
    EXPECT_EQ(o->r.num_valid, ref.num_valid);
    EXPECT_NEAR(o->r.loss_sum, ref.loss_sum, 1e-6 * std::fabs(ref.loss_sum));
    EXPECT_LT(test::rel_error(o->d_h, ref_dh), 1e-5);
    EXPECT_LT(test::rel_error(minus(o->d_w, d_w0), ref_dw), 1e-5);
  }
  // Against f32 logits: different (the option does something), within the rounding's reach.
  const double dloss = std::fabs(u.r.loss_sum - f32.r.loss_sum) / std::fabs(f32.r.loss_sum);
  EXPECT_GT(dloss, 1e-7);
  EXPECT_LT(dloss, 1e-2);
  EXPECT_LT(test::rel_error(u.d_h, f32.d_h), 5e-2);
  // Memory: 2 bytes a logit only where the block really is bf16 (bf16 operands on CUDA).
  EXPECT_EQ(linear_ce_fused_logits_bytes(c.T, c.V, bf, DType::bf16, true), 6 * c.V * 2);
  EXPECT_EQ(linear_ce_fused_logits_bytes(c.T, c.V, bf, DType::f32, true), 6 * c.V * 4);
  EXPECT_EQ(linear_ce_fused_logits_bytes(c.T, c.V, bf), 6 * c.V * 4);
  EXPECT_EQ(linear_ce_logits_bytes(c.T, c.V, bf), 5 * 16 * 4);  // the two-pass backward stays f32
}

TEST(LinearCeFused, LargeLogitsStayFinite) {
  HeadCase c = make_case(11, 31, 6, 81, 4, 40.0f);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  auto d_w0 = std::vector<float>(c.V * c.H, 0.0f);
  HeadOut f = run_head(Head::full, h, w, tg, 1.0f, {}, d_w0);
  HeadOut u = run_head(Head::fused, h, w, tg, 1.0f, fused_cfg(4), d_w0);
  ASSERT_TRUE(std::isfinite(u.r.loss_sum));
  EXPECT_GT(u.r.loss_sum, 10.0);
  EXPECT_NEAR(u.r.loss_sum, f.r.loss_sum, 1e-6 * std::fabs(f.r.loss_sum));
  for (float v : u.d_h) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LT(test::rel_error(u.d_h, f.d_h), 1e-5);
  EXPECT_LT(test::rel_error(u.d_w, f.d_w), 1e-5);
}

TEST(LinearCeFused, DhAllocatedWhenUndefined) {
  HeadCase c = make_case(5, 9, 3, 191);
  Tensor h = Tensor::from_floats(c.h, {c.T, c.H}), w = Tensor::from_floats(c.w, {c.V, c.H});
  Tensor tg = Tensor::from_ints(c.targets, {c.T});
  Tensor d_h, d_w = Tensor::zeros({c.V, c.H}, DType::f32, Device::cpu(), MemCategory::grads);
  const LossResult r = linear_ce_fused(1.0f, h, w, tg, fused_cfg(2), d_h, d_w);
  EXPECT_GT(r.num_valid, 0);
  ASSERT_TRUE(d_h.defined());
  EXPECT_EQ(d_h.shape(), (Shape{c.T, c.H}));
  EXPECT_EQ(d_h.dtype(), DType::f32);
  EXPECT_EQ(d_h.category(), MemCategory::activations);
}

TEST(LinearCeFused, LogitsPeakIsExactlyOneChunk) {
  const int64_t T = 64, V = 96, H = 8;
  HeadCase c = make_case(T, V, H, 201);
  Tensor h = Tensor::from_floats(c.h, {T, H}), w = Tensor::from_floats(c.w, {V, H});
  Tensor tg = Tensor::from_ints(c.targets, {T});
  Allocator& a = allocator_for(Device::cpu());
  ASSERT_EQ(a.stats().live_of(MemCategory::logits), 0) << "a logits tensor leaked from elsewhere";
  for (int64_t ct : {16, 24, 1000}) {  // divides T, does not, clamped to T
    SCOPED_TRACE("fused_chunk_tokens " + std::to_string(ct));
    const LossHeadConfig cfg = fused_cfg(ct);
    Tensor d_h, d_w = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
    a.reset_peak();
    linear_ce_fused(1.0f, h, w, tg, cfg, d_h, d_w);
    const int64_t peak = a.stats().peak_of(MemCategory::logits);
    EXPECT_EQ(peak, std::min<int64_t>(ct, T) * V * 4);  // one [ct, V] f32 block, nothing else
    EXPECT_EQ(peak, linear_ce_fused_logits_bytes(T, V, cfg));
    EXPECT_EQ(a.stats().live_of(MemCategory::logits), 0);
  }
}

TEST(LinearCeFused, BadInputsRaiseClearErrors) {
  const int64_t T = 6, V = 11, H = 4;
  HeadCase c = make_case(T, V, H, 211);
  Tensor h = Tensor::from_floats(c.h, {T, H}), w = Tensor::from_floats(c.w, {V, H});
  Tensor tg = Tensor::from_ints(c.targets, {T});
  Tensor d_h, d_w = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w, tg, fused_cfg(0), d_h, d_w); },
                              "linear_ce_fused: cfg.fused_chunk_tokens must be > 0, got 0");
  test::expect_error_contains(
      [&] { linear_ce_fused_logits_bytes(T, V, fused_cfg(-3)); },
      "linear_ce_fused_logits_bytes: cfg.fused_chunk_tokens must be > 0, got -3");
  auto bad = c.targets;
  bad[3] = static_cast<int32_t>(V);
  test::expect_error_contains(
      [&] { linear_ce_fused(1.0f, h, w, Tensor::from_ints(bad, {T}), {}, d_h, d_w); },
      "linear_ce_fused: targets[3] = 11 is out of range for vocab size 11");
  Tensor w_bad = Tensor::from_floats(test::randn(V * 5, 3), {V, 5});
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w_bad, tg, {}, d_h, d_w); },
                              "linear_ce_fused: hidden size mismatch");
  Tensor no_dw;
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w, tg, {}, d_h, no_dw); },
                              "linear_ce_fused: d_w is undefined");
  Tensor d_w_bad = Tensor::zeros({V + 1, H}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w, tg, {}, d_h, d_w_bad); },
                              "argument 'd_w' has shape [12, 4], expected [11, 4]");
  Tensor d_w_bf16 = Tensor::zeros({V, H}, DType::bf16, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w, tg, {}, d_h, d_w_bf16); },
                              "argument 'd_w' has dtype bf16, expected f32");
  Tensor d_h_bad = Tensor::zeros({T, H + 2}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains([&] { linear_ce_fused(1.0f, h, w, tg, {}, d_h_bad, d_w); },
                              "argument 'd_h' has shape [6, 6], expected [6, 4]");
  // Nothing above touched d_w (all checks come before any arithmetic).
  for (float v : d_w.to_floats()) ASSERT_EQ(v, 0.0f);
}

// ---- bad inputs ----------------------------------------------------------------------------

TEST(LossHead, BadInputsRaiseClearErrors) {
  const int64_t T = 6, V = 11, H = 4;
  HeadCase c = make_case(T, V, H, 131);
  Tensor h = Tensor::from_floats(c.h, {T, H}), w = Tensor::from_floats(c.w, {V, H});
  Tensor tg = Tensor::from_ints(c.targets, {T});
  const LossHeadConfig cfg{2, 3};

  auto bad = c.targets;
  bad[3] = static_cast<int32_t>(V);
  Tensor tg_bad = Tensor::from_ints(bad, {T});
  test::expect_error_contains([&] { full_ce_forward(h, w, tg_bad, nullptr); },
                              "full_ce_forward: targets[3] = 11 is out of range for vocab size 11");
  test::expect_error_contains([&] { linear_ce_forward(h, w, tg_bad, cfg, nullptr); },
                              "linear_ce_forward: targets[3] = 11 is out of range");
  test::expect_error_contains(
      [&] {
        cross_entropy_forward(Tensor::from_floats(test::randn(T * V, 1), {T, V}), tg_bad, nullptr);
      },
      "cross_entropy_forward: targets[3] = 11 is out of range");

  Tensor tg_f = Tensor::from_floats(test::randn(T, 2), {T});
  test::expect_error_contains([&] { full_ce_forward(h, w, tg_f, nullptr); },
                              "argument 'targets' has dtype f32, expected i32");
  test::expect_error_contains([&] { linear_ce_forward(h, w, tg_f, cfg, nullptr); },
                              "argument 'targets' has dtype f32, expected i32");
  test::expect_error_contains(
      [&] {
        linear_ce_forward(h, w, Tensor::from_ints({1, 2}, {2}), cfg, nullptr);
      },
      "argument 'targets' has shape [2], expected [6]");

  Tensor w_bad = Tensor::from_floats(test::randn(V * 5, 3), {V, 5});
  test::expect_error_contains(
      [&] { full_ce_forward(h, w_bad, tg, nullptr); },
      "full_ce_forward: hidden size mismatch: h is [6, 4] and w is [11, 5]");
  test::expect_error_contains([&] { linear_ce_forward(h, w_bad, tg, cfg, nullptr); },
                              "linear_ce_forward: hidden size mismatch");

  Tensor h0 = Tensor::empty({0, H}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor tg0 = Tensor::from_ints({}, {0});
  test::expect_error_contains([&] { full_ce_forward(h0, w, tg0, nullptr); },
                              "full_ce_forward: empty batch (T = 0 tokens)");
  test::expect_error_contains([&] { linear_ce_forward(h0, w, tg0, cfg, nullptr); },
                              "linear_ce_forward: empty batch (T = 0 tokens)");
  test::expect_error_contains(
      [&] {
        cross_entropy_forward(Tensor::empty({0, V}, DType::f32, Device::cpu(), MemCategory::other),
                              tg0, nullptr);
      },
      "cross_entropy_forward: empty batch");

  test::expect_error_contains(
      [&] {
        linear_ce_forward(h, w, tg, {0, 3}, nullptr);
      },
      "linear_ce_forward: cfg.chunk_tokens must be > 0, got 0");
  test::expect_error_contains(
      [&] {
        linear_ce_forward(h, w, tg, {2, -1}, nullptr);
      },
      "linear_ce_forward: cfg.chunk_vocab must be > 0, got -1");

  // Backward misuse.
  LossHeadSaved lin;
  linear_ce_forward(h, w, tg, cfg, &lin);
  Tensor d_h, d_w = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { full_ce_backward(1.0f, h, w, tg, lin, d_h, d_w); },
                              "full_ce_backward: saved.logits is undefined");
  test::expect_error_contains(
      [&] { linear_ce_backward(1.0f, h, w, tg, cfg, LossHeadSaved{}, d_h, d_w); },
      "linear_ce_backward: saved.lse is undefined");
  test::expect_error_contains(
      [&] {
        linear_ce_backward(1.0f, h, w, tg, {-2, 3}, lin, d_h, d_w);
      },
      "linear_ce_backward: cfg.chunk_tokens must be > 0, got -2");
  Tensor d_w_bad = Tensor::zeros({V, H + 1}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_backward(1.0f, h, w, tg, cfg, lin, d_h, d_w_bad); },
                              "argument 'd_w' has shape [11, 5], expected [11, 4]");
  Tensor d_w_bf16 = Tensor::zeros({V, H}, DType::bf16, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_backward(1.0f, h, w, tg, cfg, lin, d_h, d_w_bf16); },
                              "argument 'd_w' has dtype bf16, expected f32");
  Tensor logits = Tensor::from_floats(test::randn(T * V, 4), {T, V});
  test::expect_error_contains(
      [&] {
        cross_entropy_backward(logits, tg, Tensor::from_floats({1, 2}, {2}), 1.0f);
      },
      "cross_entropy_backward: argument 'lse' has shape [2], expected [6]");
}

}  // namespace
}  // namespace bb

// AdamW against a double-precision transcription of torch.optim.AdamW; grad norm and clipping;
// the bf16-moment variant (adamw_bf16_moments): its stochastic rounding, its step against a
// double reference that rounds the same way, layout independence, and why not round-to-nearest;
// the split master ([backend] master_storage = "split"): its halves, and the fp32 master it keeps
// bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "common/testing.h"
#include "primitives/optim/adamw.h"
#include "primitives/optim/moment_rounding.h"

namespace bb {
namespace {

TEST(AdamW, MatchesDoubleReferenceOverSteps) {
  const int64_t n = 37;
  auto p0 = test::randn(n, 1);
  Tensor master = Tensor::from_floats(p0, {n}, DType::f32, MemCategory::optimizer);
  Tensor m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor model = Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params);
  std::vector<double> P = test::cast<double>(p0), M(n, 0), Vv(n, 0);
  AdamWConfig cfg{0.9, 0.95, 1e-8};
  const double wd = 0.1;
  for (int step = 1; step <= 5; ++step) {
    const double lr = 1e-2 / step;
    auto g = test::randn(n, 100 + step);
    adamw_step(master, Tensor::from_floats(g, {n}), m, v, step, lr, wd, cfg, &model);
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    for (int64_t i = 0; i < n; ++i) {
      P[i] *= 1 - lr * wd;
      M[i] = 0.9 * M[i] + 0.1 * g[i];
      Vv[i] = 0.95 * Vv[i] + 0.05 * double(g[i]) * g[i];
      P[i] -= lr / bc1 * M[i] / (std::sqrt(Vv[i]) / std::sqrt(bc2) + 1e-8);
    }
  }
  EXPECT_LT(test::rel_error(master.to_floats(), P), 1e-6);
  auto mv = model.to_floats(), pv = master.to_floats();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(mv[i], round_bf16(pv[i]));  // written in the same pass
}

TEST(AdamW, FirstStepIsSignedLr) {
  // With zero moments, step 1 moves each weight by lr * g/|g| (up to eps), whatever |g|.
  Tensor p = Tensor::from_floats({1, 1, 1}, {3}, DType::f32, MemCategory::optimizer);
  Tensor m = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor v = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  adamw_step(p, Tensor::from_floats({1e-3f, -5.0f, 100.0f}, {3}), m, v, 1, 0.1, 0.0, {}, nullptr);
  auto r = p.to_floats();
  EXPECT_NEAR(r[0], 0.9, 1e-5);
  EXPECT_NEAR(r[1], 1.1, 1e-5);
  EXPECT_NEAR(r[2], 0.9, 1e-5);
}

TEST(AdamW, GradScaleEqualsPrescaledGradient) {
  // Clipping folded into the update: grad_scale s on g gives bit-for-bit the step on s * g, and
  // leaves g untouched.
  const int64_t n = 33;
  const auto g0 = test::randn(n, 7);
  const float s = 0.37f;
  std::vector<float> scaled(g0);
  for (float& x : scaled) x *= s;
  Tensor p1 = Tensor::from_floats(test::randn(n, 8), {n}), p2 = p1.clone(MemCategory::optimizer);
  Tensor m1 = Tensor::from_floats(test::randn(n, 9, 0.1f), {n}), m2 = m1.clone(MemCategory::optimizer);
  Tensor v1 = Tensor::from_floats(test::randu(n, 10, 0.0f, 0.01f), {n}), v2 = v1.clone(MemCategory::optimizer);
  Tensor g = Tensor::from_floats(g0, {n});
  AdamWConfig scaled_cfg;
  scaled_cfg.grad_scale = s;
  adamw_step(p1, g, m1, v1, 3, 1e-2, 0.1, scaled_cfg, nullptr);
  adamw_step(p2, Tensor::from_floats(scaled, {n}), m2, v2, 3, 1e-2, 0.1, {}, nullptr);
  EXPECT_EQ(p1.to_floats(), p2.to_floats());
  EXPECT_EQ(m1.to_floats(), m2.to_floats());
  EXPECT_EQ(v1.to_floats(), v2.to_floats());
  EXPECT_EQ(g.to_floats(), g0);
  scaled_cfg.grad_scale = -1;
  test::expect_error_contains([&] { adamw_step(p1, g, m1, v1, 4, 1e-2, 0.1, scaled_cfg, nullptr); },
                              "grad_scale must be finite and >= 0");
}

TEST(GradNorm, GlobalNormAndScale) {
  auto a = test::randn(10, 1), b = test::randn(7, 2);
  double ref = 0;
  for (float x : a) ref += double(x) * x;
  for (float x : b) ref += double(x) * x;
  std::vector<Tensor> gs = {Tensor::from_floats(a, {10}), Tensor::from_floats(b, {7}, DType::bf16)};
  // bf16 rounding of b changes the norm slightly; compare against that rounding.
  double ref16 = 0;
  for (float x : a) ref16 += double(x) * x;
  for (float x : b) ref16 += double(round_bf16(x)) * round_bf16(x);
  EXPECT_NEAR(global_grad_norm(gs), std::sqrt(ref16), 1e-9 * std::sqrt(ref));
  scale_inplace(gs[0], 0.5f);
  EXPECT_NEAR(sum_of_squares(gs[0]), 0.25 * sum_of_squares(Tensor::from_floats(a, {10})), 1e-9);
  // Into a slot (f64 bits in i64 storage): the same double; a slot outside is an error.
  Tensor slots = Tensor::zeros({3}, DType::i64, Device::cpu(), MemCategory::other);
  sum_of_squares_to(gs[1], slots, 2);
  double got = 0;
  std::memcpy(&got, slots.data<int64_t>() + 2, sizeof(double));
  EXPECT_EQ(got, sum_of_squares(gs[1]));
  EXPECT_EQ(slots.data<int64_t>()[0], 0);
  test::expect_error_contains([&] { sum_of_squares_to(gs[1], slots, 3); }, "outside the 3 slots");
  // Over listed rows (a gradient zero elsewhere): on the CPU the full sum; bad lists are refused.
  sum_of_squares_rows_to(gs[0], slots, 1, {0, 3}, 3);
  std::memcpy(&got, slots.data<int64_t>() + 1, sizeof(double));
  EXPECT_EQ(got, sum_of_squares(gs[0]));
  test::expect_error_contains([&] { sum_of_squares_rows_to(gs[0], slots, 1, {1, 1}, 3); }, "strictly increasing");
  test::expect_error_contains([&] { sum_of_squares_rows_to(gs[0], slots, 1, {4}, 3); }, "outside the 4 rows of 3");
  test::expect_error_contains([&] { sum_of_squares_rows_to(gs[0], slots, 1, {0}, 0); }, "row_len must be > 0");
}

TEST(AdamW, BadInput) {
  Tensor p = Tensor::zeros({3}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor g = Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { adamw_step(p, g, p, p, 1, 0.1, 0, {}, nullptr); }, "sizes differ");
  test::expect_error_contains([&] { adamw_step(p, p, p, p, 0, 0.1, 0, {}, nullptr); }, "step is 1-based");
}

// The update with its gradient's sum of squares (one pass on a GPU): the sum is what
// sum_of_squares_to writes, and the update is adamw_step with weight decay on [0, decay_numel)
// only (the bf16 moments' random bits follow the element index across the cut).
TEST(AdamW, StepWithSumOfSquaresIsTheTwoCalls) {
  const int64_t n = 37, cut = 21;
  for (DType md : {DType::f32, DType::bf16}) {
    auto state = [&](uint64_t seed) {
      return std::vector<Tensor>{Tensor::from_floats(test::randn(n, seed), {n}, DType::f32, MemCategory::optimizer),
                                 Tensor::from_floats(test::randn(n, seed + 1, 0.1f), {n}, md, MemCategory::optimizer),
                                 Tensor::from_floats(test::randu(n, seed + 2, 0.f, 0.01f), {n}, md,
                                                     MemCategory::optimizer),
                                 Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params)};
    };
    std::vector<Tensor> a = state(40), b = state(40);
    const Tensor g = Tensor::from_floats(test::randn(n, 50), {n}, DType::f32, MemCategory::grads);
    AdamWConfig cfg{0.9, 0.95, 1e-8};
    cfg.seed = 7;
    cfg.stream = 3;
    Tensor slots = Tensor::zeros({2}, DType::i64, Device::cpu(), MemCategory::other);
    adamw_step_sum_squares(a[0], g, a[1], a[2], 2, 1e-2, 0.1, cut, cfg, &a[3], nullptr, slots, 1);
    // The reference: each element alone, with its own decay and random-bit index.
    for (int64_t i = 0; i < n; ++i) {
      Tensor p = b[0].narrow(i, 1), m = b[1].narrow(i, 1), v = b[2].narrow(i, 1), w = b[3].narrow(i, 1);
      AdamWConfig c = cfg;
      c.first_element = i;
      adamw_step(p, g.narrow(i, 1), m, v, 2, 1e-2, i < cut ? 0.1 : 0.0, c, &w);
    }
    for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k].to_floats(), b[k].to_floats()) << "tensor " << k;
    double got = 0;
    std::memcpy(&got, slots.data<int64_t>() + 1, sizeof(double));
    EXPECT_EQ(got, sum_of_squares(g));
    EXPECT_NE(a[0].to_floats(), state(40)[0].to_floats());  // it did update
  }
  std::vector<Tensor> t = {Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::optimizer)};
  Tensor slots = Tensor::zeros({2}, DType::i64, Device::cpu(), MemCategory::other);
  test::expect_error_contains(
      [&] { adamw_step_sum_squares(t[0], t[0], t[0], t[0], 1, 0.1, 0, 5, {}, nullptr, nullptr, slots, 0); },
      "decay_numel 5 is outside [0, 4]");
  test::expect_error_contains(
      [&] { adamw_step_sum_squares(t[0], t[0], t[0], t[0], 1, 0.1, 0, 4, {}, nullptr, nullptr, slots, 2); },
      "outside the 2 slots");
  Tensor g5 = Tensor::zeros({5}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains(
      [&] { adamw_step_sum_squares(t[0], g5, t[0], t[0], 1, 0.1, 0, 4, {}, nullptr, nullptr, slots, 0); },
      "sizes differ: master 4, grad 5");
}

// The update of chosen rows (the embedding's rows a step did not touch, then the ones it did):
// two calls over complementary row sets are bitwise the whole-unit update (weight decay cut
// inside a row, the padding as a last, shorter row, bf16 moments' random bits by element
// index); a call reads and writes nothing outside its rows (NaN gradients there change nothing).
TEST(AdamW, StepRowsIsTheWholeUpdateOnThoseRows) {
  const int64_t row_len = 6, n = 7 * row_len + 5, cut = 20;  // 8 rows, the last one 5 elements
  for (DType md : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(md));
    auto state = [&] {
      return std::vector<Tensor>{Tensor::from_floats(test::randn(n, 60), {n}, DType::f32, MemCategory::optimizer),
                                 Tensor::from_floats(test::randn(n, 61, 0.1f), {n}, md, MemCategory::optimizer),
                                 Tensor::from_floats(test::randu(n, 62, 0.f, 0.01f), {n}, md, MemCategory::optimizer),
                                 Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params)};
    };
    const Tensor g = Tensor::from_floats(test::randn(n, 63), {n}, DType::f32, MemCategory::grads);
    AdamWConfig cfg{0.9, 0.95, 1e-8};
    cfg.seed = 9;
    cfg.stream = 4;
    std::vector<Tensor> whole = state(), split = state(), init = state();
    Tensor slots = Tensor::zeros({1}, DType::i64, Device::cpu(), MemCategory::other);
    adamw_step_sum_squares(whole[0], g, whole[1], whole[2], 3, 1e-2, 0.1, cut, cfg, &whole[3], nullptr, slots, 0);
    // First the rows {1, 4, 5, 6} with NaN gradients everywhere else: nothing else may move.
    Tensor g_nan = g.clone();
    const std::vector<int32_t> first = {1, 4, 5, 6}, second = {0, 2, 3, 7};
    for (int32_t r : second)
      for (int64_t e = r * row_len; e < std::min(n, (r + 1) * row_len); ++e) g_nan.data<float>()[e] = NAN;
    Tensor flag = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
    adamw_step_rows(split[0], g_nan, split[1], split[2], 3, 1e-2, 0.1, cut, cfg, &split[3], &flag, first, row_len);
    EXPECT_EQ(flag.to_ints()[0], 0);
    for (size_t k = 0; k < split.size(); ++k) {
      const std::vector<float> got = split[k].to_floats(), before = init[k].to_floats(), want = whole[k].to_floats();
      for (int64_t e = 0; e < n; ++e) {
        const bool listed = std::find(first.begin(), first.end(), e / row_len) != first.end();
        EXPECT_EQ(got[e], listed ? want[e] : before[e]) << "tensor " << k << " element " << e;
      }
    }
    adamw_step_rows(split[0], g, split[1], split[2], 3, 1e-2, 0.1, cut, cfg, &split[3], &flag, second, row_len);
    for (size_t k = 0; k < split.size(); ++k) EXPECT_EQ(split[k].to_floats(), whole[k].to_floats()) << "tensor " << k;
    EXPECT_NE(whole[0].to_floats(), init[0].to_floats());
  }
  Tensor t = Tensor::zeros({10}, DType::f32, Device::cpu(), MemCategory::optimizer);
  auto call = [&](const std::vector<int32_t>& rows, int64_t row_len) {
    adamw_step_rows(t, t, t, t, 1, 0.1, 0, 10, {}, nullptr, nullptr, rows, row_len);
  };
  test::expect_error_contains([&] { call({0, 4}, 3); }, "row 4 (entry 1) is outside the unit's 4 rows of 3 elements");
  test::expect_error_contains([&] { call({2, 1}, 3); }, "rows must be strictly increasing");
  test::expect_error_contains([&] { call({1, 1}, 3); }, "entry 1 is 1 after 1");
  test::expect_error_contains([&] { call({-1}, 3); }, "row -1 (entry 0)");
  test::expect_error_contains([&] { call({0}, 0); }, "row_len must be > 0");
  test::expect_error_contains([&] { adamw_step_rows(t, t, t, t, 1, 0.1, 0, 11, {}, nullptr, nullptr, {0}, 5); },
                              "decay_numel 11 is outside [0, 10]");
}

// The non-finite flag of the AdamW pass: set when an update overflows f32, left alone otherwise
// (and never cleared); mark_nonfinite flags exactly the tensors holding Inf or NaN.
TEST(AdamW, NonFiniteFlagIsSetByTheUpdateOnly) {
  const int64_t n = 33;
  for (double lr : {1e-2, 1e39}) {
    Tensor master = Tensor::from_floats(test::randn(n, 3), {n}, DType::f32, MemCategory::optimizer);
    Tensor m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
    Tensor v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
    Tensor flag = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
    adamw_step(master, Tensor::from_floats(test::randn(n, 4), {n}), m, v, 1, lr, 0.0, AdamWConfig{}, nullptr, &flag);
    EXPECT_EQ(flag.to_ints()[0], lr > 1e38 ? 1 : 0) << "lr " << lr;
    bool any = false;
    for (float x : master.to_floats()) any |= !std::isfinite(x);
    EXPECT_EQ(any, lr > 1e38);
  }
  std::vector<Tensor> ts = {Tensor::from_floats({1, 2, 3}, {3}), Tensor::from_floats({1, NAN}, {2}, DType::bf16),
                            Tensor::from_floats({INFINITY}, {1}), Tensor::from_floats({0, 0}, {2}, DType::bf16)};
  Tensor flags = Tensor::zeros({4}, DType::i32, Device::cpu(), MemCategory::workspace);
  mark_nonfinite(ts, flags);
  EXPECT_EQ(flags.to_ints(), (std::vector<int32_t>{0, 1, 1, 0}));
  Tensor wrong = Tensor::zeros({3}, DType::i32, Device::cpu(), MemCategory::workspace);
  test::expect_error_contains([&] { mark_nonfinite(ts, wrong); }, "4 tensors but 3 flags");
}

// ---- bf16 moments ---------------------------------------------------------------------------

float bits_to_float(uint16_t h) { return bf16_to_f32(h); }

// The stochastic rounding of a double y with 16 random bits r, written from the definition:
// y lies between the bf16 values lo <= |y| < lo + ulp; it rounds to lo + ulp when
// frac * 2^16 + r >= 2^16, frac = (|y| - lo) / ulp, so with r uniform the result's mean is y.
double sr_reference(double y, uint32_t r) {
  if (y == 0) return 0;
  int e = 0;
  const double mant = std::frexp(std::fabs(y), &e);  // |y| = mant 2^e, mant in [0.5, 1)
  const double scaled = mant * 256.0;                // 8 significant bits: [128, 256)
  const double lo = std::floor(scaled), frac = scaled - lo;
  const bool up = frac * 65536.0 + static_cast<double>(r & 0xffffu) >= 65536.0;
  return std::copysign(std::ldexp(lo + (up ? 1.0 : 0.0), e - 8), y);
}

// Every r in [0, 2^16): exactly (dropped bits) of them round up, so the mean over all r is x
// exactly; values that are bf16 already never move; the result is always one of the two bf16
// neighbours; sign-symmetric; Inf and NaN kept.
TEST(Bf16Moments, StochasticRoundingIsExactlyUnbiasedOverItsRandomBits) {
  std::vector<float> xs = test::randn(40, 71, 3.0f);
  xs.push_back(1.0f + 0x1234p-23f);
  xs.push_back(-0.0078125f * (1.0f + 0x7fffp-23f));
  xs.push_back(1e-30f);
  xs.push_back(6.5e4f);
  for (float x : xs) {
    SCOPED_TRACE(x);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t dropped = u & 0xffffu;
    const float lo = bits_to_float(static_cast<uint16_t>(u >> 16));
    const float hi = bits_to_float(static_cast<uint16_t>((u >> 16) + 1));
    double sum = 0;
    uint32_t ups = 0;
    for (uint32_t r = 0; r < 65536; ++r) {
      const float y = bits_to_float(f32_to_bf16_stochastic(x, r));
      ASSERT_TRUE(y == lo || y == hi) << "r " << r << " gave " << y;
      ups += y == hi;
      sum += y;  // exact in double: 65536 values of 8 significant bits
      ASSERT_EQ(bits_to_float(f32_to_bf16_stochastic(-x, r)), -y);
      ASSERT_EQ(static_cast<double>(y), sr_reference(x, r)) << "r " << r;
    }
    EXPECT_EQ(ups, dropped);
    EXPECT_EQ(sum / 65536.0, static_cast<double>(x));  // E[round(x)] = x, exactly
    const float b = round_bf16(x);  // a bf16 value: never moved, whatever r
    for (uint32_t r : {0u, 1u, 0x8000u, 0xffffu}) EXPECT_EQ(bits_to_float(f32_to_bf16_stochastic(b, r)), b);
  }
  for (uint32_t r : {0u, 0xffffu}) {
    EXPECT_EQ(bits_to_float(f32_to_bf16_stochastic(INFINITY, r)), INFINITY);
    EXPECT_EQ(bits_to_float(f32_to_bf16_stochastic(-INFINITY, r)), -INFINITY);
    EXPECT_TRUE(std::isnan(bits_to_float(f32_to_bf16_stochastic(NAN, r))));
    // A NaN whose payload sits in the dropped bits only is still a NaN.
    uint32_t nan_bits = 0x7f800001u;
    float low_nan;
    std::memcpy(&low_nan, &nan_bits, 4);
    EXPECT_TRUE(std::isnan(bits_to_float(f32_to_bf16_stochastic(low_nan, r))));
    EXPECT_TRUE(bf16_bits_nonfinite(f32_to_bf16_stochastic(low_nan, r)));
  }
  // The random words the optimizer uses: over many elements of one stream the mean of the
  // roundings of one value approaches it (4 sigma of sqrt(p (1 - p) / K) ulps).
  const float x = 1.0f + 0x5555p-23f;  // p = 0x5555 / 2^16 = 1/3 of an ulp up
  const int K = 1 << 16;
  double mean = 0;
  for (int e = 0; e < K; ++e)
    mean += bits_to_float(f32_to_bf16_stochastic(x, moment_rounding_word(moment_rounding_key(7, 3, 1), e) >> 16));
  mean /= K;
  const double ulp = 0x1p-7, p = 0x5555 / 65536.0;
  EXPECT_NEAR(mean, x, 4 * ulp * std::sqrt(p * (1 - p) / K));
}

struct Bf16State {
  Tensor master, m, v;
};

Bf16State bf16_state(int64_t n, uint64_t seed) {
  Bf16State s;
  s.master = Tensor::from_floats(test::randn(n, seed), {n}, DType::f32, MemCategory::optimizer);
  s.m = Tensor::from_floats(test::randn(n, seed + 1, 0.1f), {n}, DType::bf16, MemCategory::optimizer);
  s.v = Tensor::from_floats(test::randu(n, seed + 2, 0.0f, 0.02f), {n}, DType::bf16, MemCategory::optimizer);
  return s;
}

std::vector<uint16_t> bf16_bits(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  std::memcpy(out.data(), t.data<uint16_t>(), out.size() * 2);
  return out;
}

// Six steps (weight decay, a clipped step with grad_scale, a bf16 model copy, a bucket that
// starts at element 5 of its stream) against a double-precision transcription that stores the
// moments with the same stochastic rounding (same words, threshold computed from the double
// value). The f32 path's pre-rounding value differs from the double one by a few f32 ulps, i.e.
// ~2^-16 of the rounding step, so an element lands on the other bf16 neighbour with probability
// ~1e-4 per store; the check allows 0.2% of the stored moments one bf16 ulp off. A kernel that
// rounded to nearest (about half of the moments off) or dropped a moment update fails it.
TEST(Bf16Moments, MatchesDoubleReferenceWithTheSameRounding) {
  const int64_t n = 4099;
  Bf16State s = bf16_state(n, 21);
  Tensor model = Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::params);
  std::vector<double> P = test::cast<double>(s.master.to_floats()), M = test::cast<double>(s.m.to_floats()),
                      V = test::cast<double>(s.v.to_floats());
  AdamWConfig cfg{0.9, 0.95, 1e-8};
  cfg.seed = 1234;
  cfg.stream = 99;
  cfg.first_element = 5;
  const double wd = 0.1;
  for (int step = 1; step <= 6; ++step) {
    const double lr = 1e-2 / step;
    cfg.grad_scale = step == 3 ? 0.37 : 1.0;
    auto g = test::randn(n, 300 + step);
    adamw_step(s.master, Tensor::from_floats(g, {n}), s.m, s.v, step, lr, wd, cfg, &model);
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    const uint64_t key = moment_rounding_key(cfg.seed, cfg.stream, step);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(static_cast<float>(cfg.grad_scale)) * g[i];
      P[i] *= 1 - lr * wd;
      const double mi = 0.9 * M[i] + 0.1 * gi, vi = 0.95 * V[i] + 0.05 * gi * gi;
      P[i] -= lr / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + 1e-8);
      const uint32_t w = moment_rounding_word(key, static_cast<uint64_t>(cfg.first_element + i));
      M[i] = sr_reference(mi, w);
      V[i] = sr_reference(vi, w >> 16);
    }
  }
  EXPECT_LT(test::rel_error(s.master.to_floats(), P), 1e-6);
  int64_t off = 0;
  for (const auto& [t, R] : {std::pair<const Tensor*, const std::vector<double>*>{&s.m, &M}, {&s.v, &V}}) {
    const std::vector<float> got = t->to_floats();
    for (int64_t i = 0; i < n; ++i) {
      if (static_cast<double>(got[i]) == (*R)[i]) continue;
      ++off;
      EXPECT_LE(std::fabs(got[i] - (*R)[i]), 0x1p-7 * std::fabs((*R)[i])) << "element " << i << " more than 1 ulp off";
    }
  }
  EXPECT_LE(off, 2 * n / 500) << off << " of " << 2 * n << " moments differ from the reference's rounding";
  std::printf("[bf16 moments] %lld of %lld stored moments one bf16 ulp from the double reference's rounding\n",
              static_cast<long long>(off), static_cast<long long>(2 * n));
  auto mv = model.to_floats(), pv = s.master.to_floats();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(mv[i], round_bf16(pv[i]));  // written in the same pass
}

// Layout independence: one call over [0, n) equals two calls over [0, k) and [k, n) (first_element
// 0 and k, k not a multiple of the 4-element Philox block) bit for bit; another seed, stream or
// step changes the roundings.
TEST(Bf16Moments, SameBitsWhateverTheSplitAndKeyedOnSeedStreamStep) {
  const int64_t n = 1001, k = 7 * 53;
  const auto g = test::randn(n, 41);
  AdamWConfig cfg;
  cfg.seed = 5;
  cfg.stream = 6;
  Bf16State whole = bf16_state(n, 42), split = bf16_state(n, 42);
  adamw_step(whole.master, Tensor::from_floats(g, {n}), whole.m, whole.v, 3, 1e-2, 0.1, cfg, nullptr);
  const Tensor gt = Tensor::from_floats(g, {n});
  for (auto [lo, len] : {std::pair<int64_t, int64_t>{0, k}, {k, n - k}}) {
    Tensor p = split.master.narrow(lo, len), m = split.m.narrow(lo, len), v = split.v.narrow(lo, len);
    AdamWConfig c = cfg;
    c.first_element = lo;
    adamw_step(p, gt.narrow(lo, len), m, v, 3, 1e-2, 0.1, c, nullptr);
  }
  EXPECT_EQ(split.master.to_floats(), whole.master.to_floats());
  EXPECT_EQ(bf16_bits(split.m), bf16_bits(whole.m));
  EXPECT_EQ(bf16_bits(split.v), bf16_bits(whole.v));
  // Another key: the fp32 values are the same, about a third of the roundings differ.
  for (int which = 0; which < 3; ++which) {
    Bf16State o = bf16_state(n, 42);
    AdamWConfig c = cfg;
    int64_t step = 3;
    if (which == 0) c.seed = 50;
    if (which == 1) c.stream = 60;
    if (which == 2) step = 4;
    adamw_step(o.master, gt, o.m, o.v, step, 1e-2, 0.1, c, nullptr);
    const auto a = bf16_bits(o.m), b = bf16_bits(whole.m);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += a[i] != b[i];
    if (which < 2) EXPECT_GT(differ, n / 10) << "changing the " << (which ? "stream" : "seed") << " changed nothing";
    else EXPECT_GT(differ, 0);  // another step: other bias correction and other bits
  }
}

// Why stochastic rounding: with beta2 = 0.999 and no gradient, v should decay as 0.999^t. Round-
// to-nearest cannot store the first step (0.999 rounds back to 1: the bf16 spacing below 1 is
// 2^-8 > 0.001), so v never decreases; the stochastic rounding's mean follows 0.999^t. After
// t = 693 steps the true value is 0.4998; the mean over 4096 elements (rounding noise of at most
// 2^-8 / sqrt(1 - beta2^2) = 8.7% per element, 0.14% in the mean) is within 1%.
TEST(Bf16Moments, SecondMomentDecaysWhereRoundToNearestStalls) {
  const int64_t n = 4096, T = 693;
  Tensor p = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor m = Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::optimizer);
  Tensor v = Tensor::zeros({n}, DType::bf16, Device::cpu(), MemCategory::optimizer);
  v.fill_(1.0);
  const Tensor g = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::grads);
  AdamWConfig cfg{0.9, 0.999, 1e-8};
  cfg.seed = 3;
  float nearest = 1.0f;
  for (int64_t t = 1; t <= T; ++t) {
    adamw_step(p, g, m, v, t, 1e-3, 0.0, cfg, nullptr);
    nearest = round_bf16(0.999f * nearest);
  }
  EXPECT_EQ(nearest, 1.0f) << "round-to-nearest was expected to stall";
  double mean = 0;
  for (float x : v.to_floats()) mean += x;
  mean /= n;
  EXPECT_NEAR(mean, std::pow(0.999, T), 0.01 * std::pow(0.999, T));
  for (float x : p.to_floats()) EXPECT_EQ(x, 0.0f);  // m stayed 0: no update
}

TEST(Bf16Moments, GradScaleNonFiniteFlagAndBadInput) {
  const int64_t n = 33;
  const auto g0 = test::randn(n, 7);
  const float sc = 0.37f;
  std::vector<float> scaled(g0);
  for (float& x : scaled) x *= sc;
  Bf16State a = bf16_state(n, 8), b = bf16_state(n, 8);
  AdamWConfig scaled_cfg;
  scaled_cfg.grad_scale = sc;
  scaled_cfg.seed = 1;
  AdamWConfig plain;
  plain.seed = 1;
  const Tensor g = Tensor::from_floats(g0, {n});
  adamw_step(a.master, g, a.m, a.v, 3, 1e-2, 0.1, scaled_cfg, nullptr);
  adamw_step(b.master, Tensor::from_floats(scaled, {n}), b.m, b.v, 3, 1e-2, 0.1, plain, nullptr);
  EXPECT_EQ(a.master.to_floats(), b.master.to_floats());
  EXPECT_EQ(bf16_bits(a.m), bf16_bits(b.m));
  EXPECT_EQ(bf16_bits(a.v), bf16_bits(b.v));
  EXPECT_EQ(g.to_floats(), g0);
  // The flag: set by an update that overflows (and only then).
  for (double lr : {1e-2, 1e39}) {
    Bf16State s = bf16_state(n, 9);
    Tensor flag = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
    adamw_step(s.master, g, s.m, s.v, 1, lr, 0.0, plain, nullptr, &flag);
    EXPECT_EQ(flag.to_ints()[0], lr > 1e38 ? 1 : 0) << "lr " << lr;
  }
  {  // a moment that overflows: (1 - b2) g^2 is Inf in fp32, so v is stored as Inf and flagged
    Bf16State s = bf16_state(n, 10);
    Tensor flag = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace);
    std::vector<float> big(n, 1.0f);
    big[17] = 3e20f;
    adamw_step(s.master, Tensor::from_floats(big, {n}), s.m, s.v, 1, 1e-3, 0.0, plain, nullptr, &flag);
    EXPECT_EQ(flag.to_ints()[0], 1);
    EXPECT_TRUE(std::isinf(s.v.to_floats()[17]));
  }
  Bf16State s = bf16_state(n, 11);
  Tensor v32 = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  test::expect_error_contains([&] { adamw_step(s.master, g, s.m, v32, 1, 0.1, 0, plain, nullptr); },
                              "exp_avg is bf16 but exp_avg_sq is f32; both moments have one dtype");
  Tensor mi = Tensor::zeros({n}, DType::i32, Device::cpu(), MemCategory::optimizer);
  test::expect_error_contains([&] { adamw_step(s.master, g, mi, mi, 1, 0.1, 0, plain, nullptr); },
                              "expected f32 (adamw) or bf16 (adamw_bf16_moments)");
  AdamWConfig neg = plain;
  neg.first_element = -1;
  test::expect_error_contains([&] { adamw_step(s.master, g, s.m, s.v, 1, 0.1, 0, neg, nullptr); },
                              "first_element must be >= 0");
}


// ---- the split master ([backend] master_storage = "split") --------------------------------------

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Every fp32 bit pattern is (hi << 16) + lo exactly; hi is the value rounded to nearest bf16
// with ties away from zero: round-to-nearest-even's except when the dropped half is 0x8000
// and the kept half is even (then one ulp further from zero).
TEST(SplitMaster, HalvesHoldEveryBitPatternAndRoundTiesAway) {
  std::vector<uint32_t> pats = {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0x80000000u, 0x00000000u,
                                0x7F7FFFFFu, 0x7F7F8000u, 0xFF7F8000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                0xFFFF8000u, 0xFFFFFFFFu, 0x00008000u, 0x80018000u, 0xBF808000u, 0x0000FFFFu};
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 200000; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    pats.push_back(static_cast<uint32_t>(x));
    pats.push_back((static_cast<uint32_t>(x) & 0xFFFF0000u) | 0x8000u);  // ties
  }
  int ties_away = 0;
  for (uint32_t b : pats) {
    const uint16_t hi = split_master_hi(b);
    const int16_t lo = split_master_lo(b, hi);
    ASSERT_EQ(split_master_bits(hi, lo), b) << std::hex << b;
    float f;
    std::memcpy(&f, &b, 4);
    if (std::isnan(f)) continue;
    const uint16_t rne = f32_to_bf16(f);
    if ((b & 0xFFFFu) == 0x8000u && ((b >> 16) & 1u) == 0) {
      EXPECT_EQ(hi, static_cast<uint16_t>((b >> 16) + 1)) << std::hex << b;  // away from zero
      ++ties_away;
    } else {
      EXPECT_EQ(hi, rne) << std::hex << b;
    }
  }
  EXPECT_GT(ties_away, 1000);
  // The tensor forms.
  const int64_t n = 5;
  Tensor m = Tensor::from_floats({1.0f, -2.5f, 3.14159f, 1e-30f, -0.0f}, {n}, DType::f32, MemCategory::other);
  m.data<float>()[0] = std::bit_cast<float>(0x3F808000u);
  Tensor hi = Tensor::empty({n}, DType::bf16, Device::cpu(), MemCategory::other);
  Tensor lo = Tensor::empty({n}, DType::i16, Device::cpu(), MemCategory::other);
  Tensor back = Tensor::empty({n}, DType::f32, Device::cpu(), MemCategory::other);
  split_master(m, hi, lo);
  join_master(hi, lo, back);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(bits_of(back.data<float>()[i]), bits_of(m.data<float>()[i]));
  EXPECT_EQ(hi.data<uint16_t>()[0], 0x3F81);
  test::expect_error_contains([&] { split_master(m, lo, hi); }, "argument 'value' has dtype i16");
}

// One split-master state and its f32-master twin from the same fp32 masters (a fifth of them
// exactly on a bf16 tie): value (bf16), remainder (i16), moments, and the twin's master (f32)
// and bf16 model (rounded to nearest even).
struct Twins {
  Tensor lo, value, m, v;         // split
  Tensor master, model, m2, v2;   // f32 master
};
Twins make_twins(int64_t n, DType md, uint64_t seed) {
  std::vector<float> p = test::randn(n, seed);
  for (int64_t i = 0; i < n; i += 5) p[i] = std::bit_cast<float>((bits_of(p[i]) & 0xFFFF0000u) | 0x8000u);
  Twins t;
  t.master = Tensor::from_floats(p, {n}, DType::f32, MemCategory::optimizer);
  t.model = Tensor::from_floats(p, {n}, DType::bf16, MemCategory::params);
  t.value = Tensor::empty({n}, DType::bf16, Device::cpu(), MemCategory::params);
  t.lo = Tensor::empty({n}, DType::i16, Device::cpu(), MemCategory::optimizer);
  split_master(t.master, t.value, t.lo);
  t.m = Tensor::from_floats(test::randn(n, seed + 1, 0.1f), {n}, md, MemCategory::optimizer);
  t.v = Tensor::from_floats(test::randu(n, seed + 2, 0.f, 0.01f), {n}, md, MemCategory::optimizer);
  t.m2 = t.m.clone();
  t.v2 = t.v.clone();
  return t;
}

// The fp32 master stays bitwise the f32-master update's, step after step (both moment dtypes,
// clipping and weight decay on); the value is its ties-away rounding, which is the f32 path's
// model wherever the master is not on a tie, and a tie was met.
void expect_twins_agree(const Twins& t) {
  Tensor joined = Tensor::empty({t.master.numel()}, DType::f32, Device::cpu(), MemCategory::other);
  join_master(t.value, t.lo, joined);
  const int64_t n = t.master.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_of(t.master.data<float>()[i]);
    ASSERT_EQ(bits_of(joined.data<float>()[i]), b) << "element " << i;
    ASSERT_EQ(t.value.data<uint16_t>()[i], split_master_hi(b)) << "element " << i;
    if ((b & 0xFFFFu) != 0x8000u) ASSERT_EQ(t.value.data<uint16_t>()[i], t.model.data<uint16_t>()[i]) << i;
  }
  EXPECT_EQ(t.m.to_floats(), t.m2.to_floats());
  EXPECT_EQ(t.v.to_floats(), t.v2.to_floats());
}

TEST(SplitMaster, UpdateKeepsTheFp32MasterBitForBit) {
  const int64_t n = 203, cut = 150, row_len = 10;
  for (DType md : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(md));
    Twins t = make_twins(n, md, 70);
    int differ = 0;  // the ties of the start: the two roundings part on about half of them
    for (int64_t i = 0; i < n; ++i) differ += t.value.data<uint16_t>()[i] != t.model.data<uint16_t>()[i];
    EXPECT_GT(differ, 5);
    expect_twins_agree(t);
    AdamWConfig cfg{0.9, 0.95, 1e-8};
    cfg.seed = 5;
    cfg.stream = 2;
    for (int step = 1; step <= 4; ++step) {
      const Tensor g = Tensor::from_floats(test::randn(n, 80 + step), {n}, DType::f32, MemCategory::grads);
      cfg.grad_scale = step == 2 ? 0.5 : 1.0;
      Tensor f1 = Tensor::zeros({1}, DType::i32, Device::cpu(), MemCategory::workspace), f2 = f1.clone();
      if (step == 1) {  // plain
        adamw_step(t.lo, g, t.m, t.v, step, 1e-2, 0.1, cfg, &t.value, &f1);
        adamw_step(t.master, g, t.m2, t.v2, step, 1e-2, 0.1, cfg, &t.model, &f2);
      } else if (step == 2 || step == 3) {  // with the sum of squares
        Tensor s1 = Tensor::zeros({1}, DType::i64, Device::cpu(), MemCategory::other), s2 = s1.clone();
        adamw_step_sum_squares(t.lo, g, t.m, t.v, step, 1e-2, 0.1, cut, cfg, &t.value, &f1, s1, 0);
        adamw_step_sum_squares(t.master, g, t.m2, t.v2, step, 1e-2, 0.1, cut, cfg, &t.model, &f2, s2, 0);
        EXPECT_EQ(s1.to_ints(), s2.to_ints());
      } else {  // by rows, in two calls
        for (const std::vector<int32_t>& rows : {std::vector<int32_t>{0, 3, 4, 20}, std::vector<int32_t>{1, 2, 5, 6, 7,
                                                 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}}) {
          adamw_step_rows(t.lo, g, t.m, t.v, step, 1e-2, 0.1, cut, cfg, &t.value, &f1, rows, row_len);
          adamw_step_rows(t.master, g, t.m2, t.v2, step, 1e-2, 0.1, cut, cfg, &t.model, &f2, rows, row_len);
        }
      }
      EXPECT_EQ(f1.to_ints(), f2.to_ints());
      expect_twins_agree(t);
    }
  }
}

TEST(SplitMaster, BadInputNamesTheMissingHalf) {
  Tensor lo = Tensor::zeros({4}, DType::i16, Device::cpu(), MemCategory::optimizer);
  Tensor f = Tensor::zeros({4}, DType::f32, Device::cpu(), MemCategory::optimizer);
  Tensor f2 = f.clone(), f3 = f.clone();
  test::expect_error_contains([&] { adamw_step(lo, f, f2, f3, 1, 0.1, 0, {}, nullptr); },
                              "a split master (i16 remainder) needs the bf16 model tensor that holds its upper half; "
                              "got no model tensor");
  Tensor m32 = f.clone();
  test::expect_error_contains([&] { adamw_step(lo, f, f2, f3, 1, 0.1, 0, {}, &m32); }, "got f32");
  Tensor i32 = Tensor::zeros({4}, DType::i32, Device::cpu(), MemCategory::optimizer);
  test::expect_error_contains([&] { adamw_step(i32, f, f2, f3, 1, 0.1, 0, {}, nullptr); },
                              "argument 'master' has dtype i32, expected f32 (an fp32 master) or i16");
}

}  // namespace
}  // namespace bb

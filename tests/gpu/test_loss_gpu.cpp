// Loss heads on CUDA against the CPU path: cross_entropy forward/backward (f32 and bf16 logits,
// masked targets, targets on the host or the device, rows that do and do not allow 16-byte
// loads), full_ce and linear_ce (loss, lse, d_h written, d_w accumulated; linear_ce == full_ce
// on the GPU; chunk sizes that divide neither T nor V), the logits peak of linear_ce (one
// chunk), one host read per cross-entropy forward, and bad targets found on the device.
// linear_ce_fused (one pass, gradient written over the logits block) against full_ce on the CPU
// and on the GPU: f32 and bf16, bf16 or f32 d_h, vocab sizes that take each vector width of its
// row kernel (8, 4, 1) and several loop steps per row, masked rows, host and device targets; its
// logits peak (one [ct, V] f32 block), its one host read, and a bad device target.
#include <gtest/gtest.h>

#include <cmath>

#include "common/gpu.h"
#include "common/testing.h"
#include "primitives/loss/linear_ce.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

// Targets in [0, V) with every `mask_every`-th position masked (-1).
std::vector<int32_t> make_targets(int64_t T, int64_t V, int mask_every, uint64_t seed) {
  auto u = test::randu(T, seed, 0.f, 1.f);
  std::vector<int32_t> t(T);
  for (int64_t i = 0; i < T; ++i)
    t[i] = (mask_every > 0 && i % mask_every == 2) ? -1 : static_cast<int32_t>(u[i] * V) % V;
  return t;
}

double tol(DType dt) { return dt == DType::f32 ? test::kTolF32 : test::kTolBf16; }
double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

// ---- plain cross-entropy --------------------------------------------------------------------
struct CeCase {
  const char* name;
  int64_t T, V;
  DType dt;
  bool device_targets;
};
class CrossEntropyGpu : public ::testing::TestWithParam<CeCase> {};

TEST_P(CrossEntropyGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  const CeCase c = GetParam();
  Tensor logits = Tensor::from_floats(test::randn(c.T * c.V, 1, 3.0f), {c.T, c.V}, c.dt);
  Tensor targets = Tensor::from_ints(make_targets(c.T, c.V, 5, 2), {c.T});
  Tensor lse_c, lse_g;
  const LossResult rc = cross_entropy_forward(logits, targets, &lse_c);
  Tensor lg = logits.to(kGpu);
  Tensor tg = c.device_targets ? targets.to(kGpu) : targets;
  const LossResult rg = cross_entropy_forward(lg, tg, &lse_g);
  EXPECT_EQ(rg.num_valid, rc.num_valid);
  EXPECT_LT(rel(rg.loss_sum, rc.loss_sum), 1e-5);
  EXPECT_EQ(lse_g.device(), kGpu);
  EXPECT_EQ(lse_g.category(), MemCategory::activations);
  EXPECT_LT(test::rel_error(lse_g.to_floats(), lse_c.to_floats()), 1e-6);
  const Tensor dc = cross_entropy_backward(logits, targets, lse_c, 0.37f);
  const Tensor dg = cross_entropy_backward(lg, tg, lse_g, 0.37f);
  EXPECT_EQ(dg.dtype(), DType::f32);
  EXPECT_EQ(dg.category(), MemCategory::logits);
  const auto dgv = dg.to_floats();
  EXPECT_LT(test::rel_error(dgv, dc.to_floats()), test::kTolF32);
  // Masked rows get exactly zero gradient.
  const auto tv = targets.to_ints();
  for (int64_t t = 0; t < c.T; ++t)
    if (tv[t] < 0)
      for (int64_t v = 0; v < c.V; ++v) ASSERT_EQ(dgv[t * c.V + v], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyGpu,
    ::testing::Values(CeCase{"T71_V229_f32_host_targets", 71, 229, DType::f32, false},
                      CeCase{"T71_V229_bf16_device_targets", 71, 229, DType::bf16, true},
                      CeCase{"T33_V5000_f32_vector_loads", 33, 5000, DType::f32, true},
                      CeCase{"T33_V5000_bf16_vector_loads", 33, 5000, DType::bf16, false},
                      CeCase{"T1_V3", 1, 3, DType::f32, true}),
    [](const ::testing::TestParamInfo<CeCase>& i) { return std::string(i.param.name); });

TEST(CrossEntropyGpuRuns, OneHostReadAndBadTargets) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t T = 9, V = 229;
  Tensor logits = Tensor::from_floats(test::randn(T * V, 3), {T, V}).to(kGpu);
  Tensor targets = Tensor::from_ints(make_targets(T, V, 4, 4), {T}).to(kGpu);
  const int64_t before = cuda::host_sync_count();
  const LossResult a = cross_entropy_forward(logits, targets, nullptr);
  EXPECT_EQ(cuda::host_sync_count() - before, 1);
  const LossResult b = cross_entropy_forward(logits, targets, nullptr);
  EXPECT_EQ(a.loss_sum, b.loss_sum);  // deterministic reduction
  auto bad = make_targets(T, V, 4, 4);
  bad[6] = static_cast<int32_t>(V);
  test::expect_error_contains(
      [&] { cross_entropy_forward(logits, Tensor::from_ints(bad, {T}).to(kGpu), nullptr); },
      "cross_entropy_forward: targets[6] = 229 is out of range for vocab size 229");
  // Host targets are still checked on the host.
  test::expect_error_contains(
      [&] { cross_entropy_forward(logits, Tensor::from_ints(bad, {T}), nullptr); },
      "targets[6] = 229 is out of range");
  test::expect_error_contains(
      [&] { cross_entropy_forward(logits.to(Device::cpu()), targets, nullptr); },
      "argument 'targets' is on cuda:0 but the computation runs on cpu");
#endif
}

// ---- loss heads -----------------------------------------------------------------------------
struct HeadCase {
  const char* name;
  int64_t T, V, H, chunk_tokens, chunk_vocab;
  DType dt, dh_dt;
};
class LossHeadGpu : public ::testing::TestWithParam<HeadCase> {};

struct HeadRun {
  LossResult r;
  std::vector<float> lse, d_h, d_w;
};

// Runs a loss head forward + backward; d_w starts from `dw0` (accumulation is checked).
template <class Fwd, class Bwd>
HeadRun run_head(Fwd fwd, Bwd bwd, const Tensor& h, const Tensor& w, const Tensor& targets,
                 const std::vector<float>& dw0, DType dh_dt, float scale) {
  HeadRun out;
  LossHeadSaved saved;
  out.r = fwd(h, w, targets, &saved);
  out.lse = saved.lse.to_floats();
  Tensor d_h = Tensor::empty(h.shape(), dh_dt, h.device(), MemCategory::activations);
  Tensor d_w = Tensor::from_floats(dw0, w.shape()).to(h.device(), MemCategory::grads);
  bwd(scale, h, w, targets, saved, d_h, d_w);
  out.d_h = d_h.to_floats();
  out.d_w = d_w.to_floats();
  return out;
}

TEST_P(LossHeadGpu, FullAndLinearMatchCpuAndEachOther) {
  BB_REQUIRE_GPU();
  const HeadCase c = GetParam();
  LossHeadConfig cfg;
  cfg.chunk_tokens = c.chunk_tokens;
  cfg.chunk_vocab = c.chunk_vocab;
  Tensor h = Tensor::from_floats(test::randn(c.T * c.H, 21), {c.T, c.H}, c.dt);
  Tensor w = Tensor::from_floats(test::randn(c.V * c.H, 22, 0.3f), {c.V, c.H}, c.dt);
  Tensor targets = Tensor::from_ints(make_targets(c.T, c.V, 7, 23), {c.T});
  const auto dw0 = test::randn(c.V * c.H, 24, 0.01f);
  const float scale = 1.0f / c.T;

  auto full_f = [](const Tensor& a, const Tensor& b, const Tensor& t, LossHeadSaved* s) {
    return full_ce_forward(a, b, t, s);
  };
  auto full_b = [](float sc, const Tensor& a, const Tensor& b, const Tensor& t,
                   const LossHeadSaved& s, Tensor& dh, Tensor& dw) {
    full_ce_backward(sc, a, b, t, s, dh, dw);
  };
  auto lin_f = [&](const Tensor& a, const Tensor& b, const Tensor& t, LossHeadSaved* s) {
    return linear_ce_forward(a, b, t, cfg, s);
  };
  auto lin_b = [&](float sc, const Tensor& a, const Tensor& b, const Tensor& t,
                   const LossHeadSaved& s, Tensor& dh, Tensor& dw) {
    linear_ce_backward(sc, a, b, t, cfg, s, dh, dw);
  };

  const HeadRun cpu = run_head(full_f, full_b, h, w, targets, dw0, c.dh_dt, scale);
  const Tensor hg = h.to(kGpu), wg = w.to(kGpu), tg = targets.to(kGpu);
  const HeadRun gfull = run_head(full_f, full_b, hg, wg, tg, dw0, c.dh_dt, scale);
  const HeadRun glin = run_head(lin_f, lin_b, hg, wg, targets /* host targets */, dw0, c.dh_dt,
                                scale);
  const double t = tol(c.dt);
  for (const HeadRun* g : {&gfull, &glin}) {
    SCOPED_TRACE(g == &gfull ? "full_ce on GPU vs CPU" : "linear_ce on GPU vs CPU");
    EXPECT_EQ(g->r.num_valid, cpu.r.num_valid);
    EXPECT_LT(rel(g->r.loss_sum, cpu.r.loss_sum), t);
    EXPECT_LT(test::rel_error(g->lse, cpu.lse), t);
    EXPECT_LT(test::rel_error(g->d_h, cpu.d_h), t);
    // d_w accumulated on top of dw0: compare the increments so dw0 cannot hide an error.
    std::vector<double> inc_g(dw0.size()), inc_c(dw0.size());
    for (size_t i = 0; i < dw0.size(); ++i) {
      inc_g[i] = static_cast<double>(g->d_w[i]) - dw0[i];
      inc_c[i] = static_cast<double>(cpu.d_w[i]) - dw0[i];
    }
    EXPECT_LT(test::rel_error(inc_g, inc_c), t);
  }
  // The two GPU heads against each other (same kernels for the statistics, different chunking).
  EXPECT_LT(rel(glin.r.loss_sum, gfull.r.loss_sum), t);
  EXPECT_LT(test::rel_error(glin.d_h, gfull.d_h), t);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LossHeadGpu,
    ::testing::Values(
        HeadCase{"f32_T67_V1000_H96_chunks16x300", 67, 1000, 96, 16, 300, DType::f32, DType::f32},
        HeadCase{"f32_T71_V229_H33_chunks10x50", 71, 229, 33, 10, 50, DType::f32, DType::f32},
        HeadCase{"bf16_T67_V1000_H96_chunks16x300", 67, 1000, 96, 16, 300, DType::bf16,
                 DType::f32},
        HeadCase{"bf16_T130_V4099_H128_chunks48x1024_dh_bf16", 130, 4099, 128, 48, 1024,
                 DType::bf16, DType::bf16},
        HeadCase{"f32_T5_V7_H3_one_chunk", 5, 7, 3, 4096, 32768, DType::f32, DType::f32}),
    [](const ::testing::TestParamInfo<HeadCase>& i) { return std::string(i.param.name); });

TEST(LossHeadGpuMemory, LinearCeLogitsPeakIsOneChunk) {
  BB_REQUIRE_GPU();
  const int64_t T = 100, V = 3001, H = 64;
  LossHeadConfig cfg;
  cfg.chunk_tokens = 32;
  cfg.chunk_vocab = 512;
  const int64_t chunk = linear_ce_logits_bytes(T, V, cfg);
  ASSERT_EQ(chunk, 32 * 512 * 4);
  Allocator& alloc = allocator_for(kGpu);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor h = Tensor::from_floats(test::randn(T * H, 31), {T, H}, dt).to(kGpu);
    Tensor w = Tensor::from_floats(test::randn(V * H, 32, 0.2f), {V, H}, dt).to(kGpu);
    Tensor targets = Tensor::from_ints(make_targets(T, V, 0, 33), {T}).to(kGpu);
    Tensor d_w = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
    Tensor d_h;
    LossHeadSaved saved;
    ASSERT_EQ(alloc.stats().live_of(MemCategory::logits), 0);
    alloc.reset_peak();
    linear_ce_forward(h, w, targets, cfg, &saved);
    EXPECT_EQ(alloc.stats().peak_of(MemCategory::logits), chunk);
    alloc.reset_peak();
    linear_ce_backward(1.0f, h, w, targets, cfg, saved, d_h, d_w);
    const int64_t bwd_peak = alloc.stats().peak_of(MemCategory::logits);
    if (dt == DType::f32) EXPECT_EQ(bwd_peak, chunk);  // the gradient overwrites the block
    else EXPECT_LE(bwd_peak, chunk);                  // f32 block + bf16 gradient, fewer rows
    EXPECT_GT(bwd_peak, chunk / 2);
    EXPECT_EQ(alloc.stats().live_of(MemCategory::logits), 0);
    // full_ce holds the whole [T, V] logits for comparison.
    alloc.reset_peak();
    LossHeadSaved fs;
    full_ce_forward(h, w, targets, &fs);
    EXPECT_EQ(alloc.stats().peak_of(MemCategory::logits), T * V * 4);
  }
}

// ---- linear_ce_fused -------------------------------------------------------------------------
struct FusedCase {
  const char* name;
  int64_t T, V, H, chunk;
  DType dt, dh_dt;
  bool device_targets;
  int mask_every;
};
class LinearCeFusedGpu : public ::testing::TestWithParam<FusedCase> {};

TEST_P(LinearCeFusedGpu, MatchesCpuAndFullCe) {
  BB_REQUIRE_GPU();
  const FusedCase c = GetParam();
  LossHeadConfig cfg;
  cfg.fused_chunk_tokens = c.chunk;
  Tensor h = Tensor::from_floats(test::randn(c.T * c.H, 51), {c.T, c.H}, c.dt);
  Tensor w = Tensor::from_floats(test::randn(c.V * c.H, 52, 0.3f), {c.V, c.H}, c.dt);
  const auto tv = make_targets(c.T, c.V, c.mask_every, 53);
  Tensor targets = Tensor::from_ints(tv, {c.T});
  const auto dw0 = test::randn(c.V * c.H, 54, 0.01f);
  const float scale = 1.0f / c.T;

  auto full_f = [](const Tensor& a, const Tensor& b, const Tensor& t, LossHeadSaved* s) {
    return full_ce_forward(a, b, t, s);
  };
  auto full_b = [](float sc, const Tensor& a, const Tensor& b, const Tensor& t,
                   const LossHeadSaved& s, Tensor& dh, Tensor& dw) {
    full_ce_backward(sc, a, b, t, s, dh, dw);
  };
  const HeadRun cpu = run_head(full_f, full_b, h, w, targets, dw0, c.dh_dt, scale);
  const Tensor hg = h.to(kGpu), wg = w.to(kGpu), tg_dev = targets.to(kGpu);
  const HeadRun gfull = run_head(full_f, full_b, hg, wg, tg_dev, dw0, c.dh_dt, scale);

  // d_h starts as NaN bytes (poisoned allocation): every element must be written.
  Tensor d_h = Tensor::empty(h.shape(), c.dh_dt, kGpu, MemCategory::activations);
  Tensor d_w = Tensor::from_floats(dw0, w.shape()).to(kGpu, MemCategory::grads);
  const LossResult r =
      linear_ce_fused(scale, hg, wg, c.device_targets ? tg_dev : targets, cfg, d_h, d_w);
  const auto dh = d_h.to_floats(), dw = d_w.to_floats();

  const double t = tol(c.dt);
  EXPECT_EQ(r.num_valid, cpu.r.num_valid);
  EXPECT_LT(rel(r.loss_sum, cpu.r.loss_sum), t);
  EXPECT_LT(test::rel_error(dh, cpu.d_h), t);
  std::vector<double> inc(dw0.size()), inc_c(dw0.size()), inc_g(dw0.size());
  for (size_t i = 0; i < dw0.size(); ++i) {
    inc[i] = static_cast<double>(dw[i]) - dw0[i];
    inc_c[i] = static_cast<double>(cpu.d_w[i]) - dw0[i];
    inc_g[i] = static_cast<double>(gfull.d_w[i]) - dw0[i];
  }
  EXPECT_LT(test::rel_error(inc, inc_c), t);
  // Against full_ce on the GPU: the same bf16 gradient rounding, so a tighter match is expected.
  EXPECT_LT(rel(r.loss_sum, gfull.r.loss_sum), t);
  EXPECT_LT(test::rel_error(dh, gfull.d_h), t);
  EXPECT_LT(test::rel_error(inc, inc_g), t);
  for (int64_t i = 0; i < c.T; ++i) {
    for (int64_t k = 0; k < c.H; ++k) ASSERT_TRUE(std::isfinite(dh[i * c.H + k])) << "row " << i;
    if (tv[i] < 0)  // masked rows: exactly zero gradient
      for (int64_t k = 0; k < c.H; ++k) ASSERT_EQ(dh[i * c.H + k], 0.0f) << "row " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearCeFusedGpu,
    ::testing::Values(
        // V = 229: scalar row kernel (vector width 1); chunks that do not divide T.
        FusedCase{"f32_T71_V229_H33_ct10", 71, 229, 33, 10, DType::f32, DType::f32, false, 7},
        FusedCase{"bf16_T71_V229_H33_ct16_dh_bf16", 71, 229, 33, 16, DType::bf16, DType::bf16,
                  true, 7},
        // V = 1000: 8-wide vectors.
        FusedCase{"f32_T67_V1000_H96_ct16", 67, 1000, 96, 16, DType::f32, DType::f32, true, 5},
        FusedCase{"bf16_T67_V1000_H96_ct16", 67, 1000, 96, 16, DType::bf16, DType::f32, false, 5},
        // V = 4100: 4-wide vectors; V = 4099: scalar with 5 loop steps per row.
        FusedCase{"bf16_T130_V4100_H128_ct48_dh_bf16", 130, 4100, 128, 48, DType::bf16,
                  DType::bf16, true, 7},
        FusedCase{"bf16_T33_V4099_H40_ct33", 33, 4099, 40, 33, DType::bf16, DType::f32, false, 4},
        // V = 20000: 8-wide vectors, 3 loop steps per row (the in-place bf16 write ordering).
        FusedCase{"bf16_T40_V20000_H64_ct16", 40, 20000, 64, 16, DType::bf16, DType::f32, true,
                  3},
        FusedCase{"f32_T40_V20000_H64_ct16", 40, 20000, 64, 16, DType::f32, DType::f32, true, 3},
        // Heavy masking (every third row), and a chunk larger than T.
        FusedCase{"bf16_T24_V1000_H32_ct8_third_masked", 24, 1000, 32, 8, DType::bf16,
                  DType::f32, true, 3},
        FusedCase{"f32_T5_V7_H3_one_chunk", 5, 7, 3, 2048, DType::f32, DType::f32, false, 0}),
    [](const ::testing::TestParamInfo<FusedCase>& i) { return std::string(i.param.name); });

TEST(LossHeadGpuMemory, LinearCeFusedLogitsPeakIsOneChunk) {
  BB_REQUIRE_GPU();
  const int64_t T = 100, V = 3001, H = 64;
  LossHeadConfig cfg;
  cfg.fused_chunk_tokens = 32;
  const int64_t chunk = linear_ce_fused_logits_bytes(T, V, cfg);
  ASSERT_EQ(chunk, 32 * V * 4);
  Allocator& alloc = allocator_for(kGpu);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor h = Tensor::from_floats(test::randn(T * H, 61), {T, H}, dt).to(kGpu);
    Tensor w = Tensor::from_floats(test::randn(V * H, 62, 0.2f), {V, H}, dt).to(kGpu);
    Tensor targets = Tensor::from_ints(make_targets(T, V, 6, 63), {T}).to(kGpu);
    Tensor d_w = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
    Tensor d_h;
    ASSERT_EQ(alloc.stats().live_of(MemCategory::logits), 0);
    alloc.reset_peak();
    linear_ce_fused(1.0f / T, h, w, targets, cfg, d_h, d_w);
    // One f32 block; the bf16 gradient lives inside it, so nothing else is allocated.
    EXPECT_EQ(alloc.stats().peak_of(MemCategory::logits), chunk);
    EXPECT_EQ(alloc.stats().live_of(MemCategory::logits), 0);
    ASSERT_TRUE(d_h.defined());
    EXPECT_EQ(d_h.dtype(), DType::f32);
    EXPECT_EQ(d_h.category(), MemCategory::activations);
  }
}

// primitives.loss_logits = "bf16": the GPU's bf16 block (bf16 GEMM output, softmax and gradient
// in place at the same width) against the CPU path with the same option (f32 logits rounded to
// bf16): loss and gradients within bf16 tolerance, for the 8-wide, 4-wide and scalar row kernels;
// the GPU's two-pass forward (evaluation) gives the fused pass's loss; the block is half the f32
// one; f32 operands keep an f32 block, rounded.
TEST(LossHeadGpuMemory, LinearCeBf16LogitsMatchCpu) {
  BB_REQUIRE_GPU();
  Allocator& alloc = allocator_for(kGpu);
  for (int64_t V : {20000, 4100, 4099}) {
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(testing::Message() << "V " << V << " " << dtype_name(dt));
      const int64_t T = 40, H = 64;
      LossHeadConfig cfg;
      cfg.fused_chunk_tokens = 16;
      cfg.chunk_tokens = 24;
      cfg.chunk_vocab = 3000;
      cfg.bf16_logits = true;
      Tensor h = Tensor::from_floats(test::randn(T * H, 71), {T, H}, dt);
      Tensor w = Tensor::from_floats(test::randn(V * H, 72, 0.3f), {V, H}, dt);
      Tensor targets = Tensor::from_ints(make_targets(T, V, 5, 73), {T});
      const auto dw0 = test::randn(V * H, 74, 0.01f);
      Tensor dh_c = Tensor::empty({T, H}, DType::f32, Device::cpu(), MemCategory::activations);
      Tensor dw_c = Tensor::from_floats(dw0, {V, H});
      const LossResult rc = linear_ce_fused(1.0f / T, h, w, targets, cfg, dh_c, dw_c);
      Tensor hg = h.to(kGpu), wg = w.to(kGpu), tg = targets.to(kGpu);
      Tensor dh_g = Tensor::empty({T, H}, DType::f32, kGpu, MemCategory::activations);
      Tensor dw_g = Tensor::from_floats(dw0, {V, H}).to(kGpu, MemCategory::grads);
      alloc.reset_peak();
      const LossResult rg = linear_ce_fused(1.0f / T, hg, wg, tg, cfg, dh_g, dw_g);
      EXPECT_EQ(alloc.stats().peak_of(MemCategory::logits), linear_ce_fused_logits_bytes(T, V, cfg, dt, true));
      EXPECT_EQ(rg.num_valid, rc.num_valid);
      EXPECT_LT(rel(rg.loss_sum, rc.loss_sum), tol(DType::bf16));
      EXPECT_LT(test::rel_error(dh_g.to_floats(), dh_c.to_floats()), tol(DType::bf16));
      const auto a = dw_g.to_floats(), b = dw_c.to_floats();
      std::vector<double> ia(dw0.size()), ib(dw0.size());
      for (size_t i = 0; i < dw0.size(); ++i) ia[i] = double(a[i]) - dw0[i], ib[i] = double(b[i]) - dw0[i];
      EXPECT_LT(test::rel_error(ia, ib), tol(DType::bf16));
      const LossResult re = linear_ce_forward(hg, wg, tg, cfg, nullptr);
      EXPECT_LT(rel(re.loss_sum, rg.loss_sum), 1e-5);
      // Not the f32-logits loss (the option took effect), but close to it.
      LossHeadConfig f32cfg = cfg;
      f32cfg.bf16_logits = false;
      Tensor dh2 = Tensor::empty({T, H}, DType::f32, kGpu, MemCategory::activations);
      Tensor dw2 = Tensor::from_floats(dw0, {V, H}).to(kGpu, MemCategory::grads);
      const LossResult rf = linear_ce_fused(1.0f / T, hg, wg, tg, f32cfg, dh2, dw2);
      EXPECT_NE(rf.loss_sum, rg.loss_sum);
      EXPECT_LT(rel(rf.loss_sum, rg.loss_sum), 1e-2);
    }
  }
}

// overwrite_dw on the GPU: the first chunk's d_w GEMM writes (beta 0) instead of adding to a
// cleared buffer. d_w starts as NaN: the same bits as accumulating into zeros (2 + 1 chunks).
TEST(LossHeadGpuMemory, LinearCeFusedOverwriteDwIgnoresWhatDwHeld) {
  BB_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t T = 40, H = 64, V = 5000;
    LossHeadConfig cfg;
    cfg.fused_chunk_tokens = 16;
    Tensor hg = Tensor::from_floats(test::randn(T * H, 81), {T, H}, dt).to(kGpu);
    Tensor wg = Tensor::from_floats(test::randn(V * H, 82, 0.3f), {V, H}, dt).to(kGpu);
    Tensor tg = Tensor::from_ints(make_targets(T, V, 5, 83), {T}).to(kGpu);
    Tensor dh1 = Tensor::empty({T, H}, DType::f32, kGpu, MemCategory::activations);
    Tensor dh2 = Tensor::empty({T, H}, DType::f32, kGpu, MemCategory::activations);
    Tensor dw1 = Tensor::from_floats(std::vector<float>(V * H, 0.0f), {V, H}).to(kGpu, MemCategory::grads);
    Tensor dw2 = Tensor::from_floats(std::vector<float>(V * H, std::nanf("")), {V, H}).to(kGpu, MemCategory::grads);
    const LossResult r1 = linear_ce_fused(1.0f / T, hg, wg, tg, cfg, dh1, dw1, false);
    const LossResult r2 = linear_ce_fused(1.0f / T, hg, wg, tg, cfg, dh2, dw2, true);
    EXPECT_EQ(r1.loss_sum, r2.loss_sum);
    EXPECT_EQ(dh1.to_floats(), dh2.to_floats());
    EXPECT_EQ(dw1.to_floats(), dw2.to_floats());
  }
}

TEST(LossHeadGpuMemory, LinearCeFusedOneHostReadAndBadTargets) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t T = 9, V = 229, H = 16;
  Tensor h = Tensor::from_floats(test::randn(T * H, 71), {T, H}, DType::bf16).to(kGpu);
  Tensor w = Tensor::from_floats(test::randn(V * H, 72, 0.3f), {V, H}, DType::bf16).to(kGpu);
  Tensor targets = Tensor::from_ints(make_targets(T, V, 4, 73), {T}).to(kGpu);
  Tensor d_w = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
  Tensor d_h;
  LossHeadConfig cfg;
  cfg.fused_chunk_tokens = 4;
  const LossResult a = linear_ce_fused(0.5f, h, w, targets, cfg, d_h, d_w);  // plans cached
  const auto dh_a = d_h.to_floats();
  const int64_t before = cuda::host_sync_count();
  const LossResult b = linear_ce_fused(0.5f, h, w, targets, cfg, d_h, d_w);
  EXPECT_EQ(cuda::host_sync_count() - before, 1);  // the totals, read once at the end
  EXPECT_EQ(a.loss_sum, b.loss_sum);  // deterministic
  EXPECT_EQ(d_h.to_floats(), dh_a);   // d_h written, not accumulated
  auto bad = make_targets(T, V, 4, 73);
  bad[6] = static_cast<int32_t>(V);
  test::expect_error_contains(
      [&] { linear_ce_fused(0.5f, h, w, Tensor::from_ints(bad, {T}).to(kGpu), cfg, d_h, d_w); },
      "linear_ce_fused: targets[6] = 229 is out of range for vocab size 229");
  test::expect_error_contains(
      [&] { linear_ce_fused(0.5f, h, w, Tensor::from_ints(bad, {T}), cfg, d_h, d_w); },
      "linear_ce_fused: targets[6] = 229 is out of range");
  Tensor d_w_cpu = Tensor::zeros({V, H}, DType::f32, Device::cpu(), MemCategory::grads);
  test::expect_error_contains([&] { linear_ce_fused(0.5f, h, w, targets, cfg, d_h, d_w_cpu); },
                              "argument 'd_w' is on cpu but the computation runs on cuda:0");
#endif
}

TEST(LossHeadGpuMemory, BadInputs) {
  BB_REQUIRE_GPU();
  Tensor h = Tensor::from_floats(test::randn(4 * 8, 41), {4, 8}).to(kGpu);
  Tensor w16 = Tensor::from_floats(test::randn(5 * 8, 42), {5, 8}, DType::bf16).to(kGpu);
  Tensor targets = Tensor::from_ints({0, 1, -1, 4}, {4});
  test::expect_error_contains([&] { full_ce_forward(h, w16, targets, nullptr); },
                              "on CUDA h and w must share one dtype");
  Tensor w_cpu = Tensor::from_floats(test::randn(5 * 8, 43), {5, 8});
  test::expect_error_contains([&] { linear_ce_forward(h, w_cpu, targets, {}, nullptr); },
                              "argument 'w' is on cpu but the computation runs on cuda:0");
}

}  // namespace
}  // namespace bb

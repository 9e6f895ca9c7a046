// cuBLASLt GEMM, grouped GEMM (cuBLAS grouped, multi-stream cuBLASLt, WMMA) and the linear
// primitive on the GPU against CPU references.
//
// Oracle: a double-precision loop (cpu::gemm<double>) over the very values the GPU sees (inputs
// rounded to bf16 first when they are stored in bf16), and the CPU Tensor API for linear.
// Tolerances (relative L2, common/gpu.h): bf16 output 1e-2, f32 output 1e-4 (f32 inputs run
// without TF32). Fresh device memory is NaN-poisoned, so an unwritten output or a beta = 0 GEMM
// that reads C fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/gemm.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/linear/linear.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/grouped_mma.h"
#endif

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

double tol_for(DType out) {
  return out == DType::bf16 ? test::kTolBf16 : test::kTolF32;
}

// Host values as stored in dtype dt (bf16 rounding applied), as floats.
std::vector<float> stored(const std::vector<float>& v, DType dt) {
  return Tensor::from_floats(v, {static_cast<int64_t>(v.size())}, dt).to_floats();
}

Tensor on_gpu(const std::vector<float>& v, const Shape& s, DType dt,
              MemCategory cat = MemCategory::other) {
  return Tensor::from_floats(v, s, dt).to(kGpu, cat);
}

// ref[M, N] = alpha op(A) op(B) + beta C0 in double, row-major with packed leading dims.
std::vector<double> ref_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                             const std::vector<float>& A, const std::vector<float>& B, double beta,
                             const std::vector<float>& C0) {
  std::vector<double> a(A.begin(), A.end()), b(B.begin(), B.end()), c(M * N, 0.0);
  for (int64_t i = 0; i < M * N && beta != 0.0; ++i) c[i] = C0[i];
  if (M * N > 0) cpu::gemm<double>(ta, tb, M, N, K, alpha, a.data(), b.data(), beta, c.data());
  return c;
}

#ifdef BB_WITH_CUDA
// One grouped-GEMM problem whose A, B and C are the last three tensors of `keep`.
cuda::GemmProblem last_three(int64_t M, int64_t N, int64_t K, std::vector<Tensor>& keep) {
  cuda::GemmProblem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.A = keep[keep.size() - 3].raw();
  p.B = keep[keep.size() - 2].raw();
  p.C = keep.back().raw();
  return p;
}

void gpu_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const Tensor& a,
              const Tensor& b, float beta, Tensor& c) {
  cuda::gemm(ta, tb, M, N, K, alpha, a.raw(), a.dtype(), std::max<int64_t>(a.size(1), 1), b.raw(),
             b.dtype(), std::max<int64_t>(b.size(1), 1), beta, c.raw(), c.dtype(),
             std::max<int64_t>(c.size(1), 1), 0);
}
#endif

// ---- cuda::gemm: transposes x input dtype x output dtype x shape -------------------------------

using GemmCase = std::tuple<bool, bool, DType, DType, std::tuple<int, int, int>>;

std::string gemm_case_name(const testing::TestParamInfo<GemmCase>& info) {
  const auto& [ta, tb, in, out, mnk] = info.param;
  const auto& [M, N, K] = mnk;
  return std::string(ta ? "T" : "N") + (tb ? "T" : "N") + "_" + dtype_name(in) + "_to_" +
         dtype_name(out) + "_" + std::to_string(M) + "x" + std::to_string(N) + "x" +
         std::to_string(K);
}

class GemmGpu : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmGpu, MatchesDoubleReference) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const auto& [ta, tb, in, out, mnk] = GetParam();
  const auto& [M, N, K] = mnk;
  const auto av = stored(test::randn(M * K, 1), in), bv = stored(test::randn(K * N, 2), in);
  const Tensor a = on_gpu(av, ta ? Shape{K, M} : Shape{M, K}, in);
  const Tensor b = on_gpu(bv, tb ? Shape{N, K} : Shape{K, N}, in);
  // beta = 0 into poisoned memory: C must be written, never read.
  Tensor c = Tensor::empty({M, N}, out, kGpu, MemCategory::other);
  gpu_gemm(ta, tb, M, N, K, 1.0f, a, b, 0.0f, c);
  const auto ref = ref_gemm(ta, tb, M, N, K, 1.0, av, bv, 0.0, {});
  EXPECT_LT(test::rel_error(c.to_floats(), ref), tol_for(out));

  // beta accumulation: C = 0.5 A B + 0.75 C0 on random C0.
  const auto c0 = stored(test::randn(M * N, 3), out);
  Tensor c2 = on_gpu(c0, {M, N}, out);
  gpu_gemm(ta, tb, M, N, K, 0.5f, a, b, 0.75f, c2);
  const auto ref2 = ref_gemm(ta, tb, M, N, K, 0.5, av, bv, 0.75, c0);
  EXPECT_LT(test::rel_error(c2.to_floats(), ref2), tol_for(out));
#endif
}

INSTANTIATE_TEST_SUITE_P(AllCombos, GemmGpu,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(std::make_tuple(71, 229, 130),
                                                              std::make_tuple(1, 1, 1))),
                         gemm_case_name);

TEST(GemmGpuEdge, BetaOneAccumulatesIntoF32) {  // the wgrad pattern d_w += d_y^T x, called twice
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t T = 130, out = 71, in = 229;
  const auto dy = stored(test::randn(T * out, 4), DType::bf16);
  const auto x = stored(test::randn(T * in, 5), DType::bf16);
  const auto w0 = test::randn(out * in, 6);
  const Tensor dyg = on_gpu(dy, {T, out}, DType::bf16), xg = on_gpu(x, {T, in}, DType::bf16);
  Tensor dw = on_gpu(w0, {out, in}, DType::f32);
  gpu_gemm(true, false, out, in, T, 1.0f, dyg, xg, 1.0f, dw);
  gpu_gemm(true, false, out, in, T, 1.0f, dyg, xg, 1.0f, dw);
  auto ref = ref_gemm(true, false, out, in, T, 2.0, dy, x, 1.0, w0);
  EXPECT_LT(test::rel_error(dw.to_floats(), ref), test::kTolF32);
#endif
}

TEST(GemmGpuEdge, MixedInputDtypesAndMisalignedSlices) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  // A bf16, B f32 (widened to f32); operands start at odd element offsets (2-byte alignment
  // for bf16), so a plan that assumes 256-byte alignment would be wrong.
  const int64_t M = 37, N = 53, K = 29;
  const auto big_a = stored(test::randn((M + 1) * K, 7), DType::bf16);
  const auto bv = test::randn((K + 1) * N, 8);
  const Tensor A = on_gpu(big_a, {M + 1, K}, DType::bf16).narrow(1, M);
  const Tensor B = on_gpu(bv, {K + 1, N}, DType::f32).narrow(1, K);
  Tensor C = Tensor::empty({M + 1, N}, DType::f32, kGpu, MemCategory::other).narrow(1, M);
  gpu_gemm(false, false, M, N, K, 1.0f, A, B, 0.0f, C);
  const std::vector<float> a(big_a.begin() + K, big_a.end()), b(bv.begin() + N, bv.end());
  EXPECT_LT(test::rel_error(C.to_floats(), ref_gemm(false, false, M, N, K, 1.0, a, b, 0.0, {})),
            test::kTolF32);
  // f32 inputs with a bf16 output (through an f32 copy of C).
  const auto av32 = test::randn(M * K, 9);
  Tensor Cb = on_gpu(test::randn(M * N, 10), {M, N}, DType::bf16);
  const auto cb0 = Cb.to_floats();
  gpu_gemm(false, false, M, N, K, 1.0f, on_gpu(av32, {M, K}, DType::f32), B, 1.0f, Cb);
  EXPECT_LT(
      test::rel_error(Cb.to_floats(), ref_gemm(false, false, M, N, K, 1.0, av32, b, 1.0, cb0)),
      test::kTolBf16);
#endif
}

TEST(GemmGpuEdge, EmptyInnerDimensionScalesC) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t M = 5, N = 7;
  const auto c0 = test::randn(M * N, 11);
  Tensor a = Tensor::empty({M, 0}, DType::bf16, kGpu, MemCategory::other);
  Tensor b = Tensor::empty({0, N}, DType::bf16, kGpu, MemCategory::other);
  Tensor c = on_gpu(c0, {M, N}, DType::f32);
  cuda::gemm(false, false, M, N, 0, 1.0f, a.raw(), DType::bf16, 1, b.raw(), DType::bf16, N, 0.5f,
             c.raw(), DType::f32, N, 0);
  std::vector<double> half(c0.begin(), c0.end());
  for (double& v : half) v *= 0.5;
  EXPECT_LT(test::rel_error(c.to_floats(), half), 1e-7);
  Tensor z = Tensor::empty({M, N}, DType::bf16, kGpu, MemCategory::other);  // NaN-poisoned
  cuda::gemm(false, false, M, N, 0, 1.0f, a.raw(), DType::bf16, 1, b.raw(), DType::bf16, N, 0.0f,
             z.raw(), DType::bf16, N, 0);
  EXPECT_EQ(z.to_floats(), std::vector<float>(M * N, 0.0f));
#endif
}

TEST(GemmGpuEdge, PlansAreCachedByShape) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  cuda::gemm_clear_cache();
  const Tensor a = on_gpu(test::randn(64 * 32, 12), {64, 32}, DType::bf16);
  const Tensor b = on_gpu(test::randn(32 * 48, 13), {32, 48}, DType::bf16);
  Tensor c = Tensor::empty({64, 48}, DType::f32, kGpu, MemCategory::other);
  gpu_gemm(false, false, 64, 48, 32, 1.0f, a, b, 0.0f, c);
  EXPECT_EQ(cuda::gemm_cache_size(), 1);
  gpu_gemm(false, false, 64, 48, 32, 1.0f, a, b, 0.0f, c);
  EXPECT_EQ(cuda::gemm_cache_size(), 1);
  Tensor c2 = Tensor::empty({64, 64}, DType::f32, kGpu, MemCategory::other);
  gpu_gemm(false, true, 64, 64, 32, 1.0f, a, a, 0.0f, c2);  // another shape: a second plan
  EXPECT_EQ(cuda::gemm_cache_size(), 2);
#endif
}

// Expert sizes change every step: sizes in one bucket share one heuristic query, and each size's
// result still matches the reference (the bucket's algorithm is checked per size). Forward shape
// (M varies) and wgrad shape (K varies, trans_a, f32 accumulate).
TEST(GemmGpuEdge, SizesInABucketShareOneHeuristic) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  cuda::gemm_clear_cache();
  const int64_t N = 96, H = 80;
  int64_t first = -1;
  for (int64_t M : {520, 530, 575, 513}) {  // one bucket: (512, 576]
    const auto av = stored(test::randn(M * H, 30 + M), DType::bf16);
    const auto bv = stored(test::randn(H * N, 31), DType::bf16);
    const Tensor a = on_gpu(av, {M, H}, DType::bf16), b = on_gpu(bv, {H, N}, DType::bf16);
    Tensor c = Tensor::empty({M, N}, DType::f32, kGpu, MemCategory::other);
    gpu_gemm(false, false, M, N, H, 1.0f, a, b, 0.0f, c);
    EXPECT_LT(test::rel_error(c.to_floats(), ref_gemm(false, false, M, N, H, 1.0, av, bv, 0.0, {})),
              1e-5) << "M=" << M;
    // wgrad: d_W[H, N] += x^T [H, M] d_y [M, N]
    const auto c0 = test::randn(H * N, 32);
    Tensor w = on_gpu(c0, {H, N}, DType::f32);
    const auto dv = stored(test::randn(M * N, 33 + M), DType::bf16);
    const Tensor d = on_gpu(dv, {M, N}, DType::bf16);
    gpu_gemm(true, false, H, N, M, 1.0f, a, d, 1.0f, w);
    EXPECT_LT(test::rel_error(w.to_floats(), ref_gemm(true, false, H, N, M, 1.0, av, dv, 1.0, c0)),
              1e-5) << "wgrad K=" << M;
    if (first < 0) first = cuda::gemm_heuristic_calls();
  }
  if (!cuda::exact_heuristics())
    EXPECT_EQ(cuda::gemm_heuristic_calls(), first) << "sizes of one bucket asked the heuristic again";
#endif
}

// `exact` heuristics keep their own table: after a bucketed run filled a bucket, every new exact
// shape still asks the heuristic once (and only once), and a bucket's own key size (576 here)
// in bucketed mode reuses the algorithm another size found, checked, without a query.
TEST(GemmGpuEdge, ExactHeuristicsIgnoreBucketedChoices) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  cuda::gemm_clear_cache();
  const bool was_exact = cuda::exact_heuristics();
  const int64_t N = 96, H = 80;
  auto run = [&](int64_t M) {
    const auto av = stored(test::randn(M * H, 40 + M), DType::bf16);
    const auto bv = stored(test::randn(H * N, 41), DType::bf16);
    const Tensor a = on_gpu(av, {M, H}, DType::bf16), b = on_gpu(bv, {H, N}, DType::bf16);
    Tensor c = Tensor::empty({M, N}, DType::f32, kGpu, MemCategory::other);
    gpu_gemm(false, false, M, N, H, 1.0f, a, b, 0.0f, c);
    EXPECT_LT(test::rel_error(c.to_floats(), ref_gemm(false, false, M, N, H, 1.0, av, bv, 0.0, {})),
              1e-5) << "M=" << M << (cuda::exact_heuristics() ? " (exact)" : " (bucketed)");
  };
  cuda::set_exact_heuristics(false);
  run(520);
  const int64_t after_bucketed = cuda::gemm_heuristic_calls();
  run(576);  // the bucket's key: reuses 520's algorithm after a check
  EXPECT_EQ(cuda::gemm_heuristic_calls(), after_bucketed);
  cuda::set_exact_heuristics(true);
  run(520);
  run(576);
  EXPECT_EQ(cuda::gemm_heuristic_calls(), after_bucketed + 2) << "exact mode used a bucketed choice";
  run(520);
  EXPECT_EQ(cuda::gemm_heuristic_calls(), after_bucketed + 2) << "exact mode asked twice for a shape";
  cuda::set_exact_heuristics(was_exact);
#endif
}

TEST(GemmGpuEdge, StridedBatched) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t batch = 3, M = 19, N = 23, K = 17;
  const auto av = stored(test::randn(batch * M * K, 14), DType::bf16);
  const auto bv = stored(test::randn(K * N, 15), DType::bf16);  // broadcast: stride 0
  const Tensor a = on_gpu(av, {batch * M, K}, DType::bf16), b = on_gpu(bv, {K, N}, DType::bf16);
  Tensor c = Tensor::empty({batch * M, N}, DType::f32, kGpu, MemCategory::other);
  cuda::gemm_strided_batched(false, false, M, N, K, 1.0f, a.raw(), DType::bf16, K, M * K, b.raw(),
                             DType::bf16, N, 0, 0.0f, c.raw(), DType::f32, N, M * N, batch, 0);
  std::vector<double> ref;
  for (int64_t i = 0; i < batch; ++i) {
    const std::vector<float> ai(av.begin() + i * M * K, av.begin() + (i + 1) * M * K);
    const auto r = ref_gemm(false, false, M, N, K, 1.0, ai, bv, 0.0, {});
    ref.insert(ref.end(), r.begin(), r.end());
  }
  EXPECT_LT(test::rel_error(c.to_floats(), ref), test::kTolF32);
#endif
}

TEST(GemmGpuEdge, BadArgumentsAreClearErrors) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  Tensor a = Tensor::empty({4, 8}, DType::bf16, kGpu, MemCategory::other);
  test::expect_error_contains(
      [&] {
        cuda::gemm(false, false, 4, 4, 8, 1.0f, a.raw(), DType::bf16, 4, a.raw(), DType::bf16, 8,
                   0.0f, a.raw(), DType::f32, 4, 0);
      },
      "lda=4 is less than the 8 columns of the stored A");
  test::expect_error_contains(
      [&] {
        cuda::gemm(false, false, 1, 1, 1, 1.0f, a.raw(), DType::i32, 1, a.raw(), DType::bf16, 1,
                   0.0f, a.raw(), DType::f32, 1, 0);
      },
      "dtype i32 is not f32, bf16 or f16");
  std::vector<cuda::GemmProblem> ps(1);
  ps[0].M = ps[0].N = ps[0].K = 2;
  ps[0].A = ps[0].B = a.raw();
  ps[0].C = a.raw();
  auto grouped = [&](bool ta, DType ab, DType c, cuda::GroupedConfig cfg) {
    cuda::gemm_grouped(ta, false, ps, 1.0f, ab, 8, 8, 0.0f, c, 8, 0, cfg);
  };
  test::expect_error_contains(
      [&] { grouped(false, DType::bf16, DType::f32, {cuda::GroupedAlgo::wmma, 0}); },
      "inputs bf16 with output f32 and trans_a=0 trans_b=0 is not supported by algorithm wmma");
  test::expect_error_contains(
      [&] { grouped(true, DType::bf16, DType::f32, {cuda::GroupedAlgo::cublas, 0}); },
      "is not supported by algorithm cublas");
  // f32 inputs into a bf16 C: no native cuBLASLt combination, so no grouped algorithm.
  test::expect_error_contains(
      [&] { grouped(false, DType::f32, DType::bf16, {}); },
      "is not supported by algorithm multi_stream");
  test::expect_error_contains(
      [&] { grouped(true, DType::bf16, DType::f32, {cuda::GroupedAlgo::multi_stream, 17}); },
      "num_streams=17 is not in [0, 16]");
  cuda::GroupedDefaults d;
  d.widening = cuda::GroupedAlgo::automatic;
  test::expect_error_contains([&] { cuda::set_grouped_defaults(d); },
                              "must name an algorithm, not automatic");
  d = cuda::GroupedDefaults();
  d.num_streams = 0;
  test::expect_error_contains([&] { cuda::set_grouped_defaults(d); },
                              "num_streams=0 is not in [1, 16]");
#endif
}

// ---- cuda::gemm_grouped ------------------------------------------------------------------------

// The algorithm under test, spelled without CUDA types so the file compiles in CPU builds.
enum class Algo { automatic, cublas, multi_stream, wmma };

#ifdef BB_WITH_CUDA
cuda::GroupedConfig config_of(Algo a, int num_streams = 0) {
  const cuda::GroupedAlgo g[] = {cuda::GroupedAlgo::automatic, cuda::GroupedAlgo::cublas,
                                 cuda::GroupedAlgo::multi_stream, cuda::GroupedAlgo::wmma};
  return {g[static_cast<int>(a)], num_streams};
}
#endif

const char* algo_suffix(Algo a) {
  switch (a) {
    case Algo::cublas:
      return "_cublas";
    case Algo::multi_stream:
      return "_multi_stream";
    case Algo::wmma:
      return "_wmma";
    default:
      return "";
  }
}

struct GroupedCase {
  bool ta, tb;
  DType in, out;
  Algo algo = Algo::automatic;
};

class GemmGroupedGpu : public ::testing::TestWithParam<GroupedCase> {};

TEST_P(GemmGroupedGpu, EachProblemMatchesDoubleReference) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const GroupedCase g = GetParam();
  // Problems of uneven sizes, one empty, one with K = 0 (C = beta C), all slices of one buffer
  // each so the offsets are unaligned. Fixed lda/ldb/ldc across problems.
  const std::vector<std::array<int64_t, 3>> mnk =
      g.ta && !g.tb ? std::vector<std::array<int64_t, 3>>{{130, 71, 37},
                                                          {130, 71, 0},
                                                          {130, 71, 1},
                                                          {130, 71, 200}}
                    : std::vector<std::array<int64_t, 3>>{
                          {37, 71, 130}, {0, 71, 130}, {1, 71, 130}, {200, 71, 130}};
  const float alpha = 1.0f, beta = 1.0f;
  const int64_t lda0 = g.ta ? mnk[0][0] : mnk[0][2];  // stored-A columns (same for all)
  const int64_t ldb0 = g.tb ? mnk[0][2] : mnk[0][1];
  const int64_t ldc0 = mnk[0][1];
  std::vector<cuda::GemmProblem> ps;
  std::vector<Tensor> keep;
  std::vector<std::vector<float>> av, bv, cv;
  for (size_t i = 0; i < mnk.size(); ++i) {
    const auto [M, N, K] = mnk[i];
    const int64_t a_rows = g.ta ? K : M, b_rows = g.tb ? N : K;
    av.push_back(stored(test::randn(a_rows * lda0, 20 + i), g.in));
    bv.push_back(stored(test::randn(b_rows * ldb0, 30 + i), g.in));
    cv.push_back(stored(test::randn(M * ldc0, 40 + i), g.out));
    keep.push_back(on_gpu(av.back(), {a_rows, lda0}, g.in));
    keep.push_back(on_gpu(bv.back(), {b_rows, ldb0}, g.in));
    keep.push_back(on_gpu(cv.back(), {M, ldc0}, g.out));
    ps.push_back(last_three(M, N, K, keep));
  }
  cuda::gemm_grouped(g.ta, g.tb, ps, alpha, g.in, lda0, ldb0, beta, g.out, ldc0, 0,
                     config_of(g.algo));
  for (size_t i = 0; i < mnk.size(); ++i) {
    const auto [M, N, K] = mnk[i];
    if (M == 0) continue;
    const auto ref = ref_gemm(g.ta, g.tb, M, N, K, alpha, av[i], bv[i], beta, cv[i]);
    EXPECT_LT(test::rel_error(keep[3 * i + 2].to_floats(), ref), tol_for(g.out)) << "problem " << i;
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Combos, GemmGroupedGpu,
    ::testing::Values(GroupedCase{false, true, DType::bf16, DType::bf16},   // expert forward
                      GroupedCase{false, false, DType::bf16, DType::bf16},  // expert dgrad
                      GroupedCase{false, true, DType::f32, DType::f32},
                      GroupedCase{true, false, DType::bf16, DType::f32},  // wgrad: multi-stream
                      GroupedCase{true, false, DType::f32, DType::f32},
                      GroupedCase{true, false, DType::bf16, DType::bf16},
                      GroupedCase{true, false, DType::bf16, DType::f32, Algo::wmma},
                      GroupedCase{false, true, DType::bf16, DType::bf16, Algo::multi_stream},
                      GroupedCase{false, false, DType::bf16, DType::bf16, Algo::multi_stream},
                      GroupedCase{false, false, DType::bf16, DType::f32, Algo::multi_stream},
                      GroupedCase{true, false, DType::f32, DType::f32, Algo::multi_stream}),
    [](const testing::TestParamInfo<GroupedCase>& info) {
      const GroupedCase& g = info.param;
      return std::string(g.ta ? "T" : "N") + (g.tb ? "T" : "N") + "_" + dtype_name(g.in) + "_to_" +
             dtype_name(g.out) + algo_suffix(g.algo);
    });

// ---- the mma tile kernel (GroupedAlgo::mma) ----------------------------------------------------

// Every transpose pair, bf16 and f16, C of the input dtype or f32, both tile heights and the
// automatic choice (the wgmma kernel for bf16 NT calls on sm_90), beta 0 and 1, against a
// double reference. Sizes: the contiguous extents are multiples of 8 (the kernel's
// contract); the others are ragged (1, 37, 129, 200 rows: partial tiles; a K tail of 37 or 300
// rows for the wgrad shape), N crosses a 128-column tile, K spans 1 to 5 K steps of 64, one
// problem is empty (M = 0) and one has K = 0 (C = beta C). Leading dimensions exceed the extents,
// and each problem's matrices are separate buffers.
TEST(GemmGroupedMma, AllTransposesAndDtypesMatchDoubleReference) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  int cases = 0;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (DType in : {DType::bf16, DType::f16})
        for (bool f32_out : {false, true})
          for (int tile_m : {0, 64, 128})  // 0: the wgmma kernel where it applies (sm_90, bf16, NT)
            for (float beta : {0.0f, 1.0f}) {
              const DType out = f32_out ? DType::f32 : in;
              // {M, N, K}: M must be a multiple of 8 when A is stored [K][M]; K when it is the
              // contiguous extent of A ([M][K]) or of B ([N][K]).
              const bool k8 = !ta || tb;
              const std::vector<std::array<int64_t, 3>> mnk = {
                  {ta ? 136 : 37, 136, k8 ? 72 : 37}, {0, 136, 64},
                  {ta ? 8 : 1, 8, k8 ? 320 : 300},    {ta ? 200 : 129, 256, 0},
                  {ta ? 64 : 200, 136, k8 ? 136 : 129}};
              int64_t maxm = 0, maxn = 0, maxk = 0;
              for (const auto& p : mnk) maxm = std::max(maxm, p[0]), maxn = std::max(maxn, p[1]), maxk = std::max(maxk, p[2]);
              const int64_t lda = (ta ? maxm : maxk) + 8, ldb = (tb ? maxk : maxn) + 16, ldc = maxn + 8;
              std::vector<cuda::GemmProblem> ps;
              std::vector<Tensor> keep;
              std::vector<std::vector<float>> av, bv, cv;
              for (size_t i = 0; i < mnk.size(); ++i) {
                const auto [M, N, K] = mnk[i];
                const int64_t a_rows = ta ? K : M, b_rows = tb ? N : K;
                const uint64_t seed = 1000 + 10 * static_cast<uint64_t>(cases) + i;
                av.push_back(stored(test::randn(std::max<int64_t>(a_rows, 1) * lda, seed), in));
                bv.push_back(stored(test::randn(std::max<int64_t>(b_rows, 1) * ldb, seed + 300), in));
                cv.push_back(stored(test::randn(std::max<int64_t>(M, 1) * ldc, seed + 600), out));
                keep.push_back(on_gpu(av.back(), {std::max<int64_t>(a_rows, 1), lda}, in));
                keep.push_back(on_gpu(bv.back(), {std::max<int64_t>(b_rows, 1), ldb}, in));
                keep.push_back(on_gpu(cv.back(), {std::max<int64_t>(M, 1), ldc}, out));
                ps.push_back(last_three(M, N, K, keep));
              }
              const float alpha = 0.75f;
              cuda::GroupedConfig cfg;
              cfg.algo = cuda::GroupedAlgo::mma;
              cfg.tile_m = tile_m;
              cuda::gemm_grouped(ta, tb, ps, alpha, in, lda, ldb, beta, out, ldc, 0, cfg);
              const std::string what = std::string(ta ? "T" : "N") + (tb ? "T" : "N") + " " + dtype_name(in) +
                                       "->" + dtype_name(out) + " tile_m " + std::to_string(tile_m) +
                                       " beta " + std::to_string(beta);
              for (size_t i = 0; i < mnk.size(); ++i) {
                const auto [M, N, K] = mnk[i];
                if (M == 0) continue;
                // The reference on packed copies of the stored (strided) operands.
                const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
                std::vector<float> a(a_rows * a_cols), b(b_rows * b_cols), c0(M * N);
                for (int64_t r = 0; r < a_rows; ++r)
                  for (int64_t c = 0; c < a_cols; ++c) a[r * a_cols + c] = av[i][r * lda + c];
                for (int64_t r = 0; r < b_rows; ++r)
                  for (int64_t c = 0; c < b_cols; ++c) b[r * b_cols + c] = bv[i][r * ldb + c];
                for (int64_t r = 0; r < M; ++r)
                  for (int64_t c = 0; c < N; ++c) c0[r * N + c] = cv[i][r * ldc + c];
                const auto ref = ref_gemm(ta, tb, M, N, K, alpha, a, b, beta, c0);
                const std::vector<float> all = keep[3 * i + 2].to_floats();
                std::vector<float> got(M * N);
                for (int64_t r = 0; r < M; ++r)
                  for (int64_t c = 0; c < ldc; ++c) {
                    if (c < N) got[r * N + c] = all[r * ldc + c];
                    else ASSERT_EQ(all[r * ldc + c], cv[i][r * ldc + c]) << what << ": problem " << i
                                                                         << " wrote past N at row " << r;
                  }
                if (K == 0 && beta == 0.0f) {  // C = 0 exactly (the reference is all zeros)
                  for (float v : got) ASSERT_EQ(v, 0.0f) << what << ": problem " << i;
                  continue;
                }
                EXPECT_LT(test::rel_error(got, ref), out == DType::f32 ? 1e-5 : test::kTolBf16)
                    << what << ": problem " << i;
              }
              ++cases;
            }
  EXPECT_EQ(cases, 96);
#endif
}

TEST(GemmGroupedMma, RefusalsAreClearErrorsAndAutomaticFallsBack) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const int64_t M = 37, N = 71, K = 40;  // N = 71: not a multiple of 8
  const auto av = stored(test::randn(M * K, 5), DType::bf16), bv = stored(test::randn(N * K, 6), DType::bf16);
  const std::vector<float> cv(M * N, 0.0f);
  Tensor A = on_gpu(av, {M, K}, DType::bf16), B = on_gpu(bv, {N, K}, DType::bf16);
  Tensor C = on_gpu(cv, {M, N}, DType::bf16);
  std::vector<cuda::GemmProblem> ps(1);
  ps[0].M = M;
  ps[0].N = N;
  ps[0].K = K;
  ps[0].A = A.raw();
  ps[0].B = B.raw();
  ps[0].C = C.raw();
  cuda::GroupedConfig cfg;
  cfg.algo = cuda::GroupedAlgo::mma;
  test::expect_error_contains(
      [&] { cuda::gemm_grouped(false, true, ps, 1.0f, DType::bf16, K, K, 0.0f, DType::bf16, N, 0, cfg); },
      "algorithm mma refuses this call: every leading dimension must be a multiple of 8");
  test::expect_error_contains(
      [&] { cuda::gemm_grouped(false, true, ps, 1.0f, DType::f32, K, K, 0.0f, DType::f32, N, 0, cfg); },
      "algorithm mma refuses this call: inputs must be bf16 or f16");
  cfg.tile_m = 96;
  std::vector<cuda::GemmProblem> ok = ps;
  ok[0].N = 64;
  test::expect_error_contains(
      [&] { cuda::gemm_grouped(false, true, ok, 1.0f, DType::bf16, K, K, 0.0f, DType::bf16, 64, 0, cfg); },
      "mma tile_m = 96 is not 0, 64 or 128");
  // Defaults naming mma: a call it refuses runs on cuBLAS's grouped GEMM instead, correctly.
  const cuda::GroupedDefaults d0 = cuda::grouped_defaults();
  cuda::GroupedDefaults d = d0;
  d.same_dtype = cuda::GroupedAlgo::mma;
  d.widening = cuda::GroupedAlgo::mma;
  d.multi_stream_min_flops = 1e30;
  cuda::set_grouped_defaults(d);
  cuda::gemm_grouped(false, true, ps, 1.0f, DType::bf16, K, K, 0.0f, DType::bf16, N, 0);
  cuda::set_grouped_defaults(d0);
  const auto ref = ref_gemm(false, true, M, N, K, 1.0, av, bv, 0.0, cv);
  EXPECT_LT(test::rel_error(C.to_floats(), ref), test::kTolBf16);
#endif
}

// ---- the TMA kernel (GroupedAlgo::mma, tile_m 0, on sm_90) --------------------------------------

#ifdef BB_WITH_CUDA
// The expert layouts the TMA kernel takes: the problems' A are consecutive row ranges of one
// [rows][K] matrix (ragged counts, zero-count experts skipped), B is one weight tensor
// ([E][N][K] for TN, [E][K][N] for NN) and C consecutive row ranges of one [rows][N] matrix.
struct ExpertLayout {
  bool tb;
  int64_t E, N, K, lda, ldb, ldc;
  std::vector<int64_t> counts;
  std::vector<float> a, b, c0;  // stored values (bf16-rounded inputs; C in its dtype)
  DType out;
  int64_t rows() const {
    int64_t r = 0;
    for (int64_t c : counts) r += c;
    return r;
  }
  ExpertLayout(bool tb_, DType out_, std::vector<int64_t> counts_, int64_t N_, int64_t K_, uint64_t seed)
      : tb(tb_), E(static_cast<int64_t>(counts_.size())), N(N_), K(K_), lda(K_ + 8), ldb(tb_ ? K_ : N_ + 8),
        ldc(N_ + 8), counts(std::move(counts_)), out(out_) {
    a = stored(test::randn(std::max<int64_t>(rows(), 1) * lda, seed), DType::bf16);
    b = stored(test::randn(E * (tb ? N : K) * ldb, seed + 1), DType::bf16);
    c0 = stored(test::randn(std::max<int64_t>(rows(), 1) * ldc, seed + 2), out);
  }
  std::vector<cuda::GemmProblem> problems(const Tensor& A, const Tensor& B, Tensor& C) const {
    std::vector<cuda::GemmProblem> ps;
    int64_t off = 0;
    for (int64_t e = 0; e < E; off += counts[e], ++e) {
      if (counts[e] == 0) continue;
      cuda::GemmProblem p;
      p.M = counts[e];
      p.N = N;
      p.K = K;
      p.A = static_cast<const uint16_t*>(A.raw()) + off * lda;
      p.B = static_cast<const uint16_t*>(B.raw()) + e * (tb ? N : K) * ldb;
      p.C = static_cast<char*>(C.raw()) + off * ldc * static_cast<int64_t>(dtype_size(out));
      ps.push_back(p);
    }
    return ps;
  }
  // Checks C against a double reference per expert, and that the pad columns kept their values.
  void expect_matches(const std::vector<float>& got_all, float alpha, float beta, const std::string& what) const {
    int64_t off = 0;
    for (int64_t e = 0; e < E; off += counts[e], ++e) {
      const int64_t M = counts[e];
      if (M == 0) continue;
      std::vector<float> ap(M * K), bp(N * K), cp(M * N), got(M * N);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < K; ++k) ap[r * K + k] = a[(off + r) * lda + k];
      for (int64_t r = 0; r < (tb ? N : K); ++r)
        for (int64_t c = 0; c < (tb ? K : N); ++c) bp[r * (tb ? K : N) + c] = b[(e * (tb ? N : K) + r) * ldb + c];
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < ldc; ++c) {
          const float v = got_all[(off + r) * ldc + c];
          if (c < N) {
            cp[r * N + c] = c0[(off + r) * ldc + c];
            got[r * N + c] = v;
          } else {
            ASSERT_EQ(v, c0[(off + r) * ldc + c]) << what << ": expert " << e << " wrote past N at row " << r;
          }
        }
      const auto ref = ref_gemm(false, tb, M, N, K, alpha, ap, bp, beta, cp);
      EXPECT_LT(test::rel_error(got, ref), out == DType::f32 ? 1e-5 : test::kTolBf16) << what << ": expert " << e;
    }
  }
};
#endif  // BB_WITH_CUDA

// Ragged counts (1, 37, 129, 200, 256, 300 rows: partial 128-row tiles; more tiles than the
// H200 has SMs, so every CTA walks several tiles and the producer runs ahead across tiles),
// zero-count experts, N = 264 (a partial second 256-column tile, whose rows run into the next
// expert's weights for TN), a K tail (TN: K = 200, three full 64-wide steps and 8 columns),
// beta 0 and 1, C bf16 and f32.
TEST(GemmGroupedTma, ExpertLayoutsMatchDoubleReference) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  if (cuda::compute_capability(0) != 90) GTEST_SKIP() << "the TMA kernel runs on compute capability 9.0 only";
  std::vector<int64_t> counts;
  for (int e = 0; e < 48; ++e) counts.push_back(std::vector<int64_t>{1, 37, 129, 200, 256, 300, 64, 0}[e % 8]);
  counts.back() = 0;  // the last expert has no rows: the previous one's B tile runs past the map
  int cases = 0;
  for (bool tb : {true, false})
    for (DType out : {DType::bf16, DType::f32})
      for (float beta : {0.0f, 1.0f}) {
        // TN: zero-count experts sit only at the end (an expert's 264 B rows overrun into the
        // next expert's, which must be a problem). NN reads K rows of B: no overrun.
        std::vector<int64_t> cs = counts;
        if (tb)
          for (size_t e = 0; e + 1 < cs.size(); ++e) cs[e] = std::max<int64_t>(cs[e], 5);
        const ExpertLayout L(tb, out, cs, 264, tb ? 200 : 192, 7000 + 10 * cases);
        Tensor A = on_gpu(L.a, {std::max<int64_t>(L.rows(), 1), L.lda}, DType::bf16);
        Tensor B = on_gpu(L.b, {L.E * (tb ? L.N : L.K), L.ldb}, DType::bf16);
        Tensor C = on_gpu(L.c0, {std::max<int64_t>(L.rows(), 1), L.ldc}, out);
        const auto ps = L.problems(A, B, C);
        ASSERT_EQ(cuda::grouped_tma_refusal(false, tb, ps, DType::bf16, L.lda, L.ldb, out, 0), "");
        const int64_t calls = cuda::grouped_tma_calls();
        cuda::GroupedConfig cfg;
        cfg.algo = cuda::GroupedAlgo::mma;
        const float alpha = 0.75f;
        cuda::gemm_grouped(false, tb, ps, alpha, DType::bf16, L.lda, L.ldb, beta, out, L.ldc, 0, cfg);
        EXPECT_EQ(cuda::grouped_tma_calls(), calls + 1) << "the call did not take the TMA kernel";
        L.expect_matches(C.to_floats(), alpha, beta,
                         std::string(tb ? "TN " : "NN ") + dtype_name(out) + " beta " + std::to_string(beta));
        ++cases;
      }
  EXPECT_EQ(cases, 8);
#endif
}

#ifdef BB_WITH_CUDA
// The wgrad problems of experts with counts[e] rows each: A_e, B_e the expert's rows of A [rows][lda]
// and B [rows][ldb] (bf16), C_e = c_of(e).
template <class CFn>
std::vector<cuda::GemmProblem> wgrad_problems(const std::vector<int64_t>& counts, int64_t M, int64_t N, const Tensor& A,
                                              int64_t lda, const Tensor& B, int64_t ldb, CFn c_of) {
  std::vector<cuda::GemmProblem> ps;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); off += counts[e], ++e) {
    cuda::GemmProblem p;
    p.M = M;
    p.N = N;
    p.K = counts[e];
    p.A = static_cast<const uint16_t*>(A.raw()) + off * lda;
    p.B = static_cast<const uint16_t*>(B.raw()) + off * ldb;
    p.C = c_of(static_cast<int64_t>(e));
    ps.push_back(p);
  }
  return ps;
}
#endif

// The wgrad shape: d_W[e] (+)= A_e^T B_e with A_e, B_e the expert's rows of one [rows][M] and one
// [rows][N] matrix, K = the expert's row count (ragged: 0, 1, 63, 64, 65, 200, 513 rows; the
// last K step of each expert holds the next expert's rows, which the kernel must zero), M = 136
// and N = 264 (partial tiles), C f32 (the gradients) or bf16, beta 0, 1 and 0.5. A K = 0 problem
// gives C = beta C. f32 C goes out through the half-tile staging buffer when beta != 0 and K is
// short (as here) and from the consumers' registers otherwise; forcing the other path
// (cuda::set_grouped_tma_f32_halves) must give the same bits.
TEST(GemmGroupedTma, WgradLayoutMatchesDoubleReference) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  if (cuda::compute_capability(0) != 90) GTEST_SKIP() << "the TMA kernel runs on compute capability 9.0 only";
  const int64_t M = 136, N = 264, lda = M + 8, ldb = N, ldc = N + 8;
  std::vector<int64_t> counts;
  for (int e = 0; e < 24; ++e) counts.push_back(std::vector<int64_t>{1, 63, 0, 64, 65, 200, 513, 130}[e % 8]);
  int64_t rows = 0;
  for (int64_t c : counts) rows += c;
  const int64_t E = static_cast<int64_t>(counts.size());
  int cases = 0;
  for (DType out : {DType::f32, DType::bf16})
    for (float beta : {0.0f, 1.0f, 0.5f}) {
      const uint64_t seed = 9100 + 10 * static_cast<uint64_t>(cases);
      const auto av = stored(test::randn(rows * lda, seed), DType::bf16);
      const auto bv = stored(test::randn(rows * ldb, seed + 1), DType::bf16);
      const auto cv = stored(test::randn(E * M * ldc, seed + 2), out);
      Tensor A = on_gpu(av, {rows, lda}, DType::bf16), B = on_gpu(bv, {rows, ldb}, DType::bf16);
      Tensor C = on_gpu(cv, {E * M, ldc}, out);
      std::vector<cuda::GemmProblem> ps = wgrad_problems(counts, M, N, A, lda, B, ldb, [&](int64_t e) {
        return static_cast<char*>(C.raw()) + e * M * ldc * static_cast<int64_t>(dtype_size(out));
      });
      ASSERT_EQ(cuda::grouped_tma_refusal(true, false, ps, DType::bf16, lda, ldb, out, 0), "");
      const int64_t calls = cuda::grouped_tma_calls();
      cuda::GroupedConfig cfg;
      cfg.algo = cuda::GroupedAlgo::mma;
      const float alpha = 0.5f;
      cuda::gemm_grouped(true, false, ps, alpha, DType::bf16, lda, ldb, beta, out, ldc, 0, cfg);
      EXPECT_EQ(cuda::grouped_tma_calls(), calls + 1) << "the call did not take the TMA kernel";
      const std::vector<float> got_all = C.to_floats();
      const std::string what = std::string("wgrad ") + dtype_name(out) + " beta " + std::to_string(beta);
      if (out == DType::f32) {
        Tensor C2 = on_gpu(cv, {E * M, ldc}, out);
        for (cuda::GemmProblem& p : ps)
          p.C = static_cast<char*>(C2.raw()) + (static_cast<char*>(p.C) - static_cast<char*>(C.raw()));
        cuda::set_grouped_tma_f32_halves(beta != 0.0f ? 0 : 1);
        cuda::gemm_grouped(true, false, ps, alpha, DType::bf16, lda, ldb, beta, out, ldc, 0, cfg);
        cuda::set_grouped_tma_f32_halves(-1);
        EXPECT_EQ(C2.to_floats(), got_all) << what << ": the other f32 store path gives other bits";
      }
      int64_t off = 0;
      for (int64_t e = 0; e < E; off += counts[e], ++e) {
        const int64_t K = counts[e];
        std::vector<float> ap(K * M), bp(K * N), cp(M * N), got(M * N);
        for (int64_t r = 0; r < K; ++r) {
          for (int64_t m = 0; m < M; ++m) ap[r * M + m] = av[(off + r) * lda + m];
          for (int64_t n = 0; n < N; ++n) bp[r * N + n] = bv[(off + r) * ldb + n];
        }
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < ldc; ++c) {
            const float v = got_all[(e * M + m) * ldc + c];
            if (c < N) {
              cp[m * N + c] = cv[(e * M + m) * ldc + c];
              got[m * N + c] = v;
            } else {
              ASSERT_EQ(v, cv[(e * M + m) * ldc + c]) << what << ": expert " << e << " wrote past N";
            }
          }
        const auto ref = ref_gemm(true, false, M, N, K, alpha, ap, bp, beta, cp);
        if (K == 0 && beta == 0.0f) {
          for (float v : got) ASSERT_EQ(v, 0.0f) << what << ": expert " << e << " (K = 0)";
          continue;
        }
        EXPECT_LT(test::rel_error(got, ref), out == DType::f32 ? 1e-5 : test::kTolBf16) << what << ": expert " << e
                                                                                         << " (K = " << K << ")";
      }
      ++cases;
    }
  EXPECT_EQ(cases, 6);
#endif
}

// The wgrad's plain write (beta 0) when every problem is whole 128-row tiles goes out through TMA
// stores of 32-column boxes (kStore): ragged K (0, 1, 63, 64, 65, 200, 513 rows), N = 264 (a
// partial column tile: the map clips it, the columns past N keep their values), the C matrices
// in reverse order of the problems with a gap of rows between them. The same bits as the
// register stores (set_grouped_tma_f32_store(false)), and the double reference.
TEST(GemmGroupedTma, WgradTmaStoresMatchRegisterStores) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  if (cuda::compute_capability(0) != 90) GTEST_SKIP() << "the TMA kernel runs on compute capability 9.0 only";
  const int64_t M = 256, N = 264, lda = M, ldb = N + 16, ldc = N + 8;
  std::vector<int64_t> counts;
  for (int e = 0; e < 16; ++e) counts.push_back(std::vector<int64_t>{1, 63, 0, 64, 65, 200, 513, 130}[e % 8]);
  int64_t rows = 0;
  for (int64_t c : counts) rows += c;
  const int64_t E = static_cast<int64_t>(counts.size()), slot = M + 3;  // C rows of one problem, and a gap
  const auto av = stored(test::randn(rows * lda, 9301), DType::bf16);
  const auto bv = stored(test::randn(rows * ldb, 9302), DType::bf16);
  const auto cv = stored(test::randn(E * slot * ldc, 9303), DType::f32);
  Tensor A = on_gpu(av, {rows, lda}, DType::bf16), B = on_gpu(bv, {rows, ldb}, DType::bf16);
  auto run = [&](bool store) {
    Tensor C = on_gpu(cv, {E * slot, ldc}, DType::f32);
    const std::vector<cuda::GemmProblem> ps = wgrad_problems(
        counts, M, N, A, lda, B, ldb, [&](int64_t e) { return static_cast<float*>(C.raw()) + (E - 1 - e) * slot * ldc; });
    EXPECT_EQ(cuda::grouped_tma_refusal(true, false, ps, DType::bf16, lda, ldb, DType::f32, 0), "");
    cuda::GroupedConfig cfg;
    cfg.algo = cuda::GroupedAlgo::mma;
    cuda::set_grouped_tma_f32_store(store);
    const int64_t calls = cuda::grouped_tma_calls();
    cuda::gemm_grouped(true, false, ps, 0.75f, DType::bf16, lda, ldb, 0.0f, DType::f32, ldc, 0, cfg);
    cuda::set_grouped_tma_f32_store(true);
    EXPECT_EQ(cuda::grouped_tma_calls(), calls + 1) << "the call did not take the TMA kernel";
    return C.to_floats();
  };
  const std::vector<float> got_all = run(true), regs = run(false);
  EXPECT_EQ(got_all, regs) << "TMA stores and register stores give other bits";
  int64_t off = 0;
  for (int64_t e = 0; e < E; off += counts[e], ++e) {
    const int64_t K = counts[e], c0 = (E - 1 - e) * slot;
    std::vector<float> ap(K * M), bp(K * N), got(M * N);
    for (int64_t r = 0; r < K; ++r) {
      for (int64_t m = 0; m < M; ++m) ap[r * M + m] = av[(off + r) * lda + m];
      for (int64_t n = 0; n < N; ++n) bp[r * N + n] = bv[(off + r) * ldb + n];
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < ldc; ++c) {
        const float v = got_all[(c0 + m) * ldc + c];
        if (c < N) got[m * N + c] = v;
        else ASSERT_EQ(v, cv[(c0 + m) * ldc + c]) << "expert " << e << " wrote past N";
      }
    for (int64_t m = M; m < slot; ++m)  // the gap rows after each C are nobody's
      for (int64_t c = 0; c < ldc; ++c) ASSERT_EQ(got_all[(c0 + m) * ldc + c], cv[(c0 + m) * ldc + c]) << "gap row";
    const auto ref = ref_gemm(true, false, M, N, K, 0.75, ap, bp, 0.0, std::vector<float>(M * N, 0.0f));
    if (K == 0) {
      for (float v : got) ASSERT_EQ(v, 0.0f) << "expert " << e << " (K = 0)";
      continue;
    }
    EXPECT_LT(test::rel_error(got, ref), 1e-5) << "expert " << e << " (K = " << K << ")";
  }
#endif
}

// The automatic choice takes the TMA kernel for the expert forward shape whatever its FLOPs (the
// multi_stream FLOP line applies only to calls it does not take), and grouped_gemm_tma = false
// sends the same call back to the FLOP line; both give the reference's result. The wgrad shape
// takes it whether it writes (beta 0) or adds (beta 1).
TEST(GemmGroupedTma, AutomaticTakesItAndTheSwitchTurnsItOff) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  if (cuda::compute_capability(0) != 90) GTEST_SKIP() << "the TMA kernel runs on compute capability 9.0 only";
  const ExpertLayout L(true, DType::bf16, {640, 512, 700, 384}, 768, 2048, 91);  // ~2-2.9 GFLOP each
  Tensor A = on_gpu(L.a, {L.rows(), L.lda}, DType::bf16);
  Tensor B = on_gpu(L.b, {L.E * L.N, L.ldb}, DType::bf16);
  const cuda::GroupedDefaults d0 = cuda::grouped_defaults();
  struct Restore {
    cuda::GroupedDefaults d;
    ~Restore() { cuda::set_grouped_defaults(d); }
  } restore{d0};
  for (bool on : {true, false}) {
    cuda::GroupedDefaults d = d0;
    d.tma = on;
    cuda::set_grouped_defaults(d);
    Tensor C = on_gpu(L.c0, {L.rows(), L.ldc}, DType::bf16);
    const int64_t calls = cuda::grouped_tma_calls();
    cuda::gemm_grouped(false, true, L.problems(A, B, C), 1.0f, DType::bf16, L.lda, L.ldb, 0.0f, DType::bf16, L.ldc, 0);
    EXPECT_EQ(cuda::grouped_tma_calls(), calls + (on ? 1 : 0)) << "tma " << on;
    L.expect_matches(C.to_floats(), 1.0f, 0.0f, on ? "automatic, tma on" : "automatic, tma off");
  }
  // The wgrad shape through automatic: the TMA kernel, writing and adding.
  {
    cuda::set_grouped_defaults(d0);
    const int64_t M = 64, N = 128, K = 100;
    const auto av = stored(test::randn(2 * K * M, 95), DType::bf16), bv = stored(test::randn(2 * K * N, 96), DType::bf16);
    Tensor wa = on_gpu(av, {2 * K, M}, DType::bf16), wb = on_gpu(bv, {2 * K, N}, DType::bf16);
    Tensor wc = Tensor::zeros({2 * M, N}, DType::f32, kGpu, MemCategory::other);
    std::vector<cuda::GemmProblem> ps(2);
    for (int e = 0; e < 2; ++e) {
      ps[e].M = M;
      ps[e].N = N;
      ps[e].K = K;
      ps[e].A = static_cast<const uint16_t*>(wa.raw()) + e * K * M;
      ps[e].B = static_cast<const uint16_t*>(wb.raw()) + e * K * N;
      ps[e].C = wc.data<float>() + e * M * N;
    }
    ASSERT_EQ(cuda::grouped_tma_refusal(true, false, ps, DType::bf16, M, N, DType::f32, 0), "");
    // A writing wgrad (beta 0, the first of a step) and one that adds (beta 1, later
    // micro-batches) take the TMA kernel. Both against a double reference: C, then 2 C.
    std::vector<double> ref(static_cast<size_t>(2 * M * N), 0.0);
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n)
            ref[static_cast<size_t>((e * M + m) * N + n)] +=
                double(av[static_cast<size_t>((e * K + k) * M + m)]) * bv[static_cast<size_t>((e * K + k) * N + n)];
    int64_t calls = cuda::grouped_tma_calls();
    cuda::gemm_grouped(true, false, ps, 1.0f, DType::bf16, M, N, 0.0f, DType::f32, N, 0);
    EXPECT_EQ(cuda::grouped_tma_calls(), calls + 1) << "the automatic writing wgrad did not take the TMA kernel";
    EXPECT_LT(test::rel_error(wc.to_floats(), ref), 1e-5);
    calls = cuda::grouped_tma_calls();
    cuda::gemm_grouped(true, false, ps, 1.0f, DType::bf16, M, N, 1.0f, DType::f32, N, 0);
    EXPECT_EQ(cuda::grouped_tma_calls(), calls + 1) << "the automatic accumulating wgrad did not take the TMA kernel";
    for (double& r : ref) r *= 2;
    EXPECT_LT(test::rel_error(wc.to_floats(), ref), 1e-5);
  }
#endif
}

// Layouts one tensor map cannot cover safely are refused with the reason, and mma with tile_m 0
// then runs them on the other kernels, correctly.
TEST(GemmGroupedTma, RefusedLayoutsFallBackCorrectly) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  if (cuda::compute_capability(0) != 90) GTEST_SKIP() << "the TMA kernel runs on compute capability 9.0 only";
  // TN with N = 264 and a zero-count expert in the middle: the tile of expert 0's B rows runs
  // into expert 1's weights, which no problem owns.
  const ExpertLayout L(true, DType::bf16, {100, 0, 90}, 264, 128, 17);
  Tensor A = on_gpu(L.a, {L.rows(), L.lda}, DType::bf16);
  Tensor B = on_gpu(L.b, {L.E * L.N, L.ldb}, DType::bf16);
  Tensor C = on_gpu(L.c0, {L.rows(), L.ldc}, DType::bf16);
  auto ps = L.problems(A, B, C);
  EXPECT_NE(cuda::grouped_tma_refusal(false, true, ps, DType::bf16, L.lda, L.ldb, DType::bf16, 0)
                .find("would read rows no problem owns"),
            std::string::npos);
  const int64_t calls = cuda::grouped_tma_calls();
  cuda::GroupedConfig cfg;
  cfg.algo = cuda::GroupedAlgo::mma;
  cuda::gemm_grouped(false, true, ps, 1.0f, DType::bf16, L.lda, L.ldb, 0.0f, DType::bf16, L.ldc, 0, cfg);
  EXPECT_EQ(cuda::grouped_tma_calls(), calls);
  L.expect_matches(C.to_floats(), 1.0f, 0.0f, "refused TN layout");
  // A matrices half a row apart are not rows of one matrix.
  auto shifted = ps;
  shifted[1].A = static_cast<const uint16_t*>(shifted[1].A) + L.lda / 2;
  EXPECT_NE(cuda::grouped_tma_refusal(false, true, shifted, DType::bf16, L.lda, L.ldb, DType::bf16, 0)
                .find("A matrices are not rows of one matrix"),
            std::string::npos);
  // Different K, NN with K not a multiple of 64, other dtypes and transposes.
  auto k_differs = ps;
  k_differs[1].K = 64;
  EXPECT_EQ(cuda::grouped_tma_refusal(false, true, k_differs, DType::bf16, L.lda, L.ldb, DType::bf16, 0),
            "the problems differ in K");
  auto k72 = ps;
  for (auto& p : k72) p.K = 72;
  EXPECT_EQ(cuda::grouped_tma_refusal(false, false, k72, DType::bf16, L.lda, 272, DType::bf16, 0),
            "K is not a multiple of 64 (B stored [K][N])");
  EXPECT_EQ(cuda::grouped_tma_refusal(false, true, ps, DType::f16, L.lda, L.ldb, DType::f16, 0),
            "the inputs are not bf16");
  EXPECT_EQ(cuda::grouped_tma_refusal(true, true, ps, DType::bf16, L.lda, L.ldb, DType::f32, 0),
            "A is stored [K][M] and B [N][K]");
  EXPECT_EQ(cuda::grouped_tma_refusal(false, true, ps, DType::bf16, L.lda, L.ldb, DType::f16, 0),
            "C is neither bf16 nor f32");
#endif
}

// ---- multi-stream grouped GEMM on the expert weight-gradient shape ----------------------------

// d_W[g] += d_Y_g^T X_g as the experts issue it: A_g and B_g are consecutive row blocks
// [off_g, off_g + K_g) of one A [sum K, lda] and one B [sum K, ldb] (bf16, so most blocks start
// unaligned); C_g is matrix g of one f32 C [G * rows_c, ldc]. Twelve problems (more than the
// streams), sizes that divide no tile, two K = 0 problems, an M = 0 and an N = 0 problem, and
// one large problem, which a missing join would turn into a stale read.
// Elements whose values differ (NaN compares unequal, so a NaN anywhere counts).
int64_t num_differences(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

struct WgradSet {
  static constexpr int64_t lda = 150, ldb = 77, ldc = 77, rows_c = 150;
  std::vector<std::array<int64_t, 3>> mnk = {{150, 77, 37}, {131, 77, 0},  {150, 60, 129},
                                             {0, 77, 50},   {150, 77, 2048}, {1, 1, 1},
                                             {150, 0, 30},  {99, 77, 300},  {150, 77, 0},
                                             {150, 77, 511}, {7, 13, 3},    {150, 77, 250}};
  int64_t total_k = 0;
  std::vector<float> a, b, c0;  // host values as stored (a, b rounded to bf16)
  Tensor A, B;

  WgradSet() {
    for (const auto& p : mnk) total_k += p[2];
    a = stored(test::randn(total_k * lda, 90), DType::bf16);
    b = stored(test::randn(total_k * ldb, 91), DType::bf16);
    c0 = test::randn(num_problems() * rows_c * ldc, 92);
    A = on_gpu(a, {total_k, lda}, DType::bf16);
    B = on_gpu(b, {total_k, ldb}, DType::bf16);
  }
  int64_t num_problems() const { return static_cast<int64_t>(mnk.size()); }

#ifdef BB_WITH_CUDA
  std::vector<cuda::GemmProblem> problems(Tensor& C) const {
    std::vector<cuda::GemmProblem> ps;
    int64_t off = 0;
    for (size_t g = 0; g < mnk.size(); ++g) {
      cuda::GemmProblem p;
      p.M = mnk[g][0];
      p.N = mnk[g][1];
      p.K = mnk[g][2];
      p.A = static_cast<const char*>(A.raw()) + off * lda * 2;
      p.B = static_cast<const char*>(B.raw()) + off * ldb * 2;
      p.C = static_cast<char*>(C.raw()) + static_cast<int64_t>(g) * rows_c * ldc * 4;
      ps.push_back(p);
      off += p.K;
    }
    return ps;
  }
#endif

  // C after C = alpha A_g^T B_g + beta C on the product regions of `before`, in double.
  std::vector<double> reference(double alpha, double beta, const std::vector<float>& before) const {
    std::vector<double> c(before.begin(), before.end());
    int64_t off = 0;
    for (size_t g = 0; g < mnk.size(); ++g) {
      const auto [M, N, K] = mnk[g];
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k)
            acc += static_cast<double>(a[(off + k) * lda + m]) * b[(off + k) * ldb + n];
          double& out = c[(static_cast<int64_t>(g) * rows_c + m) * ldc + n];
          out = alpha * acc + beta * out;
        }
      off += K;
    }
    return c;
  }

  // Each product region within tol of the reference, everything else bit-identical to before.
  void expect_matches(const std::vector<float>& got, const std::vector<double>& ref,
                      const std::vector<float>& before, const std::string& what) const {
    ASSERT_EQ(got.size(), ref.size());
    for (size_t g = 0; g < mnk.size(); ++g) {
      const auto [M, N, K] = mnk[g];
      std::vector<float> gv;
      std::vector<double> rv;
      for (int64_t m = 0; m < rows_c; ++m)
        for (int64_t n = 0; n < ldc; ++n) {
          const size_t i = static_cast<size_t>((static_cast<int64_t>(g) * rows_c + m) * ldc + n);
          if (m < M && n < N) {
            gv.push_back(got[i]);
            rv.push_back(ref[i]);
          } else {
            ASSERT_EQ(got[i], before[i]) << what << ": problem " << g << " wrote outside its "
                                         << M << "x" << N << " block at (" << m << ", " << n << ")";
          }
        }
      if (!gv.empty()) {
        EXPECT_LT(test::rel_error(gv, rv), test::kTolF32) << what << ": problem " << g;
      }
    }
  }
};

TEST(GemmGroupedMultiStream, WgradMatchesReferenceAndSequential) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const WgradSet w;
  const int64_t rows = w.num_problems() * w.rows_c;
  // C is scaled by 2 on the compute stream right before each call (a K = 0 GEMM): the side
  // streams must see that, not the uploaded values.
  std::vector<float> twice(w.c0);
  for (float& v : twice) v *= 2.0f;
  auto fresh_c = [&] {
    Tensor c = on_gpu(w.c0, {rows, w.ldc}, DType::f32);
    cuda::gemm(false, false, rows, w.ldc, 0, 1.0f, c.raw(), DType::f32, 1, c.raw(), DType::f32,
               w.ldc, 2.0f, c.raw(), DType::f32, w.ldc, 0);
    return c;
  };
  // Single-stream sequential: one cuda::gemm per problem on the compute stream.
  Tensor c_seq = fresh_c();
  for (const cuda::GemmProblem& p : w.problems(c_seq))
    cuda::gemm(true, false, p.M, p.N, p.K, 1.0f, p.A, DType::bf16, w.lda, p.B, DType::bf16, w.ldb,
               1.0f, p.C, DType::f32, w.ldc, 0);
  const std::vector<float> seq = c_seq.to_floats();
  const std::vector<double> ref = w.reference(1.0, 1.0, twice);
  w.expect_matches(seq, ref, twice, "sequential");

  for (int streams : {1, 3, 4, cuda::kMaxGroupedStreams}) {
    const std::string what = "multi_stream S=" + std::to_string(streams);
    Tensor c = fresh_c();
    cuda::gemm_grouped(true, false, w.problems(c), 1.0f, DType::bf16, w.lda, w.ldb, 1.0f,
                       DType::f32, w.ldc, 0, config_of(Algo::multi_stream, streams));
    const std::vector<float> got = c.to_floats();
    w.expect_matches(got, ref, twice, what);
    // The same cuBLASLt plans as the sequential calls: the same bits.
    EXPECT_EQ(num_differences(got, seq), 0) << what << " differs from the sequential result";

    // alpha and beta other than 1 (K = 0 problems: C = 0.75 C, before the fork).
    cuda::gemm_grouped(true, false, w.problems(c), 0.5f, DType::bf16, w.lda, w.ldb, 0.75f,
                       DType::f32, w.ldc, 0, config_of(Algo::multi_stream, streams));
    w.expect_matches(c.to_floats(), w.reference(0.5, 0.75, got), got, what + ", beta 0.75");
  }
#endif
}

TEST(GemmGroupedMultiStream, SteadyStateAllocatesNothing) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const WgradSet w;
  Tensor c = on_gpu(w.c0, {w.num_problems() * w.rows_c, w.ldc}, DType::f32);
  const auto ps = w.problems(c);
  auto call = [&] {
    cuda::gemm_grouped(true, false, ps, 1.0f, DType::bf16, w.lda, w.ldb, 1.0f, DType::f32, w.ldc,
                       0, config_of(Algo::multi_stream, 4));
  };
  call();  // first use: side streams, events and their workspaces
  cuda::synchronize();
  Allocator& alloc = allocator_for(kGpu);
  alloc.reset_peak();
  const int64_t live = alloc.stats().live_of(MemCategory::workspace);
  EXPECT_GE(live, 5 * (int64_t{32} << 20)) << "the main and four side workspaces are live";
  for (int i = 0; i < 3; ++i) call();
  cuda::synchronize();
  EXPECT_EQ(alloc.stats().live_of(MemCategory::workspace), live);
  EXPECT_EQ(alloc.stats().peak_of(MemCategory::workspace), live)
      << "a steady-state multi-stream call allocated a temporary";
#endif
}

TEST(GemmGroupedMultiStream, DefaultsSteerAutomatic) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const cuda::GroupedDefaults d0 = cuda::grouped_defaults();
  EXPECT_EQ(d0.same_dtype, cuda::GroupedAlgo::mma);
  EXPECT_EQ(d0.widening, cuda::GroupedAlgo::multi_stream);
  EXPECT_EQ(d0.num_streams, 4);
  EXPECT_EQ(d0.multi_stream_min_flops, 1.2e9);
  {
    cuda::GroupedDefaults bad = d0;
    bad.multi_stream_min_flops = -1;
    test::expect_error_contains([&] { cuda::set_grouped_defaults(bad); },
                                "multi_stream_min_flops must be >= 0");
  }
  struct Restore {
    cuda::GroupedDefaults d;
    ~Restore() { cuda::set_grouped_defaults(d); }
  } restore{d0};
  const WgradSet w;
  Tensor c = on_gpu(w.c0, {w.num_problems() * w.rows_c, w.ldc}, DType::f32);
  // Widening through wmma: the NN shape it does not take becomes an error naming it.
  cuda::GroupedDefaults d = d0;
  d.widening = cuda::GroupedAlgo::wmma;
  cuda::set_grouped_defaults(d);
  test::expect_error_contains(
      [&] {
        cuda::gemm_grouped(false, false, w.problems(c), 1.0f, DType::bf16, w.lda, w.ldb, 1.0f,
                           DType::f32, w.ldc, 0);
      },
      "is not supported by algorithm wmma");
  // ... and the TN shape it takes matches the reference (summed in another order than cuBLAS).
  cuda::gemm_grouped(true, false, w.problems(c), 1.0f, DType::bf16, w.lda, w.ldb, 1.0f,
                     DType::f32, w.ldc, 0);
  w.expect_matches(c.to_floats(), w.reference(1.0, 1.0, w.c0), w.c0, "wmma via defaults");
#endif
}

// ---- linear / matmul on CUDA tensors vs the CPU path ------------------------------------------

class LinearGpu : public ::testing::TestWithParam<DType> {};

TEST_P(LinearGpu, ForwardBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 71, in = 130, out = 229;
  const Tensor x = Tensor::from_floats(test::randn(T * in, 50), {T, in}, dt);
  const Tensor w = Tensor::from_floats(test::randn(out * in, 51, 0.1f), {out, in}, dt);
  const Tensor b = Tensor::from_floats(test::randn(out, 52), {out}, dt);
  const Tensor dy = Tensor::from_floats(test::randn(T * out, 53), {T, out}, dt);
  const auto w0 = test::randn(out * in, 54), b0 = test::randn(out, 55);
  const double tol = tol_for(dt);

  for (bool with_bias : {true, false}) {
    const Tensor y_cpu = linear_forward(x, w, with_bias ? b : Tensor());
    const Tensor y_gpu = linear_forward(x.to(kGpu), w.to(kGpu), with_bias ? b.to(kGpu) : Tensor());
    EXPECT_EQ(y_gpu.dtype(), dt);
    EXPECT_EQ(y_gpu.device(), kGpu);
    EXPECT_EQ(y_gpu.category(), MemCategory::activations);
    EXPECT_LT(test::rel_error(y_gpu.to_floats(), y_cpu.to_floats()), tol) << "bias " << with_bias;
  }
  const Tensor dx_cpu = linear_backward_data(dy, w);
  const Tensor dx_gpu = linear_backward_data(dy.to(kGpu), w.to(kGpu));
  EXPECT_EQ(dx_gpu.dtype(), DType::f32);
  EXPECT_LT(test::rel_error(dx_gpu.to_floats(), dx_cpu.to_floats()), test::kTolF32);
  // A bf16 d_x written by the GEMM (attention's d_o): within one bf16 rounding of the f32 one.
  {
    const Tensor dx16 = linear_backward_data(dy.to(kGpu), w.to(kGpu), DType::bf16);
    EXPECT_EQ(dx16.dtype(), DType::bf16);
    EXPECT_EQ(dx16.category(), MemCategory::activations);
    EXPECT_LT(test::rel_error(dx16.to_floats(), dx_cpu.to_floats()), test::kTolBf16);
  }
  // Accumulating onto an existing gradient (the GEMM's beta = 1) is computing it and adding it.
  {
    const auto base = test::randn(T * in, 56);
    Tensor acc = Tensor::from_floats(base, {T, in}).to(kGpu, MemCategory::grads);
    linear_backward_data_acc(dy.to(kGpu), w.to(kGpu), acc);
    auto expect = base;
    const auto d = dx_gpu.to_floats();
    for (size_t i = 0; i < expect.size(); ++i) expect[i] += d[i];
    EXPECT_LT(test::rel_error(acc.to_floats(), expect), test::kTolF32);
  }

  // Gradients start random (accumulation) and get two calls.
  Tensor dw_cpu = Tensor::from_floats(w0, {out, in}), db_cpu = Tensor::from_floats(b0, {out});
  Tensor dw_gpu = dw_cpu.to(kGpu, MemCategory::grads), db_gpu = db_cpu.to(kGpu, MemCategory::grads);
  for (int rep = 0; rep < 2; ++rep) {
    linear_backward_weight(dy, x, dw_cpu, &db_cpu);
    linear_backward_weight(dy.to(kGpu), x.to(kGpu), dw_gpu, &db_gpu);
  }
  EXPECT_LT(test::rel_error(dw_gpu.to_floats(), dw_cpu.to_floats()), test::kTolF32);
  EXPECT_LT(test::rel_error(db_gpu.to_floats(), db_cpu.to_floats()), test::kTolF32);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearGpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

TEST(LinearGpuEdge, MatmulAllTransposesMatchCpu) {
  BB_REQUIRE_GPU();
  const int64_t M = 71, N = 229, K = 130;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a =
          Tensor::from_floats(test::randn(M * K, 60), ta ? Shape{K, M} : Shape{M, K}, DType::bf16);
      const Tensor b = Tensor::from_floats(test::randn(K * N, 61), tb ? Shape{N, K} : Shape{K, N});
      const auto c0 = test::randn(M * N, 62);
      Tensor c_cpu = Tensor::from_floats(c0, {M, N});
      Tensor c_gpu = c_cpu.to(kGpu);
      matmul(a, ta, b, tb, c_cpu, 0.5f, 1.0f);
      matmul(a.to(kGpu), ta, b.to(kGpu), tb, c_gpu, 0.5f, 1.0f);
      EXPECT_LT(test::rel_error(c_gpu.to_floats(), c_cpu.to_floats()), test::kTolF32)
          << "ta " << ta << " tb " << tb;
    }
}

TEST(LinearGpuEdge, DeviceMismatchIsAClearError) {
  BB_REQUIRE_GPU();
  const Tensor x = Tensor::from_floats(test::randn(12, 70), {3, 4});
  const Tensor w = Tensor::from_floats(test::randn(20, 71), {5, 4});
  test::expect_error_contains([&] { linear_forward(x.to(kGpu), w, Tensor()); },
                              "linear_forward: tensors on different devices (cuda:0 and cpu)");
  Tensor c = Tensor::zeros({3, 5}, DType::f32, kGpu, MemCategory::other);
  test::expect_error_contains([&] { matmul(x.to(kGpu), false, w.to(kGpu), false, c); },
                              "matmul: inner dimensions differ");
}

}  // namespace
}  // namespace bb

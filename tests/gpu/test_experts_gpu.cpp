// Expert MLPs on the GPU (sequential: one cuBLASLt GEMM per expert; grouped: one grouped GEMM
// per projection) against the CPU path of the same Tensor API.
// Legend: N permuted rows, H hidden, F ffn dim, E experts.
//
// Each stage gets identical inputs on both sides (the CPU forward's saved tensors and dgrad are
// copied to the GPU for the backward halves), so each comparison measures one stage's rounding:
// bf16 storage 1e-2, f32 1e-4 (common/gpu.h). Counts include empty experts, a single-row expert
// and uneven loads; H and F that divide no tile size; row_prob defined and undefined.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/moe/experts.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/gemm.h"
#endif

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

struct Shape3 {
  std::vector<int64_t> counts;
  int64_t H, F;
};

const Shape3 kOdd{{7, 0, 13, 1, 40, 0, 10}, 37, 29};
const Shape3 kWide{{64, 3, 0, 129}, 128, 96};

struct Inputs {
  int64_t E, N, H, F;
  std::vector<int64_t> counts;
  Tensor x, wgu, wd, prob, dy;  // CPU tensors (dtype dt; prob f32)
};

Inputs make_inputs(const Shape3& s, DType dt, uint64_t seed) {
  Inputs in;
  in.counts = s.counts;
  in.E = static_cast<int64_t>(s.counts.size());
  in.N = std::accumulate(s.counts.begin(), s.counts.end(), int64_t{0});
  in.H = s.H;
  in.F = s.F;
  const float wstd_up = 1.0f / std::sqrt(static_cast<float>(s.H));
  const float wstd_down = 1.0f / std::sqrt(static_cast<float>(s.F));
  in.x = Tensor::from_floats(test::randn(in.N * in.H, seed), {in.N, in.H}, dt);
  in.wgu = Tensor::from_floats(test::randn(in.E * 2 * in.F * in.H, seed + 1, wstd_up),
                               {in.E, 2 * in.F, in.H}, dt);
  in.wd = Tensor::from_floats(test::randn(in.E * in.H * in.F, seed + 2, wstd_down),
                              {in.E, in.H, in.F}, dt);
  in.prob = Tensor::from_floats(test::randu(in.N, seed + 3, 0.2f, 1.0f), {in.N});
  in.dy = Tensor::from_floats(test::randn(in.N * in.H, seed + 4), {in.N, in.H}, dt);
  return in;
}

Tensor gpu(const Tensor& t) {
  return t.defined() ? t.to(kGpu) : Tensor();
}

using Case = std::tuple<ExpertsImpl, bool, DType, int>;

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const auto& [impl, with_prob, dt, shape] = info.param;
  return std::string(impl == ExpertsImpl::sequential ? "seq" : "grouped") +
         (with_prob ? "_prob_" : "_noprob_") + dtype_name(dt) + (shape == 0 ? "_odd" : "_wide");
}

class ExpertsGpu : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertsGpu, EveryStageMatchesCpu) {
  BB_REQUIRE_GPU();
  const auto& [impl, with_prob, dt, shape] = GetParam();
  const Inputs in = make_inputs(shape == 0 ? kOdd : kWide, dt, 300 + shape);
  const double tol = dt == DType::bf16 ? test::kTolBf16 : test::kTolF32;
  const Tensor prob = with_prob ? in.prob : Tensor();
  const Tensor x_g = gpu(in.x), wgu_g = gpu(in.wgu), wd_g = gpu(in.wd), prob_g = gpu(prob),
               dy_g = gpu(in.dy);

  // Forward.
  ExpertsSaved sc, sg;
  const Tensor y_c = experts_forward(impl, in.x, in.counts, in.wgu, in.wd, prob, &sc);
  const Tensor y_g = experts_forward(impl, x_g, in.counts, wgu_g, wd_g, prob_g, &sg);
  EXPECT_EQ(y_g.device(), kGpu);
  EXPECT_EQ(y_g.dtype(), dt);
  EXPECT_EQ(y_g.category(), MemCategory::moe);
  EXPECT_EQ(sg.gate_up.category(), MemCategory::activations);
  EXPECT_EQ(sg.act.category(), MemCategory::activations);
  EXPECT_LT(test::rel_error(y_g.to_floats(), y_c.to_floats()), tol) << "y";
  EXPECT_LT(test::rel_error(sg.gate_up.to_floats(), sc.gate_up.to_floats()), tol) << "gate_up";
  EXPECT_LT(test::rel_error(sg.act.to_floats(), sc.act.to_floats()), tol) << "act";

  // Backward data from the CPU's saved tensors.
  const ExpertsSaved s_in{gpu(sc.gate_up), gpu(sc.act)};
  const ExpertsDgrad dc = experts_backward_data(impl, in.dy, in.counts, in.wgu, in.wd, prob, sc);
  const ExpertsDgrad dg = experts_backward_data(impl, dy_g, in.counts, wgu_g, wd_g, prob_g, s_in);
  EXPECT_EQ(dg.d_x.dtype(), dt);
  EXPECT_EQ(dg.d_x.category(), MemCategory::moe);
  EXPECT_EQ(dg.d_gate_up.category(), MemCategory::activations);
  EXPECT_LT(test::rel_error(dg.d_x.to_floats(), dc.d_x.to_floats()), tol) << "d_x";
  EXPECT_LT(test::rel_error(dg.d_gate_up.to_floats(), dc.d_gate_up.to_floats()), tol)
      << "d_gate_up";
  ASSERT_EQ(dg.d_row_prob.defined(), with_prob);
  if (with_prob) {
    EXPECT_EQ(dg.d_row_prob.dtype(), DType::f32);
    EXPECT_LT(test::rel_error(dg.d_row_prob.to_floats(), dc.d_row_prob.to_floats()), tol)
        << "d_row_prob";
  }

  // Backward weight from the CPU's dgrad, into random (nonzero) f32 gradients: +=.
  ExpertsDgrad dgrad_in;
  dgrad_in.d_gate_up = gpu(dc.d_gate_up);
  const auto gu0 = test::randn(in.E * 2 * in.F * in.H, 400),
             gd0 = test::randn(in.E * in.H * in.F, 401);
  Tensor dwgu_c = Tensor::from_floats(gu0, {in.E, 2 * in.F, in.H});
  Tensor dwd_c = Tensor::from_floats(gd0, {in.E, in.H, in.F});
  Tensor dwgu_g = dwgu_c.to(kGpu, MemCategory::grads), dwd_g = dwd_c.to(kGpu, MemCategory::grads);
  experts_backward_weight(impl, in.dy, in.x, in.counts, prob, sc, dc, dwgu_c, dwd_c);
  experts_backward_weight(impl, dy_g, x_g, in.counts, prob_g, s_in, dgrad_in, dwgu_g, dwd_g);
  // Compare the increments (the random start would hide errors in them otherwise).
  auto increment = [](const std::vector<float>& after, const std::vector<float>& before) {
    std::vector<double> d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(after[i]) - before[i];
    return d;
  };
  const auto inc_gu_c = increment(dwgu_c.to_floats(), gu0),
             inc_gu_g = increment(dwgu_g.to_floats(), gu0);
  const auto inc_d_c = increment(dwd_c.to_floats(), gd0),
             inc_d_g = increment(dwd_g.to_floats(), gd0);
  EXPECT_LT(test::rel_error(inc_gu_g, inc_gu_c), tol) << "d_w_gate_up";
  EXPECT_LT(test::rel_error(inc_d_g, inc_d_c), tol) << "d_w_down";
  // Empty experts' gradient slices are untouched, bit for bit.
  const auto dwgu_after = dwgu_g.to_floats();
  for (int64_t e = 0; e < in.E; ++e) {
    if (in.counts[e] != 0) continue;
    const int64_t n = 2 * in.F * in.H;
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(dwgu_after[e * n + i], gu0[e * n + i]) << "expert " << e;
  }

  // f32: the GPU's own chain (its saved tensors into its backward) matches too.
  if (dt == DType::f32) {
    const ExpertsDgrad dg2 = experts_backward_data(impl, dy_g, in.counts, wgu_g, wd_g, prob_g, sg);
    EXPECT_LT(test::rel_error(dg2.d_x.to_floats(), dc.d_x.to_floats()), tol) << "chained d_x";
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ExpertsGpu,
    ::testing::Combine(::testing::Values(ExpertsImpl::sequential, ExpertsImpl::grouped),
                       ::testing::Bool(), ::testing::Values(DType::f32, DType::bf16),
                       ::testing::Values(0, 1)),
    case_name);

class ExpertsGpuEdge : public ::testing::TestWithParam<ExpertsImpl> {};

TEST_P(ExpertsGpuEdge, Bf16GradientsAccumulate) {
  BB_REQUIRE_GPU();
  const ExpertsImpl impl = GetParam();
  const Inputs in = make_inputs(kOdd, DType::bf16, 500);
  ExpertsSaved sc;
  experts_forward(impl, in.x, in.counts, in.wgu, in.wd, in.prob, &sc);
  const ExpertsDgrad dc = experts_backward_data(impl, in.dy, in.counts, in.wgu, in.wd, in.prob, sc);
  // bf16 gradient tensors (the grouped path runs cuBLAS bf16 -> bf16 with beta = 1).
  const auto gu0 = test::randn(in.E * 2 * in.F * in.H, 501),
             gd0 = test::randn(in.E * in.H * in.F, 502);
  Tensor dwgu_c = Tensor::from_floats(gu0, {in.E, 2 * in.F, in.H}, DType::bf16);
  Tensor dwd_c = Tensor::from_floats(gd0, {in.E, in.H, in.F}, DType::bf16);
  Tensor dwgu_g = gpu(dwgu_c), dwd_g = gpu(dwd_c);
  const ExpertsSaved s_in{gpu(sc.gate_up), gpu(sc.act)};
  ExpertsDgrad dgrad_in;
  dgrad_in.d_gate_up = gpu(dc.d_gate_up);
  experts_backward_weight(impl, in.dy, in.x, in.counts, in.prob, sc, dc, dwgu_c, dwd_c);
  experts_backward_weight(impl, gpu(in.dy), gpu(in.x), in.counts, gpu(in.prob), s_in, dgrad_in,
                          dwgu_g, dwd_g);
  EXPECT_EQ(dwgu_g.dtype(), DType::bf16);
  EXPECT_LT(test::rel_error(dwgu_g.to_floats(), dwgu_c.to_floats()), test::kTolBf16);
  EXPECT_LT(test::rel_error(dwd_g.to_floats(), dwd_c.to_floats()), test::kTolBf16);
}

// accumulate = false on the GPU (the first write of a step into lazily zeroed gradients): NaN in
// the gradients is ignored, empty experts get zeros, and the result equals adding into zeros (to
// rounding: cuBLASLt may pick another kernel for beta 0); f32 and bf16 gradients.
TEST_P(ExpertsGpuEdge, WeightGradientsOverwriteWhenNotAccumulating) {
  BB_REQUIRE_GPU();
  const ExpertsImpl impl = GetParam();
  const Inputs in = make_inputs(kOdd, DType::bf16, 520);
  const Tensor x = gpu(in.x), dy = gpu(in.dy), wgu = gpu(in.wgu), wd = gpu(in.wd), prob = gpu(in.prob);
  ExpertsSaved s;
  experts_forward(impl, x, in.counts, wgu, wd, prob, &s);
  const ExpertsDgrad d = experts_backward_data(impl, dy, in.counts, wgu, wd, prob, s);
  for (DType gdt : {DType::f32, DType::bf16}) {
    Tensor add_gu = Tensor::zeros({in.E, 2 * in.F, in.H}, gdt, kGpu, MemCategory::grads);
    Tensor add_d = Tensor::zeros({in.E, in.H, in.F}, gdt, kGpu, MemCategory::grads);
    experts_backward_weight(impl, dy, x, in.counts, prob, s, d, add_gu, add_d);
    Tensor w_gu = Tensor::zeros({in.E, 2 * in.F, in.H}, gdt, kGpu, MemCategory::grads);
    Tensor w_d = Tensor::zeros({in.E, in.H, in.F}, gdt, kGpu, MemCategory::grads);
    w_gu.fill_(std::nan(""));
    w_d.fill_(std::nan(""));
    experts_backward_weight(impl, dy, x, in.counts, prob, s, d, w_gu, w_d, /*accumulate=*/false);
    const double tol = gdt == DType::f32 ? 1e-5 : test::kTolBf16;
    EXPECT_LT(test::rel_error(w_gu.to_floats(), add_gu.to_floats()), tol) << dtype_name(gdt);
    EXPECT_LT(test::rel_error(w_d.to_floats(), add_d.to_floats()), tol) << dtype_name(gdt);
    // Experts without rows (kOdd has two): exactly zero.
    const std::vector<float> gd = w_d.to_floats();
    for (size_t e = 0; e < in.counts.size(); ++e)
      if (in.counts[e] == 0)
        for (int64_t i = 0; i < in.H * in.F; ++i) ASSERT_EQ(gd[e * in.H * in.F + i], 0.0f) << "expert " << e;
  }
}

// experts_forward_saved on the GPU: the forward's saved tensors bit for bit (the same kernels up
// to the activation), no output.
TEST_P(ExpertsGpuEdge, ForwardSavedEqualsTheForwardsSavedTensors) {
  BB_REQUIRE_GPU();
  const ExpertsImpl impl = GetParam();
  for (DType dt : {DType::f32, DType::bf16}) {
    const Inputs in = make_inputs(kOdd, dt, 550);
    ExpertsSaved full, only;
    experts_forward(impl, gpu(in.x), in.counts, gpu(in.wgu), gpu(in.wd), gpu(in.prob), &full);
    experts_forward_saved(impl, gpu(in.x), in.counts, gpu(in.wgu), gpu(in.wd), gpu(in.prob), only);
    EXPECT_EQ(only.gate_up.to_floats(), full.gate_up.to_floats()) << dtype_name(dt);
    EXPECT_EQ(only.act.to_floats(), full.act.to_floats()) << dtype_name(dt);
  }
}

TEST_P(ExpertsGpuEdge, AllExpertsEmpty) {
  BB_REQUIRE_GPU();
  const ExpertsImpl impl = GetParam();
  const int64_t E = 3, H = 8, F = 6;
  const std::vector<int64_t> counts{0, 0, 0};
  const Tensor x = Tensor::empty({0, H}, DType::bf16, kGpu, MemCategory::moe);
  const Tensor wgu =
      Tensor::from_floats(test::randn(E * 2 * F * H, 600), {E, 2 * F, H}, DType::bf16).to(kGpu);
  const Tensor wd =
      Tensor::from_floats(test::randn(E * H * F, 601), {E, H, F}, DType::bf16).to(kGpu);
  ExpertsSaved saved;
  const Tensor y = experts_forward(impl, x, counts, wgu, wd, Tensor(), &saved);
  EXPECT_EQ(y.shape(), (Shape{0, H}));
  EXPECT_EQ(saved.act.shape(), (Shape{0, F}));
  const ExpertsDgrad g = experts_backward_data(impl, x, counts, wgu, wd, Tensor(), saved);
  EXPECT_EQ(g.d_x.shape(), (Shape{0, H}));
  EXPECT_EQ(g.d_gate_up.shape(), (Shape{0, 2 * F}));
  const auto g0 = test::randn(E * 2 * F * H, 602);
  Tensor dwgu = Tensor::from_floats(g0, {E, 2 * F, H}).to(kGpu);
  Tensor dwd = Tensor::zeros({E, H, F}, DType::f32, kGpu, MemCategory::grads);
  experts_backward_weight(impl, x, x, counts, Tensor(), saved, g, dwgu, dwd);
  EXPECT_EQ(dwgu.to_floats(), g0);
}

TEST_P(ExpertsGpuEdge, DeviceMismatchIsAClearError) {
  BB_REQUIRE_GPU();
  const ExpertsImpl impl = GetParam();
  const Inputs in = make_inputs({{2, 1}, 4, 3}, DType::f32, 700);
  test::expect_error_contains(
      [&] { experts_forward(impl, gpu(in.x), in.counts, in.wgu, gpu(in.wd), Tensor(), nullptr); },
      "experts_forward: argument 'w_gate_up' is on cpu but the rows are on cuda:0");
  test::expect_error_contains(
      [&] {
        experts_forward(impl, gpu(in.x), in.counts, gpu(in.wgu), gpu(in.wd), in.prob, nullptr);
      },
      "argument 'row_prob' is on cpu but the rows are on cuda:0");
}

INSTANTIATE_TEST_SUITE_P(Impls, ExpertsGpuEdge,
                         ::testing::Values(ExpertsImpl::sequential, ExpertsImpl::grouped),
                         [](const testing::TestParamInfo<ExpertsImpl>& i) {
                           return std::string(i.param == ExpertsImpl::sequential ? "seq"
                                                                                 : "grouped");
                         });

// `grouped` under each grouped-GEMM algorithm against `sequential`, both on the GPU with the
// same bf16 inputs and row_prob. multi_stream issues the very cuBLASLt plans the sequential path
// issues, so every output is bit-identical whatever the stream count; the cuBLAS grouped
// forward/dgrad and the WMMA wgrad sum in another order (bf16 / f32 tolerances).
TEST(ExpertsGpuAlgos, GroupedAlgorithmsMatchSequential) {
  BB_REQUIRE_GPU();
#ifdef BB_WITH_CUDA
  const Inputs in = make_inputs({{64, 3, 0, 129, 200, 1, 77, 0, 250}, 136, 104}, DType::bf16, 800);
  const Tensor x = gpu(in.x), wgu = gpu(in.wgu), wd = gpu(in.wd), prob = gpu(in.prob),
               dy = gpu(in.dy);
  const auto gu0 = test::randn(in.E * 2 * in.F * in.H, 801),
             gd0 = test::randn(in.E * in.H * in.F, 802);
  struct Out {
    std::vector<float> y, d_x, d_gate_up, d_row_prob, dwgu, dwd;
  };
  auto run = [&](ExpertsImpl impl) {
    Out o;
    ExpertsSaved s;
    o.y = experts_forward(impl, x, in.counts, wgu, wd, prob, &s).to_floats();
    const ExpertsDgrad d = experts_backward_data(impl, dy, in.counts, wgu, wd, prob, s);
    o.d_x = d.d_x.to_floats();
    o.d_gate_up = d.d_gate_up.to_floats();
    o.d_row_prob = d.d_row_prob.to_floats();
    Tensor dwgu = Tensor::from_floats(gu0, {in.E, 2 * in.F, in.H}).to(kGpu, MemCategory::grads);
    Tensor dwd = Tensor::from_floats(gd0, {in.E, in.H, in.F}).to(kGpu, MemCategory::grads);
    experts_backward_weight(impl, dy, x, in.counts, prob, s, d, dwgu, dwd);
    o.dwgu = dwgu.to_floats();
    o.dwd = dwd.to_floats();
    return o;
  };
  auto increment = [](const std::vector<float>& after, const std::vector<float>& before) {
    std::vector<double> d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(after[i]) - before[i];
    return d;
  };
  const cuda::GroupedDefaults d0 = cuda::grouped_defaults();
  struct Restore {
    cuda::GroupedDefaults d;
    ~Restore() { cuda::set_grouped_defaults(d); }
  } restore{d0};

  const Out seq = run(ExpertsImpl::sequential);
  for (int streams : {1, 4, cuda::kMaxGroupedStreams}) {
    cuda::set_grouped_defaults(
        {cuda::GroupedAlgo::multi_stream, cuda::GroupedAlgo::multi_stream, streams});
    const Out g = run(ExpertsImpl::grouped);
    // Whole-vector equality as a bool (printing the vectors would flood the log).
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i]) return false;
      return true;
    };
    EXPECT_TRUE(same(g.y, seq.y)) << "y, S=" << streams;
    EXPECT_TRUE(same(g.d_x, seq.d_x)) << "d_x, S=" << streams;
    EXPECT_TRUE(same(g.d_gate_up, seq.d_gate_up)) << "d_gate_up, S=" << streams;
    EXPECT_TRUE(same(g.d_row_prob, seq.d_row_prob)) << "d_row_prob, S=" << streams;
    EXPECT_TRUE(same(g.dwgu, seq.dwgu)) << "d_w_gate_up, S=" << streams;
    EXPECT_TRUE(same(g.dwd, seq.dwd)) << "d_w_down, S=" << streams;
  }
  // Our mma tile kernel for every stage (min_flops out of reach: no call goes to multi_stream).
  {
    cuda::GroupedDefaults dm;
    dm.same_dtype = cuda::GroupedAlgo::mma;
    dm.widening = cuda::GroupedAlgo::mma;
    dm.multi_stream_min_flops = 1e30;
    cuda::set_grouped_defaults(dm);
    const Out m = run(ExpertsImpl::grouped);
    EXPECT_LT(test::rel_error(m.y, seq.y), test::kTolBf16) << "y, mma";
    EXPECT_LT(test::rel_error(m.d_x, seq.d_x), test::kTolBf16) << "d_x, mma";
    EXPECT_LT(test::rel_error(m.d_gate_up, seq.d_gate_up), test::kTolBf16) << "d_gate_up, mma";
    EXPECT_LT(test::rel_error(m.d_row_prob, seq.d_row_prob), test::kTolBf16) << "d_row_prob, mma";
    EXPECT_LT(test::rel_error(increment(m.dwgu, gu0), increment(seq.dwgu, gu0)), test::kTolBf16)
        << "d_w_gate_up, mma";
    EXPECT_LT(test::rel_error(increment(m.dwd, gd0), increment(seq.dwd, gd0)), test::kTolBf16)
        << "d_w_down, mma";
  }
  cuda::set_grouped_defaults({cuda::GroupedAlgo::cublas, cuda::GroupedAlgo::wmma, 4});
  const Out w = run(ExpertsImpl::grouped);
  EXPECT_LT(test::rel_error(w.y, seq.y), test::kTolBf16) << "y, cublas";
  EXPECT_LT(test::rel_error(w.d_x, seq.d_x), test::kTolBf16) << "d_x, cublas";
  // wgrad inputs are the GPU's own dgrad (cuBLAS grouped here): compare against the sequential
  // wgrad of the same inputs, so only the WMMA summation order differs.
  ExpertsSaved s;
  experts_forward(ExpertsImpl::sequential, x, in.counts, wgu, wd, prob, &s);
  const ExpertsDgrad d = experts_backward_data(ExpertsImpl::sequential, dy, in.counts, wgu, wd,
                                               prob, s);
  Tensor a_gu = Tensor::from_floats(gu0, {in.E, 2 * in.F, in.H}).to(kGpu, MemCategory::grads);
  Tensor a_d = Tensor::from_floats(gd0, {in.E, in.H, in.F}).to(kGpu, MemCategory::grads);
  Tensor b_gu = a_gu.clone(), b_d = a_d.clone();
  experts_backward_weight(ExpertsImpl::sequential, dy, x, in.counts, prob, s, d, a_gu, a_d);
  experts_backward_weight(ExpertsImpl::grouped, dy, x, in.counts, prob, s, d, b_gu, b_d);
  EXPECT_LT(test::rel_error(increment(b_gu.to_floats(), gu0), increment(a_gu.to_floats(), gu0)),
            test::kTolF32)
      << "d_w_gate_up, wmma";
  EXPECT_LT(test::rel_error(increment(b_d.to_floats(), gd0), increment(a_d.to_floats(), gd0)),
            test::kTolF32)
      << "d_w_down, wmma";
#endif
}

}  // namespace
}  // namespace bb

// Row movements on CUDA against their CPU path: the context-parallel data movements (cp_ops.h:
// row gathers (f32 and bf16), scatter-adds, lse column gathers, the log-sum-exp merge, head
// split / join, assign and accumulate with replicated heads) and the MoE dispatchers' run copies
// (dispatcher_rows.h: one kernel over a run table past a few runs), on random inputs and odd sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/attention/cp_ops.h"
#include "primitives/moe/dispatcher_rows.h"

namespace bb {
namespace {

using test::randn;

const Device kGpu = Device::cuda(0);

Tensor rnd(const Shape& s, uint64_t seed, DType dt = DType::f32) {
  return Tensor::from_floats(randn(static_cast<size_t>(shape_numel(s)), seed), s).to_dtype(dt);
}

void expect_close(const Tensor& gpu, const Tensor& cpu, double tol) {
  const std::vector<float> a = gpu.to_floats(), b = cpu.to_floats();
  ASSERT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), tol);
}

TEST(CpOpsGpu, MovesAndMergeMatchTheCpu) {
  BB_REQUIRE_GPU();
  const int64_t T = 131, H = 6, D = 40;
  const std::vector<int64_t> rows = {130, 0, 7, 64, 65, 3, 99};
  const auto n = static_cast<int64_t>(rows.size());
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = rnd({T, H, D}, 1, dt);
    // Gathers are copies: exact.
    EXPECT_EQ(cp::gather_rows(x.to(kGpu), rows, MemCategory::other).to_floats(),
              cp::gather_rows(x, rows, MemCategory::other).to_floats());
    const Tensor src = rnd({n, H * D}, 2, dt);
    Tensor acc_c = rnd({T, H * D}, 3), acc_g = acc_c.to(kGpu);
    cp::scatter_add_rows(acc_c, src, rows);
    cp::scatter_add_rows(acc_g, src.to(kGpu), rows);
    expect_close(acc_g, acc_c, test::kTolF32);
    const std::vector<int64_t> starts = {0, 3};
    const Tensor sp_c = cp::split_heads(x, starts, 3, MemCategory::other);
    EXPECT_EQ(cp::split_heads(x.to(kGpu), starts, 3, MemCategory::other).to_floats(), sp_c.to_floats());
    Tensor back_c = Tensor::zeros({T, H, D}, dt, Device::cpu(), MemCategory::other), back_g = back_c.to(kGpu);
    cp::join_heads(back_c, sp_c, starts, 3, false);
    cp::join_heads(back_g, sp_c.to(kGpu), starts, 3, false);
    EXPECT_EQ(back_g.to_floats(), back_c.to_floats());
    EXPECT_EQ(back_c.to_floats(), x.to_floats());
    // Replicated heads accumulate (head 2 from three peers).
    const std::vector<int64_t> rep = {2, 2, 2, 5};
    const Tensor blocks = cp::split_heads(x, rep, 1, MemCategory::other);
    Tensor sum_c = Tensor::zeros({T, H, D}, DType::f32, Device::cpu(), MemCategory::other), sum_g = sum_c.to(kGpu);
    cp::join_heads(sum_c, blocks, rep, 1, true);
    cp::join_heads(sum_g, blocks.to(kGpu), rep, 1, true);
    expect_close(sum_g, sum_c, test::kTolF32);
    // The merge, with rows where the partial or the accumulator has seen nothing (-inf).
    Tensor o_c = rnd({T, H, D}, 4), lse_c = rnd({H, T}, 5);
    std::vector<float> lp = randn(static_cast<size_t>(H * n), 6);
    lp[0] = -std::numeric_limits<float>::infinity();
    lp[static_cast<size_t>(H * n - 1)] = -std::numeric_limits<float>::infinity();
    const Tensor lse_p = Tensor::from_floats(lp, {H, n});
    const Tensor o_p = rnd({n, H, D}, 7, dt);
    Tensor o_g = o_c.to(kGpu), lse_g = lse_c.to(kGpu);
    cp::merge_partial(o_c, lse_c, o_p, lse_p, rows);
    cp::merge_partial(o_g, lse_g, o_p.to(kGpu), lse_p.to(kGpu), rows);
    expect_close(o_g, o_c, test::kTolF32);
    expect_close(lse_g, lse_c, test::kTolF32);
  }
  const Tensor lse = rnd({H, T}, 8);
  EXPECT_EQ(cp::gather_cols(lse.to(kGpu), rows, MemCategory::other).to_floats(),
            cp::gather_cols(lse, rows, MemCategory::other).to_floats());
}

// The head split / join move whole rows in 16-byte words when the rows allow it (Gated DeltaNet
// head groups, the context-parallel head exchange) and element by element otherwise: both paths
// copy exactly what the CPU path copies, blocks in any head order.
TEST(CpOpsGpu, HeadSplitAndJoinCopyExactlyOnEveryPath) {
  BB_REQUIRE_GPU();
  struct Case {
    int64_t T, H, D, hc;
    std::vector<int64_t> start;
    DType dt;
  };
  const std::vector<Case> cases = {
      {1000, 16, 128, 4, {0, 4, 8, 12}, DType::bf16},  // 16-byte words (Qwen3.5 q / k groups)
      {257, 32, 128, 8, {24, 8}, DType::f32},          // 16-byte words, part of the heads
      {50, 4, 8, 2, {2, 0}, DType::bf16},              // 16-byte heads, out of order
      {131, 6, 36, 3, {0, 3}, DType::bf16},            // 72-byte heads: element by element
      {77, 32, 1, 8, {0, 8, 16, 24}, DType::f32},      // [T, H] gates: element by element
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "T " << c.T << " H " << c.H << " D " << c.D << " hc " << c.hc << " "
                                    << dtype_name(c.dt));
    const Tensor x = rnd({c.T, c.H, c.D}, 11, c.dt);
    const Tensor sp_c = cp::split_heads(x, c.start, c.hc, MemCategory::other);
    const Tensor sp_g = cp::split_heads(x.to(kGpu), c.start, c.hc, MemCategory::other);
    EXPECT_EQ(sp_g.to_floats(), sp_c.to_floats());
    Tensor back_c = rnd({c.T, c.H, c.D}, 12, c.dt), back_g = back_c.to(kGpu);
    cp::join_heads(back_c, sp_c, c.start, c.hc, false);
    cp::join_heads(back_g, sp_g, c.start, c.hc, false);
    EXPECT_EQ(back_g.to_floats(), back_c.to_floats());
  }
}

// Thousands of short runs in shuffled order (as a chunked dispatch sorts rows), rows of f32, bf16
// and i32 with widths that are and are not multiples of 16 bytes: every copied row equals the
// CPU copy, every other row keeps its value.
TEST(RowRunsGpu, ManyRunsCopyExactlyLikeTheCpu) {
  BB_REQUIRE_GPU();
  for (int64_t width : {64, 3, 1}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " width " + std::to_string(width));
      const int64_t rows = 5000;
      const Tensor src = rnd({rows, width}, 11, dt);
      std::vector<dispatch::RowRun> runs;
      uint64_t state = 7;
      int64_t dst = 0;
      // Runs of 0..6 rows taken from scattered places, written back to back (some adjacent: merged).
      while (dst < rows - 8) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t n = static_cast<int64_t>((state >> 40) % 7);
        const int64_t from = static_cast<int64_t>((state >> 16) % static_cast<uint64_t>(rows - n));
        runs.push_back({dst, from, n});
        dst += n;
      }
      Tensor d_c = rnd({rows, width}, 12, dt), d_g = d_c.to(kGpu);
      dispatch::copy_rows(d_c, src, runs);
      dispatch::copy_rows(d_g, src.to(kGpu), runs);
      EXPECT_EQ(d_g.to_floats(), d_c.to_floats());
    }
  }
}

}  // namespace
}  // namespace bb

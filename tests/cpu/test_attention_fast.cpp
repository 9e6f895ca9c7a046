// The blocked f32 CPU attention (attention_cpu_fast.h, the path behind attention_forward /
// attention_backward) against the double-precision loop reference (attention_ref.h): o, lse, dq,
// dk, dv over GQA ratios, head dims, awkward sequence lengths around the block size, several
// block sizes and a non-default scale; the workspace it allocates; and, printed only, its speedup
// over the f32 loop reference on a demo-like shape.
// Legend: T tokens, Hq query heads, Hkv kv heads, D head dim, R block rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "primitives/attention/attention.h"
#include "primitives/attention/attention_cpu_fast.h"
#include "primitives/attention/attention_ref.h"

namespace bb {
namespace {

// f32 GEMM/softmax sums against double, relative L2 norm. Measured maxima over these tests:
// lse 1e-7, o 6e-7, dv 1.1e-6, dq and dk 2e-6.
constexpr double kFastTol = 1e-5;

struct Problem {
  std::vector<int32_t> lens;
  int64_t Hq, Hkv, D;
  float scale;

  std::vector<int32_t> cu() const {
    std::vector<int32_t> c{0};
    for (int32_t l : lens) c.push_back(c.back() + l);
    return c;
  }
  int64_t T() const { return cu().back(); }
  int64_t B() const { return static_cast<int64_t>(lens.size()); }
  size_t nq() const { return static_cast<size_t>(T() * Hq * D); }
  size_t nkv() const { return static_cast<size_t>(T() * Hkv * D); }
};

struct Inputs {
  std::vector<float> q, k, v, d_o;
};

Inputs make_inputs(const Problem& p, uint64_t seed) {
  return {test::randn(p.nq(), seed, 1.0f, 0), test::randn(p.nkv(), seed, 1.0f, 1u << 24),
          test::randn(p.nkv(), seed, 1.0f, 2u << 24), test::randn(p.nq(), seed, 1.0f, 3u << 24)};
}

template <class T>
struct Result {
  std::vector<T> o, lse, dq, dk, dv;
};

// The oracle: forward and backward of the loop reference in double.
Result<double> run_ref_double(const Problem& p, const Inputs& in) {
  const auto cu = p.cu();
  const auto q = test::cast<double>(in.q), k = test::cast<double>(in.k);
  const auto v = test::cast<double>(in.v), d_o = test::cast<double>(in.d_o);
  Result<double> r;
  r.o.resize(p.nq());
  r.lse.resize(static_cast<size_t>(p.Hq * p.T()));
  r.dq.resize(p.nq());
  r.dk.resize(p.nkv());
  r.dv.resize(p.nkv());
  ref::attention_forward<double>(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), cu.data(),
                                 p.B(), p.T(), p.Hq, p.Hkv, p.D, p.scale);
  ref::attention_backward<double>(r.dq.data(), r.dk.data(), r.dv.data(), d_o.data(), q.data(),
                                  k.data(), v.data(), r.o.data(), r.lse.data(), cu.data(), p.B(),
                                  p.T(), p.Hq, p.Hkv, p.D, p.scale);
  return r;
}

// The production path: the Tensor-level API on f32 tensors.
Result<float> run_api(const Problem& p, const Inputs& in) {
  Tensor q = Tensor::from_floats(in.q, {p.T(), p.Hq, p.D});
  Tensor k = Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D});
  Tensor v = Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D});
  Tensor d_o = Tensor::from_floats(in.d_o, {p.T(), p.Hq, p.D});
  Tensor cu = Tensor::from_ints(p.cu(), {p.B() + 1});
  AttentionSaved saved;
  Tensor o = attention_forward(q, k, v, AttentionArgs::causal_self(cu, p.scale), &saved);
  AttentionGrads g = attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(cu, p.scale), saved);
  return {o.to_floats(), saved.lse.to_floats(), g.dq.to_floats(), g.dk.to_floats(),
          g.dv.to_floats()};
}

// The raw kernels with an explicit block size; outputs are poisoned first so that a row the
// kernel forgets to write shows up.
Result<float> run_kernels(const Problem& p, const Inputs& in, int64_t block_rows) {
  const auto cu = p.cu();
  const int64_t max_len = *std::max_element(p.lens.begin(), p.lens.end());
  std::vector<float> ws(
      static_cast<size_t>(cpu::attention_fast_workspace_floats(max_len, max_len, block_rows)), NAN);
  Result<float> r;
  r.o.assign(p.nq(), NAN);
  r.lse.assign(static_cast<size_t>(p.Hq * p.T()), NAN);
  r.dq.assign(p.nq(), NAN);
  r.dk.assign(p.nkv(), NAN);
  r.dv.assign(p.nkv(), NAN);
  cpu::attention_forward_fast(r.o.data(), r.lse.data(), in.q.data(), in.k.data(), in.v.data(),
                              cu.data(), cu.data(), p.B(), p.T(), p.Hq, p.Hkv, p.D, p.scale,
                              ref::RefMask::causal, ws.data(), block_rows);
  cpu::attention_backward_fast(r.dq.data(), r.dk.data(), r.dv.data(), in.d_o.data(), in.q.data(),
                               in.k.data(), in.v.data(), r.o.data(), r.lse.data(), cu.data(),
                               cu.data(), p.B(), p.T(), p.T(), p.Hq, p.Hkv, p.D, p.scale,
                               ref::RefMask::causal, ws.data(), block_rows);
  return r;
}

void expect_close(const Result<float>& got, const Result<double>& want, const std::string& what) {
  EXPECT_LT(test::rel_error(got.o, want.o), kFastTol) << what << ": o";
  EXPECT_LT(test::rel_error(got.lse, want.lse), kFastTol) << what << ": lse";
  EXPECT_LT(test::rel_error(got.dq, want.dq), kFastTol) << what << ": dq";
  EXPECT_LT(test::rel_error(got.dk, want.dk), kFastTol) << what << ": dk";
  EXPECT_LT(test::rel_error(got.dv, want.dv), kFastTol) << what << ": dv";
  // A NaN anywhere makes the norms NaN and the checks above fail, but say where.
  for (const auto* x : {&got.o, &got.lse, &got.dq, &got.dk, &got.dv})
    EXPECT_TRUE(std::all_of(x->begin(), x->end(), [](float f) { return std::isfinite(f); }))
        << what << ": non-finite output";
}

// (G = Hq / Hkv, D)
class AttentionCpuFastShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(AttentionCpuFastShapes, MatchesDoubleReference) {
  const auto [G, D] = GetParam();
  const int32_t R = static_cast<int32_t>(cpu::kAttnBlockRows);
  // Empty sequences at the start, middle and end; 1 token; exactly one block; one block + 1;
  // a long sequence of several blocks with a partial last one.
  const Problem p{{0, 1, R, 0, R + 1, 300, 5, 0}, 2 * G, 2, D, 0.29f};
  const Inputs in = make_inputs(p, 7 + static_cast<uint64_t>(G * 1000 + D));
  expect_close(run_api(p, in), run_ref_double(p, in),
               "G=" + std::to_string(G) + " D=" + std::to_string(D));
}

INSTANTIATE_TEST_SUITE_P(GqaByHeadDim, AttentionCpuFastShapes,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 4),
                                            ::testing::Values<int64_t>(8, 32, 128)),
                         [](const auto& info) {
                           return "G" + std::to_string(std::get<0>(info.param)) + "_D" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(AttentionCpuFast, BlockSizesDoNotChangeTheResult) {
  // Small blocks make every sequence span many tiles: sizes that divide, do not divide, and
  // exceed the sequence lengths, and R = 1 (one query row per tile).
  const Problem p{{9, 0, 16, 17, 1, 40}, 6, 3, 16, 0.5f};
  const Inputs in = make_inputs(p, 2024);
  const Result<double> want = run_ref_double(p, in);
  for (int64_t R : {1, 3, 8, 16, 17, 64, 1000}) {
    const Result<float> got = run_kernels(p, in, R);
    expect_close(got, want, "R=" + std::to_string(R));
  }
}

TEST(AttentionCpuFast, LargeScoresMatchReference) {
  // Scores of order 1e2..1e3: the softmax max subtraction and exp clamp must hold up (most p
  // underflow to 0, one key per row dominates).
  const Problem p{{130, 70}, 4, 1, 32, 3.0f};
  const Inputs in = make_inputs(p, 99);
  expect_close(run_api(p, in), run_ref_double(p, in), "large scores");
}

TEST(AttentionCpuFast, WorkspaceIsBlockTimesLongestSequence) {
  // One long sequence: the scratch is [R, S] (x2 in the backward), never S x S, and it is
  // accounted under workspace and released after the call.
  const Problem p{{1000, 24}, 2, 1, 8, 0.35f};
  const Inputs in = make_inputs(p, 5);
  Tensor q = Tensor::from_floats(in.q, {p.T(), p.Hq, p.D});
  Tensor k = Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D});
  Tensor v = Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D});
  Tensor cu = Tensor::from_ints(p.cu(), {p.B() + 1});
  Allocator& a = allocator_for(Device::cpu());
  const int64_t live0 = a.stats().live_of(MemCategory::workspace);
  a.reset_peak();
  AttentionSaved saved;
  Tensor o = attention_forward(q, k, v, AttentionArgs::causal_self(cu, p.scale), &saved);
  AttentionGrads g = attention_backward(o, q, k, v, o, AttentionArgs::causal_self(cu, p.scale), saved);
  const MemoryStats st = a.stats();
  const int64_t expected = cpu::attention_fast_workspace_floats(1000, 1000) * 4;
  EXPECT_EQ(expected, (2 * cpu::kAttnBlockRows * 1000 + cpu::kAttnBlockRows) * 4);
  EXPECT_EQ(st.peak_of(MemCategory::workspace) - live0, expected);
  EXPECT_LT(expected, 1000 * 1000 * 4);
  EXPECT_EQ(st.live_of(MemCategory::workspace), live0);
}

TEST(AttentionCpuFast, SpeedupOverLoopReferenceOnDemoShape) {
  // Demo-like: T = 1024 packed from documents of 200..1000 tokens, Hq = 4, Hkv = 2, D = 32.
  // Printed, not asserted (timings depend on the machine); equality is asserted.
  const Problem p{{232, 512, 280}, 4, 2, 32, 1.0f / std::sqrt(32.0f)};
  const Inputs in = make_inputs(p, 31);
  const auto cu = p.cu();
  using clock = std::chrono::steady_clock;
  auto seconds = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };

  Result<float> slow;
  slow.o.resize(p.nq());
  slow.lse.resize(static_cast<size_t>(p.Hq * p.T()));
  slow.dq.resize(p.nq());
  slow.dk.resize(p.nkv());
  slow.dv.resize(p.nkv());
  auto t0 = clock::now();
  ref::attention_forward<float>(slow.o.data(), slow.lse.data(), in.q.data(), in.k.data(),
                                in.v.data(), cu.data(), p.B(), p.T(), p.Hq, p.Hkv, p.D, p.scale);
  const double ref_fwd = seconds(t0);
  t0 = clock::now();
  ref::attention_backward<float>(slow.dq.data(), slow.dk.data(), slow.dv.data(), in.d_o.data(),
                                 in.q.data(), in.k.data(), in.v.data(), slow.o.data(),
                                 slow.lse.data(), cu.data(), p.B(), p.T(), p.Hq, p.Hkv, p.D,
                                 p.scale);
  const double ref_bwd = seconds(t0);

  Tensor q = Tensor::from_floats(in.q, {p.T(), p.Hq, p.D});
  Tensor k = Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D});
  Tensor v = Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D});
  Tensor d_o = Tensor::from_floats(in.d_o, {p.T(), p.Hq, p.D});
  Tensor cu_t = Tensor::from_ints(cu, {p.B() + 1});
  double fast_fwd = 1e30, fast_bwd = 1e30;
  Result<float> fast;
  for (int rep = 0; rep < 5; ++rep) {  // best of 5: the first run also warms up BLAS
    AttentionSaved saved;
    t0 = clock::now();
    Tensor o = attention_forward(q, k, v, AttentionArgs::causal_self(cu_t, p.scale), &saved);
    fast_fwd = std::min(fast_fwd, seconds(t0));
    t0 = clock::now();
    AttentionGrads g = attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(cu_t, p.scale), saved);
    fast_bwd = std::min(fast_bwd, seconds(t0));
    fast = {o.to_floats(), saved.lse.to_floats(), g.dq.to_floats(), g.dk.to_floats(),
            g.dv.to_floats()};
  }
  std::printf(
      "[attention speed] T=1024 docs {232,512,280} Hq=4 Hkv=2 D=32: loop reference f32 "
      "fwd %.2f ms bwd %.2f ms; blocked fwd %.2f ms bwd %.2f ms; speedup fwd %.1fx bwd %.1fx "
      "fwd+bwd %.1fx\n",
      ref_fwd * 1e3, ref_bwd * 1e3, fast_fwd * 1e3, fast_bwd * 1e3, ref_fwd / fast_fwd,
      ref_bwd / fast_bwd, (ref_fwd + ref_bwd) / (fast_fwd + fast_bwd));
  // The f32 loop reference sums in double, so it is a fine oracle at this tolerance too.
  EXPECT_LT(test::rel_error(fast.o, slow.o), kFastTol);
  EXPECT_LT(test::rel_error(fast.dq, slow.dq), kFastTol);
  EXPECT_LT(test::rel_error(fast.dk, slow.dk), kFastTol);
  EXPECT_LT(test::rel_error(fast.dv, slow.dv), kFastTol);
}

// Query blocks against key blocks, every mask, several block sizes: the blocked kernels against
// the double loop reference (the same raw-pointer interface, poisoned outputs).
TEST(AttentionFast, BlocksOfQueriesAndKeysMatchReferenceForEveryMask) {
  struct BlockCase {
    std::vector<int32_t> lq, lk;
    ref::RefMask mask;
  };
  const std::vector<BlockCase> cases = {
      {{5, 1, 70, 0, 3}, {4, 66, 2, 3, 0}, ref::RefMask::none},
      {{3, 1, 65, 0, 2}, {90, 1, 130, 2, 5}, ref::RefMask::causal_bottom_right},
      {{3, 129}, {77, 2}, ref::RefMask::causal},
  };
  const int64_t Hq = 4, Hkv = 2, D = 16;
  const float scale = 0.3f;
  for (const BlockCase& c : cases)
    for (int64_t R : {1, 7, 64}) {
      SCOPED_TRACE("mask " + std::to_string(static_cast<int>(c.mask)) + " R " + std::to_string(R));
      std::vector<int32_t> cq{0}, ck{0};
      for (int32_t l : c.lq) cq.push_back(cq.back() + l);
      for (int32_t l : c.lk) ck.push_back(ck.back() + l);
      const int64_t B = static_cast<int64_t>(c.lq.size()), Tq = cq.back(), Tk = ck.back();
      const auto q = test::randn(Tq * Hq * D, 1), k = test::randn(Tk * Hkv * D, 2),
                 v = test::randn(Tk * Hkv * D, 3), d_o = test::randn(Tq * Hq * D, 4);
      std::vector<double> o_r(q.size()), lse_r(static_cast<size_t>(Hq * Tq)), dq_r(q.size()),
          dk_r(k.size()), dv_r(k.size());
      const auto qd = test::cast<double>(q), kd = test::cast<double>(k), vd = test::cast<double>(v),
                 dod = test::cast<double>(d_o);
      ref::attention_forward<double>(o_r.data(), lse_r.data(), qd.data(), kd.data(), vd.data(), cq.data(),
                                     ck.data(), B, Tq, Hq, Hkv, D, scale, c.mask);
      ref::attention_backward<double>(dq_r.data(), dk_r.data(), dv_r.data(), dod.data(), qd.data(), kd.data(),
                                      vd.data(), o_r.data(), lse_r.data(), cq.data(), ck.data(), B, Tq, Tk,
                                      Hq, Hkv, D, scale, c.mask);
      const int64_t mq = *std::max_element(c.lq.begin(), c.lq.end()),
                    mk = *std::max_element(c.lk.begin(), c.lk.end());
      std::vector<float> ws(static_cast<size_t>(cpu::attention_fast_workspace_floats(mq, mk, R)), NAN);
      std::vector<float> o(q.size(), NAN), lse(lse_r.size(), NAN), dq(q.size(), NAN), dk(k.size(), NAN),
          dv(k.size(), NAN);
      cpu::attention_forward_fast(o.data(), lse.data(), q.data(), k.data(), v.data(), cq.data(), ck.data(),
                                  B, Tq, Hq, Hkv, D, scale, c.mask, ws.data(), R);
      cpu::attention_backward_fast(dq.data(), dk.data(), dv.data(), d_o.data(), q.data(), k.data(),
                                   v.data(), o.data(), lse.data(), cq.data(), ck.data(), B, Tq, Tk, Hq,
                                   Hkv, D, scale, c.mask, ws.data(), R);
      EXPECT_LT(test::rel_error(o, o_r), kFastTol);
      // Queries with no key (the empty key sequence) have lse = -inf in both; the rest compare.
      std::vector<float> lse_f;
      std::vector<double> lse_rf;
      for (size_t i = 0; i < lse.size(); ++i) {
        if (std::isinf(lse_r[i])) {
          EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "lse " << i;
          continue;
        }
        lse_f.push_back(lse[i]);
        lse_rf.push_back(lse_r[i]);
      }
      EXPECT_LT(test::rel_error(lse_f, lse_rf), kFastTol);
      EXPECT_LT(test::rel_error(dq, dq_r), kFastTol);
      EXPECT_LT(test::rel_error(dk, dk_r), kFastTol);
      EXPECT_LT(test::rel_error(dv, dv_r), kFastTol);
    }
}

}  // namespace
}  // namespace bb

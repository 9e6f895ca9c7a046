// Gated DeltaNet primitives on CUDA against their CPU references.
//
// Causal conv1d (+ SiLU) over packed sequences: widths 1-4, sequences of 1, 2 and 3 tokens
// (shorter than the filter) beside long ones, channel counts that fill no warp, several dw
// chunks; dw must be bitwise reproducible and accumulate onto what d_w held.
//
// Gated delta rule (chunked kernels, chunk 64): forward o and all five gradients against the fp64
// recurrent reference run on the same (dtype-rounded) inputs, relative L2 error with the tolerance
// of the input dtype (gdn_tol below). Sequences of 1, 63, 64, 65 and 1000 tokens (a chunk of
// one token, one short of a chunk, exactly one, one over, and many with a partial last one), and
// packed mixes with empty and one-token sequences; f32 and bf16 q/k/v; with and without the L2
// norm; Hk = Hv (no GVA), Hk = 2 / Hv = 4 and Hk = 1 / Hv = 4 (GVA), K = V = 128 (Qwen3.5) and
// K = 64 / V = 32 (padded inside the kernels). A chunk boundary handled wrongly (a state carried
// a token too far, a partial chunk reading its neighbour) moves o and the gradients far outside
// these tolerances. Outputs are allocated poisoned (NaN), so an element a kernel forgets fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "common/testing.h"
#include "core/tensor.h"
#include "primitives/conv/causal_conv1d.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gated_delta_rule_cuda.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {
namespace {

const Device kGpu = Device::cuda(0);

Tensor cu_of(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
}

TEST(CausalConv1dGpu, ForwardAndBackwardMatchCpu) {
  BB_REQUIRE_GPU();
  struct Case {
    std::vector<int32_t> lens;
    int64_t C;
  };
  const std::vector<Case> cases = {
      {{1, 0, 2, 3, 40}, 7}, {{700, 1, 300}, 96}, {{5000}, 33}, {{1}, 1},
      // sequence ends on and next to the backward's 128-token and the forward's 64-token chunk
      // edges and the 8-token prefetch groups; two channel blocks
      {{256, 257, 0, 3}, 9}, {{255, 2, 300}, 300}, {{64, 65, 0, 63, 1, 7, 9}, 9}, {{127, 2, 128, 130}, 300}};
  for (const Case& k : cases) {
    int64_t T = 0;
    for (int32_t l : k.lens) T += l;
    for (int64_t W = 1; W <= 4; ++W) {
      for (bool silu : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "T=" << T << " C=" << k.C << " W=" << W << " silu " << silu);
        const Tensor cu = cu_of(k.lens);
        const Tensor x =
            Tensor::from_floats(test::randn(static_cast<size_t>(T * k.C), 7 + W), {T, k.C});
        const Tensor w =
            Tensor::from_floats(test::randn(static_cast<size_t>(k.C * W), 9 + W, 0.5f), {k.C, W});
        const Tensor dy =
            Tensor::from_floats(test::randn(static_cast<size_t>(T * k.C), 11 + W), {T, k.C});
        const Tensor y = causal_conv1d_forward(x, w, cu, silu);
        const Tensor yg = causal_conv1d_forward(x.to(kGpu), w.to(kGpu), cu, silu);
        EXPECT_LT(test::rel_error(yg.to_floats(), y.to_floats()), test::kTolF32);
        // bf16 out: the same f32 values rounded once (to nearest even), bit for bit.
        const Tensor yb = causal_conv1d_forward(x.to(kGpu), w.to(kGpu), cu, silu,
                                                MemCategory::activations, DType::bf16);
        ASSERT_EQ(yb.dtype(), DType::bf16);
        std::vector<float> yr = yg.to_floats();
        for (float& e : yr) e = round_bf16(e);
        EXPECT_EQ(yb.to_floats(), yr);

        const std::vector<float> dw0 = test::randn(static_cast<size_t>(k.C * W), 13);
        Tensor dw = Tensor::from_floats(dw0, {k.C, W});
        Tensor dwg = dw.to(kGpu), dwg2 = dw.to(kGpu);
        const Tensor dx = causal_conv1d_backward(dy, x, w, cu, silu, dw);
        const Tensor dxg =
            causal_conv1d_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), cu, silu, dwg);
        (void)causal_conv1d_backward(dy.to(kGpu), x.to(kGpu), w.to(kGpu), cu, silu, dwg2);
        EXPECT_LT(test::rel_error(dxg.to_floats(), dx.to_floats()), test::kTolF32);
        EXPECT_LT(test::rel_error(dwg.to_floats(), dw.to_floats()), test::kTolF32);
        EXPECT_EQ(dwg.to_floats(), dwg2.to_floats()) << "dw must be bitwise reproducible";
      }
    }
  }
}

TEST(CausalConv1dGpu, MixedDevicesAreAnError) {
  BB_REQUIRE_GPU();
  const Tensor x = Tensor::from_floats(test::randn(12, 1), {4, 3});
  const Tensor w = Tensor::from_floats(test::randn(6, 2), {3, 2});
  test::expect_error_contains([&] { causal_conv1d_forward(x.to(kGpu), w, cu_of({4}), true); },
                              "causal_conv1d_forward");
}

// ---- gated delta rule -------------------------------------------------------------------------

// All five gradients bit for bit.
void expect_bitwise_equal(const GatedDeltaGrads& x, const GatedDeltaGrads& y) {
  EXPECT_EQ(x.d_q.to_floats(), y.d_q.to_floats()) << "d_q";
  EXPECT_EQ(x.d_k.to_floats(), y.d_k.to_floats()) << "d_k";
  EXPECT_EQ(x.d_v.to_floats(), y.d_v.to_floats()) << "d_v";
  EXPECT_EQ(x.d_g.to_floats(), y.d_g.to_floats()) << "d_g";
  EXPECT_EQ(x.d_beta.to_floats(), y.d_beta.to_floats()) << "d_beta";
}

// Relative L2 error allowed against the fp64 reference, by input dtype. f32 inputs go through
// split-bf16 (3-product) tensor-core matmuls, about 2^-16 relative per product: measured ~1e-5.
// bf16 inputs round every matmul operand to bf16 once (2^-9): measured ~4e-3.
double gdn_tol(DType dt) {
  return dt == DType::f32 ? test::kTolF32 : test::kTolBf16;
}

struct GdnCase {
  std::vector<int32_t> lens;
  int64_t Hk = 2, Hv = 4, K = 128, V = 128;
  DType dt = DType::f32;
  bool l2norm = true;
  DType do_dt = DType::f32;
  std::string name() const {
    std::string s = std::string(dtype_name(dt)) + (l2norm ? " l2norm" : " raw") +
                    " Hk=" + std::to_string(Hk) + " Hv=" + std::to_string(Hv) +
                    " K=" + std::to_string(K) + " V=" + std::to_string(V) + " d_o " +
                    dtype_name(do_dt) + " lens";
    for (int32_t l : lens) s += " " + std::to_string(l);
    return s;
  }
};

struct GdnErrors {
  double o, dq, dk, dv, dg, dbeta;
};

std::vector<double> as_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}
std::vector<float> rounded(std::vector<float> v, DType dt) {
  if (dt == DType::bf16)
    for (float& x : v) x = round_bf16(x);
  return v;
}

// Runs one case on the GPU and the fp64 reference; returns the relative errors.
GdnErrors run_gdn_case(const GdnCase& c, uint64_t seed) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : c.lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), nseq = static_cast<int64_t>(c.lens.size());
  const size_t nq = static_cast<size_t>(T * c.Hk * c.K), nv = static_cast<size_t>(T * c.Hv * c.V),
               nh = static_cast<size_t>(T * c.Hv);
  // Without the norm, k ~ N(0, 1/K) keeps beta |k|^2 < 2, i.e. the update I - beta k k^T a
  // contraction (the model always normalises; raw keys of norm sqrt(K) would blow up any form).
  const float k_std = c.l2norm ? 1.f : 1.f / std::sqrt(static_cast<float>(c.K));
  const std::vector<float> q = rounded(test::randn(nq, seed, 1.f, 0), c.dt);
  const std::vector<float> k = rounded(test::randn(nq, seed, k_std, 1u << 24), c.dt);
  const std::vector<float> v = rounded(test::randn(nv, seed, 1.f, 2u << 24), c.dt);
  const std::vector<float> g = test::randu(nh, seed, -0.3f, -0.01f, 3u << 24);
  const std::vector<float> beta = test::randu(nh, seed, 0.1f, 0.9f, 4u << 24);
  const std::vector<float> d_o = rounded(test::randn(nv, seed, 1.f, 5u << 24), c.do_dt);

  ref::GdnShape s;
  s.T = T;
  s.Hk = c.Hk;
  s.Hv = c.Hv;
  s.K = c.K;
  s.V = c.V;
  s.scale = 1.0 / std::sqrt(static_cast<double>(c.K));
  s.l2norm = c.l2norm;
  const std::vector<double> qd = as_double(q), kd = as_double(k), vd = as_double(v),
                            gd = as_double(g), bd = as_double(beta), dod = as_double(d_o);
  std::vector<double> o_ref(nv), dq_ref(nq), dk_ref(nq), dv_ref(nv), dg_ref(nh), db_ref(nh);
  ref::gated_delta_forward<double>(o_ref.data(), qd.data(), kd.data(), vd.data(), gd.data(),
                                   bd.data(), cu.data(), nseq, s);
  ref::gated_delta_backward<double>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dg_ref.data(),
                                    db_ref.data(), dod.data(), qd.data(), kd.data(), vd.data(),
                                    gd.data(), bd.data(), cu.data(), nseq, s);

  const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  const Tensor qg = Tensor::from_floats(q, {T, c.Hk, c.K}, c.dt).to(kGpu);
  const Tensor kg = Tensor::from_floats(k, {T, c.Hk, c.K}, c.dt).to(kGpu);
  const Tensor vg = Tensor::from_floats(v, {T, c.Hv, c.V}, c.dt).to(kGpu);
  const Tensor gg = Tensor::from_floats(g, {T, c.Hv}).to(kGpu);
  const Tensor bg = Tensor::from_floats(beta, {T, c.Hv}).to(kGpu);
  const Tensor dog = Tensor::from_floats(d_o, {T, c.Hv, c.V}, c.do_dt).to(kGpu);
  GatedDeltaOptions opts;
  opts.l2norm = c.l2norm;
  const Tensor o = gated_delta_rule_forward(qg, kg, vg, gg, bg, cut, opts);
  EXPECT_EQ(o.dtype(), c.dt);
  const GatedDeltaGrads gr = gated_delta_rule_backward(dog, qg, kg, vg, gg, bg, cut, opts);
  for (const Tensor* t : {&gr.d_q, &gr.d_k, &gr.d_v, &gr.d_g, &gr.d_beta})
    EXPECT_EQ(t->dtype(), DType::f32);
  // Relative L2 error; where the exact result is identically zero (dg when every sequence has one
  // token: the state before it is zero), the largest absolute value instead.
  auto err = [](const std::vector<float>& got, const std::vector<double>& want) {
    double ref_norm = 0;
    for (double x : want) ref_norm += x * x;
    return ref_norm > 0 ? test::rel_error(got, want) : test::max_abs_diff(got, want);
  };
  GdnErrors e{};
  e.o = err(o.to_floats(), o_ref);
  e.dq = err(gr.d_q.to_floats(), dq_ref);
  e.dk = err(gr.d_k.to_floats(), dk_ref);
  e.dv = err(gr.d_v.to_floats(), dv_ref);
  e.dg = err(gr.d_g.to_floats(), dg_ref);
  e.dbeta = err(gr.d_beta.to_floats(), db_ref);
  std::printf("  %-74s o %.1e dq %.1e dk %.1e dv %.1e dg %.1e db %.1e\n", c.name().c_str(), e.o,
              e.dq, e.dk, e.dv, e.dg, e.dbeta);
  return e;
}

void expect_gdn_case(const GdnCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name());
  const GdnErrors e = run_gdn_case(c, seed);
  const double tol = gdn_tol(c.dt);
  EXPECT_LT(e.o, tol) << "o";
  EXPECT_LT(e.dq, tol) << "dq";
  EXPECT_LT(e.dk, tol) << "dk";
  EXPECT_LT(e.dv, tol) << "dv";
  EXPECT_LT(e.dg, tol) << "dg";
  EXPECT_LT(e.dbeta, tol) << "dbeta";
}

TEST(GatedDeltaGpu, ChunkBoundariesMatchTheRecurrence) {
  BB_REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : {DType::f32, DType::bf16})
    for (bool l2 : {true, false})
      for (int32_t len : {1, 63, 64, 65, 1000}) {
        GdnCase c;
        // One-token sequences come 16 to a batch: a lone token gives 4 output rows, too few for a
        // relative error that measures rounding rather than the luck of 4 dot products.
        c.lens = std::vector<int32_t>(len == 1 ? 16 : 1, len);
        c.dt = dt;
        c.l2norm = l2;
        expect_gdn_case(c, ++seed);
      }
}

TEST(GatedDeltaGpu, PackedSequencesAndHeadLayouts) {
  BB_REQUIRE_GPU();
  const std::vector<int32_t> mix = {5, 0, 1, 130, 64, 200, 0, 63};
  struct Layout {
    int64_t Hk, Hv, K, V;
  };
  uint64_t seed = 200;
  for (const Layout& lay : {Layout{2, 2, 128, 128}, Layout{2, 4, 128, 128}, Layout{1, 4, 128, 128},
                            Layout{2, 4, 64, 32}})
    for (DType dt : {DType::f32, DType::bf16})
      for (bool l2 : {true, false}) {
        GdnCase c;
        c.lens = mix;
        c.Hk = lay.Hk;
        c.Hv = lay.Hv;
        c.K = lay.K;
        c.V = lay.V;
        c.dt = dt;
        c.l2norm = l2;
        expect_gdn_case(c, ++seed);
      }
}

TEST(GatedDeltaGpu, Bf16GradientOfTheOutput) {
  BB_REQUIRE_GPU();
  // d_o in bf16 (read in place when V = 128) and f32 against bf16 inputs.
  uint64_t seed = 300;
  for (int64_t V : {128, 64}) {
    GdnCase c;
    c.lens = {0, 150, 1, 70};
    c.V = V;
    c.dt = DType::bf16;
    c.do_dt = DType::bf16;
    expect_gdn_case(c, ++seed);
  }
}

TEST(GatedDeltaGpu, RepeatedCallsAreBitwiseEqual) {
  BB_REQUIRE_GPU();
  const std::vector<int32_t> cu = {0, 70, 71, 200};
  const int64_t T = 200, Hk = 1, Hv = 2, K = 128;
  const Tensor cut = Tensor::from_ints(cu, {4});
  const Tensor q =
      Tensor::from_floats(test::randn(T * Hk * K, 1), {T, Hk, K}, DType::bf16).to(kGpu);
  const Tensor k =
      Tensor::from_floats(test::randn(T * Hk * K, 2), {T, Hk, K}, DType::bf16).to(kGpu);
  const Tensor v =
      Tensor::from_floats(test::randn(T * Hv * K, 3), {T, Hv, K}, DType::bf16).to(kGpu);
  const Tensor g = Tensor::from_floats(test::randu(T * Hv, 4, -0.3f, -0.01f), {T, Hv}).to(kGpu);
  const Tensor b = Tensor::from_floats(test::randu(T * Hv, 5, 0.1f, 0.9f), {T, Hv}).to(kGpu);
  const Tensor d_o = Tensor::from_floats(test::randn(T * Hv * K, 6), {T, Hv, K}).to(kGpu);
  const Tensor o1 = gated_delta_rule_forward(q, k, v, g, b, cut),
               o2 = gated_delta_rule_forward(q, k, v, g, b, cut);
  EXPECT_EQ(o1.to_floats(), o2.to_floats());
  const GatedDeltaGrads a = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  const GatedDeltaGrads c = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  expect_bitwise_equal(a, c);
}

// The backward runs its two state passes on two streams (the rebuild on a side stream that forks
// from and joins the current one). The result must not depend on it: GdnVariant::overlap = false
// runs both on the current stream, bit for bit the same; so must the other variants below. Long enough (1000 + 3000 tokens) that the passes
// really run side by side, and the outputs are read on the current stream right after the call,
// so a missing join would read unfinished states.
TEST(GatedDeltaGpu, BackwardSideStreamAndKernelKnobsAreBitwiseEqual) {
  BB_REQUIRE_GPU();
  const std::vector<int32_t> cu = {0, 1000, 4000};
  const int64_t T = 4000, Hk = 2, Hv = 4, K = 128;
  const Tensor cut = Tensor::from_ints(cu, {3});
  auto bf = [&](int64_t n, uint64_t seed, const Shape& sh) {
    return Tensor::from_floats(test::randn(static_cast<size_t>(n), seed), sh, DType::bf16).to(kGpu);
  };
  const Tensor q = bf(T * Hk * K, 31, {T, Hk, K}), k = bf(T * Hk * K, 32, {T, Hk, K}),
               v = bf(T * Hv * K, 33, {T, Hv, K}), d_o = bf(T * Hv * K, 36, {T, Hv, K});
  const Tensor g = Tensor::from_floats(test::randu(T * Hv, 34, -0.3f, -0.01f), {T, Hv}).to(kGpu);
  const Tensor b = Tensor::from_floats(test::randu(T * Hv, 35, 0.1f, 0.9f), {T, Hv}).to(kGpu);
  const GatedDeltaGrads two = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  const cuda::GdnVariant base = cuda::gdn_variant();
  auto with = [&](auto change) {
    cuda::GdnVariant v = base;
    change(v);
    cuda::set_gdn_variant(v);
  };
  with([](cuda::GdnVariant& v) { v.overlap = false; });
  const GatedDeltaGrads one = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  cuda::set_gdn_variant(base);
  expect_bitwise_equal(two, one);
  // The block order of the per-(chunk, head) kernels (value heads fastest instead of chunks)
  // changes only which block runs when.
  const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cut);
  with([](cuda::GdnVariant& v) { v.chunk_fastest = !v.chunk_fastest; });
  const Tensor o2 = gated_delta_rule_forward(q, k, v, g, b, cut);
  const GatedDeltaGrads other = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  cuda::set_gdn_variant(base);
  EXPECT_EQ(o2.to_floats(), o.to_floats());
  expect_bitwise_equal(other, two);
  // chunk_prep with K^ resident (3 blocks an SM) instead of loaded again after the solve.
  with([](cuda::GdnVariant& v) { v.prep_reload = false; });
  const Tensor o3 = gated_delta_rule_forward(q, k, v, g, b, cut);
  const GatedDeltaGrads resident = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
  cuda::set_gdn_variant(base);
  EXPECT_EQ(o3.to_floats(), o.to_floats());
  expect_bitwise_equal(resident, two);
  // The state passes' column slices and warps (16 columns: 4 warps always; this shape's default
  // is 16): which block and warp computes an element, not how.
  for (int vt : {16, 32, 64})
    for (int warps : {4, 8}) {
      SCOPED_TRACE("vt " + std::to_string(vt) + ", state_warps " + std::to_string(warps));
      with([&](cuda::GdnVariant& v) {
        v.vt = vt;
        v.state_warps = warps;
      });
      const Tensor o4 = gated_delta_rule_forward(q, k, v, g, b, cut);
      const GatedDeltaGrads sliced = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
      EXPECT_EQ(o4.to_floats(), o.to_floats());
      expect_bitwise_equal(sliced, two);
    }
  cuda::set_gdn_variant(base);
}

// A workspace limit below what one call needs runs the call in time segments (token ranges cut
// at whole chunks, a cut sequence carrying its state and its state's gradient across the cut):
// bit-identical to one call. Limits of one byte (64-token segments: a segment holding the end of
// one sequence, a one-token sequence and the start of another, both carried), and about a half
// and a third of one call's workspace; bf16 and f32 inputs, f32 and bf16 d_o (the bf16 path reads
// d_o in place), a packed mix and one long sequence; the forward's state pass beside chunk_prep
// (split 50) and in the plain order.
TEST(GatedDeltaGpu, TimeSegmentsUnderAWorkspaceLimitAreBitwiseEqual) {
  BB_REQUIRE_GPU();
  const int64_t Hk = 4, Hv = 8, K = 128;
  for (const std::vector<int32_t>& cu : {std::vector<int32_t>{0, 130, 131, 400}, std::vector<int32_t>{0, 0, 2000},
                                         std::vector<int32_t>{0, 700, 1400, 1401, 2100}})
    for (DType dt : {DType::bf16, DType::f32}) {
      const int64_t T = cu.back();
      SCOPED_TRACE(testing::Message() << cu.size() - 1 << " sequences, T " << T << ", " << dtype_name(dt));
      const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
      auto in = [&](int64_t n, uint64_t seed, const Shape& sh, DType t) {
        return Tensor::from_floats(test::randn(static_cast<size_t>(n), seed), sh, t).to(kGpu);
      };
      const Tensor q = in(T * Hk * K, 21, {T, Hk, K}, dt), k = in(T * Hk * K, 22, {T, Hk, K}, dt),
                   v = in(T * Hv * K, 23, {T, Hv, K}, dt);
      const Tensor g = Tensor::from_floats(test::randu(T * Hv, 24, -0.3f, -0.01f), {T, Hv}).to(kGpu);
      const Tensor b = Tensor::from_floats(test::randu(T * Hv, 25, 0.1f, 0.9f), {T, Hv}).to(kGpu);
      const Tensor d_o32 = in(T * Hv * K, 26, {T, Hv, K}, DType::f32);
      const Tensor d_oin = in(T * Hv * K, 26, {T, Hv, K}, dt);
      const GatedDeltaOptions whole;
      const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cut, whole);
      const GatedDeltaGrads a32 = gated_delta_rule_backward(d_o32, q, k, v, g, b, cut, whole);
      const GatedDeltaGrads ain = gated_delta_rule_backward(d_oin, q, k, v, g, b, cut, whole);
      const size_t bwd_bytes = T * (dt == DType::bf16 ? 512 * 4 + 3336 * 8 + 256 * 8 : 1024 * 4 + 5640 * 8 + 512 * 8);
      for (size_t limit : {size_t{1}, bwd_bytes / 2, bwd_bytes / 3})
        for (int split : {50, 100}) {
          SCOPED_TRACE("limit " + std::to_string(limit) + ", fwd_split " + std::to_string(split));
          cuda::GdnVariant var = cuda::gdn_variant();
          var.fwd_split = split;
          cuda::set_gdn_variant(var);
          GatedDeltaOptions seg;
          seg.max_workspace_bytes = limit;
          EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut, seg).to_floats(), o.to_floats());
          // A prep is kept only when it fits the limit; the backward then drops it (its rest does
          // not fit either) and segments.
          GatedDeltaPrep prep;
          EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut, seg, MemCategory::activations, &prep).to_floats(),
                    o.to_floats());
          if (limit == 1) EXPECT_FALSE(prep.defined());
          expect_bitwise_equal(gated_delta_rule_backward(d_o32, q, k, v, g, b, cut, seg, &prep), a32);
          expect_bitwise_equal(gated_delta_rule_backward(d_oin, q, k, v, g, b, cut, seg), ain);
        }
      cuda::set_gdn_variant(cuda::GdnVariant{});
    }
}

// A forward given `keep` hands its chunk_prep outputs to the backward, which then skips qk_norm
// and chunk_prep: the output and every gradient bitwise as without it (the same kernels make the
// same buffers), for bf16 and f32 inputs, f32 and bf16 d_o, across chunk edges and a packed mix.
// The backward consumes the prep (released: a second backward cannot reuse its overwritten U).
// A prep over the workspace limit is not kept; a backward whose rest would exceed the limit drops
// it and runs in time segments; a prep of other inputs is an error.
TEST(GatedDeltaGpu, KeptForwardPrepGivesBitwiseEqualGradients) {
  BB_REQUIRE_GPU();
  const std::vector<int32_t> cu = {0, 1, 64, 65, 1065, 1128};
  const int64_t T = 1128, Hk = 2, Hv = 4, K = 128;
  const Tensor cut = Tensor::from_ints(cu, {6});
  for (DType dt : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    auto in = [&](int64_t n, uint64_t seed, const Shape& sh, DType t) {
      return Tensor::from_floats(test::randn(static_cast<size_t>(n), seed), sh, t).to(kGpu);
    };
    const Tensor q = in(T * Hk * K, 41, {T, Hk, K}, dt), k = in(T * Hk * K, 42, {T, Hk, K}, dt),
                 v = in(T * Hv * K, 43, {T, Hv, K}, dt);
    const Tensor g = Tensor::from_floats(test::randu(T * Hv, 44, -0.3f, -0.01f), {T, Hv}).to(kGpu);
    const Tensor b = Tensor::from_floats(test::randu(T * Hv, 45, 0.1f, 0.9f), {T, Hv}).to(kGpu);
    const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cut);
    for (DType do_dt : {DType::f32, dt}) {
      SCOPED_TRACE(std::string("d_o ") + dtype_name(do_dt));
      const Tensor d_o = in(T * Hv * K, 46, {T, Hv, K}, do_dt);
      const GatedDeltaGrads a = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
      GatedDeltaPrep prep;
      const Tensor o_kept =
          gated_delta_rule_forward(q, k, v, g, b, cut, {}, MemCategory::activations, &prep);
      ASSERT_TRUE(prep.defined());
      EXPECT_EQ(o_kept.to_floats(), o.to_floats());
      const GatedDeltaGrads c = gated_delta_rule_backward(d_o, q, k, v, g, b, cut, {}, &prep);
      EXPECT_FALSE(prep.defined()) << "the backward consumes the prep";
      expect_bitwise_equal(c, a);
    }
    // Over the limit: the forward keeps nothing (and still computes o).
    GatedDeltaOptions tight;
    tight.max_workspace_bytes = 1;
    GatedDeltaPrep none;
    EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut, tight, MemCategory::activations, &none)
                  .to_floats(),
              o.to_floats());
    EXPECT_FALSE(none.defined());
    // A prep kept under the default limit, a backward under a limit its rest exceeds: the prep is
    // dropped and the head-group path runs, bitwise the same.
    const Tensor d_o = in(T * Hv * K, 47, {T, Hv, K}, DType::f32);
    const GatedDeltaGrads a = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
    GatedDeltaPrep prep;
    gated_delta_rule_forward(q, k, v, g, b, cut, {}, MemCategory::activations, &prep);
    ASSERT_TRUE(prep.defined());
    const GatedDeltaGrads c = gated_delta_rule_backward(d_o, q, k, v, g, b, cut, tight, &prep);
    EXPECT_FALSE(prep.defined());
    EXPECT_EQ(c.d_q.to_floats(), a.d_q.to_floats());
    EXPECT_EQ(c.d_g.to_floats(), a.d_g.to_floats());
    // A prep of other inputs: a clear error, not wrong gradients.
    gated_delta_rule_forward(q, k, v, g, b, cut, {}, MemCategory::activations, &prep);
    const Tensor cu2 = Tensor::from_ints({0, 564, 1128}, {3});
    test::expect_error_contains(
        [&] { gated_delta_rule_backward(d_o, q, k, v, g, b, cu2, {}, &prep); },
        "kept forward prep was made for other inputs");
  }
}

// The bf16 forward runs chunk_prep of the later chunks beside the state pass (flags per chunk
// and value head, the state pass on a higher-priority stream). Bitwise the plain order
// (GdnVariant::fwd_split = 100) at several splits, for one long sequence and a packed batch whose
// sequences straddle the split, with and without a kept prep (whose backward must match too);
// the output is read on the current stream right after the call, so a missing join or a chunk
// loaded before its flag would show.
TEST(GatedDeltaGpu, ForwardBesideChunkPrepIsBitwiseThePlainOrder) {
  BB_REQUIRE_GPU();
  const int64_t Hk = 2, Hv = 4, K = 128;
  std::vector<int32_t> many{0};  // 60 sequences: more state blocks than SMs (must not hang)
  for (int i = 0; i < 60; ++i) many.push_back(many.back() + 150);
  for (const std::vector<int32_t>& cu :
       {std::vector<int32_t>{0, 9000}, std::vector<int32_t>{0, 1000, 1001, 6000, 9000}, many}) {
    const int64_t T = cu.back();
    SCOPED_TRACE(testing::Message() << cu.size() - 1 << " sequences");
    const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
    auto bf = [&](int64_t n, uint64_t seed, const Shape& sh) {
      return Tensor::from_floats(test::randn(static_cast<size_t>(n), seed), sh, DType::bf16).to(kGpu);
    };
    const Tensor q = bf(T * Hk * K, 51, {T, Hk, K}), k = bf(T * Hk * K, 52, {T, Hk, K}),
                 v = bf(T * Hv * K, 53, {T, Hv, K}), d_o = bf(T * Hv * K, 56, {T, Hv, K});
    const Tensor g = Tensor::from_floats(test::randu(T * Hv, 54, -0.3f, -0.01f), {T, Hv}).to(kGpu);
    const Tensor b = Tensor::from_floats(test::randu(T * Hv, 55, 0.1f, 0.9f), {T, Hv}).to(kGpu);
    cuda::GdnVariant var;
    var.fwd_split = 100;
    cuda::set_gdn_variant(var);
    const std::vector<float> plain = gated_delta_rule_forward(q, k, v, g, b, cut).to_floats();
    const GatedDeltaGrads ref = gated_delta_rule_backward(d_o, q, k, v, g, b, cut);
    for (int split : {1, 30, 50, 90}) {
      SCOPED_TRACE("fwd_split " + std::to_string(split));
      var.fwd_split = split;
      cuda::set_gdn_variant(var);
      for (int rep = 0; rep < 2; ++rep) EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut).to_floats(), plain);
      GatedDeltaPrep prep;
      EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut, {}, MemCategory::activations, &prep).to_floats(), plain);
      ASSERT_TRUE(prep.defined());
      expect_bitwise_equal(gated_delta_rule_backward(d_o, q, k, v, g, b, cut, {}, &prep), ref);
    }
    cuda::set_gdn_variant(cuda::GdnVariant{});
    EXPECT_EQ(gated_delta_rule_forward(q, k, v, g, b, cut).to_floats(), plain);  // the default split
  }
}

TEST(GatedDeltaGpu, EmptyBatchesAndBadInputs) {
  BB_REQUIRE_GPU();
  auto gpu = [](const Shape& s, DType dt = DType::f32) {
    return Tensor::zeros(s, dt, kGpu, MemCategory::other);
  };
  {  // T = 0: nothing to do, and no error
    const Tensor q = gpu({0, 1, 8}), v = gpu({0, 2, 8}), g = gpu({0, 2});
    const Tensor o = gated_delta_rule_forward(q, q, v, g, g, cu_of({0, 0}));
    EXPECT_EQ(o.numel(), 0);
    const GatedDeltaGrads r = gated_delta_rule_backward(v, q, q, v, g, g, cu_of({0}));
    EXPECT_EQ(r.d_q.numel(), 0);
  }
  const Tensor q = gpu({4, 1, 8}), v = gpu({4, 2, 8}), g = gpu({4, 2});
  const Tensor cu = cu_of({4});
  test::expect_error_contains(
      [&] {
        gated_delta_rule_forward(gpu({4, 1, 8}, DType::f16), q, v, g, g, cu);
      },
      "must be f32 or bf16");
  test::expect_error_contains(
      [&] {
        gated_delta_rule_forward(q, gpu({4, 1, 8}, DType::bf16), v, g, g, cu);
      },
      "'k'");
  test::expect_error_contains(
      [&] {
        gated_delta_rule_forward(q, q, v, gpu({4, 2}, DType::bf16), g, cu);
      },
      "'g'");
  test::expect_error_contains(
      [&] { gated_delta_rule_forward(q, q, v, g, g.to(Device::cpu()), cu); }, "'beta'");
  const Tensor q200 = gpu({4, 1, 136}), v200 = gpu({4, 2, 136});
  test::expect_error_contains([&] { gated_delta_rule_forward(q200, q200, v200, g, g, cu); },
                              "K, V <= 128");
  const Tensor q12 = gpu({4, 1, 12});
  test::expect_error_contains([&] { gated_delta_rule_forward(q12, q12, v, g, g, cu); },
                              "multiples of 8");
  const Tensor vb = gpu({4, 2, 8}, DType::bf16), qb = gpu({4, 1, 8}, DType::bf16);
  test::expect_error_contains(
      [&] {
        gated_delta_rule_backward(gpu({4, 2, 8}, DType::f16), qb, qb, vb, g, g, cu);
      },
      "d_o must be f32 or v's dtype");
  test::expect_error_contains(
      [&] { gated_delta_rule_backward(v.to(Device::cpu()), q, q, v, g, g, cu); }, "d_o is on");
}

}  // namespace
}  // namespace bb

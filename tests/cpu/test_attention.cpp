// Causal GQA attention over packed sequences (sdpa baseline): gradients against double finite
// differences, an independent full-matrix oracle, packing, GQA vs repeated MHA, bf16, scale,
// and the boundary checks.
// Legend: T tokens, Hq query heads, Hkv kv heads, D head dim.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/testing.h"
#include "primitives/attention/attention.h"
#include "primitives/attention/attention_ref.h"

namespace bb {
namespace {

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
  Tensor cu_tensor() const { return Tensor::from_ints(cu(), {B() + 1}); }
};

const Problem kGqa{{5, 1, 7, 0, 3}, 4, 2, 8, 0.37f};

struct Inputs {
  std::vector<float> q, k, v, d_o;
};

Inputs make_inputs(const Problem& p, uint64_t seed, float std = 1.0f) {
  return {test::randn(p.nq(), seed, std, 0), test::randn(p.nkv(), seed, std, 1u << 20),
          test::randn(p.nkv(), seed, 1.0f, 2u << 20), test::randn(p.nq(), seed, 1.0f, 3u << 20)};
}

struct AttnRun {
  Tensor o;
  AttentionSaved saved;
  AttentionGrads g;
};

AttnRun run(const Problem& p, const Inputs& in, DType dt = DType::f32) {
  Tensor q = Tensor::from_floats(in.q, {p.T(), p.Hq, p.D}, dt);
  Tensor k = Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D}, dt);
  Tensor v = Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D}, dt);
  Tensor d_o = Tensor::from_floats(in.d_o, {p.T(), p.Hq, p.D}, dt);
  Tensor cu = p.cu_tensor();
  AttnRun r;
  r.o = attention_forward(q, k, v, AttentionArgs::causal_self(cu, p.scale), &r.saved);
  r.g = attention_backward(d_o, q, k, v, r.o, AttentionArgs::causal_self(cu, p.scale), r.saved);
  return r;
}

// Independent oracle: the full T x T score matrix in double with an explicit mask
// (same sequence and j <= i), written without the reference's per-sequence loop structure.
void naive_attention(const Problem& p, const Inputs& in, std::vector<double>& o,
                     std::vector<double>& lse) {
  const int64_t T = p.T(), G = p.Hq / p.Hkv, D = p.D;
  std::vector<int> seq_of(static_cast<size_t>(T));
  const auto cu = p.cu();
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    for (int32_t t = cu[b]; t < cu[b + 1]; ++t) seq_of[t] = static_cast<int>(b);
  o.assign(p.nq(), 0.0);
  lse.assign(static_cast<size_t>(p.Hq * T), 0.0);
  std::vector<double> s(static_cast<size_t>(T * T));
  for (int64_t h = 0; h < p.Hq; ++h) {
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < T; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(in.q[(i * p.Hq + h) * D + d]) * in.k[(j * p.Hkv + h / G) * D + d];
        const bool visible = seq_of[i] == seq_of[j] && j <= i;
        s[i * T + j] = visible ? p.scale * dot : -INFINITY;
      }
    for (int64_t i = 0; i < T; ++i) {
      double sum = 0;  // scores are O(1) here, so no max subtraction is needed
      for (int64_t j = 0; j < T; ++j) sum += std::exp(s[i * T + j]);
      lse[h * T + i] = std::log(sum);
      for (int64_t j = 0; j < T; ++j) {
        const double pij = std::exp(s[i * T + j]) / sum;
        for (int64_t d = 0; d < D; ++d)
          o[(i * p.Hq + h) * D + d] += pij * in.v[(j * p.Hkv + h / G) * D + d];
      }
    }
  }
}

std::vector<float> slice_rows(const std::vector<float>& x, int64_t row_elems, int64_t t0,
                              int64_t t1) {
  return {x.begin() + t0 * row_elems, x.begin() + t1 * row_elems};
}

TEST(AttentionSdpa, BackwardMatchesFiniteDifferences) {
  const Problem p = kGqa;
  const Inputs in = make_inputs(p, 101);
  const AttnRun r = run(p, in);

  const auto cu = p.cu();
  const std::vector<double> w = test::cast<double>(in.d_o);  // L = sum w * o
  const size_t nq = p.nq(), nkv = p.nkv();
  auto loss = [&](const std::vector<double>& x) {
    std::vector<double> o(nq);
    ref::attention_forward<double>(o.data(), nullptr, x.data(), x.data() + nq,
                                   x.data() + nq + nkv, cu.data(), p.B(), p.T(), p.Hq, p.Hkv,
                                   p.D, p.scale);
    return test::weighted_sum(o, w);
  };
  std::vector<double> x = test::cast<double>(in.q);
  x.insert(x.end(), in.k.begin(), in.k.end());
  x.insert(x.end(), in.v.begin(), in.v.end());
  const std::vector<double> fd = test::finite_diff(loss, x);
  const std::vector<double> fd_q(fd.begin(), fd.begin() + nq);
  const std::vector<double> fd_k(fd.begin() + nq, fd.begin() + nq + nkv);
  const std::vector<double> fd_v(fd.begin() + nq + nkv, fd.end());

  EXPECT_LT(test::rel_error(r.g.dq.to_floats(), fd_q), test::kGradTol);
  EXPECT_LT(test::rel_error(r.g.dk.to_floats(), fd_k), test::kGradTol);
  EXPECT_LT(test::rel_error(r.g.dv.to_floats(), fd_v), test::kGradTol);
  EXPECT_EQ(r.g.dq.shape(), (Shape{p.T(), p.Hq, p.D}));
  EXPECT_EQ(r.g.dk.shape(), (Shape{p.T(), p.Hkv, p.D}));
  EXPECT_EQ(r.g.dv.shape(), (Shape{p.T(), p.Hkv, p.D}));
  EXPECT_EQ(r.g.dq.category(), MemCategory::activations);
  EXPECT_EQ(r.g.dk.category(), MemCategory::activations);
  EXPECT_EQ(r.g.dv.category(), MemCategory::activations);
}

TEST(AttentionSdpa, ForwardAndLseMatchNaiveFullMatrix) {
  const Problem p = kGqa;
  const Inputs in = make_inputs(p, 202);
  AttentionSaved saved;
  Tensor o = attention_forward(Tensor::from_floats(in.q, {p.T(), p.Hq, p.D}),
                               Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D}),
                               Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D}), AttentionArgs::causal_self(p.cu_tensor(), p.scale), &saved);
  std::vector<double> o_ref, lse_ref;
  naive_attention(p, in, o_ref, lse_ref);
  EXPECT_LT(test::rel_error(o.to_floats(), o_ref), 1e-6);
  EXPECT_LT(test::rel_error(saved.lse.to_floats(), lse_ref), 1e-6);
  EXPECT_LT(test::max_abs_diff(saved.lse.to_floats(), lse_ref), 1e-5);
  EXPECT_EQ(o.dtype(), DType::f32);
  EXPECT_EQ(o.category(), MemCategory::activations);
  EXPECT_EQ(saved.lse.shape(), (Shape{p.Hq, p.T()}));
  EXPECT_EQ(saved.lse.dtype(), DType::f32);
  EXPECT_EQ(saved.lse.category(), MemCategory::activations);
  // The first token of a sequence sees only itself: o = v of its kv head, lse = its own score.
  const int64_t t0 = p.cu()[2];  // the length-7 sequence
  const auto of = o.to_floats();
  for (int64_t h = 0; h < p.Hq; ++h)
    for (int64_t d = 0; d < p.D; ++d)
      EXPECT_FLOAT_EQ(of[(t0 * p.Hq + h) * p.D + d], in.v[(t0 * p.Hkv + h / 2) * p.D + d]);
  // Without `saved` the output is the same.
  Tensor o2 = attention_forward(Tensor::from_floats(in.q, {p.T(), p.Hq, p.D}),
                                Tensor::from_floats(in.k, {p.T(), p.Hkv, p.D}),
                                Tensor::from_floats(in.v, {p.T(), p.Hkv, p.D}), AttentionArgs::causal_self(p.cu_tensor(), p.scale), nullptr);
  EXPECT_EQ(o2.to_floats(), o.to_floats());
}

TEST(AttentionSdpa, PackedEqualsEachSequenceAlone) {
  for (const Problem& p : {kGqa, Problem{{0, 6, 0, 2, 0}, 3, 1, 4, 0.5f}}) {
    const Inputs in = make_inputs(p, 303);
    const AttnRun packed = run(p, in);
    const auto o = packed.o.to_floats(), lse = packed.saved.lse.to_floats();
    const auto dq = packed.g.dq.to_floats(), dk = packed.g.dk.to_floats(),
               dv = packed.g.dv.to_floats();
    const auto cu = p.cu();
    const int64_t rq = p.Hq * p.D, rkv = p.Hkv * p.D;
    for (int64_t b = 0; b < p.B(); ++b) {
      const int64_t t0 = cu[b], t1 = cu[b + 1];
      if (t0 == t1) continue;
      const Problem alone{{static_cast<int32_t>(t1 - t0)}, p.Hq, p.Hkv, p.D, p.scale};
      const Inputs in_b{slice_rows(in.q, rq, t0, t1), slice_rows(in.k, rkv, t0, t1),
                        slice_rows(in.v, rkv, t0, t1), slice_rows(in.d_o, rq, t0, t1)};
      const AttnRun r = run(alone, in_b);
      EXPECT_LT(test::max_abs_diff(r.o.to_floats(), slice_rows(o, rq, t0, t1)), 1e-6) << b;
      EXPECT_LT(test::max_abs_diff(r.g.dq.to_floats(), slice_rows(dq, rq, t0, t1)), 1e-6) << b;
      EXPECT_LT(test::max_abs_diff(r.g.dk.to_floats(), slice_rows(dk, rkv, t0, t1)), 1e-6) << b;
      EXPECT_LT(test::max_abs_diff(r.g.dv.to_floats(), slice_rows(dv, rkv, t0, t1)), 1e-6) << b;
      const auto lse_b = r.saved.lse.to_floats();
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t t = t0; t < t1; ++t)
          EXPECT_NEAR(lse_b[h * (t1 - t0) + (t - t0)], lse[h * p.T() + t], 1e-6);
    }
  }
}

TEST(AttentionSdpa, SequenceBoundariesBlockAttention) {
  // The same tokens as one sequence give different outputs after the first boundary, and the
  // packed outputs of sequence 0 do not change when later sequences' tokens change.
  const Problem p = kGqa;
  const Inputs in = make_inputs(p, 404);
  const AttnRun packed = run(p, in);
  const Problem one{{static_cast<int32_t>(p.T())}, p.Hq, p.Hkv, p.D, p.scale};
  const AttnRun joined = run(one, in);
  const int64_t rq = p.Hq * p.D, t_first_boundary = p.cu()[1];
  const auto po = packed.o.to_floats(), jo = joined.o.to_floats();
  EXPECT_LT(test::max_abs_diff(slice_rows(po, rq, 0, t_first_boundary),
                               slice_rows(jo, rq, 0, t_first_boundary)), 1e-6);  // BLAS sums in another order: a few ulp
  EXPECT_GT(test::max_abs_diff(slice_rows(po, rq, t_first_boundary, p.T()),
                               slice_rows(jo, rq, t_first_boundary, p.T())), 1e-2);

  Inputs changed = in;
  for (size_t i = static_cast<size_t>(t_first_boundary * p.Hkv * p.D); i < changed.k.size(); ++i) {
    changed.k[i] += 1.0f;
    changed.v[i] -= 2.0f;
  }
  const AttnRun r2 = run(p, changed);
  EXPECT_EQ(slice_rows(r2.o.to_floats(), rq, 0, t_first_boundary),
            slice_rows(po, rq, 0, t_first_boundary));
}

TEST(AttentionSdpa, GqaEqualsMhaWithRepeatedKv) {
  const Problem p{{5, 1, 7, 0, 3}, 6, 2, 8, 0.3f};
  const int64_t G = p.Hq / p.Hkv, T = p.T(), D = p.D;
  const Inputs in = make_inputs(p, 505);
  const AttnRun gqa = run(p, in);

  const Problem mha{p.lens, p.Hq, p.Hq, D, p.scale};
  Inputs rep = in;
  rep.k.assign(mha.nkv(), 0.0f);
  rep.v.assign(mha.nkv(), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t d = 0; d < D; ++d) {
        rep.k[(t * p.Hq + h) * D + d] = in.k[(t * p.Hkv + h / G) * D + d];
        rep.v[(t * p.Hq + h) * D + d] = in.v[(t * p.Hkv + h / G) * D + d];
      }
  const AttnRun m = run(mha, rep);
  EXPECT_LT(test::rel_error(gqa.o.to_floats(), m.o.to_floats()), 1e-6);
  EXPECT_LT(test::rel_error(gqa.saved.lse.to_floats(), m.saved.lse.to_floats()), 1e-6);
  EXPECT_LT(test::rel_error(gqa.g.dq.to_floats(), m.g.dq.to_floats()), 1e-6);
  // dk/dv of a kv head are the sums over its query heads of the repeated heads' gradients.
  const auto mdk = m.g.dk.to_floats(), mdv = m.g.dv.to_floats();
  std::vector<double> dk_sum(p.nkv(), 0.0), dv_sum(p.nkv(), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t d = 0; d < D; ++d) {
        dk_sum[(t * p.Hkv + h / G) * D + d] += mdk[(t * p.Hq + h) * D + d];
        dv_sum[(t * p.Hkv + h / G) * D + d] += mdv[(t * p.Hq + h) * D + d];
      }
  EXPECT_LT(test::rel_error(gqa.g.dk.to_floats(), dk_sum), 1e-6);
  EXPECT_LT(test::rel_error(gqa.g.dv.to_floats(), dv_sum), 1e-6);
}

TEST(AttentionSdpa, Bf16StorageCloseToF32) {
  const Problem p = kGqa;
  const Inputs in = make_inputs(p, 606);
  const AttnRun f = run(p, in, DType::f32);
  const AttnRun h = run(p, in, DType::bf16);
  for (const Tensor* t : {&h.o, &h.g.dq, &h.g.dk, &h.g.dv}) {
    EXPECT_EQ(t->dtype(), DType::bf16);
    EXPECT_EQ(t->category(), MemCategory::activations);
  }
  EXPECT_EQ(h.saved.lse.dtype(), DType::f32);
  EXPECT_LT(test::rel_error(h.o.to_floats(), f.o.to_floats()), 1e-2);
  EXPECT_LT(test::rel_error(h.saved.lse.to_floats(), f.saved.lse.to_floats()), 1e-2);
  EXPECT_LT(test::rel_error(h.g.dq.to_floats(), f.g.dq.to_floats()), 1e-2);
  EXPECT_LT(test::rel_error(h.g.dk.to_floats(), f.g.dk.to_floats()), 1e-2);
  EXPECT_LT(test::rel_error(h.g.dv.to_floats(), f.g.dv.to_floats()), 1e-2);
  // And not identical: the bf16 path really rounded.
  EXPECT_GT(test::max_abs_diff(h.o.to_floats(), f.o.to_floats()), 0.0);
}

TEST(AttentionSdpa, SoftmaxScaleRespected) {
  // Attention with scale s on q equals scale 1 on s*q; gradients: dq_s = s * dq_1(s*q).
  const float s = 0.6f;
  const Problem p{{5, 1, 7, 0, 3}, 4, 2, 8, s};
  const Problem p1{p.lens, p.Hq, p.Hkv, p.D, 1.0f};
  const Inputs in = make_inputs(p, 707);
  Inputs in1 = in;
  for (float& x : in1.q) x *= s;
  const AttnRun a = run(p, in), b = run(p1, in1);
  EXPECT_LT(test::rel_error(a.o.to_floats(), b.o.to_floats()), 1e-5);
  EXPECT_LT(test::rel_error(a.saved.lse.to_floats(), b.saved.lse.to_floats()), 1e-5);
  std::vector<float> dq1 = b.g.dq.to_floats();
  for (float& x : dq1) x *= s;
  EXPECT_LT(test::rel_error(a.g.dq.to_floats(), dq1), 1e-5);
  EXPECT_LT(test::rel_error(a.g.dk.to_floats(), b.g.dk.to_floats()), 1e-5);
  EXPECT_LT(test::rel_error(a.g.dv.to_floats(), b.g.dv.to_floats()), 1e-5);
  // The scale changes the result (guards against an ignored argument).
  const AttnRun c = run(p1, in);
  EXPECT_GT(test::rel_error(a.o.to_floats(), c.o.to_floats()), 1e-2);
}

TEST(AttentionSdpa, LargeScoresStayFiniteAndConvex) {
  // Scores of order 1e3 overflow exp() without the max subtraction.
  const Problem p{{9, 4}, 2, 1, 8, 1.0f};
  const Inputs in = make_inputs(p, 808, 12.0f);
  const AttnRun r = run(p, in);
  const auto o = r.o.to_floats(), lse = r.saved.lse.to_floats();
  for (float x : lse) EXPECT_TRUE(std::isfinite(x));
  for (const Tensor* t : {&r.g.dq, &r.g.dk, &r.g.dv})
    for (float x : t->to_floats()) EXPECT_TRUE(std::isfinite(x));
  // Each output is a convex combination of the visible values.
  const auto cu = p.cu();
  for (int64_t b = 0; b < p.B(); ++b)
    for (int64_t i = cu[b]; i < cu[b + 1]; ++i)
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t d = 0; d < p.D; ++d) {
          float lo = INFINITY, hi = -INFINITY;
          for (int64_t j = cu[b]; j <= i; ++j) {
            lo = std::min(lo, in.v[j * p.D + d]);
            hi = std::max(hi, in.v[j * p.D + d]);
          }
          const float x = o[(i * p.Hq + h) * p.D + d];
          EXPECT_TRUE(std::isfinite(x));
          EXPECT_GE(x, lo - 1e-4f);
          EXPECT_LE(x, hi + 1e-4f);
        }
}

TEST(AttentionSdpa, BadInputsRaise) {
  const Problem p = kGqa;  // T = 16
  const Inputs in = make_inputs(p, 909);
  const int64_t T = p.T();
  Tensor q = Tensor::from_floats(in.q, {T, 4, 8});
  Tensor k = Tensor::from_floats(in.k, {T, 2, 8});
  Tensor v = Tensor::from_floats(in.v, {T, 2, 8});
  Tensor cu = p.cu_tensor();
  const float sc = p.scale;

  Tensor k3 = Tensor::from_floats(test::randn(T * 3 * 8, 1), {T, 3, 8});
  test::expect_error_contains([&] { attention_forward(q, k3, k3, AttentionArgs::causal_self(cu, sc), nullptr); },
                              "attention_forward: number of query heads Hq = 4 is not a multiple "
                              "of the number of kv heads Hkv = 3");
  Tensor cu_short = Tensor::from_ints({0, 5, 6, 13, 13, 15}, {6});
  test::expect_error_contains([&] { attention_forward(q, k, v, AttentionArgs::causal_self(cu_short, sc), nullptr); },
      "attention_forward: cu_seqlens_q[B] = 15 must equal the number of query tokens Tq = 16");
  test::expect_error_contains(
      [&] { attention_forward(q, k, v, AttentionArgs::causal_self(Tensor::from_ints({0, 5, 3, 16}, {4}), sc), nullptr); },
      "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 5");
  test::expect_error_contains(
      [&] { attention_forward(q, k, v, AttentionArgs::causal_self(Tensor::from_ints({2, 5, 16}, {3}), sc), nullptr); },
      "cu_seqlens_q[0] must be 0, got 2");
  Tensor cu64 = Tensor::empty({2}, DType::i64, Device::cpu(), MemCategory::other);
  cu64.data<int64_t>()[0] = 0;
  cu64.data<int64_t>()[1] = T;
  test::expect_error_contains(
      [&] { attention_forward(q, k, v, AttentionArgs::causal_self(cu64, sc), nullptr); },
      "attention_forward: argument 'cu_seqlens_q' has dtype i64, expected i32");
  Tensor k6 = Tensor::from_floats(test::randn(T * 2 * 6, 2), {T, 2, 6});
  test::expect_error_contains([&] { attention_forward(q, k6, v, AttentionArgs::causal_self(cu, sc), nullptr); },
                              "argument 'k' has shape [16, 2, 6], expected [-1, -1, 8]");
  test::expect_error_contains([&] { attention_forward(q, k, k6, AttentionArgs::causal_self(cu, sc), nullptr); },
                              "argument 'v' has shape [16, 2, 6], expected [16, 2, 8]");
  Tensor q0 = Tensor::empty({0, 4, 8}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor k0 = Tensor::empty({0, 2, 8}, DType::f32, Device::cpu(), MemCategory::other);
  test::expect_error_contains(
      [&] { attention_forward(q0, k0, k0, AttentionArgs::causal_self(Tensor::from_ints({0}, {1}), sc), nullptr); },
      "attention_forward: empty batch (Tq = 0 query tokens)");
  test::expect_error_contains(
      [&] { attention_forward(q, k.to_dtype(DType::bf16), v, AttentionArgs::causal_self(cu, sc), nullptr); },
      "argument 'k' has dtype bf16 but q has dtype f32");
  test::expect_error_contains(
      [&] {
        Tensor qh = q.to_dtype(DType::f16);
        attention_forward(qh, qh, qh, AttentionArgs::causal_self(cu, sc), nullptr);
      },
      "argument 'q' has dtype f16, expected f32 or bf16");
  test::expect_error_contains([&] { attention_forward(q, k, v, AttentionArgs::causal_self(cu, NAN), nullptr); },
                              "softmax_scale must be finite");

  AttentionSaved saved;
  Tensor o = attention_forward(q, k, v, AttentionArgs::causal_self(cu, sc), &saved);
  test::expect_error_contains(
      [&] { attention_backward(k, q, k, v, o, AttentionArgs::causal_self(cu, sc), saved); },
      "attention_backward: argument 'd_o' has shape [16, 2, 8], expected [16, 4, 8]");
  AttentionSaved bad{Tensor::zeros({2, T}, DType::f32, Device::cpu(), MemCategory::other)};
  test::expect_error_contains([&] { attention_backward(o, q, k, v, o, AttentionArgs::causal_self(cu, sc), bad); },
                              "argument 'saved.lse' has shape [2, 16], expected [4, 16]");
  test::expect_error_contains([&] { attention_backward(o, q, k, v, o, AttentionArgs::causal_self(cu, sc), AttentionSaved{}); },
                              "argument 'saved.lse' is undefined");
  test::expect_error_contains(
      [&] { attention_backward(o, q, k3, k3, o, AttentionArgs::causal_self(cu, sc), saved); },
      "attention_backward: number of query heads Hq = 4 is not a multiple");
}

// ---- query blocks against key blocks (the context-parallel calls) -----------------------------

struct BlockProblem {
  std::vector<int32_t> lens_q, lens_kv;
  int64_t Hq, Hkv, D;
  AttentionMask mask;
  float scale = 0.4f;

  static std::vector<int32_t> cu(const std::vector<int32_t>& lens) {
    std::vector<int32_t> c{0};
    for (int32_t l : lens) c.push_back(c.back() + l);
    return c;
  }
  int64_t Tq() const { return cu(lens_q).back(); }
  int64_t Tkv() const { return cu(lens_kv).back(); }
  int64_t B() const { return static_cast<int64_t>(lens_q.size()); }
  AttentionArgs args() const {
    return {Tensor::from_ints(cu(lens_q), {B() + 1}), Tensor::from_ints(cu(lens_kv), {B() + 1}),
            mask, scale};
  }
  ref::RefMask ref_mask() const { return static_cast<ref::RefMask>(static_cast<int>(mask)); }
};

struct BlockInputs {
  std::vector<float> q, k, v, d_o;
};

BlockInputs block_inputs(const BlockProblem& p, uint64_t seed) {
  const size_t nq = static_cast<size_t>(p.Tq() * p.Hq * p.D), nk = static_cast<size_t>(p.Tkv() * p.Hkv * p.D);
  return {test::randn(nq, seed, 1.0f, 0), test::randn(nk, seed, 1.0f, 1u << 20),
          test::randn(nk, seed, 1.0f, 2u << 20), test::randn(nq, seed, 1.0f, 3u << 20)};
}

struct BlockRun {
  Tensor o;
  AttentionSaved saved;
  AttentionGrads g;
};

BlockRun run_block(const BlockProblem& p, const BlockInputs& in) {
  Tensor q = Tensor::from_floats(in.q, {p.Tq(), p.Hq, p.D});
  Tensor k = Tensor::from_floats(in.k, {p.Tkv(), p.Hkv, p.D});
  Tensor v = Tensor::from_floats(in.v, {p.Tkv(), p.Hkv, p.D});
  Tensor d_o = Tensor::from_floats(in.d_o, {p.Tq(), p.Hq, p.D});
  BlockRun r;
  r.o = attention_forward(q, k, v, p.args(), &r.saved);
  r.g = attention_backward(d_o, q, k, v, r.o, p.args(), r.saved);
  return r;
}

// Independent oracle: the full Tq x Tkv score matrix in double with the visibility written out
// from global token indices (same sequence; key position vs query position by the mask).
void naive_block(const BlockProblem& p, const BlockInputs& in, std::vector<double>& o,
                 std::vector<double>& lse) {
  const int64_t Tq = p.Tq(), Tk = p.Tkv(), G = p.Hq / p.Hkv, D = p.D;
  const auto cq = BlockProblem::cu(p.lens_q), ck = BlockProblem::cu(p.lens_kv);
  std::vector<int64_t> seq_q(static_cast<size_t>(Tq)), pos_q(static_cast<size_t>(Tq)),
      seq_k(static_cast<size_t>(Tk)), pos_k(static_cast<size_t>(Tk));
  for (size_t b = 0; b + 1 < cq.size(); ++b) {
    for (int32_t t = cq[b]; t < cq[b + 1]; ++t) seq_q[t] = b, pos_q[t] = t - cq[b];
    for (int32_t t = ck[b]; t < ck[b + 1]; ++t) seq_k[t] = b, pos_k[t] = t - ck[b];
  }
  o.assign(static_cast<size_t>(Tq * p.Hq * D), 0.0);
  lse.assign(static_cast<size_t>(p.Hq * Tq), -INFINITY);
  for (int64_t h = 0; h < p.Hq; ++h)
    for (int64_t i = 0; i < Tq; ++i) {
      const int64_t b = seq_q[i];
      const int64_t sq = cq[b + 1] - cq[b], skv = ck[b + 1] - ck[b];
      std::vector<double> s(static_cast<size_t>(Tk), -INFINITY);
      double sum = 0;
      for (int64_t j = 0; j < Tk; ++j) {
        if (seq_k[j] != b) continue;
        bool visible = true;
        if (p.mask == AttentionMask::causal) visible = pos_k[j] <= pos_q[i];
        if (p.mask == AttentionMask::causal_bottom_right) visible = pos_k[j] <= pos_q[i] + (skv - sq);
        if (!visible) continue;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(in.q[(i * p.Hq + h) * D + d]) * in.k[(j * p.Hkv + h / G) * D + d];
        s[j] = p.scale * dot;
        sum += std::exp(s[j]);
      }
      if (sum == 0) continue;  // sees no key: o = 0, lse = -inf
      lse[h * Tq + i] = std::log(sum);
      for (int64_t j = 0; j < Tk; ++j) {
        if (s[j] == -INFINITY) continue;
        const double pij = std::exp(s[j]) / sum;
        for (int64_t d = 0; d < D; ++d) o[(i * p.Hq + h) * D + d] += pij * in.v[(j * p.Hkv + h / G) * D + d];
      }
    }
}

const std::vector<BlockProblem>& block_problems() {
  static const std::vector<BlockProblem> v = {
      // No mask: a key block wholly before the query block (an off-diagonal ring step).
      {{5, 1, 7, 0, 3}, {4, 6, 2, 3, 0}, 4, 2, 8, AttentionMask::none},
      // Bottom-right: the queries are the last positions of the keys (an all-gathered prefix).
      {{3, 1, 7, 0, 2}, {9, 1, 7, 2, 5}, 4, 2, 8, AttentionMask::causal_bottom_right},
      // Top-left causal with fewer and with more queries than keys.
      {{3, 6}, {7, 2}, 6, 3, 4, AttentionMask::causal},
      // A sequence with queries and no keys: o = 0, lse = -inf.
      {{2, 3, 4}, {0, 5, 4}, 2, 1, 8, AttentionMask::none},
  };
  return v;
}

TEST(AttentionBlocks, ForwardMatchesNaiveForEveryMask) {
  for (const BlockProblem& p : block_problems()) {
    SCOPED_TRACE(attention_mask_name(p.mask));
    const BlockInputs in = block_inputs(p, 777);
    const BlockRun r = run_block(p, in);
    std::vector<double> o_ref, lse_ref;
    naive_block(p, in, o_ref, lse_ref);
    EXPECT_LT(test::rel_error(r.o.to_floats(), o_ref), 1e-6);
    const std::vector<float> lse = r.saved.lse.to_floats();
    ASSERT_EQ(lse.size(), lse_ref.size());
    for (size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse_ref[i])) {
        EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i << " sees no key: lse " << lse[i];
      } else {
        EXPECT_NEAR(lse[i], lse_ref[i], 1e-5) << "lse " << i;
      }
    }
    EXPECT_EQ(r.o.shape(), (Shape{p.Tq(), p.Hq, p.D}));
    EXPECT_EQ(r.g.dk.shape(), (Shape{p.Tkv(), p.Hkv, p.D}));
  }
}

TEST(AttentionBlocks, BackwardMatchesFiniteDifferences) {
  for (const BlockProblem& p : block_problems()) {
    SCOPED_TRACE(attention_mask_name(p.mask));
    const BlockInputs in = block_inputs(p, 888);
    const BlockRun r = run_block(p, in);
    const auto cq = BlockProblem::cu(p.lens_q), ck = BlockProblem::cu(p.lens_kv);
    const size_t nq = in.q.size(), nk = in.k.size();
    const std::vector<double> w = test::cast<double>(in.d_o);  // L = sum w * o
    auto loss = [&](const std::vector<double>& x) {
      std::vector<double> o(nq);
      ref::attention_forward<double>(o.data(), nullptr, x.data(), x.data() + nq, x.data() + nq + nk,
                                     cq.data(), ck.data(), p.B(), p.Tq(), p.Hq, p.Hkv, p.D, p.scale,
                                     p.ref_mask());
      return test::weighted_sum(o, w);
    };
    std::vector<double> x = test::cast<double>(in.q);
    x.insert(x.end(), in.k.begin(), in.k.end());
    x.insert(x.end(), in.v.begin(), in.v.end());
    const std::vector<double> fd = test::finite_diff(loss, x);
    EXPECT_LT(test::rel_error(r.g.dq.to_floats(), std::vector<double>(fd.begin(), fd.begin() + nq)), test::kGradTol);
    EXPECT_LT(test::rel_error(r.g.dk.to_floats(), std::vector<double>(fd.begin() + nq, fd.begin() + nq + nk)), test::kGradTol);
    EXPECT_LT(test::rel_error(r.g.dv.to_floats(), std::vector<double>(fd.begin() + nq + nk, fd.end())), test::kGradTol);
  }
}

// What context parallelism does with the pieces: causal attention of a sequence split into a
// first and a second half equals (first half: causal on its own keys) and (second half: no mask
// on the first half's keys, merged by lse with causal on its own keys); and the second half
// against all keys with the bottom-right mask gives the same rows directly.
TEST(AttentionBlocks, SplitSequencesMergeByLseIntoFullCausal) {
  const int64_t Hq = 4, Hkv = 2, D = 8, n1 = 6, n2 = 5, T = n1 + n2;
  const float scale = 0.35f;
  const std::vector<float> q = test::randn(T * Hq * D, 1), k = test::randn(T * Hkv * D, 2),
                           v = test::randn(T * Hkv * D, 3);
  auto t = [&](const std::vector<float>& x, int64_t t0, int64_t len, int64_t H) {
    return Tensor::from_floats(std::vector<float>(x.begin() + t0 * H * D, x.begin() + (t0 + len) * H * D),
                               {len, H, D});
  };
  auto cu1 = [](int64_t n) { return Tensor::from_ints({0, static_cast<int32_t>(n)}, {2}); };
  AttentionSaved full_s;
  const std::vector<float> full =
      attention_forward(t(q, 0, T, Hq), t(k, 0, T, Hkv), t(v, 0, T, Hkv),
                        AttentionArgs::causal_self(cu1(T), scale), &full_s).to_floats();
  const std::vector<float> full_lse = full_s.lse.to_floats();
  // Second half: off-diagonal (no mask) + diagonal (causal), merged.
  AttentionSaved s_off, s_diag;
  const std::vector<float> o_off =
      attention_forward(t(q, n1, n2, Hq), t(k, 0, n1, Hkv), t(v, 0, n1, Hkv),
                        {cu1(n2), cu1(n1), AttentionMask::none, scale}, &s_off).to_floats();
  const std::vector<float> o_diag =
      attention_forward(t(q, n1, n2, Hq), t(k, n1, n2, Hkv), t(v, n1, n2, Hkv),
                        AttentionArgs::causal_self(cu1(n2), scale), &s_diag).to_floats();
  const std::vector<float> l_off = s_off.lse.to_floats(), l_diag = s_diag.lse.to_floats();
  std::vector<float> merged(static_cast<size_t>(n2 * Hq * D)), merged_lse(static_cast<size_t>(Hq * n2));
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < n2; ++i) {
      const double a = l_off[h * n2 + i], b = l_diag[h * n2 + i];
      const double L = std::max(a, b) + std::log(std::exp(a - std::max(a, b)) + std::exp(b - std::max(a, b)));
      merged_lse[h * n2 + i] = static_cast<float>(L);
      for (int64_t d = 0; d < D; ++d) {
        const size_t at = static_cast<size_t>((i * Hq + h) * D + d);
        merged[at] = static_cast<float>(std::exp(a - L) * o_off[at] + std::exp(b - L) * o_diag[at]);
      }
    }
  const std::vector<float> want(full.begin() + n1 * Hq * D, full.end());
  EXPECT_LT(test::max_abs_diff(merged, want), 1e-5);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < n2; ++i) EXPECT_NEAR(merged_lse[h * n2 + i], full_lse[h * T + n1 + i], 1e-5);
  // The same rows in one call: the second half's queries against every key, bottom-right.
  const std::vector<float> br =
      attention_forward(t(q, n1, n2, Hq), t(k, 0, T, Hkv), t(v, 0, T, Hkv),
                        {cu1(n2), cu1(T), AttentionMask::causal_bottom_right, scale}, nullptr).to_floats();
  EXPECT_LT(test::max_abs_diff(br, want), 1e-5);
}

TEST(AttentionBlocks, QueriesThatSeeNoKeyGetZeroOutputAndNoGradient) {
  const BlockProblem p{{3, 2}, {0, 4}, 2, 1, 8, AttentionMask::none};
  const BlockInputs in = block_inputs(p, 5);
  const BlockRun r = run_block(p, in);
  const std::vector<float> o = r.o.to_floats(), dq = r.g.dq.to_floats(), lse = r.saved.lse.to_floats();
  for (int64_t i = 0; i < 3 * p.Hq * p.D; ++i) {
    EXPECT_EQ(o[i], 0.0f);
    EXPECT_EQ(dq[i], 0.0f);
  }
  for (int64_t h = 0; h < p.Hq; ++h)
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(lse[h * p.Tq() + i], -INFINITY);
  for (float x : o) EXPECT_TRUE(std::isfinite(x));
  for (float x : r.g.dk.to_floats()) EXPECT_TRUE(std::isfinite(x));
}

TEST(AttentionBlocks, BadBlockArgumentsRaise) {
  const BlockProblem p{{3, 2}, {4, 4}, 2, 1, 8, AttentionMask::causal_bottom_right};
  const BlockInputs in = block_inputs(p, 6);
  Tensor q = Tensor::from_floats(in.q, {p.Tq(), p.Hq, p.D});
  Tensor k = Tensor::from_floats(in.k, {p.Tkv(), p.Hkv, p.D});
  AttentionArgs a = p.args();
  a.cu_seqlens_kv = Tensor::from_ints({0, 2, 8}, {3});  // sequence 0: 3 queries, 2 keys
  test::expect_error_contains([&] { attention_forward(q, k, k, a, nullptr); },
                              "causal_bottom_right mask needs at least as many keys as queries");
  a.cu_seqlens_kv = Tensor::from_ints({0, 8}, {2});
  test::expect_error_contains([&] { attention_forward(q, k, k, a, nullptr); },
                              "cu_seqlens_kv has 1 sequences, cu_seqlens_q 2");
  a.cu_seqlens_kv = Tensor::from_ints({0, 4, 7}, {3});
  test::expect_error_contains([&] { attention_forward(q, k, k, a, nullptr); },
                              "cu_seqlens_kv[B] = 7 must equal the number of key tokens Tkv = 8");
  test::expect_error_contains(
      [&] { attention_forward(q, k, k, AttentionArgs::causal_self(p.args().cu_seqlens_q, 1.0f), nullptr); },
      "without cu_seqlens_kv the keys are the queries' tokens, but k has 8 tokens and q 5");
}

}  // namespace
}  // namespace bb

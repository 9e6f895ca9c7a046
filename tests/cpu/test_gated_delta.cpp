// The gated delta rule (primitives/gdn): the recurrent reference against the matrix form of the
// issue's equation, its backward against finite differences in double, the float path against
// that, sequence boundaries in packed batches, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {
namespace {

struct Case {
  int64_t Hk = 2, Hv = 4, K = 3, V = 2;
  std::vector<int32_t> cu = {0, 3, 8};
  bool l2norm = true;
  int64_t T() const { return cu.back(); }
};

// Inputs in double: q, k, v, g (log decay in [-1, -0.05]), beta in [0.1, 0.9].
struct Inputs {
  std::vector<double> q, k, v, g, beta;
};
Inputs make_inputs(const Case& c, uint64_t seed) {
  const size_t T = static_cast<size_t>(c.T());
  Inputs in;
  in.q = test::cast<double>(test::randn(T * c.Hk * c.K, seed, 1.0f, 0));
  in.k = test::cast<double>(test::randn(T * c.Hk * c.K, seed, 1.0f, 1000));
  in.v = test::cast<double>(test::randn(T * c.Hv * c.V, seed, 1.0f, 2000));
  in.g = test::cast<double>(test::randu(T * c.Hv, seed, -1.0f, -0.05f, 3000));
  in.beta = test::cast<double>(test::randu(T * c.Hv, seed, 0.1f, 0.9f, 4000));
  return in;
}

ref::GdnShape shape(const Case& c) {
  ref::GdnShape s;
  s.T = c.T();
  s.Hk = c.Hk;
  s.Hv = c.Hv;
  s.K = c.K;
  s.V = c.V;
  s.scale = 1.0 / std::sqrt(static_cast<double>(c.K));
  s.l2norm = c.l2norm;
  return s;
}

std::vector<double> forward(const Case& c, const Inputs& in) {
  std::vector<double> o(static_cast<size_t>(c.T() * c.Hv * c.V));
  ref::gated_delta_forward<double>(o.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                   c.cu.data(), static_cast<int64_t>(c.cu.size()) - 1, shape(c));
  return o;
}

// The form with explicit matrices, S as [V, K]: S_t = e^g S (I - beta k k^T) + beta v k^T,
// o_t = S_t q; q, k normalised and q scaled first. Independent of the reference's loop order.
std::vector<double> matrix_form(const Case& c, const Inputs& in) {
  const int64_t K = c.K, V = c.V, G = c.Hv / c.Hk;
  std::vector<double> o(static_cast<size_t>(c.T() * c.Hv * V));
  auto unit = [&](const double* x, double scale) {
    double ss = 0;
    for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
    std::vector<double> y(static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) y[static_cast<size_t>(i)] = x[i] * (c.l2norm ? 1.0 / std::sqrt(ss + 1e-6) : 1.0) * scale;
    return y;
  };
  for (size_t n = 0; n + 1 < c.cu.size(); ++n)
    for (int64_t h = 0; h < c.Hv; ++h) {
      std::vector<double> S(static_cast<size_t>(V * K), 0.0);
      for (int64_t t = c.cu[n]; t < c.cu[n + 1]; ++t) {
        const int64_t hk = h / G;
        const std::vector<double> q = unit(&in.q[static_cast<size_t>((t * c.Hk + hk) * K)], 1.0 / std::sqrt(double(K)));
        const std::vector<double> k = unit(&in.k[static_cast<size_t>((t * c.Hk + hk) * K)], 1.0);
        const double a = std::exp(in.g[static_cast<size_t>(t * c.Hv + h)]), b = in.beta[static_cast<size_t>(t * c.Hv + h)];
        // M = I - b k k^T;  S = a S M + b v k^T
        std::vector<double> Sn(S.size(), 0.0);
        for (int64_t r = 0; r < V; ++r)
          for (int64_t j = 0; j < K; ++j) {
            double acc = 0;
            for (int64_t i = 0; i < K; ++i)
              acc += S[static_cast<size_t>(r * K + i)] * ((i == j ? 1.0 : 0.0) - b * k[static_cast<size_t>(i)] * k[static_cast<size_t>(j)]);
            Sn[static_cast<size_t>(r * K + j)] =
                a * acc + b * in.v[static_cast<size_t>((t * c.Hv + h) * V + r)] * k[static_cast<size_t>(j)];
          }
        S = Sn;
        for (int64_t r = 0; r < V; ++r) {
          double acc = 0;
          for (int64_t j = 0; j < K; ++j) acc += S[static_cast<size_t>(r * K + j)] * q[static_cast<size_t>(j)];
          o[static_cast<size_t>((t * c.Hv + h) * V + r)] = acc;
        }
      }
    }
  return o;
}

TEST(GatedDelta, RecurrenceEqualsTheMatrixForm) {
  for (bool l2 : {true, false}) {
    Case c;
    c.l2norm = l2;
    const Inputs in = make_inputs(c, 5);
    const std::vector<double> a = forward(c, in), b = matrix_form(c, in);
    EXPECT_LT(test::rel_error(a, b), 1e-12) << "l2norm " << l2;
  }
}

TEST(GatedDelta, BackwardMatchesFiniteDifferences) {
  for (bool l2 : {true, false}) {
    Case c;
    c.l2norm = l2;
    c.cu = {0, 1, 4, 4, 9};  // a one-token sequence and an empty one among them
    const Inputs in = make_inputs(c, 11);
    const std::vector<double> w = test::cast<double>(test::randn(static_cast<size_t>(c.T() * c.Hv * c.V), 12));
    // Analytic gradients in double.
    const size_t nq = in.q.size(), nv = in.v.size(), ng = in.g.size();
    std::vector<double> dq(nq), dk(nq), dv(nv), dg(ng), db(ng);
    ref::gated_delta_backward<double>(dq.data(), dk.data(), dv.data(), dg.data(), db.data(), w.data(), in.q.data(),
                                      in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.cu.data(),
                                      static_cast<int64_t>(c.cu.size()) - 1, shape(c));
    auto check = [&](std::vector<double> Inputs::*field, const std::vector<double>& analytic, const char* name) {
      auto f = [&](const std::vector<double>& x) {
        Inputs p = in;
        p.*field = x;
        return test::weighted_sum(forward(c, p), w);
      };
      const std::vector<double> fd = test::finite_diff(f, in.*field);
      EXPECT_LT(test::rel_error(analytic, fd), 1e-7) << name << " l2norm " << l2;
    };
    check(&Inputs::q, dq, "d_q");
    check(&Inputs::k, dk, "d_k");
    check(&Inputs::v, dv, "d_v");
    check(&Inputs::g, dg, "d_g");
    check(&Inputs::beta, db, "d_beta");
  }
}

Tensor f32(const std::vector<double>& x, const Shape& s) { return Tensor::from_floats(test::cast<float>(x), s); }

TEST(GatedDelta, FloatPathMatchesTheDoubleReference) {
  Case c;
  c.Hk = 2;
  c.Hv = 4;
  c.K = 8;
  c.V = 6;
  c.cu = {0, 17, 40, 41};
  const Inputs in = make_inputs(c, 21);
  const int64_t T = c.T();
  Tensor q = f32(in.q, {T, c.Hk, c.K}), k = f32(in.k, {T, c.Hk, c.K}), v = f32(in.v, {T, c.Hv, c.V}),
         g = f32(in.g, {T, c.Hv}), beta = f32(in.beta, {T, c.Hv}), cu = Tensor::from_ints(c.cu, {4});
  Tensor o = gated_delta_rule_forward(q, k, v, g, beta, cu);
  EXPECT_LT(test::rel_error(o.to_floats(), forward(c, in)), 1e-5);
  const std::vector<double> w = test::cast<double>(test::randn(static_cast<size_t>(T * c.Hv * c.V), 22));
  GatedDeltaGrads gr = gated_delta_rule_backward(f32(w, {T, c.Hv, c.V}), q, k, v, g, beta, cu);
  std::vector<double> dq(in.q.size()), dk(in.q.size()), dv(in.v.size()), dg(in.g.size()), db(in.g.size());
  ref::gated_delta_backward<double>(dq.data(), dk.data(), dv.data(), dg.data(), db.data(), w.data(), in.q.data(),
                                    in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.cu.data(), 3, shape(c));
  EXPECT_LT(test::rel_error(gr.d_q.to_floats(), dq), test::kGradTol);
  EXPECT_LT(test::rel_error(gr.d_k.to_floats(), dk), test::kGradTol);
  EXPECT_LT(test::rel_error(gr.d_v.to_floats(), dv), test::kGradTol);
  EXPECT_LT(test::rel_error(gr.d_g.to_floats(), dg), test::kGradTol);
  EXPECT_LT(test::rel_error(gr.d_beta.to_floats(), db), test::kGradTol);
}

// The chunked (WY/UT) form equals the recurrence, for chunks of 1, 4 and 64 and the sequence
// lengths the GPU kernels must handle around a chunk (1, 63, 64, 65) plus a two-chunk one.
TEST(GatedDelta, ChunkedFormEqualsTheRecurrence) {
  Case c;
  c.Hk = 2;
  c.Hv = 4;
  c.K = 6;
  c.V = 5;
  c.cu = {0, 1, 64, 128, 193, 323};
  const Inputs in = make_inputs(c, 41);
  const std::vector<double> rec = forward(c, in);
  for (int64_t chunk : {1, 4, 64}) {
    std::vector<double> o(rec.size());
    ref::gated_delta_forward_chunked<double>(o.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                                             in.beta.data(), c.cu.data(), 5, shape(c), chunk);
    EXPECT_LT(test::rel_error(o, rec), 1e-11) << "chunk " << chunk;
  }
  // In f32 too (the GPU keeps the state and accumulations in f32).
  std::vector<float> qf = test::cast<float>(in.q), kf = test::cast<float>(in.k), vf = test::cast<float>(in.v),
                     gf = test::cast<float>(in.g), bf = test::cast<float>(in.beta), of(rec.size());
  ref::gated_delta_forward_chunked<float>(of.data(), qf.data(), kf.data(), vf.data(), gf.data(), bf.data(), c.cu.data(),
                                          5, shape(c), 64);
  EXPECT_LT(test::rel_error(of, rec), 1e-5);
  // Strong decay (g = -3 per token: Gamma reaches e^-192 in a chunk, below the f32 range) stays
  // finite and equal.
  Inputs strong = in;
  for (double& x : strong.g) x = -3.0;
  const std::vector<double> rec2 = forward(c, strong);
  std::vector<float> g3 = test::cast<float>(strong.g), o3(rec.size());
  ref::gated_delta_forward_chunked<float>(o3.data(), qf.data(), kf.data(), vf.data(), g3.data(), bf.data(), c.cu.data(),
                                          5, shape(c), 64);
  EXPECT_LT(test::rel_error(o3, rec2), 1e-5);
}

// The state never crosses a boundary: a packed batch equals each sequence run alone.
TEST(GatedDelta, PackedSequencesAreIndependent) {
  Case c;
  c.cu = {0, 4, 9, 15};
  const Inputs in = make_inputs(c, 31);
  const std::vector<double> packed = forward(c, in);
  const int64_t per_tok_q = c.Hk * c.K, per_tok_v = c.Hv * c.V, per_tok_g = c.Hv;
  for (size_t n = 0; n + 1 < c.cu.size(); ++n) {
    const int64_t a = c.cu[n], L = c.cu[n + 1] - a;
    Case one = c;
    one.cu = {0, static_cast<int32_t>(L)};
    Inputs sub;
    auto cut = [&](const std::vector<double>& x, int64_t per) {
      return std::vector<double>(x.begin() + a * per, x.begin() + (a + L) * per);
    };
    sub.q = cut(in.q, per_tok_q);
    sub.k = cut(in.k, per_tok_q);
    sub.v = cut(in.v, per_tok_v);
    sub.g = cut(in.g, per_tok_g);
    sub.beta = cut(in.beta, per_tok_g);
    const std::vector<double> alone = forward(one, sub), part = cut(packed, per_tok_v);
    EXPECT_EQ(alone, part) << "sequence " << n;
  }
}

TEST(GatedDelta, BadInputsAreClearErrors) {
  const Tensor q = Tensor::zeros({4, 2, 3}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor v = Tensor::zeros({4, 3, 2}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor v4 = Tensor::zeros({4, 4, 2}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor g3 = Tensor::zeros({4, 3}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor g4 = Tensor::zeros({4, 4}, DType::f32, Device::cpu(), MemCategory::other);
  const Tensor cu = Tensor::from_ints({0, 4}, {2});
  test::expect_error_contains([&] { gated_delta_rule_forward(q, q, v, g3, g3, cu); }, "positive multiple of key heads");
  test::expect_error_contains([&] { gated_delta_rule_forward(q, q, v4, g4, g4, Tensor::from_ints({0, 3}, {2})); },
                              "end at T = 4");
  test::expect_error_contains([&] { gated_delta_rule_forward(q, q, v4, g3, g4, cu); }, "'g'");
  test::expect_error_contains(
      [&] { gated_delta_rule_forward(q.to_dtype(DType::bf16), q, v4, g4, g4, cu); }, "'q'");
}

// The CPU reference keeps no forward prep (GatedDeltaPrep is a CUDA fast path): the forward
// leaves it empty, and a backward given the empty prep matches one given none.
TEST(GatedDelta, CpuForwardKeepsNoPrep) {
  const int64_t T = 5, Hk = 1, Hv = 2, K = 4;
  const Tensor q = Tensor::from_floats(test::randn(T * Hk * K, 1), {T, Hk, K});
  const Tensor k = Tensor::from_floats(test::randn(T * Hk * K, 2), {T, Hk, K});
  const Tensor v = Tensor::from_floats(test::randn(T * Hv * K, 3), {T, Hv, K});
  const Tensor g = Tensor::from_floats(test::randu(T * Hv, 4, -0.3f, -0.01f), {T, Hv});
  const Tensor b = Tensor::from_floats(test::randu(T * Hv, 5, 0.1f, 0.9f), {T, Hv});
  const Tensor d_o = Tensor::from_floats(test::randn(T * Hv * K, 6), {T, Hv, K});
  const Tensor cu = Tensor::from_ints({0, 2, 5}, {3});
  GatedDeltaPrep prep;
  prep.cu = {1, 2, 3};  // stale content is reset
  const Tensor o = gated_delta_rule_forward(q, k, v, g, b, cu, {}, MemCategory::activations, &prep);
  EXPECT_FALSE(prep.defined());
  EXPECT_TRUE(prep.cu.empty());
  EXPECT_EQ(o.to_floats(), gated_delta_rule_forward(q, k, v, g, b, cu).to_floats());
  const GatedDeltaGrads a = gated_delta_rule_backward(d_o, q, k, v, g, b, cu);
  const GatedDeltaGrads c = gated_delta_rule_backward(d_o, q, k, v, g, b, cu, {}, &prep);
  EXPECT_EQ(a.d_q.to_floats(), c.d_q.to_floats());
  EXPECT_EQ(a.d_g.to_floats(), c.d_g.to_floats());
}

}  // namespace
}  // namespace bb

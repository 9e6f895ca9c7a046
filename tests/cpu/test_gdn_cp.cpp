// Context parallelism of the gated delta rule by state summaries (primitives/gdn, the `states`
// member of primitives.gdn_cp; skills/gdn-cp-states.md), in one process:
//   - the rule with start states and end-state gradients: a sequence cut in two and run as two
//     calls carrying the state equals one call; the backward's gradients (inputs, start state)
//     against finite differences in double;
//   - the summaries: the end state is P S0 + E for any start S0; the start-state gradient from
//     the outputs alone equals the backward's;
//   - the whole scheme on P simulated ranks (P = 2, 3, 4; head-tail pieces of packed sequences
//     shorter than, equal to and longer than a rank's share): summaries, the fold over earlier
//     pieces, each rank's run, and the backward's reverse fold give the single-rank outputs and
//     gradients in double to 1e-12;
//   - the f32 entry points against the double reference, and bad states as clear errors.
// The conv halo and the collectives run in tests/mpi/test_gdn_cp_states.cpp.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "core/context_shard.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gated_delta_rule_ref.h"

namespace bb {
namespace {

struct Dims {
  int64_t Hk = 2, Hv = 4, K = 3, V = 2;
};

ref::GdnShape shape_of(const Dims& d, int64_t T) {
  ref::GdnShape s;
  s.T = T;
  s.Hk = d.Hk;
  s.Hv = d.Hv;
  s.K = d.K;
  s.V = d.V;
  s.scale = 1.0 / std::sqrt(static_cast<double>(d.K));
  return s;
}

struct Inputs {
  std::vector<double> q, k, v, g, beta;
};
Inputs make_inputs(const Dims& d, int64_t T, uint64_t seed) {
  const size_t t = static_cast<size_t>(T);
  Inputs in;
  in.q = test::cast<double>(test::randn(t * d.Hk * d.K, seed, 1.0f, 0));
  in.k = test::cast<double>(test::randn(t * d.Hk * d.K, seed, 1.0f, 1000));
  in.v = test::cast<double>(test::randn(t * d.Hv * d.V, seed, 1.0f, 2000));
  in.g = test::cast<double>(test::randu(t * d.Hv, seed, -0.6f, -0.02f, 3000));
  in.beta = test::cast<double>(test::randu(t * d.Hv, seed, 0.1f, 0.9f, 4000));
  return in;
}

int64_t nseq(const std::vector<int32_t>& cu) { return static_cast<int64_t>(cu.size()) - 1; }

std::vector<double> fwd(const Dims& d, const Inputs& in, const std::vector<int32_t>& cu, const double* s0 = nullptr,
                        std::vector<double>* s_end = nullptr) {
  const int64_t T = cu.back();
  std::vector<double> o(static_cast<size_t>(T * d.Hv * d.V));
  if (s_end) s_end->assign(static_cast<size_t>(nseq(cu) * d.Hv * d.K * d.V), 0.0);
  ref::gated_delta_forward<double>(o.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                   cu.data(), nseq(cu), shape_of(d, T), s0, s_end ? s_end->data() : nullptr);
  return o;
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, db, ds0;
};
Grads bwd(const Dims& d, const Inputs& in, const std::vector<int32_t>& cu, const std::vector<double>& d_o,
          const double* s0, const double* ds_end) {
  Grads r;
  r.dq.resize(in.q.size());
  r.dk.resize(in.k.size());
  r.dv.resize(in.v.size());
  r.dg.resize(in.g.size());
  r.db.resize(in.beta.size());
  r.ds0.resize(static_cast<size_t>(nseq(cu) * d.Hv * d.K * d.V));
  ref::gated_delta_backward<double>(r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.db.data(), d_o.data(),
                                    in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), cu.data(),
                                    nseq(cu), shape_of(d, cu.back()), s0, ds_end, r.ds0.data());
  return r;
}

// Rows [a, b) of a [T, ...] vector with `w` values a row.
std::vector<double> rows(const std::vector<double>& x, int64_t w, int64_t a, int64_t b) {
  return {x.begin() + a * w, x.begin() + b * w};
}
Inputs rows(const Inputs& in, const Dims& d, int64_t a, int64_t b) {
  return {rows(in.q, d.Hk * d.K, a, b), rows(in.k, d.Hk * d.K, a, b), rows(in.v, d.Hv * d.V, a, b),
          rows(in.g, d.Hv, a, b), rows(in.beta, d.Hv, a, b)};
}

TEST(GdnCpStates, CarriedStateEqualsOneCall) {
  const Dims d;
  const std::vector<int32_t> whole = {0, 11};
  const Inputs in = make_inputs(d, 11, 3);
  const std::vector<double> o = fwd(d, in, whole);
  for (int64_t cut : {1, 4, 10}) {
    std::vector<double> end;
    const std::vector<double> a = fwd(d, rows(in, d, 0, cut), {0, static_cast<int32_t>(cut)}, nullptr, &end);
    const std::vector<double> b = fwd(d, rows(in, d, cut, 11), {0, static_cast<int32_t>(11 - cut)}, end.data());
    std::vector<double> ab = a;
    ab.insert(ab.end(), b.begin(), b.end());
    EXPECT_LT(test::rel_error(ab, o), 1e-13) << "cut " << cut;
  }
}

TEST(GdnCpStates, BackwardWithStatesMatchesFiniteDifferences) {
  const Dims d;
  const std::vector<int32_t> cu = {0, 3, 3, 7};  // an empty sequence among them
  const int64_t T = cu.back(), nS = nseq(cu) * d.Hv * d.K * d.V;
  const Inputs in = make_inputs(d, T, 7);
  const std::vector<double> s0 = test::cast<double>(test::randn(static_cast<size_t>(nS), 8, 0.5f));
  const std::vector<double> w = test::cast<double>(test::randn(static_cast<size_t>(T * d.Hv * d.V), 9));
  const std::vector<double> wS = test::cast<double>(test::randn(static_cast<size_t>(nS), 10));
  // loss = <w, o> + <wS, S_end>: the end states' gradient is wS.
  auto loss = [&](const Inputs& x, const std::vector<double>& start) {
    std::vector<double> end;
    const std::vector<double> o = fwd(d, x, cu, start.data(), &end);
    return test::weighted_sum(o, w) + test::weighted_sum(end, wS);
  };
  const Grads g = bwd(d, in, cu, w, s0.data(), wS.data());
  auto check = [&](std::vector<double> Inputs::*field, const std::vector<double>& analytic, const char* name) {
    const std::vector<double> fd = test::finite_diff(
        [&](const std::vector<double>& x) {
          Inputs p = in;
          p.*field = x;
          return loss(p, s0);
        },
        in.*field);
    EXPECT_LT(test::rel_error(analytic, fd), 1e-7) << name;
  };
  check(&Inputs::q, g.dq, "d_q");
  check(&Inputs::k, g.dk, "d_k");
  check(&Inputs::v, g.dv, "d_v");
  check(&Inputs::g, g.dg, "d_g");
  check(&Inputs::beta, g.db, "d_beta");
  const std::vector<double> fd0 = test::finite_diff([&](const std::vector<double>& x) { return loss(in, x); }, s0);
  EXPECT_LT(test::rel_error(g.ds0, fd0), 1e-7) << "d_start";
}

TEST(GdnCpStates, SummariesAreTheAffineMapAndItsGradient) {
  const Dims d;
  const std::vector<int32_t> cu = {0, 5, 5, 6, 13};  // empty and one-token sequences
  const int64_t T = cu.back(), n = nseq(cu), KK = d.Hv * d.K * d.K, KV = d.Hv * d.K * d.V;
  const Inputs in = make_inputs(d, T, 21);
  const ref::GdnShape s = shape_of(d, T);
  std::vector<double> P(static_cast<size_t>(n * KK)), E(static_cast<size_t>(n * KV)), D(static_cast<size_t>(n * KV));
  ref::gated_delta_transition<double>(P.data(), in.k.data(), in.g.data(), in.beta.data(), cu.data(), n, s);
  ref::gated_delta_forward<double>(nullptr, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                   cu.data(), n, s, nullptr, E.data());
  const std::vector<double> s0 = test::cast<double>(test::randn(static_cast<size_t>(n * KV), 22));
  std::vector<double> end;
  fwd(d, in, cu, s0.data(), &end);
  std::vector<double> affine(end.size());
  for (int64_t i = 0; i < n * d.Hv; ++i)
    for (int64_t a = 0; a < d.K; ++a)
      for (int64_t b = 0; b < d.V; ++b) {
        double x = E[static_cast<size_t>(i * d.K * d.V + a * d.V + b)];
        for (int64_t c = 0; c < d.K; ++c)
          x += P[static_cast<size_t>(i * d.K * d.K + a * d.K + c)] * s0[static_cast<size_t>(i * d.K * d.V + c * d.V + b)];
        affine[static_cast<size_t>(i * d.K * d.V + a * d.V + b)] = x;
      }
  EXPECT_LT(test::rel_error(affine, end), 1e-13);
  // An empty sequence's transition is the identity.
  for (int64_t h = 0; h < d.Hv; ++h)
    for (int64_t a = 0; a < d.K; ++a)
      for (int64_t c = 0; c < d.K; ++c)
        EXPECT_EQ(P[static_cast<size_t>((1 * d.Hv + h) * d.K * d.K + a * d.K + c)], a == c ? 1.0 : 0.0);
  // The start-state gradient from the outputs alone: the backward's with no end-state gradient,
  // whatever the start state.
  const std::vector<double> d_o = test::cast<double>(test::randn(static_cast<size_t>(T * d.Hv * d.V), 23));
  ref::gated_delta_start_grad<double>(D.data(), d_o.data(), in.q.data(), in.k.data(), in.g.data(), in.beta.data(),
                                      cu.data(), n, s);
  EXPECT_LT(test::rel_error(D, bwd(d, in, cu, d_o, s0.data(), nullptr).ds0), 1e-13);
  EXPECT_LT(test::rel_error(D, bwd(d, in, cu, d_o, nullptr, nullptr).ds0), 1e-13);
}

// ---- the scheme on simulated ranks ----

// Piece (b, c) of rank r's two pieces per sequence: the local cu and rows of every rank.
struct Rank {
  std::vector<int32_t> cu;             // head and tail chunk of every sequence as pieces
  std::vector<int64_t> global;         // each local row's row in the whole batch
};
Rank rank_of(const std::vector<int64_t>& lens, int64_t P, int64_t r) {
  Rank k;
  const cp_layout::RankLayout L = cp_layout::rank_layout(lens, P, r);
  k.cu.push_back(0);
  for (const cp_layout::RankSeq& s : L.seqs) {
    k.cu.push_back(k.cu.back() + static_cast<int32_t>(s.head));
    k.cu.push_back(k.cu.back() + static_cast<int32_t>(s.tail));
  }
  k.global = cp_layout::global_rows(lens, P, r);
  return k;
}
std::vector<double> pick(const std::vector<double>& x, int64_t w, const std::vector<int64_t>& rows_) {
  std::vector<double> out;
  for (int64_t r : rows_) out.insert(out.end(), x.begin() + r * w, x.begin() + (r + 1) * w);
  return out;
}
void put(std::vector<double>& x, int64_t w, const std::vector<int64_t>& rows_, const std::vector<double>& src) {
  for (size_t i = 0; i < rows_.size(); ++i)
    std::copy(src.begin() + static_cast<int64_t>(i) * w, src.begin() + static_cast<int64_t>(i + 1) * w,
              x.begin() + rows_[i] * w);
}
// Y = A X + Y per head: A [Hv, K, K] (transposed when `ta`), X, Y [Hv, K, V].
void fold(const Dims& d, const double* A, bool ta, const std::vector<double>& X, std::vector<double>& Y) {
  for (int64_t h = 0; h < d.Hv; ++h)
    for (int64_t a = 0; a < d.K; ++a)
      for (int64_t b = 0; b < d.V; ++b) {
        double acc = 0;
        for (int64_t c = 0; c < d.K; ++c)
          acc += A[h * d.K * d.K + (ta ? c * d.K + a : a * d.K + c)] * X[static_cast<size_t>((h * d.K + c) * d.V + b)];
        Y[static_cast<size_t>((h * d.K + a) * d.V + b)] += acc;
      }
}

TEST(GdnCpStates, SchemeOnSimulatedRanksEqualsTheSingleRank) {
  const Dims d;
  const int64_t KK = d.Hv * d.K * d.K, KV = d.Hv * d.K * d.V, wq = d.Hk * d.K, wv = d.Hv * d.V;
  for (int64_t P : {2, 3, 4}) {
    // Shorter than, equal to and longer than one rank's share (2 pieces of 2P), packed.
    const std::vector<int64_t> lens = {1, 2 * P, 3, 4 * P + 3, 2, 17, 5};
    std::vector<int32_t> cu = {0};
    for (int64_t l : lens) cu.push_back(cu.back() + static_cast<int32_t>(l));
    const int64_t T = cu.back(), B = static_cast<int64_t>(lens.size());
    const Inputs in = make_inputs(d, T, 40 + static_cast<uint64_t>(P));
    const std::vector<double> d_o = test::cast<double>(test::randn(static_cast<size_t>(T * wv), 41));
    const std::vector<double> o_ref = fwd(d, in, cu);
    const Grads g_ref = bwd(d, in, cu, d_o, nullptr, nullptr);
    // Every rank's summaries (what the all-gather carries).
    std::vector<Rank> R;
    std::vector<Inputs> local;
    std::vector<std::vector<double>> Pm, Em, Dm;
    for (int64_t r = 0; r < P; ++r) {
      R.push_back(rank_of(lens, P, r));
      const Rank& k = R.back();
      local.push_back({pick(in.q, wq, k.global), pick(in.k, wq, k.global), pick(in.v, wv, k.global),
                       pick(in.g, d.Hv, k.global), pick(in.beta, d.Hv, k.global)});
      const Inputs& x = local.back();
      const ref::GdnShape s = shape_of(d, k.cu.back());
      Pm.emplace_back(static_cast<size_t>(2 * B * KK));
      Em.emplace_back(static_cast<size_t>(2 * B * KV));
      Dm.emplace_back(static_cast<size_t>(2 * B * KV));
      ref::gated_delta_transition<double>(Pm.back().data(), x.k.data(), x.g.data(), x.beta.data(), k.cu.data(), 2 * B, s);
      ref::gated_delta_forward<double>(nullptr, x.q.data(), x.k.data(), x.v.data(), x.g.data(), x.beta.data(),
                                       k.cu.data(), 2 * B, s, nullptr, Em.back().data());
      const std::vector<double> dol = pick(d_o, wv, k.global);
      ref::gated_delta_start_grad<double>(Dm.back().data(), dol.data(), x.q.data(), x.k.data(), x.g.data(),
                                          x.beta.data(), k.cu.data(), 2 * B, s);
    }
    auto at = [&](int64_t b, int64_t c, int64_t& r) {  // chunk c's rank and slot
      r = c < P ? c : 2 * P - 1 - c;
      return 2 * b + (c < P ? 0 : 1);
    };
    std::vector<double> o(o_ref.size());
    Grads g{std::vector<double>(in.q.size()), std::vector<double>(in.k.size()), std::vector<double>(in.v.size()),
            std::vector<double>(in.g.size()), std::vector<double>(in.beta.size()), {}};
    for (int64_t r = 0; r < P; ++r) {
      std::vector<double> s0(static_cast<size_t>(2 * B * KV)), dse(static_cast<size_t>(2 * B * KV));
      for (int64_t b = 0; b < B; ++b) {
        std::vector<double> S(static_cast<size_t>(KV), 0.0);
        for (int64_t c = 0; c < 2 * P; ++c) {
          if (c == r || c == 2 * P - 1 - r)
            std::copy(S.begin(), S.end(), s0.begin() + (2 * b + (c == r ? 0 : 1)) * KV);
          int64_t q = 0;
          const int64_t sl = at(b, c, q);
          std::vector<double> next(Em[static_cast<size_t>(q)].begin() + sl * KV,
                                   Em[static_cast<size_t>(q)].begin() + (sl + 1) * KV);
          fold(d, Pm[static_cast<size_t>(q)].data() + sl * KK, false, S, next);
          S = next;
        }
        std::vector<double> G(static_cast<size_t>(KV), 0.0);
        for (int64_t c = 2 * P - 1; c >= 0; --c) {
          if (c == r || c == 2 * P - 1 - r)
            std::copy(G.begin(), G.end(), dse.begin() + (2 * b + (c == r ? 0 : 1)) * KV);
          int64_t q = 0;
          const int64_t sl = at(b, c, q);
          std::vector<double> next(Dm[static_cast<size_t>(q)].begin() + sl * KV,
                                   Dm[static_cast<size_t>(q)].begin() + (sl + 1) * KV);
          fold(d, Pm[static_cast<size_t>(q)].data() + sl * KK, true, G, next);
          G = next;
        }
      }
      const Rank& k = R[static_cast<size_t>(r)];
      put(o, wv, k.global, fwd(d, local[static_cast<size_t>(r)], k.cu, s0.data()));
      const Grads gl = bwd(d, local[static_cast<size_t>(r)], k.cu, pick(d_o, wv, k.global), s0.data(), dse.data());
      put(g.dq, wq, k.global, gl.dq);
      put(g.dk, wq, k.global, gl.dk);
      put(g.dv, wv, k.global, gl.dv);
      put(g.dg, d.Hv, k.global, gl.dg);
      put(g.db, d.Hv, k.global, gl.db);
    }
    EXPECT_LT(test::rel_error(o, o_ref), 1e-12) << "P " << P;
    EXPECT_LT(test::rel_error(g.dq, g_ref.dq), 1e-12) << "P " << P;
    EXPECT_LT(test::rel_error(g.dk, g_ref.dk), 1e-12) << "P " << P;
    EXPECT_LT(test::rel_error(g.dv, g_ref.dv), 1e-12) << "P " << P;
    EXPECT_LT(test::rel_error(g.dg, g_ref.dg), 1e-12) << "P " << P;
    EXPECT_LT(test::rel_error(g.db, g_ref.db), 1e-12) << "P " << P;
  }
}

// ---- the f32 entry points ----

Tensor f32(const std::vector<double>& x, const Shape& s) { return Tensor::from_floats(test::cast<float>(x), s); }

TEST(GdnCpStates, FloatEntryPointsMatchTheDoubleReference) {
  const Dims d;
  const std::vector<int32_t> cu = {0, 6, 6, 15};
  const int64_t T = cu.back(), n = nseq(cu), KV = d.Hv * d.K * d.V;
  const Inputs in = make_inputs(d, T, 31);
  const ref::GdnShape s = shape_of(d, T);
  const Tensor q = f32(in.q, {T, d.Hk, d.K}), k = f32(in.k, {T, d.Hk, d.K}), v = f32(in.v, {T, d.Hv, d.V}),
               g = f32(in.g, {T, d.Hv}), beta = f32(in.beta, {T, d.Hv});
  const Tensor cut = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  const std::vector<double> s0 = test::cast<double>(test::randn(static_cast<size_t>(n * KV), 32));
  const std::vector<double> dse = test::cast<double>(test::randn(static_cast<size_t>(n * KV), 33));
  const std::vector<double> d_o = test::cast<double>(test::randn(static_cast<size_t>(T * d.Hv * d.V), 34));
  const Tensor S0 = f32(s0, {n, d.Hv, d.K, d.V}), dSe = f32(dse, {n, d.Hv, d.K, d.V}), dO = f32(d_o, {T, d.Hv, d.V});
  // Forward and backward with states.
  EXPECT_LT(test::rel_error(gated_delta_rule_forward(q, k, v, g, beta, cut, {}, MemCategory::activations, nullptr, &S0)
                                .to_floats(),
                            fwd(d, in, cu, s0.data())),
            1e-5);
  const GatedDeltaGrads gg = gated_delta_rule_backward(dO, q, k, v, g, beta, cut, {}, nullptr, &S0, &dSe);
  const Grads gr = bwd(d, in, cu, d_o, s0.data(), dse.data());
  EXPECT_LT(test::rel_error(gg.d_q.to_floats(), gr.dq), 1e-5);
  EXPECT_LT(test::rel_error(gg.d_k.to_floats(), gr.dk), 1e-5);
  EXPECT_LT(test::rel_error(gg.d_v.to_floats(), gr.dv), 1e-5);
  EXPECT_LT(test::rel_error(gg.d_g.to_floats(), gr.dg), 1e-5);
  EXPECT_LT(test::rel_error(gg.d_beta.to_floats(), gr.db), 1e-5);
  // Summaries and the start-state gradient.
  const GatedDeltaSummary sum = gated_delta_rule_summary(q, k, v, g, beta, cut);
  std::vector<double> P(static_cast<size_t>(n * d.Hv * d.K * d.K)), E(static_cast<size_t>(n * KV)),
      D(static_cast<size_t>(n * KV));
  ref::gated_delta_transition<double>(P.data(), in.k.data(), in.g.data(), in.beta.data(), cu.data(), n, s);
  ref::gated_delta_forward<double>(nullptr, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                   cu.data(), n, s, nullptr, E.data());
  ref::gated_delta_start_grad<double>(D.data(), d_o.data(), in.q.data(), in.k.data(), in.g.data(), in.beta.data(),
                                      cu.data(), n, s);
  EXPECT_EQ(sum.transition.shape(), (Shape{n, d.Hv, d.K, d.K}));
  EXPECT_LT(test::rel_error(sum.transition.to_floats(), P), 1e-5);
  EXPECT_LT(test::rel_error(sum.end_state.to_floats(), E), 1e-5);
  EXPECT_LT(test::rel_error(gated_delta_rule_start_grad(dO, q, k, v, g, beta, cut).to_floats(), D), 1e-5);
}

TEST(GdnCpStates, BadStatesAreClearErrors) {
  const Dims d;
  const int64_t T = 5;
  const Inputs in = make_inputs(d, T, 51);
  const Tensor q = f32(in.q, {T, d.Hk, d.K}), k = f32(in.k, {T, d.Hk, d.K}), v = f32(in.v, {T, d.Hv, d.V}),
               g = f32(in.g, {T, d.Hv}), beta = f32(in.beta, {T, d.Hv});
  const Tensor cu = Tensor::from_ints({0, 2, 5}, {3});
  const Tensor wrong = Tensor::zeros({1, d.Hv, d.K, d.V}, DType::f32, Device::cpu(), MemCategory::workspace);
  test::expect_error_contains(
      [&] { gated_delta_rule_forward(q, k, v, g, beta, cu, {}, MemCategory::activations, nullptr, &wrong); },
      "initial_state");
  const Tensor dO = Tensor::zeros({T, d.Hv, d.V}, DType::f32, Device::cpu(), MemCategory::workspace);
  test::expect_error_contains([&] { gated_delta_rule_backward(dO, q, k, v, g, beta, cu, {}, nullptr, nullptr, &wrong); },
                              "d_final_state");
}

}  // namespace
}  // namespace bb

// gated_delta_rule_ref.h — CPU reference of the gated delta rule in its recurrent form (templated
// over the scalar type: double for finite-difference checks, float in production).
//
// One value head h (state S: [K, V], zero at each sequence start), key head h / G:
//   q_t, k_t  L2-normalised (x * rsqrt(sum x^2 + eps)) when `l2norm`; q_t scaled by `scale`
//   A   = exp(g_t) S_{t-1}
//   m   = A^T k_t                   (what the state predicts for k_t)
//   d   = beta_t (v_t - m)
//   S_t = A + k_t d^T               (= exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
//                                     written with S as [K, V])
//   o_t = S_t^T q_t
// Backward, t from the end, with dS the gradient reaching S_t from later tokens:
//   dS += q_t do_t^T;  dq_t = S_t do_t
//   dA = dS;  dk_t += dS d;  dd = dS^T k_t
//   dbeta_t = dd . (v_t - m);  dv_t = beta_t dd;  dm = -beta_t dd
//   dA += k_t dm^T;  dk_t += A dm
//   dg_t = sum(dA o A);  dS_{t-1} = exp(g_t) dA
// then through the scale and the L2 norm: y = x r, r = (|x|^2 + eps)^-1/2, dx = r dy - r^3 x (x . dy).
// The backward rebuilds the states by running the forward again (nothing but the inputs is saved).
//
// Layout (packed, T tokens): q, k [T, Hk, K]; v, o [T, Hv, V]; g, beta [T, Hv]; cu [n + 1].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bb::ref {

struct GdnShape {
  int64_t T = 0, Hk = 0, Hv = 0, K = 0, V = 0;
  double scale = 1.0;
  bool l2norm = true;
  double eps = 1e-6;
};

namespace gdn_detail {

// The normalised (and, for q, scaled) vector of token t, head h; r = the norm factor.
template <class T>
void prep(const T* x, int64_t K, bool l2norm, double eps, double scale, T* out, T* r) {
  double ss = 0;
  for (int64_t i = 0; i < K; ++i) ss += static_cast<double>(x[i]) * x[i];
  *r = l2norm ? static_cast<T>(1.0 / std::sqrt(ss + eps)) : T(1);
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * *r * static_cast<T>(scale);
}

// d(x r s)/dx applied to dy: s (r dy - r^3 x (x . dy)), or s dy without the norm.
template <class T>
void prep_backward(const T* x, const T* dy, int64_t K, bool l2norm, T r, double scale, T* dx) {
  const T s = static_cast<T>(scale);
  if (!l2norm) {
    for (int64_t i = 0; i < K; ++i) dx[i] += s * dy[i];
    return;
  }
  T dot = 0;
  for (int64_t i = 0; i < K; ++i) dot += x[i] * dy[i];
  for (int64_t i = 0; i < K; ++i) dx[i] += s * (r * dy[i] - r * r * r * x[i] * dot);
}

}  // namespace gdn_detail

// o [T, Hv, V] written (o null: no outputs, the end states only). States [nseq, Hv, K, V]:
// s_init (null: zero) is each sequence's start state, s_final (null: not wanted) receives its end
// state (the start state for an empty sequence).
template <class T>
void gated_delta_forward(T* o, const T* q, const T* k, const T* v, const T* g, const T* beta,
                         const int32_t* cu, int64_t nseq, const GdnShape& s, const T* s_init = nullptr,
                         T* s_final = nullptr) {
  const int64_t G = s.Hv / s.Hk, K = s.K, V = s.V;
  std::vector<T> S(static_cast<size_t>(K * V)), qn(static_cast<size_t>(K)), kn(static_cast<size_t>(K)),
      m(static_cast<size_t>(V)), d(static_cast<size_t>(V));
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t h = 0; h < s.Hv; ++h) {
      const int64_t hk = h / G;
      const size_t at = static_cast<size_t>((n * s.Hv + h) * K * V);
      if (s_init != nullptr)
        std::copy(s_init + at, s_init + at + S.size(), S.begin());
      else
        std::fill(S.begin(), S.end(), T(0));
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        T r;
        gdn_detail::prep(q + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, s.scale, qn.data(), &r);
        gdn_detail::prep(k + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, 1.0, kn.data(), &r);
        const T decay = std::exp(g[t * s.Hv + h]), b = beta[t * s.Hv + h];
        const T* vt = v + (t * s.Hv + h) * V;
        for (auto& x : S) x *= decay;
        for (int64_t j = 0; j < V; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += S[static_cast<size_t>(i * V + j)] * kn[static_cast<size_t>(i)];
          m[static_cast<size_t>(j)] = acc;
          d[static_cast<size_t>(j)] = b * (vt[j] - acc);
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) S[static_cast<size_t>(i * V + j)] += kn[static_cast<size_t>(i)] * d[static_cast<size_t>(j)];
        if (o == nullptr) continue;
        T* ot = o + (t * s.Hv + h) * V;
        for (int64_t j = 0; j < V; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += S[static_cast<size_t>(i * V + j)] * qn[static_cast<size_t>(i)];
          ot[j] = acc;
        }
      }
      if (s_final != nullptr) std::copy(S.begin(), S.end(), s_final + at);
    }
}

// Gradients written (=): dq, dk [T, Hk, K], dv [T, Hv, V], dg, dbeta [T, Hv]. States [nseq, Hv, K,
// V]: s_init the forward's start states (null: zero); ds_final the gradient reaching each end state
// from outside (null: zero); ds_init (null: not wanted) receives the start states' gradients.
template <class T>
void gated_delta_backward(T* dq, T* dk, T* dv, T* dg, T* dbeta, const T* d_o, const T* q, const T* k,
                          const T* v, const T* g, const T* beta, const int32_t* cu, int64_t nseq,
                          const GdnShape& s, const T* s_init = nullptr, const T* ds_final = nullptr,
                          T* ds_init = nullptr) {
  const int64_t G = s.Hv / s.Hk, K = s.K, V = s.V;
  const size_t KV = static_cast<size_t>(K * V);
  std::fill(dq, dq + s.T * s.Hk * K, T(0));
  std::fill(dk, dk + s.T * s.Hk * K, T(0));
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t h = 0; h < s.Hv; ++h) {
      const int64_t hk = h / G, t0 = cu[n], L = cu[n + 1] - cu[n];
      // Rebuild every state of the sequence: states[u] = S_{t0 + u}, states[-1] = 0 (index 0 here).
      std::vector<T> states(static_cast<size_t>(L + 1) * KV, T(0));
      const size_t at = static_cast<size_t>(n * s.Hv + h) * KV;
      if (s_init != nullptr) std::copy(s_init + at, s_init + at + KV, states.begin());
      std::vector<T> qn(static_cast<size_t>(L * K)), kn(static_cast<size_t>(L * K)), rq(static_cast<size_t>(L)),
          rk(static_cast<size_t>(L)), dvec(static_cast<size_t>(L * V)), mvec(static_cast<size_t>(L * V));
      for (int64_t u = 0; u < L; ++u) {
        const int64_t t = t0 + u;
        gdn_detail::prep(q + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, s.scale, &qn[static_cast<size_t>(u * K)], &rq[static_cast<size_t>(u)]);
        gdn_detail::prep(k + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, 1.0, &kn[static_cast<size_t>(u * K)], &rk[static_cast<size_t>(u)]);
        const T decay = std::exp(g[t * s.Hv + h]), b = beta[t * s.Hv + h];
        const T* prev = &states[static_cast<size_t>(u) * KV];
        T* cur = &states[static_cast<size_t>(u + 1) * KV];
        for (size_t e = 0; e < KV; ++e) cur[e] = decay * prev[e];
        const T* kt = &kn[static_cast<size_t>(u * K)];
        const T* vt = v + (t * s.Hv + h) * V;
        for (int64_t j = 0; j < V; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += cur[i * V + j] * kt[i];
          mvec[static_cast<size_t>(u * V + j)] = acc;
          dvec[static_cast<size_t>(u * V + j)] = b * (vt[j] - acc);
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) cur[i * V + j] += kt[i] * dvec[static_cast<size_t>(u * V + j)];
      }
      std::vector<T> dS(KV, T(0)), dA(KV), dqn(static_cast<size_t>(K)), dkn(static_cast<size_t>(K)),
          A(KV), dd(static_cast<size_t>(V)), dm(static_cast<size_t>(V));
      if (ds_final != nullptr) std::copy(ds_final + at, ds_final + at + KV, dS.begin());
      for (int64_t u = L - 1; u >= 0; --u) {
        const int64_t t = t0 + u;
        const T decay = std::exp(g[t * s.Hv + h]), b = beta[t * s.Hv + h];
        const T* St = &states[static_cast<size_t>(u + 1) * KV];
        const T* prev = &states[static_cast<size_t>(u) * KV];
        const T* qt = &qn[static_cast<size_t>(u * K)];
        const T* kt = &kn[static_cast<size_t>(u * K)];
        const T* dot = d_o + (t * s.Hv + h) * V;
        const T* vt = v + (t * s.Hv + h) * V;
        const T* dl = &dvec[static_cast<size_t>(u * V)];
        const T* ml = &mvec[static_cast<size_t>(u * V)];
        for (int64_t i = 0; i < K; ++i) {
          T acc = 0;
          for (int64_t j = 0; j < V; ++j) {
            dS[static_cast<size_t>(i * V + j)] += qt[i] * dot[j];
            acc += St[i * V + j] * dot[j];
          }
          dqn[static_cast<size_t>(i)] = acc;
        }
        for (size_t e = 0; e < KV; ++e) {
          dA[e] = dS[e];
          A[e] = decay * prev[e];
        }
        for (int64_t i = 0; i < K; ++i) {
          T acc = 0;
          for (int64_t j = 0; j < V; ++j) acc += dS[static_cast<size_t>(i * V + j)] * dl[j];
          dkn[static_cast<size_t>(i)] = acc;
        }
        T db = 0;
        for (int64_t j = 0; j < V; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += dS[static_cast<size_t>(i * V + j)] * kt[i];
          dd[static_cast<size_t>(j)] = acc;
          db += acc * (vt[j] - ml[j]);
          dv[(t * s.Hv + h) * V + j] = b * acc;
          dm[static_cast<size_t>(j)] = -b * acc;
        }
        dbeta[t * s.Hv + h] = db;
        for (int64_t i = 0; i < K; ++i) {
          T acc = 0;
          for (int64_t j = 0; j < V; ++j) {
            dA[static_cast<size_t>(i * V + j)] += kt[i] * dm[static_cast<size_t>(j)];
            acc += A[static_cast<size_t>(i * V + j)] * dm[static_cast<size_t>(j)];
          }
          dkn[static_cast<size_t>(i)] += acc;
        }
        T dgt = 0;
        for (size_t e = 0; e < KV; ++e) {
          dgt += dA[e] * A[e];
          dS[e] = decay * dA[e];
        }
        dg[t * s.Hv + h] = dgt;
        gdn_detail::prep_backward(q + (t * s.Hk + hk) * K, dqn.data(), K, s.l2norm, rq[static_cast<size_t>(u)], s.scale,
                                  dq + (t * s.Hk + hk) * K);
        gdn_detail::prep_backward(k + (t * s.Hk + hk) * K, dkn.data(), K, s.l2norm, rk[static_cast<size_t>(u)], 1.0,
                                  dk + (t * s.Hk + hk) * K);
      }
      if (ds_init != nullptr) std::copy(dS.begin(), dS.end(), ds_init + at);
    }
}

// Context parallelism by state summaries (skills/gdn-cp-states.md). Per value head, token t acts
// on the state as S_t = A_t S_{t-1} + beta_t k_t v_t^T with A_t = exp(g_t) (I - beta_t k_t k_t^T)
// (k_t normalised; A_t symmetric), so a sequence maps its start state affinely: S_end = P S_start +
// E, with P = A_L ... A_1 its transition and E its end state from a zero start.
//
// transition [nseq, Hv, K, K] written: P of each sequence (the identity for an empty one).
template <class T>
void gated_delta_transition(T* transition, const T* k, const T* g, const T* beta, const int32_t* cu,
                            int64_t nseq, const GdnShape& s) {
  const int64_t G = s.Hv / s.Hk, K = s.K;
  std::vector<T> kn(static_cast<size_t>(K)), kp(static_cast<size_t>(K));
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t h = 0; h < s.Hv; ++h) {
      T* P = transition + (n * s.Hv + h) * K * K;
      std::fill(P, P + K * K, T(0));
      for (int64_t i = 0; i < K; ++i) P[i * K + i] = T(1);
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        T r;
        gdn_detail::prep(k + (t * s.Hk + h / G) * K, K, s.l2norm, s.eps, 1.0, kn.data(), &r);
        const T decay = std::exp(g[t * s.Hv + h]), b = beta[t * s.Hv + h];
        // P <- decay (P - beta k (k^T P))
        for (int64_t j = 0; j < K; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += kn[static_cast<size_t>(i)] * P[i * K + j];
          kp[static_cast<size_t>(j)] = acc;
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < K; ++j)
            P[i * K + j] = decay * (P[i * K + j] - b * kn[static_cast<size_t>(i)] * kp[static_cast<size_t>(j)]);
      }
    }
}

// ds_start [nseq, Hv, K, V] written: the gradient of each sequence's start state from its outputs'
// gradients d_o alone (none reaching its end state): sum_t (A_t ... A_1)^T q_t do_t^T. It does not
// depend on the start state or on v.
template <class T>
void gated_delta_start_grad(T* ds_start, const T* d_o, const T* q, const T* k, const T* g, const T* beta,
                            const int32_t* cu, int64_t nseq, const GdnShape& s) {
  const int64_t G = s.Hv / s.Hk, K = s.K, V = s.V;
  std::vector<T> qn(static_cast<size_t>(K)), kn(static_cast<size_t>(K)), kd(static_cast<size_t>(V));
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t h = 0; h < s.Hv; ++h) {
      const int64_t hk = h / G;
      T* D = ds_start + (n * s.Hv + h) * K * V;
      std::fill(D, D + K * V, T(0));
      for (int64_t t = cu[n + 1] - 1; t >= cu[n]; --t) {
        T r;
        gdn_detail::prep(q + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, s.scale, qn.data(), &r);
        gdn_detail::prep(k + (t * s.Hk + hk) * K, K, s.l2norm, s.eps, 1.0, kn.data(), &r);
        const T decay = std::exp(g[t * s.Hv + h]), b = beta[t * s.Hv + h];
        const T* dot = d_o + (t * s.Hv + h) * V;
        // D <- A_t^T (D + q_t do_t^T) = decay ((D + q do^T) - beta k (k^T (D + q do^T)))
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) D[i * V + j] += qn[static_cast<size_t>(i)] * dot[j];
        for (int64_t j = 0; j < V; ++j) {
          T acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += kn[static_cast<size_t>(i)] * D[i * V + j];
          kd[static_cast<size_t>(j)] = acc;
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j)
            D[i * V + j] = decay * (D[i * V + j] - b * kn[static_cast<size_t>(i)] * kd[static_cast<size_t>(j)]);
      }
    }
}

// The chunked (WY / UT) form of the same forward, what the GPU kernels compute. Per value head and
// chunk of C tokens with state S0 at its start, Gamma_t = exp(sum_{i <= t} g_i) within the chunk:
//   L[t, i] = beta_t (Gamma_t / Gamma_i) k_t . k_i        (i < t; strictly lower triangular)
//   T = (I + L)^-1                                        (forward substitution)
//   U = T diag(beta) V,   W = T diag(beta Gamma) K,   delta = U - W S0       (delta [C, V])
//   O = diag(Gamma) Q S0 + (M o Q K^T) delta,         M[t, i] = Gamma_t / Gamma_i (i <= t)
//   S_C = Gamma_C S0 + K^T diag(Gamma_C / Gamma) delta
// delta_t is the recurrent form's d at token t, so the two forms agree to rounding.
template <class T>
void gated_delta_forward_chunked(T* o, const T* q, const T* k, const T* v, const T* g, const T* beta,
                                 const int32_t* cu, int64_t nseq, const GdnShape& s, int64_t chunk) {
  const int64_t G = s.Hv / s.Hk, K = s.K, V = s.V;
  std::vector<T> S(static_cast<size_t>(K * V));
  for (int64_t n = 0; n < nseq; ++n)
    for (int64_t h = 0; h < s.Hv; ++h) {
      const int64_t hk = h / G;
      std::fill(S.begin(), S.end(), T(0));
      for (int64_t c0 = cu[n]; c0 < cu[n + 1]; c0 += chunk) {
        const int64_t C = std::min<int64_t>(chunk, cu[n + 1] - c0);
        std::vector<T> Q(static_cast<size_t>(C * K)), Kc(static_cast<size_t>(C * K)), gam(static_cast<size_t>(C)),
            lgam(static_cast<size_t>(C)), b(static_cast<size_t>(C)), D(static_cast<size_t>(C * V));
        // Ratios as exp of differences of the cumulative log decay: no underflow to 0/0 when
        // Gamma itself is below the float range.
        auto ratio = [&](int64_t t, int64_t i) { return std::exp(lgam[static_cast<size_t>(t)] - lgam[static_cast<size_t>(i)]); };
        T acc_g = 0;
        for (int64_t t = 0; t < C; ++t) {
          const int64_t tok = c0 + t;
          T r;
          gdn_detail::prep(q + (tok * s.Hk + hk) * K, K, s.l2norm, s.eps, s.scale, &Q[static_cast<size_t>(t * K)], &r);
          gdn_detail::prep(k + (tok * s.Hk + hk) * K, K, s.l2norm, s.eps, 1.0, &Kc[static_cast<size_t>(t * K)], &r);
          acc_g += g[tok * s.Hv + h];
          lgam[static_cast<size_t>(t)] = acc_g;
          gam[static_cast<size_t>(t)] = std::exp(acc_g);
          b[static_cast<size_t>(t)] = beta[tok * s.Hv + h];
        }
        auto dotk = [&](const T* a, const T* c) {
          T x = 0;
          for (int64_t i = 0; i < K; ++i) x += a[i] * c[i];
          return x;
        };
        // rhs_t = beta_t (v_t - Gamma_t S0^T k_t); then forward substitution with L.
        for (int64_t t = 0; t < C; ++t) {
          const T* kt = &Kc[static_cast<size_t>(t * K)];
          const T* vt = v + ((c0 + t) * s.Hv + h) * V;
          for (int64_t j = 0; j < V; ++j) {
            T sk = 0;
            for (int64_t i = 0; i < K; ++i) sk += S[static_cast<size_t>(i * V + j)] * kt[i];
            T x = b[static_cast<size_t>(t)] * (vt[j] - gam[static_cast<size_t>(t)] * sk);
            for (int64_t i = 0; i < t; ++i)
              x -= b[static_cast<size_t>(t)] * ratio(t, i) *
                   dotk(kt, &Kc[static_cast<size_t>(i * K)]) * D[static_cast<size_t>(i * V + j)];
            D[static_cast<size_t>(t * V + j)] = x;
          }
        }
        for (int64_t t = 0; t < C; ++t) {
          const T* qt = &Q[static_cast<size_t>(t * K)];
          T* ot = o + ((c0 + t) * s.Hv + h) * V;
          for (int64_t j = 0; j < V; ++j) {
            T sq = 0;
            for (int64_t i = 0; i < K; ++i) sq += S[static_cast<size_t>(i * V + j)] * qt[i];
            T x = gam[static_cast<size_t>(t)] * sq;
            for (int64_t i = 0; i <= t; ++i)
              x += ratio(t, i) * dotk(qt, &Kc[static_cast<size_t>(i * K)]) *
                   D[static_cast<size_t>(i * V + j)];
            ot[j] = x;
          }
        }
        const T last = gam[static_cast<size_t>(C - 1)];
        // S_C = Gamma_C S0 + sum_t (Gamma_C / Gamma_t) k_t delta_t^T
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) {
            T x = last * S[static_cast<size_t>(i * V + j)];
            for (int64_t t = 0; t < C; ++t)
              x += ratio(C - 1, t) * Kc[static_cast<size_t>(t * K + i)] * D[static_cast<size_t>(t * V + j)];
            S[static_cast<size_t>(i * V + j)] = x;
          }
      }
    }
}

}  // namespace bb::ref

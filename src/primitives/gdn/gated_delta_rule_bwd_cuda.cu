// gated_delta_rule_bwd_cuda.cu — the backward direction of the CUDA gated delta rule: the kernels
// convert_do, the reverse state pass, dqkw, wy_bwd and finalize_qk, their launchers, the
// backward's workspace and its driver (the prep and the rebuild of the chunk-start states run
// through gated_delta_rule_fwd_cuda.cu). Design notes: the top of gated_delta_rule_cuda.cu;
// shared pieces: gdn_cuda_common.cuh.
#include "primitives/gdn/gdn_cuda_common.cuh"

namespace bb::cuda {

using namespace gdn;  // gdn_cuda_common.cuh (the kernels stay in the anonymous namespace here,
                      // so their names in profiles are as they were)

namespace {

// ---- 4. d_o -> operand planes [T, Hv, D] --------------------------------------------------------
template <class Tdo, int NPL>
__global__ void __launch_bounds__(kThreads)
    convert_do_kernel(Dims d, uint16_t* dop, const Tdo* d_o) {
  const int64_t rows = d.T * d.Hv, ps = rows * kD, n = rows * (kD / 4);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / (kD / 4);
    const int c = static_cast<int>(i % (kD / 4)) * 4;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < d.V) ld4(d_o + r * d.V + c, x);
    uint16_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = f2bf(x[e]);
      lo[e] = f2bf(x[e] - bf2f(hi[e]));
    }
    *reinterpret_cast<U2*>(dop + r * kD + c) = U2{pack2(hi[0], hi[1]), pack2(hi[2], hi[3])};
    if constexpr (NPL == 2)
      *reinterpret_cast<U2*>(dop + ps + r * kD + c) = U2{pack2(lo[0], lo[1]), pack2(lo[2], lo[3])};
  }
}

// ---- 5. reverse state pass: dS (gradient of the chunk-end state), chunks last to first ----------
//   dh[n] = dS;  dDelta = diag(c) K dS + P^T dO;  dS <- Gamma_last dS + Q^T diag(Gamma) dO - W^T
//   dDelta
template <int NPL, int VT>
struct StateBwdLayout {
  static constexpr int kStages = NPL == 1 ? 2 : 1;
  static constexpr size_t kK = 0;
  static constexpr size_t kQ = kK + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kW = kQ + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kP = kW + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kO = kP + align128(Tile<kC, kC, NPL>::kBytes);
  static constexpr size_t kG = kO + align128(Tile<kC, VT, NPL>::kBytes);
  static constexpr size_t kStage = kG + align128(kC * 4);
  static constexpr size_t kS = kStages * kStage;
  static constexpr size_t kDd = kS + align128(Tile<kD, VT, NPL>::kBytes);
  static constexpr size_t kGo = kDd + align128(Tile<kC, VT, NPL>::kBytes);
  static constexpr size_t kBytes = kGo + align128(Tile<kC, VT, NPL>::kBytes);
};

template <int NPL, int VT, int NW>
__global__ void __launch_bounds__(NW * 32, 2)
    state_bwd_kernel(Dims d, const uint16_t* kh, const uint16_t* qh, const uint16_t* w,
                     const uint16_t* pm, const uint16_t* dop, int64_t psdo, const float* gcum,
                     uint16_t* dhs, uint16_t* ddl) {
  static_assert(NW == 4 || NW == 8, "state pass warps");
  constexpr int NT = VT / 8, NT2 = VT / 8 / (NW / 4), NTH = NW * 32, MS = kD / NW / 16;
  using L = StateBwdLayout<NPL, VT>;
  unsigned char* sm = smem_base();
  const Tile<kD, VT, NPL> dSt{reinterpret_cast<uint16_t*>(sm + L::kS)};
  const Tile<kC, VT, NPL> dDt{reinterpret_cast<uint16_t*>(sm + L::kDd)};  // holds -dDelta
  const Tile<kC, VT, NPL> GOt{reinterpret_cast<uint16_t*>(sm + L::kGo)};  // diag(Gamma) dO
  const int tid = threadIdx.x, warp = tid >> 5;
  const int rm = (warp & 3) * 16, cn = (warp >> 2) * (VT / (NW / 4)), rs = warp * (kD / NW);
  constexpr int nvt = kD / VT;
  const int h = blockIdx.x / nvt, v0 = (blockIdx.x % nvt) * VT, hk = h / d.G;
  const int first = d.seq_first(blockIdx.y), count = d.seq_count(blockIdx.y);
  const int64_t psk = d.T * d.Hk * kD, psv = d.T * d.Hv * kD, psc = d.T * d.Hv * kC;
  const int64_t psh = static_cast<int64_t>(d.NC) * d.Hv * kD * kD;

  auto K_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kK)};
  };
  auto Q_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kQ)};
  };
  auto W_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kW)};
  };
  auto P_s = [&](int s) {
    return Tile<kC, kC, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kP)};
  };
  auto O_s = [&](int s) {
    return Tile<kC, VT, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kO)};
  };
  auto G_s = [&](int s) { return reinterpret_cast<float*>(sm + s * L::kStage + L::kG); };

  auto issue = [&](int idx, int s) {
    const int n = first + idx, c0 = d.chunk_start(n), C = d.chunk_len(n);
    const int64_t rv = static_cast<int64_t>(c0) * d.Hv + h,
                  rk = static_cast<int64_t>(c0) * d.Hk + hk;
    load_rows<NTH>(K_s(s), kh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, 0, C);
    load_rows<NTH>(Q_s(s), qh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, 0, C);
    load_rows<NTH>(W_s(s), w, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
    load_rows<NTH>(P_s(s), pm, psc, rv * kC, static_cast<int64_t>(d.Hv) * kC, 0, C);
    load_rows<NTH>(O_s(s), dop, psdo, rv * kD, static_cast<int64_t>(d.Hv) * kD, v0, C);
    if (tid < kC)
      cp_async4(G_s(s) + tid, tid < C ? gcum + (static_cast<int64_t>(c0) + tid) * d.Hv + h : gcum,
                tid < C);
    cp_async_commit();
  };

  float dS[MS][NT][4];  // rows rs + [0, 16 MS)
  zero(dS);
  const int seq = static_cast<int>(blockIdx.y);
  if (d.dcin != nullptr && seq == d.cout_seq) carry_tile<false>(dS, const_cast<float*>(d.dcin), h, rs, v0);
  if (count > 0) issue(count - 1, 0);
  for (int it = 0; it < count; ++it) {
    const int idx = count - 1 - it;
    const int s = L::kStages == 2 ? (it & 1) : 0;
    const int n = first + idx, c0 = d.chunk_start(n), C = d.chunk_len(n);
    if (L::kStages == 1 && it > 0) {
      block_sync();
      issue(idx, 0);
    }
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = frag_row(rs, mt, hf), c = frag_col(0, nt);
          dSt.put2(r, c, dS[mt][nt][2 * hf], dS[mt][nt][2 * hf + 1]);
          gstore2<NPL>(dhs, psh, ((static_cast<int64_t>(n) * d.Hv + h) * kD + r) * kD + v0 + c,
                       dS[mt][nt][2 * hf], dS[mt][nt][2 * hf + 1]);
        }
    cp_async_wait_all();
    block_sync();
    if (L::kStages == 2 && idx > 0) issue(idx - 1, s ^ 1);

    const float* gam = G_s(s);
    const float gl = gam[C - 1];
    for (int i = tid; i < kC * VT / 2; i += NTH) {
      const int r = i / (VT / 2), c = (i % (VT / 2)) * 2;
      const float gr = r < C ? fexp(gam[r]) : 0.f;
      const F2 ov = O_s(s).get2(r, c);
      GOt.put2(r, c, gr * ov.x, gr * ov.y);
    }
    float ct[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int t = frag_row(rm, 0, hf);
      ct[hf] = t < C ? fexp(gl - gam[t]) : 0.f;
    }
    float dD[1][NT2][4];
    zero(dD);
    warp_mma<1, NT2, false, true, kD>(dD, K_s(s), rm, dSt, cn);
#pragma unroll
    for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dD[0][nt][e] *= ct[e >> 1];
    warp_mma<1, NT2, true, true, kC>(dD, P_s(s), rm, O_s(s), cn);
#pragma unroll
    for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = frag_row(rm, 0, hf), c = frag_col(cn, nt);
        const bool ok = t < C;
        const float d0 = ok ? dD[0][nt][2 * hf] : 0.f, d1 = ok ? dD[0][nt][2 * hf + 1] : 0.f;
        dDt.put2(t, c, -d0, -d1);
        if (ok)
          gstore2<NPL>(ddl, psv, ((static_cast<int64_t>(c0) + t) * d.Hv + h) * kD + v0 + c, d0, d1);
      }
    block_sync();
    const float dec = fexp(gl);
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dS[mt][nt][e] *= dec;
    warp_mma<MS, NT, true, true, kC>(dS, Q_s(s), rs, GOt, 0);
    warp_mma<MS, NT, true, true, kC>(dS, W_s(s), rs, dDt, 0);
  }
  // dS is now the gradient of the sequence's start state.
  if (d.dcout != nullptr && seq == d.cin_seq) carry_tile<true>(dS, d.dcout, h, rs, v0);
}

// ---- 6. per chunk and value head: dq^, dk^ (intra and state parts), dW, dgamma parts ------------
//   dP = dO Delta^T,  dPM = M o dP
//   dq^ = diag(Gamma) dO S0^T + dPM K^           dk^ = diag(c) Delta dS^T + dPM^T Q^
//   dW = -dDelta S0^T
//   dgamma_t = Gamma_t q_t.(dO S0^T)_t + sum_i dP_ti P_ti - sum_j dP_jt P_jt - c_t k_t.(Delta
//   dS^T)_t
//              + [t = last] (Gamma_last sum(dS o S0) + sum_t c_t k_t.(Delta dS^T)_t)
// The state tiles S0 = h[n] and dS = dh[n] are taken in two halves of their K rows.
template <int NPL>
struct DqkwLayout {
  static constexpr size_t kO = 0;
  static constexpr size_t kDl = kO + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kDd = kDl + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kPM = kDd + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kS0 = kPM + align128(Tile<kC, kC, NPL>::kBytes);
  static constexpr size_t kdS = kS0 + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kU =
      kdS + align128(Tile<kC, kD, NPL>::kBytes);  // union of the two phases
  static constexpr size_t kP = kU;                // phase A: P
  static constexpr size_t kKh = kU;               // phase B: K^, Q^ halves
  static constexpr size_t kQh = kKh + align128(Tile<kC, kC, NPL>::kBytes);
  static constexpr size_t kUEnd = kQh + align128(Tile<kC, kC, NPL>::kBytes);
  // gamma, dg row terms, row q dots, row k dots, dg column terms per warp [kWarps][64], red.
  // (The dP o P sums are reduced in registers, not through a 64 x 65 f32 tile: that keeps the
  // block at 106 KiB for bf16, two blocks an SM.)
  static constexpr size_t kF = kUEnd;
  static constexpr size_t kBytes = kF + align128((4 * kC + kWarps * kC + kWarps) * 4);
};

template <int NPL>
__global__ void __launch_bounds__(kThreads)
    dqkw_kernel(Dims d, const uint16_t* kh, const uint16_t* qh, const uint16_t* pm,
                const uint16_t* dop, int64_t psdo, const uint16_t* dl, const uint16_t* ddl,
                const uint16_t* hs, const uint16_t* dhs, const float* gcum, float* dqp, float* dkp,
                uint16_t* dwp, float* dgp) {
  using L = DqkwLayout<NPL>;
  unsigned char* sm = smem_base();
  const Tile<kC, kD, NPL> Ot{reinterpret_cast<uint16_t*>(sm + L::kO)};
  const Tile<kC, kD, NPL> Dlt{reinterpret_cast<uint16_t*>(sm + L::kDl)};
  const Tile<kC, kD, NPL> Ddt{reinterpret_cast<uint16_t*>(sm + L::kDd)};
  const Tile<kC, kC, NPL> PMt{reinterpret_cast<uint16_t*>(sm + L::kPM)};
  const Tile<kC, kD, NPL> S0t{reinterpret_cast<uint16_t*>(sm + L::kS0)};
  const Tile<kC, kD, NPL> dSt{reinterpret_cast<uint16_t*>(sm + L::kdS)};
  const Tile<kC, kC, NPL> Pt{reinterpret_cast<uint16_t*>(sm + L::kP)};
  const Tile<kC, kC, NPL> Kht{reinterpret_cast<uint16_t*>(sm + L::kKh)};
  const Tile<kC, kC, NPL> Qht{reinterpret_cast<uint16_t*>(sm + L::kQh)};
  float* gam = reinterpret_cast<float*>(sm + L::kF);
  float* dgrow = gam + kC;
  float* rowq = dgrow + kC;
  float* rowk = rowq + kC;
  float* colp = rowk + kC;  // [kWarps][kC]
  float* red = colp + kWarps * kC;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int n, h;
  chunk_head(d, n, h);
  const int hk = h / d.G;
  const int c0 = d.chunk_start(n), C = d.chunk_len(n);
  const int64_t psk = d.T * d.Hk * kD, psv = d.T * d.Hv * kD, psc = d.T * d.Hv * kC;
  const int64_t psh = static_cast<int64_t>(d.NC) * d.Hv * kD * kD;
  const int64_t rv = static_cast<int64_t>(c0) * d.Hv + h, rk = static_cast<int64_t>(c0) * d.Hk + hk;

  load_rows(Ot, dop, psdo, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
  load_rows(Dlt, dl, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
  load_rows(Ddt, ddl, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
  load_rows(Pt, pm, psc, rv * kC, static_cast<int64_t>(d.Hv) * kC, 0, C);
  cp_async_commit();
  if (tid < kC) gam[tid] = tid < C ? gcum[(static_cast<int64_t>(c0) + tid) * d.Hv + h] : 0.f;
  cp_async_wait_all();
  block_sync();
  const float gl = gam[C - 1];

  {  // phase A: dP = dO Delta^T; E = (i < t) dP o P summed over its rows (dgrow, in the
     // accumulator's lanes) and columns (per warp over its 16 rows, then over the warps)
    float acc[1][8][4];
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Ot, warp * 16, Dlt, 0);
    float rs[2] = {0.f, 0.f}, cs[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      cs[nt][0] = cs[nt][1] = 0.f;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = frag_row(warp * 16, 0, hf), i = frag_col(0, nt);
        float pmv[2];
        const F2 pv = Pt.get2(t, i);
        const float pe[2] = {pv.x, pv.y};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ii = i + e;
          const float dp = acc[0][nt][2 * hf + e];
          pmv[e] = (t < C && ii <= t) ? dp * fexp(gam[t] - gam[ii]) : 0.f;
          const float ev = (t < C && ii < t) ? dp * pe[e] : 0.f;
          rs[hf] += ev;
          cs[nt][e] += ev;
        }
        PMt.put2(t, i, pmv[0], pmv[1]);
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float r = row_reduce4(rs[hf]);
      if ((lane & 3) == 0) dgrow[frag_row(warp * 16, 0, hf)] = r;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float c = cs[nt][e];
        c += shfl_xor(c, 4);
        c += shfl_xor(c, 8);
        c += shfl_xor(c, 16);
        if (lane < 4) colp[warp * kC + frag_col(0, nt) + e] = c;
      }
  }
  float dq_dot[2] = {0.f, 0.f}, dk_dot[2] = {0.f, 0.f}, dlast = 0.f;
#pragma unroll 1
  for (int hf = 0; hf < 2; ++hf) {
    block_sync();  // the union (phase A's P, E / the previous half's K^, Q^) and S0, dS are free
    const int64_t hrow = (static_cast<int64_t>(n) * d.Hv + h) * kD + hf * 64;
    load_rows(S0t, hs, psh, hrow * kD, kD, 0, 64);
    load_rows(dSt, dhs, psh, hrow * kD, kD, 0, 64);
    load_rows(Kht, kh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, hf * 64, C);
    load_rows(Qht, qh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, hf * 64, C);
    cp_async_commit();
    cp_async_wait_all();
    block_sync();
    // sum(S0 o dS) over the half: both tiles share one swizzle, so element j of the raw
    // planes is the same (row, column) in each; 16-byte reads, order-independent positions.
    for (int i = tid; i < 64 * kD / 8; i += kThreads) {
#pragma unroll
      for (int pl = 0; pl < NPL; ++pl) {
        const uint4 a = reinterpret_cast<const uint4*>(S0t.p + pl * S0t.kPlane)[i];
        const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int ql = 0; ql < NPL; ++ql) {
          const uint4 b = reinterpret_cast<const uint4*>(dSt.p + ql * dSt.kPlane)[i];
          const uint32_t bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dlast +=
                bf2f(static_cast<uint16_t>(aw[e] & 0xffffu)) *
                    bf2f(static_cast<uint16_t>(bw[e] & 0xffffu)) +
                bf2f(static_cast<uint16_t>(aw[e] >> 16)) * bf2f(static_cast<uint16_t>(bw[e] >> 16));
        }
      }
    }
    float acc[1][8][4];
    // dq^ = diag(Gamma) dO S0^T + dPM K^
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Ot, warp * 16, S0t, 0);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int t = frag_row(warp * 16, 0, r2);
      const float gt = t < C ? fexp(gam[t]) : 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = frag_col(0, nt);
        acc[0][nt][2 * r2] *= gt;
        acc[0][nt][2 * r2 + 1] *= gt;
        const F2 qv = Qht.get2(t, c);
        dq_dot[r2] += acc[0][nt][2 * r2] * qv.x + acc[0][nt][2 * r2 + 1] * qv.y;
      }
    }
    warp_mma<1, 8, false, true, kC>(acc, PMt, warp * 16, Kht, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = frag_row(warp * 16, 0, r2), c = frag_col(0, nt);
        if (t < C)
          st2(dqp + (rv + static_cast<int64_t>(t) * d.Hv) * kD + hf * 64 + c, acc[0][nt][2 * r2],
              acc[0][nt][2 * r2 + 1]);
      }
    // dW = -dDelta S0^T
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Ddt, warp * 16, S0t, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = frag_row(warp * 16, 0, r2), c = frag_col(0, nt);
        if (t < C)
          gstore2<NPL>(dwp, psv, (rv + static_cast<int64_t>(t) * d.Hv) * kD + hf * 64 + c,
                       -acc[0][nt][2 * r2], -acc[0][nt][2 * r2 + 1]);
      }
    // dk^ = diag(c) Delta dS^T + dPM^T Q^
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Dlt, warp * 16, dSt, 0);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int t = frag_row(warp * 16, 0, r2);
      const float ct = t < C ? fexp(gl - gam[t]) : 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = frag_col(0, nt);
        acc[0][nt][2 * r2] *= ct;
        acc[0][nt][2 * r2 + 1] *= ct;
        const F2 kv = Kht.get2(t, c);
        dk_dot[r2] += acc[0][nt][2 * r2] * kv.x + acc[0][nt][2 * r2 + 1] * kv.y;
      }
    }
    warp_mma<1, 8, true, true, kC>(acc, PMt, warp * 16, Qht, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = frag_row(warp * 16, 0, r2), c = frag_col(0, nt);
        if (t < C)
          st2(dkp + (rv + static_cast<int64_t>(t) * d.Hv) * kD + hf * 64 + c, acc[0][nt][2 * r2],
              acc[0][nt][2 * r2 + 1]);
      }
  }
  // dgamma
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float a = row_reduce4(dq_dot[r2]), b = row_reduce4(dk_dot[r2]);
    if ((lane & 3) == 0) {
      const int t = frag_row(warp * 16, 0, r2);
      rowq[t] = a;
      rowk[t] = b;
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) dlast += shfl_xor(dlast, m);
  if (lane == 0) red[warp] = dlast;
  block_sync();
  if (tid < C) {
    float dgcol = 0.f;
    for (int wp = 0; wp < kWarps; ++wp) dgcol += colp[wp * kC + tid];
    float dgt = rowq[tid] + dgrow[tid] - dgcol - rowk[tid];
    if (tid == C - 1) {
      float tot = 0.f;
      for (int t = 0; t < C; ++t) tot += rowk[t];
      float dl_sum = 0.f;
      for (int i = 0; i < kWarps; ++i) dl_sum += red[i];
      dgt += tot + fexp(gl) * dl_sum;
    }
    dgp[rv + static_cast<int64_t>(tid) * d.Hv] = dgt;
  }
}

// ---- 7. per chunk and value head: backward through W = T diag(beta Gamma) K^, U = T diag(beta) V
// and T = (I + L)^-1; dv, dbeta, dg (reverse cumsum within the chunk) written; dk^ completed.
//   X_u = T^T dU: dv = beta X_u, dbeta += X_u . v
//   X_w = T^T dW: dk^ += beta Gamma X_w, dbeta += Gamma X_w . k^, dgamma += beta Gamma X_w . k^
//   dT = (dU V^T) diag(beta) + (dW K^T) diag(beta Gamma);  dL = -T^T dT T^T (strictly lower)
//   dA = dL o beta_t exp(gamma_t - gamma_i): dk^ += dA K^ + dA^T K^, dbeta_t += sum_i dL_ti exp()
//   A_ti, dgamma_t += sum_i dL_ti L_ti - sum_j dL_jt L_jt
template <int NPL>
struct WyLayout {
  static constexpr size_t kT = 0;
  static constexpr size_t kA = kT + align128(Tile<kC, kC, NPL>::kBytes);  // dU, then dW
  static constexpr size_t kB = kA + align128(Tile<kC, kD, NPL>::kBytes);  // V, then K^
  static constexpr size_t kdT = kB + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kY = kdT + align128(Tile<kC, kC, NPL>::kBytes);
  static constexpr size_t kdA = kdT;  // dT is dead once Y = dT T^T is formed
  static constexpr size_t kE = kY + align128(Tile<kC, kC, NPL>::kBytes);
  static constexpr size_t kF =
      kE + align128(kC * 65 * 4);  // gamma, beta, db rows, dg rows, dg E terms
  static constexpr size_t kBytes = kF + align128(5 * kC * 4);
};

template <class Tin>
__global__ void __launch_bounds__(kThreads)
    wy_bwd_kernel(Dims d, const uint16_t* kh, const uint16_t* tm, const uint16_t* ddl,
                  const uint16_t* dwp, const Tin* v, const float* beta, const float* gcum,
                  const float* dgp, float* dkp, float* dv, float* dbeta, float* dg) {
  constexpr int NPL = planes_of<Tin>();
  using L = WyLayout<NPL>;
  unsigned char* sm = smem_base();
  const Tile<kC, kC, NPL> Tt{reinterpret_cast<uint16_t*>(sm + L::kT)};
  const Tile<kC, kD, NPL> At{reinterpret_cast<uint16_t*>(sm + L::kA)};
  const Tile<kC, kD, NPL> Bt{reinterpret_cast<uint16_t*>(sm + L::kB)};
  const Tile<kC, kC, NPL> dTt{reinterpret_cast<uint16_t*>(sm + L::kdT)};
  const Tile<kC, kC, NPL> Yt{reinterpret_cast<uint16_t*>(sm + L::kY)};
  const Tile<kC, kC, NPL> dAt{reinterpret_cast<uint16_t*>(sm + L::kdA)};
  float* Ef = reinterpret_cast<float*>(sm + L::kE);
  float* gam = reinterpret_cast<float*>(sm + L::kF);
  float* bet = gam + kC;
  float* dbr = bet + kC;
  float* dgr = dbr + kC;
  float* dge = dgr + kC;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int n, h;
  chunk_head(d, n, h);
  const int hk = h / d.G;
  const int c0 = d.chunk_start(n), C = d.chunk_len(n);
  const int64_t psk = d.T * d.Hk * kD, psv = d.T * d.Hv * kD, psc = d.T * d.Hv * kC;
  const int64_t rv = static_cast<int64_t>(c0) * d.Hv + h, rk = static_cast<int64_t>(c0) * d.Hk + hk;

  load_rows(Tt, tm, psc, rv * kC, static_cast<int64_t>(d.Hv) * kC, 0, C);
  load_rows(At, ddl, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
  load_raw_rows(Bt, v + rv * d.V, static_cast<int64_t>(d.Hv) * d.V, d.V, C);
  cp_async_commit();
  if (tid < kC) {
    gam[tid] = tid < C ? gcum[rv + static_cast<int64_t>(tid) * d.Hv] : 0.f;
    bet[tid] = tid < C ? beta[rv + static_cast<int64_t>(tid) * d.Hv] : 0.f;
  }
  cp_async_wait_all();
  block_sync();

  float db_row[2] = {0.f, 0.f}, dg_row[2] = {0.f, 0.f};
  float acc[1][16][4];  // X_u, then X_w -> the dk^ accumulator
  float dT[1][8][4];
  {
    zero(acc);
    warp_mma<1, 16, true, true, kC>(acc, Tt, warp * 16, At, 0);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int i = frag_row(warp * 16, 0, r2);
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int c = frag_col(0, nt);
        const float x0 = acc[0][nt][2 * r2], x1 = acc[0][nt][2 * r2 + 1];
        const F2 bv = Bt.get2(i, c);
        db_row[r2] += x0 * bv.x + x1 * bv.y;
        if (i < C && c < d.V)
          st2(dv + (rv + static_cast<int64_t>(i) * d.Hv) * d.V + c, bet[i] * x0, bet[i] * x1);
      }
    }
    zero(dT);
    warp_mma<1, 8, false, false, kD>(dT, At, warp * 16, Bt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dT[0][nt][e] *= bet[frag_col(0, nt) + (e & 1)];
  }
  block_sync();
  load_rows(At, dwp, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
  load_rows(Bt, kh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, 0, C);
  cp_async_commit();
  cp_async_wait_all();
  block_sync();
  {
    zero(acc);
    warp_mma<1, 16, true, true, kC>(acc, Tt, warp * 16, At, 0);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int i = frag_row(warp * 16, 0, r2);
      float dot = 0.f;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int c = frag_col(0, nt);
        const F2 bv = Bt.get2(i, c);
        dot += acc[0][nt][2 * r2] * bv.x + acc[0][nt][2 * r2 + 1] * bv.y;
      }
      const float gi = i < C ? fexp(gam[i]) : 0.f, f = bet[i] * gi;
      db_row[r2] += gi * dot;
      dg_row[r2] += f * dot;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        acc[0][nt][2 * r2] *= f;
        acc[0][nt][2 * r2 + 1] *= f;
      }
    }
    float t2[1][8][4];
    zero(t2);
    warp_mma<1, 8, false, false, kD>(t2, At, warp * 16, Bt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = frag_col(0, nt) + (e & 1);
        const float f = i < C ? bet[i] * fexp(gam[i]) : 0.f;
        dT[0][nt][e] += t2[0][nt][e] * f;
      }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2)
        dTt.put2(frag_row(warp * 16, 0, r2), frag_col(0, nt), dT[0][nt][2 * r2],
                 dT[0][nt][2 * r2 + 1]);
  }
  block_sync();
  {  // Y = dT T^T
    float y[1][8][4];
    zero(y);
    warp_mma<1, 8, false, false, kC>(y, dTt, warp * 16, Tt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2)
        Yt.put2(frag_row(warp * 16, 0, r2), frag_col(0, nt), y[0][nt][2 * r2],
                y[0][nt][2 * r2 + 1]);
  }
  block_sync();
  {  // Ef = (i < t < C) exp(gamma_t - gamma_i) k_t . k_i (each thread reads back only its own
     // entries)
    float a[1][8][4];
    zero(a);
    warp_mma<1, 8, false, false, kD>(a, Bt, warp * 16, Bt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = frag_row(warp * 16, 0, e >> 1), i = frag_col(0, nt) + (e & 1);
        Ef[t * 65 + i] = (t < C && i < t) ? fexp(gam[t] - gam[i]) * a[0][nt][e] : 0.f;
      }
  }
  {  // dL = -T^T Y;  dA = dL beta_t exp();  Ef <- dL o L
    float z[1][8][4];
    zero(z);
    warp_mma<1, 8, true, true, kC>(z, Tt, warp * 16, Yt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = frag_row(warp * 16, 0, r2), i = frag_col(0, nt);
        float da[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ii = i + e;
          const bool ok = t < C && ii < t;
          const float dlv = -z[0][nt][2 * r2 + e], ea = Ef[t * 65 + ii];
          da[e] = ok ? dlv * bet[t] * fexp(gam[t] - gam[ii]) : 0.f;
          db_row[r2] += dlv * ea;
          Ef[t * 65 + ii] = dlv * bet[t] * ea;
        }
        dAt.put2(t, i, da[0], da[1]);
      }
  }
  block_sync();
  warp_mma<1, 16, false, true, kC>(acc, dAt, warp * 16, Bt, 0);
  warp_mma<1, 16, true, true, kC>(acc, dAt, warp * 16, Bt, 0);
#pragma unroll
  for (int r2 = 0; r2 < 2;
       ++r2) {  // dk^ += acc: all loads first (they would serialise behind the stores)
    const int t = frag_row(warp * 16, 0, r2);
    if (t >= C) continue;
    F2* row = reinterpret_cast<F2*>(dkp + (rv + static_cast<int64_t>(t) * d.Hv) * kD);
    F2 x[16];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) x[nt] = row[frag_col(0, nt) / 2];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
      row[frag_col(0, nt) / 2] = F2{x[nt].x + acc[0][nt][2 * r2], x[nt].y + acc[0][nt][2 * r2 + 1]};
  }
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float a = row_reduce4(db_row[r2]), b = row_reduce4(dg_row[r2]);
    if ((lane & 3) == 0) {
      const int t = frag_row(warp * 16, 0, r2);
      dbr[t] = a;
      dgr[t] = b;
    }
  }
  if (tid < kC) {
    float s = 0.f;
    for (int i = 0; i < kC; ++i) s += Ef[tid * 65 + i];
    for (int j = 0; j < kC; ++j) s -= Ef[j * 65 + tid];
    dge[tid] = s;
  }
  block_sync();
  if (warp == 0) {  // dg_i = sum_{t >= i} dgamma_t within the chunk (2 tokens a lane)
    float v2[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = lane * 2 + e;
      v2[e] = t < C ? dgr[t] + dge[t] + dgp[rv + static_cast<int64_t>(t) * d.Hv] : 0.f;
    }
    const float s1 = v2[1], s0 = v2[0] + v2[1];
    float x = s0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = shfl_down(x, o);
      if (lane + o < 32) x += y;
    }
    const float after = x - s0;  // lanes above this one
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = lane * 2 + e;
      if (t < C) {
        dg[rv + static_cast<int64_t>(t) * d.Hv] = (e == 0 ? s0 : s1) + after;
        dbeta[rv + static_cast<int64_t>(t) * d.Hv] = dbr[t];
      }
    }
  }
}

// ---- 8. dq, dk: sum the value heads of each key head, then back through the scale and L2 norm
// ----
template <class Tin>
__global__ void __launch_bounds__(kThreads)
    finalize_qk_kernel(Dims d, float* dq, float* dk, const Tin* q, const Tin* k, const float* dqp,
                       const float* dkp) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = d.T * d.Hk;
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; w < 2 * rows;
       w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const bool is_q = w < rows;
    const int64_t r = is_q ? w : w - rows, t = r / d.Hk;
    const int hk = static_cast<int>(r % d.Hk), c = lane * 4;
    const float* part = is_q ? dqp : dkp;
    float y[4] = {0.f, 0.f, 0.f, 0.f}, x[4] = {0.f, 0.f, 0.f, 0.f};
    for (int gi = 0; gi < d.G; ++gi) {
      float p[4];
      ld4(part + (t * d.Hv + static_cast<int64_t>(hk) * d.G + gi) * kD + c, p);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] += p[e];
    }
    if (c < d.K) ld4((is_q ? q : k) + r * d.K + c, x);
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ss += x[e] * x[e];
      dot += x[e] * y[e];
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
      ss += shfl_xor(ss, m);
      dot += shfl_xor(dot, m);
    }
    const float s = is_q ? d.scale : 1.f;
    float out[4];
    if (d.l2norm) {
      const float rn = rsqrtf(ss + d.eps), r3 = rn * rn * rn;
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = s * (rn * y[e] - r3 * x[e] * dot);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = s * y[e];
    }
    if (c < d.K)
      *reinterpret_cast<F4*>((is_q ? dq : dk) + r * d.K + c) = F4{out[0], out[1], out[2], out[3]};
  }
}

// ---- host side ----------------------------------------------------------------------------------

// The backward's two state passes are independent: the rebuild (chunk-start states, Delta) and
// the reverse pass (dh, dDelta) read only chunk_prep's outputs and d_o. With few sequences each
// launches about one block an SM and leaves most of it idle, so the rebuild runs on a second
// stream beside the reverse pass; both are built for two blocks an SM (128 registers with 8
// warps; 84.5 + 136.5 KiB of shared memory for bf16 at VT 32) so that they share SMs. The side
// stream (one per thread and device, created on first use, non-blocking) forks from the current
// stream after chunk_prep and joins it before dqkw, so callers see one stream-ordered call and
// the workspace is released in the current stream's order. GdnVariant::overlap = false runs
// both on the current stream (bench_gdn --no-overlap).
bool overlap_state_passes() { return g_variant.overlap; }

template <int NPL, int NW>
void run_state_bwd(const Dims& d, int vt, const uint16_t* kh, const uint16_t* qh, const uint16_t* w,
                   const uint16_t* pm, const uint16_t* dop, int64_t psdo, const float* gcum,
                   uint16_t* dhs, uint16_t* ddl) {
  const unsigned gy = static_cast<unsigned>(d.NS);
  if constexpr (NW == 4) {
    if (vt == 16) {
      launch(state_bwd_kernel<NPL, 16, 4>, dim3(static_cast<unsigned>(d.Hv * (kD / 16)), gy), 4 * 32,
             StateBwdLayout<NPL, 16>::kBytes, d, kh, qh, w, pm, dop, psdo, gcum, dhs, ddl);
      return;
    }
  }
  if (vt == 64)
    launch(state_bwd_kernel<NPL, 64, NW>, dim3(static_cast<unsigned>(d.Hv * (kD / 64)), gy),
           NW * 32, StateBwdLayout<NPL, 64>::kBytes, d, kh, qh, w, pm, dop, psdo, gcum, dhs, ddl);
  else
    launch(state_bwd_kernel<NPL, 32, NW>, dim3(static_cast<unsigned>(d.Hv * (kD / 32)), gy),
           NW * 32, StateBwdLayout<NPL, 32>::kBytes, d, kh, qh, w, pm, dop, psdo, gcum, dhs, ddl);
}

struct BwdBuffers {
  FwdBuffers f;
  uint16_t *hs, *dl, *dop, *dhs, *ddl, *dwp;
  float *dqp, *dkp, *dgp;
  bool own_do;
};

// prep: a carve over the buffer a forward kept (carve_prep with T), or null to carve the prep
// from c.
template <int NPL>
BwdBuffers carve_bwd(Carve& c, const GdnDims& g, bool own_do, Carve* prep) {
  BwdBuffers b{};
  b.f = carve_prep<NPL>(prep != nullptr ? *prep : c, g, true);
  const int64_t state = NPL * static_cast<int64_t>(g.num_chunks) * g.Hv * kD * kD;
  b.hs = c.take<uint16_t>(state);
  b.dl = c.take<uint16_t>(NPL * g.T * g.Hv * kD);
  b.own_do = own_do;
  b.dop = own_do ? c.take<uint16_t>(NPL * g.T * g.Hv * kD) : nullptr;
  b.dhs = c.take<uint16_t>(state);
  b.ddl = c.take<uint16_t>(NPL * g.T * g.Hv * kD);
  b.dwp = b.f.u;  // U is dead once the states are rebuilt; dW takes its place (a kept prep is
                  // consumed by the backward that takes it)
  b.dqp = c.take<float>(g.T * g.Hv * kD);
  b.dkp = c.take<float>(g.T * g.Hv * kD);
  b.dgp = c.take<float>(g.T * g.Hv);
  return b;
}

}  // namespace

namespace gdn {  // declared in gdn_cuda_common.cuh

// d_o can serve as its own operand plane when it is bf16 in the bf16 path and V = D.
bool do_needs_planes(const GdnDims& g, DType dt, DType do_dt) {
  return !(dt == DType::bf16 && do_dt == DType::bf16 && g.V == kD);
}

template <class Tin>
size_t backward_ws(const GdnDims& g, bool own_do, bool have_prep) {
  Carve c{nullptr}, kept{nullptr};
  carve_bwd<planes_of<Tin>()>(c, g, own_do, have_prep ? &kept : nullptr);
  return c.used;
}

template <class Tin>
void backward_impl(float* dq, float* dk, float* dv, float* dg, float* dbeta, const void* d_o,
                   DType do_dt, const Tin* q, const Tin* k, const Tin* v, const float* g,
                   const float* beta, const int32_t* table, const GdnDims& gd, DType dt, void* ws,
                   void* prep, const GdnCarry* carry) {
  constexpr int NPL = planes_of<Tin>();
  Dims d = make_dims(gd, table);
  apply_carry(d, carry);
  const bool own_do = do_needs_planes(gd, dt, do_dt);
  Carve c{static_cast<unsigned char*>(ws)}, kept{static_cast<unsigned char*>(prep)};
  const BwdBuffers b = carve_bwd<NPL>(c, gd, own_do, prep != nullptr ? &kept : nullptr);
  const int vt = pick_vt(gd);
  if (prep == nullptr) run_prep<Tin, true>(d, b.f, q, k, v, g, beta);
  const int nw = pick_state_warps(false, vt);
  const cudaStream_t main_st = stream();
  SideStream* side = overlap_state_passes() ? &side_stream() : nullptr;
  if (side != nullptr) {
    BB_CHECK_CUDA(cudaEventRecord(side->fork, main_st));
    BB_CHECK_CUDA(cudaStreamWaitEvent(side->s, side->fork, 0));
  }
  run_state_fwd<Tin, false>(d, vt, nw, b.f, static_cast<Tin*>(nullptr), b.hs, b.dl,
                            side != nullptr ? side->s : main_st);
  const uint16_t* dop = static_cast<const uint16_t*>(d_o);
  const int64_t psdo = gd.T * gd.Hv * kD;
  if (own_do) {
    const unsigned blocks = blocks_for(gd.T * gd.Hv * (kD / 4), kThreads);
    if (do_dt == DType::f32)
      launch(convert_do_kernel<float, NPL>, dim3(blocks), kThreads, 0, d, b.dop,
             static_cast<const float*>(d_o));
    else
      launch(convert_do_kernel<uint16_t, NPL>, dim3(blocks), kThreads, 0, d, b.dop,
             static_cast<const uint16_t*>(d_o));
    dop = b.dop;
  }
  const uint16_t *kh = b.f.kh, *qh = b.f.qh, *w = b.f.w, *pm = b.f.pm;
  if (nw == 4)
    run_state_bwd<NPL, 4>(d, vt, kh, qh, w, pm, dop, psdo, static_cast<const float*>(b.f.gcum),
                          b.dhs, b.ddl);
  else
    run_state_bwd<NPL, 8>(d, vt, kh, qh, w, pm, dop, psdo, static_cast<const float*>(b.f.gcum),
                          b.dhs, b.ddl);
  if (side != nullptr) {  // dqkw reads the rebuilt states and Delta
    BB_CHECK_CUDA(cudaEventRecord(side->join, side->s));
    BB_CHECK_CUDA(cudaStreamWaitEvent(main_st, side->join, 0));
  }
  const dim3 chunks = chunk_grid(d);
  launch(dqkw_kernel<NPL>, chunks, kThreads, DqkwLayout<NPL>::kBytes, d, kh, qh, pm, dop, psdo,
         static_cast<const uint16_t*>(b.dl), static_cast<const uint16_t*>(b.ddl),
         static_cast<const uint16_t*>(b.hs), static_cast<const uint16_t*>(b.dhs),
         static_cast<const float*>(b.f.gcum), b.dqp, b.dkp, b.dwp, b.dgp);
  launch(wy_bwd_kernel<Tin>, chunks, kThreads, WyLayout<NPL>::kBytes, d, kh,
         static_cast<const uint16_t*>(b.f.tm), static_cast<const uint16_t*>(b.ddl),
         static_cast<const uint16_t*>(b.dwp), v, beta, static_cast<const float*>(b.f.gcum),
         static_cast<const float*>(b.dgp), b.dkp, dv, dbeta, dg);
  launch(finalize_qk_kernel<Tin>, dim3(blocks_for(2 * d.T * d.Hk, kWarps)), kThreads, 0, d, dq, dk,
         q, k, static_cast<const float*>(b.dqp), static_cast<const float*>(b.dkp));
}

// The start-state gradient of carry.seq_in from d_o (and carry.ds_in at carry.seq_out's end)
// alone: the prep and the reverse state pass, which reads neither the rebuilt states nor Delta;
// no input gradient is written.
template <class Tin>
void start_grad_impl(const void* d_o, DType do_dt, const Tin* q, const Tin* k, const Tin* v, const float* g,
                     const float* beta, const int32_t* table, const GdnDims& gd, DType dt, void* ws,
                     const GdnCarry& carry) {
  constexpr int NPL = planes_of<Tin>();
  Dims d = make_dims(gd, table);
  apply_carry(d, &carry);
  const bool own_do = do_needs_planes(gd, dt, do_dt);
  Carve c{static_cast<unsigned char*>(ws)};
  const BwdBuffers b = carve_bwd<NPL>(c, gd, own_do, nullptr);
  const int vt = pick_vt(gd);
  run_prep<Tin, true>(d, b.f, q, k, v, g, beta);
  const int nw = pick_state_warps(false, vt);
  const uint16_t* dop = static_cast<const uint16_t*>(d_o);
  const int64_t psdo = gd.T * gd.Hv * kD;
  if (own_do) {
    const unsigned blocks = blocks_for(gd.T * gd.Hv * (kD / 4), kThreads);
    if (do_dt == DType::f32)
      launch(convert_do_kernel<float, NPL>, dim3(blocks), kThreads, 0, d, b.dop, static_cast<const float*>(d_o));
    else
      launch(convert_do_kernel<uint16_t, NPL>, dim3(blocks), kThreads, 0, d, b.dop,
             static_cast<const uint16_t*>(d_o));
    dop = b.dop;
  }
  if (nw == 4)
    run_state_bwd<NPL, 4>(d, vt, b.f.kh, b.f.qh, b.f.w, b.f.pm, dop, psdo, static_cast<const float*>(b.f.gcum),
                          b.dhs, b.ddl);
  else
    run_state_bwd<NPL, 8>(d, vt, b.f.kh, b.f.qh, b.f.w, b.f.pm, dop, psdo, static_cast<const float*>(b.f.gcum),
                          b.dhs, b.ddl);
}

// What gated_delta_rule_cuda.cu calls (gdn_cuda_common.cuh).
template void start_grad_impl<float>(const void*, DType, const float*, const float*, const float*, const float*,
                                     const float*, const int32_t*, const GdnDims&, DType, void*, const GdnCarry&);
template void start_grad_impl<uint16_t>(const void*, DType, const uint16_t*, const uint16_t*, const uint16_t*,
                                        const float*, const float*, const int32_t*, const GdnDims&, DType, void*,
                                        const GdnCarry&);
template size_t backward_ws<float>(const GdnDims&, bool, bool);
template size_t backward_ws<uint16_t>(const GdnDims&, bool, bool);
template void backward_impl<float>(float*, float*, float*, float*, float*, const void*, DType,
                                   const float*, const float*, const float*, const float*,
                                   const float*, const int32_t*, const GdnDims&, DType, void*,
                                   void*, const GdnCarry*);
template void backward_impl<uint16_t>(float*, float*, float*, float*, float*, const void*, DType,
                                      const uint16_t*, const uint16_t*, const uint16_t*,
                                      const float*, const float*, const int32_t*, const GdnDims&,
                                      DType, void*, void*, const GdnCarry*);

}  // namespace gdn
}  // namespace bb::cuda

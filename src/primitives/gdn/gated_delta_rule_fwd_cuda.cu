// gated_delta_rule_fwd_cuda.cu — the forward direction of the CUDA gated delta rule: the kernels
// qk_norm, chunk_prep and the state pass (the forward's output, or the backward's rebuild of the
// chunk-start states and Delta), their launchers, the forward's overlap of chunk_prep with the
// state pass, and the forward and end-state drivers. The backward (gated_delta_rule_bwd_cuda.cu)
// runs the prep and the rebuild through run_prep / run_state_fwd. Design notes: the top of
// gated_delta_rule_cuda.cu; shared pieces: gdn_cuda_common.cuh.
#include "primitives/gdn/gdn_cuda_common.cuh"

namespace bb::cuda {

using namespace gdn;  // gdn_cuda_common.cuh (the kernels stay in the anonymous namespace here,
                      // so their names in profiles are as they were)

namespace {

// ---- 1. q, k -> normalised (q also scaled) operand planes [T, Hk, D] ---------------------------
template <class Tin>
__global__ void __launch_bounds__(kThreads)
    qk_norm_kernel(Dims d, uint16_t* qh, uint16_t* kh, const Tin* q, const Tin* k) {
  constexpr int NPL = planes_of<Tin>();
  const int lane = threadIdx.x & 31;
  const int64_t rows = d.T * d.Hk, ps = rows * kD;
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; w < 2 * rows;
       w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const bool is_q = w < rows;
    const int64_t r = is_q ? w : w - rows;
    const int c = lane * 4;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < d.K) ld4((is_q ? q : k) + r * d.K + c, x);
    float ss = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) ss += shfl_xor(ss, m);
    const float f = (d.l2norm ? rsqrtf(ss + d.eps) : 1.f) * (is_q ? d.scale : 1.f);
    uint16_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float y = x[e] * f;
      hi[e] = f2bf(y);
      lo[e] = f2bf(y - bf2f(hi[e]));
    }
    uint16_t* out = (is_q ? qh : kh) + r * kD + c;
    *reinterpret_cast<U2*>(out) = U2{pack2(hi[0], hi[1]), pack2(hi[2], hi[3])};
    if constexpr (NPL == 2)
      *reinterpret_cast<U2*>(out + ps) = U2{pack2(lo[0], lo[1]), pack2(lo[2], lo[3])};
  }
}

// ---- 2. per chunk and value head: gamma, T = (I + L)^-1, W, U, P -------------------------------
// Row strides (floats) of chunk_prep's f32 T and its block scratch: 16-byte rows, so the
// off-diagonal solve reads and writes 4 columns at a time.
constexpr int kTs = 68, kXs = 20;

template <int NPL, bool kReload>
struct PrepLayout {
  // Shared memory decides how many blocks share an SM, so buffers whose lives do not overlap
  // share space: V is loaded over Q^ once P is done, and the bf16 T diag(.) operands are
  // written over L once T is solved. kReload: T is solved over K^ too (K^ is dead from P to the
  // W product, and is loaded again for it), 54 KB for bf16: 4 blocks an SM instead of 3.
  static constexpr size_t kKBytes = align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kTBytes = align128(kC * kTs * 4);
  static constexpr size_t kK = 0;  // K^ (kReload: then T f32, then K^ again)
  static constexpr size_t kQ = kReload ? (kKBytes > kTBytes ? kKBytes : kTBytes) : kKBytes;
  static constexpr size_t kV = kQ;                                        // Q^, then V
  static constexpr size_t kL = kQ + align128(Tile<kC, kD, NPL>::kBytes);  // L f32 [64][65]
  static constexpr size_t kTf = kReload ? kK : kL + align128(kC * 65 * 4);  // T f32 [64][kTs]
  static constexpr size_t kX = kReload ? kL + align128(kC * 65 * 4)
                                       : kTf + kTBytes;  // block scratch [3][16][kXs]
  static constexpr size_t kG = kX + align128(3 * 16 * kXs * 4);  // gamma, beta, scan
  static constexpr size_t kEnd = kG + align128(3 * kC * 4);
  static constexpr bool kTInL = 2 * align128(Tile<kC, kC, NPL>::kBytes) <= kC * 65 * 4;
  static constexpr size_t kTw = kTInL ? kL : kEnd;                          // T diag(beta Gamma)
  static constexpr size_t kTu = kTw + align128(Tile<kC, kC, NPL>::kBytes);  // T diag(beta)
  static constexpr size_t kBytes = kTInL ? kEnd : kTu + align128(Tile<kC, kC, NPL>::kBytes);
};

template <class Tin, bool kStoreT, bool kReload>
__global__ void __launch_bounds__(kThreads)
    chunk_prep_kernel(Dims d, const uint16_t* qh, const uint16_t* kh, const Tin* v, const float* g,
                      const float* beta, float* gcum, uint16_t* w, uint16_t* u, uint16_t* pm,
                      uint16_t* tm, int* ready) {
  constexpr int NPL = planes_of<Tin>();
  using L = PrepLayout<NPL, kReload>;
  unsigned char* sm = smem_base();
  const Tile<kC, kD, NPL> Kt{reinterpret_cast<uint16_t*>(sm + L::kK)};
  const Tile<kC, kD, NPL> Qt{reinterpret_cast<uint16_t*>(sm + L::kQ)};
  const Tile<kC, kD, NPL> Vt{reinterpret_cast<uint16_t*>(sm + L::kV)};
  const Tile<kC, kC, NPL> Twt{reinterpret_cast<uint16_t*>(sm + L::kTw)};
  const Tile<kC, kC, NPL> Tut{reinterpret_cast<uint16_t*>(sm + L::kTu)};
  float* Lf = reinterpret_cast<float*>(sm + L::kL);
  float* Tf = reinterpret_cast<float*>(sm + L::kTf);
  float* Xs = reinterpret_cast<float*>(sm + L::kX);
  float* gam = reinterpret_cast<float*>(sm + L::kG);
  float* bet = gam + kC;
  float* scan = bet + kC;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int n, h;
  chunk_head(d, n, h);
  const int hk = h / d.G;
  const int c0 = d.chunk_start(n), C = d.chunk_len(n);
  const int64_t psk = d.T * d.Hk * kD, psv = d.T * d.Hv * kD, psc = d.T * d.Hv * kC;

  load_rows(Kt, kh, psk, (static_cast<int64_t>(c0) * d.Hk + hk) * kD,
            static_cast<int64_t>(d.Hk) * kD, 0, C);
  load_rows(Qt, qh, psk, (static_cast<int64_t>(c0) * d.Hk + hk) * kD,
            static_cast<int64_t>(d.Hk) * kD, 0, C);
  cp_async_commit();

  if (tid < kC) {  // warps 0 and 1: inclusive scan of g within each warp
    float x = tid < C ? g[(static_cast<int64_t>(c0) + tid) * d.Hv + h] : 0.f;
    bet[tid] = tid < C ? beta[(static_cast<int64_t>(c0) + tid) * d.Hv + h] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = shfl_up(x, o);
      if (lane >= o) x += y;
    }
    scan[tid] = x;
  }
  block_sync();
  if (tid < kC) gam[tid] = tid >= 32 ? scan[tid] + scan[31] : scan[tid];
  cp_async_wait_all();
  block_sync();

  {  // L = strictly lower (beta_t exp(gamma_t - gamma_i) k_t . k_i)
    float acc[1][8][4];
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Kt, warp * 16, Kt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = frag_row(warp * 16, 0, e >> 1), i = frag_col(0, nt) + (e & 1);
        Lf[t * 65 + i] = (i < t && t < C) ? bet[t] * fexp(gam[t] - gam[i]) * acc[0][nt][e] : 0.f;
      }
  }
  {  // P = (i <= t) exp(gamma_t - gamma_i) q_t . k_i  -> global
    float acc[1][8][4];
    zero(acc);
    warp_mma<1, 8, false, false, kD>(acc, Qt, warp * 16, Kt, 0);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = frag_row(warp * 16, 0, hf), i = frag_col(0, nt);
        if (t >= C) continue;
        const float p0 = i <= t ? fexp(gam[t] - gam[i]) * acc[0][nt][2 * hf] : 0.f;
        const float p1 = i + 1 <= t ? fexp(gam[t] - gam[i + 1]) * acc[0][nt][2 * hf + 1] : 0.f;
        gstore2<NPL>(pm, psc, ((static_cast<int64_t>(c0) + t) * d.Hv + h) * kC + i, p0, p1);
      }
  }
  block_sync();
  // Q^ is dead: V goes into its space while T is solved (waited for before the U product).
  load_raw_rows(Vt, v + (static_cast<int64_t>(c0) * d.Hv + h) * d.V,
                static_cast<int64_t>(d.Hv) * d.V, d.V, C);
  cp_async_commit();

  {  // diagonal 16 x 16 blocks of T: warp w inverts block w, lane l (< 16) owns column l
    const int base = warp * 16, jl = lane & 15;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      float a = t == jl ? 1.f : 0.f;
#pragma unroll
      for (int i = 0; i < t; ++i) a -= Lf[(base + t) * 65 + base + i] * x[i];
      x[t] = a;
    }
    if (lane < 16) {
#pragma unroll
      for (int t = 0; t < 16; ++t) Tf[(base + t) * kTs + base + jl] = x[t];
    }
    for (int i = lane; i < 16 * kC; i += 32) {  // blocks right of the diagonal are zero
      const int r = i / kC, c = i % kC;
      if (c >= base + 16) Tf[(base + r) * kTs + c] = 0.f;
    }
  }
  block_sync();
  // Off-diagonal blocks, one block diagonal at a time: T_ij = -T_ii sum_{k=j}^{i-1} L_ik T_kj.
  // A thread computes 4 adjacent columns (c4): one L (or T_ii) value feeds 4 FMAs with a 16-byte
  // read of the other operand; each element's sum runs in the same order as a scalar loop.
  for (int dd = 1; dd < 4; ++dd) {
    const int nb = 4 - dd;
    for (int e = tid; e < nb * 64; e += kThreads) {
      const int b = e >> 6, a = (e >> 2) & 15, c = (e & 3) * 4, bi = dd + b, bj = b;
      F4 s{0.f, 0.f, 0.f, 0.f};
      for (int kb = bj; kb < bi; ++kb)
#pragma unroll
        for (int m = 0; m < 16; ++m) {
          const float l = Lf[(bi * 16 + a) * 65 + kb * 16 + m];
          const F4 t4 = *reinterpret_cast<const F4*>(Tf + (kb * 16 + m) * kTs + bj * 16 + c);
          s.a += l * t4.a, s.b += l * t4.b, s.c += l * t4.c, s.d += l * t4.d;
        }
      *reinterpret_cast<F4*>(Xs + (b * 16 + a) * kXs + c) = s;
    }
    block_sync();
    for (int e = tid; e < nb * 64; e += kThreads) {
      const int b = e >> 6, a = (e >> 2) & 15, c = (e & 3) * 4, bi = dd + b, bj = b;
      F4 s{0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const float tv = Tf[(bi * 16 + a) * kTs + bi * 16 + m];
        const F4 x4 = *reinterpret_cast<const F4*>(Xs + (b * 16 + m) * kXs + c);
        s.a += tv * x4.a, s.b += tv * x4.b, s.c += tv * x4.c, s.d += tv * x4.d;
      }
      *reinterpret_cast<F4*>(Tf + (bi * 16 + a) * kTs + bj * 16 + c) = F4{-s.a, -s.b, -s.c, -s.d};
    }
    block_sync();
  }
  if (tid < kC) scan[tid] = tid < C ? bet[tid] * fexp(gam[tid]) : 0.f;  // beta Gamma (scan is free)
  block_sync();
  for (int i = tid; i < kC * kC / 2;
       i += kThreads) {  // T diag(beta Gamma), T diag(beta) as operands
    const int r = i / (kC / 2), c = (i % (kC / 2)) * 2;
    const F2 tv = *reinterpret_cast<const F2*>(Tf + r * kTs + c);
    const float a0 = tv.x, a1 = tv.y;
    Twt.put2(r, c, a0 * scan[c], a1 * scan[c + 1]);
    Tut.put2(r, c, a0 * bet[c], a1 * bet[c + 1]);
    if (kStoreT && r < C)
      gstore2<NPL>(tm, psc, ((static_cast<int64_t>(c0) + r) * d.Hv + h) * kC + c, a0, a1);
  }
  if (tid < C) gcum[(static_cast<int64_t>(c0) + tid) * d.Hv + h] = gam[tid];
  cp_async_wait_all();
  block_sync();
  if constexpr (kReload) {  // T is in the operands now: K^ again over it, behind the U product
    load_rows(Kt, kh, psk, (static_cast<int64_t>(c0) * d.Hk + hk) * kD,
              static_cast<int64_t>(d.Hk) * kD, 0, C);
    cp_async_commit();
  }

  // W = (T diag(beta Gamma)) K^, U = (T diag(beta)) V; U first when K^ is on its way again.
#pragma unroll 1
  for (int it = 0; it < 2; ++it) {
    const int which = kReload ? 1 - it : it;
    if (kReload && which == 0) {
      cp_async_wait_all();
      block_sync();
    }
    float acc[1][16][4];
    zero(acc);
    if (which == 0)
      warp_mma<1, 16, false, true, kC>(acc, Twt, warp * 16, Kt, 0);
    else
      warp_mma<1, 16, false, true, kC>(acc, Tut, warp * 16, Vt, 0);
    uint16_t* out = which == 0 ? w : u;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = frag_row(warp * 16, 0, hf), c = frag_col(0, nt);
        if (t < C)
          gstore2<NPL>(out, psv, ((static_cast<int64_t>(c0) + t) * d.Hv + h) * kD + c,
                       acc[0][nt][2 * hf], acc[0][nt][2 * hf + 1]);
      }
  }
  if (ready != nullptr) {  // the state pass running beside this launch may read the chunk now
    __threadfence();
    block_sync();
    if (tid == 0) st_release(ready + static_cast<int64_t>(n) * d.Hv + h, 1);
  }
}

// Warp 0 of a state-pass block waits until chunk_prep has marked chunks [n, n + cnt) of value
// head h ready (cnt <= 32; one acquire load a lane). A block_sync follows before anyone loads.
__device__ __forceinline__ void wait_ready(const int* ready, int Hv, int h, int n, int cnt) {
  const int lane = threadIdx.x & 31;
  const int* p = ready + static_cast<int64_t>(n + (lane < cnt ? lane : cnt - 1)) * Hv + h;
  while (!__all_sync(0xffffffffu, ld_acquire(p) != 0)) __nanosleep(200);
}
constexpr int kReadyAhead = 8;  // chunks checked per wait

// ---- 3. sequential state pass over the chunks of one sequence, one value head, VT columns -------
// kFwd: O = diag(Gamma) Q S0 + P Delta written (nothing else). !kFwd (backward's recompute):
// the chunk-start states h [chunk][Hv][D][D] and Delta [T][Hv][D] written.
template <int NPL, int VT, bool kFwd>
struct StateFwdLayout {
  static constexpr int kStages = NPL == 1 ? 2 : 1;
  static constexpr size_t kW = 0;
  static constexpr size_t kK = kW + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kU = kK + align128(Tile<kC, kD, NPL>::kBytes);
  static constexpr size_t kQ = kU + align128(Tile<kC, VT, NPL>::kBytes);
  static constexpr size_t kP = kQ + (kFwd ? align128(Tile<kC, kD, NPL>::kBytes) : 0);
  static constexpr size_t kG = kP + (kFwd ? align128(Tile<kC, kC, NPL>::kBytes) : 0);
  static constexpr size_t kStage = kG + align128(kC * 4);
  static constexpr size_t kS = kStages * kStage;
  static constexpr size_t kDl = kS + align128(Tile<kD, VT, NPL>::kBytes);
  static constexpr size_t kCd = kDl + (kFwd ? align128(Tile<kC, VT, NPL>::kBytes) : 0);
  static constexpr size_t kBytes = kCd + align128(Tile<kC, VT, NPL>::kBytes);
};

// NW warps (8 or 4). Warp w: rows [w D / NW, +D / NW) of the state (all VT columns); for the
// chunk-row products (Delta, O) rows [16 (w % 4), +16) x columns [(w / 4) VT / (NW / 4), +VT /
// (NW / 4)). Fewer warps read the shared S and Delta tiles fewer times (the pass is bound by
// shared-memory bandwidth) but hide less latency.
template <class Tin, int VT, bool kFwd, int NW>
__global__ void __launch_bounds__(NW * 32, kFwd ? 1 : 2)
    state_fwd_kernel(Dims d, const uint16_t* kh, const uint16_t* qh, const uint16_t* w,
                     const uint16_t* u, const uint16_t* pm, const float* gcum, Tin* o, uint16_t* hs,
                     uint16_t* dl, const int* ready, int ready_from) {
  static_assert(NW == 4 || NW == 8, "state pass warps");
  constexpr int NPL = planes_of<Tin>(), NT = VT / 8, NT2 = VT / 8 / (NW / 4), NTH = NW * 32;
  constexpr int MS = kD / NW / 16;  // 16-row tiles of the state per warp
  using L = StateFwdLayout<NPL, VT, kFwd>;
  unsigned char* sm = smem_base();
  const Tile<kD, VT, NPL> St{reinterpret_cast<uint16_t*>(sm + L::kS)};
  const Tile<kC, VT, NPL> Dt{reinterpret_cast<uint16_t*>(sm + L::kDl)};
  const Tile<kC, VT, NPL> Ct{reinterpret_cast<uint16_t*>(sm + L::kCd)};
  const int tid = threadIdx.x, warp = tid >> 5;
  const int rm = (warp & 3) * 16, cn = (warp >> 2) * (VT / (NW / 4));  // chunk-row tile
  const int rs = warp * (kD / NW);                                     // state rows
  constexpr int nvt = kD / VT;
  const int h = blockIdx.x / nvt, v0 = (blockIdx.x % nvt) * VT, hk = h / d.G;
  const int first = d.seq_first(blockIdx.y), count = d.seq_count(blockIdx.y);
  const int64_t psk = d.T * d.Hk * kD, psv = d.T * d.Hv * kD, psc = d.T * d.Hv * kC;
  const int64_t psh = static_cast<int64_t>(d.NC) * d.Hv * kD * kD;

  auto W_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kW)};
  };
  auto K_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kK)};
  };
  auto U_s = [&](int s) {
    return Tile<kC, VT, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kU)};
  };
  auto Q_s = [&](int s) {
    return Tile<kC, kD, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kQ)};
  };
  auto P_s = [&](int s) {
    return Tile<kC, kC, NPL>{reinterpret_cast<uint16_t*>(sm + s * L::kStage + L::kP)};
  };
  auto G_s = [&](int s) { return reinterpret_cast<float*>(sm + s * L::kStage + L::kG); };

  auto issue = [&](int idx, int s) {
    const int n = first + idx, c0 = d.chunk_start(n), C = d.chunk_len(n);
    const int64_t rv = static_cast<int64_t>(c0) * d.Hv + h,
                  rk = static_cast<int64_t>(c0) * d.Hk + hk;
    load_rows<NTH>(W_s(s), w, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, 0, C);
    load_rows<NTH>(K_s(s), kh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, 0, C);
    load_rows<NTH>(U_s(s), u, psv, rv * kD, static_cast<int64_t>(d.Hv) * kD, v0, C);
    if constexpr (kFwd) {
      load_rows<NTH>(Q_s(s), qh, psk, rk * kD, static_cast<int64_t>(d.Hk) * kD, 0, C);
      load_rows<NTH>(P_s(s), pm, psc, rv * kC, static_cast<int64_t>(d.Hv) * kC, 0, C);
    }
    if (tid < kC)
      cp_async4(G_s(s) + tid, tid < C ? gcum + (static_cast<int64_t>(c0) + tid) * d.Hv + h : gcum,
                tid < C);
    cp_async_commit();
  };

  // ready: chunk_prep of the chunks from ready_from on runs beside this pass (forward_impl);
  // each is loaded only after its flag is set. Chunks below ready_upto are known ready.
  int ready_upto = ready != nullptr ? (first > ready_from ? first : ready_from) : first + count;
  auto await = [&](int n) {  // before the block_sync that precedes loading chunk n
    if (n < ready_upto) return;
    const int cnt = first + count - n < kReadyAhead ? first + count - n : kReadyAhead;
    if (warp == 0) wait_ready(ready, d.Hv, h, n, cnt);
    ready_upto = n + cnt;
  };

  float S[MS][NT][4];  // rows rs + [0, 16 MS), cols v0 + [0, VT)
  zero(S);
  const int seq = static_cast<int>(blockIdx.y);
  if (d.cin != nullptr && seq == d.cin_seq) carry_tile<false>(S, const_cast<float*>(d.cin), h, rs, v0);
  if (count > 0) {
    if (ready != nullptr) {
      await(first);
      block_sync();
    }
    issue(0, 0);
  }
  for (int idx = 0; idx < count; ++idx) {
    const int s = L::kStages == 2 ? (idx & 1) : 0;
    const int n = first + idx, c0 = d.chunk_start(n), C = d.chunk_len(n);
    if (L::kStages == 1 && idx > 0) {
      await(n);
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
          St.put2(r, c, S[mt][nt][2 * hf], S[mt][nt][2 * hf + 1]);
          if constexpr (!kFwd) {
            if (hs != nullptr)  // null: the end state alone (gdn_end_state)
              gstore2<NPL>(hs, psh, ((static_cast<int64_t>(n) * d.Hv + h) * kD + r) * kD + v0 + c,
                           S[mt][nt][2 * hf], S[mt][nt][2 * hf + 1]);
          }
        }
    cp_async_wait_all();
    if (L::kStages == 2 && idx + 1 < count) await(n + 1);
    block_sync();
    if (L::kStages == 2 && idx + 1 < count) issue(idx + 1, s ^ 1);

    const float* gam = G_s(s);
    const float gl = gam[C - 1];
    float ct[2], gt[2];  // c_t and Gamma_t of this thread's two chunk rows (0 past the chunk)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int t = frag_row(rm, 0, hf);
      ct[hf] = t < C ? fexp(gl - gam[t]) : 0.f;
      gt[hf] = t < C ? fexp(gam[t]) : 0.f;
    }
    float D[1][NT2][4], O[1][NT2][4];
    zero(D);
    if constexpr (kFwd) {  // Delta's W S0 and the output's Q S0 share their S0 fragments
      zero(O);
      warp_mma_pair<NT2, kD>(D, O, W_s(s), Q_s(s), rm, St, cn);
    } else {
      warp_mma<1, NT2, false, true, kD>(D, W_s(s), rm, St, cn);
    }
#pragma unroll
    for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = frag_row(rm, 0, hf), c = frag_col(cn, nt);
        const bool ok = t < C;
        const F2 uv = U_s(s).get2(t, c);
        const float d0 = ok ? uv.x - D[0][nt][2 * hf] : 0.f;
        const float d1 = ok ? uv.y - D[0][nt][2 * hf + 1] : 0.f;
        if constexpr (kFwd) Dt.put2(t, c, d0, d1);
        Ct.put2(t, c, ct[hf] * d0, ct[hf] * d1);
        if constexpr (!kFwd)
          if (ok && dl != nullptr)
            gstore2<NPL>(dl, psv, ((static_cast<int64_t>(c0) + t) * d.Hv + h) * kD + v0 + c, d0,
                         d1);
      }
    if constexpr (kFwd) {
#pragma unroll
      for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[0][nt][e] *= gt[e >> 1];
    }
    block_sync();
    if constexpr (kFwd) {
      warp_mma<1, NT2, false, true, kC>(O, P_s(s), rm, Dt, cn);
#pragma unroll
      for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int t = frag_row(rm, 0, hf), c = v0 + frag_col(cn, nt);
          if (t < C && c < d.V)
            st2(o + ((static_cast<int64_t>(c0) + t) * d.Hv + h) * d.V + c, O[0][nt][2 * hf],
                O[0][nt][2 * hf + 1]);
        }
    }
    const float dec = fexp(gl);
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= dec;
    warp_mma<MS, NT, true, true, kC>(S, K_s(s), rs, Ct, 0);
  }
  if (d.cout != nullptr && seq == d.cout_seq) carry_tile<true>(S, d.cout, h, rs, v0);
}

// ---- host side ----------------------------------------------------------------------------------

template <class Tin>
void run_qk_norm(const Dims& d, const FwdBuffers& b, const Tin* q, const Tin* k) {
  launch(qk_norm_kernel<Tin>, dim3(blocks_for(2 * d.T * d.Hk, kWarps)), kThreads, 0, d, b.qh, b.kh,
         q, k);
}

// chunk_prep over chunks [n0, n1) of every value head; `ready`, if given, gets each block's flag.
template <class Tin, bool kStoreT>
void run_chunk_prep(const Dims& dims, const FwdBuffers& b, const Tin* v, const float* g,
                    const float* beta, int n0, int n1, int* ready) {
  constexpr int NPL = planes_of<Tin>();
  if (n1 <= n0) return;
  Dims d = dims;
  d.n0 = n0;
  // GdnVariant::prep_reload = false keeps K^ resident (3 blocks an SM for bf16; bitwise the
  // same results).
  if (!g_variant.prep_reload)
    launch(chunk_prep_kernel<Tin, kStoreT, false>, chunk_grid(d, n1 - n0), kThreads,
           PrepLayout<NPL, false>::kBytes, d, static_cast<const uint16_t*>(b.qh),
           static_cast<const uint16_t*>(b.kh), v, g, beta, b.gcum, b.w, b.u, b.pm, b.tm, ready);
  else
    launch(chunk_prep_kernel<Tin, kStoreT, true>, chunk_grid(d, n1 - n0), kThreads,
           PrepLayout<NPL, true>::kBytes, d, static_cast<const uint16_t*>(b.qh),
           static_cast<const uint16_t*>(b.kh), v, g, beta, b.gcum, b.w, b.u, b.pm, b.tm, ready);
}

template <class Tin, bool kFwd, int NW, int VT>
void run_state_fwd_nw(cudaStream_t st, const Dims& d, const FwdBuffers& b, Tin* o, uint16_t* hs,
                      uint16_t* dl, const int* ready, int ready_from) {
  constexpr int NPL = planes_of<Tin>();
  launch_on(st, state_fwd_kernel<Tin, VT, kFwd, NW>,
            dim3(static_cast<unsigned>(d.Hv * (kD / VT)), static_cast<unsigned>(d.NS)), NW * 32,
            StateFwdLayout<NPL, VT, kFwd>::kBytes, d, static_cast<const uint16_t*>(b.kh),
            static_cast<const uint16_t*>(b.qh), static_cast<const uint16_t*>(b.w),
            static_cast<const uint16_t*>(b.u), static_cast<const uint16_t*>(b.pm),
            static_cast<const float*>(b.gcum), o, hs, dl, ready, ready_from);
}

}  // namespace

namespace gdn {  // declared in gdn_cuda_common.cuh

template <class Tin, bool kStoreT>
void run_prep(const Dims& d, const FwdBuffers& b, const Tin* q, const Tin* k, const Tin* v,
              const float* g, const float* beta) {
  run_qk_norm(d, b, q, k);
  run_chunk_prep<Tin, kStoreT>(d, b, v, g, beta, 0, d.NC, nullptr);
}

template <class Tin, bool kFwd>
void run_state_fwd(const Dims& d, int vt, int nw, const FwdBuffers& b, Tin* o, uint16_t* hs,
                   uint16_t* dl, cudaStream_t st, const int* ready, int ready_from) {
  if (vt == 16)
    run_state_fwd_nw<Tin, kFwd, 4, 16>(st, d, b, o, hs, dl, ready, ready_from);
  else if (nw == 4 && vt == 64)
    run_state_fwd_nw<Tin, kFwd, 4, 64>(st, d, b, o, hs, dl, ready, ready_from);
  else if (nw == 4)
    run_state_fwd_nw<Tin, kFwd, 4, 32>(st, d, b, o, hs, dl, ready, ready_from);
  else if (vt == 64)
    run_state_fwd_nw<Tin, kFwd, 8, 64>(st, d, b, o, hs, dl, ready, ready_from);
  else
    run_state_fwd_nw<Tin, kFwd, 8, 32>(st, d, b, o, hs, dl, ready, ready_from);
}

}  // namespace gdn

namespace {

// The forward's state pass beside the second part of chunk_prep. Both are latency bound and the
// state pass runs one block per (sequence, value head, VT columns): at 1 x 32K that is 128
// blocks with one SM each and the rest of the SM idle. So the forward runs chunk_prep over the
// first chunks, then launches the state pass (on a higher-priority stream, so its blocks take
// the SMs first) while chunk_prep of the remaining chunks runs beside it; each of those blocks
// sets a flag for its (chunk, value head) after its stores, and the state pass waits for the
// flags of the chunks it is about to load (kReadyAhead at a time). Results are bitwise those of
// the plain order: the same kernels compute the same values.
//
// No deadlock: the state pass only waits on chunk_prep blocks, which wait on nothing;
// fwd_overlap_capacity() checks that an SM holding as many state blocks as fit still has room for a
// chunk_prep block; and the state pass must fit on the GPU at once (blocks <= SMs x blocks an
// SM): the block scheduler gives no SM to a lower-priority kernel while a higher-priority one
// still has blocks waiting, so state blocks left waiting (packed batches: one block per sequence,
// head and column slice) would keep chunk_prep out while the resident ones wait for it (measured:
// 8 x 4K hung). chunk_prep of the later chunks is enqueued (host order) before the state pass, so
// a device that serializes kernels (a debugger, CUDA_LAUNCH_BLOCKING=1) runs it first.
//
// GdnVariant::fwd_split = percent of the chunks whose chunk_prep runs before the state pass starts
// (default 60; 100 = the plain order). forward_run() below. q / k are normalised for all
// chunks first: normalising the later chunks beside the state pass measured slower (2.02-2.03
// against 1.88-1.91 ms at 1 x 32K), as it delays their chunk_prep, which the state pass waits for.

int fwd_split_percent() {
  if (const int v = g_variant.fwd_split; v >= 0 && v <= 100) return v;
  // Measured at 1 x 32K on an H200 (bench/results/2026-12-03-h200.md): 60 % gave 1.88-1.91 ms
  // against 1.97-2.02 for the plain order; 50-90 % lie between, 30 % is slower.
  return 60;
}

// Registers of a block of kernel f, as the SM allocates them (per warp, 256 at a time).
template <class K>
int64_t block_regs(K f, int threads) {
  cudaFuncAttributes a{};
  BB_CHECK_CUDA(cudaFuncGetAttributes(&a, f));
  const int64_t per_warp = (static_cast<int64_t>(a.numRegs) * 32 + 255) / 256 * 256;
  return per_warp * ((threads + 31) / 32);
}

// How many state-pass blocks the GPU holds at once, or 0 when an SM full of them (as many as
// fit) has no room left for a chunk_prep block.
template <class SK, class PK>
int64_t fwd_overlap_capacity(SK state_kernel, size_t state_smem, int state_threads, PK prep_kernel,
                             size_t prep_smem) {
  int dev = 0, smem_sm = 0, regs_sm = 0, threads_sm = 0, reserved = 0;
  BB_CHECK_CUDA(cudaGetDevice(&dev));
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&regs_sm, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&threads_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  for (auto [f, smem] : {std::pair<const void*, size_t>{reinterpret_cast<const void*>(state_kernel), state_smem},
                         {reinterpret_cast<const void*>(prep_kernel), prep_smem}}) {
    BB_CHECK_CUDA(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    BB_CHECK_CUDA(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared));
  }
  int k = 0;
  BB_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, state_kernel, state_threads, state_smem));
  if (k < 1) return 0;
  const int64_t smem = k * static_cast<int64_t>(state_smem + reserved) + static_cast<int64_t>(prep_smem + reserved);
  const int64_t regs = k * block_regs(state_kernel, state_threads) + block_regs(prep_kernel, kThreads);
  const int64_t threads = int64_t{k} * state_threads + kThreads;
  return smem <= smem_sm && regs <= regs_sm && threads <= threads_sm ? int64_t{k} * num_sms() : 0;
}

// The first chunk whose chunk_prep runs beside the forward's state pass, or NC for the plain
// order (f32 inputs: the state pass leaves no room; a split of 100; too few chunks to gain).
template <class Tin, bool kStoreT>
int fwd_split_chunk(const Dims& d, int vt, int nw) {
  if constexpr (planes_of<Tin>() != 1) {
    return d.NC;
  } else {
    const int pct = fwd_split_percent();
    if (pct >= 100 || d.NC < 16) return d.NC;
    constexpr int NPL = 1;
    auto prep = chunk_prep_kernel<Tin, kStoreT, true>;
    static thread_local int64_t cap[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};  // [vt 16|32|64][nw 4|8]
    int64_t& c = cap[vt == 16 ? 0 : vt == 32 ? 1 : 2][nw == 8];
    if (c < 0) {
      const size_t ps = PrepLayout<NPL, true>::kBytes;
      if (vt == 16)
        c = fwd_overlap_capacity(state_fwd_kernel<Tin, 16, true, 4>, StateFwdLayout<NPL, 16, true>::kBytes, 128, prep, ps);
      else if (nw == 4 && vt == 64)
        c = fwd_overlap_capacity(state_fwd_kernel<Tin, 64, true, 4>, StateFwdLayout<NPL, 64, true>::kBytes, 128, prep, ps);
      else if (nw == 4)
        c = fwd_overlap_capacity(state_fwd_kernel<Tin, 32, true, 4>, StateFwdLayout<NPL, 32, true>::kBytes, 128, prep, ps);
      else if (vt == 64)
        c = fwd_overlap_capacity(state_fwd_kernel<Tin, 64, true, 8>, StateFwdLayout<NPL, 64, true>::kBytes, 256, prep, ps);
      else
        c = fwd_overlap_capacity(state_fwd_kernel<Tin, 32, true, 8>, StateFwdLayout<NPL, 32, true>::kBytes, 256, prep, ps);
    }
    // Every state block resident at once (see above).
    if (static_cast<int64_t>(d.Hv) * (kD / vt) * d.NS > c) return d.NC;
    const int split = static_cast<int>(static_cast<int64_t>(d.NC) * pct / 100);
    return split < 1 ? 1 : split;
  }
}

template <class Tin, bool kStoreT>
void forward_run(Tin* o, const Tin* q, const Tin* k, const Tin* v, const float* g,
                 const float* beta, const Dims& d, const GdnDims& gd, const FwdBuffers& b,
                 int* flags) {
  const int vt = pick_vt(gd), nw = pick_state_warps(true, vt);
  const int split = fwd_split_chunk<Tin, kStoreT>(d, vt, nw);
  run_qk_norm(d, b, q, k);
  if (split >= d.NC) {
    run_chunk_prep<Tin, kStoreT>(d, b, v, g, beta, 0, d.NC, nullptr);
    run_state_fwd<Tin, true>(d, vt, nw, b, o, nullptr, nullptr);
    return;
  }
  cudaStream_t st = stream();
  SideStream& fs = side_stream(1);
  BB_CHECK_CUDA(cudaMemsetAsync(flags + static_cast<int64_t>(split) * d.Hv, 0,
                                static_cast<size_t>(d.NC - split) * d.Hv * sizeof(int), st));
  run_chunk_prep<Tin, kStoreT>(d, b, v, g, beta, 0, split, nullptr);
  BB_CHECK_CUDA(cudaEventRecord(fs.fork, st));
  run_chunk_prep<Tin, kStoreT>(d, b, v, g, beta, split, d.NC, flags);  // enqueued first (see above)
  BB_CHECK_CUDA(cudaStreamWaitEvent(fs.s, fs.fork, 0));
  run_state_fwd<Tin, true>(d, vt, nw, b, o, nullptr, nullptr, fs.s, flags, split);
  BB_CHECK_CUDA(cudaEventRecord(fs.join, fs.s));
  BB_CHECK_CUDA(cudaStreamWaitEvent(st, fs.join, 0));
}

}  // namespace

namespace gdn {  // declared in gdn_cuda_common.cuh

// The forward's workspace: chunk_prep's outputs (with_t: T too, the prep a forward keeps for its
// backward), then the per-(chunk, value head) readiness flags of the overlapped order (4 bytes each).
template <class Tin>
size_t forward_ws(const GdnDims& g, bool with_t) {
  Carve c{nullptr};
  carve_prep<planes_of<Tin>()>(c, g, with_t);
  c.take<int>(static_cast<int64_t>(g.num_chunks) * g.Hv);
  return c.used;
}

template <class Tin>
void forward_impl(Tin* o, const Tin* q, const Tin* k, const Tin* v, const float* g,
                  const float* beta, const int32_t* table, const GdnDims& gd, void* ws,
                  bool keep_prep, const GdnCarry* carry) {
  Dims d = make_dims(gd, table);
  apply_carry(d, carry);
  Carve c{static_cast<unsigned char*>(ws)};
  const FwdBuffers b = carve_prep<planes_of<Tin>()>(c, gd, keep_prep);
  int* flags = c.take<int>(static_cast<int64_t>(gd.num_chunks) * gd.Hv);
  if (keep_prep)
    forward_run<Tin, true>(o, q, k, v, g, beta, d, gd, b, flags);
  else
    forward_run<Tin, false>(o, q, k, v, g, beta, d, gd, b, flags);
}

// The end state of carry.seq_out alone: the prep, then the rebuild pass writing nothing else.
template <class Tin>
void end_state_impl(const Tin* q, const Tin* k, const Tin* v, const float* g, const float* beta,
                    const int32_t* table, const GdnDims& gd, void* ws, const GdnCarry& carry) {
  Dims d = make_dims(gd, table);
  apply_carry(d, &carry);
  Carve c{static_cast<unsigned char*>(ws)};
  const FwdBuffers b = carve_prep<planes_of<Tin>()>(c, gd, false);
  run_prep<Tin, false>(d, b, q, k, v, g, beta);
  const int vt = pick_vt(gd);
  run_state_fwd<Tin, false>(d, vt, pick_state_warps(false, vt), b, static_cast<Tin*>(nullptr),
                            nullptr, nullptr);
}

// What the other files call (gdn_cuda_common.cuh).
template void run_prep<float, true>(const Dims&, const FwdBuffers&, const float*, const float*,
                                    const float*, const float*, const float*);
template void run_prep<uint16_t, true>(const Dims&, const FwdBuffers&, const uint16_t*,
                                       const uint16_t*, const uint16_t*, const float*,
                                       const float*);
template void run_state_fwd<float, false>(const Dims&, int, int, const FwdBuffers&, float*,
                                          uint16_t*, uint16_t*, cudaStream_t, const int*, int);
template void run_state_fwd<uint16_t, false>(const Dims&, int, int, const FwdBuffers&, uint16_t*,
                                             uint16_t*, uint16_t*, cudaStream_t, const int*, int);
template size_t forward_ws<float>(const GdnDims&, bool);
template size_t forward_ws<uint16_t>(const GdnDims&, bool);
template void forward_impl<float>(float*, const float*, const float*, const float*, const float*,
                                  const float*, const int32_t*, const GdnDims&, void*, bool,
                                  const GdnCarry*);
template void forward_impl<uint16_t>(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*,
                                     const float*, const float*, const int32_t*, const GdnDims&,
                                     void*, bool, const GdnCarry*);
template void end_state_impl<float>(const float*, const float*, const float*, const float*,
                                    const float*, const int32_t*, const GdnDims&, void*,
                                    const GdnCarry&);
template void end_state_impl<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*,
                                       const float*, const float*, const int32_t*, const GdnDims&,
                                       void*, const GdnCarry&);

}  // namespace gdn
}  // namespace bb::cuda

// gated_delta_rule_cuda.cu — the chunked (WY / UT) gated delta rule on the GPU, forward and
// backward, over packed variable-length sequences (equations: gated_delta_rule_ref.h and
// skills/gated-delta-rule.md; the chunked backward is derived there).
//
// Legend: T tokens, C = 64 tokens per chunk (the last chunk of a sequence may be shorter),
// D = 128 (K and V padded to it with zeros), per value head h and chunk with state S0 [K, V]:
//   gamma_t = sum_{i <= t} g_i (within the chunk), Gamma = exp(gamma), c_t = exp(gamma_last -
//   gamma_t) L = strictly lower (beta_t exp(gamma_t - gamma_i) k_t . k_i),  T = (I + L)^-1 W = (T
//   diag(beta Gamma)) K,  U = (T diag(beta)) V,  Delta = U - W S0 P = (i <= t) exp(gamma_t -
//   gamma_i) q_t . k_i O = diag(Gamma) Q S0 + P Delta,  S_next = Gamma_last S0 + K^T diag(c) Delta
//
// Kernels (128 threads = 4 warps; the sequential state passes 4 or 8 warps, pick_state_warps;
// chunk-local products on tensor cores):
//   forward:  qk_norm -> chunk_prep -> state_fwd<fused output>
//   backward: qk_norm -> chunk_prep (+T) -> state_fwd<recompute: boundary states h, Delta>
//             -> [d_o to operand planes] -> state_bwd (reverse: dh, dDelta) -> dqkw (dq, dk parts,
//             dW, dgamma parts) -> wy_bwd (dv, dbeta, dg, dk parts) -> finalize_qk (GVA sum + norm)
//
// Precision. Every matrix product is mma.sync m16n8k16 bf16 with fp32 accumulation; the state
// and all accumulations stay fp32. With bf16 inputs each operand is rounded to bf16 once
// (relative 2^-9). With f32 inputs each f32 operand x is split as hi = bf16(x), lo = bf16(x - hi)
// and a b = ah bh + ah bl + al bh (three products): about 2^-16 relative per product, which keeps
// the f32 path within 1e-4 of the fp64 reference. Intermediates that travel between kernels
// (normalised q/k, W, U, P, T, h, Delta, dh, dDelta, dW) are stored in the same "operand planes":
// one bf16 plane, or the hi and lo planes (lo at +plane_stride) for f32. The triangular solve is
// fp32 arithmetic (no tensor cores).
//
// Shared-memory operand tiles are [rows][cols] bf16 with 16-byte chunks XOR-swizzled by row, so
// ldmatrix (8 rows x 16 bytes) and the accumulator stores hit 32 distinct banks.
//
// Parallelism: the chunk-parallel kernels run one block per (chunk, value head); the state passes
// one block per (non-empty sequence, value head, VT value columns), sequential over the chunks of
// the sequence, with the next chunk's tiles prefetched by cp.async (two stages for bf16; one for
// f32, whose hi/lo tiles need twice the shared memory); in the backward the rebuild and the
// reverse pass run side by side on two streams (side_stream). Nothing is atomic: results are
// bitwise reproducible. Measured on an H200 (bench_gdn, ncu; skills/gated-delta-rule.md): the state
// passes are bound by shared-memory bandwidth (every warp reads the S / Delta tiles it shares
// with the others, about 250 KB per chunk and block), chunk_prep / dqkw / wy_bwd by latency at
// 3 / 2 / 2 blocks an SM; none is near the tensor-core or HBM ceilings. Shared-memory layouts
// overlap buffers whose lives do not overlap, to fit those blocks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "core/error.h"
#include "primitives/gdn/gated_delta_rule_cuda.h"

namespace bb::cuda {
namespace {

GdnVariant g_variant;  // set_gdn_variant (benchmarks and tests); the defaults in a run

constexpr int kC = 64;         // tokens per chunk
constexpr int kD = 128;        // padded K and V
constexpr int kThreads = 128;  // every kernel but the state passes
constexpr int kWarps = kThreads / 32;
// The state passes run 8 warps a block (or 4: GdnVariant::state_warps, see pick_state_warps).

// ---- device intrinsics (all PTX in one place) -------------------------------------------------
__device__ __forceinline__ uint16_t f2bf(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float bf2f(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes global -> shared, zero-filled when !valid (nothing is read then).
__device__ __forceinline__ void cp_async16(void* s, const void* g, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* s, const void* g, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(s)), "l"(g),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
// Readiness flags between chunk_prep and the forward state pass running beside it (gpu scope).
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// exp of a log-decay difference (<= 0 in practice): ex2.approx, relative error about 2^-22 plus
// |x| 2^-24 from scaling the argument, far below the bf16 operand rounding and the f32 path's 1e-4.
__device__ __forceinline__ float fexp(float x) {
  return __expf(x);
}
__device__ __forceinline__ float shfl_xor(float v, int m) {
  return __shfl_xor_sync(0xffffffffu, v, m);
}
__device__ __forceinline__ float shfl_up(float v, int d) {
  return __shfl_up_sync(0xffffffffu, v, d);
}
__device__ __forceinline__ float shfl_down(float v, int d) {
  return __shfl_down_sync(0xffffffffu, v, d);
}
__device__ __forceinline__ void block_sync() {
  __syncthreads();
}
__device__ __forceinline__ unsigned char* smem_base() {
  extern __shared__ __align__(128) unsigned char gdn_smem[];
  return gdn_smem;
}

template <class... P, class... A>
void launch_on(cudaStream_t st, void (*kernel)(P...), dim3 grid, int threads, size_t smem,
               A... args) {
  if (grid.x == 0 || grid.y == 0) return;
  if (smem > 48 * 1024) {
    BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    // All of the unified L1 as shared memory: the tiles come in by cp.async.cg (L2 only), and
    // the blocks an SM holds are set by shared memory.
    BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared));
  }
  kernel<<<grid, threads, smem, st>>>(static_cast<P>(args)...);
  BB_CHECK_LAUNCH();
}
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, int threads, size_t smem, A... args) {
  launch_on(stream(), kernel, grid, threads, smem, args...);
}
int num_sms() {
  return sm_count();
}

struct alignas(8) F2 {
  float x, y;
};
struct alignas(16) F4 {
  float a, b, c, d;
};
struct alignas(8) U2 {
  uint32_t x, y;
};

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

template <class T>
constexpr int planes_of() {
  return std::is_same_v<T, float> ? 2 : 1;
}

// Raw inputs: f32 or bf16 (uint16_t bits).
__device__ __forceinline__ void ld4(const float* p, float (&v)[4]) {
  const F4 t = *reinterpret_cast<const F4*>(p);
  v[0] = t.a, v[1] = t.b, v[2] = t.c, v[3] = t.d;
}
__device__ __forceinline__ void ld4(const uint16_t* p, float (&v)[4]) {
  const U2 t = *reinterpret_cast<const U2*>(p);
  v[0] = bf2f(static_cast<uint16_t>(t.x & 0xffffu)), v[1] = bf2f(static_cast<uint16_t>(t.x >> 16));
  v[2] = bf2f(static_cast<uint16_t>(t.y & 0xffffu)), v[3] = bf2f(static_cast<uint16_t>(t.y >> 16));
}
__device__ __forceinline__ void st2(float* p, float a, float b) {
  *reinterpret_cast<F2*>(p) = F2{a, b};
}
__device__ __forceinline__ void st2(uint16_t* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack2(f2bf(a), f2bf(b));
}

// Two values into operand planes at element offset `off` (even): hi, and lo at +ps for NPL = 2.
template <int NPL>
__device__ __forceinline__ void gstore2(uint16_t* base, int64_t ps, int64_t off, float v0,
                                        float v1) {
  const uint16_t h0 = f2bf(v0), h1 = f2bf(v1);
  *reinterpret_cast<uint32_t*>(base + off) = pack2(h0, h1);
  if constexpr (NPL == 2)
    *reinterpret_cast<uint32_t*>(base + ps + off) = pack2(f2bf(v0 - bf2f(h0)), f2bf(v1 - bf2f(h1)));
}

// ---- shared-memory operand tiles ---------------------------------------------------------------
// R x COLS bf16 per plane, NPL planes back to back. 16-byte chunk j of row r sits at chunk
// j ^ sw(r): any 8 consecutive rows of one logical chunk land in 8 different 16-byte bank groups.
template <int R, int COLS, int NPL>
struct Tile {
  static_assert(COLS == 16 || COLS == 32 || COLS == 64 || COLS == 128, "tile width");
  static constexpr int kPlane = R * COLS;
  static constexpr int kBytes = NPL * kPlane * 2;
  uint16_t* p;
  __device__ __forceinline__ static int off(int r, int c) {
    const int sw = COLS == 16 ? ((r >> 2) & 1) : COLS == 32 ? ((r >> 1) & 3) : (r & 7);
    return r * COLS + ((((c >> 3) ^ sw)) << 3) + (c & 7);
  }
  __device__ __forceinline__ uint16_t* at(int pl, int r, int c) const {
    return p + pl * kPlane + off(r, c);
  }
  __device__ __forceinline__ float get(int r, int c) const {
    float v = bf2f(*at(0, r, c));
    if constexpr (NPL == 2) v += bf2f(*at(1, r, c));
    return v;
  }
  // c even: columns c and c + 1, one 32-bit read a plane
  __device__ __forceinline__ F2 get2(int r, int c) const {
    const uint32_t h = *reinterpret_cast<const uint32_t*>(at(0, r, c));
    F2 v{bf2f(static_cast<uint16_t>(h & 0xffffu)), bf2f(static_cast<uint16_t>(h >> 16))};
    if constexpr (NPL == 2) {
      const uint32_t l = *reinterpret_cast<const uint32_t*>(at(1, r, c));
      v.x += bf2f(static_cast<uint16_t>(l & 0xffffu));
      v.y += bf2f(static_cast<uint16_t>(l >> 16));
    }
    return v;
  }
  // c even
  __device__ __forceinline__ void put2(int r, int c, float v0, float v1) const {
    const uint16_t h0 = f2bf(v0), h1 = f2bf(v1);
    *reinterpret_cast<uint32_t*>(at(0, r, c)) = pack2(h0, h1);
    if constexpr (NPL == 2)
      *reinterpret_cast<uint32_t*>(at(1, r, c)) = pack2(f2bf(v0 - bf2f(h0)), f2bf(v1 - bf2f(h1)));
  }
};

// Rows [0, R) x cols [col0, col0 + COLS) of operand planes into a tile by cp.async; row r of
// global starts at element row0 + r * row_stride; rows >= valid are zero-filled.
template <int NTH = kThreads, int R, int COLS, int NPL>
__device__ __forceinline__ void load_rows(const Tile<R, COLS, NPL>& t, const uint16_t* g,
                                          int64_t ps, int64_t row0, int64_t row_stride, int col0,
                                          int valid) {
  constexpr int kChunks = COLS / 8;
  if constexpr ((R * kChunks) % NTH == 0 && NTH % kChunks == 0) {
    // Every thread copies the same 16-byte column chunk of kPer rows kStep apart: the addresses
    // are one base plus constant steps (the issue cost per chunk of the state passes matters).
    constexpr int kPer = R * kChunks / NTH, kStep = NTH / kChunks;
    const int r0 = static_cast<int>(threadIdx.x) / kChunks,
              ch = static_cast<int>(threadIdx.x) % kChunks;
    const int64_t step = kStep * row_stride;
#pragma unroll
    for (int pl = 0; pl < NPL; ++pl) {
      const uint16_t* gp = g + pl * ps + row0 + r0 * row_stride + col0 + ch * 8;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const bool ok = r0 + j * kStep < valid;
        cp_async16(t.at(pl, r0 + j * kStep, ch * 8), ok ? gp + j * step : g, ok);
      }
    }
  } else {
#pragma unroll
    for (int pl = 0; pl < NPL; ++pl) {
      const uint16_t* gp = g + pl * ps;
#pragma unroll 4
      for (int i = threadIdx.x; i < R * kChunks; i += NTH) {
        const int r = i / kChunks, ch = i % kChunks;
        const bool ok = r < valid;
        const uint16_t* src = ok ? gp + row0 + r * row_stride + col0 + ch * 8 : g;
        cp_async16(t.at(pl, r, ch * 8), src, ok);
      }
    }
  }
}

// Raw input rows (f32 or bf16, `width` <= COLS values each, row r at src + r * row_stride) into a
// tile, zero beyond `width` and for rows >= valid. bf16 goes straight in by cp.async; f32 is
// split into hi / lo on the way (through registers).
template <int R, int COLS, int NPL>
__device__ __forceinline__ void load_raw_rows(const Tile<R, COLS, NPL>& t, const uint16_t* src,
                                              int64_t row_stride, int width, int valid) {
  constexpr int kChunks = COLS / 8;
  static_assert((R * kChunks) % kThreads == 0 && kThreads % kChunks == 0, "raw tile shape");
  constexpr int kPer = R * kChunks / kThreads, kStep = kThreads / kChunks;
  const int r0 = static_cast<int>(threadIdx.x) / kChunks,
            ch = static_cast<int>(threadIdx.x) % kChunks;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int r = r0 + j * kStep;
    const bool ok = r < valid && ch * 8 < width;
    cp_async16(t.at(0, r, ch * 8), ok ? src + r * row_stride + ch * 8 : src, ok);
  }
}
template <int R, int COLS, int NPL>
__device__ __forceinline__ void load_raw_rows(const Tile<R, COLS, NPL>& t, const float* src,
                                              int64_t row_stride, int width, int valid) {
  for (int i = threadIdx.x; i < R * (COLS / 4); i += kThreads) {
    const int r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < valid && c < width) ld4(src + r * row_stride + c, x);
    t.put2(r, c, x[0], x[1]);
    t.put2(r, c + 2, x[2], x[3]);
  }
}

// acc[MT][NT] += A[m0 + 16 MT rows][0, KLEN) * B[0, KLEN)[n0 + 8 NT cols], one warp.
// A: kAT = false -> tile holds A as [m][k]; true -> as [k][m].
// B: kBT = false -> tile holds B as [n][k]; true -> as [k][n].
// Fragment layouts of mma.m16n8k16 (g = lane / 4, q = lane % 4): A regs {(g, 2q..), (g+8, 2q..),
// (g, 2q+8..), (g+8, 2q+8..)}; B regs {(k 2q.., n g), (k 2q+8.., n g)}; C {(g, 2q..), (g+8, 2q..)}.
template <int MT, int NT, bool kAT, bool kBT, int KLEN, class TA, class TB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const TA& A, int m0, const TB& B,
                                         int n0) {
  static_assert(NT % 2 == 0, "n tiles come in pairs");
  constexpr int NPL = (TA::kBytes / TA::kPlane) / 2;
  static_assert(NPL == (TB::kBytes / TB::kPlane) / 2, "operands of one product share a precision");
  const int lane = threadIdx.x & 31, j = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int k = 0; k < KLEN; k += 16) {
    uint32_t a[NPL][MT][4];
#pragma unroll
    for (int pl = 0; pl < NPL; ++pl)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (!kAT)
          ldsm4(a[pl][mt], A.at(pl, m0 + mt * 16 + (lane & 15), k + (lane >> 4) * 8));
        else
          ldsm4t(a[pl][mt], A.at(pl, k + rr + (j >> 1) * 8, m0 + mt * 16 + (j & 1) * 8));
      }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[NPL][4];
#pragma unroll
      for (int pl = 0; pl < NPL; ++pl) {
        if constexpr (!kBT)
          ldsm4(b[pl], B.at(pl, n0 + np * 16 + rr + (j >> 1) * 8, k + (j & 1) * 8));
        else
          ldsm4t(b[pl], B.at(pl, k + rr + (j & 1) * 8, n0 + np * 16 + (j >> 1) * 8));
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          float(&c)[4] = acc[mt][np * 2 + sub];
          mma_bf16(c, a[0][mt], b[0][2 * sub], b[0][2 * sub + 1]);
          if constexpr (NPL == 2) {
            mma_bf16(c, a[0][mt], b[1][2 * sub], b[1][2 * sub + 1]);
            mma_bf16(c, a[1][mt], b[0][2 * sub], b[0][2 * sub + 1]);
          }
        }
    }
  }
}

// acc1 += A1[m0 + 16 rows][0, KLEN) B and acc2 += A2[...] B, one warp, A tiles as [m][k], B as
// [k][n]: each B fragment is read from shared memory once for both products (the forward state
// pass reads S for W S and Q S; shared-memory bandwidth bounds it).
template <int NT, int KLEN, class TA, class TB>
__device__ __forceinline__ void warp_mma_pair(float (&acc1)[1][NT][4], float (&acc2)[1][NT][4],
                                              const TA& A1, const TA& A2, int m0, const TB& B,
                                              int n0) {
  static_assert(NT % 2 == 0, "n tiles come in pairs");
  constexpr int NPL = (TA::kBytes / TA::kPlane) / 2;
  static_assert(NPL == (TB::kBytes / TB::kPlane) / 2, "operands of one product share a precision");
  const int lane = threadIdx.x & 31, j = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int k = 0; k < KLEN; k += 16) {
    uint32_t a1[NPL][4], a2[NPL][4];
#pragma unroll
    for (int pl = 0; pl < NPL; ++pl) {
      ldsm4(a1[pl], A1.at(pl, m0 + (lane & 15), k + (lane >> 4) * 8));
      ldsm4(a2[pl], A2.at(pl, m0 + (lane & 15), k + (lane >> 4) * 8));
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[NPL][4];
#pragma unroll
      for (int pl = 0; pl < NPL; ++pl)
        ldsm4t(b[pl], B.at(pl, k + rr + (j & 1) * 8, n0 + np * 16 + (j >> 1) * 8));
#pragma unroll
      for (int sub = 0; sub < 2; ++sub) {
        float(&c1)[4] = acc1[0][np * 2 + sub];
        float(&c2)[4] = acc2[0][np * 2 + sub];
        mma_bf16(c1, a1[0], b[0][2 * sub], b[0][2 * sub + 1]);
        mma_bf16(c2, a2[0], b[0][2 * sub], b[0][2 * sub + 1]);
        if constexpr (NPL == 2) {
          mma_bf16(c1, a1[0], b[1][2 * sub], b[1][2 * sub + 1]);
          mma_bf16(c1, a1[1], b[0][2 * sub], b[0][2 * sub + 1]);
          mma_bf16(c2, a2[0], b[1][2 * sub], b[1][2 * sub + 1]);
          mma_bf16(c2, a2[1], b[0][2 * sub], b[0][2 * sub + 1]);
        }
      }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// Row / column of accumulator element (mt, nt, 2 * half (+1)) of a warp tile at (m0, n0).
__device__ __forceinline__ int frag_row(int m0, int mt, int half) {
  return m0 + mt * 16 + ((threadIdx.x & 31) >> 2) + half * 8;
}
__device__ __forceinline__ int frag_col(int n0, int nt) {
  return n0 + nt * 8 + ((threadIdx.x & 3) << 1);
}

// A state pass's register tile (rows rs + [0, 16 MS), columns v0 + [0, 8 NT)) of value head h
// from (kStore false) or to a carried f32 state [Hv][128][128] (GdnCarry).
template <bool kStore, int MS, int NT>
__device__ __forceinline__ void carry_tile(float (&S)[MS][NT][4], float* mem, int h, int rs,
                                           int v0) {
#pragma unroll
  for (int mt = 0; mt < MS; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = frag_row(rs, mt, hf), c = v0 + frag_col(0, nt);
        float2* p = reinterpret_cast<float2*>(mem + (static_cast<int64_t>(h) * 128 + r) * 128 + c);
        if constexpr (kStore) {
          *p = make_float2(S[mt][nt][2 * hf], S[mt][nt][2 * hf + 1]);
        } else {
          const float2 x = *p;
          S[mt][nt][2 * hf] = x.x;
          S[mt][nt][2 * hf + 1] = x.y;
        }
      }
}

// Sum over the 4 lanes that share an accumulator row.
__device__ __forceinline__ float row_reduce4(float v) {
  v += shfl_xor(v, 1);
  v += shfl_xor(v, 2);
  return v;
}

constexpr size_t align128(size_t b) {
  return (b + 127) / 128 * 128;
}

struct Dims {
  int64_t T;
  int Hk, Hv, G, K, V;
  float scale, eps;
  int l2norm;
  int NC, NS;
  // Block order of the per-(chunk, value head) kernels: 0 = chunks fastest (grid NC x Hv), 1 =
  // value heads fastest (grid NC Hv), so the G value heads of a key head run side by side and
  // its q / k tiles are read from L2 the second time (chunk_grid, chunk_head).
  int head_fastest;
  int n0;  // first chunk of a per-(chunk, value head) launch (a forward's chunk_prep runs in two)
  const int32_t* tab;  // chunk table (gdn_chunk_table layout)
  // A sequence continuing across calls (GdnCarry; f32 states [Hv][128][128]): sequence cin_seq
  // (table order) starts from the state cin and its start-state gradient goes to dcout;
  // sequence cout_seq leaves its end state in cout and its end-state gradient comes from dcin.
  // Null pointers: zero start, nothing written.
  const float* cin;
  float* cout;
  const float* dcin;
  float* dcout;
  int cin_seq, cout_seq;
  __device__ __forceinline__ int chunk_start(int n) const { return tab[n]; }
  __device__ __forceinline__ int chunk_len(int n) const { return tab[NC + n]; }
  __device__ __forceinline__ int seq_first(int s) const { return tab[2 * NC + s]; }
  __device__ __forceinline__ int seq_count(int s) const { return tab[2 * NC + NS + s]; }
};

// This block's chunk n and value head h in a per-(chunk, value head) kernel.
__device__ __forceinline__ void chunk_head(const Dims& d, int& n, int& h) {
  if (d.head_fastest) {
    n = d.n0 + static_cast<int>(blockIdx.x / static_cast<unsigned>(d.Hv));
    h = static_cast<int>(blockIdx.x % static_cast<unsigned>(d.Hv));
  } else {
    n = d.n0 + static_cast<int>(blockIdx.x);
    h = static_cast<int>(blockIdx.y);
  }
}

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

// Workspace carving: the same code sizes (base == nullptr) and hands out the buffers.
struct Carve {
  unsigned char* base;
  size_t used = 0;
  template <class T>
  T* take(int64_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
};

Dims make_dims(const GdnDims& g, const int32_t* table) {
  Dims d{};
  d.T = g.T;
  d.Hk = g.Hk;
  d.Hv = g.Hv;
  d.G = g.Hv / g.Hk;
  d.K = g.K;
  d.V = g.V;
  d.scale = g.scale;
  d.eps = g.eps;
  d.l2norm = g.l2norm ? 1 : 0;
  d.NC = g.num_chunks;
  d.NS = g.num_seqs;
  d.tab = table;
  d.cin_seq = d.cout_seq = -1;
  // Value heads fastest by default: the backward measured 6.38-6.42 against 6.50-6.52 ms at
  // 1 x 32K and 8 x 4K (H200, Qwen3.5 shapes), the forward the same. GdnVariant::chunk_fastest
  // restores chunks fastest (results are bitwise the same).
  d.head_fastest = g_variant.chunk_fastest ? 0 : 1;
  if (static_cast<int64_t>(d.NC) * d.Hv > 0x7fffffff) d.head_fastest = 0;
  return d;
}

// The grid of a per-(chunk, value head) kernel over chunks [d.n0, d.n0 + count) (all by default).
dim3 chunk_grid(const Dims& d, int count = -1) {
  const int nc = count < 0 ? d.NC - d.n0 : count;
  if (d.head_fastest) return dim3(static_cast<unsigned>(static_cast<int64_t>(nc) * d.Hv));
  return dim3(static_cast<unsigned>(nc), static_cast<unsigned>(d.Hv));
}

// Value columns per state-pass block: 64 when there are enough (sequence, head) pairs to fill
// the GPU twice with them; 16 when even 32 columns would leave more than half of the SMs
// without a block (few heads over long sequences: a context-parallel rank's share of the heads,
// a call's heads at batch 1), so that the sequential passes get twice the blocks, each with half
// the work per chunk; else 32. GdnVariant::vt overrides.
int pick_vt(const GdnDims& g) {
  if (const int v = g_variant.vt; v == 16 || v == 32 || v == 64) return v;
  const int64_t pairs = static_cast<int64_t>(g.num_seqs) * g.Hv;
  if (pairs * 2 >= 2LL * num_sms()) return 64;
  return pairs * (kD / 32) * 2 <= num_sms() ? 16 : 32;
}

// Warps per state-pass block. Measured on an H200 (1 x 32K, bf16): the forward pass (which also
// forms O) is faster with 4 (0.90 against 0.96 ms), the backward's rebuild and reverse pass with
// 8 (0.96 / 1.35 against 1.05 / 1.42 ms). GdnVariant::state_warps sets all three.
// At 16 columns a block always runs 4 warps (the products take their n tiles in pairs: 8 warps
// would leave one 8-column tile each).
int pick_state_warps(bool forward_output, int vt) {
  if (vt == 16) return 4;
  if (const int v = g_variant.state_warps; v == 4 || v == 8) return v;
  return forward_output ? 4 : 8;
}

unsigned blocks_for(int64_t work_items, int per_block) {
  const int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, int64_t{num_sms()} * 16)));
}

struct FwdBuffers {
  uint16_t *qh, *kh, *w, *u, *pm, *tm;
  float* gcum;
};

template <int NPL>
FwdBuffers carve_prep(Carve& c, const GdnDims& g, bool with_t) {
  FwdBuffers b{};
  b.qh = c.take<uint16_t>(NPL * g.T * g.Hk * kD);
  b.kh = c.take<uint16_t>(NPL * g.T * g.Hk * kD);
  b.w = c.take<uint16_t>(NPL * g.T * g.Hv * kD);
  b.u = c.take<uint16_t>(NPL * g.T * g.Hv * kD);
  b.pm = c.take<uint16_t>(NPL * g.T * g.Hv * kC);
  b.tm = with_t ? c.take<uint16_t>(NPL * g.T * g.Hv * kC) : nullptr;
  b.gcum = c.take<float>(g.T * g.Hv);
  return b;
}

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

template <class Tin, bool kStoreT>
void run_prep(const Dims& d, const FwdBuffers& b, const Tin* q, const Tin* k, const Tin* v,
              const float* g, const float* beta) {
  run_qk_norm(d, b, q, k);
  run_chunk_prep<Tin, kStoreT>(d, b, v, g, beta, 0, d.NC, nullptr);
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

template <class Tin, bool kFwd>
void run_state_fwd(const Dims& d, int vt, int nw, const FwdBuffers& b, Tin* o, uint16_t* hs,
                   uint16_t* dl, cudaStream_t st = stream(), const int* ready = nullptr,
                   int ready_from = 0) {
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

// Side streams, one per thread, device and kind, non-blocking, created on first use: kind 0 at
// the compute stream's priority (the backward's rebuild), kind 1 at the highest (the forward's
// state pass).
struct SideStream {
  cudaStream_t s = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
SideStream& side_stream(int kind = 0) {
  constexpr int kMaxDevices = 64;
  thread_local SideStream per_device[2][kMaxDevices];
  int dev = 0;
  BB_CHECK_CUDA(cudaGetDevice(&dev));
  BB_CHECK(dev >= 0 && dev < kMaxDevices, "gated_delta_rule (CUDA): device ", dev,
           " is beyond the ", kMaxDevices, " this backend supports");
  SideStream& ss = per_device[kind][dev];
  if (ss.s == nullptr) {
    int lo = 0, hi = 0;
    BB_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    // The forward's state pass goes first (it waits on chunk_prep's flags, resident); the
    // backward's rebuild pass shares SMs with the reverse pass at the compute stream's priority
    // (not the lowest, where the update beside the backward queues its short blocks: measured
    // 4.8 ms a layer instead of 2.2 for the Qwen3.5 slice's 8K backward with the update beside it).
    BB_CHECK_CUDA(cudaStreamCreateWithPriority(&ss.s, cudaStreamNonBlocking,
                                               kind == 1 ? hi : bb::cuda::work_stream_priority(dev)));
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&ss.fork, cudaEventDisableTiming));
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&ss.join, cudaEventDisableTiming));
  }
  return ss;
}

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

// The forward's workspace: chunk_prep's outputs (with_t: T too, the prep a forward keeps for its
// backward), then the per-(chunk, value head) readiness flags of the overlapped order (4 bytes each).
template <class Tin>
size_t forward_ws(const GdnDims& g, bool with_t) {
  Carve c{nullptr};
  carve_prep<planes_of<Tin>()>(c, g, with_t);
  c.take<int>(static_cast<int64_t>(g.num_chunks) * g.Hv);
  return c.used;
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

// The carried states of a call (GdnCarry), into its dims.
void apply_carry(Dims& d, const GdnCarry* c) {
  if (c == nullptr) return;
  BB_CHECK(c->seq_in < d.NS && c->seq_out < d.NS, "gated_delta_rule (CUDA): carried sequence ",
           std::max(c->seq_in, c->seq_out), " is beyond the call's ", d.NS, " sequences");
  d.cin_seq = c->seq_in;
  d.cout_seq = c->seq_out;
  d.cin = c->seq_in >= 0 ? c->s_in : nullptr;
  d.dcout = c->seq_in >= 0 ? c->ds_out : nullptr;
  d.cout = c->seq_out >= 0 ? c->s_out : nullptr;
  d.dcin = c->seq_out >= 0 ? c->ds_in : nullptr;
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

}  // namespace

int gdn_table_seq(const std::vector<int32_t>& table, const GdnDims& dims, int32_t token_start) {
  const size_t nc = static_cast<size_t>(dims.num_chunks);
  for (int j = 0; j < dims.num_seqs; ++j) {
    const size_t first = static_cast<size_t>(table[2 * nc + static_cast<size_t>(j)]);
    if (table[first] == token_start) return j;
  }
  return -1;
}

void gdn_end_state(const void* q, const void* k, const void* v, const float* g, const float* beta,
                   const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                   const GdnCarry& carry) {
  if (dims.T == 0 || dims.num_chunks == 0 || carry.seq_out < 0) return;
  if (dt == DType::f32)
    end_state_impl<float>(static_cast<const float*>(q), static_cast<const float*>(k),
                          static_cast<const float*>(v), g, beta, table, dims, ws, carry);
  else
    end_state_impl<uint16_t>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                             static_cast<const uint16_t*>(v), g, beta, table, dims, ws, carry);
}

std::vector<int32_t> gdn_chunk_table(const int32_t* cu, int64_t nseq, GdnDims& dims) {
  std::vector<int32_t> starts, lens, order;
  std::vector<int32_t> first(static_cast<size_t>(nseq)), count(static_cast<size_t>(nseq));
  for (int64_t s = 0; s < nseq; ++s) {
    first[static_cast<size_t>(s)] = static_cast<int32_t>(starts.size());
    for (int32_t c0 = cu[s]; c0 < cu[s + 1]; c0 += kC) {
      starts.push_back(c0);
      lens.push_back(std::min(kC, cu[s + 1] - c0));
    }
    count[static_cast<size_t>(s)] =
        static_cast<int32_t>(starts.size()) - first[static_cast<size_t>(s)];
    if (count[static_cast<size_t>(s)] > 0) order.push_back(static_cast<int32_t>(s));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return count[static_cast<size_t>(a)] > count[static_cast<size_t>(b)];
  });
  BB_CHECK(order.size() <= 65535,
           "gated_delta_rule (CUDA): at most 65535 non-empty sequences per call, got ",
           order.size());
  dims.num_chunks = static_cast<int>(starts.size());
  dims.num_seqs = static_cast<int>(order.size());
  std::vector<int32_t> table(starts);
  table.insert(table.end(), lens.begin(), lens.end());
  for (int32_t s : order) table.push_back(first[static_cast<size_t>(s)]);
  for (int32_t s : order) table.push_back(count[static_cast<size_t>(s)]);
  return table;
}

size_t gdn_forward_workspace_bytes(const GdnDims& dims, DType dt) {
  return dt == DType::f32 ? forward_ws<float>(dims, false) : forward_ws<uint16_t>(dims, false);
}

size_t gdn_prep_bytes(const GdnDims& dims, DType dt) {
  return dt == DType::f32 ? forward_ws<float>(dims, true) : forward_ws<uint16_t>(dims, true);
}

void gdn_forward(void* o, const void* q, const void* k, const void* v, const float* g,
                 const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                 bool keep_prep, const GdnCarry* carry) {
  if (dims.T == 0 || dims.num_chunks == 0) return;
  if (dt == DType::f32)
    forward_impl<float>(static_cast<float*>(o), static_cast<const float*>(q),
                        static_cast<const float*>(k), static_cast<const float*>(v), g, beta, table,
                        dims, ws, keep_prep, carry);
  else
    forward_impl<uint16_t>(static_cast<uint16_t*>(o), static_cast<const uint16_t*>(q),
                           static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
                           beta, table, dims, ws, keep_prep, carry);
}

size_t gdn_backward_workspace_bytes(const GdnDims& dims, DType dt, DType do_dt, bool have_prep) {
  const bool own = do_needs_planes(dims, dt, do_dt);
  return dt == DType::f32 ? backward_ws<float>(dims, own, have_prep)
                          : backward_ws<uint16_t>(dims, own, have_prep);
}

void gdn_backward(float* dq, float* dk, float* dv, float* dg, float* dbeta, const void* d_o,
                  DType do_dt, const void* q, const void* k, const void* v, const float* g,
                  const float* beta, const int32_t* table, const GdnDims& dims, DType dt,
                  void* ws, void* prep, const GdnCarry* carry) {
  if (dims.T == 0 || dims.num_chunks == 0) return;
  if (dt == DType::f32)
    backward_impl<float>(dq, dk, dv, dg, dbeta, d_o, do_dt, static_cast<const float*>(q),
                         static_cast<const float*>(k), static_cast<const float*>(v), g, beta, table,
                         dims, dt, ws, prep, carry);
  else
    backward_impl<uint16_t>(dq, dk, dv, dg, dbeta, d_o, do_dt, static_cast<const uint16_t*>(q),
                            static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
                            beta, table, dims, dt, ws, prep, carry);
}

void set_gdn_variant(const GdnVariant& v) {
  BB_CHECK(v.vt == 0 || v.vt == 16 || v.vt == 32 || v.vt == 64, "GdnVariant: vt is 16, 32, 64 or 0, got ", v.vt);
  BB_CHECK(v.state_warps == 0 || v.state_warps == 4 || v.state_warps == 8, "GdnVariant: state_warps is 4, 8 or 0, got ",
           v.state_warps);
  BB_CHECK(v.fwd_split >= -1 && v.fwd_split <= 100, "GdnVariant: fwd_split is a percent or -1, got ", v.fwd_split);
  g_variant = v;
}

GdnVariant gdn_variant() { return g_variant; }

}  // namespace bb::cuda

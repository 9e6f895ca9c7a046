// gdn_cuda_common.cuh — what both directions of the CUDA gated delta rule share, private to
// gated_delta_rule_cuda.cu (public entry points), gated_delta_rule_fwd_cuda.cu and
// gated_delta_rule_bwd_cuda.cu: the chunk and tile constants, the device intrinsics (all PTX in
// one place), the shared-memory operand tiles and warp products, Dims; on the host the launch
// helpers, the workspace carving, the block-shape choices, the side streams, and the functions one
// file exports to the others. The design notes are at the top of gated_delta_rule_cuda.cu.
// Everything here is in namespace bb::cuda::gdn; the kernels stay in each .cu file's anonymous
// namespace.
#pragma once

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

namespace bb::cuda::gdn {

// set_gdn_variant (benchmarks and tests); the defaults in a run. Defined in
// gated_delta_rule_cuda.cu.
extern GdnVariant g_variant;

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
inline int num_sms() {
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

inline Dims make_dims(const GdnDims& g, const int32_t* table) {
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
inline dim3 chunk_grid(const Dims& d, int count = -1) {
  const int nc = count < 0 ? d.NC - d.n0 : count;
  if (d.head_fastest) return dim3(static_cast<unsigned>(static_cast<int64_t>(nc) * d.Hv));
  return dim3(static_cast<unsigned>(nc), static_cast<unsigned>(d.Hv));
}

// Value columns per state-pass block: 64 when there are enough (sequence, head) pairs to fill
// the GPU twice with them; 16 when even 32 columns would leave more than half of the SMs
// without a block (few heads over long sequences: a context-parallel rank's share of the heads,
// a call's heads at batch 1), so that the sequential passes get twice the blocks, each with half
// the work per chunk; else 32. GdnVariant::vt overrides.
inline int pick_vt(const GdnDims& g) {
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
inline int pick_state_warps(bool forward_output, int vt) {
  if (vt == 16) return 4;
  if (const int v = g_variant.state_warps; v == 4 || v == 8) return v;
  return forward_output ? 4 : 8;
}

inline unsigned blocks_for(int64_t work_items, int per_block) {
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

// The carried states of a call (GdnCarry), into its dims.
inline void apply_carry(Dims& d, const GdnCarry* c) {
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

// Side streams, one per thread, device and kind, non-blocking, created on first use: kind 0 at
// the compute stream's priority (the backward's rebuild), kind 1 at the highest (the forward's
// state pass).
struct SideStream {
  cudaStream_t s = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
SideStream& side_stream(int kind = 0);  // defined in gated_delta_rule_cuda.cu

// ---- exported by gated_delta_rule_fwd_cuda.cu (instantiated there for Tin = float and uint16_t;
// run_prep only with kStoreT = true, run_state_fwd only with kFwd = false: the backward's uses)
template <class Tin, bool kStoreT>
void run_prep(const Dims& d, const FwdBuffers& b, const Tin* q, const Tin* k, const Tin* v,
              const float* g, const float* beta);
template <class Tin, bool kFwd>
void run_state_fwd(const Dims& d, int vt, int nw, const FwdBuffers& b, Tin* o, uint16_t* hs,
                   uint16_t* dl, cudaStream_t st = stream(), const int* ready = nullptr,
                   int ready_from = 0);
template <class Tin>
size_t forward_ws(const GdnDims& g, bool with_t);
template <class Tin>
void forward_impl(Tin* o, const Tin* q, const Tin* k, const Tin* v, const float* g,
                  const float* beta, const int32_t* table, const GdnDims& gd, void* ws,
                  bool keep_prep, const GdnCarry* carry);
template <class Tin>
void end_state_impl(const Tin* q, const Tin* k, const Tin* v, const float* g, const float* beta,
                    const int32_t* table, const GdnDims& gd, void* ws, const GdnCarry& carry);

// ---- exported by gated_delta_rule_bwd_cuda.cu (instantiated there for Tin = float and uint16_t)
bool do_needs_planes(const GdnDims& g, DType dt, DType do_dt);
template <class Tin>
size_t backward_ws(const GdnDims& g, bool own_do, bool have_prep);
template <class Tin>
void backward_impl(float* dq, float* dk, float* dv, float* dg, float* dbeta, const void* d_o,
                   DType do_dt, const Tin* q, const Tin* k, const Tin* v, const float* g,
                   const float* beta, const int32_t* table, const GdnDims& gd, DType dt, void* ws,
                   void* prep, const GdnCarry* carry);
template <class Tin>
void start_grad_impl(const void* d_o, DType do_dt, const Tin* q, const Tin* k, const Tin* v, const float* g,
                     const float* beta, const int32_t* table, const GdnDims& gd, DType dt, void* ws,
                     const GdnCarry& carry);

}  // namespace bb::cuda::gdn

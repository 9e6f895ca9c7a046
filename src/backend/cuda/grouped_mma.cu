// grouped_mma.cu — the grouped GEMM tile kernel of grouped_mma.h.
//
// Why a kernel of our own: with many small problems (256-1024 rows per expert, the 8K-token MoE
// step) per-expert cuBLASLt calls are bound by the host (~8 us of enqueue each, 2E calls per
// stage) and cuBLAS's grouped GEMM stays near 300 TFLOP/s; one launch that walks a device-side
// problem table has neither limit.
//
// Layout. CTA tile BM x 128 (BM = 64 or 128), K step 64, 4 warps as 2 x 2, each warp owning a
// (BM / 2) x 64 block of C as m16n8 fragments in registers. Shared-memory tiles are stored the way
// the operand is stored in global memory, [rows][64 or more contiguous 16-bit elements], with
// the 16-byte chunks of row r XOR-swizzled by (r & 7): the cp.async writes stay row-contiguous and
// the eight 16-byte rows an ldmatrix phase reads fall in eight distinct bank groups.
//   op(A) = A   (A [M][K]): tile [BM][64],  ldmatrix         -> A fragments
//   op(A) = A^T (A [K][M]): tile [64][BM],  ldmatrix.trans   -> A fragments
//   op(B) = B^T (B [N][K]): tile [128][64], ldmatrix         -> B fragments
//   op(B) = B   (B [K][N]): tile [64][128], ldmatrix.trans   -> B fragments
// Edges: rows past M / N / K and 16-byte chunks past the contiguous extent are zero-filled by
// cp.async (src-size 0), so ragged expert sizes and a K tail (the weight gradient's row count)
// need no special path; the epilogue stores only rows < M and columns < N.
//
// Pipeline: 3 stages; K step s + 2 is in flight while step s is multiplied; one barrier per step.
// Scheduling: one CTA per output tile, problems back to back in the grid (tiles of a problem
// M-fastest so CTAs running together share a B tile in L2); a CTA finds its problem by binary
// search over the tile starts.
//
// Measured (H200, bench_experts; skills/experts.md): 289-362 TFLOP/s on the expert forward
// (37-46% of the cuBLASLt ceiling), ahead of cuBLAS's grouped GEMM and per-expert calls up to
// ~512 rows per expert, behind cuBLASLt's wgmma kernels beyond: mma.sync, not the schedule, is
// the limit. The wgrad shape (both operands through ldmatrix.trans) reaches 8-34%. On sm_90 the
// forward shape runs the wgmma kernel of grouped_wgmma_sm90a.cu instead (334-418 TFLOP/s).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/grouped_mma.h"
#include "backend/cuda/grouped_mma_device.cuh"
#include "backend/cuda/runtime.h"
#include "core/error.h"
#include "core/tensor.h"

namespace bb::cuda {
namespace {

using namespace grouped;

constexpr int kBN = 128, kBK = 64, kStages = 3, kThreads = 128;

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kBf16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of (r, c) in a [R][L] tile of 16-bit elements whose 16-byte chunks are
// XOR-swizzled by row (L >= 64, so every row has at least 8 chunks).
template <int L>
__device__ __forceinline__ int swz(int r, int c) {
  return r * L + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// One operand's tile loads, set up once per CTA: a [R][L] tile (rows of the stored matrix x L
// contiguous elements) is kPer 16-byte chunks per thread, all in one chunk column c and in rows
// r0 + i * kRowStep. kRowStep is a multiple of 8, so the swizzle of every chunk is that of r0 and
// the thread needs one global pointer, one shared offset and the row / column limits.
template <int R, int L>
struct TileLoader {
  static constexpr int kChunksRow = L / 8, kRowStep = kThreads / kChunksRow, kPer = R / kRowStep;
  static_assert(kThreads % kChunksRow == 0 && R % kRowStep == 0 && kRowStep % 8 == 0, "tile shape");
  const uint16_t* g;     // element (r0, c) of the tile at K step 0 (maybe past the matrix)
  const uint16_t* safe;  // the matrix's first element: the address of zero-filled chunks
  int64_t ld;
  int r0, c, soff;    // soff: shared offset of (r0, c), swizzled
  __device__ __forceinline__ TileLoader(const uint16_t* base, int64_t ld_, int64_t row0, int64_t col0)
      : safe(base), ld(ld_) {
    r0 = threadIdx.x / kChunksRow;
    c = (threadIdx.x % kChunksRow) * 8;
    soff = swz<L>(r0, c);
    g = base + (row0 + r0) * ld + col0 + c;
  }
  // gstep: g moved to this K step; rows_left / cols_left: rows and columns of the matrix from
  // the tile's origin at this step (chunks outside read as zero).
  __device__ __forceinline__ void load(uint16_t* s, const uint16_t* gstep, int64_t rows_left,
                                       int64_t cols_left) const {
    const bool col_ok = c < cols_left;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const bool ok = col_ok && r0 + i * kRowStep < rows_left;
      cp_async16(smem_u32(s + soff + i * kRowStep * L), ok ? gstep + i * kRowStep * ld : safe, ok);
    }
  }
};

template <int BM>
constexpr int smem_bytes() {
  return kStages * (BM * kBK + kBN * kBK) * 2;
}

// kTa: A stored [K][M] (op(A) = A^T); kTb: B stored [N][K] (op(B) = B^T). TC: C's element type.
template <bool kBf16, bool kTa, bool kTb, class TC, int BM>
__global__ void __launch_bounds__(kThreads, BM == 128 ? 2 : 3)
    grouped_mma_kernel(const MmaProblem* __restrict__ probs, const int32_t* __restrict__ starts,
                       int num_probs, int64_t lda, int64_t ldb, int64_t ldc, float alpha,
                       float beta) {
#if __CUDA_ARCH__ >= 800
  constexpr int WM = BM / 2, WN = kBN / 2, MI = WM / 16, NI = WN / 8;
  // A tile: [BM][kBK] (!kTa) or [kBK][BM] (kTa); B tile: [kBN][kBK] (kTb) or [kBK][kBN] (!kTb).
  constexpr int kATile = BM * kBK, kBTile = kBN * kBK;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* As = smem;
  uint16_t* Bs = smem + kStages * kATile;

  const TileAt at = find_tile<BM, kBN>(probs, starts, num_probs);
  const MmaProblem& p = *at.p;
  const int64_t M = p.M, N = p.N, K = p.K, m0 = at.m0, n0 = at.n0;
  const auto* A = static_cast<const uint16_t*>(p.A);
  const auto* B = static_cast<const uint16_t*>(p.B);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 1, wn = warp & 1;

  // A: [M][K] (rows m, K contiguous) or [K][M]; B: [N][K] or [K][N]. The K step moves the
  // pointer by kBK elements along the contiguous extent or kBK rows.
  using ALoad = std::conditional_t<kTa, TileLoader<kBK, BM>, TileLoader<BM, kBK>>;
  using BLoad = std::conditional_t<kTb, TileLoader<kBN, kBK>, TileLoader<kBK, kBN>>;
  const ALoad la = kTa ? ALoad(A, lda, 0, m0) : ALoad(A, lda, m0, 0);
  const BLoad lb = kTb ? BLoad(B, ldb, n0, 0) : BLoad(B, ldb, 0, n0);
  auto load_stage = [&](int stage, int64_t k0) {
    uint16_t* as = As + stage * kATile;
    uint16_t* bs = Bs + stage * kBTile;
    if constexpr (kTa) la.load(as, la.g + k0 * lda, K - k0, M - m0);
    else la.load(as, la.g + k0, M - m0, K - k0);
    if constexpr (kTb) lb.load(bs, lb.g + k0, N - n0, K - k0);
    else lb.load(bs, lb.g + k0 * ldb, K - k0, N - n0);
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const int KT = static_cast<int>((K + kBK - 1) / kBK);
  pipeline_prologue<kStages, kBK>(KT, load_stage);

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step kt landed for every thread; the stage of step kt - 1 is free
    const int nk = kt + kStages - 1;
    if (nk < KT) load_stage(nk % kStages, static_cast<int64_t>(nk) * kBK);
    cp_async_commit();

    const int stage = kt % kStages;
    const uint16_t* as = As + stage * kATile;
    const uint16_t* bs = Bs + stage * kBTile;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t a[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int mr = wm * WM + i * 16;
        if constexpr (kTa) {  // stored [k][m]: matrix j = lane / 8 is (m half j & 1, k half j >> 1)
          const int k = kk + ((lane >> 4) << 3) + (lane & 7), m = mr + (((lane >> 3) & 1) << 3);
          ldsm4t(a[i], smem_u32(as + swz<BM>(k, m)));
        } else {  // stored [m][k]
          const int m = mr + (lane & 15), k = kk + ((lane >> 4) << 3);
          ldsm4(a[i], smem_u32(as + swz<kBK>(m, k)));
        }
      }
      // B two n8 fragments (one ldmatrix.x4) at a time, each multiplied into every row block
      // right away: 4 live B registers instead of 2 NI.
#pragma unroll
      for (int j = 0; j < NI / 2; ++j) {
        const int nc = wn * WN + j * 16;
        uint32_t r[4];
        if constexpr (kTb) {  // stored [n][k]: matrix q is (n half q >> 1, k half q & 1)
          const int n = nc + ((lane >> 4) << 3) + (lane & 7), k = kk + (((lane >> 3) & 1) << 3);
          ldsm4(r, smem_u32(bs + swz<kBK>(n, k)));
        } else {  // stored [k][n]
          const int k = kk + (((lane >> 3) & 1) << 3) + (lane & 7), n = nc + ((lane >> 4) << 3);
          ldsm4t(r, smem_u32(bs + swz<kBN>(k, n)));
        }
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          mma16816<kBf16>(acc[i][2 * j], a[i], r[0], r[1]);
          mma16816<kBf16>(acc[i][2 * j + 1], a[i], r[2], r[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing may be in flight into shared memory when the CTA exits

  TC* C = static_cast<TC*>(p.C);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) {
      const int64_t col = n0 + wn * WN + j * 8 + 2 * (lane & 3);
      if (col >= N) continue;  // N % 8 == 0: col < N implies col + 1 < N
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * WM + i * 16 + (lane >> 2) + 8 * h;
        if (row >= M) continue;
        epilogue2(C + row * ldc + col, acc[i][j][2 * h], acc[i][j][2 * h + 1], alpha, beta);
      }
    }
#else
  __trap();  // the host never launches this below sm_80 (grouped_mma_refusal)
#endif
}

template <bool kBf16, bool kTa, bool kTb, class TC, int BM>
void launch(const MmaProblem* probs, const int32_t* starts, int n, int64_t tiles, int64_t lda,
            int64_t ldb, int64_t ldc, float alpha, float beta) {
  auto* kernel = grouped_mma_kernel<kBf16, kTa, kTb, TC, BM>;
  constexpr int smem = smem_bytes<BM>();
  // Per launch (a few microseconds of host time; the attribute belongs to the current device).
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
  kernel<<<static_cast<unsigned>(tiles), kThreads, smem, stream()>>>(probs, starts, n, lda, ldb,
                                                                      ldc, alpha, beta);
  BB_CHECK_LAUNCH();
}

template <bool kBf16, bool kTa, bool kTb, class TC>
void launch_tm(int tile_m, const MmaProblem* probs, const int32_t* starts, int n, int64_t tiles,
               int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta) {
  if (tile_m == 64) launch<kBf16, kTa, kTb, TC, 64>(probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
  else launch<kBf16, kTa, kTb, TC, 128>(probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
}

template <bool kBf16, class TC>
void launch_t(bool ta, bool tb, int tile_m, const MmaProblem* probs, const int32_t* starts, int n,
              int64_t tiles, int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta) {
  if (ta && tb) launch_tm<kBf16, true, true, TC>(tile_m, probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
  else if (ta) launch_tm<kBf16, true, false, TC>(tile_m, probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
  else if (tb) launch_tm<kBf16, false, true, TC>(tile_m, probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
  else launch_tm<kBf16, false, false, TC>(tile_m, probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
}

}  // namespace

std::string grouped_mma_refusal(bool ta, bool tb, const std::vector<GemmProblem>& ps, DType ab,
                                int64_t lda, int64_t ldb, DType cdt, int64_t ldc, int device) {
  if (ab != DType::bf16 && ab != DType::f16) return "inputs must be bf16 or f16";
  if (cdt != ab && cdt != DType::f32) return "the output must be the inputs' dtype or f32";
  if (lda % 8 || ldb % 8 || ldc % 8) return "every leading dimension must be a multiple of 8";
  for (const GemmProblem& p : ps) {
    if (p.M == 0 || p.N == 0) continue;  // dropped before the launch
    const int64_t a_cont = ta ? p.M : p.K, b_cont = tb ? p.K : p.N;
    if (a_cont % 8 || b_cont % 8 || p.N % 8)
      return "the contiguous extents (K or M of A, K or N of B, N of C) must be multiples of 8";
    if (!aligned(p.A, 16) || !aligned(p.B, 16) || !aligned(p.C, 16))
      return "every matrix must start 16-byte aligned";
  }
  if (compute_capability(device) < 80) return "it needs compute capability 8.0 or newer";
  return "";
}

void grouped_mma(bool ta, bool tb, const std::vector<GemmProblem>& ps, float alpha, DType ab,
                 int64_t lda, int64_t ldb, float beta, DType cdt, int64_t ldc, int device,
                 int tile_m, bool tma) {
  BB_CHECK(tile_m == 0 || tile_m == 64 || tile_m == 128, "cuda::gemm_grouped: mma tile_m = ",
           tile_m, " is not 0, 64 or 128");
  if (ps.empty()) return;
  if (tile_m == 0 && tma && grouped_tma(ta, tb, ps, alpha, ab, lda, ldb, beta, cdt, ldc, device)) return;
  const bool wgmma = tile_m == 0 && compute_capability(device) == 90 && ab == DType::bf16 && !ta && tb &&
                     (cdt == DType::bf16 || cdt == DType::f32);
  if (wgmma) tile_m = 128;
  // Measured on an H200 (bench_experts, 256-2048 rows per expert): 128-row tiles are 4-8% faster
  // for the forward and dgrad shapes, 64-row tiles 13-28% faster for the wgrad shape
  // (trans_a, both operands through ldmatrix.trans).
  if (tile_m == 0) tile_m = ta ? 64 : 128;
  std::vector<MmaProblem> mp;
  std::vector<int32_t> starts;
  int64_t tiles = 0;
  for (const GemmProblem& p : ps) {
    const int64_t tm = ceil_div(p.M, tile_m), tn = ceil_div(p.N, kBN);
    starts.push_back(static_cast<int32_t>(tiles));
    mp.push_back({p.M, p.N, p.K, p.A, p.B, p.C, static_cast<int32_t>(tm)});
    tiles += tm * tn;
    BB_CHECK(tiles < (int64_t{1} << 31) && tm < (int64_t{1} << 31), "cuda::gemm_grouped: too many tiles (", tiles,
             ") for the mma kernel");
  }
  // One upload for both tables (no host sync: staged through pinned memory).
  const size_t pb = mp.size() * sizeof(MmaProblem), sb = starts.size() * sizeof(int32_t);
  std::vector<unsigned char> host(pb + sb);
  std::copy_n(reinterpret_cast<const unsigned char*>(mp.data()), pb, host.data());
  std::copy_n(reinterpret_cast<const unsigned char*>(starts.data()), sb, host.data() + pb);
  Tensor meta = Tensor::empty({static_cast<int64_t>(host.size())}, DType::u8, Device::cuda(device),
                              MemCategory::workspace);
  cuda::memcpy(meta.raw(), Device::cuda(device), host.data(), Device::cpu(), host.size());
  const auto* dprobs = static_cast<const MmaProblem*>(meta.raw());
  const auto* dstarts = reinterpret_cast<const int32_t*>(static_cast<const unsigned char*>(meta.raw()) + pb);
  const int n = static_cast<int>(mp.size());
  if (wgmma) {
    launch_grouped_wgmma_tn(dprobs, dstarts, n, tiles, lda, ldb, ldc, alpha, beta, cdt == DType::f32);
    return;
  }
  const bool bf = ab == DType::bf16;
  if (cdt == DType::f32) {
    if (bf) launch_t<true, float>(ta, tb, tile_m, dprobs, dstarts, n, tiles, lda, ldb, ldc, alpha, beta);
    else launch_t<false, float>(ta, tb, tile_m, dprobs, dstarts, n, tiles, lda, ldb, ldc, alpha, beta);
  } else if (bf) {
    launch_t<true, __nv_bfloat16>(ta, tb, tile_m, dprobs, dstarts, n, tiles, lda, ldb, ldc, alpha, beta);
  } else {
    launch_t<false, __half>(ta, tb, tile_m, dprobs, dstarts, n, tiles, lda, ldb, ldc, alpha, beta);
  }
}

}  // namespace bb::cuda

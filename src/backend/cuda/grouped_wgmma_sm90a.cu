// grouped_wgmma_sm90a.cu — the Hopper path of the grouped GEMM tile kernel (grouped_mma.h):
// op(A) = A [M][K], op(B) = B^T with B [N][K] (both K-contiguous: the expert forward), bf16 in,
// fp32 accumulators, C bf16 or f32. Compiled for sm_90a only (wgmma is an arch-specific
// instruction; CMakeLists.txt builds this file as its own object library) and launched only on
// compute capability 9.0 devices (grouped_mma.cu checks).
//
// CTA tile 128 x 128, K step 64, 2 warpgroups of 4 warps; warpgroup w computes rows
// [64 w, +64) x 128 columns with wgmma.mma_async m64n128k16 reading both operands from shared
// memory, one K step's products in flight while the previous step's stage is refilled. The
// tiles arrive by the same 3-stage cp.async pipeline as the mma.sync kernel, stored
// [rows][64] (128-byte rows) with 16-byte chunk c of row r at chunk c ^ (r & 7): on a 1024-byte
// aligned base that is exactly wgmma's 128-byte-swizzled K-major layout (8-row atoms 1024 bytes
// apart), so the shared-memory descriptors need no other layout. Before the warpgroups read a
// stage, every thread fences its cp.async writes into the async proxy.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/grouped_mma.h"
#include "backend/cuda/grouped_mma_device.cuh"

namespace bb::cuda {
namespace {

using namespace grouped;

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256;
constexpr int kTileBytes = kBM * kBK * 2;  // A and B tiles are both 128 x 64 bf16 (16 KB)
constexpr int kSmem = kStages * 2 * kTileBytes + 1024;  // + room to align the base to 1024

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// 128 rows x 64 K-contiguous elements of a row-major matrix (ld) into a swizzled tile: each of
// the 256 threads moves 4 16-byte chunks, all in chunk column (tid % 8), rows tid / 8 + 32 i.
__device__ __forceinline__ void load_tile(uint32_t s, const uint16_t* g, const uint16_t* safe, int64_t ld,
                                          int64_t rows_left, int64_t cols_left) {
  const int r0 = threadIdx.x >> 3, c = (threadIdx.x & 7) * 8;
  const bool col_ok = c < cols_left;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + 32 * i;
    const bool ok = col_ok && r < rows_left;
    cp_async16(s + r * 128 + (((c >> 3) ^ (r & 7)) << 4), ok ? g + static_cast<int64_t>(r) * ld + c : safe, ok);
  }
}

template <class TC>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_wgmma_tn_kernel(const MmaProblem* __restrict__ probs, const int32_t* __restrict__ starts, int num_probs,
                            int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // wgmma's swizzle is on address bits: align
  const uint32_t As = base, Bs = base + kStages * kTileBytes;

  const TileAt at = find_tile<kBM, kBN>(probs, starts, num_probs);
  const MmaProblem& p = *at.p;
  const int64_t M = p.M, N = p.N, K = p.K, m0 = at.m0, n0 = at.n0;
  const auto* A = static_cast<const uint16_t*>(p.A);
  const auto* B = static_cast<const uint16_t*>(p.B);
  const uint16_t* ga = A + m0 * lda;  // row m0 of A, K step 0
  const uint16_t* gb = B + n0 * ldb;

  const int wg = threadIdx.x >> 7;  // warpgroup: rows [64 wg, +64)
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

  const int KT = static_cast<int>((K + kBK - 1) / kBK);
  auto load_stage = [&](int stage, int64_t k0) {
    load_tile(As + stage * kTileBytes, ga + k0, A, lda, M - m0, K - k0);
    load_tile(Bs + stage * kTileBytes, gb + k0, B, ldb, N - n0, K - k0);
  };
  pipeline_prologue<kStages, kBK>(KT, load_stage);
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
    __syncthreads();  // step kt landed for every thread
    const int stage = kt % kStages;
    const uint64_t da = sw128_desc(As + stage * kTileBytes + wg * 64 * 128, 16, 1024);
    const uint64_t db = sw128_desc(Bs + stage * kTileBytes, 16, 1024);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)  // +32 bytes along K per k16 step (2 in 16-byte units)
      wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk, 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // Step kt's products run while step kt - 1's are waited for and its stage is refilled.
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    __syncthreads();  // both warpgroups are done reading the stage of step kt - 1
    const int nk = kt + kStages - 1;
    if (nk < KT) load_stage(nk % kStages, static_cast<int64_t>(nk) * kBK);
    cp_async_commit();
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  cp_async_wait<0>();

  // Accumulators: warp q of the warpgroup holds rows 16 q + lane / 4 (+ 8); n8 block j in
  // acc[4 j .. 4 j + 3] as in mma.sync's m16n8 fragment.
  TC* C = static_cast<TC*>(p.C);
  const int lane = threadIdx.x & 31, q = (threadIdx.x >> 5) & 3;
  const int64_t row0 = m0 + wg * 64 + q * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t col = n0 + j * 8 + 2 * (lane & 3);
    if (col >= N) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row >= M) continue;
      epilogue2(C + row * ldc + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], alpha, beta);
    }
  }
#else
  __trap();
#endif
}

template <class TC>
void launch(const MmaProblem* probs, const int32_t* starts, int n, int64_t tiles, int64_t lda, int64_t ldb,
            int64_t ldc, float alpha, float beta) {
  auto* kernel = grouped_wgmma_tn_kernel<TC>;
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
  kernel<<<static_cast<unsigned>(tiles), kThreads, kSmem, stream()>>>(probs, starts, n, lda, ldb, ldc, alpha, beta);
  BB_CHECK_LAUNCH();
}

}  // namespace

void launch_grouped_wgmma_tn(const MmaProblem* probs, const int32_t* starts, int n, int64_t tiles, int64_t lda,
                             int64_t ldb, int64_t ldc, float alpha, float beta, bool c_f32) {
  if (c_f32) launch<float>(probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
  else launch<__nv_bfloat16>(probs, starts, n, tiles, lda, ldb, ldc, alpha, beta);
}

}  // namespace bb::cuda

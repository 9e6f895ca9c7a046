// grouped_mma.h — our grouped GEMM tile kernel (GroupedAlgo::mma of gemm.h): every problem of a
// call in one launch, one CTA per (problem, BM x 128 output tile), bf16 or f16 mma.sync
// m16n8k16 with fp32 accumulators, a 3-stage cp.async pipeline over 64-wide K steps, and
// ldmatrix (.trans for operands stored with M or N contiguous), so all four transpose
// combinations run without copies. Row-major semantics as gemm.h:
//   C_g = alpha op(A_g) op(B_g) + beta C_g
// Host-only header (no CUDA types); the kernels are in grouped_mma.cu. Internal to gemm.cu,
// which checks dtypes and drops empty problems before calling.
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/gemm.h"
#include "core/dtype.h"

namespace bb::cuda {

// Empty when the mma kernel takes the call, else why not (for the error, or for automatic to
// fall back): 16-bit inputs (bf16 or f16) with C of the same dtype or f32; every contiguous
// dimension (K for !trans_a, M for trans_a; K for trans_b, N for !trans_b; N of C), every leading
// dimension a multiple of 8 elements; every base pointer 16-byte aligned; a device of compute
// capability 8.0 or newer.
std::string grouped_mma_refusal(bool trans_a, bool trans_b, const std::vector<GemmProblem>& ps,
                                DType ab, int64_t lda, int64_t ldb, DType c_dt, int64_t ldc,
                                int device);

// Runs the problems (all with M, N > 0; checked by the caller) on cuda::stream(). tile_m: 64 or
// 128 rows per CTA tile of the mma.sync kernel; 0 = the wgmma kernel below when it applies
// (compute capability 9.0, bf16 inputs, C bf16 or f32, !trans_a && trans_b: the expert forward),
// else the mma.sync kernel with 128-row tiles, or 64-row tiles when trans_a (the wgrad shape).
void grouped_mma(bool trans_a, bool trans_b, const std::vector<GemmProblem>& ps, float alpha,
                 DType ab, int64_t lda, int64_t ldb, float beta, DType c_dt, int64_t ldc,
                 int device, int tile_m);

// The device-side problem table of both kernels (internal).
struct MmaProblem {
  int64_t M, N, K;
  const void* A;
  const void* B;
  void* C;
  int32_t tiles_m;  // M tiles of this problem; its CTAs are the M-fastest (m, n) tiles
};

// grouped_wgmma_sm90a.cu (built for sm_90a only): 128 x 128 tiles, wgmma from shared memory,
// op(A) = A [M][K], op(B) = B^T with B [N][K], bf16 inputs, C bf16 (c_f32 false) or f32.
// `starts[g]` is problem g's first CTA; `tiles` CTAs in all.
void launch_grouped_wgmma_tn(const MmaProblem* probs, const int32_t* starts, int n, int64_t tiles,
                             int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta,
                             bool c_f32);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA

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
// 128 rows per CTA tile of the mma.sync kernel; 0 = the fastest kernel that applies: the TMA
// kernel of grouped_tma_sm90a.cu when `tma` and grouped_tma_refusal is empty, else the wgmma
// kernel below when it applies (compute capability 9.0, bf16 inputs, C bf16 or f32, !trans_a &&
// trans_b: the expert forward), else the mma.sync kernel with 128-row tiles, or 64-row tiles
// when trans_a (the wgrad shape).
void grouped_mma(bool trans_a, bool trans_b, const std::vector<GemmProblem>& ps, float alpha,
                 DType ab, int64_t lda, int64_t ldb, float beta, DType c_dt, int64_t ldc,
                 int device, int tile_m, bool tma);

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

// grouped_tma_sm90a.cu (built for sm_90a only): the persistent warp-specialised kernel, TMA
// loads into 128-byte swizzled stages, wgmma m64n256k16, 128 x 256 tiles, bf16 inputs, C bf16
// or f32, in the expert shapes: A [M][K] with B [N][K] (trans_b: the forward) or B [K][N] (the
// dgrad), and A [K][M] with B [K][N] (trans_a: the wgrad, K ragged per problem). Empty when it
// takes the call, else why not: besides the dtypes and the device (compute capability 9.0),
// one tensor map per operand must cover every problem, so the problems' A (and B) must be rows
// of one matrix (their pointers a whole number of rows apart), agree on the extent that is the
// map's inner dimension (K for A [M][K] and B [N][K]; N for B [K][N]; M for A [K][M]), with K a
// multiple of 64 for the dgrad, and a tile that runs past a problem's last row must land on
// rows another problem owns or past the last problem's rows (the expert layouts: permuted rows
// back to back, weights [E][N][K] or [E][K][N]). Problems with M = 0 or N = 0 are ignored.
std::string grouped_tma_refusal(bool trans_a, bool trans_b, const std::vector<GemmProblem>& ps,
                                DType ab, int64_t lda, int64_t ldb, DType c_dt, int device);
// Runs the call on the TMA kernel (on cuda::stream()) and returns true when grouped_tma_refusal
// would be empty; else does nothing and returns false. Checks and plans once.
bool grouped_tma(bool trans_a, bool trans_b, const std::vector<GemmProblem>& ps, float alpha,
                 DType ab, int64_t lda, int64_t ldb, float beta, DType c_dt, int64_t ldc, int device);
// Calls the TMA kernel has run, process-wide (tests check which kernel a call took).
int64_t grouped_tma_calls();
// How an f32 C that the TMA kernel writes leaves the tile: -1 automatic (through the half-tile
// staging buffer when C is added to and K is short), 0 register stores, 1 the staging buffer,
// for every call. The same bits either way; tests compare the two. Process-wide.
void set_grouped_tma_f32_halves(int mode);
// Whether an f32 C that a wgrad writes (beta 0) leaves through TMA stores where the layout
// allows (default true; false: the register stores). The same bits; tests compare the two.
void set_grouped_tma_f32_store(bool on);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA

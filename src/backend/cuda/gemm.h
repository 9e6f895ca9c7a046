// gemm.h — row-major GEMM on CUDA devices through cuBLASLt (and cuBLAS for grouped GEMM).
//
//   C[M,N] = alpha * op(A) @ op(B) + beta * C          (fp32 compute and accumulation)
//   op(A) is A[M,K] (trans_a = false) or A[K,M]^T; op(B) is B[K,N] or B[N,K]^T.
// Same semantics as backend/cpu/gemm.h. Leading dimensions are those of the stored (row-major)
// matrices. Pointers are device pointers on `device`, which is made current; work is ordered on
// cuda::stream(); nothing synchronises the host.
//
// dtypes: A and B f32, bf16 or f16; C f32, bf16 or f16. Native cuBLASLt combinations
// (AB -> C): f32 -> f32, bf16 -> bf16|f32, f16 -> f16|f32. Others run through converted
// temporaries under MemCategory::workspace: A and B of different dtypes are both widened to
// f32; f32 inputs with a 16-bit C go through an f32 copy of C. f32 inputs never use TF32
// (CUBLAS_COMPUTE_32F), so f32 results match a CPU fp32 GEMM to fp32 rounding.
// beta = 0 never reads C (NaN in C is overwritten); beta = 1 accumulates (wgrad +=).
//
// Host-only header: no CUDA types. Only compiled into CUDA builds (BB_WITH_CUDA).
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace bb::cuda {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
          DType a_dt, int64_t lda, const void* B, DType b_dt, int64_t ldb, float beta, void* C,
          DType c_dt, int64_t ldc, int device);

// `batch` independent GEMMs of the same shape; matrix i of X starts at X + i * stride_x
// elements (stride 0 broadcasts one matrix). One cuBLASLt call.
void gemm_strided_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                          const void* A, DType a_dt, int64_t lda, int64_t stride_a, const void* B,
                          DType b_dt, int64_t ldb, int64_t stride_b, float beta, void* C,
                          DType c_dt, int64_t ldc, int64_t stride_c, int64_t batch, int device);

// One problem of a grouped GEMM: its own sizes and matrices (row-major, as above).
struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  const void* B = nullptr;
  void* C = nullptr;
};

// All problems in one launch: C_g = alpha op(A_g) op(B_g) + beta C_g, the same transposes,
// dtypes and leading dimensions for every g. Problems with M = 0 or N = 0 are dropped; K = 0
// gives C_g = beta C_g.
//   - AB -> C = bf16 -> bf16, f16 -> f16, f32 -> f32: cublasGemmGroupedBatchedEx (fp32 compute).
//   - bf16|f16 -> f32 with trans_a && !trans_b (the weight-gradient shape d_W += d_Y^T X):
//     cuBLAS (13.1) refuses this combination, so a WMMA tile kernel of our own runs it; CTAs are
//     mapped to (problem, 128x128 output tile). It is far slower than cuBLASLt (skills/experts.md).
//   - anything else is an error.
// The per-problem metadata travels to the device with one asynchronous copy (no host sync).
void gemm_grouped(bool trans_a, bool trans_b, const std::vector<GemmProblem>& problems, float alpha,
                  DType ab_dt, int64_t lda, int64_t ldb, float beta, DType c_dt, int64_t ldc,
                  int device);

// Drops the cached descriptors and heuristics (tests; the handle and workspace stay).
void gemm_clear_cache();
// Number of cached cuBLASLt plans (tests check that a repeated shape reuses its plan).
int64_t gemm_cache_size();

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA

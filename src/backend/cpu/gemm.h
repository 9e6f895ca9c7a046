// gemm.h — row-major GEMM on the CPU through OpenBLAS (float and double).
//
//   C[M,N] = alpha * op(A) @ op(B) + beta * C
//   op(A) is A[M,K] (trans_a = false) or A[K,M]^T; op(B) is B[K,N] or B[N,K]^T.
// Leading dimensions are those of the stored (row-major) matrices.
#pragma once

#include <cstdint>

namespace bb::cpu {

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Convenience with packed leading dimensions.
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          const T* B, T beta, T* C) {
  gemm<T>(trans_a, trans_b, M, N, K, alpha, A, trans_a ? M : K, B, trans_b ? K : N, beta, C, N);
}

}  // namespace bb::cpu

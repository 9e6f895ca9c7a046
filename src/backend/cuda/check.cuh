// check.cuh — checked CUDA calls and launch helpers for .cu files.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define BB_CHECK_CUDA(expr)                                                                  \
  do {                                                                                       \
    cudaError_t bb_err_ = (expr);                                                            \
    BB_CHECK(bb_err_ == cudaSuccess, "CUDA error in ", #expr, ": ", cudaGetErrorString(bb_err_)); \
  } while (0)

// Checks the last launch (every kernel launch goes through this).
#define BB_CHECK_LAUNCH() BB_CHECK_CUDA(cudaGetLastError())

namespace bb::cuda {
// The stream all primitives run on (one compute stream per device for now).
cudaStream_t stream();
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace bb::cuda

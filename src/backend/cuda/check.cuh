// check.cuh — checked CUDA calls and launch helpers for .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "core/stream.h"

#define BB_CHECK_CUDA(expr)                                                                  \
  do {                                                                                       \
    cudaError_t bb_err_ = (expr);                                                            \
    BB_CHECK(bb_err_ == cudaSuccess, "CUDA error in ", #expr, ": ", cudaGetErrorString(bb_err_)); \
  } while (0)

// Checks the last launch (every kernel launch goes through this).
#define BB_CHECK_LAUNCH() BB_CHECK_CUDA(cudaGetLastError())

namespace bb::cuda {
// The calling thread's current stream on its current device (core/stream.h): where every
// primitive enqueues its work. A thread-local read after the first call.
cudaStream_t stream();
// Stream `s` of device `dev` (created on first use).
cudaStream_t stream_of(int dev, Stream s);
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Whether p is a multiple of `bytes` (the precondition of the vectorised kernel paths).
inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
// Multiprocessors of the current device (asked once per device, then cached).
int sm_count();
// Compute capability of device `dev` as 10 major + minor (90 for H100/H200; asked once, cached).
int compute_capability(int dev);
// Blocks of `threads` for a grid-stride loop over `work` items: enough to cover the work, at
// most `blocks_per_sm` per multiprocessor (enough resident threads to hide memory latency).
inline unsigned grid_stride_blocks(int64_t work, int threads, int blocks_per_sm = 16) {
  const int64_t cap = int64_t{sm_count()} * blocks_per_sm;
  return static_cast<unsigned>(
      work <= 0 ? 1 : (ceil_div(work, threads) < cap ? ceil_div(work, threads) : cap));
}
}  // namespace bb::cuda

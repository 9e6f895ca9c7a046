// row_runs.cu — row_runs.h: one thread per (row, word); the row's run is found by binary search
// over the runs' prefix sums (the runs are few compared to the rows, and the table stays in L1).
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/row_runs.h"

namespace bb::cuda {
namespace {

template <class W>
__global__ void copy_row_runs_kernel(W* dst, const W* src, const int32_t* table, int64_t R, int64_t total_rows,
                                     int64_t words) {
  const int32_t* start = table;
  const int32_t* drow = table + R + 1;
  const int32_t* srow = drow + R;
  const int64_t total = total_rows * words, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / words, w = i - row * words;
    int64_t lo = 0, hi = R - 1;  // the last run whose start <= row
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (start[mid] <= row) lo = mid; else hi = mid - 1;
    }
    const int64_t off = row - start[lo];
    dst[(drow[lo] + off) * words + w] = src[(srow[lo] + off) * words + w];
  }
}

}  // namespace

void copy_row_runs(void* dst, const void* src, const int32_t* table, int64_t num_runs, int64_t total_rows,
                   int64_t row_bytes) {
  if (num_runs == 0 || total_rows == 0 || row_bytes == 0) return;
  constexpr int kThreads = 256;
  const bool v16 = row_bytes % 16 == 0 && aligned(dst, 16) && aligned(src, 16);
  const bool v4 = row_bytes % 4 == 0 && aligned(dst, 4) && aligned(src, 4);
  const int64_t word = v16 ? 16 : v4 ? 4 : 2;
  const int64_t words = row_bytes / word;
  const unsigned blocks = grid_stride_blocks(total_rows * words, kThreads);
  if (v16)
    copy_row_runs_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src),
                                                            table, num_runs, total_rows, words);
  else if (v4)
    copy_row_runs_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<uint32_t*>(dst),
                                                            static_cast<const uint32_t*>(src), table, num_runs,
                                                            total_rows, words);
  else
    copy_row_runs_kernel<<<blocks, kThreads, 0, stream()>>>(static_cast<uint16_t*>(dst),
                                                            static_cast<const uint16_t*>(src), table, num_runs,
                                                            total_rows, words);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

// embedding_cuda.cu — embedding lookup (row gather) and its deterministic backward.
//
// Forward: one block per token copies its table row in the widest unit (16, 4 or 2 bytes) that
// the row size and pointers allow; it is a byte copy, so any dtype works and y equals the
// table bit for bit. Backward: the host groups the batch by id (sorted, ascending t inside a
// group), so each d_table row is owned by one block column that adds its tokens' rows in order:
// deterministic, no float atomics, no contention on frequent ids.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/embedding/embedding_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 128;

// y row t <- table row ids[t]; rows of `units` elements of type U.
template <class U>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(U* __restrict__ y, const U* __restrict__ table,
                       const int32_t* __restrict__ ids, int64_t units) {
  const int64_t t = blockIdx.x;
  const U* src = table + static_cast<int64_t>(ids[t]) * units;
  U* dst = y + t * units;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) dst[i] = src[i];
}

// Block (u, c): columns [c * kThreads * N, ...) of group u.
template <class TD, int N>
__global__ void __launch_bounds__(kThreads)
    scatter_add_kernel(float* __restrict__ d_table, const TD* __restrict__ d_y,
                       const int32_t* __restrict__ order, const int32_t* __restrict__ seg_start,
                       const int32_t* __restrict__ seg_id, int64_t H) {
  const int64_t u = blockIdx.x;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * N;
  if (col >= H) return;
  float* row = d_table + static_cast<int64_t>(seg_id[u]) * H + col;
  float acc[N];
  load<float, N>(row, acc);
  for (int32_t k = seg_start[u]; k < seg_start[u + 1]; ++k) {
    float dv[N];
    load<TD, N>(d_y + static_cast<int64_t>(order[k]) * H + col, dv);
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] += dv[j];
  }
  store<float, N>(row, acc);
}

template <class U>
void launch_gather(void* y, const void* table, const int32_t* ids, int64_t T, int64_t row_bytes) {
  gather_rows_kernel<U><<<static_cast<unsigned>(T), kThreads, 0, stream()>>>(
      static_cast<U*>(y), static_cast<const U*>(table), ids,
      row_bytes / static_cast<int64_t>(sizeof(U)));
  BB_CHECK_LAUNCH();
}

template <class TD, int N>
void launch_scatter(float* d_table, const void* d_y, const int32_t* order, const int32_t* seg_start,
                    const int32_t* seg_id, int64_t U, int64_t H) {
  const dim3 grid(static_cast<unsigned>(U),
                  static_cast<unsigned>(ceil_div(ceil_div(H, N), kThreads)));
  scatter_add_kernel<TD, N><<<grid, kThreads, 0, stream()>>>(
      d_table, static_cast<const TD*>(d_y), order, seg_start, seg_id, H);
  BB_CHECK_LAUNCH();
}

template <class TD>
void dispatch_scatter(float* d_table, const void* d_y, const int32_t* order,
                      const int32_t* seg_start, const int32_t* seg_id, int64_t U, int64_t H) {
  constexpr int N = 16 / sizeof(TD);
  // d_table's rows take N f32 (16 or 32 bytes): 16-byte alignment of every row is enough.
  if (H % N == 0 && aligned(d_table, 16) && aligned(d_y, 16))
    launch_scatter<TD, N>(d_table, d_y, order, seg_start, seg_id, U, H);
  else
    launch_scatter<TD, 1>(d_table, d_y, order, seg_start, seg_id, U, H);
}

}  // namespace

void embedding_forward(void* y, const void* table, const int32_t* ids, int64_t T,
                       int64_t row_bytes) {
  if (T == 0 || row_bytes == 0) return;
  if (row_bytes % 16 == 0 && aligned(y, 16) && aligned(table, 16))
    launch_gather<uint4>(y, table, ids, T, row_bytes);
  else if (row_bytes % 4 == 0 && aligned(y, 4) && aligned(table, 4))
    launch_gather<uint32_t>(y, table, ids, T, row_bytes);
  else
    launch_gather<uint16_t>(y, table, ids, T, row_bytes);
}

void embedding_backward(float* d_table, const void* d_y, DType dy_dtype, const int32_t* order,
                        const int32_t* seg_start, const int32_t* seg_id, int64_t U, int64_t H) {
  if (U == 0 || H == 0) return;
  if (dy_dtype == DType::bf16)
    dispatch_scatter<bf16_t>(d_table, d_y, order, seg_start, seg_id, U, H);
  else
    dispatch_scatter<float>(d_table, d_y, order, seg_start, seg_id, U, H);
}

}  // namespace bb::cuda

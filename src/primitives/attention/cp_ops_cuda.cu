// cp_ops_cuda.cu — the context-parallel data movements (cp_ops.h) on the GPU: grid-stride
// loops over the destination elements; copies move 2- or 4-byte words (the head split / join:
// 16-byte words, a warp a row, whenever rows and pointers allow), the merge and the adds compute
// in fp32.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/attention/cp_ops_cuda.h"

namespace bb::cuda::cp {
namespace {

constexpr int kThreads = 256;

template <class W>
__global__ void gather_rows_kernel(W* out, const W* src, const int32_t* rows, int64_t n, int64_t re) {
  const int64_t total = n * re, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / re, j = i - r * re;
    out[i] = src[static_cast<int64_t>(rows[r]) * re + j];
  }
}

template <class TS>
__global__ void scatter_add_kernel(float* dst, const TS* src, const int32_t* rows, int64_t n, int64_t W) {
  const int64_t total = n * W, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / W, j = i - r * W;
    dst[static_cast<int64_t>(rows[r]) * W + j] += to_f32(src[i]);
  }
}

__global__ void gather_cols_kernel(float* out, const float* lse, const int32_t* rows, int64_t H, int64_t T,
                                   int64_t n) {
  const int64_t total = H * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t h = i / n, c = i - h * n;
    out[i] = lse[h * T + rows[c]];
  }
}

// One warp per (row i, head h): the weights from the two log-sum-exps, then D elements.
template <class TP>
__global__ void merge_kernel(float* o_acc, float* lse_acc, const TP* o_p, const float* lse_p, const int32_t* rows,
                             int64_t n, int64_t T, int64_t H, int64_t D) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; w < n * H; w += warps) {
    const int64_t i = w / H, h = w - i * H, r = rows[i];
    const float l1 = lse_acc[h * T + r], l2 = lse_p[h * n + i];
    const float m = fmaxf(l1, l2);
    if (m == -INFINITY) continue;
    const float w1 = l1 == -INFINITY ? 0.f : __expf(l1 - m), w2 = l2 == -INFINITY ? 0.f : __expf(l2 - m);
    float* a = o_acc + (r * H + h) * D;
    const TP* p = o_p + (i * H + h) * D;
    const float sum = w1 + w2, inv = 1.f / sum;  // the weights of the merged softmax: e^(l - L)
    for (int64_t d = lane; d < D; d += 32) a[d] = (w1 * a[d] + w2 * to_f32(p[d])) * inv;
    __syncwarp();
    if (lane == 0) lse_acc[h * T + r] = m + logf(sum);
  }
}

template <class W>
__global__ void split_heads_kernel(W* out, const W* src, const int32_t* start, int64_t P, int64_t T, int64_t H,
                                   int64_t hc, int64_t D) {
  const int64_t per = hc * D, total = P * T * per, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t pt = i / per, j = i - pt * per, p = pt / T, t = pt - p * T;
    out[i] = src[(t * H + start[p]) * D + j];
  }
}

// The same moves with a warp per (block, token) row of hc D elements, in 16-byte words: dv = D
// in words, rv = hc D in words (both whole). One division a row instead of two an element: the
// element kernels above run at about a third of the copy rate (measured on an H200 in the Gated
// DeltaNet head groups).
template <bool kJoin>
__global__ void heads_rows_kernel(uint4* blocks, uint4* full, const int32_t* start, int64_t P,
                                  int64_t T, int64_t H, int64_t rv, int64_t dv) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = P * T, warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5; row < rows;
       row += warps) {
    const int64_t p = row / T, t = row - p * T;
    uint4* b = blocks + row * rv;
    uint4* f = full + (t * H + start[p]) * dv;
    for (int64_t j = lane; j < rv; j += 32) {
      if constexpr (kJoin)
        f[j] = b[j];
      else
        b[j] = f[j];
    }
  }
}

// Whether the row kernel serves: rows and the head stride whole 16-byte words, pointers aligned.
bool heads_rows_ok(const void* a, const void* b, int elem_bytes, int64_t hc, int64_t D) {
  const int64_t row = hc * D * elem_bytes, head = D * elem_bytes;
  return row % 16 == 0 && head % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

template <class W>
__global__ void join_heads_kernel(W* dst, const W* src, const int32_t* start, int64_t P, int64_t T, int64_t H,
                                  int64_t hc, int64_t D) {
  const int64_t per = hc * D, total = P * T * per, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t pt = i / per, j = i - pt * per, p = pt / T, t = pt - p * T;
    dst[(t * H + start[p]) * D + j] = src[i];
  }
}

// Accumulating: one peer's block per launch, so blocks with overlapping head ranges never race.
template <class TS>
__global__ void join_heads_add_kernel(float* dst, const TS* src, int64_t start, int64_t T, int64_t H, int64_t hc,
                                      int64_t D) {
  const int64_t per = hc * D, total = T * per, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / per, j = i - t * per;
    dst[(t * H + start) * D + j] += to_f32(src[i]);
  }
}

unsigned blocks(int64_t work) { return grid_stride_blocks(work, kThreads); }

}  // namespace

void gather_rows(void* out, const void* src, const int32_t* rows, int64_t n, int64_t row_elems, int elem_bytes) {
  if (elem_bytes == 4)
    gather_rows_kernel<<<blocks(n * row_elems), kThreads, 0, stream()>>>(
        static_cast<uint32_t*>(out), static_cast<const uint32_t*>(src), rows, n, row_elems);
  else
    gather_rows_kernel<<<blocks(n * row_elems), kThreads, 0, stream()>>>(
        static_cast<uint16_t*>(out), static_cast<const uint16_t*>(src), rows, n, row_elems);
  BB_CHECK_LAUNCH();
}

void scatter_add_rows(float* dst, const void* src, DType src_dtype, const int32_t* rows, int64_t n, int64_t W) {
  if (src_dtype == DType::bf16)
    scatter_add_kernel<<<blocks(n * W), kThreads, 0, stream()>>>(dst, static_cast<const bf16_t*>(src), rows, n, W);
  else
    scatter_add_kernel<<<blocks(n * W), kThreads, 0, stream()>>>(dst, static_cast<const float*>(src), rows, n, W);
  BB_CHECK_LAUNCH();
}

void gather_cols(float* out, const float* lse, const int32_t* rows, int64_t H, int64_t T, int64_t n) {
  gather_cols_kernel<<<blocks(H * n), kThreads, 0, stream()>>>(out, lse, rows, H, T, n);
  BB_CHECK_LAUNCH();
}

void merge_partial(float* o_acc, float* lse_acc, const void* o_p, DType p_dtype, const float* lse_p,
                   const int32_t* rows, int64_t n, int64_t T, int64_t H, int64_t D) {
  const unsigned g = grid_stride_blocks(n * H * 32, kThreads);
  if (p_dtype == DType::bf16)
    merge_kernel<<<g, kThreads, 0, stream()>>>(o_acc, lse_acc, static_cast<const bf16_t*>(o_p), lse_p, rows, n, T, H, D);
  else
    merge_kernel<<<g, kThreads, 0, stream()>>>(o_acc, lse_acc, static_cast<const float*>(o_p), lse_p, rows, n, T, H, D);
  BB_CHECK_LAUNCH();
}

void split_heads(void* out, const void* src, int elem_bytes, const int32_t* start, int64_t P, int64_t T, int64_t H,
                 int64_t hc, int64_t D) {
  const int64_t work = P * T * hc * D;
  if (heads_rows_ok(out, src, elem_bytes, hc, D)) {
    const int64_t dv = D * elem_bytes / 16;
    heads_rows_kernel<false><<<blocks(P * T * 32), kThreads, 0, stream()>>>(
        static_cast<uint4*>(out), static_cast<uint4*>(const_cast<void*>(src)), start, P, T, H, hc * dv, dv);
  } else if (elem_bytes == 4)
    split_heads_kernel<<<blocks(work), kThreads, 0, stream()>>>(static_cast<uint32_t*>(out),
                                                                static_cast<const uint32_t*>(src), start, P, T, H, hc, D);
  else
    split_heads_kernel<<<blocks(work), kThreads, 0, stream()>>>(static_cast<uint16_t*>(out),
                                                                static_cast<const uint16_t*>(src), start, P, T, H, hc, D);
  BB_CHECK_LAUNCH();
}

void join_heads(void* dst, const void* src, int elem_bytes, const int32_t* start, int64_t P, int64_t T, int64_t H,
                int64_t hc, int64_t D) {
  const int64_t work = P * T * hc * D;
  if (heads_rows_ok(dst, src, elem_bytes, hc, D)) {
    const int64_t dv = D * elem_bytes / 16;
    heads_rows_kernel<true><<<blocks(P * T * 32), kThreads, 0, stream()>>>(
        static_cast<uint4*>(const_cast<void*>(src)), static_cast<uint4*>(dst), start, P, T, H, hc * dv, dv);
  } else if (elem_bytes == 4)
    join_heads_kernel<<<blocks(work), kThreads, 0, stream()>>>(static_cast<uint32_t*>(dst),
                                                               static_cast<const uint32_t*>(src), start, P, T, H, hc, D);
  else
    join_heads_kernel<<<blocks(work), kThreads, 0, stream()>>>(static_cast<uint16_t*>(dst),
                                                               static_cast<const uint16_t*>(src), start, P, T, H, hc, D);
  BB_CHECK_LAUNCH();
}

void join_heads_add(float* dst, const void* src, DType src_dtype, int64_t start, int64_t T, int64_t H, int64_t hc,
                    int64_t D) {
  const int64_t work = T * hc * D;
  if (src_dtype == DType::bf16)
    join_heads_add_kernel<<<blocks(work), kThreads, 0, stream()>>>(dst, static_cast<const bf16_t*>(src), start, T, H,
                                                                   hc, D);
  else
    join_heads_add_kernel<<<blocks(work), kThreads, 0, stream()>>>(dst, static_cast<const float*>(src), start, T, H,
                                                                   hc, D);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda::cp

// experts_cuda.cu — row scaling by the routing probability and its backward, for the expert MLPs
// when row_prob is given (memory_efficient permute).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "primitives/moe/experts_cuda.h"

namespace bb::cuda {

namespace {


template <class T>
__global__ void scale_rows_kernel(T* out, const T* act, const float* row_prob, int64_t N,
                                  int64_t F) {
  const int64_t n = N * F;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_f(out, i, row_prob[i / F] * load_f(act, i));
}

constexpr int kRowsPerBlock = 8;  // one warp per row

template <class T>
__global__ void prob_backward_kernel(float* d_row_prob, T* d_a, const T* act, const float* row_prob,
                                     int64_t N, int64_t F) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const int64_t base = row * F;
  float dot = 0.0f;
  for (int64_t j = lane; j < F; j += 32) dot += load_f(d_a, base + j) * load_f(act, base + j);
  for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  const float p = row_prob[row];
  for (int64_t j = lane; j < F; j += 32) store_f(d_a, base + j, p * load_f(d_a, base + j));
  if (lane == 0) d_row_prob[row] = dot;
}

}  // namespace

void experts_scale_rows(void* out, const void* act, DType dt, const float* row_prob, int64_t N,
                        int64_t F, int device) {
  if (N * F == 0) return;
  cuda::set_device(device);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(N * F, threads), 8192));
  switch (dt) {
    case DType::f32:
      scale_rows_kernel<<<blocks, threads, 0, stream()>>>(
          static_cast<float*>(out), static_cast<const float*>(act), row_prob, N, F);
      break;
    case DType::bf16:
      scale_rows_kernel<<<blocks, threads, 0, stream()>>>(
          static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(act), row_prob, N, F);
      break;
    case DType::f16:
      scale_rows_kernel<<<blocks, threads, 0, stream()>>>(
          static_cast<__half*>(out), static_cast<const __half*>(act), row_prob, N, F);
      break;
    default:
      BB_FAIL("experts_scale_rows: dtype ", dtype_name(dt), " is not a float type");
  }
  BB_CHECK_LAUNCH();
}

void experts_prob_backward(float* d_row_prob, void* d_a, const void* act, DType dt,
                           const float* row_prob, int64_t N, int64_t F, int device) {
  if (N == 0) return;
  cuda::set_device(device);
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  const int threads = 32 * kRowsPerBlock;
  switch (dt) {
    case DType::f32:
      prob_backward_kernel<<<blocks, threads, 0, stream()>>>(
          d_row_prob, static_cast<float*>(d_a), static_cast<const float*>(act), row_prob, N, F);
      break;
    case DType::bf16:
      prob_backward_kernel<<<blocks, threads, 0, stream()>>>(
          d_row_prob, static_cast<__nv_bfloat16*>(d_a), static_cast<const __nv_bfloat16*>(act),
          row_prob, N, F);
      break;
    case DType::f16:
      prob_backward_kernel<<<blocks, threads, 0, stream()>>>(
          d_row_prob, static_cast<__half*>(d_a), static_cast<const __half*>(act), row_prob, N, F);
      break;
    default:
      BB_FAIL("experts_prob_backward: dtype ", dtype_name(dt), " is not a float type");
  }
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

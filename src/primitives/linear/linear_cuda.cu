// linear_cuda.cu — bias broadcast (forward) and bias gradient (column sums) for linear on CUDA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "primitives/linear/linear_cuda.h"

namespace bb::cuda {

namespace {


template <class TY, class TB>
__global__ void bias_broadcast_kernel(TY* y, const TB* bias, int64_t T, int64_t O) {
  const int64_t n = T * O;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_f(y, i, load_f(bias, i % O));
}

// blockDim (32, 8): threadIdx.x picks the column, threadIdx.y strides over rows; the 8 partial
// sums of a column are added in a fixed order.
template <class TD>
__global__ void bias_grad_kernel(float* d_bias, const TD* d_y, int64_t T, int64_t O) {
  __shared__ float part[8][33];
  const int64_t o = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (o < O)
    for (int64_t t = threadIdx.y; t < T; t += 8) s += load_f(d_y, t * O + o);
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && o < O) {
    float total = 0.0f;
    for (int r = 0; r < 8; ++r) total += part[r][threadIdx.x];
    d_bias[o] += total;
  }
}

template <class TY>
void broadcast_to(TY* y, const void* bias, DType b_dt, int64_t T, int64_t O) {
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(T * O, threads), 8192));
  switch (b_dt) {
    case DType::f32:
      bias_broadcast_kernel<<<blocks, threads, 0, stream()>>>(y, static_cast<const float*>(bias), T,
                                                              O);
      break;
    case DType::bf16:
      bias_broadcast_kernel<<<blocks, threads, 0, stream()>>>(
          y, static_cast<const __nv_bfloat16*>(bias), T, O);
      break;
    case DType::f16:
      bias_broadcast_kernel<<<blocks, threads, 0, stream()>>>(y, static_cast<const __half*>(bias),
                                                              T, O);
      break;
    default:
      BB_FAIL("linear_bias_broadcast: bias dtype ", dtype_name(b_dt), " is not a float type");
  }
  BB_CHECK_LAUNCH();
}

}  // namespace

void linear_bias_broadcast(void* y, DType y_dt, const void* bias, DType b_dt, int64_t T, int64_t O,
                           int device) {
  if (T * O == 0) return;
  cuda::set_device(device);
  switch (y_dt) {
    case DType::f32:
      broadcast_to(static_cast<float*>(y), bias, b_dt, T, O);
      break;
    case DType::bf16:
      broadcast_to(static_cast<__nv_bfloat16*>(y), bias, b_dt, T, O);
      break;
    case DType::f16:
      broadcast_to(static_cast<__half*>(y), bias, b_dt, T, O);
      break;
    default:
      BB_FAIL("linear_bias_broadcast: y dtype ", dtype_name(y_dt), " is not a float type");
  }
}

void linear_bias_grad(float* d_bias, const void* d_y, DType dy_dt, int64_t T, int64_t O,
                      int device) {
  if (O == 0) return;
  cuda::set_device(device);
  const dim3 block(32, 8);
  const unsigned grid = static_cast<unsigned>(ceil_div(O, 32));
  switch (dy_dt) {
    case DType::f32:
      bias_grad_kernel<<<grid, block, 0, stream()>>>(d_bias, static_cast<const float*>(d_y), T, O);
      break;
    case DType::bf16:
      bias_grad_kernel<<<grid, block, 0, stream()>>>(d_bias, static_cast<const __nv_bfloat16*>(d_y),
                                                     T, O);
      break;
    case DType::f16:
      bias_grad_kernel<<<grid, block, 0, stream()>>>(d_bias, static_cast<const __half*>(d_y), T, O);
      break;
    default:
      BB_FAIL("linear_bias_grad: d_y dtype ", dtype_name(dy_dt), " is not a float type");
  }
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

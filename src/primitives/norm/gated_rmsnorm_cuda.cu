// gated_rmsnorm_cuda.cu — gated RMSNorm (norm(x) * silu(z), per head) forward and backward.
//
// One warp per row (a head vector; D = 128 in Qwen3.5), 8 warps per block, a grid-stride loop
// over rows with a grid that depends only on the device and the row count. Each lane keeps its
// columns' elements in registers between the two passes over the row (the sum of squares, then
// the output), so x and z are read once. The weight is staged as f32 in shared memory.
//
// d_w without float atomics: every warp sums u * xhat for its lanes' columns over its rows into
// its own shared-memory row; the block adds its 8 warp rows in order into one partial row per
// block (global workspace); a second kernel adds the blocks in order. The result depends only on
// the grid size, which is fixed for a device and a shape.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "primitives/norm/gated_rmsnorm_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPerLane = 8;  // row elements per lane kept in registers (D <= 256); wider rows loop

__device__ __forceinline__ float ld(const void* p, bool bf16, int64_t i) {
  return bf16 ? to_f32(static_cast<const bf16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + __expf(-z)); }

__global__ void __launch_bounds__(kThreads)
    fwd_kernel(void* __restrict__ y, const void* __restrict__ x, bool xb, const void* __restrict__ z,
               bool zb, const void* __restrict__ w, bool wb, int64_t rows, int D, float eps) {
  extern __shared__ float w_s[];  // [D]
  for (int i = threadIdx.x; i < D; i += blockDim.x) w_s[i] = ld(w, wb, i);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * D;
    float xv[kPerLane];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = lane + 32 * j;
      xv[j] = c < D ? ld(x, xb, base + c) : 0.f;
      ss += xv[j] * xv[j];
    }
    for (int c = lane + 32 * kPerLane; c < D; c += 32) {
      const float v = ld(x, xb, base + c);
      ss += v * v;
    }
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(D) + eps);
    auto out = [&](int c, float xc) {
      const float zc = ld(z, zb, base + c);
      const float v = w_s[c] * (xc * r) * (zc * sigmoidf(zc));
      if (xb)
        static_cast<bf16_t*>(y)[base + c] = from_f32<bf16_t>(v);
      else
        static_cast<float*>(y)[base + c] = v;
    };
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < D) out(lane + 32 * j, xv[j]);
    for (int c = lane + 32 * kPerLane; c < D; c += 32) out(c, ld(x, xb, base + c));
  }
}

// partial [gridDim.x, D]: this block's d_w share.
__global__ void __launch_bounds__(kThreads)
    bwd_kernel(float* __restrict__ dx, float* __restrict__ dz, float* __restrict__ partial,
               const void* __restrict__ dy, bool db, const void* __restrict__ x, bool xb,
               const void* __restrict__ z, bool zb, const void* __restrict__ w, bool wb,
               int64_t rows, int D, float eps) {
  extern __shared__ float smem[];
  float* w_s = smem;           // [D]
  float* dw_s = smem + D;      // [kWarps, D]
  for (int i = threadIdx.x; i < D; i += blockDim.x) w_s[i] = ld(w, wb, i);
  for (int i = threadIdx.x; i < kWarps * D; i += blockDim.x) dw_s[i] = 0.f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* my_dw = dw_s + warp * D;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * D;
    float ss = 0.f;
    for (int c = lane; c < D; c += 32) {
      const float v = ld(x, xb, base + c);
      ss += v * v;
    }
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(D) + eps);
    // u = dy * silu(z): what the plain norm sees as its incoming gradient.
    float dot = 0.f;
    for (int c = lane; c < D; c += 32) {
      const float zc = ld(z, zb, base + c);
      const float u = ld(dy, db, base + c) * zc * sigmoidf(zc);
      dot += u * w_s[c] * ld(x, xb, base + c) * r;
    }
    const float mean = warp_sum(dot) / static_cast<float>(D);
    for (int c = lane; c < D; c += 32) {
      const float zc = ld(z, zb, base + c), dyc = ld(dy, db, base + c);
      const float s = sigmoidf(zc);
      const float xh = ld(x, xb, base + c) * r, u = dyc * zc * s;
      my_dw[c] += u * xh;
      dx[base + c] = r * (u * w_s[c] - xh * mean);
      dz[base + c] = dyc * w_s[c] * xh * (s * (1.0f + zc * (1.0f - s)));
    }
  }
  __syncthreads();
  float* pr = partial + static_cast<int64_t>(blockIdx.x) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float t = 0.f;
    for (int k = 0; k < kWarps; ++k) t += dw_s[k * D + c];
    pr[c] = t;
  }
}

__global__ void dw_reduce_kernel(float* __restrict__ dw, const float* __restrict__ partial, int blocks,
                                 int D) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float t = 0.f;
  for (int b = 0; b < blocks; ++b) t += partial[static_cast<int64_t>(b) * D + c];
  dw[c] += t;
}

int64_t grid_for(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, kWarps), int64_t{sm_count()} * 8));
}

void smem_opt_in(const void* kernel, size_t bytes, int64_t D) {
  if (bytes <= 48 * 1024) return;
  int max_optin = 0;
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
  BB_CHECK(bytes <= static_cast<size_t>(max_optin), "gated_rmsnorm: head dim ", D, " needs ", bytes,
           " bytes of shared memory, the device allows ", max_optin);
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

void gated_rmsnorm_forward(void* y, const void* x, DType x_dtype, const void* z, DType z_dtype,
                           const void* w, DType w_dtype, int64_t rows, int64_t D, float eps) {
  if (rows == 0) return;
  const size_t smem = static_cast<size_t>(D) * sizeof(float);
  smem_opt_in(reinterpret_cast<const void*>(fwd_kernel), smem, D);
  fwd_kernel<<<static_cast<unsigned>(grid_for(rows)), kThreads, smem, stream()>>>(
      y, x, x_dtype == DType::bf16, z, z_dtype == DType::bf16, w, w_dtype == DType::bf16, rows,
      static_cast<int>(D), eps);
  BB_CHECK_LAUNCH();
}

int64_t gated_rmsnorm_backward_workspace(int64_t rows, int64_t D) { return grid_for(rows) * D; }

void gated_rmsnorm_backward(float* dx, float* dz, float* dw, float* workspace, const void* dy,
                            DType dy_dtype, const void* x, DType x_dtype, const void* z,
                            DType z_dtype, const void* w, DType w_dtype, int64_t rows, int64_t D,
                            float eps) {
  if (rows == 0) return;
  const int64_t blocks = grid_for(rows);
  const size_t smem = static_cast<size_t>(D) * (1 + kWarps) * sizeof(float);
  smem_opt_in(reinterpret_cast<const void*>(bwd_kernel), smem, D);
  bwd_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream()>>>(
      dx, dz, workspace, dy, dy_dtype == DType::bf16, x, x_dtype == DType::bf16, z,
      z_dtype == DType::bf16, w, w_dtype == DType::bf16, rows, static_cast<int>(D), eps);
  BB_CHECK_LAUNCH();
  dw_reduce_kernel<<<static_cast<unsigned>(ceil_div(D, 128)), 128, 0, stream()>>>(
      dw, workspace, static_cast<int>(blocks), static_cast<int>(D));
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

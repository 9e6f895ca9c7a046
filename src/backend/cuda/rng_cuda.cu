// rng_cuda.cu — Philox fills on the device: the same numbers as the host fill (core/rng.h)
// for the same (seed, offset), so initialisation does not depend on where it runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/check.cuh"
#include "backend/cuda/rng_cuda.h"
#include "core/rng.h"

namespace bb::cuda {

namespace {
template <class T>
__device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, uint64_t offset, float a, float b, bool normal) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Same formulas as the host: uniform lo + (hi-lo) u, normal mean + std z.
    const float v = normal ? a + b * philox_normal(seed, offset + static_cast<uint64_t>(i))
                           : a + (b - a) * philox_uniform(seed, offset + static_cast<uint64_t>(i));
    p[i] = from_float<T>(v);
  }
}

template <class T>
void launch(void* p, int64_t n, uint64_t seed, uint64_t offset, float a, float b, bool normal) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 4096));
  fill_kernel<T><<<blocks, threads, 0, stream()>>>(static_cast<T*>(p), n, seed, offset, a, b, normal);
  BB_CHECK_LAUNCH();
}
}  // namespace

void fill_random(void* p, DType dt, int64_t n, uint64_t seed, uint64_t offset, float a, float b, bool normal) {
  switch (dt) {
    case DType::f32: launch<float>(p, n, seed, offset, a, b, normal); break;
    case DType::bf16: launch<__nv_bfloat16>(p, n, seed, offset, a, b, normal); break;
    case DType::f16: launch<__half>(p, n, seed, offset, a, b, normal); break;
    default: BB_FAIL("fill_random: dtype ", dtype_name(dt), " is not a float type");
  }
}

}  // namespace bb::cuda

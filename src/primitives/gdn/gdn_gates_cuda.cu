// gdn_gates_cuda.cu — Gated DeltaNet gates: g = -exp(A_log) softplus(a + dt), beta = sigmoid(b).
//
// Forward: one thread per (token, head) element, grid-stride. Backward: the elementwise part
// the same way, plus the per-head sums over tokens (d_A_log = sum d_g g, d_dt = sum d_u)
// without float atomics: block j of the first kernel owns a fixed token range and writes its
// per-head partial sums (a shared-memory tree over the block's threads, fixed order) to
// workspace[j, 2 Hv]; a second kernel adds the blocks in order. The result depends only on the
// shape, not on scheduling.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/gdn/gdn_gates_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerBlock = 256;  // backward: tokens whose head sums one block owns

__device__ __forceinline__ float ldf(const void* p, bool bf16, int64_t i) {
  return bf16 ? to_f32(static_cast<const bf16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
// Accurate forms (not the __expf intrinsics): g feeds an exp inside the recurrence, and the
// CPU reference uses the libm functions.
__device__ __forceinline__ float softplus_f(float u) { return u > 20.f ? u : log1pf(expf(u)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

__global__ void gates_fwd_kernel(float* __restrict__ g, float* __restrict__ beta, const void* __restrict__ a,
                                 bool ab, const void* __restrict__ b, bool bb16, const float* __restrict__ a_log,
                                 const float* __restrict__ dt, int64_t n, int Hv) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % Hv);
    g[i] = -expf(a_log[h]) * softplus_f(ldf(a, ab, i) + dt[h]);
    beta[i] = sigmoid_f(ldf(b, bb16, i));
  }
}

// Block j: tokens [j * kTokensPerBlock, ...). Thread layout: Hv <= 1024 heads; each thread
// handles head (tid % Hv) for token rows tid / Hv, tid / Hv + per, ... inside the block's range.
// Partial sums go through shared memory in a fixed order.
__global__ void gates_bwd_kernel(float* __restrict__ d_a, float* __restrict__ d_b, float* __restrict__ partial,
                                 const float* __restrict__ d_g, const float* __restrict__ d_beta,
                                 const void* __restrict__ a, bool ab, const float* __restrict__ g,
                                 const float* __restrict__ beta, const float* __restrict__ a_log,
                                 const float* __restrict__ dt, int64_t rows, int Hv) {
  extern __shared__ float sm[];  // [2, threads]
  const int per = max(1, static_cast<int>(blockDim.x) / Hv);  // token lanes per head
  const int h = threadIdx.x % Hv, lane = threadIdx.x / Hv;
  const bool active = lane < per && threadIdx.x < per * Hv;
  float s_alog = 0.f, s_dt = 0.f;
  if (active) {
    const float e = expf(a_log[h]);
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock;
    const int64_t t1 = min(rows, t0 + kTokensPerBlock);
    for (int64_t t = t0 + lane; t < t1; t += per) {
      const int64_t i = t * Hv + h;
      const float u = ldf(a, ab, i) + dt[h];
      const float dgi = d_g[i];
      const float du = dgi * (-e) * (u > 20.f ? 1.f : sigmoid_f(u));
      d_a[i] = du;
      s_dt += du;
      s_alog += dgi * g[i];
      const float bi = beta[i];
      d_b[i] = d_beta[i] * bi * (1.f - bi);
    }
  }
  sm[threadIdx.x] = s_alog;
  sm[blockDim.x + threadIdx.x] = s_dt;
  __syncthreads();
  if (threadIdx.x < Hv) {
    float sa = 0.f, sd = 0.f;
    for (int l = 0; l < per; ++l) {
      sa += sm[l * Hv + threadIdx.x];
      sd += sm[blockDim.x + l * Hv + threadIdx.x];
    }
    partial[static_cast<int64_t>(blockIdx.x) * 2 * Hv + threadIdx.x] = sa;
    partial[static_cast<int64_t>(blockIdx.x) * 2 * Hv + Hv + threadIdx.x] = sd;
  }
}

__global__ void gates_sum_kernel(float* __restrict__ d_a_log, float* __restrict__ d_dt,
                                 const float* __restrict__ partial, int blocks, int Hv) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= Hv) return;
  float sa = 0.f, sd = 0.f;
  for (int j = 0; j < blocks; ++j) {
    sa += partial[static_cast<int64_t>(j) * 2 * Hv + h];
    sd += partial[static_cast<int64_t>(j) * 2 * Hv + Hv + h];
  }
  d_a_log[h] += sa;
  d_dt[h] += sd;
}

int bwd_threads(int64_t Hv) {
  // A multiple of Hv, at most 1024 (Hv itself when it is larger than 256).
  return static_cast<int>(Hv >= kThreads ? Hv : (kThreads / Hv) * Hv);
}

}  // namespace

void gdn_gates_forward(float* g, float* beta, const void* a, DType a_dtype, const void* b, DType b_dtype,
                       const float* a_log, const float* dt, int64_t rows, int64_t Hv) {
  const int64_t n = rows * Hv;
  if (n == 0) return;
  gates_fwd_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream()>>>(
      g, beta, a, a_dtype == DType::bf16, b, b_dtype == DType::bf16, a_log, dt, n, static_cast<int>(Hv));
  BB_CHECK_LAUNCH();
}

int64_t gdn_gates_backward_workspace(int64_t rows, int64_t Hv) {
  return std::max<int64_t>(1, ceil_div(rows, kTokensPerBlock)) * 2 * Hv;
}

void gdn_gates_backward(float* d_a, float* d_b, float* d_a_log, float* d_dt, float* workspace, const float* d_g,
                        const float* d_beta, const void* a, DType a_dtype, const float* g, const float* beta,
                        const float* a_log, const float* dt, int64_t rows, int64_t Hv) {
  if (rows == 0 || Hv == 0) return;
  BB_CHECK(Hv <= 1024, "gdn_gates_backward: ", Hv, " value heads; the CUDA path takes at most 1024");
  const int64_t blocks = ceil_div(rows, kTokensPerBlock);
  const int threads = bwd_threads(Hv);
  gates_bwd_kernel<<<static_cast<unsigned>(blocks), threads, 2 * threads * sizeof(float), stream()>>>(
      d_a, d_b, workspace, d_g, d_beta, a, a_dtype == DType::bf16, g, beta, a_log, dt, rows, static_cast<int>(Hv));
  BB_CHECK_LAUNCH();
  gates_sum_kernel<<<static_cast<unsigned>(ceil_div(Hv, 128)), 128, 0, stream()>>>(
      d_a_log, d_dt, workspace, static_cast<int>(blocks), static_cast<int>(Hv));
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

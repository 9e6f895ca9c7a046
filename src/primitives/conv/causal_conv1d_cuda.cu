// causal_conv1d_cuda.cu — depthwise causal conv1d (+ SiLU) forward and backward on the GPU.
//
// One thread per (token, channel), consecutive threads on consecutive channels (coalesced rows
// of [T, C]; a 2D grid, channels x token stride, so no per-element 64-bit index division). A token finds its sequence's start by binary search in cu_seqlens (n + 1 ints on
// the device), so no filter tap reaches across a sequence start.
// Backward recomputes the pre-activation of the W tokens a tap feeds (W <= 4: at most 16
// multiply-adds per element, nothing saved by the forward). dw is a reduction over all tokens:
// each block sums a fixed chunk of kChunk tokens for 32 channels into its own workspace slot,
// and a second kernel adds the slots in chunk order, so the result does not depend on timing.
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/check.cuh"
#include "primitives/conv/causal_conv1d_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 256;  // tokens per dw partial sum

// Index of the sequence holding token t: the last n with cu[n] <= t.
__device__ __forceinline__ int seq_of(const int32_t* cu, int64_t nseq, int64_t t) {
  int lo = 0, hi = static_cast<int>(nseq) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float pre_at(const float* x, const float* wc, int64_t t, int64_t start, int64_t c,
                                        int64_t C, int W) {
  float acc = 0.f;
  for (int j = 0; j < W; ++j) {
    const int64_t src = t - (W - 1) + j;
    if (src >= start) acc = fmaf(wc[j], x[src * C + c], acc);
  }
  return acc;
}

__device__ __forceinline__ float silu_grad(float p) {
  const float s = 1.f / (1.f + __expf(-p));
  return s * (1.f + p * (1.f - s));
}

// The elementwise kernels run a 2D grid: x over channels (a block covers kThreads consecutive
// channels of one token row: coalesced), y strides over the tokens; no 64-bit division per element.
dim3 rows_grid(int64_t T, int64_t C) {
  const int64_t cb = ceil_div(C, kThreads);
  const int64_t want = ceil_div(static_cast<int64_t>(sm_count()) * 16, cb);  // ~16 blocks per SM
  return dim3(static_cast<unsigned>(cb), static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>({T, want, 65535}))));
}

__global__ void __launch_bounds__(kThreads)
    forward_kernel(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w,
                   const int32_t* __restrict__ cu, int64_t nseq, int64_t T, int64_t C, int W, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float* wc = w + c * W;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t start = cu[seq_of(cu, nseq, t)];
    const float p = pre_at(x, wc, t, start, c, C, W);
    y[t * C + c] = silu ? p / (1.f + __expf(-p)) : p;
  }
}

// dpre of token t (in the sequence [start, end)), channel c.
__device__ __forceinline__ float dpre_at(const float* dy, const float* x, const float* wc, int64_t t, int64_t start,
                                         int64_t c, int64_t C, int W, bool silu) {
  float d = dy[t * C + c];
  if (silu) d *= silu_grad(pre_at(x, wc, t, start, c, C, W));
  return d;
}

__global__ void __launch_bounds__(kThreads)
    backward_dx_kernel(float* __restrict__ dx, const float* __restrict__ dy, const float* __restrict__ x,
                       const float* __restrict__ w, const int32_t* __restrict__ cu, int64_t nseq, int64_t T, int64_t C,
                       int W, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float* wc = w + c * W;
  for (int64_t s = blockIdx.y; s < T; s += gridDim.y) {
    const int q = seq_of(cu, nseq, s);
    const int64_t start = cu[q], end = cu[q + 1];
    float acc = 0.f;
    // x[s] feeds token t = s + (W-1) - j through tap j.
    for (int j = 0; j < W; ++j) {
      const int64_t t = s + (W - 1) - j;
      if (t < end) acc = fmaf(wc[j], dpre_at(dy, x, wc, t, start, c, C, W, silu), acc);
    }
    dx[s * C + c] = acc;
  }
}

// ws[chunk][c][j] = sum over the chunk's tokens t of dpre[t, c] x[t - (W-1) + j, c]. Block
// (chunk, 32-channel group): thread (ty, tx) takes channel group*32 + tx and every 8th token.
__global__ void __launch_bounds__(kThreads)
    backward_dw_partial_kernel(float* __restrict__ ws, const float* __restrict__ dy, const float* __restrict__ x,
                               const float* __restrict__ w, const int32_t* __restrict__ cu, int64_t nseq, int64_t T,
                               int64_t C, int W, bool silu) {
  __shared__ float red[8][32][4];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * 32 + tx;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kChunk;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (c < C) {
    const float* wc = w + c * W;
    for (int64_t t = t0 + ty; t < t0 + kChunk && t < T; t += 8) {
      const int64_t start = cu[seq_of(cu, nseq, t)];
      const float d = dpre_at(dy, x, wc, t, start, c, C, W, silu);
      for (int j = 0; j < W; ++j) {
        const int64_t src = t - (W - 1) + j;
        if (src >= start) acc[j] = fmaf(d, x[src * C + c], acc[j]);
      }
    }
  }
  for (int j = 0; j < 4; ++j) red[ty][tx][j] = acc[j];
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int j = 0; j < W; ++j) {
      float s = 0.f;
      for (int r = 0; r < 8; ++r) s += red[r][tx][j];
      ws[(static_cast<int64_t>(blockIdx.x) * C + c) * W + j] = s;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    backward_dw_finish_kernel(float* __restrict__ dw, const float* __restrict__ ws, int64_t chunks, int64_t CW) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < CW;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t k = 0; k < chunks; ++k) s += ws[k * CW + i];
    dw[i] += s;
  }
}

}  // namespace

void causal_conv1d_forward(float* y, const float* x, const float* w, const int32_t* cu, int64_t nseq, int64_t T,
                           int64_t C, int64_t W, bool silu) {
  if (T * C == 0) return;
  forward_kernel<<<rows_grid(T, C), kThreads, 0, stream()>>>(y, x, w, cu, nseq, T, C, static_cast<int>(W), silu);
  BB_CHECK_LAUNCH();
}

int64_t causal_conv1d_backward_workspace(int64_t T, int64_t C, int64_t W) {
  return ceil_div(T, kChunk) * C * W;
}

void causal_conv1d_backward(float* dx, float* dw, float* ws, const float* dy, const float* x, const float* w,
                            const int32_t* cu, int64_t nseq, int64_t T, int64_t C, int64_t W, bool silu) {
  if (T * C == 0) return;
  const int Wi = static_cast<int>(W);
  backward_dx_kernel<<<rows_grid(T, C), kThreads, 0, stream()>>>(dx, dy, x, w, cu, nseq, T, C, Wi, silu);
  BB_CHECK_LAUNCH();
  const int64_t chunks = ceil_div(T, kChunk);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(ceil_div(C, 32)));
  backward_dw_partial_kernel<<<grid, kThreads, 0, stream()>>>(ws, dy, x, w, cu, nseq, T, C, Wi, silu);
  BB_CHECK_LAUNCH();
  backward_dw_finish_kernel<<<grid_stride_blocks(C * W, kThreads), kThreads, 0, stream()>>>(dw, ws, chunks, C * W);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

// rmsnorm_cuda.cu — RMSNorm forward/backward kernels (a sub-warp or a warp per row).
//
// A "row group" of rt threads (a power of two <= 32) normalises one row at a time; a 256-thread
// block holds 256 / rt groups and loops over rows with a one-wave grid. Rows move in 16-byte
// vectors when H and the pointers allow, else element by element. When a row has at most 8
// vectors per lane, each lane keeps its share in registers (forward: x read once, all loads in
// flight; backward: the lane's d_w columns); wider rows loop and re-read from L1/L2. The
// weight is staged once per block in shared memory as f32. Reductions are butterfly shuffles
// inside the group: every lane gets the same value, no __syncthreads, results independent of
// scheduling.
//
// Backward d_w is deterministic without float atomics: each lane owns fixed columns and sums
// d_y * xhat over its rows (in registers, or in its group's slice of shared memory for wide
// rows); a block then adds its groups in a fixed order into one partial row (global workspace),
// and a second kernel adds the partial rows to d_w in block order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "primitives/norm/rmsnorm_cuda.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksPerSm = 2048 / kThreads;  // bound of the one-wave grid
constexpr int kRegVecs = 8;  // vectors per lane kept in registers; wider rows loop

// N consecutive elements as one aligned access (split by the compiler above 16 bytes).

template <class T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N>& pk, float (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_f32(pk.v[k]);
}

// Sum over an aligned group of rt <= 32 lanes; all lanes of the warp must take part.
__device__ __forceinline__ float group_sum(float v, int rt) {
  for (int o = rt >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The weight as the kernels use it: w_offset + w (w_offset 1 for the zero-centred norm).
__device__ __forceinline__ void stage_weight(float* w_s, const void* w, bool w_bf16, float w_offset,
                                             int H) {
  for (int h = threadIdx.x; h < H; h += blockDim.x)
    w_s[h] = w_offset +
             (w_bf16 ? to_f32(static_cast<const bf16_t*>(w)[h]) : static_cast<const float*>(w)[h]);
}

// The loops over rows run the same number of times in every lane of a warp (shuffles need the
// whole warp): groups past the last row go along inactive.
#define BB_FOR_ROWS(row, active)                                                          \
  for (int64_t base_ = static_cast<int64_t>(blockIdx.x) * groups; base_ < rows;          \
       base_ += static_cast<int64_t>(gridDim.x) * groups)                                 \
    if (const int64_t row = base_ + g; true)                                              \
      if (const bool active = row < rows; true)

// x, y [rows, H]; rstd [rows]; w [H] (f32 or bf16). N divides H. kRegs: the row is kept in
// registers (nv <= rt * kRegVecs); else it is read twice.
template <class TX, int N, bool kRegs>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_fwd_kernel(TX* __restrict__ y, float* __restrict__ rstd, const TX* __restrict__ x,
                       const void* __restrict__ w, bool w_bf16, float w_offset, int64_t rows, int H,
                       int rt, float eps) {
  extern __shared__ float4 smem4[];
  float* w_s = reinterpret_cast<float*>(smem4);  // [H]
  stage_weight(w_s, w, w_bf16, w_offset, H);
  __syncthreads();
  const int groups = blockDim.x / rt;
  const int g = threadIdx.x / rt, lane = threadIdx.x % rt;
  const int nv = H / N;
  BB_FOR_ROWS(row, active) {
    const TX* xr = x + row * H;
    TX* yr = y + row * H;
    float ss = 0.f;
    if constexpr (kRegs) {
      Pack<TX, N> xp[kRegVecs];
#pragma unroll
      for (int j = 0; j < kRegVecs; ++j) {
        const int v = lane + j * rt;
        if (active && v < nv) xp[j] = *reinterpret_cast<const Pack<TX, N>*>(xr + v * N);
      }
#pragma unroll
      for (int j = 0; j < kRegVecs; ++j) {
        const int v = lane + j * rt;
        if (active && v < nv) {
          float xv[N];
          unpack(xp[j], xv);
#pragma unroll
          for (int k = 0; k < N; ++k) ss += xv[k] * xv[k];
        }
      }
      ss = group_sum(ss, rt);
      const float r = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
      if (active && lane == 0) rstd[row] = r;
#pragma unroll
      for (int j = 0; j < kRegVecs; ++j) {
        const int v = lane + j * rt;
        if (active && v < nv) {
          float xv[N], wv[N], out[N];
          unpack(xp[j], xv);
          load<float, N>(w_s + v * N, wv);
#pragma unroll
          for (int k = 0; k < N; ++k) out[k] = wv[k] * (xv[k] * r);
          store<TX, N>(yr + v * N, out);
        }
      }
    } else {
      if (active)
#pragma unroll 4
        for (int v = lane; v < nv; v += rt) {
          float xv[N];
          load<TX, N>(xr + v * N, xv);
#pragma unroll
          for (int k = 0; k < N; ++k) ss += xv[k] * xv[k];
        }
      ss = group_sum(ss, rt);
      const float r = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
      if (active && lane == 0) rstd[row] = r;
      if (active)
        for (int v = lane; v < nv; v += rt) {
          float xv[N], wv[N], out[N];
          load<TX, N>(xr + v * N, xv);
          load<float, N>(w_s + v * N, wv);
#pragma unroll
          for (int k = 0; k < N; ++k) out[k] = wv[k] * (xv[k] * r);
          store<TX, N>(yr + v * N, out);
        }
    }
  }
}

// One row element block of the backward: d_x written, d_y * xhat added to acc.
// resr (may be null): the residual's gradient row, added to d_x as a separate rounding (the
// bits of adding it afterwards).
template <class TX, class TD, class TO, int N>
__device__ __forceinline__ void bwd_vec(TO* dxr, const TX* xr, const TD* dyr, const float* w_s,
                                        const float* resr, int v, float r, float mean,
                                        float (&acc)[N]) {
  float xv[N], dv[N], wv[N], out[N];
  load<TX, N>(xr + v * N, xv);
  load<TD, N>(dyr + v * N, dv);
  load<float, N>(w_s + v * N, wv);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float xhat = xv[k] * r;
    out[k] = r * (dv[k] * wv[k] - xhat * mean);
    acc[k] += dv[k] * xhat;
  }
  if (resr != nullptr) {
    float rv[N];
    load<float, N>(resr + v * N, rv);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = __fadd_rn(out[k], rv[k]);  // never fused into an FMA
  }
  store<TO, N>(dxr + v * N, out);  // a bf16 d_x is rounded once, after the residual add
}

template <class TX, class TD, int N>
__device__ __forceinline__ float dot_vec(const TX* xr, const TD* dyr, const float* w_s, int v,
                                         float r) {
  float xv[N], dv[N], wv[N];
  load<TX, N>(xr + v * N, xv);
  load<TD, N>(dyr + v * N, dv);
  load<float, N>(w_s + v * N, wv);
  float d = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) d += dv[k] * wv[k] * (xv[k] * r);
  return d;
}

// dx [rows, H] f32 written; partial [gridDim.x, H] f32: this block's share of d_w.
// kRegs: each lane's d_w columns live in registers; else in its group's shared-memory slice.
template <class TX, class TD, class TO, int N, bool kRegs>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_bwd_kernel(TO* __restrict__ dx, float* __restrict__ partial,
                       const TD* __restrict__ dy, const TX* __restrict__ x,
                       const float* __restrict__ res,
                       const void* __restrict__ w, bool w_bf16, float w_offset,
                       const float* __restrict__ rstd, int64_t rows, int H, int rt) {
  extern __shared__ float4 smem4[];
  const int groups = blockDim.x / rt;
  float* w_s = reinterpret_cast<float*>(smem4);  // [H]
  float* dw_s = w_s + H;  // kRegs: [H] combine buffer; else [groups, H]
  stage_weight(w_s, w, w_bf16, w_offset, H);
  if (!kRegs)
    for (int i = threadIdx.x; i < groups * H; i += blockDim.x) dw_s[i] = 0.f;
  __syncthreads();
  const int g = threadIdx.x / rt, lane = threadIdx.x % rt;
  const int nv = H / N;
  float acc[kRegs ? kRegVecs : 1][N] = {};
  float* my_dw = dw_s + (kRegs ? 0 : g * H);
  BB_FOR_ROWS(row, active) {
    const TX* xr = x + row * H;
    const TD* dyr = dy + row * H;
    TO* dxr = dx + row * H;
    const float* resr = res != nullptr ? res + row * H : nullptr;
    const float r = active ? rstd[row] : 0.f;
    float dot = 0.f;
    if (active) {
      if constexpr (kRegs) {
#pragma unroll
        for (int j = 0; j < kRegVecs; ++j)
          if (lane + j * rt < nv) dot += dot_vec<TX, TD, N>(xr, dyr, w_s, lane + j * rt, r);
      } else {
#pragma unroll 4
        for (int v = lane; v < nv; v += rt) dot += dot_vec<TX, TD, N>(xr, dyr, w_s, v, r);
      }
    }
    dot = group_sum(dot, rt);
    const float mean = dot / static_cast<float>(H);
    if (active) {
      if constexpr (kRegs) {
#pragma unroll
        for (int j = 0; j < kRegVecs; ++j)
          if (lane + j * rt < nv)
            bwd_vec<TX, TD, TO, N>(dxr, xr, dyr, w_s, resr, lane + j * rt, r, mean, acc[j]);
      } else {
        for (int v = lane; v < nv; v += rt) {
          float a[N];
          load<float, N>(my_dw + v * N, a);
          bwd_vec<TX, TD, TO, N>(dxr, xr, dyr, w_s, resr, v, r, mean, a);
          store<float, N>(my_dw + v * N, a);
        }
      }
    }
  }
  if constexpr (kRegs) {
    // Groups add their registers into the buffer one after another: a fixed order.
    for (int gg = 0; gg < groups; ++gg) {
      if (g == gg)
#pragma unroll
        for (int j = 0; j < kRegVecs; ++j) {
          const int v = lane + j * rt;
          if (v < nv) {
            float b[N];
            if (gg == 0) {
#pragma unroll
              for (int k = 0; k < N; ++k) b[k] = acc[j][k];
            } else {
              load<float, N>(dw_s + v * N, b);
#pragma unroll
              for (int k = 0; k < N; ++k) b[k] += acc[j][k];
            }
            store<float, N>(dw_s + v * N, b);
          }
        }
      __syncthreads();
    }
    float* pr = partial + static_cast<int64_t>(blockIdx.x) * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x) pr[h] = dw_s[h];
  } else {
    __syncthreads();
    float* pr = partial + static_cast<int64_t>(blockIdx.x) * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      float s = 0.f;
      for (int gg = 0; gg < groups; ++gg) s += dw_s[gg * H + h];
      pr[h] = s;
    }
  }
}
#undef BB_FOR_ROWS

// dw[c] += sum_b partial[b, c], b in a fixed order. Block (32, 16): 32 columns, 16 strided
// row lanes, then the 16 lane sums in order.
__global__ void dw_reduce_kernel(float* __restrict__ dw, const float* __restrict__ partial,
                                 int blocks, int H) {
  __shared__ float s[16][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < H)
    for (int b = threadIdx.y; b < blocks; b += 16) acc += partial[static_cast<int64_t>(b) * H + c];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < H) {
    float t = 0.f;
    for (int i = 0; i < 16; ++i) t += s[i][threadIdx.x];
    dw[c] += t;
  }
}

// Dynamic shared memory above the 48 KiB default needs an opt-in per kernel.
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* op, int64_t H) {
  if (bytes <= 48 * 1024) return;
  const int dev = current_device();
  int max_optin = 0;
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  BB_CHECK(bytes <= static_cast<size_t>(max_optin), op, ": hidden size ", H,
           " needs ", bytes, " bytes of shared memory, the device allows ", max_optin);
  BB_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
}

// Threads per row in the forward: the smallest power of two (at most a warp) that leaves each
// lane at most kRegVecs vectors. Narrow rows (qk norm: 16 vectors) thus get 2 lanes with 8
// loads each in flight rather than 16 lanes with one (measured on an H200: 3.1 vs 2.3 TB/s).
int row_threads_fwd(int64_t nv) {
  int rt = 1;
  while (rt < 32 && static_cast<int64_t>(rt) * kRegVecs < nv) rt *= 2;
  return rt;
}

// Backward: one lane per vector up to a warp. Packing narrow rows onto few lanes, as in the
// forward, made it slower (2.1 vs 3.2 TB/s for qk norm): 125 registers of d_w accumulators
// per lane and 128 groups to combine per block.
int row_threads_bwd(int64_t nv) {
  int rt = 1;
  while (rt < 32 && rt < nv) rt *= 2;
  return rt;
}

// One wave of resident blocks (at most kMaxBlocksPerSm per SM), fewer if the rows run out.
template <class Kernel>
int64_t wave_blocks(Kernel kernel, size_t smem, int64_t rows, int groups) {
  int per_sm = 0;
  BB_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t wave = static_cast<int64_t>(std::clamp(per_sm, 1, kMaxBlocksPerSm)) * sm_count();
  return std::min(ceil_div(rows, groups), wave);
}

template <class TX, int N, bool kRegs>
void launch_fwd(void* y, float* rstd, const void* x, const void* w, bool w_bf16, float w_offset,
                int64_t rows, int64_t H, int rt, float eps) {
  auto kernel = rmsnorm_fwd_kernel<TX, N, kRegs>;
  const size_t smem = static_cast<size_t>(H) * sizeof(float);
  allow_smem(kernel, smem, "rmsnorm_forward", H);
  const int64_t blocks = wave_blocks(kernel, smem, rows, kThreads / rt);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream()>>>(
      static_cast<TX*>(y), rstd, static_cast<const TX*>(x), w, w_bf16, w_offset, rows,
      static_cast<int>(H), rt, eps);
  BB_CHECK_LAUNCH();
}

template <class TX, int N>
void dispatch_fwd(void* y, float* rstd, const void* x, const void* w, bool w_bf16, float w_offset,
                  int64_t rows, int64_t H, float eps) {
  const int rt = row_threads_fwd(H / N);
  if (H / N <= static_cast<int64_t>(rt) * kRegVecs)
    launch_fwd<TX, N, true>(y, rstd, x, w, w_bf16, w_offset, rows, H, rt, eps);
  else
    launch_fwd<TX, N, false>(y, rstd, x, w, w_bf16, w_offset, rows, H, rt, eps);
}

template <class TX, class TD, class TO, int N, bool kRegs>
void launch_bwd(TO* dx, float* dw, float* workspace, const void* dy, const void* x,
                const float* res, const void* w, bool w_bf16, float w_offset, const float* rstd,
                int64_t rows, int64_t H, int rt) {
  auto kernel = rmsnorm_bwd_kernel<TX, TD, TO, N, kRegs>;
  const int groups = kThreads / rt;
  const size_t smem = static_cast<size_t>(H) * (kRegs ? 2 : 1 + groups) * sizeof(float);
  allow_smem(kernel, smem, "rmsnorm_backward", H);
  const int64_t blocks = wave_blocks(kernel, smem, rows, groups);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream()>>>(
      dx, workspace, static_cast<const TD*>(dy), static_cast<const TX*>(x), res, w, w_bf16, w_offset, rstd,
      rows, static_cast<int>(H), rt);
  BB_CHECK_LAUNCH();
  dw_reduce_kernel<<<static_cast<unsigned>(ceil_div(H, 32)), dim3(32, 16), 0, stream()>>>(
      dw, workspace, static_cast<int>(blocks), static_cast<int>(H));
  BB_CHECK_LAUNCH();
}

template <class TX, class TD, class TO, int N>
void dispatch_bwd_n(TO* dx, float* dw, float* ws, const void* dy, const void* x, const float* res,
                    const void* w, bool w_bf16, float w_offset, const float* rstd, int64_t rows,
                    int64_t H) {
  const int rt = row_threads_bwd(H / N);
  if (H / N <= static_cast<int64_t>(rt) * kRegVecs)
    launch_bwd<TX, TD, TO, N, true>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H, rt);
  else
    launch_bwd<TX, TD, TO, N, false>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H, rt);
}

template <class TX, class TD, class TO>
void dispatch_bwd_out(void* dx_raw, float* dw, float* ws, const void* dy, const void* x,
                      const float* res, const void* w, bool w_bf16, float w_offset,
                      const float* rstd, int64_t rows, int64_t H) {
  constexpr int N = 16 / sizeof(TX);
  TO* dx = static_cast<TO*>(dx_raw);
  const bool vec = H % N == 0 && aligned(x, 16) && aligned(dy, 16) && aligned(dx, 16) &&
                   (res == nullptr || aligned(res, 16));
  if (vec)
    dispatch_bwd_n<TX, TD, TO, N>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
  else
    dispatch_bwd_n<TX, TD, TO, 1>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
}

template <class TX, class TD>
void dispatch_bwd(void* dx, bool dx_bf16, float* dw, float* ws, const void* dy, const void* x,
                  const float* res, const void* w, bool w_bf16, float w_offset, const float* rstd,
                  int64_t rows, int64_t H) {
  if (dx_bf16)
    dispatch_bwd_out<TX, TD, bf16_t>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
  else
    dispatch_bwd_out<TX, TD, float>(dx, dw, ws, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
}

}  // namespace

void rmsnorm_forward(void* y, float* rstd, const void* x, DType x_dtype, const void* w,
                     DType w_dtype, float w_offset, int64_t rows, int64_t H, float eps) {
  if (rows == 0) return;
  const bool w_bf16 = w_dtype == DType::bf16;
  if (x_dtype == DType::bf16) {
    if (H % 8 == 0 && aligned(x, 16) && aligned(y, 16))
      dispatch_fwd<bf16_t, 8>(y, rstd, x, w, w_bf16, w_offset, rows, H, eps);
    else
      dispatch_fwd<bf16_t, 1>(y, rstd, x, w, w_bf16, w_offset, rows, H, eps);
  } else {
    if (H % 4 == 0 && aligned(x, 16) && aligned(y, 16))
      dispatch_fwd<float, 4>(y, rstd, x, w, w_bf16, w_offset, rows, H, eps);
    else
      dispatch_fwd<float, 1>(y, rstd, x, w, w_bf16, w_offset, rows, H, eps);
  }
}

int64_t rmsnorm_backward_workspace(int64_t rows, int64_t H) {
  return std::min<int64_t>(rows, int64_t{kMaxBlocksPerSm} * sm_count()) * H;
}

void rmsnorm_backward(void* dx, DType dx_dtype, float* dw, float* workspace, const void* dy,
                      DType dy_dtype, const void* x, DType x_dtype, const void* w, DType w_dtype,
                      float w_offset, const float* rstd, int64_t rows, int64_t H,
                      const float* residual) {
  if (rows == 0) return;
  const bool w_bf16 = w_dtype == DType::bf16, ob = dx_dtype == DType::bf16;
  const bool xb = x_dtype == DType::bf16, db = dy_dtype == DType::bf16;
  const float* res = residual;
  if (xb && db)
    dispatch_bwd<bf16_t, bf16_t>(dx, ob, dw, workspace, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
  else if (xb)
    dispatch_bwd<bf16_t, float>(dx, ob, dw, workspace, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
  else if (db)
    dispatch_bwd<float, bf16_t>(dx, ob, dw, workspace, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
  else
    dispatch_bwd<float, float>(dx, ob, dw, workspace, dy, x, res, w, w_bf16, w_offset, rstd, rows, H);
}

}  // namespace bb::cuda

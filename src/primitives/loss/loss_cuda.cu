// loss_cuda.cu — CUDA cross-entropy pieces: online logsumexp over one logits block, the
// finalize/reduce step with its single host read, the softmax gradient (in place or into a
// bf16 block for the bf16 GEMMs of the loss heads), and the whole-row step of linear_ce_fused
// (statistics and gradient in one kernel, gradient written over the logits).
//
// Legend: T tokens (rows), V vocab, nv columns of one block starting at column v0.
// NOTES: one thread block owns one row in every kernel, so nothing is shared between blocks;
// the loss sum is reduced by a single block in a fixed tree order, in double, so it is
// deterministic. Row statistics are f32 (max, sum of exp(x - max) rescaled online); lse and the
// loss terms are formed in double from them. Loads are 16 bytes wide when the row stride, the
// chunk width and the base pointers allow.
// ce_fused_rows_kernel is the hot one of linear_ce_fused: it streams a [ct, V] f32 block twice
// and writes the gradient once, so it is pure memory traffic (10 bytes per logit for bf16);
// see its NOTES for why the bf16 gradient can overwrite the f32 logits it is computed from.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "backend/cuda/runtime.h"
#include "primitives/loss/loss_cuda.h"

namespace bb::cuda {

namespace {

constexpr int kMaxThreads = 512;
constexpr int kFinalThreads = 1024;

int row_threads(int64_t units) {
  return static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, ceil_div(units, 32) * 32)));
}

// ---- online logsumexp -----------------------------------------------------------------------
// (m, s) represents sum_i exp(x_i) = s * exp(m); m = -inf, s = 0 is the empty set.
__device__ __forceinline__ void lse_add(float& m, float& s, float x) {
  if (x == -INFINITY) return;
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // exp(-inf) = 0 covers the empty set
    m = x;
  } else {
    s += expf(x - m);
  }
}
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
  if (om == -INFINITY) return;
  if (m == -INFINITY) {
    m = om;
    s = os;
    return;
  }
  const float M = fmaxf(m, om);
  s = s * expf(m - M) + os * expf(om - M);
  m = M;
}

// Block-wide merge of every thread's (m, s); all threads get the result. Contains barriers:
// every thread of the block must call it.
__device__ __forceinline__ void block_lse_merge(float& m, float& s) {
  __shared__ float sh_m[32], sh_s[32];
  for (int off = 16; off > 0; off >>= 1) {
    const float om = __shfl_down_sync(0xffffffffu, m, off);
    const float os = __shfl_down_sync(0xffffffffu, s, off);
    lse_merge(m, s, om, os);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? sh_m[lane] : -INFINITY;
    s = lane < warps ? sh_s[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) {
      const float om = __shfl_down_sync(0xffffffffu, m, off);
      const float os = __shfl_down_sync(0xffffffffu, s, off);
      lse_merge(m, s, om, os);
    }
    if (lane == 0) {
      sh_m[0] = m;
      sh_s[0] = s;
    }
  }
  __syncthreads();
  m = sh_m[0];
  s = sh_s[0];
}

template <class T, int V>
__global__ void ce_update_kernel(float* __restrict__ run_max, float* __restrict__ run_sum,
                                 float* __restrict__ target_logit, const T* __restrict__ x,
                                 int64_t ld, const int32_t* __restrict__ targets, int64_t v0,
                                 int64_t nv, bool first) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * ld;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < nv; j += static_cast<int64_t>(blockDim.x) * V) {
    float v[V];
    load<T, V>(xr + j, v);
#pragma unroll
    for (int i = 0; i < V; ++i) lse_add(m, s, v[i]);
  }
  block_lse_merge(m, s);
  if (threadIdx.x != 0) return;
  if (!first) lse_merge(m, s, run_max[r], run_sum[r]);
  run_max[r] = m;
  run_sum[r] = s;
  const int64_t tg = targets[r];
  if (tg >= v0 && tg < v0 + nv) target_logit[r] = to_f32(xr[tg - v0]);
}

struct DeviceTotals {
  double loss_sum;
  long long num_valid;
  long long first_bad_row;
};

__global__ void ce_finalize_kernel(float* __restrict__ lse, DeviceTotals* __restrict__ out,
                                   const float* __restrict__ run_max,
                                   const float* __restrict__ run_sum,
                                   const float* __restrict__ target_logit,
                                   const int32_t* __restrict__ targets, int64_t T, int64_t V) {
  __shared__ double sh_loss[kFinalThreads];
  __shared__ long long sh_valid[kFinalThreads], sh_bad[kFinalThreads];
  double loss = 0.0;
  long long valid = 0, bad = LLONG_MAX;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const double l = static_cast<double>(run_max[t]) + log(static_cast<double>(run_sum[t]));
    lse[t] = static_cast<float>(l);
    const int64_t tg = targets[t];
    if (tg >= V) {
      bad = min(bad, static_cast<long long>(t));
    } else if (tg >= 0) {
      loss += l - static_cast<double>(target_logit[t]);
      ++valid;
    }
  }
  sh_loss[threadIdx.x] = loss;
  sh_valid[threadIdx.x] = valid;
  sh_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sh_loss[threadIdx.x] += sh_loss[threadIdx.x + half];
      sh_valid[threadIdx.x] += sh_valid[threadIdx.x + half];
      sh_bad[threadIdx.x] = min(sh_bad[threadIdx.x], sh_bad[threadIdx.x + half]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out->loss_sum = sh_loss[0];
    out->num_valid = sh_valid[0];
    out->first_bad_row = sh_bad[0] == LLONG_MAX ? -1 : sh_bad[0];
  }
}

// d and x may alias (in place, both f32): each element is read, then written, by one thread.
template <class TI, class TO, int V>
__global__ void ce_softmax_grad_kernel(TO* d, int64_t ld_d, const TI* x, int64_t ld_x,
                                       const int32_t* __restrict__ targets,
                                       const float* __restrict__ lse, float scale, int64_t v0,
                                       int64_t nv) {
  const int64_t r = blockIdx.x;
  const int64_t tg = targets[r];
  const float l = lse[r];
  const TI* xr = x + r * ld_x;
  TO* dr = d + r * ld_d;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < nv; j += static_cast<int64_t>(blockDim.x) * V) {
    float v[V];
    if (tg < 0) {
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = 0.0f;
    } else {
      load<TI, V>(xr + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float onehot = (v0 + j + i == tg) ? 1.0f : 0.0f;
        v[i] = scale * (expf(v[i] - l) - onehot);
      }
    }
    store<TO, V>(dr + j, v);
  }
}

template <class T>
void launch_update(float* run_max, float* run_sum, float* target_logit, const void* x, int64_t ld,
                   const int32_t* targets, int64_t rows, int64_t v0, int64_t nv, bool first) {
  constexpr int kVec = 16 / sizeof(T);
  const T* xp = static_cast<const T*>(x);
  if (nv % kVec == 0 && ld % kVec == 0 && aligned(x, 16)) {
    ce_update_kernel<T, kVec><<<static_cast<unsigned>(rows), row_threads(nv / kVec), 0, stream()>>>(
        run_max, run_sum, target_logit, xp, ld, targets, v0, nv, first);
  } else {
    ce_update_kernel<T, 1><<<static_cast<unsigned>(rows), row_threads(nv), 0, stream()>>>(
        run_max, run_sum, target_logit, xp, ld, targets, v0, nv, first);
  }
  BB_CHECK_LAUNCH();
}

template <class TI, class TO>
void launch_grad(void* d, int64_t ld_d, const void* x, int64_t ld_x, const int32_t* targets,
                 const float* lse, float scale, int64_t rows, int64_t v0, int64_t nv) {
  constexpr int kVec = 16 / sizeof(TI);
  TO* dp = static_cast<TO*>(d);
  const TI* xp = static_cast<const TI*>(x);
  if (nv % kVec == 0 && ld_x % kVec == 0 && ld_d % kVec == 0 && aligned(x, 16) && aligned(d, 16)) {
    ce_softmax_grad_kernel<TI, TO, kVec><<<static_cast<unsigned>(rows), row_threads(nv / kVec), 0,
                                           stream()>>>(dp, ld_d, xp, ld_x, targets, lse, scale, v0, nv);
  } else {
    ce_softmax_grad_kernel<TI, TO, 1><<<static_cast<unsigned>(rows), row_threads(nv), 0, stream()>>>(
        dp, ld_d, xp, ld_x, targets, lse, scale, v0, nv);
  }
  BB_CHECK_LAUNCH();
}

// ---- linear_ce_fused: statistics + gradient of whole rows -----------------------------------
constexpr int kFusedThreads = 512;
constexpr int kFusedGroups = 2;  // vectors in flight per thread per loop step

// Folds kVec values into a thread's running (m, s): one rescale per vector, not per element.
// Branch-free, so the loads of unrolled steps are not held behind data-dependent jumps. While
// everything seen is -inf the offset is 0 instead of -inf (no inf - inf): s stays 0.
template <int kVec>
__device__ __forceinline__ void lse_fold(float& m, float& s, const float (&v)[kVec]) {
  float nm = m;
#pragma unroll
  for (int i = 0; i < kVec; ++i) nm = fmaxf(nm, v[i]);
  const float off = nm == -INFINITY ? 0.0f : nm;
  s *= expf(m - off);  // 1 when the max did not move; 0 while m is still -inf
#pragma unroll
  for (int i = 0; i < kVec; ++i) s += expf(v[i] - off);
  m = nm;
}

// Sweep-1 step of ce_fused_rows_kernel at columns [base, base + tile). kChecked: the step may run
// past the end of the row (the last, partial tile); the full tiles skip the bounds tests so the
// compiler can issue the loads of unrolled steps together.
template <class TI, int kVec, bool kChecked>
__device__ __forceinline__ void lse_step(const TI* __restrict__ xr, int64_t base,
                                         int64_t vocab, int64_t nthreads, float& m, float& s) {
  float v[kFusedGroups][kVec];
#pragma unroll
  for (int g = 0; g < kFusedGroups; ++g) {
    const int64_t j = base + (g * nthreads + threadIdx.x) * kVec;
    if (!kChecked || j < vocab) load<TI, kVec>(xr + j, v[g]);
  }
#pragma unroll
  for (int g = 0; g < kFusedGroups; ++g) {
    const int64_t j = base + (g * nthreads + threadIdx.x) * kVec;
    if (!kChecked || j < vocab) lse_fold<kVec>(m, s, v[g]);
  }
}

// One block per row r of x [rows, vocab] (f32, or bf16 logits). Loop step `base` covers `tile` =
// blockDim * kVec * kFusedGroups columns; thread t's vector g starts at column base + (g * blockDim
// + t) * kVec, so every group is one coalesced sweep of the block. kVec divides vocab (the launcher makes sure), so a
// vector is either wholly inside the row or wholly past its end.
// NOTES (in place, bf16): row r of d is written over the first 2 * vocab bytes of x's row r.
// Step k writes bf16 columns [k*tile, (k+1)*tile), i.e. the bytes of f32 columns
// [k*tile/2, (k+1)*tile/2): columns read at steps <= k and never read again. Step k's own reads
// are turned into values (exp evaluated) before the barrier and its writes come after it, and
// the barrier also keeps any warp from running a step ahead of a lagging one; so no thread
// overwrites a logit another thread has yet to read. Sweep 1 finishes (block_lse_merge's
// barriers) before any write. When the gradient has the logits' width (f32 -> f32, bf16 ->
// bf16) each thread rewrites only its own elements.
template <class TI, class TO, int kVec>
__global__ void __launch_bounds__(kFusedThreads)
    ce_fused_rows_kernel(TI* __restrict__ x, int64_t vocab, const int32_t* __restrict__ targets,
                         float scale, float* __restrict__ run_max, float* __restrict__ run_sum,
                         float* __restrict__ target_logit) {
  constexpr bool kNarrow = sizeof(TO) < sizeof(TI);
  const int64_t r = blockIdx.x;
  TI* xr = x + r * vocab;
  TO* dr = reinterpret_cast<TO*>(xr);
  const int64_t tg = targets[r];
  const int64_t nthreads = blockDim.x;
  const int64_t tile = nthreads * kVec * kFusedGroups;

  if (tg < 0) {  // masked row: zero gradient, neutral statistics; nothing is read
    float z[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) z[i] = 0.0f;
    for (int64_t j = threadIdx.x * static_cast<int64_t>(kVec); j < vocab; j += nthreads * kVec)
      store<TO, kVec>(dr + j, z);
    if (threadIdx.x == 0) {
      run_max[r] = 0.0f;
      run_sum[r] = 1.0f;
      target_logit[r] = 0.0f;
    }
    return;
  }
  // The target logit is read (and stored, so the load has completed) before the barriers that
  // precede every write to the row.
  if (threadIdx.x == 0) target_logit[r] = tg < vocab ? to_f32(xr[tg]) : 0.0f;

  // Sweep 1: running (max, sum of exp) per thread, merged over the block.
  float m = -INFINITY, s = 0.0f;
  {
    const int64_t full_end = vocab - vocab % tile;
    int64_t base = 0;
#pragma unroll 2
    for (; base < full_end; base += tile) lse_step<TI, kVec, false>(xr, base, vocab, nthreads, m, s);
    if (base < vocab) lse_step<TI, kVec, true>(xr, base, vocab, nthreads, m, s);
  }
  block_lse_merge(m, s);
  if (threadIdx.x == 0) {
    run_max[r] = m;
    run_sum[r] = s;
  }
  const float lse = m + logf(s);

  // Sweep 2: d = scale * (softmax - onehot), written over the row.
  for (int64_t base = 0; base < vocab; base += tile) {
    float v[kFusedGroups][kVec];
    bool in[kFusedGroups];
#pragma unroll
    for (int g = 0; g < kFusedGroups; ++g) {
      const int64_t j = base + (g * nthreads + threadIdx.x) * kVec;
      in[g] = j < vocab;
      if (!in[g]) continue;
      load<TI, kVec>(xr + j, v[g]);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float onehot = (j + i == tg) ? 1.0f : 0.0f;
        v[g][i] = scale * (expf(v[g][i] - lse) - onehot);
      }
    }
    if constexpr (kNarrow) __syncthreads();
#pragma unroll
    for (int g = 0; g < kFusedGroups; ++g) {
      const int64_t j = base + (g * nthreads + threadIdx.x) * kVec;
      if (in[g]) store<TO, kVec>(dr + j, v[g]);
    }
  }
}

template <class TI, class TO>
void launch_fused(void* xv, int64_t vocab, const int32_t* targets, float scale, int64_t rows,
                  float* run_max, float* run_sum, float* target_logit) {
  TI* x = static_cast<TI*>(xv);
  const unsigned grid = static_cast<unsigned>(rows);
  auto threads = [&](int vec) {
    return std::min(kFusedThreads, row_threads(ceil_div(vocab, vec * kFusedGroups)));
  };
  // Row starts are aligned to the vector (f32 logits: their bf16 gradient rows start at the same
  // bytes; bf16 logits: rows of 2 V bytes) when vocab is a multiple of the vector width and the
  // block is 16-byte aligned.
  if (vocab % 8 == 0 && aligned(x, 16)) {
    ce_fused_rows_kernel<TI, TO, 8><<<grid, threads(8), 0, stream()>>>(
        x, vocab, targets, scale, run_max, run_sum, target_logit);
  } else if (vocab % 4 == 0 && aligned(x, 16)) {
    ce_fused_rows_kernel<TI, TO, 4><<<grid, threads(4), 0, stream()>>>(
        x, vocab, targets, scale, run_max, run_sum, target_logit);
  } else {
    ce_fused_rows_kernel<TI, TO, 1><<<grid, threads(1), 0, stream()>>>(
        x, vocab, targets, scale, run_max, run_sum, target_logit);
  }
  BB_CHECK_LAUNCH();
}

}  // namespace

void ce_fused_rows(void* x, DType x_dt, int64_t V, DType d_dt, const int32_t* targets, float scale,
                   int64_t rows, float* run_max, float* run_sum, float* target_logit) {
  if (rows == 0) return;
  BB_CHECK(d_dt == DType::f32 || d_dt == DType::bf16, "linear_ce_fused on CUDA: gradient dtype ",
           dtype_name(d_dt), " is not supported (f32 or bf16)");
  BB_CHECK(x_dt == DType::f32 || (x_dt == DType::bf16 && d_dt == DType::bf16),
           "linear_ce_fused on CUDA: logits ", dtype_name(x_dt), " with gradient ", dtype_name(d_dt),
           " is not supported (f32 logits, or bf16 logits and gradient)");
  if (x_dt == DType::bf16)
    launch_fused<__nv_bfloat16, __nv_bfloat16>(x, V, targets, scale, rows, run_max, run_sum, target_logit);
  else if (d_dt == DType::f32)
    launch_fused<float, float>(x, V, targets, scale, rows, run_max, run_sum, target_logit);
  else
    launch_fused<float, __nv_bfloat16>(x, V, targets, scale, rows, run_max, run_sum, target_logit);
}

namespace {
__global__ void round_bf16_kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}
}  // namespace

void round_to_bf16(float* x, int64_t n) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 65535));
  round_bf16_kernel<<<blocks, threads, 0, stream()>>>(x, n);
  BB_CHECK_LAUNCH();
}

void ce_online_update(float* run_max, float* run_sum, float* target_logit, const void* x,
                      DType dt, int64_t ld, const int32_t* targets, int64_t rows, int64_t v0,
                      int64_t nv, bool first) {
  if (rows == 0) return;
  switch (dt) {
    case DType::f32:
      launch_update<float>(run_max, run_sum, target_logit, x, ld, targets, rows, v0, nv, first);
      break;
    case DType::bf16:
      launch_update<__nv_bfloat16>(run_max, run_sum, target_logit, x, ld, targets, rows, v0, nv,
                                   first);
      break;
    default: BB_FAIL("cross-entropy on CUDA: logits dtype ", dtype_name(dt), " is not supported (f32 or bf16)");
  }
}

size_t ce_totals_bytes() { return sizeof(DeviceTotals); }

CeTotals ce_finalize(float* lse, void* totals_scratch, const float* run_max, const float* run_sum,
                     const float* target_logit, const int32_t* targets, int64_t T, int64_t V) {
  DeviceTotals* dev = static_cast<DeviceTotals*>(totals_scratch);
  ce_finalize_kernel<<<1, kFinalThreads, 0, stream()>>>(lse, dev, run_max, run_sum, target_logit,
                                                        targets, T, V);
  BB_CHECK_LAUNCH();
  // The loss head's one host read (cuda::memcpy waits and calls cuda::note_host_sync()).
  DeviceTotals host;
  cuda::memcpy(&host, Device::cpu(), dev, Device::cuda(cuda::current_device()), sizeof(host));
  CeTotals t;
  t.loss_sum = host.loss_sum;
  t.num_valid = host.num_valid;
  t.first_bad_row = host.first_bad_row;
  return t;
}

void ce_softmax_grad(void* d, DType d_dt, int64_t ld_d, const void* x, DType x_dt, int64_t ld_x,
                     const int32_t* targets, const float* lse, float scale, int64_t rows,
                     int64_t v0, int64_t nv) {
  if (rows == 0 || nv == 0) return;
  using bf16 = __nv_bfloat16;
  const bool xf = x_dt == DType::f32, df = d_dt == DType::f32;
  BB_CHECK((xf || x_dt == DType::bf16) && (df || d_dt == DType::bf16),
           "cross-entropy gradient on CUDA: dtypes ", dtype_name(x_dt), " -> ", dtype_name(d_dt),
           " are not supported (f32 or bf16)");
  if (xf && df) launch_grad<float, float>(d, ld_d, x, ld_x, targets, lse, scale, rows, v0, nv);
  else if (xf) launch_grad<float, bf16>(d, ld_d, x, ld_x, targets, lse, scale, rows, v0, nv);
  else if (df) launch_grad<bf16, float>(d, ld_d, x, ld_x, targets, lse, scale, rows, v0, nv);
  else launch_grad<bf16, bf16>(d, ld_d, x, ld_x, targets, lse, scale, rows, v0, nv);
}

}  // namespace bb::cuda

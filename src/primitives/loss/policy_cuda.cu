// policy_cuda.cu — the policy loss's kernels (policy_cuda.h): the row sweep's row kernel and the
// vocab sweep's column-statistics, row-terms and column-gradient kernels.
//
// NOTES: row kernel: one block per row. Sweep 1 keeps an online (max, sum of exp, sum of exp x z) per thread
// (the sums in double: V up to ~250K terms), merged over the block; thread 0 then evaluates the
// token's objective (policy::token_terms, the CPU path's function) and shares the two upstream
// gradients. Sweep 2 recomputes p from the row and writes the gradient. In place with a bf16
// gradient, step k writes bf16 columns [k B, (k + 1) B), i.e. bytes of f32 columns below
// (k + 1) B / 2, all read at steps <= k; the barrier between each step's reads and its writes
// keeps every read ahead of any write that could cover it (ce_fused_rows' argument, one element
// per thread per step). The vocab sweep's kernels take a warp per row of a column block; the
// same in-place argument holds per warp step (a warp barrier between reads and writes).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/loss/policy_cuda.h"
#include "primitives/loss/policy_terms.h"

namespace bb::cuda {

namespace {

constexpr int kThreads = 512;

struct Lse3 {
  float m;
  double s, sz;  // sum exp(z - m), sum exp(z - m) z
};

__device__ __forceinline__ void lse3_add(Lse3& a, float z) {
  if (z > a.m) {
    const double k = a.m == -INFINITY ? 0.0 : exp(static_cast<double>(a.m - z));
    a.s = a.s * k + 1.0;
    a.sz = a.sz * k + z;
    a.m = z;
  } else {
    const double e = exp(static_cast<double>(z - a.m));
    a.s += e;
    a.sz += e * z;
  }
}

__device__ __forceinline__ void lse3_merge(Lse3& a, const Lse3& b) {
  if (b.m == -INFINITY) return;
  if (a.m == -INFINITY) {
    a = b;
    return;
  }
  const float M = fmaxf(a.m, b.m);
  const double ka = exp(static_cast<double>(a.m - M)), kb = exp(static_cast<double>(b.m - M));
  a.s = a.s * ka + b.s * kb;
  a.sz = a.sz * ka + b.sz * kb;
  a.m = M;
}

// Merge over a warp (lane 0 gets the result).
__device__ __forceinline__ void warp_lse3(Lse3& a) {
  for (int off = 16; off > 0; off >>= 1) {
    Lse3 o;
    o.m = __shfl_down_sync(0xffffffffu, a.m, off);
    o.s = __shfl_down_sync(0xffffffffu, a.s, off);
    o.sz = __shfl_down_sync(0xffffffffu, a.sz, off);
    lse3_merge(a, o);
  }
}

// Block-wide merge; every thread gets the result. Contains barriers.
__device__ Lse3 block_lse3(Lse3 a) {
  __shared__ float sm[32];
  __shared__ double ss[32], ssz[32];
  warp_lse3(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    sm[warp] = a.m;
    ss[warp] = a.s;
    ssz[warp] = a.sz;
  }
  __syncthreads();
  if (warp == 0) {
    Lse3 b{lane < warps ? sm[lane] : -INFINITY, lane < warps ? ss[lane] : 0.0, lane < warps ? ssz[lane] : 0.0};
    warp_lse3(b);
    if (lane == 0) {
      sm[0] = b.m;
      ss[0] = b.s;
      ssz[0] = b.sz;
    }
  }
  __syncthreads();
  return Lse3{sm[0], ss[0], ssz[0]};
}

// One valid row's objective from its log-prob and entropy: the statistics st[kPolicyStats] and
// the gradient's factors g = {scale w g_lp, scale w g_H}.
__device__ void row_terms(float* st, double logp, double ent, int64_t r, const PolicyLossConfig& c,
                          const PolicyRowInputs& in, float scale, double* g) {
  const double w = in.weight ? static_cast<double>(in.weight[r]) : 1.0;
  const policy::TokenTerms t =
      policy::token_terms(c, logp, ent, in.adv ? in.adv[r] : 0.0, in.old ? in.old[r] : NAN, in.ref ? in.ref[r] : NAN,
                          in.seq_lr ? in.seq_lr[r] : NAN);
  st[kStatLoss] = static_cast<float>(w * t.loss);
  st[kStatLogp] = static_cast<float>(logp);
  st[kStatEntropy] = static_cast<float>(ent);
  st[kStatRatio] = static_cast<float>(t.ratio);
  st[kStatClipped] = t.clipped ? 1.0f : 0.0f;
  st[kStatDual] = t.dual_clipped ? 1.0f : 0.0f;
  st[kStatApproxKl] = static_cast<float>(t.ratio - 1.0 - t.log_ratio);
  st[kStatRefKl] = static_cast<float>(t.ref_kl);
  st[kStatValid] = 1.0f;
  st[kStatBadTarget] = 0.0f;
  g[0] = static_cast<double>(scale) * w * t.d_logp;
  g[1] = static_cast<double>(scale) * w * t.d_entropy;
}

template <class TO>
__global__ void __launch_bounds__(kThreads)
    policy_rows_kernel(float* __restrict__ x, int64_t V, bool write_grad, const int32_t* __restrict__ targets,
                       PolicyLossConfig c, PolicyRowInputs in, float scale, float* __restrict__ stats) {
  constexpr bool kNarrow = sizeof(TO) < sizeof(float);
  const int64_t r = blockIdx.x;
  float* xr = x + r * V;
  TO* dr = reinterpret_cast<TO*>(xr);
  float* st = stats + r * kPolicyStats;
  const int64_t tg = targets[r];
  const int64_t nthreads = blockDim.x;
  if (tg < 0 || tg >= V) {  // masked (or a bad target, reported by the caller): zero gradient
    if (write_grad)
      for (int64_t j = threadIdx.x; j < V; j += nthreads) dr[j] = from_f32<TO>(0.0f);
    if (threadIdx.x < kPolicyStats) st[threadIdx.x] = threadIdx.x == kStatBadTarget && tg >= V ? 1.0f : 0.0f;
    return;
  }
  const float inv = static_cast<float>(1.0 / c.temperature);
  __shared__ float sh_target;
  __shared__ double sh_g[2];
  if (threadIdx.x == 0) sh_target = xr[tg] * inv;  // read before the barriers that precede any write

  Lse3 a{-INFINITY, 0.0, 0.0};
  for (int64_t j = threadIdx.x; j < V; j += nthreads) lse3_add(a, xr[j] * inv);
  a = block_lse3(a);
  const double lse = static_cast<double>(a.m) + log(a.s);
  const double ent = lse - a.sz / a.s;
  if (threadIdx.x == 0) row_terms(st, static_cast<double>(sh_target) - lse, ent, r, c, in, scale, sh_g);
  __syncthreads();
  if (!write_grad) return;
  const float g_lp = static_cast<float>(sh_g[0]), g_h = static_cast<float>(sh_g[1]);
  const float lse_f = static_cast<float>(lse), ent_f = static_cast<float>(ent);
  // Every thread runs the same number of steps (the barrier below is reached by all).
  for (int64_t base = 0; base < V; base += nthreads) {
    const int64_t j = base + threadIdx.x;
    float d = 0.0f;
    if (j < V) {
      const float lp = xr[j] * inv - lse_f;
      const float p = expf(lp);
      d = -g_lp * p - g_h * p * (lp + ent_f);
      if (j == tg) d += g_lp;
      d *= inv;
    }
    if constexpr (kNarrow) __syncthreads();
    if (j < V) dr[j] = from_f32<TO>(d);
  }
}

// ---- The vocab sweep: one warp per row of a [rows, cols] column block. ----

constexpr int kColWarps = 8;  // rows per thread block

// A row's partial statistics in the shifted form: max m, s = sum exp(z - m), sz = sum exp(z - m)
// (z - m); s = 0 when empty. Exponentials in f32 (each term to ~1 ulp), sums in f64.
struct ColAcc {
  float m;
  double s, sz;
};

__device__ __forceinline__ void col_add(ColAcc& a, float z) {
  if (z > a.m) {
    if (a.s != 0.0) {
      const double d = static_cast<double>(a.m) - static_cast<double>(z);
      const double k = exp(d);
      a.sz = k * (a.sz + d * a.s);
      a.s *= k;
    }
    a.m = z;
  }
  const float d = z - a.m;
  const double e = static_cast<double>(expf(d));
  a.s += e;
  a.sz += e * static_cast<double>(d);
}

// VEC = 4: float4 loads (cols % 4 == 0, so every row starts 16-byte aligned); VEC = 1: scalar.
template <int VEC>
__global__ void __launch_bounds__(kColWarps * 32)
    policy_col_stats_kernel(const float* __restrict__ x, int64_t cols, int64_t v0, int64_t V,
                            const int32_t* __restrict__ targets, float inv, bool first, int64_t rows,
                            double* __restrict__ acc) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kColWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t tg = targets[r];
  if (tg < 0 || tg >= V) return;
  const float* xr = x + r * cols;
  ColAcc a{-INFINITY, 0.0, 0.0};
  if constexpr (VEC == 4) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t j = lane; j < cols / 4; j += 32) {
      const float4 v = x4[j];
      col_add(a, v.x * inv);
      col_add(a, v.y * inv);
      col_add(a, v.z * inv);
      col_add(a, v.w * inv);
    }
  } else {
    for (int64_t j = lane; j < cols; j += 32) col_add(a, xr[j] * inv);
  }
  double m = a.s == 0.0 ? 0.0 : static_cast<double>(a.m), s = a.s, sz = a.sz;
  for (int off = 16; off > 0; off >>= 1) {
    const double om = __shfl_down_sync(0xffffffffu, m, off), os = __shfl_down_sync(0xffffffffu, s, off),
                 osz = __shfl_down_sync(0xffffffffu, sz, off);
    policy::merge_shifted(m, s, sz, om, os, osz);
  }
  if (lane != 0) return;
  double* ar = acc + r * 4;
  if (first) {
    ar[0] = m, ar[1] = s, ar[2] = sz, ar[3] = 0.0;
  } else {
    policy::merge_shifted(ar[0], ar[1], ar[2], m, s, sz);  // the running max in f64
  }
  if (tg >= v0 && tg < v0 + cols) ar[3] = static_cast<double>(xr[tg - v0] * inv);
}

__global__ void policy_row_terms_kernel(const double* __restrict__ acc, int64_t V, const int32_t* __restrict__ targets,
                                        PolicyLossConfig c, PolicyRowInputs in, float scale, int64_t rows,
                                        float* __restrict__ stats, float* __restrict__ coef) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float* st = stats + r * kPolicyStats;
  float* cf = coef + r * 4;
  const int64_t tg = targets[r];
  if (tg < 0 || tg >= V) {
    for (int k = 0; k < kPolicyStats; ++k) st[k] = k == kStatBadTarget && tg >= V ? 1.0f : 0.0f;
    cf[0] = cf[1] = cf[2] = cf[3] = 0.0f;
    return;
  }
  const double* ar = acc + r * 4;
  const double ls = log(ar[1]), lse = ar[0] + ls, ent = ls - ar[2] / ar[1];
  double g[2];
  row_terms(st, ar[3] - lse, ent, r, c, in, scale, g);
  cf[0] = static_cast<float>(lse);
  cf[1] = static_cast<float>(ent);
  cf[2] = static_cast<float>(g[0]);
  cf[3] = static_cast<float>(g[1]);
}

// In place with a bf16 gradient, step k reads f32 columns [k S, (k + 1) S) (S = 32 VEC) and writes
// bf16 columns [k S, (k + 1) S), i.e. the bytes of f32 columns below (k + 1) S / 2, all read at
// steps <= k; the warp barrier between each step's reads and its writes orders them.
template <class TO, int VEC>
__global__ void __launch_bounds__(kColWarps * 32)
    policy_col_grad_kernel(float* __restrict__ x, int64_t cols, int64_t v0, const int32_t* __restrict__ targets,
                           float inv, const float* __restrict__ coef, int64_t rows) {
  constexpr bool kNarrow = sizeof(TO) < sizeof(float);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kColWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float* xr = x + r * cols;
  TO* dr = reinterpret_cast<TO*>(xr);
  const float* cf = coef + r * 4;
  const float lse = cf[0], ent = cf[1], g_lp = cf[2], g_h = cf[3];
  const bool zero = g_lp == 0.0f && g_h == 0.0f;  // a masked row (its lse is not a row's)
  const int64_t tcol = targets[r] - v0;
  auto grad = [&](float xv, int64_t j) {
    const float lp = xv * inv - lse;
    const float p = expf(lp);
    float d = -g_lp * p - g_h * p * (lp + ent);
    if (j == tcol) d += g_lp;
    return d * inv;
  };
  constexpr int64_t S = 32 * VEC;
  for (int64_t base = 0; base < cols; base += S) {  // the same steps on every lane
    const int64_t j = base + lane * VEC;
    float d[VEC];
    if constexpr (VEC == 4) {
      if (j < cols) {
        const float4 v = *reinterpret_cast<const float4*>(xr + j);
        d[0] = zero ? 0.0f : grad(v.x, j);
        d[1] = zero ? 0.0f : grad(v.y, j + 1);
        d[2] = zero ? 0.0f : grad(v.z, j + 2);
        d[3] = zero ? 0.0f : grad(v.w, j + 3);
      }
    } else {
      if (j < cols) d[0] = zero ? 0.0f : grad(xr[j], j);
    }
    if constexpr (kNarrow) __syncwarp();
    if (j < cols)
      for (int k = 0; k < VEC; ++k) dr[j + k] = from_f32<TO>(d[k]);
  }
}

}  // namespace

void policy_col_stats(const float* x, int64_t cols, int64_t v0, int64_t V, const int32_t* targets, double temperature,
                      bool first, int64_t rows, double* acc) {
  if (rows == 0 || cols == 0) return;
  const unsigned grid = static_cast<unsigned>(ceil_div(rows, int64_t{kColWarps}));
  const float inv = static_cast<float>(1.0 / temperature);
  if (cols % 4 == 0)
    policy_col_stats_kernel<4><<<grid, kColWarps * 32, 0, stream()>>>(x, cols, v0, V, targets, inv, first, rows, acc);
  else
    policy_col_stats_kernel<1><<<grid, kColWarps * 32, 0, stream()>>>(x, cols, v0, V, targets, inv, first, rows, acc);
  BB_CHECK_LAUNCH();
}

void policy_row_terms(const double* acc, int64_t V, const int32_t* targets, const PolicyLossConfig& cfg,
                      const PolicyRowInputs& in, float scale, int64_t rows, float* stats, float* coef) {
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>(ceil_div(rows, int64_t{256}));
  policy_row_terms_kernel<<<grid, 256, 0, stream()>>>(acc, V, targets, cfg, in, scale, rows, stats, coef);
  BB_CHECK_LAUNCH();
}

void policy_col_grad(float* x, int64_t cols, int64_t v0, const int32_t* targets, double temperature,
                     const float* coef, DType d_dt, int64_t rows) {
  if (rows == 0 || cols == 0) return;
  BB_CHECK(d_dt == DType::f32 || d_dt == DType::bf16, "policy loss on CUDA: gradient dtype ", dtype_name(d_dt),
           " is not supported (f32 or bf16)");
  const unsigned grid = static_cast<unsigned>(ceil_div(rows, int64_t{kColWarps}));
  const float inv = static_cast<float>(1.0 / temperature);
  const int threads = kColWarps * 32;
  const bool v4 = cols % 4 == 0;
  if (d_dt == DType::f32) {
    if (v4) policy_col_grad_kernel<float, 4><<<grid, threads, 0, stream()>>>(x, cols, v0, targets, inv, coef, rows);
    else policy_col_grad_kernel<float, 1><<<grid, threads, 0, stream()>>>(x, cols, v0, targets, inv, coef, rows);
  } else {
    if (v4) policy_col_grad_kernel<bf16_t, 4><<<grid, threads, 0, stream()>>>(x, cols, v0, targets, inv, coef, rows);
    else policy_col_grad_kernel<bf16_t, 1><<<grid, threads, 0, stream()>>>(x, cols, v0, targets, inv, coef, rows);
  }
  BB_CHECK_LAUNCH();
}

void policy_rows(float* x, int64_t V, DType d_dt, bool write_grad, const int32_t* targets, const PolicyLossConfig& cfg,
                 const PolicyRowInputs& in, float scale, int64_t rows, float* stats) {
  if (rows == 0) return;
  BB_CHECK(d_dt == DType::f32 || d_dt == DType::bf16, "policy loss on CUDA: gradient dtype ", dtype_name(d_dt),
           " is not supported (f32 or bf16)");
  const unsigned grid = static_cast<unsigned>(rows);
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, ceil_div(V, 32) * 32)));
  if (d_dt == DType::f32)
    policy_rows_kernel<float><<<grid, threads, 0, stream()>>>(x, V, write_grad, targets, cfg, in, scale, stats);
  else
    policy_rows_kernel<bf16_t><<<grid, threads, 0, stream()>>>(x, V, write_grad, targets, cfg, in, scale, stats);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

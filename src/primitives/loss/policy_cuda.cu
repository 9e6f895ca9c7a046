// policy_cuda.cu — the policy loss's row kernel (policy_cuda.h).
//
// NOTES: one block per row. Sweep 1 keeps an online (max, sum of exp, sum of exp x z) per thread
// (the sums in double: V up to ~250K terms), merged over the block; thread 0 then evaluates the
// token's objective (policy::token_terms, the CPU path's function) and shares the two upstream
// gradients. Sweep 2 recomputes p from the row and writes the gradient. In place with a bf16
// gradient, step k writes bf16 columns [k B, (k + 1) B), i.e. bytes of f32 columns below
// (k + 1) B / 2, all read at steps <= k; the barrier between each step's reads and its writes
// keeps every read ahead of any write that could cover it (ce_fused_rows' argument, one element
// per thread per step).
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
  if (threadIdx.x == 0) {
    const double logp = static_cast<double>(sh_target) - lse;
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
    sh_g[0] = static_cast<double>(scale) * w * t.d_logp;
    sh_g[1] = static_cast<double>(scale) * w * t.d_entropy;
  }
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

}  // namespace

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

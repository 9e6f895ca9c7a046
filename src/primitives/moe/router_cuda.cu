// router_cuda.cu — CUDA router: one warp per token for scores, (group) top-k, weights and the
// loss partial sums; a one-block kernel reduces the partials; a warp-per-token backward.
//
// Legend: T tokens, E experts, K top-k, G expert groups, B forward blocks.
// NOTES: selection must be bit-identical to ref::router_select on the same fp32 logits, so the
// scores are computed as the CPU does (softmax: max in f32, exp((double)(l - m)) summed in
// double, quotient rounded to f32; sigmoid: the same split-by-sign formula in f32) and every
// argmax breaks ties toward the lower index. The aux-loss column sums and the z-loss sums are
// accumulated per warp in token order, then per block in warp order, then across blocks in
// block order: no float atomics, so the losses are deterministic. The grid size depends on T
// and the config only. router_backward WRITES d_logits (=).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "primitives/moe/router_cuda.h"

namespace bb::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxWarps = 8;
constexpr int64_t kMaxBlocks = 512;
constexpr size_t kSmemLimit = 48 * 1024;

struct Params {
  int E, K, G, topk_groups, group_size;
  bool sigmoid, norm;
  float scaling;
};

Params make_params(const RouterConfig& cfg) {
  Params p;
  p.E = cfg.num_experts;
  p.K = cfg.top_k;
  p.G = cfg.num_groups;
  p.topk_groups = cfg.topk_groups;
  p.group_size = cfg.num_experts / cfg.num_groups;
  p.sigmoid = cfg.score == RouterScore::sigmoid;
  p.norm = cfg.norm_topk_prob;
  p.scaling = cfg.routed_scaling;
  return p;
}

// Per-warp shared memory of the forward: byte offsets of each array.
struct WarpSmem {
  size_t colsum, sc, sel, gsc, idx, flag, gflag, total;
};
__host__ __device__ inline WarpSmem warp_smem(int E, int K, int G) {
  WarpSmem w;
  size_t o = 0;
  w.colsum = o;  // double [E]: this warp's sum over its tokens of p_te
  o += 8 * static_cast<size_t>(E);
  w.sc = o;  // float [E]: scores of the current token
  o += 4 * static_cast<size_t>(E);
  w.sel = o;  // float [E]: selection scores (scores + bias)
  o += 4 * static_cast<size_t>(E);
  w.gsc = o;  // float [G]: group scores
  o += 4 * static_cast<size_t>(G);
  w.idx = o;  // int [K]: the selection of the current token
  o += 4 * static_cast<size_t>(K);
  w.flag = o;  // u8 [E]: 1 = taken or not eligible
  o += static_cast<size_t>(E);
  w.gflag = o;  // u8 [G]: 1 = group already chosen
  o += static_cast<size_t>(G);
  w.total = (o + 15) & ~size_t(15);
  return w;
}

int forward_warps(const RouterConfig& cfg) {
  const WarpSmem w = warp_smem(cfg.num_experts, cfg.top_k, cfg.num_groups);
  const size_t per_warp = w.total + 8;  // + the warp's z partial
  BB_CHECK(per_warp + 16 <= kSmemLimit, "router_forward on CUDA: E = ", cfg.num_experts,
           " needs ", per_warp, " bytes of shared memory per token, more than ", kSmemLimit);
  return static_cast<int>(std::min<size_t>(kMaxWarps, (kSmemLimit - 16) / per_warp));
}

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}
// The xor butterfly leaves the same value in every lane (fp addition is commutative).
__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// (ov, oi) replaces (v, i) if it is a candidate (oi >= 0) and larger, or equal with a lower id.
__device__ __forceinline__ void keep_better(float& v, int& i, float ov, int oi) {
  if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
    v = ov;
    i = oi;
  }
}
// Warp-wide argmax of (v, i) pairs, ties to the lower index; -1 when no lane has a candidate.
__device__ __forceinline__ int warp_argmax(float v, int i) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, off);
    const int oi = __shfl_xor_sync(kFull, i, off);
    keep_better(v, i, ov, oi);
  }
  return i;
}

// ref::stable_sigmoid in f32.
__device__ __forceinline__ float stable_sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

// given: a selection decided earlier ([T, K], replay): used instead of the top-k search; then
// topk_idx and counts may be null (nothing to write).
__global__ void router_fwd_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                  const int32_t* __restrict__ given,
                                  float* __restrict__ scores_out, int32_t* __restrict__ topk_idx,
                                  float* __restrict__ topk_prob, double* __restrict__ part_col,
                                  double* __restrict__ part_z, int32_t* __restrict__ counts,
                                  int64_t T, Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = p.E, K = p.K, G = p.G;
  const WarpSmem L = warp_smem(E, K, G);
  unsigned char* base = smem + warp * L.total;
  double* colsum = reinterpret_cast<double*>(base + L.colsum);
  float* sc = reinterpret_cast<float*>(base + L.sc);
  float* sel = reinterpret_cast<float*>(base + L.sel);
  float* gsc = reinterpret_cast<float*>(base + L.gsc);
  int* sidx = reinterpret_cast<int*>(base + L.idx);
  unsigned char* flag = base + L.flag;
  unsigned char* gflag = base + L.gflag;
  double* zw = reinterpret_cast<double*>(smem + warps * L.total);

  for (int e = lane; e < E; e += 32) colsum[e] = 0.0;
  double zacc = 0.0;  // lane 0: sum of lse^2 over this warp's tokens

  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < T;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* l = logits + t * E;
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);

    // Scores, exactly as ref::router_scores computes them in f32.
    if (p.sigmoid) {
      for (int e = lane; e < E; e += 32) sc[e] = stable_sigmoid(l[e]);
    } else {
      double sum = 0.0;
      for (int e = lane; e < E; e += 32) sum += exp(static_cast<double>(l[e] - m));
      sum = warp_sum(sum);
      for (int e = lane; e < E; e += 32)
        sc[e] = static_cast<float>(exp(static_cast<double>(l[e] - m)) / sum);
    }
    // z loss: lse in double, as ref::router_z_loss.
    {
      const double md = static_cast<double>(m);
      double z = 0.0;
      for (int e = lane; e < E; e += 32) z += exp(static_cast<double>(l[e]) - md);
      z = warp_sum(z);
      const double lse = md + log(z);
      zacc += lse * lse;
    }
    for (int e = lane; e < E; e += 32) {
      sel[e] = sc[e] + (bias ? bias[e] : 0.0f);
      flag[e] = 0;
    }
    __syncwarp();

    if (given) {
      for (int k = lane; k < K; k += 32) sidx[k] = given[t * K + k];
      __syncwarp();
    } else if (G > 1) {
      // Group score: sum of the group's two best selection scores (ties do not change it).
      const int gs = p.group_size;
      for (int g = lane; g < G; g += 32) {
        const float* s = sel + g * gs;
        int b1 = 0;
        for (int j = 1; j < gs; ++j)
          if (s[j] > s[b1]) b1 = j;
        int b2 = -1;
        for (int j = 0; j < gs; ++j)
          if (j != b1 && (b2 < 0 || s[j] > s[b2])) b2 = j;
        gsc[g] = s[b1] + (b2 >= 0 ? s[b2] : 0.0f);
        gflag[g] = 0;
      }
      __syncwarp();
      for (int i = 0; i < p.topk_groups; ++i) {
        float v = 0.0f;
        int bi = -1;
        for (int g = lane; g < G; g += 32)
          if (!gflag[g]) keep_better(v, bi, gsc[g], g);
        bi = warp_argmax(v, bi);
        if (lane == 0) gflag[bi] = 1;
        __syncwarp();
      }
      for (int e = lane; e < E; e += 32) flag[e] = gflag[e / gs] ? 0 : 1;
      __syncwarp();
    }

    for (int k = 0; k < K && !given; ++k) {
      float v = 0.0f;
      int bi = -1;
      for (int e = lane; e < E; e += 32)
        if (!flag[e]) keep_better(v, bi, sel[e], e);
      bi = warp_argmax(v, bi);
      if (lane == 0) {
        sidx[k] = bi;
        flag[bi] = 1;
      }
      __syncwarp();
    }

    // Weights: the denominator summed in k order in f32, as ref::router_weights.
    float denom = 1.0f;
    if (p.norm) {
      denom = 0.0f;
      for (int k = 0; k < K; ++k) denom += sc[sidx[k]];
    }
    for (int k = lane; k < K; k += 32) {
      const int e = sidx[k];
      if (topk_idx) topk_idx[t * K + k] = e;
      topk_prob[t * K + k] = p.scaling * sc[e] / denom;
      if (counts) atomicAdd(&counts[e], 1);
    }

    // Aux loss: p = scores (softmax) or scores / sum_e scores (sigmoid).
    double pden = 1.0;
    if (p.sigmoid) {
      double s = 0.0;
      for (int e = lane; e < E; e += 32) s += static_cast<double>(sc[e]);
      pden = warp_sum(s);
    }
    for (int e = lane; e < E; e += 32) {
      colsum[e] += static_cast<double>(sc[e]) / pden;
      if (scores_out) scores_out[t * E + e] = sc[e];
    }
    __syncwarp();
  }

  if (lane == 0) zw[warp] = zacc;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double acc = 0.0;
    for (int w = 0; w < warps; ++w)
      acc += reinterpret_cast<const double*>(smem + w * L.total + L.colsum)[e];
    part_col[static_cast<int64_t>(blockIdx.x) * E + e] = acc;
  }
  if (threadIdx.x == 0) {
    double z = 0.0;
    for (int w = 0; w < warps; ++w) z += zw[w];
    part_z[blockIdx.x] = z;
  }
}

constexpr int kFinalThreads = 256;

// Sum of v over threads in a fixed tree order (blockDim.x a power of two <= kFinalThreads).
__device__ double block_tree_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) red[threadIdx.x] += red[threadIdx.x + h];
    __syncthreads();
  }
  const double out = red[0];
  __syncthreads();
  return out;
}

// Stage 1, one block per expert e (and block E for the z partials): the column sum of the
// forward blocks' partials, each thread a fixed stride of them, then a fixed tree. (A single
// block looping over all partials per expert took ~0.2 ms on an H200: a chain of dependent
// loads.) Expert e's term (counts_e / T) (col_e / T) goes to terms[e], the z sum to terms[E].
__global__ void router_finalize_cols_kernel(const double* __restrict__ part_col,
                                            const double* __restrict__ part_z,
                                            int64_t num_blocks, int64_t T, int E,
                                            const unsigned char* __restrict__ stats,
                                            double* __restrict__ terms) {
  __shared__ double red[kFinalThreads];
  const int e = blockIdx.x;
  double acc = 0.0;
  for (int64_t b = threadIdx.x; b < num_blocks; b += blockDim.x)
    acc += e < E ? part_col[b * E + e] : part_z[b];
  const double sum = block_tree_sum(acc, red);
  if (threadIdx.x != 0) return;
  if (e == E) {
    terms[E] = sum;
    return;
  }
  const int32_t* counts =
      reinterpret_cast<const int32_t*>(stats + RouterStatsLayout::kCountsOffset);
  const double nt = static_cast<double>(T);
  terms[e] = (static_cast<double>(counts[e]) / nt) * (sum / nt);
}

// Stage 2, one block: aux = E * sum_e terms[e] (fixed order), z = terms[E] / T.
__global__ void router_finalize_kernel(const double* __restrict__ terms, int64_t T, int E,
                                       unsigned char* stats) {
  __shared__ double red[kFinalThreads];
  double acc = 0.0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) acc += terms[e];
  const double s = block_tree_sum(acc, red);
  if (threadIdx.x == 0) {
    *reinterpret_cast<double*>(stats + RouterStatsLayout::kAuxOffset) = static_cast<double>(E) * s;
    *reinterpret_cast<double*>(stats + RouterStatsLayout::kZOffset) = terms[E] / static_cast<double>(T);
  }
}

__global__ void count_kernel(const int32_t* __restrict__ idx, int64_t n, int E,
                             int32_t* __restrict__ counts) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int v = idx[i];
    if (v >= 0 && v < E) atomicAdd(&counts[v], 1);
  }
}

__global__ void router_bwd_kernel(float* __restrict__ d_logits, const float* __restrict__ dw,
                                  const float* __restrict__ logits,
                                  const float* __restrict__ scores,
                                  const int32_t* __restrict__ topk_idx,
                                  const int32_t* __restrict__ counts, int64_t T, Params p,
                                  double d_aux, double d_z) {
  extern __shared__ __align__(16) float fsmem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = p.E, K = p.K;
  const double nt = static_cast<double>(T);
  float* dp_aux = fsmem;               // [E]: d aux / d p_te = d_aux * E * count_e / T^2
  float* ds = fsmem + E + warp * E;    // [E] per warp: d loss / d scores of the current token
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    dp_aux[e] = static_cast<float>(d_aux * static_cast<double>(static_cast<int64_t>(E) * counts[e]) /
                                   (nt * nt));
  __syncthreads();
  const float c = p.scaling;

  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < T;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* s = scores + t * E;
    const float* l = logits + t * E;
    const int32_t* idx = topk_idx + t * K;
    for (int e = lane; e < E; e += 32) ds[e] = 0.0f;
    __syncwarp();
    // Combine-weight path, serial in k like the reference (K is small; an expert may repeat).
    if (dw && lane == 0) {
      const float* g = dw + t * K;
      if (p.norm) {
        float S = 0.0f, dot = 0.0f;
        for (int k = 0; k < K; ++k) {
          S += s[idx[k]];
          dot += g[k] * s[idx[k]];
        }
        for (int k = 0; k < K; ++k) ds[idx[k]] += c * (g[k] / S - dot / (S * S));
      } else {
        for (int k = 0; k < K; ++k) ds[idx[k]] += c * g[k];
      }
    }
    __syncwarp();
    // Aux path through p (from here on each lane touches only its own experts).
    if (!p.sigmoid) {
      for (int e = lane; e < E; e += 32) ds[e] += dp_aux[e];
    } else {
      float S = 0.0f;
      for (int e = lane; e < E; e += 32) S += s[e];
      S = warp_sum(S);
      float dot = 0.0f;
      for (int e = lane; e < E; e += 32) dot += dp_aux[e] * s[e] / S;
      dot = warp_sum(dot);
      for (int e = lane; e < E; e += 32) ds[e] += (dp_aux[e] - dot) / S;
    }
    // Scores -> logits.
    float dot = 0.0f;
    if (!p.sigmoid) {
      for (int e = lane; e < E; e += 32) dot += ds[e] * s[e];
      dot = warp_sum(dot);
    }
    double lse = 0.0;
    if (d_z != 0.0) {
      float m = -INFINITY;
      for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
      const double md = static_cast<double>(warp_max(m));
      double z = 0.0;
      for (int e = lane; e < E; e += 32) z += exp(static_cast<double>(l[e]) - md);
      lse = md + log(warp_sum(z));
    }
    for (int e = lane; e < E; e += 32) {
      float g = p.sigmoid ? ds[e] * s[e] * (1.0f - s[e]) : s[e] * (ds[e] - dot);
      if (d_z != 0.0)
        g += static_cast<float>(d_z * 2.0 * lse * exp(static_cast<double>(l[e]) - lse) / nt);
      d_logits[t * E + e] = g;
    }
    __syncwarp();
  }
}

}  // namespace

int64_t router_num_blocks(int64_t T, const RouterConfig& cfg) {
  const int warps = forward_warps(cfg);
  return std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, ceil_div(T, warps)));
}

size_t router_partials_bytes(int64_t T, const RouterConfig& cfg) {
  // Per forward block: E column partials and one z partial; then E + 1 finalize terms.
  return (static_cast<size_t>(router_num_blocks(T, cfg)) + 1) * (cfg.num_experts + 1) *
         sizeof(double);
}

void router_forward(const float* logits, const float* bias, float* scores, int32_t* topk_idx,
                    float* topk_prob, void* partials, void* stats, int64_t T,
                    const RouterConfig& cfg, const int32_t* given) {
  const Params p = make_params(cfg);
  const int warps = forward_warps(cfg);
  const int64_t blocks = router_num_blocks(T, cfg);
  const WarpSmem L = warp_smem(p.E, p.K, p.G);
  // + 16: slack for 16-byte vectorised shared reads at the end of the last array.
  const size_t smem = warps * L.total + warps * sizeof(double) + 16;
  unsigned char* st = static_cast<unsigned char*>(stats);
  double* part_col = static_cast<double*>(partials);
  double* part_z = part_col + blocks * p.E;
  if (given) {  // replay: weights and scores only, no losses, no counts
    router_fwd_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream()>>>(
        logits, bias, given, scores, nullptr, topk_prob, part_col, part_z, nullptr, T, p);
    BB_CHECK_LAUNCH();
    return;
  }
  int32_t* counts = reinterpret_cast<int32_t*>(st + RouterStatsLayout::kCountsOffset);
  memset_zero(stats, RouterStatsLayout::bytes(p.E));
  router_fwd_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream()>>>(
      logits, bias, nullptr, scores, topk_idx, topk_prob, part_col, part_z, counts, T, p);
  BB_CHECK_LAUNCH();
  // The E + 1 terms go after the partials (router_partials_bytes counts them).
  double* terms = part_z + blocks;
  router_finalize_cols_kernel<<<static_cast<unsigned>(p.E + 1), kFinalThreads, 0, stream()>>>(
      part_col, part_z, blocks, T, p.E, st, terms);
  BB_CHECK_LAUNCH();
  router_finalize_kernel<<<1, kFinalThreads, 0, stream()>>>(terms, T, p.E, st);
  BB_CHECK_LAUNCH();
}

void router_backward(float* d_logits, const float* d_topk_prob, double d_aux, double d_z,
                     const float* logits, const float* scores, const int32_t* topk_idx,
                     int32_t* counts, int64_t T, const RouterConfig& cfg) {
  const Params p = make_params(cfg);
  memset_zero(counts, sizeof(int32_t) * p.E);
  const int64_t n = T * p.K;
  count_kernel<<<static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 1024)), 256, 0,
                 stream()>>>(topk_idx, n, p.E, counts);
  BB_CHECK_LAUNCH();
  // Shared memory: dp_aux [E] + one [E] row per warp.
  const size_t row = 4 * static_cast<size_t>(p.E);
  BB_CHECK(2 * row + 16 <= kSmemLimit, "router_backward on CUDA: E = ", p.E, " is too large (needs ",
           2 * row, " bytes of shared memory, limit ", kSmemLimit, ")");
  const int warps = static_cast<int>(std::min<size_t>(kMaxWarps, (kSmemLimit - row - 16) / row));
  const int64_t blocks = std::min<int64_t>(ceil_div(T, warps), 4096);
  router_bwd_kernel<<<static_cast<unsigned>(blocks), warps * 32, row * (1 + warps) + 16, stream()>>>(
      d_logits, d_topk_prob, logits, scores, topk_idx, counts, T, p, d_aux, d_z);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

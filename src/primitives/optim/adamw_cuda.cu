// adamw_cuda.cu — the fused AdamW update (one read and one write of every state, the model
// weights written in the same pass; f32 moments, or bf16 moments stochastically rounded with the
// CPU path's random bits) and deterministic sums of squares for gradient norms.
//
// Sums of squares: stage 1 cuts the tensor into slices of kSliceAccesses vector accesses per
// thread (slice j: vector accesses [j, j + 1) * kThreads * kSliceAccesses, thread t takes
// accesses t, t + kThreads, ...; the scalar tail goes to thread 0 of the last slice) and writes
// one double per slice; stage 2 adds the slices in a fixed order. The partition depends on n
// (and the vector width) only, not on the grid, so the update can add the squares of the
// gradient it reads anyway (adamw_step_sum_squares) and give bitwise the standalone sum. No
// float atomics, so a norm is bitwise reproducible run to run. Squares are accumulated in
// double (the FP64 rate is far above what memory bandwidth feeds).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "primitives/optim/adamw_cuda.h"
#include "primitives/optim/moment_rounding.h"
#include "primitives/optim/split_master.h"

namespace bb::cuda {
namespace {

constexpr int kThreads = 256;

// Weight decay applies to the call's elements [0, decay_end) (a whole unit in one call: its
// weight-decayed elements come first); the factor 1 of the others is exact.
__device__ __forceinline__ float decay_of(const AdamWScalars& s, int64_t i) {
  return i < s.decay_end ? s.decay : 1.0f;
}

// The master's fp32 values of elements [i, i + M): f32 at p, or (kSplit) joined from the bf16
// model (upper half) and the i16 remainder at p (adamw.h: bits = (hi << 16) + lo).
template <int M, bool kSplit, class TM>
__device__ __forceinline__ void load_master(const void* p, const TM* model, int64_t i, float (&pv)[M]) {
  if constexpr (kSplit) {
    static_assert(std::is_same_v<TM, bf16_t>, "a split master's upper half is the bf16 model");
    const Pack<uint16_t, M> hi = *reinterpret_cast<const Pack<uint16_t, M>*>(model + i);
    const Pack<int16_t, M> lo = *reinterpret_cast<const Pack<int16_t, M>*>(static_cast<const int16_t*>(p) + i);
#pragma unroll
    for (int k = 0; k < M; ++k) pv[k] = __uint_as_float(split_master_bits(hi.v[k], lo.v[k]));
  } else {
    load<float, M>(static_cast<const float*>(p) + i, pv);
  }
}

// The new master: f32 at p and, when there is one, the model rounded to its dtype (bf16: to
// nearest even); or (kSplit) the model = the master rounded to nearest with ties away from zero
// and the exact remainder at p.
template <int M, bool kSplit, class TM>
__device__ __forceinline__ void store_master(void* p, TM* model, int64_t i, const float (&pv)[M]) {
  if constexpr (kSplit) {
    Pack<uint16_t, M> hi;
    Pack<int16_t, M> lo;
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const uint32_t b = __float_as_uint(pv[k]);
      hi.v[k] = split_master_hi(b);
      lo.v[k] = split_master_lo(b, hi.v[k]);
    }
    *reinterpret_cast<Pack<uint16_t, M>*>(model + i) = hi;
    *reinterpret_cast<Pack<int16_t, M>*>(static_cast<int16_t*>(p) + i) = lo;
  } else {
    store<float, M>(static_cast<float*>(p) + i, pv);
    if (model) store<TM, M>(model + i, pv);
  }
}

template <int M, bool kSplit, bool kSq = false, class TM>
__device__ __forceinline__ void adamw_elems(void* p, const float* g, float* m, float* v, TM* model,
                                            int64_t i, const AdamWScalars& s, bool& bad, double& sq) {
  float pv[M], gv[M], mv[M], vv[M];
  load_master<M, kSplit>(p, model, i, pv);
  load<float, M>(g + i, gv);
  load<float, M>(m + i, mv);
  load<float, M>(v + i, vv);
  if constexpr (kSq) {
#pragma unroll
    for (int k = 0; k < M; ++k) sq += static_cast<double>(gv[k]) * gv[k];
  }
#pragma unroll
  for (int k = 0; k < M; ++k) {
    gv[k] *= s.grad_scale;
    pv[k] *= decay_of(s, i + k);
    mv[k] = s.beta1 * mv[k] + (1.0f - s.beta1) * gv[k];
    vv[k] = s.beta2 * vv[k] + (1.0f - s.beta2) * gv[k] * gv[k];
    pv[k] -= s.step_size * mv[k] / (sqrtf(vv[k]) * s.inv_sqrt_bc2 + s.eps);
    bad |= !isfinite(pv[k]) || !isfinite(mv[k]) || !isfinite(vv[k]);
  }
  store_master<M, kSplit>(p, model, i, pv);
  store<float, M>(m + i, mv);
  store<float, M>(v + i, vv);
}

template <class TM, int V, bool kSplit>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(void* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                 float* __restrict__ v, TM* __restrict__ model, int64_t n, AdamWScalars s,
                 int32_t* __restrict__ nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = n / V;
  bool bad = false;
  double unused = 0;
  for (int64_t i = gid; i < nv; i += stride) adamw_elems<V, kSplit>(p, g, m, v, model, i * V, s, bad, unused);
  for (int64_t i = nv * V + gid; i < n; i += stride) adamw_elems<1, kSplit>(p, g, m, v, model, i, s, bad, unused);
  // Every writer stores the same value, so the race is benign; no atomics, no extra pass.
  if (bad && nonfinite) *nonfinite = 1;
}

// bf16 moments: the same math on moments loaded from bf16; the fp32 results move the weights,
// then are stored stochastically rounded with element (first + i)'s random word (low half m,
// high half v). When the M elements start a Philox block (first + i divisible by 4), one block
// gives all four words; otherwise each element computes its own block (same words).
template <int M, bool kSplit, bool kSq = false, class TM>
__device__ __forceinline__ void adamw_bf16m_elems(void* p, const float* g, bf16_t* m, bf16_t* v, TM* model,
                                                  int64_t i, const AdamWScalars& s, uint64_t key,
                                                  int64_t first, bool& bad, double& sq) {
  float pv[M], gv[M], mv[M], vv[M];
  load_master<M, kSplit>(p, model, i, pv);
  load<float, M>(g + i, gv);
  if constexpr (kSq) {
#pragma unroll
    for (int k = 0; k < M; ++k) sq += static_cast<double>(gv[k]) * gv[k];
  }
  load<bf16_t, M>(m + i, mv);
  load<bf16_t, M>(v + i, vv);
  const auto e0 = static_cast<uint64_t>(first + i);
  uint32_t w[M];
  if (M == 4 && (e0 & 3) == 0) {
    const Philox4 r = philox4x32_10(key, e0 >> 2);
#pragma unroll
    for (int k = 0; k < M; ++k) w[k] = r.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < M; ++k) w[k] = moment_rounding_word(key, e0 + k);
  }
  Pack<bf16_t, M> mo, vo;
#pragma unroll
  for (int k = 0; k < M; ++k) {
    gv[k] *= s.grad_scale;
    pv[k] *= decay_of(s, i + k);
    mv[k] = s.beta1 * mv[k] + (1.0f - s.beta1) * gv[k];
    vv[k] = s.beta2 * vv[k] + (1.0f - s.beta2) * gv[k] * gv[k];
    pv[k] -= s.step_size * mv[k] / (sqrtf(vv[k]) * s.inv_sqrt_bc2 + s.eps);
    mo.v[k] = f32_to_bf16_stochastic(mv[k], w[k]);
    vo.v[k] = f32_to_bf16_stochastic(vv[k], w[k] >> 16);
    bad |= !isfinite(pv[k]) || bf16_bits_nonfinite(mo.v[k]) || bf16_bits_nonfinite(vo.v[k]);
  }
  store_master<M, kSplit>(p, model, i, pv);
  *reinterpret_cast<Pack<bf16_t, M>*>(m + i) = mo;
  *reinterpret_cast<Pack<bf16_t, M>*>(v + i) = vo;
}

template <class TM, int V, bool kSplit>
__global__ void __launch_bounds__(kThreads)
    adamw_bf16m_kernel(void* __restrict__ p, const float* __restrict__ g, bf16_t* __restrict__ m,
                       bf16_t* __restrict__ v, TM* __restrict__ model, int64_t n, AdamWScalars s, uint64_t key,
                       int64_t first, int32_t* __restrict__ nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = n / V;
  bool bad = false;
  double unused = 0;
  for (int64_t i = gid; i < nv; i += stride)
    adamw_bf16m_elems<V, kSplit>(p, g, m, v, model, i * V, s, key, first, bad, unused);
  for (int64_t i = nv * V + gid; i < n; i += stride)
    adamw_bf16m_elems<1, kSplit>(p, g, m, v, model, i, s, key, first, bad, unused);
  if (bad && nonfinite) *nonfinite = 1;  // benign race: every writer stores 1
}

template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(int32_t* __restrict__ flag, const T* __restrict__ x, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = n / V;
  bool bad = false;
  for (int64_t i = gid; i < nv; i += stride) {
    float xv[V];
    load<T, V>(x + i * V, xv);
#pragma unroll
    for (int k = 0; k < V; ++k) bad |= !isfinite(xv[k]);
  }
  for (int64_t i = nv * V + gid; i < n; i += stride) bad |= !isfinite(to_f32(x[i]));
  if (bad) *flag = 1;
}

__device__ __forceinline__ double block_sum(double x) {
  __shared__ double red[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  double s = 0;
  if (threadIdx.x == 0)
    for (int i = 0; i < kThreads / 32; ++i) s += red[i];
  return s;  // valid in thread 0
}

constexpr int kSliceAccesses = 4;  // vector accesses per thread in one slice
constexpr int64_t kSliceVecs = int64_t{kThreads} * kSliceAccesses;

// Slices of n elements read V at a time (at least one: an empty or tiny tensor has one).
__host__ __device__ __forceinline__ int64_t slices_of(int64_t n, int V) {
  const int64_t s = (n / V + kSliceVecs - 1) / kSliceVecs;
  return s > 0 ? s : 1;
}

// Slice j's sum of squares in thread 0 (every thread of the block calls it). visit(e, M, acc)
// handles elements [e, e + M) (M = V, or 1 for the tail) and adds their squares to acc.
template <int V, class Visit>
__device__ __forceinline__ double slice_sum(int64_t j, int64_t n, int64_t slices, Visit&& visit) {
  const int64_t nv = n / V;
  double acc = 0;
#pragma unroll
  for (int r = 0; r < kSliceAccesses; ++r) {
    const int64_t i = j * kSliceVecs + r * kThreads + threadIdx.x;
    if (i < nv) visit(i * V, std::integral_constant<int, V>{}, acc);
  }
  if (j == slices - 1 && threadIdx.x == 0)
    for (int64_t e = nv * V; e < n; ++e) visit(e, std::integral_constant<int, 1>{}, acc);
  const double s = block_sum(acc);
  __syncthreads();  // block_sum's shared words are reused by the next slice
  return s;
}

// partial[j] = slice j's sum; slices j = blockIdx.x, blockIdx.x + gridDim.x, ...
// Slice j's sum of the squares of x, in thread 0 (every thread of the block calls it).
template <class T, int V>
__device__ __forceinline__ double slice_squares(const T* x, int64_t j, int64_t n, int64_t slices) {
  return slice_sum<V>(j, n, slices, [&](int64_t e, auto m, double& acc) {
    constexpr int M = decltype(m)::value;
    float xv[M];
    load<T, M>(x + e, xv);
#pragma unroll
    for (int k = 0; k < M; ++k) acc += static_cast<double>(xv[k]) * xv[k];
  });
}

template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(double* __restrict__ partial, const T* __restrict__ x, int64_t n) {
  const int64_t slices = slices_of(n, V);
  for (int64_t j = blockIdx.x; j < slices; j += gridDim.x) {
    const double s = slice_squares<T, V>(x, j, n, slices);
    if (threadIdx.x == 0) partial[j] = s;
  }
}

// partial[list[b]] for the listed slices only (the others are set to zero beforehand): the
// same slice sums as sum_squares_kernel<T, V> over the same n.
template <class T, int V>
__global__ void __launch_bounds__(kThreads)
    sum_squares_listed_kernel(double* __restrict__ partial, const T* __restrict__ x, int64_t n,
                              const int32_t* __restrict__ list, int64_t num) {
  const int64_t slices = slices_of(n, V);
  for (int64_t b = blockIdx.x; b < num; b += gridDim.x) {
    const int64_t j = list[b];
    const double s = slice_squares<T, V>(x, j, n, slices);
    if (threadIdx.x == 0) partial[j] = s;
  }
}

// out[0] = the sum of partial[0, slices) in a fixed order (one block of kFinishThreads). A big
// unit has ~10^5 slices: each thread keeps 8 loads in flight (8 partial sums), so the block
// reads them in a few round trips rather than one per slice it owns.
constexpr int kFinishThreads = 1024;
__global__ void __launch_bounds__(kFinishThreads)
    sum_squares_finish_kernel(double* __restrict__ out, const double* __restrict__ partial, int64_t slices) {
  constexpr int U = 8;
  double acc[U] = {};
  int64_t j = threadIdx.x;
  for (; j + (U - 1) * int64_t{kFinishThreads} < slices; j += U * int64_t{kFinishThreads}) {
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] += partial[j + u * int64_t{kFinishThreads}];
  }
  for (; j < slices; j += kFinishThreads) acc[0] += partial[j];
  double x = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  __shared__ double red[kFinishThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < kFinishThreads / 32; ++i) s += red[i];
    out[0] = s;
  }
}

// The update (f32 or bf16 moments) and the gradient's sum of squares in one pass: each slice
// of the sum is one block's share of the update, with the squares of the gradient values the
// update loads. Vector width 4 (the caller checks the alignment, as launch_sum_squares<float>
// would pick width 4 for the same gradient).
template <class TM, bool kBf16M, bool kSplit>
__global__ void __launch_bounds__(kThreads)
    adamw_sq_kernel(void* __restrict__ p, const float* __restrict__ g, void* __restrict__ m,
                    void* __restrict__ v, TM* __restrict__ model, int64_t n, AdamWScalars s, uint64_t key,
                    int64_t first, int32_t* __restrict__ nonfinite, double* __restrict__ partial) {
  const int64_t slices = slices_of(n, 4);
  bool bad = false;
  for (int64_t j = blockIdx.x; j < slices; j += gridDim.x) {
    const double sum = slice_sum<4>(j, n, slices, [&](int64_t e, auto mw, double& acc) {
      constexpr int M = decltype(mw)::value;
      if constexpr (kBf16M)
        adamw_bf16m_elems<M, kSplit, true>(p, g, static_cast<bf16_t*>(m), static_cast<bf16_t*>(v), model, e, s,
                                           key, first, bad, acc);
      else
        adamw_elems<M, kSplit, true>(p, g, static_cast<float*>(m), static_cast<float*>(v), model, e, s, bad, acc);
    });
    if (threadIdx.x == 0) partial[j] = sum;
  }
  if (bad && nonfinite) *nonfinite = 1;  // benign race: every writer stores 1
}

// One block per listed row of row_len elements (the unit's last row may be shorter): the
// row's elements through the same element code as the whole-unit kernels, at their unit
// element index (decay and rounding words as there).
template <class TM, int V, bool kBf16M, bool kSplit>
__global__ void __launch_bounds__(kThreads)
    adamw_rows_kernel(void* __restrict__ p, const float* __restrict__ g, void* __restrict__ m,
                      void* __restrict__ v, TM* __restrict__ model, int64_t n, const int32_t* __restrict__ rows,
                      int64_t row_len, AdamWScalars s, uint64_t key, int64_t first,
                      int32_t* __restrict__ nonfinite) {
  const int64_t base = static_cast<int64_t>(rows[blockIdx.x]) * row_len;
  const int64_t len = n - base < row_len ? n - base : row_len;
  bool bad = false;
  double unused = 0;
  auto visit = [&](int64_t e, auto mw) {
    constexpr int M = decltype(mw)::value;
    if constexpr (kBf16M)
      adamw_bf16m_elems<M, kSplit>(p, g, static_cast<bf16_t*>(m), static_cast<bf16_t*>(v), model, e, s, key, first,
                                   bad, unused);
    else
      adamw_elems<M, kSplit>(p, g, static_cast<float*>(m), static_cast<float*>(v), model, e, s, bad, unused);
  };
  const int64_t nv = len / V;
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) visit(base + c * V, std::integral_constant<int, V>{});
  for (int64_t c = nv * V + threadIdx.x; c < len; c += kThreads) visit(base + c, std::integral_constant<int, 1>{});
  if (bad && nonfinite) *nonfinite = 1;  // benign race: every writer stores 1
}

__global__ void __launch_bounds__(kThreads)
    scale_kernel(float* __restrict__ g, float s, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const bool vec = reinterpret_cast<uintptr_t>(g) % 16 == 0;
  const int64_t nv = vec ? n / 4 : 0;
  for (int64_t i = gid; i < nv; i += stride) {
    float4 v = reinterpret_cast<float4*>(g)[i];
    v.x *= s, v.y *= s, v.z *= s, v.w *= s;
    reinterpret_cast<float4*>(g)[i] = v;
  }
  for (int64_t i = nv * 4 + gid; i < n; i += stride) g[i] *= s;
}

// Blocks of an update over `work` accesses: a grid-stride grid (16 blocks an SM at most), or
// with short_blocks one block per kShortAccesses accesses of each thread (about 4K elements,
// ~120 KB of traffic), which leaves an SM within microseconds.
constexpr int64_t kShortAccesses = 4;
unsigned update_blocks(int64_t work, bool short_blocks) {
  if (!short_blocks) return grid_stride_blocks(work, kThreads);
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(work, kThreads * kShortAccesses), 1, 0x7fffffff));
}

// The master's 16-byte (f32) or 8-byte (a split master's remainder) alignment for 4-wide
// accesses.
size_t master_align(bool split) { return split ? 8 : 16; }

template <class TM, bool kSplit>
void launch_adamw(void* p, const float* g, float* m, float* v, TM* model, int64_t n,
                  const AdamWScalars& s, int32_t* nonfinite) {
  const bool vec = aligned(p, master_align(kSplit)) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) &&
                   (model == nullptr || aligned(model, 4 * sizeof(TM)));
  if (vec)
    adamw_kernel<TM, 4, kSplit><<<update_blocks(ceil_div(n, 4), s.short_blocks), kThreads, 0, stream()>>>(
        p, g, m, v, model, n, s, nonfinite);
  else
    adamw_kernel<TM, 1, kSplit><<<update_blocks(n, s.short_blocks), kThreads, 0, stream()>>>(p, g, m, v, model, n, s,
                                                                                           nonfinite);
  BB_CHECK_LAUNCH();
}

template <class TM, bool kSplit>
void launch_adamw_bf16m(void* p, const float* g, bf16_t* m, bf16_t* v, TM* model, int64_t n,
                        const AdamWScalars& s, uint64_t key, int64_t first, int32_t* nonfinite) {
  // Four elements per access: 16 bytes of p (8 of a split remainder) and g, 8 of each bf16 moment.
  const bool vec = aligned(p, master_align(kSplit)) && aligned(g, 16) && aligned(m, 4 * sizeof(bf16_t)) &&
                   aligned(v, 4 * sizeof(bf16_t)) && (model == nullptr || aligned(model, 4 * sizeof(TM)));
  if (vec)
    adamw_bf16m_kernel<TM, 4, kSplit><<<update_blocks(ceil_div(n, 4), s.short_blocks), kThreads, 0, stream()>>>(
        p, g, m, v, model, n, s, key, first, nonfinite);
  else
    adamw_bf16m_kernel<TM, 1, kSplit><<<update_blocks(n, s.short_blocks), kThreads, 0, stream()>>>(
        p, g, m, v, model, n, s, key, first, nonfinite);
  BB_CHECK_LAUNCH();
}

// Grid of a pass over `slices` slices: one block each (short blocks), or at most a grid-stride
// grid's worth looping over them. The results do not depend on it.
unsigned slice_blocks(int64_t slices, bool short_blocks) {
  const int64_t cap = short_blocks ? 0x7fffffff : int64_t{grid_stride_blocks(slices * kThreads, kThreads)};
  return static_cast<unsigned>(std::min<int64_t>(slices, cap));
}

template <class T>
int64_t launch_sum_squares(double* partial, const void* x, int64_t n) {
  constexpr int V = 16 / sizeof(T);
  // The partition depends on n and the width only, so a tensor's sum is the same on every call
  // (and every device).
  const int w = aligned(x, 16) ? V : 1;
  const int64_t slices = slices_of(n, w);
  const auto* xt = static_cast<const T*>(x);
  if (w == V)
    sum_squares_kernel<T, V><<<slice_blocks(slices, false), kThreads, 0, stream()>>>(partial, xt, n);
  else
    sum_squares_kernel<T, 1><<<slice_blocks(slices, false), kThreads, 0, stream()>>>(partial, xt, n);
  BB_CHECK_LAUNCH();
  return slices;
}

void check_split(const AdamWScalars& s, const void* model, DType model_dtype) {
  BB_CHECK(!s.split_master || (model && model_dtype == DType::bf16),
           "adamw (CUDA): a split master needs the bf16 model tensor that holds its upper half");
}

}  // namespace

void adamw_step(void* master, const float* grad, float* exp_avg, float* exp_avg_sq, void* model,
                DType model_dtype, int64_t n, const AdamWScalars& s, int32_t* nonfinite) {
  if (n == 0) return;
  check_split(s, model, model_dtype);
  auto* mb = static_cast<bf16_t*>(model);
  if (s.split_master)
    launch_adamw<bf16_t, true>(master, grad, exp_avg, exp_avg_sq, mb, n, s, nonfinite);
  else if (model && model_dtype == DType::bf16)
    launch_adamw<bf16_t, false>(master, grad, exp_avg, exp_avg_sq, mb, n, s, nonfinite);
  else
    launch_adamw<float, false>(master, grad, exp_avg, exp_avg_sq, static_cast<float*>(model), n, s, nonfinite);
}

void adamw_step_bf16_moments(void* master, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                             void* model, DType model_dtype, int64_t n, const AdamWScalars& s, uint64_t key,
                             int64_t first_element, int32_t* nonfinite) {
  if (n == 0) return;
  check_split(s, model, model_dtype);
  auto* mb = static_cast<bf16_t*>(model);
  if (s.split_master)
    launch_adamw_bf16m<bf16_t, true>(master, grad, exp_avg, exp_avg_sq, mb, n, s, key, first_element, nonfinite);
  else if (model && model_dtype == DType::bf16)
    launch_adamw_bf16m<bf16_t, false>(master, grad, exp_avg, exp_avg_sq, mb, n, s, key, first_element, nonfinite);
  else
    launch_adamw_bf16m<float, false>(master, grad, exp_avg, exp_avg_sq, static_cast<float*>(model), n, s, key,
                                     first_element, nonfinite);
}

void mark_nonfinite(int32_t* flag, const void* x, DType dtype, int64_t n) {
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>(grid_stride_blocks(ceil_div(n, 8), kThreads));
  if (dtype == DType::bf16) {
    const auto* xt = static_cast<const bf16_t*>(x);
    if (aligned(x, 16)) nonfinite_kernel<bf16_t, 8><<<blocks, kThreads, 0, stream()>>>(flag, xt, n);
    else nonfinite_kernel<bf16_t, 1><<<blocks, kThreads, 0, stream()>>>(flag, xt, n);
  } else {
    const auto* xt = static_cast<const float*>(x);
    if (aligned(x, 16)) nonfinite_kernel<float, 4><<<blocks, kThreads, 0, stream()>>>(flag, xt, n);
    else nonfinite_kernel<float, 1><<<blocks, kThreads, 0, stream()>>>(flag, xt, n);
  }
  BB_CHECK_LAUNCH();
}

int64_t sum_squares_max_slots(int64_t n) { return slices_of(n, 1); }

int64_t sum_squares_partial(double* partial, const void* x, DType dtype, int64_t n) {
  if (dtype == DType::bf16) return launch_sum_squares<bf16_t>(partial, x, n);
  return launch_sum_squares<float>(partial, x, n);
}

std::vector<int32_t> sum_squares_slices_of_rows(const void* x, int64_t n, const int32_t* rows, int64_t num_rows,
                                                int64_t row_len) {
  const int V = aligned(x, 16) ? 4 : 1;  // launch_sum_squares<float>'s width for this address
  const int64_t nv = n / V, slices = slices_of(n, V);
  // Slice of element e: vector access e / V of slice (e / V) / kSliceVecs; the scalar tail
  // belongs to the last slice.
  auto slice_of = [&](int64_t e) { return e < nv * V ? (e / V) / kSliceVecs : slices - 1; };
  std::vector<int32_t> out;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t a = rows[i] * row_len, b = std::min(n, (rows[i] + 1) * row_len);
    if (a >= b) continue;
    int64_t j = slice_of(a);
    if (!out.empty() && out.back() >= j) j = out.back() + 1;
    for (const int64_t last = slice_of(b - 1); j <= last; ++j) out.push_back(static_cast<int32_t>(j));
  }
  return out;
}

int64_t sum_squares_partial_listed(double* partial, const float* x, int64_t n, const int32_t* list,
                                   int64_t num) {
  const bool vec = aligned(x, 16);
  const int64_t slices = slices_of(n, vec ? 4 : 1);
  BB_CHECK_CUDA(cudaMemsetAsync(partial, 0, static_cast<size_t>(slices) * sizeof(double), stream()));
  if (num > 0) {
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(num, slice_blocks(slices, false)));
    if (vec)
      sum_squares_listed_kernel<float, 4><<<blocks, kThreads, 0, stream()>>>(partial, x, n, list, num);
    else
      sum_squares_listed_kernel<float, 1><<<blocks, kThreads, 0, stream()>>>(partial, x, n, list, num);
    BB_CHECK_LAUNCH();
  }
  return slices;
}

void sum_squares_finish(double* out, const double* partial, int64_t slots) {
  sum_squares_finish_kernel<<<1, kFinishThreads, 0, stream()>>>(out, partial, slots);
  BB_CHECK_LAUNCH();
}

int64_t adamw_step_sum_squares(void* master, const float* grad, void* exp_avg, void* exp_avg_sq, bool bf16_moments,
                               void* model, DType model_dtype, int64_t n, const AdamWScalars& s, uint64_t key,
                               int64_t first_element, int32_t* nonfinite, double* partial) {
  check_split(s, model, model_dtype);
  const size_t model_align = model_dtype == DType::bf16 ? 8 : 16;
  const size_t moment_align = bf16_moments ? 8 : 16;
  if (!(aligned(master, master_align(s.split_master)) && aligned(grad, 16) && aligned(exp_avg, moment_align) &&
        aligned(exp_avg_sq, moment_align) && (model == nullptr || aligned(model, model_align))))
    return -1;
  const int64_t slices = slices_of(n, 4);
  const unsigned blocks = slice_blocks(slices, s.short_blocks);
  const bool bf16_model = model && model_dtype == DType::bf16;
  auto go = [&](auto tm, auto b16, auto split) {
    using TM = decltype(tm);
    constexpr bool B = decltype(b16)::value, P = decltype(split)::value;
    adamw_sq_kernel<TM, B, P><<<blocks, kThreads, 0, stream()>>>(
        master, grad, exp_avg, exp_avg_sq, static_cast<TM*>(model), n, s, key, first_element, nonfinite, partial);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (s.split_master) bf16_moments ? go(bf16_t{}, T{}, T{}) : go(bf16_t{}, F{}, T{});
  else if (bf16_model) bf16_moments ? go(bf16_t{}, T{}, F{}) : go(bf16_t{}, F{}, F{});
  else bf16_moments ? go(float{}, T{}, F{}) : go(float{}, F{}, F{});
  BB_CHECK_LAUNCH();
  return slices;
}

void adamw_step_rows(void* master, const float* grad, void* exp_avg, void* exp_avg_sq, bool bf16_moments,
                     void* model, DType model_dtype, int64_t n, const int32_t* rows, int64_t num_rows,
                     int64_t row_len, const AdamWScalars& s, uint64_t key, int64_t first_element,
                     int32_t* nonfinite) {
  if (num_rows == 0) return;
  check_split(s, model, model_dtype);
  const bool bf16_model = model && model_dtype == DType::bf16;
  // Four elements an access when every row starts on a 16-byte boundary of every tensor.
  const size_t mom = bf16_moments ? 8 : 16, mod = bf16_model ? 8 : 16;
  const bool vec = row_len % 4 == 0 && aligned(master, master_align(s.split_master)) && aligned(grad, 16) && aligned(exp_avg, mom) &&
                   aligned(exp_avg_sq, mom) && (model == nullptr || aligned(model, mod));
  const auto blocks = static_cast<unsigned>(num_rows);
  auto go = [&](auto tm, auto v, auto b16, auto split) {
    using TM = decltype(tm);
    constexpr int V = decltype(v)::value;
    constexpr bool B = decltype(b16)::value, P = decltype(split)::value;
    adamw_rows_kernel<TM, V, B, P><<<blocks, kThreads, 0, stream()>>>(master, grad, exp_avg, exp_avg_sq,
                                                                          static_cast<TM*>(model), n, rows, row_len,
                                                                          s, key, first_element, nonfinite);
  };
  using I4 = std::integral_constant<int, 4>;
  using I1 = std::integral_constant<int, 1>;
  using T = std::true_type;
  using F = std::false_type;
  if (s.split_master) {
    if (bf16_moments) vec ? go(bf16_t{}, I4{}, T{}, T{}) : go(bf16_t{}, I1{}, T{}, T{});
    else vec ? go(bf16_t{}, I4{}, F{}, T{}) : go(bf16_t{}, I1{}, F{}, T{});
  } else if (bf16_model) {
    if (bf16_moments) vec ? go(bf16_t{}, I4{}, T{}, F{}) : go(bf16_t{}, I1{}, T{}, F{});
    else vec ? go(bf16_t{}, I4{}, F{}, F{}) : go(bf16_t{}, I1{}, F{}, F{});
  } else {
    if (bf16_moments) vec ? go(float{}, I4{}, T{}, F{}) : go(float{}, I1{}, T{}, F{});
    else vec ? go(float{}, I4{}, F{}, F{}) : go(float{}, I1{}, F{}, F{});
  }
  BB_CHECK_LAUNCH();
}

void scale_inplace(float* g, float s, int64_t n) {
  if (n == 0) return;
  scale_kernel<<<grid_stride_blocks(ceil_div(n, 4), kThreads), kThreads, 0, stream()>>>(g, s, n);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

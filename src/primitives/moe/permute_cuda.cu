// permute_cuda.cu — CUDA token permutation: the map (histogram + stable radix sort of the expert
// ids), row gather/copy, the fp32 gather-sum that serves permute_backward and unpermute_forward,
// unpermute_backward with its per-(t, k) dot products, and the probability scatter/gather.
//
// Legend: T tokens, K top-k, E experts, H hidden, N = T*K permuted rows.
// NOTES: the map is a stable LSD radix sort of the keys topk_idx (row-major (t, k) order) with
// values 0..N-1, so rows come out grouped by expert and ordered by (t, k) inside an expert:
// exactly ref::make_permute_map's counting sort. Only the low ceil(log2 E) key bits are sorted.
// permute scatters each token row (read once) to its K rows through slot_row.
// Row kernels give each output row to one block and use 16-byte accesses when the row size and
// the base pointers allow. Backward functions WRITE their outputs (=).
#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "backend/cuda/runtime.h"
#include "primitives/moe/permute_cuda.h"

namespace bb::cuda {

namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;
constexpr size_t kSmemLimit = 48 * 1024;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
int row_threads(int64_t units) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, ceil_div(units, 32) * 32)));
}

// Deterministic block sum (fixed tree); every thread must call it; result valid in thread 0.
__device__ float block_sum(float v, float* red /* [32] shared */) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // red may still be read from the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? red[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

// ---- the map --------------------------------------------------------------------------------
__global__ void histogram_kernel(const int32_t* __restrict__ idx, int64_t n, int E,
                                 int32_t* __restrict__ stats, bool shared_hist) {
  extern __shared__ int32_t hist[];
  int32_t* counts = stats + 1;
  if (shared_hist) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int v = idx[i];
    if (v >= 0 && v < E) {
      atomicAdd(shared_hist ? &hist[v] : &counts[v], 1);
    } else {
      atomicMax(&stats[0], static_cast<int32_t>(n - i));  // the largest n - i = the first bad i
    }
  }
  if (shared_hist) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (hist[e]) atomicAdd(&counts[e], hist[e]);
  }
}

__global__ void iota_kernel(int32_t* __restrict__ v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int32_t>(i);
}

// Sorted position n holds copy v = t*K + k: row n comes from token t, and (t, k) goes to row n.
__global__ void scatter_map_kernel(const int32_t* __restrict__ sorted, int64_t n, int K,
                                   int32_t* __restrict__ row_token,
                                   int32_t* __restrict__ slot_row) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t v = sorted[i];
    row_token[i] = v / K;
    slot_row[v] = static_cast<int32_t>(i);
  }
}

int key_bits(int64_t E) {
  int bits = 1;
  while ((int64_t{1} << bits) < E) ++bits;
  return bits;
}

struct MapScratch {
  uint32_t* keys_out;
  int32_t* vals_in;
  int32_t* vals_out;
  void* cub_temp;
  size_t cub_bytes;
};

size_t cub_sort_bytes(int64_t N, int64_t E) {
  size_t bytes = 0;
  BB_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(N), 0,
      key_bits(E), stream()));
  return bytes;
}

MapScratch carve(void* ws, int64_t N, size_t cub_bytes) {
  unsigned char* p = static_cast<unsigned char*>(ws);
  const size_t row = align_up(4 * static_cast<size_t>(N));
  MapScratch s;
  s.keys_out = reinterpret_cast<uint32_t*>(p);
  s.vals_in = reinterpret_cast<int32_t*>(p + row);
  s.vals_out = reinterpret_cast<int32_t*>(p + 2 * row);
  s.cub_temp = p + 3 * row;
  s.cub_bytes = cub_bytes;
  return s;
}

unsigned grid_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), 4096)));
}

// ---- row kernels ----------------------------------------------------------------------------
// One block per token: its row is read once and written to its K permuted rows (a gather by
// row_token would read every token row K times). R is the access unit (16, 8, 4, 2 or 1
// bytes). Each permuted row is the copy of exactly one (t, k), so one block writes it.
template <class R>
__global__ void permute_rows_kernel(R* __restrict__ out, const R* __restrict__ in,
                                    const int32_t* __restrict__ slot_row, int K, int64_t units) {
  const int64_t t = blockIdx.x;
  const R* src = in + t * units;
  const int32_t* slots = slot_row + t * K;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    const R v = src[u];
    for (int k = 0; k < K; ++k) out[static_cast<int64_t>(slots[k]) * units + u] = v;
  }
}

// Shared arrays of gather_sum_kernel, each padded to 16 bytes: the compiler may read the k loop's
// operands in 16-byte vectors (compute-sanitizer flagged rows[0..1] read for K = 1).
__host__ __device__ inline size_t gather_rows_bytes(int64_t K) { return (8 * K + 15) / 16 * 16; }
__host__ __device__ inline size_t gather_smem_bytes(int64_t K) {
  return gather_rows_bytes(K) + (4 * K + 15) / 16 * 16;
}

// One block per token: out[t] = sum_k w[t, k] * in[slot_row[t, k]], V elements per access.
template <class T, class TO, int V>
__global__ void gather_sum_kernel(TO* __restrict__ out, const T* __restrict__ in,
                                  const int32_t* __restrict__ slot_row,
                                  const float* __restrict__ prob, int K, int64_t H) {
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* rows = reinterpret_cast<int64_t*>(smem);
  float* w = reinterpret_cast<float*>(smem + gather_rows_bytes(K));
  const int64_t t = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    rows[k] = slot_row[t * K + k];
    w[k] = prob ? prob[t * K + k] : 1.0f;
  }
  __syncthreads();
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < H; j += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    for (int k = 0; k < K; ++k) {
      float v[V];
      load<T, V>(in + rows[k] * H + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += w[k] * v[i];
    }
    store<TO, V>(out + t * H + j, acc);
  }
}

// One block per token: for each k, the scaled copy of d_y[t] and (optionally) the dot product.
template <class T, int V>
__global__ void unpermute_bwd_kernel(T* __restrict__ d_y_perm, float* __restrict__ d_prob,
                                     const T* __restrict__ d_y, const T* __restrict__ y_perm,
                                     const int32_t* __restrict__ slot_row,
                                     const float* __restrict__ prob, int K, int64_t H) {
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const T* dy = d_y + t * H;
  for (int k = 0; k < K; ++k) {
    const int64_t row = slot_row[t * K + k];
    const float w = prob ? prob[t * K + k] : 1.0f;
    T* dst = d_y_perm + row * H;
    const T* yp = d_prob ? y_perm + row * H : nullptr;
    float dot = 0.0f;
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < H; j += static_cast<int64_t>(blockDim.x) * V) {
      float g[V], o[V];
      load<T, V>(dy + j, g);
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = w * g[i];
      store<T, V>(dst + j, o);
      if (yp) {
        float y[V];
        load<T, V>(yp + j, y);
#pragma unroll
        for (int i = 0; i < V; ++i) dot += g[i] * y[i];
      }
    }
    if (d_prob) {
      dot = block_sum(dot, red);
      if (threadIdx.x == 0) d_prob[t * K + k] = dot;
    }
  }
}

__global__ void permute_probs_kernel(float* __restrict__ row_prob, const float* __restrict__ prob,
                                     const int32_t* __restrict__ slot_row, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    row_prob[slot_row[i]] = prob[i];
}

__global__ void unpermute_probs_grad_kernel(float* __restrict__ d_prob,
                                            const float* __restrict__ d_row_prob,
                                            const int32_t* __restrict__ slot_row, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    d_prob[i] = d_row_prob[slot_row[i]];
}

template <class T, class TO>
void launch_gather_sum(void* out, const void* in, const int32_t* slot_row, const float* prob,
                       int64_t T_, int64_t K, int64_t H) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = H % kVec == 0 && aligned(out, 16) && aligned(in, 16);
  const size_t smem = gather_smem_bytes(K);
  BB_CHECK(smem <= kSmemLimit, "gather_sum_rows on CUDA: K = ", K, " is too large");
  if (vec) {
    gather_sum_kernel<T, TO, kVec><<<static_cast<unsigned>(T_), row_threads(H / kVec), smem, stream()>>>(
        static_cast<TO*>(out), static_cast<const T*>(in), slot_row, prob, static_cast<int>(K), H);
  } else {
    gather_sum_kernel<T, TO, 1><<<static_cast<unsigned>(T_), row_threads(H), smem, stream()>>>(
        static_cast<TO*>(out), static_cast<const T*>(in), slot_row, prob, static_cast<int>(K), H);
  }
  BB_CHECK_LAUNCH();
}

template <class T>
void launch_unpermute_bwd(void* d_y_perm, float* d_prob, const void* d_y, const void* y_perm,
                          const int32_t* slot_row, const float* prob, int64_t T_, int64_t K,
                          int64_t H) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = H % kVec == 0 && aligned(d_y_perm, 16) && aligned(d_y, 16) &&
                   (!d_prob || aligned(y_perm, 16));
  if (vec) {
    unpermute_bwd_kernel<T, kVec><<<static_cast<unsigned>(T_), row_threads(H / kVec), 0, stream()>>>(
        static_cast<T*>(d_y_perm), d_prob, static_cast<const T*>(d_y),
        static_cast<const T*>(y_perm), slot_row, prob, static_cast<int>(K), H);
  } else {
    unpermute_bwd_kernel<T, 1><<<static_cast<unsigned>(T_), row_threads(H), 0, stream()>>>(
        static_cast<T*>(d_y_perm), d_prob, static_cast<const T*>(d_y),
        static_cast<const T*>(y_perm), slot_row, prob, static_cast<int>(K), H);
  }
  BB_CHECK_LAUNCH();
}

template <class R>
void launch_permute_rows(void* out, const void* in, const int32_t* slot_row, int64_t T, int64_t K,
                         int64_t row_bytes) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(R));
  permute_rows_kernel<R><<<static_cast<unsigned>(T), row_threads(units), 0, stream()>>>(
      static_cast<R*>(out), static_cast<const R*>(in), slot_row, static_cast<int>(K), units);
  BB_CHECK_LAUNCH();
}

}  // namespace

size_t permute_map_workspace_bytes(int64_t N, int64_t E) {
  BB_CHECK(N >= 1 && N <= INT_MAX, "make_permute_map on CUDA: T * K = ", N,
           " rows is outside [1, 2^31)");
  return 3 * align_up(4 * static_cast<size_t>(N)) + align_up(cub_sort_bytes(N, E));
}

void make_permute_map(int32_t* row_token, int32_t* slot_row, int32_t* stats,
                      const int32_t* topk_idx, int64_t T, int64_t K, int64_t E, void* workspace,
                      size_t workspace_bytes) {
  const int64_t N = T * K;
  const size_t cub_bytes = cub_sort_bytes(N, E);
  BB_CHECK(workspace_bytes >= 3 * align_up(4 * static_cast<size_t>(N)) + cub_bytes,
           "make_permute_map on CUDA: workspace of ", workspace_bytes, " bytes is too small");
  MapScratch s = carve(workspace, N, cub_bytes);
  memset_zero(stats, 4 * static_cast<size_t>(E + 1));
  const bool shared_hist = 4 * static_cast<size_t>(E) <= kSmemLimit;
  histogram_kernel<<<grid_for(N), kThreads, shared_hist ? 4 * E : 0, stream()>>>(
      topk_idx, N, static_cast<int>(E), stats, shared_hist);
  BB_CHECK_LAUNCH();
  iota_kernel<<<grid_for(N), kThreads, 0, stream()>>>(s.vals_in, N);
  BB_CHECK_LAUNCH();
  // Out-of-range ids still sort (on their low bits) into some permutation; the caller throws
  // after reading stats, so the map is never used then.
  size_t bytes = s.cub_bytes;
  BB_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
      s.cub_temp, bytes, reinterpret_cast<const uint32_t*>(topk_idx), s.keys_out, s.vals_in,
      s.vals_out, static_cast<int>(N), 0, key_bits(E), stream()));
  scatter_map_kernel<<<grid_for(N), kThreads, 0, stream()>>>(s.vals_out, N, static_cast<int>(K),
                                                              row_token, slot_row);
  BB_CHECK_LAUNCH();
}

void permute_rows(void* x_perm, const void* x, const int32_t* slot_row, int64_t T, int64_t K,
                  int64_t row_bytes) {
  if (T == 0 || K == 0 || row_bytes == 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(x_perm) | reinterpret_cast<uintptr_t>(x) |
                      static_cast<uintptr_t>(row_bytes);
  if (a % 16 == 0) launch_permute_rows<uint4>(x_perm, x, slot_row, T, K, row_bytes);
  else if (a % 8 == 0) launch_permute_rows<uint2>(x_perm, x, slot_row, T, K, row_bytes);
  else if (a % 4 == 0) launch_permute_rows<uint32_t>(x_perm, x, slot_row, T, K, row_bytes);
  else if (a % 2 == 0) launch_permute_rows<uint16_t>(x_perm, x, slot_row, T, K, row_bytes);
  else launch_permute_rows<uint8_t>(x_perm, x, slot_row, T, K, row_bytes);
}

void gather_sum_rows(void* out, const void* in, DType dt, const int32_t* slot_row,
                     const float* prob, int64_t T, int64_t K, int64_t H, bool out_f32) {
  if (T == 0 || H == 0) return;
  // 16-bit rows: stored in their own dtype, or the f32 sum when out_f32.
  auto sixteen_bit = [&](auto tag) {
    using R = decltype(tag);
    if (out_f32) launch_gather_sum<R, float>(out, in, slot_row, prob, T, K, H);
    else launch_gather_sum<R, R>(out, in, slot_row, prob, T, K, H);
  };
  switch (dt) {
    case DType::f32: launch_gather_sum<float, float>(out, in, slot_row, prob, T, K, H); break;
    case DType::bf16: sixteen_bit(__nv_bfloat16{}); break;
    case DType::f16: sixteen_bit(__half{}); break;
    default: BB_FAIL("gather_sum_rows on CUDA: dtype ", dtype_name(dt), " is not a float type");
  }
}

void unpermute_backward(void* d_y_perm, float* d_prob, const void* d_y, const void* y_perm,
                        DType dt, const int32_t* slot_row, const float* prob, int64_t T,
                        int64_t K, int64_t H) {
  if (T == 0) return;
  switch (dt) {
    case DType::f32:
      launch_unpermute_bwd<float>(d_y_perm, d_prob, d_y, y_perm, slot_row, prob, T, K, H);
      break;
    case DType::bf16:
      launch_unpermute_bwd<__nv_bfloat16>(d_y_perm, d_prob, d_y, y_perm, slot_row, prob, T, K, H);
      break;
    case DType::f16:
      launch_unpermute_bwd<__half>(d_y_perm, d_prob, d_y, y_perm, slot_row, prob, T, K, H);
      break;
    default: BB_FAIL("unpermute_backward on CUDA: dtype ", dtype_name(dt), " is not a float type");
  }
}

void permute_probs(float* row_prob, const float* prob, const int32_t* slot_row, int64_t n) {
  if (n == 0) return;
  permute_probs_kernel<<<grid_for(n), kThreads, 0, stream()>>>(row_prob, prob, slot_row, n);
  BB_CHECK_LAUNCH();
}

void unpermute_probs_grad(float* d_prob, const float* d_row_prob, const int32_t* slot_row,
                          int64_t n) {
  if (n == 0) return;
  unpermute_probs_grad_kernel<<<grid_for(n), kThreads, 0, stream()>>>(d_prob, d_row_prob,
                                                                      slot_row, n);
  BB_CHECK_LAUNCH();
}

}  // namespace bb::cuda

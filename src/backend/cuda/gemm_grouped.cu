// gemm_grouped.cu — the grouped GEMM (gemm_grouped) and its dispatch: the algorithm choice
// (automatic: our TMA / mma.sync tile kernels of grouped_mma.cu first, then the dtype defaults and
// the FLOP line), one cublasGemmGroupedBatchedEx call, per-problem cuBLASLt GEMMs over side
// streams (with host threads that enqueue them), and a WMMA grouped weight-gradient kernel; the
// process-wide defaults (grouped_defaults). The cuBLASLt state and plans it shares with the
// dense GEMM: gemm.cu, gemm_common.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_common.cuh"
#include "backend/cuda/grouped_mma.h"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "core/tensor.h"

namespace bb::cuda {

using namespace gemm_detail;  // gemm_common.cuh

namespace {

// Copies host bytes to a new device buffer (workspace) without synchronising the host
// (cuda::memcpy stages them in pinned memory), so `src` may die after.
Tensor upload(const void* src, size_t bytes, int dev) {
  Tensor t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, Device::cuda(dev),
                           MemCategory::workspace);
  cuda::memcpy(t.raw(), Device::cuda(dev), src, Device::cpu(), bytes);
  return t;
}

struct DevProblem {
  int64_t M, N, K;
  const void* A;
  const void* B;
  float* C;
  int64_t tile_start;  // first CTA of this problem
};

constexpr int kBM = 128, kBN = 128, kBK = 32, kPad = 8, kThreads = 256;
constexpr int kVec = 8;                              // 16-bit elements per 16-byte load
constexpr int kLoads = kBK * kBM / kVec / kThreads;  // 16-byte loads per thread per operand

// One operand tile, [kBK][kBM] (k rows, m or n contiguous), held in registers between the
// global load of step k+1 and its store to shared memory after step k's math.
template <class T>
struct TileRegs {
  uint4 v[kLoads];
};

// Loads rows [k0, k0 + kBK) x columns [c0, c0 + kBM) of a row-major [K, C] matrix (ld). The
// 16-byte path needs ld % 8 == 0 and a 16-byte aligned base (checked on the host: `vec`);
// otherwise, and at the right edge, elements are loaded one by one. Out of range reads as 0.
template <class T>
__device__ __forceinline__ void load_tile(TileRegs<T>& r, const T* X, int64_t ld, int64_t K,
                                          int64_t C, int64_t k0, int64_t c0, bool vec) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int kk = idx / (kBM / kVec), cc = (idx % (kBM / kVec)) * kVec;
    const int64_t gk = k0 + kk, gc = c0 + cc;
    const T* src = X + gk * ld + gc;
    if (gk < K && vec && gc + kVec <= C) {
      r.v[i] = *reinterpret_cast<const uint4*>(src);
    } else {  // the raw 16-bit patterns (0 is +0.0 in bf16 and f16), packed little-endian
      const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
      uint32_t w[kVec / 2];
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const uint32_t lo = (gk < K && gc + 2 * j < C) ? s16[2 * j] : 0u;
        const uint32_t hi = (gk < K && gc + 2 * j + 1 < C) ? s16[2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
      }
      r.v[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <class T>
__device__ __forceinline__ void store_tile(T (*S)[kBM + kPad], const TileRegs<T>& r) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int kk = idx / (kBM / kVec), cc = (idx % (kBM / kVec)) * kVec;
    *reinterpret_cast<uint4*>(&S[kk][cc]) = r.v[i];
  }
}

// C_g[M, N] = alpha * A_g^T B_g + beta * C_g with A_g [K, M] (lda), B_g [K, N] (ldb) row-major,
// 16-bit inputs, f32 C: the weight-gradient shape d_W += d_Y^T X. One CTA per 128x128 tile of
// one problem; 8 warps of 64x32, each 4x2 WMMA 16x16x16 fragments with fp32 accumulators.
// Shared tiles are double-buffered: the global loads of step k+1 are in flight (in registers)
// while step k's MMAs run, so one barrier per step suffices.
template <class T>
__global__ void __launch_bounds__(kThreads)
    grouped_tn_f32_kernel(const DevProblem* __restrict__ probs, int num_probs, int64_t lda,
                          int64_t ldb, int64_t ldc, float alpha, float beta, bool vec) {
  using namespace nvcuda;
  __shared__ __align__(128) T As[2][kBK][kBM + kPad];
  __shared__ __align__(128) T Bs[2][kBK][kBN + kPad];
  __shared__ __align__(128) float Cw[kThreads / 32][16][16];  // per-warp epilogue staging
  __shared__ int s_prob;
  if (threadIdx.x == 0) {  // the problem owning this CTA: last one with tile_start <= blockIdx.x
    int lo = 0, hi = num_probs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (probs[mid].tile_start <= static_cast<int64_t>(blockIdx.x))
        lo = mid;
      else
        hi = mid - 1;
    }
    s_prob = lo;
  }
  __syncthreads();
  const DevProblem p = probs[s_prob];
  const int64_t tile = blockIdx.x - p.tile_start;
  const int64_t tiles_n = (p.N + kBN - 1) / kBN;
  const int64_t m0 = (tile / tiles_n) * kBM, n0 = (tile % tiles_n) * kBN;
  const T* A = static_cast<const T*>(p.A);
  const T* B = static_cast<const T*>(p.B);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4;  // warp tile: rows [wm*64, +64), cols [wn*32, +32)

#if __CUDA_ARCH__ >= 800
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#else
  // Pre-Ampere PTX (a build for compute_75 JIT-compiled on a newer GPU) has no bf16 WMMA:
  // each lane accumulates the same 4x2 fragments' 64 outputs in scalar fp32 instead.
  float acc_s[4][2][8];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int e = 0; e < 8; ++e) acc_s[i][j][e] = 0.0f;
#endif

  TileRegs<T> ra, rb;
  if (p.K > 0) {
    load_tile(ra, A, lda, p.K, p.M, 0, m0, vec);
    load_tile(rb, B, ldb, p.K, p.N, 0, n0, vec);
    store_tile(As[0], ra);
    store_tile(Bs[0], rb);
  }
  __syncthreads();
  int cur = 0;
  for (int64_t k0 = 0; k0 < p.K; k0 += kBK) {
    const bool more = k0 + kBK < p.K;
    if (more) {
      load_tile(ra, A, lda, p.K, p.M, k0 + kBK, m0, vec);
      load_tile(rb, B, ldb, p.K, p.N, k0 + kBK, n0, vec);
    }
#if __CUDA_ARCH__ >= 800
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      // op(A) tile element (m, k) sits at As[k][m]: column-major for matrix_a.
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(fa[i], &As[cur][kk][wm * 64 + i * 16], kBM + kPad);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fb[j], &Bs[cur][kk][wn * 32 + j * 16], kBN + kPad);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
#else
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 8; ++e) {
          const int r = (lane * 8 + e) / 16, c = (lane * 8 + e) % 16;
          float s = 0.0f;
          for (int kk = 0; kk < kBK; ++kk)
            s += load_f(&As[cur][kk][wm * 64 + i * 16 + r], 0) *
                 load_f(&Bs[cur][kk][wn * 32 + j * 16 + c], 0);
          acc_s[i][j][e] += s;
        }
#endif
    if (more) {
      store_tile(As[cur ^ 1], ra);
      store_tile(Bs[cur ^ 1], rb);
    }
    __syncthreads();
    cur ^= 1;
  }
  // Epilogue, one 16x16 fragment at a time through the warp's staging tile: bounds, alpha, beta.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#if __CUDA_ARCH__ >= 800
      wmma::store_matrix_sync(&Cw[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
#else
      for (int e = 0; e < 8; ++e)
        Cw[warp][(lane * 8 + e) / 16][(lane * 8 + e) % 16] = acc_s[i][j][e];
#endif
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = e / 16, c = e % 16;
        const int64_t gm = m0 + wm * 64 + i * 16 + r, gn = n0 + wn * 32 + j * 16 + c;
        if (gm < p.M && gn < p.N) {
          float* out = p.C + gm * ldc + gn;
          const float v = alpha * Cw[warp][r][c];
          *out = beta == 0.0f ? v : v + beta * *out;
        }
      }
      __syncwarp();
    }
}

void grouped_own_tn(const std::vector<GemmProblem>& ps, float alpha, DType ab, int64_t lda,
                    int64_t ldb, float beta, int64_t ldc, int dev) {
  std::vector<DevProblem> dp;
  int64_t tiles = 0;
  // 16-byte loads need every row start 16-byte aligned: ld % 8 == 0 and aligned bases.
  bool vec = lda % kVec == 0 && ldb % kVec == 0;
  for (const GemmProblem& p : ps) {
    dp.push_back({p.M, p.N, p.K, p.A, p.B, static_cast<float*>(p.C), tiles});
    tiles += ceil_div(p.M, kBM) * ceil_div(p.N, kBN);
    vec = vec && reinterpret_cast<uintptr_t>(p.A) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(p.B) % 16 == 0;
  }
  BB_CHECK(tiles < (int64_t{1} << 31), "cuda::gemm_grouped: too many tiles (", tiles, ")");
  Tensor meta = upload(dp.data(), dp.size() * sizeof(DevProblem), dev);
  const auto* d = static_cast<const DevProblem*>(meta.raw());
  const int n = static_cast<int>(dp.size());
  if (ab == DType::bf16)
    grouped_tn_f32_kernel<__nv_bfloat16><<<static_cast<unsigned>(tiles), kThreads, 0, stream()>>>(
        d, n, lda, ldb, ldc, alpha, beta, vec);
  else
    grouped_tn_f32_kernel<__half><<<static_cast<unsigned>(tiles), kThreads, 0, stream()>>>(
        d, n, lda, ldb, ldc, alpha, beta, vec);
  BB_CHECK_LAUNCH();
}

// All problems with one cublasGemmGroupedBatchedEx call: one group per problem (group_size 1),
// swapped operands as in gemm().
void grouped_cublas(bool ta, bool tb, const std::vector<GemmProblem>& ps, float alpha, DType ab,
                    int64_t lda, int64_t ldb, float beta, DType cdt, int64_t ldc, int dev) {
  const int G = static_cast<int>(ps.size());
  std::vector<cublasOperation_t> op_a(G, tb ? CUBLAS_OP_T : CUBLAS_OP_N),
      op_b(G, ta ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<int> m(G), n(G), k(G), ld_a(G, static_cast<int>(ldb)), ld_b(G, static_cast<int>(lda)),
      ld_c(G, static_cast<int>(ldc)), size(G, 1);
  std::vector<float> alphas(G, alpha), betas(G, beta);
  std::vector<const void*> ptrs(3 * static_cast<size_t>(G));
  for (int g = 0; g < G; ++g) {
    BB_CHECK(ps[g].M < (1 << 30) && ps[g].N < (1 << 30) && ps[g].K < (1 << 30) &&
                 std::max({lda, ldb, ldc}) < (1 << 30),
             "cuda::gemm_grouped: sizes must fit in int32");
    m[g] = static_cast<int>(ps[g].N);
    n[g] = static_cast<int>(ps[g].M);
    k[g] = static_cast<int>(ps[g].K);
    ptrs[g] = ps[g].B;
    ptrs[G + g] = ps[g].A;
    ptrs[2 * G + g] = ps[g].C;
  }
  Tensor dptrs = upload(ptrs.data(), ptrs.size() * sizeof(void*), dev);
  const void* const* d = static_cast<const void* const*>(dptrs.raw());
  DeviceGemm& dg = device_gemm(dev);
  cublasHandle_t blas = thread_blas(thread_gemm(dev));
  BB_CHECK_CUBLAS(cublasSetStream(blas, stream()));
  BB_CHECK_CUBLAS(cublasSetWorkspace(blas, stream_workspace(dg, dev), kWorkspaceBytes));
  const cudaDataType_t t = cuda_type(ab), tc = cuda_type(cdt);
  BB_CHECK_CUBLAS(cublasGemmGroupedBatchedEx(
      blas, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alphas.data(), d, t,
      ld_a.data(), d + G, t, ld_b.data(), betas.data(), const_cast<void* const*>(d + 2 * G), tc,
      ld_c.data(), G, size.data(), CUBLAS_COMPUTE_32F));
}

// Side streams 0..n-1 of `dev` with their workspaces and events, created on first need.
// Caller holds st.grouped_mu; `dev` is current.
void ensure_side_streams(DeviceGemm& st, int n, int dev) {
  if (!st.fork) BB_CHECK_CUDA(cudaEventCreateWithFlags(&st.fork, cudaEventDisableTiming));
  while (static_cast<int>(st.side.size()) < n) {
    // The workspace first (the step most likely to fail, near a full GPU), so that a failure
    // leaves the three lists the same length. Ordered for the calling stream (new_workspace),
    // and the side streams start after the fork event recorded on it.
    void* ws = new_workspace(dev);
    cudaStream_t s = nullptr;
    cudaEvent_t e = nullptr;
    // Non-blocking like the compute stream (no implicit ordering with the legacy stream) and at
    // its priority (the default is the lowest, the copy stream's).
    BB_CHECK_CUDA(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, work_stream_priority(dev)));
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    st.side_ws.push_back(ws);
    st.side.push_back(s);
    st.side_done.push_back(e);
  }
}

}  // namespace

namespace gemm_detail {  // DeviceGemm::pool (gemm_common.cuh)

// Enqueueing one cuBLASLt call costs the host ~8 us; with 2E calls per stage and small experts
// the host, not the GPU, sets the pace (bench_experts' `host ms`). The pool's threads enqueue the
// shares of side streams 1..S-1 in parallel with the calling thread, which takes share 0. Each
// thread has its own cuBLASLt handle. Created once per device and never destroyed (the threads
// are detached and wait on the pool's condition variable for the life of the process).
struct EnqueuePool {
  std::mutex m;
  std::condition_variable cv_job, cv_done;
  uint64_t generation = 0;
  int pending = 0;
  std::vector<std::function<void(cublasLtHandle_t)>> jobs;  // jobs[w] for worker w (w >= 1)
  std::vector<cublasLtHandle_t> handles;                     // handles[w]
  int workers = 0;                                           // threads started (w = 1..workers)
};

}  // namespace gemm_detail

namespace {

void worker_loop(EnqueuePool* pool, int w, int dev) {
  set_device(dev);
  uint64_t seen = 0;
  for (;;) {
    std::function<void(cublasLtHandle_t)> job;
    {
      std::unique_lock<std::mutex> lk(pool->m);
      pool->cv_job.wait(lk, [&] { return pool->generation != seen; });
      seen = pool->generation;
      if (w < static_cast<int>(pool->jobs.size())) job = pool->jobs[w];
    }
    if (job) job(pool->handles[w]);
    {
      std::lock_guard<std::mutex> lk(pool->m);
      if (job && --pool->pending == 0) pool->cv_done.notify_all();
    }
  }
}

// Caller holds st.grouped_mu; `dev` is current.
EnqueuePool& ensure_pool(DeviceGemm& st, int n, int dev) {
  if (!st.pool) st.pool = new EnqueuePool;
  EnqueuePool& pool = *st.pool;
  std::lock_guard<std::mutex> lk(pool.m);
  if (pool.handles.empty()) pool.handles.push_back(nullptr);  // worker 0 is the caller
  while (pool.workers < n - 1) {
    cublasLtHandle_t h = nullptr;
    BB_CHECK_CUBLAS(cublasLtCreate(&h));
    pool.handles.push_back(h);  // before the thread, which reads handles[w]
    try {
      std::thread(worker_loop, &pool, pool.workers + 1, dev).detach();
    } catch (...) {
      pool.handles.pop_back();
      cublasLtDestroy(h);
      throw;
    }
    ++pool.workers;  // only a started thread counts: jobs are given to w <= workers
  }
  return pool;
}

// Per-problem cuBLASLt GEMMs spread over `num_streams` side streams (see gemm.h). The A, B, C
// buffers were produced on (and will be freed on) the calling stream: the fork orders every
// side stream after what the calling stream has queued so far, the join orders what it queues
// next after every side stream, so the stream-ordered allocator stays correct. One call at a
// time per device uses the side streams (st.grouped_mu).
void grouped_multi_stream(bool ta, bool tb, const std::vector<GemmProblem>& ps, float alpha,
                          DType ab, int64_t lda, int64_t ldb, float beta, DType cdt, int64_t ldc,
                          int num_streams, int dev) {
  std::vector<size_t> order;  // the problems with a product, largest first
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].K == 0)  // C = beta C: a kernel on the compute stream, before the fork
      scale_c(ps[i].C, cdt, ps[i].M, ps[i].N, ldc, 0, 1, beta);
    else
      order.push_back(i);
  }
  if (order.empty()) return;
  auto work = [&](size_t i) {
    return static_cast<double>(ps[i].M) * static_cast<double>(ps[i].N) *
           static_cast<double>(ps[i].K);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return work(x) > work(y); });
  const int S = static_cast<int>(std::min<size_t>(static_cast<size_t>(num_streams), order.size()));
  // Largest first to the least-loaded stream (lowest index on ties: round-robin when equal).
  std::vector<std::vector<size_t>> share(static_cast<size_t>(S));
  std::vector<double> load(static_cast<size_t>(S), 0.0);
  for (size_t i : order) {
    const size_t s = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    share[s].push_back(i);
    load[s] += work(i);
  }

  DeviceGemm& st = device_gemm(dev);
  ThreadGemm& tg = thread_gemm(dev);
  std::lock_guard<std::mutex> lock(st.grouped_mu);
  ensure_side_streams(st, S, dev);
  // Every plan before the fork: a missing algorithm throws here, with no side work in flight.
  // Room first: an eviction in the middle would free plans already looked up.
  make_room(tg, order.size());
  std::vector<const Plan*> plan(ps.size(), nullptr);
  for (size_t i : order)
    plan[i] = &get_plan(tg, st, plan_key(ta, tb, ps[i].M, ps[i].N, ps[i].K, ps[i].A, ab, lda, 0,
                                     ps[i].B, ab, ldb, 0, ps[i].C, cdt, ldc, 0, 1));
  cudaStream_t main = stream();
  BB_CHECK_CUDA(cudaEventRecord(st.fork, main));
  for (int s = 0; s < S; ++s) BB_CHECK_CUDA(cudaStreamWaitEvent(st.side[s], st.fork, 0));
  // Stream s's share, enqueued with handle `lt`; returns the first failure ("" if none).
  auto enqueue_share = [&](int s, cublasLtHandle_t lt) -> std::string {
    for (size_t i : share[s]) {
      const GemmProblem& p = ps[i];
      const Plan& pl = *plan[i];
      const cublasStatus_t r =
          cublasLtMatmul(lt, pl.desc, &alpha, p.B, pl.a, p.A, pl.b, &beta, p.C, pl.c, p.C, pl.c,
                         &pl.algo, st.side_ws[s], kWorkspaceBytes, st.side[s]);
      if (r != CUBLAS_STATUS_SUCCESS)
        return std::string("cuBLAS error in cublasLtMatmul (multi-stream grouped GEMM, M=") +
               std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K) +
               "): " + cublasLtGetStatusName(r);
    }
    return "";
  };
  std::string failure;
  if (S > 1 && knobs().threaded.load(std::memory_order_relaxed)) {
    // Shares 1..S-1 on the pool's threads, share 0 here, all at once.
    EnqueuePool& pool = ensure_pool(st, S, dev);
    std::vector<std::string> fails(static_cast<size_t>(S));
    {
      std::lock_guard<std::mutex> lk(pool.m);
      pool.jobs.assign(static_cast<size_t>(S), nullptr);
      for (int w = 1; w < S; ++w)
        pool.jobs[w] = [&, w](cublasLtHandle_t lt) { fails[w] = enqueue_share(w, lt); };
      pool.pending = S - 1;
      ++pool.generation;
    }
    pool.cv_job.notify_all();
    fails[0] = enqueue_share(0, tg.lt);
    {
      std::unique_lock<std::mutex> lk(pool.m);
      pool.cv_done.wait(lk, [&] { return pool.pending == 0; });
      pool.jobs.clear();
    }
    for (const std::string& f : fails)
      if (failure.empty()) failure = f;
  } else {
    // One thread: launches interleaved across the streams (the j-th problem of every share,
    // then the next), so that all streams have work while the host is still enqueueing.
    size_t longest = 0;
    for (const auto& sh : share) longest = std::max(longest, sh.size());
    for (size_t j = 0; j < longest && failure.empty(); ++j)
      for (int s = 0; s < S && failure.empty(); ++s) {
        if (j >= share[s].size()) continue;
        const GemmProblem& p = ps[share[s][j]];
        const Plan& pl = *plan[share[s][j]];
        const cublasStatus_t r =
            cublasLtMatmul(tg.lt, pl.desc, &alpha, p.B, pl.a, p.A, pl.b, &beta, p.C, pl.c, p.C,
                           pl.c, &pl.algo, st.side_ws[s], kWorkspaceBytes, st.side[s]);
        if (r != CUBLAS_STATUS_SUCCESS)
          failure = std::string("cuBLAS error in cublasLtMatmul (multi-stream grouped GEMM, M=") +
                    std::to_string(p.M) + " N=" + std::to_string(p.N) + " K=" +
                    std::to_string(p.K) + "): " + cublasLtGetStatusName(r);
      }
  }
  // Joined even after a failure: the calling stream must not run ahead of queued side work.
  for (int s = 0; s < S; ++s) {
    BB_CHECK_CUDA(cudaEventRecord(st.side_done[s], st.side[s]));
    BB_CHECK_CUDA(cudaStreamWaitEvent(main, st.side_done[s], 0));
  }
  BB_CHECK(failure.empty(), failure);
}

}  // namespace

const char* grouped_algo_name(GroupedAlgo a) {
  switch (a) {
    case GroupedAlgo::automatic:
      return "automatic";
    case GroupedAlgo::cublas:
      return "cublas";
    case GroupedAlgo::multi_stream:
      return "multi_stream";
    case GroupedAlgo::wmma:
      return "wmma";
    case GroupedAlgo::mma:
      return "mma";
  }
  return "?";
}

GroupedDefaults grouped_defaults() {
  const Knobs& k = knobs();
  GroupedDefaults d;
  d.same_dtype = static_cast<GroupedAlgo>(k.same_dtype.load());
  d.widening = static_cast<GroupedAlgo>(k.widening.load());
  d.num_streams = k.num_streams.load();
  d.multi_stream_min_flops = k.min_flops.load();
  d.threaded_enqueue = k.threaded.load();
  d.tma = k.tma.load();
  return d;
}

void set_grouped_defaults(const GroupedDefaults& d) {
  BB_CHECK(d.same_dtype != GroupedAlgo::automatic && d.widening != GroupedAlgo::automatic,
           "cuda::set_grouped_defaults: a default must name an algorithm, not automatic");
  BB_CHECK(d.same_dtype != GroupedAlgo::wmma,
           "cuda::set_grouped_defaults: wmma takes only 16-bit -> f32, not same_dtype problems");
  BB_CHECK(d.widening != GroupedAlgo::cublas,
           "cuda::set_grouped_defaults: cublas (13.1) refuses 16-bit -> f32, not a widening "
           "default");
  BB_CHECK(d.multi_stream_min_flops >= 0, "cuda::set_grouped_defaults: multi_stream_min_flops must "
           "be >= 0, got ", d.multi_stream_min_flops);
  BB_CHECK(d.num_streams >= 1 && d.num_streams <= kMaxGroupedStreams,
           "cuda::set_grouped_defaults: num_streams=", d.num_streams, " is not in [1, ",
           kMaxGroupedStreams, "]");
  Knobs& k = knobs();
  k.same_dtype.store(static_cast<int>(d.same_dtype));
  k.widening.store(static_cast<int>(d.widening));
  k.num_streams.store(d.num_streams);
  k.min_flops.store(d.multi_stream_min_flops);
  k.threaded.store(d.threaded_enqueue);
  k.tma.store(d.tma);
}

void gemm_grouped(bool ta, bool tb, const std::vector<GemmProblem>& problems, float alpha, DType ab,
                  int64_t lda, int64_t ldb, float beta, DType cdt, int64_t ldc, int dev,
                  GroupedConfig cfg) {
  (void)cuda_type(ab), (void)cuda_type(cdt);  // dtype checks
  BB_CHECK(cfg.num_streams >= 0 && cfg.num_streams <= kMaxGroupedStreams,
           "cuda::gemm_grouped: num_streams=", cfg.num_streams, " is not in [0, ",
           kMaxGroupedStreams, "] (0 = the default)");
  const GroupedDefaults defaults = grouped_defaults();
  const bool same = ab == cdt;
  GroupedAlgo algo = cfg.algo;
  const bool tma = cfg.tma && defaults.tma;
  // Automatic: the TMA kernel first for every forward, dgrad and wgrad call it takes, faster
  // than the other algorithms at 256-2048 rows per expert (skills/experts.md; the wgrad that adds,
  // beta 1 on later micro-batches, level with multi_stream at 512-1024 rows and 3-18 % faster
  // elsewhere, without multi_stream's 1-2 ms of host enqueue); then the dtype defaults and the
  // FLOP line.
  const bool tma_first = algo == GroupedAlgo::automatic && tma &&
                         grouped_tma_refusal(ta, tb, problems, ab, lda, ldb, cdt, dev).empty();
  if (tma_first) {
    algo = GroupedAlgo::mma;
    cfg.tile_m = 0;
  } else if (algo == GroupedAlgo::automatic) {
    algo = same ? defaults.same_dtype : defaults.widening;
    if (same && native(ab, cdt)) {
      double flops = 0;
      int64_t n = 0;
      for (const GemmProblem& p : problems)
        if (p.M > 0 && p.N > 0) flops += 2.0 * p.M * p.N * p.K, ++n;
      if (n > 0 && flops / static_cast<double>(n) >= defaults.multi_stream_min_flops)
        algo = GroupedAlgo::multi_stream;
    }
  }
  const int num_streams = cfg.num_streams > 0 ? cfg.num_streams : defaults.num_streams;
  std::string mma_refusal;
  if (algo == GroupedAlgo::mma) {
    mma_refusal = grouped_mma_refusal(ta, tb, problems, ab, lda, ldb, cdt, ldc, dev);
    // A default that cannot take this call falls back instead of failing the step.
    if (!mma_refusal.empty() && cfg.algo == GroupedAlgo::automatic)
      algo = same ? GroupedAlgo::cublas : GroupedAlgo::multi_stream;
  }
  bool ok = false;
  const char* takes = "";
  switch (algo) {
    case GroupedAlgo::cublas:
      ok = same;
      takes = "bf16 -> bf16, f16 -> f16, f32 -> f32";
      break;
    case GroupedAlgo::multi_stream:
      ok = native(ab, cdt);
      takes = "f32 -> f32, bf16 -> bf16|f32, f16 -> f16|f32";
      break;
    case GroupedAlgo::wmma:
      ok = (ab == DType::bf16 || ab == DType::f16) && cdt == DType::f32 && ta && !tb;
      takes = "bf16|f16 -> f32 with trans_a && !trans_b";
      break;
    case GroupedAlgo::mma:
      ok = mma_refusal.empty();
      takes = "bf16|f16 -> the same or f32, with multiples of 8 and 16-byte aligned matrices";
      break;
    case GroupedAlgo::automatic:
      break;
  }
  BB_CHECK(algo != GroupedAlgo::mma || ok, "cuda::gemm_grouped: algorithm mma refuses this call: ",
           mma_refusal);
  BB_CHECK(ok, "cuda::gemm_grouped: inputs ", dtype_name(ab), " with output ", dtype_name(cdt),
           " and trans_a=", ta, " trans_b=", tb, " is not supported by algorithm ",
           grouped_algo_name(algo), " (it takes ", takes, ")");
  std::vector<GemmProblem> ps;
  for (const GemmProblem& p : problems) {
    check_dims("cuda::gemm_grouped", ta, tb, p.M, p.N, p.K, lda, ldb, ldc);
    if (p.M > 0 && p.N > 0) ps.push_back(p);
  }
  if (ps.empty()) return;
  cuda::set_device(dev);
  switch (algo) {
    case GroupedAlgo::cublas:
      grouped_cublas(ta, tb, ps, alpha, ab, lda, ldb, beta, cdt, ldc, dev);
      break;
    case GroupedAlgo::multi_stream:
      grouped_multi_stream(ta, tb, ps, alpha, ab, lda, ldb, beta, cdt, ldc, num_streams, dev);
      break;
    case GroupedAlgo::wmma:
      grouped_own_tn(ps, alpha, ab, lda, ldb, beta, ldc, dev);
      break;
    case GroupedAlgo::mma:
      grouped_mma(ta, tb, ps, alpha, ab, lda, ldb, beta, cdt, ldc, dev, cfg.tile_m, tma);
      break;
    case GroupedAlgo::automatic:
      break;
  }
}

}  // namespace bb::cuda

// gemm.cu — cuBLASLt GEMM (gemm, gemm_strided_batched): the per-device state, the thread's
// handles and the plan cache, the heuristic's bucketed algorithms, and the dtype conversions
// around cuBLASLt. The grouped GEMM dispatch (cuBLAS grouped, multi-stream cuBLASLt, our mma.sync
// tile kernel of grouped_mma.cu, and a WMMA grouped weight-gradient kernel) is in gemm_grouped.cu;
// what both use is declared in gemm_common.cuh.
//
// Row-major on a column-major library: a row-major X[r, c] is the column-major X^T, so
// C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T: cuBLAS sees m = N, n = M, its "A" is our
// B and its "B" is our A, with the same transpose flags.
//
// Per device, created once and kept for the life of the process: one cuBLASLt handle, one cuBLAS
// handle (grouped GEMM only), one 32 MiB workspace Tensor under MemCategory::workspace, and for
// the multi-stream grouped GEMM (created on its first use) side streams, each with its own
// 32 MiB workspace (concurrent cuBLASLt calls must not share one) and a join event. cuBLASLt
// plans (descriptors, layouts and the heuristic's algorithm) are cached by everything that
// decides them: shape, leading dims, batch strides, transposes, dtypes and pointer alignment.
// NOTES: the alignment is part of the key because cuBLASLt's heuristic assumes 256-byte aligned
// buffers unless told otherwise, and expert slices (rows [off_e, ...) of a tensor) rarely are.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_common.cuh"
#include "backend/cuda/runtime.h"
#include "backend/cuda/vec.cuh"
#include "core/tensor.h"

namespace bb::cuda {

using namespace gemm_detail;  // gemm_common.cuh

namespace {

// ---- per-device state (the types: gemm_common.cuh), and what only this file uses ---------------

constexpr int kMaxDevices = 64;
std::atomic<DeviceGemm*> g_devices[kMaxDevices] = {};
std::mutex g_devices_mu;
std::atomic<uint64_t> g_generation{1};  // bumped by gemm_clear_cache
std::atomic<int64_t> g_heuristic_calls{0};

int alignment_of(const void* p, int64_t stride_bytes) {
  uint64_t v = reinterpret_cast<uint64_t>(p) | 256u;
  if (stride_bytes) v |= static_cast<uint64_t>(stride_bytes);
  return static_cast<int>(v & (~v + 1));  // lowest set bit, at most 256
}

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, T v) {
  BB_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d, a, &v, sizeof(v)));
}
template <class T>
void set_attr(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a, T v) {
  BB_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, a, &v, sizeof(v)));
}
template <class T>
void set_attr(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, T v) {
  BB_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(p, a, &v, sizeof(v)));
}

cublasLtMatrixLayout_t make_layout(DType dt, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  BB_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, cuda_type(dt), static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    set_attr(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(batch));
    set_attr(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
  }
  return l;
}

// Expert GEMMs change M (forward, dgrad) or K (wgrad) with the routing every step; asking
// cuBLASLt's heuristic for every new size costs host time in every step. Sizes are bucketed
// (steps of 1/8 of the power of two below, at least 64; exact below 64) and the heuristic runs once
// per bucket; a bucket's algorithm is checked against each exact size (cublasLtMatmulAlgoCheck)
// before use and the exact size gets its own heuristic if the check fails.
// set_exact_heuristics(true) ([backend] gemm_heuristics = "exact") turns the bucketing off
// (every new shape asks the heuristic).
int64_t size_bucket(int64_t x) {
  if (x < 64) return x;
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  const int64_t step = std::max<int64_t>(64, p / 8);
  return (x + step - 1) / step * step;
}

PlanKey bucket_key(PlanKey k) {
  k.M = size_bucket(k.M);
  k.K = size_bucket(k.K);
  return k;
}

// Bounds the exact-shape plan cache of a thread (every distinct expert size adds one).
constexpr size_t kMaxPlans = 16384;

void destroy_plan(Plan& p) {
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatmulDescDestroy(p.desc);
}

// Elements spanned by `batch` row-major matrices of rows x cols with leading dim ld.
int64_t span(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

// A converted device copy of `n` elements (workspace category).
Tensor converted(const void* p, DType from, DType to, int64_t n, int dev) {
  Tensor t =
      Tensor::empty({std::max<int64_t>(n, 1)}, to, Device::cuda(dev), MemCategory::workspace);
  convert(t.raw(), to, p, from, n);
  return t;
}

// C[b][r, c] = beta * C (beta = 0 writes zeros, NaN included): the K = 0 product.
template <class T>
__global__ void scale_kernel(T* C, int64_t rows, int64_t cols, int64_t ldc, int64_t stride,
                             int64_t batch, float beta) {
  const int64_t n = rows * cols * batch;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / (rows * cols), r = (i / cols) % rows, c = i % cols;
    T* p = C + b * stride + r * ldc + c;
    store_f(p, 0, beta == 0.0f ? 0.0f : beta * load_f(p, 0));
  }
}

}  // namespace

namespace gemm_detail {  // what gemm_grouped.cu also uses (declared in gemm_common.cuh)

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      BB_FAIL("cuda::gemm: dtype ", dtype_name(dt), " is not f32, bf16 or f16");
  }
}

Knobs& knobs() {
  static Knobs k;
  return k;
}

// A 32 MiB workspace on `dev`, kept for the life of the process (deliberately never freed: it
// would be released after the allocator and the CUDA context at exit). It counts as live
// `workspace` memory. Allocated on the compute stream; when the caller's current stream is
// another one, that stream first waits for the compute stream, so no work it issues next (or a
// stream forked from it) touches memory the compute stream still uses.
void* new_workspace(int dev) {
  const Stream caller = current_stream();
  Tensor* ws = nullptr;
  {
    StreamScope on_compute(Stream::compute);
    ws = new Tensor(Tensor::empty({static_cast<int64_t>(kWorkspaceBytes)}, DType::u8,
                                  Device::cuda(dev), MemCategory::workspace));
  }
  if (caller != Stream::compute) Event::record(Device::cuda(dev), Stream::compute).wait(caller);
  return ws->raw();
}

DeviceGemm& device_gemm(int dev) {
  BB_CHECK(dev >= 0 && dev < device_count() && dev < kMaxDevices, "cuda::gemm: cuda:", dev,
           " requested but ", device_count(), " CUDA device(s) are visible");
  if (DeviceGemm* d = g_devices[dev].load(std::memory_order_acquire)) return *d;
  std::lock_guard<std::mutex> lock(g_devices_mu);
  if (DeviceGemm* d = g_devices[dev].load(std::memory_order_acquire)) return *d;
  auto* d = new DeviceGemm;  // lives for the process
  g_devices[dev].store(d, std::memory_order_release);
  return *d;
}

// The workspace of the calling thread's current stream on `dev`.
void* stream_workspace(DeviceGemm& d, int dev) {
  const int s = static_cast<int>(current_stream());
  if (void* w = d.workspace[s].load(std::memory_order_acquire)) return w;
  std::lock_guard<std::mutex> lock(d.mu);
  if (void* w = d.workspace[s].load(std::memory_order_acquire)) return w;
  void* w = new_workspace(dev);  // ordered for this stream
  d.workspace[s].store(w, std::memory_order_release);
  return w;
}

// The calling thread's handles and plans for `dev` (the current device), created on first use.
// Never destroyed: a thread-exit destructor could run after the CUDA context is gone.
ThreadGemm& thread_gemm(int dev) {
  thread_local std::vector<ThreadGemm*> mine;
  if (static_cast<int>(mine.size()) <= dev) mine.resize(static_cast<size_t>(dev) + 1, nullptr);
  ThreadGemm*& t = mine[static_cast<size_t>(dev)];
  if (!t) {
    t = new ThreadGemm;
    BB_CHECK_CUBLAS(cublasLtCreate(&t->lt));
    t->generation = g_generation.load();
  }
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (t->generation != gen) {  // gemm_clear_cache ran: drop this thread's plans
    for (auto& [k, p] : t->plans) destroy_plan(p);
    t->plans.clear();
    t->generation = gen;
  }
  return *t;
}

cublasHandle_t thread_blas(ThreadGemm& t) {
  if (!t.blas) {
    BB_CHECK_CUBLAS(cublasCreate(&t.blas));
    BB_CHECK_CUBLAS(cublasSetPointerMode(t.blas, CUBLAS_POINTER_MODE_HOST));
  }
  return t.blas;
}

// Empties the plan cache if `n` more plans might not fit, so that the next n get_plan calls
// never evict (a caller holding several plan references at once calls this first).
void make_room(ThreadGemm& t, size_t n) {
  BB_CHECK(n < kMaxPlans, "cuda::gemm: ", n, " problems in one call exceed the plan cache (",
           kMaxPlans, ")");
  if (t.plans.size() + n <= kMaxPlans) return;
  for (auto& [key, plan] : t.plans) destroy_plan(plan);
  t.plans.clear();
}

// The plan of `k` from this thread's cache; on a miss, built with the shared algorithm of its
// bucket (checked for this exact size) or a new heuristic query.
const Plan& get_plan(ThreadGemm& t, DeviceGemm& d, const PlanKey& k) {
  auto it = t.plans.find(k);
  if (it != t.plans.end()) return it->second;
  make_room(t, 1);
  const DType at = static_cast<DType>(k.a), bt = static_cast<DType>(k.b),
              ct = static_cast<DType>(k.c);
  Plan p;
  BB_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLAS's A is our B (op = trans_b), its B is our A (op = trans_a).
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_TRANSA,
           static_cast<int32_t>(k.tb ? CUBLAS_OP_T : CUBLAS_OP_N));
  set_attr(p.desc, CUBLASLT_MATMUL_DESC_TRANSB,
           static_cast<int32_t>(k.ta ? CUBLAS_OP_T : CUBLAS_OP_N));
  p.a = make_layout(bt, k.tb ? k.K : k.N, k.tb ? k.N : k.K, k.ldb, k.batch, k.sb);
  p.b = make_layout(at, k.ta ? k.M : k.K, k.ta ? k.K : k.M, k.lda, k.batch, k.sa);
  p.c = make_layout(ct, k.N, k.M, k.ldc, k.batch, k.sc);

  // The shared algorithm of this shape's key: in bucketed mode its bucket's (checked for this
  // exact size unless this size is the one that found it), in exact mode this shape's own. The
  // two modes keep separate maps, so an exact run never uses an algorithm a bucketed one found
  // for another size.
  const bool exact_mode = knobs().exact.load(std::memory_order_relaxed);
  const PlanKey ak = exact_mode ? k : bucket_key(k);
  std::map<PlanKey, Algo>& algos = exact_mode ? d.exact_algos : d.algos;
  std::lock_guard<std::mutex> lock(d.mu);
  auto ai = algos.find(ak);
  if (ai != algos.end()) {
    const bool donor = ai->second.donor_m == k.M && ai->second.donor_k == k.K;
    cublasLtMatmulHeuristicResult_t chk{};
    if (donor || (cublasLtMatmulAlgoCheck(t.lt, p.desc, p.a, p.b, p.c, p.c, &ai->second.algo,
                                          &chk) == CUBLAS_STATUS_SUCCESS &&
                  chk.workspaceSize <= kWorkspaceBytes)) {
      p.algo = ai->second.algo;
      p.workspace = donor ? ai->second.workspace : chk.workspaceSize;
      return t.plans.emplace(k, p).first->second;
    }
  }

  cublasLtMatmulPreference_t pref = nullptr;
  BB_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  set_attr(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
  set_attr(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(k.align_b));
  set_attr(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(k.align_a));
  set_attr(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(k.align_c));
  set_attr(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(k.align_c));
  g_heuristic_calls.fetch_add(1);
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st_h =
      cublasLtMatmulAlgoGetHeuristic(t.lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st_h != CUBLAS_STATUS_SUCCESS || found == 0) destroy_plan(p);
  BB_CHECK(st_h == CUBLAS_STATUS_SUCCESS && found > 0,
           "cuda::gemm: cuBLASLt has no algorithm for M=", k.M, " N=", k.N, " K=", k.K,
           " trans_a=", k.ta, " trans_b=", k.tb, " A ", dtype_name(at), " B ", dtype_name(bt),
           " C ", dtype_name(ct), " lda=", k.lda, " ldb=", k.ldb, " ldc=", k.ldc,
           " batch=", k.batch, " (", cublasLtGetStatusName(st_h), ")");
  p.algo = res.algo;
  p.workspace = res.workspaceSize;
  // The first size seen in a bucket donates its algorithm to the bucket.
  algos.emplace(ak, Algo{res.algo, res.workspaceSize, k.M, k.K});
  return t.plans.emplace(k, p).first->second;
}

bool native(DType ab, DType c) {
  if (ab == DType::f32) return c == DType::f32;
  if (ab == DType::bf16) return c == DType::bf16 || c == DType::f32;
  if (ab == DType::f16) return c == DType::f16 || c == DType::f32;
  return false;
}

void scale_c(void* C, DType dt, int64_t rows, int64_t cols, int64_t ldc, int64_t stride,
             int64_t batch, float beta) {
  if (beta == 1.0f || rows * cols * batch == 0) return;
  const int threads = 256;
  const int blocks =
      static_cast<int>(std::min<int64_t>(ceil_div(rows * cols * batch, threads), 4096));
  switch (dt) {
    case DType::f32:
      scale_kernel<<<blocks, threads, 0, stream()>>>(static_cast<float*>(C), rows, cols, ldc,
                                                     stride, batch, beta);
      break;
    case DType::bf16:
      scale_kernel<<<blocks, threads, 0, stream()>>>(static_cast<__nv_bfloat16*>(C), rows, cols,
                                                     ldc, stride, batch, beta);
      break;
    case DType::f16:
      scale_kernel<<<blocks, threads, 0, stream()>>>(static_cast<__half*>(C), rows, cols, ldc,
                                                     stride, batch, beta);
      break;
    default:
      BB_FAIL("cuda::gemm: C dtype ", dtype_name(dt), " is not a float type");
  }
  BB_CHECK_LAUNCH();
}

// The plan key of one cuBLASLt call (batch 1 ignores the strides).
PlanKey plan_key(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, DType adt,
                 int64_t lda, int64_t sa, const void* B, DType bdt, int64_t ldb, int64_t sb,
                 const void* C, DType cdt, int64_t ldc, int64_t sc, int64_t batch) {
  const int64_t ea = static_cast<int64_t>(dtype_size(adt)),
                eb = static_cast<int64_t>(dtype_size(bdt)),
                ec = static_cast<int64_t>(dtype_size(cdt));
  PlanKey k{M,
            N,
            K,
            lda,
            ldb,
            ldc,
            batch > 1 ? sa : 0,
            batch > 1 ? sb : 0,
            batch > 1 ? sc : 0,
            batch,
            ta,
            tb,
            static_cast<int>(adt),
            static_cast<int>(bdt),
            static_cast<int>(cdt),
            alignment_of(A, batch > 1 ? sa * ea : 0),
            alignment_of(B, batch > 1 ? sb * eb : 0),
            alignment_of(C, batch > 1 ? sc * ec : 0)};
  return k;
}

void check_dims(const char* op, bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda,
                int64_t ldb, int64_t ldc) {
  BB_CHECK(M >= 0 && N >= 0 && K >= 0, op, ": negative size M=", M, " N=", N, " K=", K);
  const int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
  BB_CHECK(lda >= std::max<int64_t>(a_cols, 1), op, ": lda=", lda, " is less than the ", a_cols,
           " columns of the stored A");
  BB_CHECK(ldb >= std::max<int64_t>(b_cols, 1), op, ": ldb=", ldb, " is less than the ", b_cols,
           " columns of the stored B");
  BB_CHECK(ldc >= std::max<int64_t>(N, 1), op, ": ldc=", ldc, " is less than N=", N);
}

}  // namespace gemm_detail

namespace {

// cuBLASLt on a natively supported combination, on the current stream with its workspace.
void lt_matmul(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
               DType adt, int64_t lda, int64_t sa, const void* B, DType bdt, int64_t ldb,
               int64_t sb, float beta, void* C, DType cdt, int64_t ldc, int64_t sc, int64_t batch,
               int dev) {
  DeviceGemm& d = device_gemm(dev);
  ThreadGemm& t = thread_gemm(dev);
  const Plan& p = get_plan(
      t, d, plan_key(ta, tb, M, N, K, A, adt, lda, sa, B, bdt, ldb, sb, C, cdt, ldc, sc, batch));
  BB_CHECK_CUBLAS(cublasLtMatmul(t.lt, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, C, p.c,
                                 &p.algo, stream_workspace(d, dev), kWorkspaceBytes, stream()));
}

}  // namespace

void gemm_strided_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                          const void* A, DType adt, int64_t lda, int64_t sa, const void* B,
                          DType bdt, int64_t ldb, int64_t sb, float beta, void* C, DType cdt,
                          int64_t ldc, int64_t sc, int64_t batch, int dev) {
  check_dims("cuda::gemm", ta, tb, M, N, K, lda, ldb, ldc);
  BB_CHECK(batch >= 0 && sa >= 0 && sb >= 0 && sc >= 0, "cuda::gemm: negative batch or stride");
  BB_CHECK(batch <= 1 || sc >= (M - 1) * ldc + N || M == 0 || N == 0,
           "cuda::gemm: output matrices overlap (stride_c=", sc, ")");
  (void)cuda_type(adt), (void)cuda_type(bdt), (void)cuda_type(cdt);  // dtype checks
  if (M == 0 || N == 0 || batch == 0) return;
  cuda::set_device(dev);
  if (K == 0) {  // no product: C = beta C (cuBLASLt does not take k = 0 everywhere)
    scale_c(C, cdt, M, N, ldc, sc, batch, beta);
    return;
  }
  // Bring the operands to one dtype: widening to f32 is exact.
  Tensor a_tmp, b_tmp, c_tmp;
  DType ab = adt;
  if (adt != bdt) {
    ab = DType::f32;
    if (adt != DType::f32) {
      a_tmp = converted(A, adt, DType::f32, span(ta ? K : M, ta ? M : K, lda, batch, sa), dev);
      A = a_tmp.raw();
    }
    if (bdt != DType::f32) {
      b_tmp = converted(B, bdt, DType::f32, span(tb ? N : K, tb ? K : N, ldb, batch, sb), dev);
      B = b_tmp.raw();
    }
  }
  if (native(ab, cdt)) {
    lt_matmul(ta, tb, M, N, K, alpha, A, ab, lda, sa, B, ab, ldb, sb, beta, C, cdt, ldc, sc, batch,
              dev);
    return;
  }
  // AB f32 with a 16-bit C (or bf16 x f16 mixes): widen what is not f32, run into an f32 copy
  // of C (the whole span, so that the gaps between rows convert back to themselves), narrow.
  if (ab != DType::f32) {
    a_tmp = converted(A, ab, DType::f32, span(ta ? K : M, ta ? M : K, lda, batch, sa), dev);
    b_tmp = converted(B, ab, DType::f32, span(tb ? N : K, tb ? K : N, ldb, batch, sb), dev);
    A = a_tmp.raw();
    B = b_tmp.raw();
  }
  const int64_t c_span = span(M, N, ldc, batch, sc);
  c_tmp = converted(C, cdt, DType::f32, c_span, dev);
  lt_matmul(ta, tb, M, N, K, alpha, A, DType::f32, lda, sa, B, DType::f32, ldb, sb, beta,
            c_tmp.raw(), DType::f32, ldc, sc, batch, dev);
  convert(C, cdt, c_tmp.raw(), DType::f32, c_span);
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, DType adt,
          int64_t lda, const void* B, DType bdt, int64_t ldb, float beta, void* C, DType cdt,
          int64_t ldc, int dev) {
  gemm_strided_batched(ta, tb, M, N, K, alpha, A, adt, lda, 0, B, bdt, ldb, 0, beta, C, cdt, ldc, 0,
                       1, dev);
}

void gemm_clear_cache() {
  g_generation.fetch_add(1, std::memory_order_acq_rel);  // every thread drops its plans
  for (auto& dp : g_devices) {
    DeviceGemm* d = dp.load(std::memory_order_acquire);
    if (!d) continue;
    std::lock_guard<std::mutex> lock(d->mu);
    d->algos.clear();
    d->exact_algos.clear();
  }
}

int64_t gemm_heuristic_calls() { return g_heuristic_calls.load(); }

int64_t gemm_cache_size() {
  int64_t n = 0;
  for (int dev = 0; dev < std::min(device_count(), kMaxDevices); ++dev)
    if (g_devices[dev].load(std::memory_order_acquire))
      n += static_cast<int64_t>(thread_gemm(dev).plans.size());
  return n;
}

void set_exact_heuristics(bool exact) {
  // A thread's plans were built under the old mode: a change makes every thread rebuild them
  // (the shared algorithms of both modes stay).
  if (knobs().exact.exchange(exact) != exact)
    g_generation.fetch_add(1, std::memory_order_acq_rel);
}
bool exact_heuristics() { return knobs().exact.load(); }

}  // namespace bb::cuda

// gemm_common.cuh — what gemm.cu (cuBLASLt GEMM) and gemm_grouped.cu (grouped GEMM dispatch)
// share, private to those two files: the cuBLAS status check, the per-device state and one
// thread's handles and plans (described at the top of gemm.cu), the process-wide knobs, and the
// cuBLASLt helpers the grouped paths reuse (defined in gemm.cu, namespace bb::cuda::gemm_detail).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"
#include "core/stream.h"

#define BB_CHECK_CUBLAS(expr)                                                  \
  do {                                                                         \
    cublasStatus_t bb_st_ = (expr);                                            \
    BB_CHECK(bb_st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error in ", #expr, ": ", \
             cublasLtGetStatusName(bb_st_));                                   \
  } while (0)

namespace bb::cuda::gemm_detail {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// ---- per-device state ------------------------------------------------------------------------

struct PlanKey {
  int64_t M, N, K, lda, ldb, ldc, sa, sb, sc, batch;
  int ta, tb, a, b, c, align_a, align_b, align_c;
  auto tie() const {
    return std::tie(M, N, K, lda, ldb, ldc, sa, sb, sc, batch, ta, tb, a, b, c, align_a, align_b,
                    align_c);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLAS's A, B, C(=D)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

// What the heuristic chose for a bucket of shapes (see bucket_key).
struct Algo {
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  int64_t donor_m = 0, donor_k = 0;  // the exact size whose heuristic query found it
};

// Shared by every thread, per device.
struct DeviceGemm {
  std::atomic<void*> workspace[kNumStreams] = {};  // created on first use under `mu`
  std::mutex mu;                                     // workspace creation, `algos`
  std::map<PlanKey, Algo> algos;                     // by bucketed key
  std::map<PlanKey, Algo> exact_algos;               // by exact key (gemm_heuristics = exact)
  // Multi-stream grouped GEMM, under `grouped_mu`: side stream s runs with workspace side_ws[s]
  // and signals side_done[s]; `fork` is recorded on the calling stream for them to wait on.
  std::mutex grouped_mu;
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> side;
  std::vector<void*> side_ws;
  std::vector<cudaEvent_t> side_done;
  struct EnqueuePool* pool = nullptr;  // host threads that enqueue side streams 1.. (leaked)
};

// One thread's handles and plans on one device.
struct ThreadGemm {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  std::map<PlanKey, Plan> plans;
  uint64_t generation = 0;  // of g_generation when `plans` was last valid
};

// Process-wide knobs ([backend] in the run config, applied through set_grouped_defaults and
// set_exact_heuristics). Atomics: read on every grouped call without a lock.
// Initial values: GroupedDefaults{} (one place for the defaults).
struct Knobs {
  std::atomic<int> same_dtype{static_cast<int>(GroupedDefaults{}.same_dtype)};
  std::atomic<int> widening{static_cast<int>(GroupedDefaults{}.widening)};
  std::atomic<int> num_streams{GroupedDefaults{}.num_streams};
  std::atomic<double> min_flops{GroupedDefaults{}.multi_stream_min_flops};
  std::atomic<bool> threaded{GroupedDefaults{}.threaded_enqueue};
  std::atomic<bool> tma{GroupedDefaults{}.tma};
  std::atomic<bool> exact{false};
};

// ---- defined in gemm.cu (their comments are there) ----------------------------------------------

cudaDataType_t cuda_type(DType dt);
Knobs& knobs();
void* new_workspace(int dev);
DeviceGemm& device_gemm(int dev);
void* stream_workspace(DeviceGemm& d, int dev);
ThreadGemm& thread_gemm(int dev);
cublasHandle_t thread_blas(ThreadGemm& t);
void make_room(ThreadGemm& t, size_t n);
const Plan& get_plan(ThreadGemm& t, DeviceGemm& d, const PlanKey& k);
bool native(DType ab, DType c);
void scale_c(void* C, DType dt, int64_t rows, int64_t cols, int64_t ldc, int64_t stride,
             int64_t batch, float beta);
PlanKey plan_key(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, DType adt,
                 int64_t lda, int64_t sa, const void* B, DType bdt, int64_t ldb, int64_t sb,
                 const void* C, DType cdt, int64_t ldc, int64_t sc, int64_t batch);
void check_dims(const char* op, bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda,
                int64_t ldb, int64_t ldc);

}  // namespace bb::cuda::gemm_detail

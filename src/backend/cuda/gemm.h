// gemm.h — row-major GEMM on CUDA devices through cuBLASLt (grouped GEMM also through cuBLAS and our
// tile kernels: WMMA, and mma.sync in grouped_mma.h).
//
//   C[M,N] = alpha * op(A) @ op(B) + beta * C          (fp32 compute and accumulation)
//   op(A) is A[M,K] (trans_a = false) or A[K,M]^T; op(B) is B[K,N] or B[N,K]^T.
// Same semantics as backend/cpu/gemm.h. Leading dimensions are those of the stored (row-major)
// matrices. Pointers are device pointers on `device`, which is made current; work is ordered on
// the calling thread's current stream (cuda::stream(), core/stream.h), with that stream's own
// workspace; nothing synchronises the host. Calls from several threads and on several streams
// may run at once; a call whose plan this thread has cached takes no lock.
//
// dtypes: A and B f32, bf16 or f16; C f32, bf16 or f16. Native cuBLASLt combinations
// (AB -> C): f32 -> f32, bf16 -> bf16|f32, f16 -> f16|f32. Others run through converted
// temporaries under MemCategory::workspace: A and B of different dtypes are both widened to
// f32; f32 inputs with a 16-bit C go through an f32 copy of C. f32 inputs never use TF32
// (CUBLAS_COMPUTE_32F), so f32 results match a CPU fp32 GEMM to fp32 rounding.
// beta = 0 never reads C (NaN in C is overwritten); beta = 1 accumulates (wgrad +=).
//
// Host-only header: no CUDA types. Only compiled into CUDA builds (BB_WITH_CUDA).
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace bb::cuda {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
          DType a_dt, int64_t lda, const void* B, DType b_dt, int64_t ldb, float beta, void* C,
          DType c_dt, int64_t ldc, int device);

// `batch` independent GEMMs of the same shape; matrix i of X starts at X + i * stride_x
// elements (stride 0 broadcasts one matrix). One cuBLASLt call.
void gemm_strided_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                          const void* A, DType a_dt, int64_t lda, int64_t stride_a, const void* B,
                          DType b_dt, int64_t ldb, int64_t stride_b, float beta, void* C,
                          DType c_dt, int64_t ldc, int64_t stride_c, int64_t batch, int device);

// One problem of a grouped GEMM: its own sizes and matrices (row-major, as above).
struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  const void* B = nullptr;
  void* C = nullptr;
};

// How gemm_grouped runs its problems. Measured trade-offs: skills/experts.md ("CUDA path").
enum class GroupedAlgo {
  automatic,     // grouped_defaults(): same_dtype for AB == C, widening for 16-bit -> f32
  cublas,        // one cublasGemmGroupedBatchedEx: bf16 -> bf16, f16 -> f16, f32 -> f32 only
  multi_stream,  // one cuBLASLt GEMM per problem, spread over side streams (any native combo)
  wmma,          // our WMMA tile kernel: bf16|f16 -> f32 with trans_a && !trans_b only
  mma,           // our tile kernels (grouped_mma.h; wgmma for the bf16 forward shape on sm_90,
                 // mma.sync otherwise): bf16|f16 -> same or f32, any transposes, one launch;
                 // multiples of 8 and 16-byte alignment required
};
const char* grouped_algo_name(GroupedAlgo a);

// Per-call choice. num_streams (multi_stream only): side streams used, 1..kMaxGroupedStreams;
// 0 takes grouped_defaults().num_streams.
// tile_m (mma only): rows per CTA tile of the mma.sync kernel, 64 or 128; 0 = the fastest of
// our kernels that takes the call: on sm_90 with bf16 inputs and !trans_a, the TMA kernel when
// the problems are laid out as the experts' are (grouped_mma.h, grouped_tma_refusal), else the
// wgmma kernel for trans_b, else mma.sync with 128-row tiles (64 when trans_a).
// tma (mma with tile_m 0 only): false keeps the call off the TMA kernel (benches, tests); it
// is used only when GroupedDefaults::tma is true as well.
struct GroupedConfig {
  GroupedAlgo algo = GroupedAlgo::automatic;
  int num_streams = 0;
  int tile_m = 0;
  bool tma = true;
};
constexpr int kMaxGroupedStreams = 16;

// What GroupedAlgo::automatic resolves to, process-wide. The trainer sets it from the run
// config's [backend] table (backend/config.h); benches and tests may change it.
//   same_dtype: bf16 -> bf16, f16 -> f16, f32 -> f32 (the expert forward and dgrad);
//   widening:   bf16|f16 -> f32 (the expert wgrad into f32 gradients).
struct GroupedDefaults {
  GroupedAlgo same_dtype = GroupedAlgo::mma;
  GroupedAlgo widening = GroupedAlgo::multi_stream;
  int num_streams = 4;
  // Same-dtype calls whose mean problem is at least this many FLOPs (2 M N K over the non-empty
  // problems) take multi_stream instead of `same_dtype`. Measured on an H200 (bench_experts,
  // forward stage, both projections; skills/experts.md): with 256 rows per expert (E = 256,
  // H = 2048, F = 512; 0.5 and 1.1 GFLOP per expert) mma 1.46 ms, cuBLAS grouped 1.63,
  // multi_stream S=4 2.13; with 512 rows (E = 128, F = 768; 1.6 and 3.2 GFLOP) multi_stream S=2
  // 1.80, mma 1.89, cuBLAS grouped 2.16; with 2048 rows multi_stream 3.86, mma 6.96. End to end
  // (4-layer Qwen3-30B-A3B slice, 8K tokens) a line at 2e9, which sends its 1.6 GFLOP down
  // projection to mma, gave 108.4 ms against 105.0 at 1e9. 0 sends every same-dtype call to
  // multi_stream.
  double multi_stream_min_flops = 1.2e9;
  // multi_stream: side streams 1..S-1 are enqueued by a pool of host threads while the calling
  // thread enqueues stream 0 (false: one thread, launches interleaved across the streams).
  bool threaded_enqueue = true;
  // Automatic forward, dgrad and wgrad calls that the TMA kernel takes (sm_90, bf16, the expert
  // layouts: grouped_mma.h) run on it, before same_dtype, widening and the FLOP line apply: on
  // an H200 it is faster than or level with every other algorithm at 256-2048 rows per expert
  // (bench_experts, skills/experts.md). [backend] grouped_gemm_tma.
  bool tma = true;
};
GroupedDefaults grouped_defaults();
void set_grouped_defaults(const GroupedDefaults& d);  // checked: no automatic, streams in range

// All problems of one call: C_g = alpha op(A_g) op(B_g) + beta C_g, the same transposes, dtypes
// and leading dimensions for every g. Problems with M = 0 or N = 0 are dropped; K = 0 gives
// C_g = beta C_g. The C_g must not overlap (they may be written concurrently). Algorithms
// (cfg.algo; automatic resolves through grouped_defaults()):
//   - cublas: cublasGemmGroupedBatchedEx (fp32 compute), one launch. cuBLAS 13.1 refuses
//     16-bit inputs with an f32 output. The pointer arrays travel to the device with one
//     asynchronous copy (no host sync).
//   - multi_stream: the problems, largest (M N K) first, are dealt to the side stream with the
//     least work so far (round-robin for equal sizes); each side stream runs its share as
//     cuBLASLt GEMMs (the plans of cuda::gemm) with its own workspace. Side streams 1..S-1 are
//     enqueued by a per-device pool of host threads (one cuBLASLt handle each) while the
//     calling thread enqueues stream 0: the ~8 us host cost per cublasLtMatmul is paid in
//     parallel (threaded_enqueue = false: one thread, interleaved). The side streams are
//     forked from cuda::stream() and joined back with events: work after the call on
//     cuda::stream() sees every C_g. One multi_stream call at a time per device uses them. Streams, events and workspaces (kMaxGroupedStreams at
//     most, 32 MiB each under MemCategory::workspace) are created per device on first use and
//     reused. Any natively supported combination (see gemm above: f32 -> f32,
//     bf16 -> bf16|f32, f16 -> f16|f32), any transposes. K = 0 problems are scaled on
//     cuda::stream() before the fork.
//   - wmma: our tile kernel, one CTA per (problem, 128x128 output tile), bf16 WMMA with fp32
//     accumulators; bf16|f16 -> f32 with trans_a && !trans_b (d_W += d_Y^T X) only. Kept for
//     comparison: cuBLASLt is several times faster.
//   - mma: our tile kernel of grouped_mma.h, one launch for all problems (no per-problem host
//     cost), bf16|f16 inputs with C of the same dtype or f32, all transposes. It needs every
//     contiguous extent and leading dimension a multiple of 8 and 16-byte aligned matrices;
//     when `automatic` resolves to mma and a call does not meet that, the call takes cublas
//     (same dtype) or multi_stream (widening) instead.
// A combination the chosen algorithm does not take is an error naming it.
void gemm_grouped(bool trans_a, bool trans_b, const std::vector<GemmProblem>& problems, float alpha,
                  DType ab_dt, int64_t lda, int64_t ldb, float beta, DType c_dt, int64_t ldc,
                  int device, GroupedConfig cfg = {});

// Drops the cached descriptors and heuristics of every thread (tests; handles and workspaces
// stay).
void gemm_clear_cache();
// Number of cuBLASLt plans the calling thread has cached (tests check that a repeated shape
// reuses its plan).
int64_t gemm_cache_size();
// cuBLASLt heuristic queries so far, all threads (a new shape bucket asks once; sizes inside a
// bucket reuse its algorithm after cublasLtMatmulAlgoCheck).
int64_t gemm_heuristic_calls();
// true: every new shape asks the heuristic (no buckets); [backend] gemm_heuristics = "exact".
void set_exact_heuristics(bool exact);
bool exact_heuristics();

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA

// loss_cuda.h — host-side declarations of the CUDA cross-entropy kernels shared by
// cross_entropy.cpp (cross_entropy_*, full_ce) and linear_ce.cpp. Raw pointers and sizes only;
// every launch runs on cuda::stream().
//
// Legend: T tokens (rows), V vocab, nv columns of one vocab chunk starting at column v0.
// The forward is split in two so that full_ce (one chunk = the whole row) and linear_ce (many
// chunks) share it: ce_online_update folds one logits block into a running (max, sum of
// exponentials) per row and records the target logit; ce_finalize turns the running state into
// lse and reduces the loss on the device in a fixed order (deterministic), then makes the one
// host read. targets < 0 are masked; targets >= V are reported (first_bad_row), never read.
// linear_ce_fused uses a third entry, ce_fused_rows: statistics and gradient of whole rows in
// one kernel, the gradient written over the logits it came from.
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>

#include "core/dtype.h"

namespace bb::cuda {

// x [rows, nv] (row stride ld, dtype f32 or bf16) holds columns [v0, v0 + nv) of the logits of
// rows whose targets are targets[0, rows). run_max, run_sum, target_logit [rows] f32 (in/out;
// first = true initialises them instead of reading them).
void ce_online_update(float* run_max, float* run_sum, float* target_logit, const void* x,
                      DType dt, int64_t ld, const int32_t* targets, int64_t rows, int64_t v0,
                      int64_t nv, bool first);

struct CeTotals {
  double loss_sum = 0;         // sum over valid rows of lse - target logit
  int64_t num_valid = 0;       // rows with 0 <= target < V
  int64_t first_bad_row = -1;  // first row with target >= V, or -1
};
// Scratch bytes ce_finalize needs on the device.
size_t ce_totals_bytes();
// lse [T] f32 (out) <- run_max + log(run_sum); the totals are reduced on the device, copied to
// the host and returned (one synchronisation, recorded by cuda::memcpy).
CeTotals ce_finalize(float* lse, void* totals_scratch, const float* run_max, const float* run_sum,
                     const float* target_logit, const int32_t* targets, int64_t T, int64_t V);

// d [rows, nv] (row stride ld_d, dtype d_dt f32 or bf16) <- scale * (exp(x - lse) - onehot) on
// valid rows, 0 on masked rows; x [rows, nv] (row stride ld_x, dtype x_dt f32 or bf16) holds
// columns [v0, v0 + nv). d may alias x when both are f32 with the same stride (in place).
void ce_softmax_grad(void* d, DType d_dt, int64_t ld_d, const void* x, DType x_dt, int64_t ld_x,
                     const int32_t* targets, const float* lse, float scale, int64_t rows,
                     int64_t v0, int64_t nv);

// ---- linear_ce_fused ---------------------------------------------------------------------------
// One row step of the fused loss head over a whole-vocabulary logits block x [rows, V] (row
// stride V; f32, or bf16 when the head keeps bf16 logits), one thread block per row, two sweeps
// over the row:
//   1. running max and sum of exp(x - max) over the row -> run_max, run_sum [rows] f32 (the state
//      ce_finalize takes), and the target logit -> target_logit [rows] f32;
//   2. d = scale * (exp(x - lse) - onehot(target)), lse = max + log(sum); 0 on masked rows
//      (target < 0), no one-hot term for a target >= V (ce_finalize reports it).
// d is written IN PLACE over x, in dtype d_dt, with row stride ce_fused_grad_ld(V, x_dt, d_dt):
//   f32 x, f32 d:   d[r, v] replaces x[r, v];
//   f32 x, bf16 d:  row r of d fills the first 2V bytes of x's row r (row stride 2V bf16 elements);
//   bf16 x, bf16 d: d[r, v] replaces x[r, v] (bf16 x with f32 d is refused).
// Masked rows get run_max = 0, run_sum = 1 (lse 0) and are skipped by ce_finalize's loss.
void ce_fused_rows(void* x, DType x_dt, int64_t V, DType d_dt, const int32_t* targets, float scale,
                   int64_t rows, float* run_max, float* run_sum, float* target_logit);

// Row stride, in elements of d_dt, of the gradient ce_fused_rows leaves in the block.
inline int64_t ce_fused_grad_ld(int64_t V, DType x_dt, DType d_dt) {
  return x_dt == d_dt ? V : 2 * V;
}

// x[i] = float(bf16(x[i])) (round to nearest even): f32 logits held at bf16 precision, for
// loss heads with bf16 logits whose GEMM writes f32 (f32 operands, the two-pass paths).
void round_to_bf16(float* x, int64_t n);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA

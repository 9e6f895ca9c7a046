// adamw_cuda.h — host-side declarations of the optimizer CUDA kernels: the fused AdamW update
// (f32 or bf16 moments) and deterministic sums of squares for gradient norms. Plain C++ header:
// raw device pointers, element counts and dtypes; launches go on cuda::stream().
#pragma once

#include <cstdint>
#include <climits>
#include <vector>

#include "core/dtype.h"

#ifdef BB_WITH_CUDA
namespace bb::cuda {

// Per-call scalars, computed on the host exactly as the CPU path computes them.
struct AdamWScalars {
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float decay;         // 1 - lr * weight_decay
  float beta1, beta2, eps;
  float grad_scale;    // g is read as grad_scale * grad
  // Launch shape, not a kernel argument's meaning: many short blocks (each thread a few
  // accesses) instead of a resident grid-stride grid, so that other streams' kernels get SMs
  // between them. The update is element-wise: the same bits either way.
  bool short_blocks = false;
  // Weight decay (the factor `decay`) applies to the call's elements [0, decay_end), the others
  // keep factor 1: a whole unit in one call (its weight-decayed elements come first).
  int64_t decay_end = INT64_MAX;
  // The split master (adamw.h): `master` is the i16 remainder and `model` (bf16, required) the
  // upper half; both are read and written. Otherwise `master` is f32.
  bool split_master = false;
};

// master [n] f32 (or the split master's i16 remainder, s.split_master), grad, exp_avg,
// exp_avg_sq [n] f32; model [n] (model_dtype f32 or bf16) or null.
// One pass: g = grad_scale * grad; p *= decay; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps); model = p (rounded to model_dtype).
// nonfinite (device i32, may be null) is set to 1 when any new p, m or v is Inf/NaN.
void adamw_step(void* master, const float* grad, float* exp_avg, float* exp_avg_sq, void* model,
                DType model_dtype, int64_t n, const AdamWScalars& s, int32_t* nonfinite = nullptr);

// The same update with bf16 moments (adamw_bf16_moments): exp_avg, exp_avg_sq [n] bf16 bits,
// loaded to fp32, updated as above (the weight update uses the fp32 values), stored
// stochastically rounded with the random bits of elements first_element + i of `key`'s stream
// (moment_rounding.h; bit for bit what the CPU path draws). nonfinite: set when a new p or a
// stored m or v is Inf/NaN.
void adamw_step_bf16_moments(void* master, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                             void* model, DType model_dtype, int64_t n, const AdamWScalars& s, uint64_t key,
                             int64_t first_element, int32_t* nonfinite = nullptr);

// *flag (device i32) = 1 when x [n] (f32 or bf16) holds an Inf or NaN; untouched otherwise.
void mark_nonfinite(int32_t* flag, const void* x, DType dtype, int64_t n);

// Sums of squares in two stages. The most slots stage 1 writes for n elements (about one per
// 1024 to 8192 elements).
int64_t sum_squares_max_slots(int64_t n);
// partial [slots] doubles (device) <- sums of x^2 over fixed slices of x [n] (f32 or bf16);
// returns slots. The slices depend on n and x's alignment only: deterministic.
int64_t sum_squares_partial(double* partial, const void* x, DType dtype, int64_t n);
// For an f32 x [n] at address x (the address sets the vector width, as above): the stage-1
// slices (increasing, each once) that hold an element of the listed rows of row_len elements
// (rows increasing; a row past n is empty). Host only.
std::vector<int32_t> sum_squares_slices_of_rows(const void* x, int64_t n, const int32_t* rows, int64_t num_rows,
                                                int64_t row_len);
// Stage 1 for an f32 x [n] that is zero outside the listed slices (list [num] on the device,
// from sum_squares_slices_of_rows): partial[j] of a listed slice as sum_squares_partial writes
// it, +0.0 (what a slice of zeros sums to) for the others; returns the slot count. Bitwise
// sum_squares_partial on such an x, reading only the listed slices.
int64_t sum_squares_partial_listed(double* partial, const float* x, int64_t n, const int32_t* list, int64_t num);
// out[0] (device) = the sum of partial[0, slots) in a fixed order.
void sum_squares_finish(double* out, const double* partial, int64_t slots);

// adamw_step (bf16_moments false: f32 exp_avg / exp_avg_sq) or adamw_step_bf16_moments (true),
// and in the same pass over grad the stage-1 partial sums of its squares, bitwise what
// sum_squares_partial(partial, grad, f32, n) writes; returns the slot count. Needs an f32 master,
// grad and f32 moments 16-byte aligned, bf16 moments, a split master's remainder and a bf16
// model 8-byte aligned (an f32 model 16): returns -1 without doing anything when they are not (the caller makes the two passes).
int64_t adamw_step_sum_squares(void* master, const float* grad, void* exp_avg, void* exp_avg_sq, bool bf16_moments,
                               void* model, DType model_dtype, int64_t n, const AdamWScalars& s, uint64_t key,
                               int64_t first_element, int32_t* nonfinite, double* partial);

// The update of whole rows (adamw_step_rows): rows [num_rows] (device i32) index rows of
// row_len elements of a unit of n elements (the last row may be shorter); each element e of a
// listed row is updated as adamw_step(_bf16_moments) over the whole unit updates it (s.decay_end,
// first_element + e for the rounding). One block per listed row.
void adamw_step_rows(void* master, const float* grad, void* exp_avg, void* exp_avg_sq, bool bf16_moments,
                     void* model, DType model_dtype, int64_t n, const int32_t* rows, int64_t num_rows,
                     int64_t row_len, const AdamWScalars& s, uint64_t key, int64_t first_element,
                     int32_t* nonfinite);

// g [n] f32 *= s.
void scale_inplace(float* g, float s, int64_t n);

}  // namespace bb::cuda
#endif

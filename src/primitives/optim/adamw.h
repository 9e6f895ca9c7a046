// adamw.h — AdamW with fp32 master weights and decoupled weight decay; gradient norms.
//
// One flat parameter tensor at a time (the runtime keeps one per parameter or per bucket):
//   master      [n] f32 (optimizer)      fp32 copy of the weights, updated in place
//   grad        [n] f32 (grads)          gradient (clipping folded in through grad_scale)
//   exp_avg     [n] f32|bf16 (optimizer) first moment, updated in place
//   exp_avg_sq  [n] f32|bf16 (optimizer) second moment, updated in place (same dtype as exp_avg)
//   model       [n] f32/bf16 (params), optional: receives the new weights in the same pass
// Update (matches torch.optim.AdamW), in fp32:
//   p <- p * (1 - lr * wd)
//   m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// f32 moments (optimizer `adamw`): m and v are stored as computed. bf16 moments
// (`adamw_bf16_moments`): m and v are loaded from bf16, updated in fp32, the weight update uses
// those fp32 values, and they are stored stochastically rounded to bf16 (moment_rounding.h:
// unbiased, random bits keyed on (seed, stream, step, first_element + i)).
//
// Split master ([backend] master_storage = "split", the default for bf16 parameters): `master`
// is i16 and the fp32 master is held in two halves, the bf16 `model` tensor (required) its upper
// half and `master` the remainder:
//   bits(master fp32) = (bits(model) << 16) + lo     (32-bit wrap-around, lo a signed 16-bit int)
// The update reads both, computes exactly as above on that fp32 value, and writes the new value
// back split: model = the new master rounded to bf16 to nearest with ties AWAY from zero (the
// one rounding whose remainder always fits 16 signed bits; round-to-nearest-even differs only
// when the dropped half is exactly 0x8000), lo = the exact remainder. The fp32 master is kept
// exactly (bitwise the f32-master update's), 2 bytes an element instead of 4 + the bf16 copy.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "primitives/optim/split_master.h"

namespace bb {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // The gradient is used as grad_scale * grad (gradient clipping folded into the update, so the
  // gradients are not rewritten in a separate pass); grad itself is not modified.
  double grad_scale = 1.0;
  // bf16 moments only: element i of the call is element (first_element + i) of the rounding
  // stream `stream` (the state family passes a hash of the unit's name and the unit index of
  // the bucket's first element, so the bits do not depend on the layout); with `seed` and the
  // step they give its random bits (moment_rounding.h). Ignored for f32 moments.
  uint64_t seed = 0, stream = 0;
  int64_t first_element = 0;
  // GPU launch shape only (the results are the same bits): many short blocks instead of a grid
  // that stays resident for the whole call, so that kernels of other streams get SMs between
  // them (the training state's update beside the backward).
  bool yield_sms = false;
};

// The per-call fp32 scalars of an update (what the CPU loops and the kernels compute with):
// step_size = lr / (1 - b1^t), inv_sqrt_bc2 = 1 / sqrt(1 - b2^t), decay = 1 - lr wd.
struct AdamWScalars {
  float step_size, inv_sqrt_bc2, decay, b1, b2, eps, gs;
};
AdamWScalars adamw_scalars(int64_t step, double lr, double weight_decay, const AdamWConfig& cfg);
// The fp32-master, f32-moment update of n host elements in place: the CPU reference's loop
// itself (adamw_step on host tensors calls it), callable on raw memory and on slices from
// several threads (primitives.optimizer = "adamw_offload" runs it on the host pool). Returns
// whether a new master or moment element is Inf or NaN.
bool adamw_update_f32_host(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);
// The parameter values of n host fp32 masters: f32 values copied, bf16 values rounded to nearest
// with ties to even, or (ties_away) with ties away from zero, the split master's rounding
// (split_master.h), so that values follow masters as the run's master storage makes them.
void host_values_from_master(const float* p, void* dst, DType dst_dtype, int64_t n, bool ties_away);

// Host tensors (split_master.h has the bit functions): value [n] bf16 and lo [n] i16 <- the split of master [n] f32, and back.
void split_master(const Tensor& master, Tensor& value, Tensor& lo);
void join_master(const Tensor& value, const Tensor& lo, Tensor& master);

// step is 1-based. lr and weight_decay are per call (schedules and no-decay groups).
// `nonfinite`, if given, is an i32 [1] tensor on the master's device that the same pass sets to
// 1 when any updated master or (stored) moment element is Inf or NaN (it is never cleared here: one flag
// can collect several calls). The trainer's non-finite guard reads it with the step's one sync.
void adamw_step(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                Tensor* model /* may be null */, Tensor* nonfinite = nullptr);

// adamw_step and sum_of_squares_to(grad, slots, slot) in one pass over the gradient (a whole
// flat unit: weight_decay applies to elements [0, decay_numel), none to the rest). The same
// bits as the separate calls (the sum as sum_of_squares_to gives it; the update as adamw_step
// over [0, decay_numel) and over the rest with first_element advanced), with one read of grad
// instead of two on a GPU (the training state's update during the backward, clipping off). On
// the CPU, or with tensors a GPU cannot read 16 bytes at a time, it makes those calls.
void adamw_step_sum_squares(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                            int64_t step, double lr, double weight_decay, int64_t decay_numel,
                            const AdamWConfig& cfg, Tensor* model, Tensor* nonfinite, Tensor& slots,
                            int64_t slot);

// The update of chosen rows of a unit laid out as rows of `row_len` elements from element 0 (an
// embedding table [V, H] and its alignment padding: row r is elements [r row_len, min((r + 1)
// row_len, n)), so the padding is a last, shorter row). `rows` (host, strictly increasing, each
// in [0, ceil(n / row_len))) lists the rows to update; every element of them gets bitwise what
// adamw_step_sum_squares's update gives it over the whole unit (weight decay on [0, decay_numel),
// bf16-moment rounding at element first_element + e), and no other element is read or written.
// So the rows a step's lookup never touched (zero gradient) can be updated before the backward
// writes the others, and those after it: two calls over complementary row sets are the whole
// update. One launch per call on a GPU (one short block a row; the list is uploaded without a
// host sync), adamw_step over each run of consecutive rows on the CPU.
void adamw_step_rows(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, int64_t step,
                     double lr, double weight_decay, int64_t decay_numel, const AdamWConfig& cfg, Tensor* model,
                     Tensor* nonfinite, const std::vector<int32_t>& rows, int64_t row_len);

// flags[i] (i32, on the tensors' device) is set to 1 when tensor i (f32 or bf16) holds an Inf
// or NaN; flags are never cleared here. One launch per tensor on a GPU, no host sync.
void mark_nonfinite(const std::vector<Tensor>& ts, Tensor& flags);

// sum of squares of a float tensor, accumulated in double.
double sum_of_squares(const Tensor& g);
// The same sum, enqueued on the current stream into slot i of `slots` (i64 storage holding f64
// bits, on g's device) without reading it back: the caller reads the slots later, once, after
// ordering that stream before the read. Bitwise the value sum_of_squares(g) returns. (The
// training state uses it to sum a layer's finished gradients beside the next layer's backward.)
void sum_of_squares_to(const Tensor& g, Tensor& slots, int64_t i);
// sum_of_squares_to(g, slots, i) for a g that is ZERO outside the listed rows (an embedding's
// gradient: only the rows a step's lookups touched are non-zero; rows host, strictly
// increasing, of row_len elements from element 0, the last row may be shorter): bitwise the
// same slot, but a GPU reads only the slices of the sum that hold a listed row (a slice of zeros
// sums to +0.0). The CPU, or a bf16 g, makes the full sum.
void sum_of_squares_rows_to(const Tensor& g, Tensor& slots, int64_t i, const std::vector<int32_t>& rows,
                            int64_t row_len);
// sqrt(sum over tensors of sum of squares).
double global_grad_norm(const std::vector<Tensor>& grads);
// g *= s (f32 tensors).
void scale_inplace(Tensor& g, float s);

}  // namespace bb

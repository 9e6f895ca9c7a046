// gated_rmsnorm.h — gated RMSNorm, y = w * rmsnorm(x) * silu(z), per head (the output norm of
// Gated DeltaNet layers: weight starts at 1, the norm comes before the gate; equations in
// gated_rmsnorm_ref.h).
//
// Tensors (legend: R rows = tokens x heads, D head dim):
//   x, z  [R, D] (or [T, H, D], viewed as rows)  f32 or bf16   normalised input and gate
//   w     [D]                                     f32 or bf16   weight
//   y     like x, in x's dtype, category `out_cat`
// Backward: d_x and d_z written (f32, activations), d_w accumulated (+=, f32 [D]); d_y f32 or
// bf16. Nothing is saved; the row norms are recomputed. Math is fp32 everywhere.
// Devices: CPU (the reference) and CUDA (gated_rmsnorm_cuda.cu: a warp per row, d_w summed in a
// fixed order, so deterministic). All tensors on one device.
#pragma once

#include "core/tensor.h"

namespace bb {

Tensor gated_rmsnorm_forward(const Tensor& x, const Tensor& z, const Tensor& w, double eps,
                             MemCategory out_cat = MemCategory::activations);
// Returns {d_x, d_z}; accumulates into d_w.
std::pair<Tensor, Tensor> gated_rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& z,
                                                 const Tensor& w, double eps, Tensor& d_w);

}  // namespace bb

// rmsnorm.h — RMSNorm and per-head QK RMSNorm (Qwen3 style: y = w * x / rms(x), w starts at 1),
// and the zero-centred variant (Qwen3-Next / Qwen3.5: y = (1 + w) * x / rms(x), w starts at 0)
// selected by `zero_centered`; d_w has the same formula in both (d(1 + w)/dw = 1).
//
// Tensors (legend: T tokens, H normalised width, n heads, D head dim):
//   x      [T, H]  f32 or bf16                     input
//   w      [H]     f32 or bf16                     weight
//   y      [T, H]  x's dtype, category `out_cat`   output
//   saved.rstd [T] f32, category activations       1/rms per row, for backward
// Backward: d_x written (= ; f32, or bf16 when the consumer takes bf16: rounded once from the
// f32 value in the same pass), d_w accumulated (+= ; f32 [H]).
// QK norm is RMSNorm over each head vector: x [T, n, D] is viewed as [T*n, D] with w [D].
#pragma once

#include "core/tensor.h"

namespace bb {

struct RMSNormSaved {
  Tensor rstd;  // [rows] f32
};

Tensor rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat = MemCategory::activations, bool zero_centered = false);
// Returns d_x [rows, H] f32; accumulates into d_w ([H] f32). residual (optional, f32 [rows, H],
// e.g. the gradient arriving on a pre-norm block's skip connection): returned d_x + residual,
// with the bits of adding it afterwards, in the same pass over the rows.
Tensor rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& w,
                        const RMSNormSaved& saved, Tensor& d_w, bool zero_centered = false,
                        const Tensor* residual = nullptr, DType out_dtype = DType::f32);

// Per-head norm: x [T, n, D], w [D]. Same contract as above on the [T*n, D] view.
Tensor qk_norm_forward(const Tensor& x, const Tensor& w, double eps, RMSNormSaved* saved,
                       MemCategory out_cat = MemCategory::activations, bool zero_centered = false);
Tensor qk_norm_backward(const Tensor& d_y, const Tensor& x, const Tensor& w,
                        const RMSNormSaved& saved, Tensor& d_w, bool zero_centered = false,
                        DType out_dtype = DType::f32);

}  // namespace bb

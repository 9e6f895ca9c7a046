// causal_conv1d.h — depthwise causal 1-d convolution over packed sequences, optionally followed
// by SiLU (the q/k/v mixing of Gated DeltaNet layers; equations in causal_conv1d_ref.h).
//
// Tensors (legend: T tokens, C channels, W kernel width 1..4):
//   x           [T, C]   f32          input (the concatenated q, k, v projections in the model)
//   w           [C, W]   f32          one filter per channel; w[:, W-1] weighs the current token
//                                     (HF's conv1d.weight [C, 1, W] viewed as [C, W])
//   cu_seqlens  [n + 1]  i32, host    no filter reaches across a sequence start
//   y           [T, C]   out_dtype    output, category `out_cat`: f32, or bf16 (rounded once from
//                                     the f32 result; what the gated delta rule takes on a GPU)
// Backward: d_x written (f32, activations), d_w accumulated (+=, f32 [C, W]). Nothing is saved:
// the pre-activation is recomputed from x.
// Devices: CPU (the reference) and CUDA (causal_conv1d_cuda.cu: a thread walks one channel of a
// chunk of tokens with the filter window in registers, the sequence found by binary search in
// cu_seqlens, dw reduced deterministically per 128-token chunk). x, w, d_y, d_w on one device;
// cu_seqlens always on the host.
#pragma once

#include "core/tensor.h"

namespace bb {

Tensor causal_conv1d_forward(const Tensor& x, const Tensor& w, const Tensor& cu_seqlens, bool silu,
                             MemCategory out_cat = MemCategory::activations, DType out_dtype = DType::f32);
Tensor causal_conv1d_backward(const Tensor& d_y, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens,
                              bool silu, Tensor& d_w);

}  // namespace bb

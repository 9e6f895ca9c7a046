// swiglu.h — SwiGLU activation of the (fused) gate/up projection, Tensor-level API.
//
// Legend: N rows (tokens or permuted token copies), F ffn dim.
// Accumulation convention: this op has no parameters; the backward WRITES d_gate_up (=).
// Storage may be f32, bf16 or f16; the CPU path computes in fp32 and stores in the input dtype.
#pragma once

#include "core/tensor.h"

namespace bb {

// gate_up [N, 2F] float (in): columns [0, F) = gate, [F, 2F) = up.
// Returns h [N, F], dtype of gate_up, category `out_cat`:  h = silu(gate) * up.
// Saves nothing: the backward needs gate_up itself, which the caller keeps.
Tensor swiglu_forward(const Tensor& gate_up, MemCategory out_cat = MemCategory::activations);

// d_h [N, F] float (in), gate_up [N, 2F] float (in, the forward's input).
// Returns d_gate_up [N, 2F], dtype of gate_up, category activations:
//   d_gate = d_h * up * silu'(gate),  d_up = d_h * silu(gate).
Tensor swiglu_backward(const Tensor& d_h, const Tensor& gate_up);

}  // namespace bb

// elementwise.h — the few pointwise ops a decoder needs between primitives (residual adds,
// gates). fp32 compute; outputs f32 unless stated.
#pragma once

#include <utility>

#include "core/tensor.h"

namespace bb {

// a += b (a f32; b any float dtype, same numel).
void add_inplace(Tensor& a, const Tensor& b);
// a += s * b
void axpy_inplace(Tensor& a, float s, const Tensor& b);
// out = a + b as a new f32 tensor under `cat`.
Tensor add(const Tensor& a, const Tensor& b, MemCategory cat);
// Row-wise gate: y[t, :] = x[t, :] * g[t] (x [T, H], g [T]); new f32 tensor under `cat`.
Tensor scale_rows(const Tensor& x, const Tensor& g, MemCategory cat);
// Logistic sigmoid of an f32 tensor (new tensor under `cat`).
Tensor sigmoid(const Tensor& x, MemCategory cat);
// Backward of a sigmoid row gate y[t, :] = sigmoid(z[t]) * s[t, :] with respect to the gate
// logit z: d_z[t] = (sum_h d_y[t, h] * s[t, h]) * g[t] * (1 - g[t]), g = sigmoid(z).
// d_y, s [T, H] any float dtype; g [T] (or [T, 1]) f32/bf16. Returns d_z [T, 1] f32 under `cat`
// (written), the row sum in fp32.
Tensor sigmoid_gate_backward(const Tensor& d_y, const Tensor& s, const Tensor& g, MemCategory cat);

// Element-wise gate (the attention output gate): y = x * sigmoid(z), x and z of the same shape
// (any float dtypes). y: x's dtype and shape, under `cat`.
Tensor sigmoid_mul(const Tensor& x, const Tensor& z, MemCategory cat);
// Its backward: d_x = d_y * sigmoid(z), d_z = d_y * x * s * (1 - s). New f32 tensors of x's and
// z's shapes (category activations), written.
std::pair<Tensor, Tensor> sigmoid_mul_backward(const Tensor& d_y, const Tensor& x, const Tensor& z);

// Halves of the last dimension of a 2-d x [R, 2C]: a = x[:, :C], b = x[:, C:] (new [R, C]
// tensors in x's dtype under `cat`).
std::pair<Tensor, Tensor> split_halves(const Tensor& x, MemCategory cat);
// The inverse: a, b [R, C] (any float dtypes) -> [R, 2C] in dtype `dt` under `cat`.
Tensor join_halves(const Tensor& a, const Tensor& b, DType dt, MemCategory cat);

}  // namespace bb

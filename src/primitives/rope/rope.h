// rope.h — rotary position embedding (rotate-half), full or partial rotary width.
//
// Tensors (T tokens, n heads, D head dim):
//   x          [T, n, D] f32 or bf16     queries or keys
//   positions  [T]       i32 (host)      position of each token inside its sequence
//   y          [T, n, D] x's dtype       category `out_cat`
// Saves nothing: backward needs only the positions. Backward returns d_x (= , f32).
#pragma once

#include "core/tensor.h"

namespace bb {

struct RopeConfig {
  double theta = 10000.0;
  int64_t rotary_dim = 0;  // 0 = the whole head dim; otherwise even and <= D
};

Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeConfig& cfg,
                    MemCategory out_cat = MemCategory::activations);
Tensor rope_backward(const Tensor& d_y, const Tensor& positions, const RopeConfig& cfg);

}  // namespace bb

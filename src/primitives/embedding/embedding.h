// embedding.h — token embedding lookup.
//
//   ids     [T]    i32 (host), each in [0, V)
//   table   [V, H] f32 or bf16 (params)
//   y       [T, H] table's dtype, category `out_cat`
// Backward accumulates (+=) into d_table [V, H] f32; saves nothing (ids are the input).
#pragma once

#include "core/tensor.h"

namespace bb {

Tensor embedding_forward(const Tensor& ids, const Tensor& table,
                         MemCategory out_cat = MemCategory::activations);
void embedding_backward(const Tensor& d_y, const Tensor& ids, Tensor& d_table);

}  // namespace bb

// util.h — helpers for the CPU paths of primitives: f32 views of bf16/f16 tensors.
//
// The CPU reference computes in fp32 whatever the storage dtype. `as_f32` returns the tensor
// itself when it is already f32 (no copy) or a converted temporary under `workspace`;
// `store_f32` writes f32 values back into a tensor of any float dtype.
#pragma once

#include "core/tensor.h"

namespace bb::cpu {

Tensor as_f32(const Tensor& t);
// dst (any float dtype, CPU) <- src (f32, same numel).
void store_f32(Tensor& dst, const Tensor& src);
// A new f32 CPU tensor (category `cat`) that will later be stored into dtype `dt`:
// if dt is f32 it is the final tensor already.
Tensor empty_f32(const Shape& shape, MemCategory cat);

}  // namespace bb::cpu

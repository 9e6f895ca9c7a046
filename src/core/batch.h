// batch.h — one packed micro-batch (THD layout, DESIGN.md sec. 7): what a model's forward and
// backward read. runtime/data.h packs them; models only read them.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace bb {

// All tensors i32. On a GPU run, targets and positions live on the device; token ids and
// cu_seqlens stay on the host (the embedding range-checks the ids there and uploads them
// without a host sync; attention plans and packing metadata are host-side).
struct MicroBatch {
  Tensor tokens;          // [T] input ids
  Tensor targets;         // [T] next-token ids; -1 = no loss here
  Tensor positions;       // [T] position of each token within its sequence (RoPE), from 0
  Tensor cu_seqlens;      // [B+1] cumulative sequence lengths (host), cu[0] = 0, cu[B] = T
  int64_t num_valid = 0;  // number of targets >= 0: the loss denominator
};

}  // namespace bb

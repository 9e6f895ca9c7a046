// hooks.h — the points of a micro-batch where state sharding and overlap attach (the schedule,
// runtime/schedule.h, calls them; the order of calls is documented there). Declared with the
// model so that the families that implement them (primitives/state) need not know the schedule.
#pragma once

#include <cstdint>

#include "models/block.h"

namespace bb {

enum class ModelEnd : uint8_t { embed, head, embed_backward };

class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  // Train pass, before the embedding's forward: the micro-batch's token ids (i32 [T]), i.e. the
  // rows of the embedding table its backward will write (the other rows get no gradient).
  virtual void embedding_rows(const Tensor& /*ids*/) {}
  virtual void before_end(ModelEnd, Pass) {}
  virtual void after_end(ModelEnd, Pass) {}
  virtual void before_forward(const Layer&, Pass) {}
  virtual void after_forward(const Layer&, Pass) {}
  virtual void before_backward(const Layer&) {}
  // After block b's backward_weight has been issued (blocks in reverse order; with delayed
  // wgrads, after the layer's data gradients and then each block's weights).
  virtual void after_block_backward(const Layer&, size_t /*b*/) {}
  virtual void after_backward(const Layer&) {}
};

}  // namespace bb

// batch.h — one packed micro-batch (THD layout, DESIGN.md sec. 7): what a model's forward and
// backward read. runtime/data.h packs them; models only read them.
#pragma once

#include <cstdint>

#include "core/context_shard.h"
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
  int64_t num_valid = 0;  // number of targets >= 0: the loss denominator (of this batch's tokens)
  // RL rollouts (runtime/data.h; read by the policy loss, primitives/loss/policy.h): f32 [T] on
  // the host, aligned with targets (position t holds the value of the token it predicts, t + 1
  // of its document), 0 where the target is -1. Undefined when the data has none.
  Tensor advantages, old_logprobs, ref_logprobs;
  // With advantages: 1 / (valid targets of the position's whole document) at valid positions,
  // 0 elsewhere; a document's weights sum to 1 over all its pieces (sequence means stay exact
  // when a document is split across micro-batches or context-parallel ranks).
  Tensor seq_weight;
  // Router replay: the experts the rollout engine routed each TOKEN to (aligned with tokens, not
  // targets), i32 [T, L * K] on the host: row t holds token t's top-k ids for MoE layer 0, then
  // layer 1, ... Undefined when the data has none. Read with primitives.router_replay.
  Tensor routing;
  // Context parallelism: set when this batch is one rank's shard of a micro-batch split over a
  // context-parallel group (runtime/context_shard.h); tokens, targets, positions and cu_seqlens
  // above are then the shard's. cp 1: the whole micro-batch.
  ContextShard shard;
  // This batch's share of its micro-batch's tokens (1 unless sharded): per-token means of the
  // micro-batch (the router z-loss) are the sum over the shards of share x the local mean.
  double token_share() const {
    return shard.split() && shard.tokens > 0
               ? static_cast<double>(tokens.numel()) / static_cast<double>(shard.tokens)
               : 1.0;
  }
};

}  // namespace bb

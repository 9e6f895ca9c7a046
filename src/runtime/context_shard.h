// context_shard.h — one context-parallel rank's shard of a packed micro-batch (the head-tail
// layout of core/context_shard.h). The trainer shards every micro-batch of a CP group the same
// way, on the host, before it moves to the device.
#pragma once

#include <cstdint>

#include "core/batch.h"

namespace bb {

// Rank `rank` of `cp`: the rows of its chunks of every sequence (tokens, targets, positions),
// local cu_seqlens with one (possibly empty) local sequence per sequence of `mb`, num_valid
// counted over the shard's targets, and `shard` describing the whole micro-batch. `mb` must be
// whole (not already sharded) and on the host. cp 1 returns `mb` unchanged.
// A rank left with no token (every sequence shorter than 2 cp and none of its chunks filled) is an
// error naming the micro-batch size to raise.
MicroBatch shard_micro_batch(const MicroBatch& mb, int64_t cp, int64_t rank);

}  // namespace bb

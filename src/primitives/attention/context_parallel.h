// context_parallel.h — the attention family (`primitives.attention`) as the object a decoder's
// attention block calls: causal self-attention over the block's packed micro-batch, which under
// context parallelism is this rank's head-tail shard of a micro-batch split over the CP group
// (core/context_shard.h). The block hands over q, k, v of its local rows and never learns how
// many ranks share the sequence.
//
// Members:
//   sdpa      the local causal attention (attention.h); refuses a sharded micro-batch
//   cp_ring   KV blocks passed around the CP ring, partial outputs merged by log-sum-exp; backward
//             passes the KV blocks around again with their f32 gradient accumulators (skills/cp-ring.md)
//   cp_a2a    Ulysses: all-to-all from sequence-sharded to head-sharded q/k/v, the whole sequence
//             attended per head group, all-to-all back (skills/cp-a2a.md). Needs Hq % CP == 0 and
//             Hkv % CP == 0 or CP % Hkv == 0 (then each KV head is replicated to CP / Hkv ranks)
// On one rank (or cp 1) every member is sdpa.
//
// Legend: T local rows, Hq / Hkv heads, D head dim, P = CP group size.
//   q [T, Hq, D], k, v [T, Hkv, D] f32 or bf16 (one dtype), positions already rotated
//   o [T, Hq, D] q's dtype; saved: what the member's backward needs (AttentionSaved: lse [Hq, T]
//   for sdpa and cp_ring; cp_a2a keeps its head-sharded q/k/v/o and their lse)
//   backward: dq, dk, dv WRITTEN, the dtypes of q, k, v
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "comm/comm.h"
#include "core/batch.h"
#include "primitives/attention/attention.h"

namespace bb {

struct SelfAttentionConfig {
  comm::GroupPtr group;  // the context-parallel group (Mesh::cp()); null: this rank alone
};

class SelfAttention {
 public:
  virtual ~SelfAttention() = default;
  virtual const char* name() const = 0;
  // Causal self-attention over mb's sequences (the whole sequences, whichever rank holds them).
  // `saved` may be null (no backward follows).
  virtual Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const MicroBatch& mb,
                         float softmax_scale, AttentionSaved* saved) = 0;
  // `o` and `saved` as the forward returned them for the same inputs.
  virtual AttentionGrads backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const MicroBatch& mb,
                                  float softmax_scale, const AttentionSaved& saved) = 0;
};

using SelfAttentionFactory = std::unique_ptr<SelfAttention> (*)(const SelfAttentionConfig&);

std::unique_ptr<SelfAttention> make_sdpa_attention(const SelfAttentionConfig& cfg);
std::unique_ptr<SelfAttention> make_cp_ring_attention(const SelfAttentionConfig& cfg);
std::unique_ptr<SelfAttention> make_cp_a2a_attention(const SelfAttentionConfig& cfg);

// Errors (naming the heads, CP and the member to use instead) when cp_a2a cannot split these
// heads over `cp` ranks. Checked at startup by the trainer and again by the member.
void check_cp_a2a_heads(int64_t num_heads, int64_t num_kv_heads, int64_t cp);

// Context parallelism for a token mixer whose work is independent per head and channel (the
// Gated DeltaNet layer: depthwise conv per channel, recurrence and output norm per head): an
// all-to-all from this rank's rows of every head to every row of this rank's head group over the
// whole sequences (in the whole micro-batch's packed order), and back. With no group or a whole
// micro-batch every call is the identity, so a block can call it unconditionally
// (skills/cp-a2a.md, "Gated DeltaNet layers").
// An exchange posted and not yet waited for (HeadExchange::start_to_heads / start_from_heads):
// get() orders the caller after it (a stream wait on a GPU; the host does not block) and
// returns the result. Work queued between the start and get() overlaps the exchange. get() once.
class PendingExchange {
 public:
  PendingExchange() = default;
  explicit PendingExchange(Tensor ready) : ready_(std::move(ready)) {}
  explicit PendingExchange(std::function<Tensor()> finish) : finish_(std::move(finish)) {}
  Tensor get();

 private:
  Tensor ready_;
  std::function<Tensor()> finish_;
};

class HeadExchange {
 public:
  explicit HeadExchange(comm::GroupPtr group = nullptr) : group_(std::move(group)) {}
  // This rank's heads [first, first + count) of `num_heads` for mb (all of them when mb is
  // whole); an error naming `what` unless the context-parallel size divides num_heads.
  std::pair<int64_t, int64_t> my_heads(int64_t num_heads, const MicroBatch& mb, const char* what) const;
  // x [T_local, num_heads * head_dim] -> [T_all, (num_heads / P) * head_dim]: this rank's heads
  // of every row of mb's whole sequences.
  Tensor to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  // The inverse: [T_all, (num_heads / P) * head_dim] -> [T_local, num_heads * head_dim].
  Tensor from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  // The same exchanges posted now (on the cp stream) and finished by get(): a layer posts
  // several before it needs the first, so each travels under the work queued after it.
  PendingExchange start_to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  PendingExchange start_from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  // The offsets of the sequences the head-sharded rows form: mb's whole sequences when sharded,
  // else mb.cu_seqlens.
  Tensor cu_seqlens(const MicroBatch& mb) const;

 private:
  // The row orders of mb's sharding (every rank's rows, rank-major <-> global), computed once per
  // sharding: a layer exchanges several tensors of one micro-batch.
  struct Orders;
  const Orders& orders(const MicroBatch& mb) const;
  comm::GroupPtr group_;
  mutable std::shared_ptr<const Orders> cache_;
};


}  // namespace bb

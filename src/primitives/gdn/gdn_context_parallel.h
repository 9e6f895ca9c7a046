// gdn_context_parallel.h — the context-parallel family of Gated DeltaNet layers
// (`primitives.gdn_cp`): how a GDN block (models/gdn_block.h) runs the part of its layer that
// mixes tokens (the causal conv and the gated delta rule) when its micro-batch is one rank's
// head-tail shard (core/context_shard.h). The block calls it unconditionally; on a whole
// micro-batch every call is the plain primitive.
//
// Members (skills/gdn-cp-states.md):
//   heads   all-to-all to heads (HeadExchange, attention/context_parallel.h): each rank gets
//           Hk / cp key and Hv / cp value heads of every row of the whole sequences, runs the conv,
//           gates, rule and output norm there and sends the output back; 7 exchanges of the
//           projections per pass. cp must divide both head counts.
//   states  no exchange of activations: each rank runs its own token pieces (two chunks of each
//           sequence). The conv's (W - 1)-token halo comes from the ranks that hold it; the rule
//           needs only each piece's summary: its transition P [K, K] and end state from zero E
//           [K, V] per value head (gated_delta_rule_summary), all-gathered in one collective; each
//           rank folds the earlier pieces, S_start(c) = P_{c-1} S_start(c-1) + E_{c-1}, and runs
//           its pieces from those states. The backward mirrors it: each piece's start-state
//           gradient from its own outputs D (gated_delta_rule_start_grad) and its transition are
//           all-gathered, dS_end(c) = D_{c+1} + P_{c+1}^T dS_end(c+1), and the backward runs with
//           them. Any head count; a state never crosses a sequence boundary.
//   auto    heads where cp divides both head counts, else states (the default: heads is the
//           measured baseline; states is chosen where heads cannot run).
//
// Legend: T local rows, B sequences of the micro-batch, P = cp, Hk / Hv key / value heads, K / V
// their dims, W the conv width, C channels of a row block.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "comm/comm.h"
#include "core/batch.h"
#include "primitives/attention/context_parallel.h"
#include "primitives/gdn/gated_delta_rule.h"

namespace bb {

enum class GdnCpMode : uint8_t { automatic, heads, states };

// What a `states` forward keeps for its backward (empty under the other routes).
struct GdnCpSaved {
  Tensor halo[3];     // per row block (q, k, v): the conv's halo sequences' inputs [*, C] f32
  Tensor start;       // [2B, Hv, K, V] f32 the start states of this rank's pieces
  Tensor transition;  // [2B, Hv, K, K] f32 their transitions
};

class GdnContextParallel {
 public:
  enum class Route : uint8_t { local, heads, states };
  GdnContextParallel() = default;
  // group: the context-parallel group (null: one rank). The head counts choose `auto`'s route;
  // conv_width is the layer's conv kernel width W (its halo is W - 1 tokens).
  GdnContextParallel(comm::GroupPtr group, GdnCpMode mode, int64_t num_key_heads, int64_t num_value_heads,
                     int64_t conv_width);

  // local for a whole micro-batch, else the member's route.
  Route route(const MicroBatch& mb) const;
  // The route of sharded micro-batches and the member's name ("heads" / "states") for logs.
  bool by_states() const { return states_; }

  // This rank's heads [first, first + count): a slice under heads, all of them otherwise.
  std::pair<int64_t, int64_t> my_heads(int64_t num_heads, const MicroBatch& mb) const;
  // HeadExchange's movements under heads; the identity otherwise.
  PendingExchange start_to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  PendingExchange start_from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  Tensor to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  Tensor from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const;
  // The sequences of the rows the conv and rule run on: the whole sequences (heads), this rank's
  // pieces, head and tail chunk of each sequence apart (states), or mb's own (local).
  Tensor cu_seqlens(const MicroBatch& mb) const;

  // silu(causal_conv1d(pre)) over cu_seqlens(mb), in out_dtype (causal_conv1d.h). pre [rows, C]
  // f32, filters [C, W] f32. states: the first W - 1 rows of every piece that does not start its
  // sequence are computed again with their halo, which comes from the ranks holding it (one
  // all-gather) unless *halo already holds it (a rebuild); *halo keeps it for the backward.
  Tensor conv_forward(const Tensor& pre, const Tensor& filters, const MicroBatch& mb, DType out_dtype,
                      Tensor* halo) const;
  // d_pre (f32, written); d_w accumulated. d_y is consumed (states: rows of it are cleared). halo:
  // what conv_forward kept (states); the halo rows' gradients go back to their ranks (one
  // all-gather).
  Tensor conv_backward(Tensor d_y, const Tensor& pre, const Tensor& filters, const MicroBatch& mb,
                       const Tensor& halo, Tensor& d_w) const;

  // The gated delta rule over cu_seqlens(mb) (gated_delta_rule.h). states: summaries exchanged,
  // each piece run from its start state; `saved` (non-null when a backward follows) keeps the
  // start states and transitions. keep: the rule's prep (not kept under states).
  Tensor rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const MicroBatch& mb, const GatedDeltaOptions& opts, GatedDeltaPrep* keep,
                      GdnCpSaved* saved) const;
  GatedDeltaGrads rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& g, const Tensor& beta, const MicroBatch& mb,
                                const GatedDeltaOptions& opts, GatedDeltaPrep* prep, const GdnCpSaved& saved) const;

 private:
  struct Pieces;  // every rank's pieces of a sharding (host arithmetic, cached)
  const Pieces& pieces(const MicroBatch& mb) const;
  comm::GroupPtr group_;
  int64_t conv_width_ = 1;
  HeadExchange xchg_;
  bool states_ = false;
  mutable std::shared_ptr<const Pieces> cache_;
};

// The route `mode` gives for these heads over `cp` ranks, with `heads` refused (naming the heads
// and what to do) where cp does not divide them. Checked at startup by the trainer.
bool gdn_cp_by_states(GdnCpMode mode, int64_t num_key_heads, int64_t num_value_heads, int64_t cp);

}  // namespace bb

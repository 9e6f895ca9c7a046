// schedule.h — the layer loop of one micro-batch: forward through every layer, the head, then
// backward through the layers in reverse, with the recompute policy and per-layer hooks
// (DESIGN.md sec. 11). The model provides the pieces (embedding, layers of blocks, head); the
// schedule decides what is kept, what is recomputed and when each block's weight gradients run.
//
//   recompute = none   every block keeps its saved state from the forward until its backward
//   recompute = selective  every block keeps its saved state except the named parts'
//                      internals (ctx.recompute_drop), which its backward rebuilds
//   recompute = full   only each layer's input is kept; in backward the layer's forward runs
//                      again (Pass::recompute: the stashed routing is replayed) to rebuild it;
//                      its output is discarded, so the last block runs with ctx.output_unused
//                      (the MoE block then skips fc2 and the combine where backward allows)
//   max_layers_ahead   the host stays at most that many layers ahead of the compute stream
//   delay_wgrad        each layer's weight-gradient GEMMs run after all of the layer's
//                      data-gradient work (a schedule that overlaps communication moves them
//                      further); gradients are identical either way
//
// Hooks are where state sharding and overlap attach (gather a unit before its forward, prefetch
// the next, free after use, reduce-scatter after backward). Order of calls per micro-batch:
//   before_forward(l, train), after_forward(l, train)          l = 0 .. L-1
//   before_backward(l) [, before_forward(l, recompute), after_forward(l, recompute)],
//   after_block_backward(l, b) b = last .. 0, after_backward(l)  l = L-1 .. 0
// and around the model's ends, which use the embedding and head units outside any layer:
//   embedding_rows(ids)                   train pass, before the lookup: the rows its backward writes
//   before_end(embed, pass) / after_end   the embedding lookup (before layer 0)
//   before_end(head, pass) / after_end    final norm + loss head (+ its backward when training)
//   before_end(embed_backward) / after_end  the embedding gradient (after layer 0's backward)
// Hooks run in the order they were added (after_* in reverse).
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "models/decoder.h"
#include "models/hooks.h"
#include "primitives/moe/aux_loss.h"
#include "primitives/registry.h"

namespace bb {

// Routing steered from outside the model (the emulated backend's balanced routing). Called at
// the start of every train and eval pass with the stash's entries, one per MoE layer in layer
// order (cleared); it sets each entry's logit_bias ([T, E] f32 on the model's device) for `mb`,
// which every forward of that layer adds to its router logits (models/block.h).
using RoutingSource = std::function<void(const MicroBatch& mb, std::vector<RoutingStash::Entry>& layers)>;

struct ScheduleOptions {
  RecomputePolicy recompute = RecomputePolicy::none;
  bool delay_wgrad = false;
  // recompute = selective: the parts each block's training forward does not keep
  // (recompute_parts() of the registry choice); ignored by the other policies.
  RecomputeParts parts;
  // The host enqueues at most this many layers past the compute stream's progress ([backend]
  // max_layers_ahead; 0: no limit): before a layer's forward or backward it waits until the
  // compute stream finished the layer that many layers back.
  int64_t max_layers_ahead = 0;
};

// How the host waits for a point of the compute stream (the run's deadline: a hung peer must
// end the job, not the wait); `where` names the point for the message.
using HostWait = std::function<void(const Event& e, const std::string& where)>;

class Schedule {
 public:
  Schedule(DecoderModel& model, const ScheduleOptions& opts);

  // Not owned; must outlive the schedule's use.
  void add_hooks(LayerHooks* hooks);
  // Routing for every later pass (an empty function: the routers decide, the default).
  void set_routing_source(RoutingSource source) { routing_source_ = std::move(source); }
  // The wait of max_layers_ahead (default: poll the event without a deadline).
  void set_host_wait(HostWait wait) { host_wait_ = std::move(wait); }
  // Host waits of max_layers_ahead since the schedule was built.
  int64_t layer_waits() const { return layer_waits_; }

  // Forward + backward of one micro-batch. loss_scale = d(objective)/d(loss_sum), usually
  // 1 / (valid tokens in the whole optimizer step); aux_scale multiplies the aux/z-loss
  // gradients (1 / micro-batches per step), so the objective is
  //   sum_mb loss_sum * loss_scale + aux_scale * sum_mb (aux_coef * aux + z_coef * z).
  // Parameter gradients accumulate (+=) across calls.
  ForwardStats forward_backward(const MicroBatch& mb, float loss_scale, double aux_scale);
  // Forward only (nothing kept). If logits is non-null it receives [T, V] f32 logits.
  ForwardStats forward(const MicroBatch& mb, Tensor* logits);
  // Forward only, with the head's per-token log-prob of each target and entropy at
  // head.policy.temperature instead of the loss (streamed as the policy head streams; no
  // [T, V] tensor): logp / entropy [T] f32 on the host, 0 where the target is -1.
  void forward_token_stats(const MicroBatch& mb, const LossHeadConfig& head, Tensor& logp, Tensor& entropy);

  // The routing of the last micro-batch, one [T, K] i32 tensor per MoE layer in layer order
  // (copies, category other).
  const std::vector<Tensor>& last_routing() const { return last_routing_; }
  // How often each MoE layer's stashed routing was replayed by a recompute in the last
  // micro-batch (1 per layer under full recompute, 0 otherwise).
  const std::vector<int64_t>& last_replays() const { return last_replays_; }
  // The aux-loss pool (the runtime sets its reduce hook for ranks that share a batch).
  AuxLossPool& aux_pool() { return aux_; }
  const ScheduleOptions& options() const { return opts_; }

 private:
  struct LayerState {
    Tensor x;  // the layer input (full recompute)
    std::vector<std::unique_ptr<BlockSaved>> blocks;
  };
  // output_unused: the caller discards the result (the recompute forward); the last block sees
  // ctx.output_unused and may return an undefined tensor.
  Tensor forward_layer(Layer& layer, const Tensor& x, BatchContext& ctx, LayerState* state,
                       bool output_unused = false);
  // Checks the batch, resets the routing stash and the aux pool, and returns the context of
  // one pass over `mb` whose statistics go to `st`.
  // Embedding and layers of an evaluation forward: the last layer's output.
  Tensor forward_trunk(const MicroBatch& mb, ForwardStats& st);
  BatchContext begin(const MicroBatch& mb, Pass pass, ForwardStats& st);
  void end();
  void before_end(ModelEnd e, Pass p);
  void after_end(ModelEnd e, Pass p);
  // max_layers_ahead: marks the compute stream after a layer's work and waits for the mark
  // max_layers_ahead layers back (`what` names the pass for a timeout's message).
  void pace(const char* what, size_t layer);

  DecoderModel& model_;
  ScheduleOptions opts_;
  std::vector<LayerHooks*> hooks_;
  AuxLossPool aux_;
  RoutingStash routing_;
  RoutingSource routing_source_;
  HostWait host_wait_;
  std::deque<Event> layer_marks_;  // the compute stream after each of the last layers
  int64_t layer_waits_ = 0;
  std::vector<Tensor> last_routing_;
  std::vector<int64_t> last_replays_;
};

}  // namespace bb

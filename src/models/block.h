// block.h — the building blocks of a decoder layer (DESIGN.md sec. 11).
//
// A layer is a list of residual blocks, y = x + f(norm(x)): a token mixer (attention, or the
// gated delta net of Qwen3.5's linear_attention layers) then an MLP (dense or MoE). A block has an explicit forward and a backward
// split into a data part and a weight part:
//   forward(x, ctx, saved)      -> y; keeps in `saved` what its backward needs (saved may be
//                                  null: inference, or the first pass under full recompute)
//   backward_data(d_y, ctx, s)  -> d_x (=); norm-weight gradients (vectors) are added here,
//                                  fused with d_x
//   backward_weight(ctx, s)     the weight-gradient GEMMs (+=)
// With ctx.defer_wgrad false each wgrad GEMM runs inside backward_data right after its dgrad
// (what keeps memory lowest); with it true they are queued in `saved` with the tensors they read
// and run by backward_weight, so a schedule can move them (e.g. into a communication window).
// Gradients are identical either way: every parameter gradient has one writer per block.
// No block knows the parallel layout; a schedule (runtime/schedule.h) owns the layer loop.
//
// Legend: T tokens, H hidden.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/tensor.h"
#include "models/config.h"
#include "models/params.h"
#include "primitives/loss/policy_config.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/recompute/recompute.h"

namespace bb {

class AuxLossPool;

// Sums over one micro-batch (forward): loss is a sum over valid tokens; aux_loss the pooled
// load-balancing loss (primitives/moe/aux_loss.h); z_loss the mean over MoE layers of the
// per-layer router z-loss.
struct ForwardStats {
  double loss_sum = 0;
  int64_t num_valid = 0;
  PolicyMetrics policy;  // the policy loss's sums (primitives/loss/policy_config.h)
  double aux_loss = 0;
  double z_loss = 0;
  // Rows this rank's experts received, summed over the MoE layers (train and eval forwards; a
  // recompute does not count again): the token-count skew across expert-parallel ranks.
  int64_t moe_rows_received = 0;
};

// Which forward this is.
//   train      the first forward of a training micro-batch: routing is decided (and stashed),
//              the aux-loss pool and z-loss are filled
//   recompute  the forward rerun in backward under full recompute: routing comes from the
//              stash, no loss is added (the first forward counted it)
//   eval       a forward with no backward (routing stashed too, losses counted)
enum class Pass : uint8_t { train, recompute, eval };

// The routing of one micro-batch, one entry per MoE layer, written by the train / eval forward
// and read by a recompute (so the recomputed layer routes, permutes and dispatches exactly as
// the first forward did, with no second top-k and no host read).
// A bias may be given before the pass (the emulated backend's balanced routing): every forward
// of the layer adds it to the router logits, so the router, searching its top-k and reading its
// counts back as usual, picks the experts the bias favours.
struct DispatchPlan;  // primitives/moe/dispatcher.h

struct RoutingStash {
  struct Entry {
    Tensor topk_idx;                         // [T, K] i32 on the model's device
    std::vector<int64_t> tokens_per_expert;  // [E] host
    bool valid = false;
    int64_t replays = 0;  // recompute passes that reused it
    Tensor logit_bias;    // [T, E] f32 on the model's device, or undefined
    // Per token chunk (one unless ModelOptions::moe_token_chunks > 1): the chunk's per-expert
    // counts (host) and how the dispatcher moved its rows in the training forward. A recompute
    // (or the chunk-by-chunk rebuild in the backward) hands the plan back (DispatchState::plan),
    // so the replayed routing moves the rows again without reading counts back or a second
    // exchange of them (a host exchange over the EP group per layer).
    std::vector<std::vector<int64_t>> chunk_counts;
    std::vector<std::shared_ptr<const DispatchPlan>> chunk_plans;
  };
  std::vector<Entry> layers;
};

// Everything a block reads besides its input and weights, per micro-batch.
struct BatchContext {
  const MicroBatch* mb = nullptr;
  Pass pass = Pass::train;
  ForwardStats* stats = nullptr;  // forwards add their z-loss here
  AuxLossPool* aux = nullptr;     // MoE blocks pool counts and probabilities (train, eval)
  RoutingStash* routing = nullptr;
  // Backward: d objective / d pooled aux loss, and / d each layer's z-loss.
  double aux_grad = 0, z_grad = 0;
  bool defer_wgrad = false;  // queue weight gradients for backward_weight
  // Selective recompute (primitives/recompute/recompute.h): the parts whose internal
  // activations a forward with saved state does not keep. The schedule sets it for the training
  // forward only; a block's backward rebuilds whatever its saved state lacks (an undefined
  // tensor) from what it kept, with the same primitives, so gradients do not change.
  RecomputeParts recompute_drop;
  // The caller discards this block's output: the schedule sets it for the last block of a layer
  // in the full-recompute forward (Pass::recompute), whose result only rebuilt saved state. A
  // block may then skip work whose only consumer is its output (and return an undefined
  // tensor), as long as `saved` ends exactly as a normal forward leaves it; ignoring the flag is
  // always correct. Never set when the output feeds another block.
  bool output_unused = false;
};

// A block's saved state. The base keeps the queued weight-gradient calls.
struct BlockSaved {
  virtual ~BlockSaved() = default;
  std::vector<std::function<void()>> deferred_wgrad;
};

class Block {
 public:
  virtual ~Block() = default;
  virtual const char* kind() const = 0;  // "attention", "gated_delta_net", "mlp", "moe"
  virtual std::unique_ptr<BlockSaved> make_saved() const = 0;
  virtual Tensor forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) = 0;
  virtual Tensor backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) = 0;
  // Runs the queued weight gradients (none unless ctx.defer_wgrad was set) and drops them.
  virtual void backward_weight(BatchContext& ctx, BlockSaved& saved);
  // The parameter units whose gradients this block writes (set by the model that builds it).
  // A unit no earlier block of the layer writes has its final gradient once this block's
  // backward_weight is issued (the training state then starts its reduce and update).
  std::vector<const ParamUnit*> units;
};

struct Layer {
  int64_t index = 0;
  LayerType type = LayerType::full_attention;
  bool moe = false;
  std::vector<std::unique_ptr<Block>> blocks;
};

namespace block {
// `t` in dtype `dt` (a converted copy under activations when it differs).
Tensor as_dtype(const Tensor& t, DType dt);
// [T, ...] -> [T, rest].
Tensor flat(const Tensor& t);
// Runs `fn` now, or queues it in `saved` for backward_weight when ctx.defer_wgrad.
void weight_grad(BatchContext& ctx, BlockSaved& saved, std::function<void()> fn);
// The backward of y = x w^T (+ b) for the data part: d_x = d_y w (f32, or bf16 written by the
// GEMM when the caller wants bf16); queues or runs w.grad += d_y^T x and b.grad += sum d_y. d_y
// is taken in the weight's dtype.
Tensor linear_backward(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                       Param* w, Param* b, DType out_dtype = DType::f32);
// The same, with the data gradient added into d_x (f32, [T, in]) by the GEMM itself
// (beta = 1) instead of a separate addition pass: the branches of one input (q, k, v from one
// norm output; a layer's several projections) sum their gradients this way.
void linear_backward_acc(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                         Param* w, Param* b, Tensor& d_x);
// A pre-norm block's input gradient: the norm's backward of d_h plus the skip connection's
// d_y, in one pass when d_y is f32 (rmsnorm_backward's residual), else added after it.
Tensor norm_backward_with_skip(const Tensor& d_h, const Tensor& x, Param* ln,
                               const RMSNormSaved& rms, bool zero_centered, const Tensor& d_y);
}  // namespace block

}  // namespace bb

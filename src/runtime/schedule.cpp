// schedule.cpp — the layer loop, recompute and hooks (schedule.h).
#include "runtime/schedule.h"

#include <algorithm>
#include <thread>

#include "core/trace.h"

namespace bb {

Schedule::Schedule(DecoderModel& model, const ScheduleOptions& opts) : model_(model), opts_(opts) {}

void Schedule::before_end(ModelEnd e, Pass p) {
  for (LayerHooks* h : hooks_) h->before_end(e, p);
}

void Schedule::after_end(ModelEnd e, Pass p) {
  for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h) (*h)->after_end(e, p);
}

void Schedule::pace(const char* what, size_t layer) {
  if (opts_.max_layers_ahead <= 0 || model_.options().device.is_cpu()) return;
  layer_marks_.push_back(Event::record(model_.options().device, Stream::compute));
  if (static_cast<int64_t>(layer_marks_.size()) <= opts_.max_layers_ahead) return;
  const Event e = layer_marks_.front();
  layer_marks_.pop_front();
  if (e.done()) return;
  ++layer_waits_;
  const std::string where = std::string("the ") + what + " of layer " + std::to_string(layer);
  if (host_wait_) {
    host_wait_(e, where);
  } else {
    while (!e.done()) std::this_thread::yield();
  }
}

void Schedule::add_hooks(LayerHooks* hooks) {
  BB_CHECK(hooks, "Schedule::add_hooks: null hooks");
  hooks_.push_back(hooks);
}

BatchContext Schedule::begin(const MicroBatch& mb, Pass pass, ForwardStats& st) {
  model_.check_batch(mb);
  routing_.layers.assign(static_cast<size_t>(model_.num_moe_layers()), RoutingStash::Entry{});
  if (routing_source_ && !routing_.layers.empty()) {
    routing_source_(mb, routing_.layers);
    for (const RoutingStash::Entry& e : routing_.layers)
      BB_CHECK(e.logit_bias.defined() && e.logit_bias.dim() == 2 && e.logit_bias.size(0) == mb.tokens.numel() &&
                   e.logit_bias.size(1) == model_.config().num_experts,
               "schedule: the routing source must give every MoE layer a [", mb.tokens.numel(), ", ",
               model_.config().num_experts, "] logit bias");
  }
  if (model_.num_moe_layers() > 0)
    aux_.begin(model_.config().num_experts, model_.options().prims.router.value,
               model_.options().device);
  BatchContext ctx;
  ctx.mb = &mb;
  ctx.pass = pass;
  ctx.stats = &st;
  ctx.aux = model_.num_moe_layers() > 0 ? &aux_ : nullptr;
  ctx.routing = &routing_;
  return ctx;
}

Tensor Schedule::forward_layer(Layer& layer, const Tensor& x, BatchContext& ctx,
                               LayerState* state, bool output_unused) {
  if (state) {
    state->blocks.clear();
    for (auto& b : layer.blocks) state->blocks.push_back(b->make_saved());
  }
  Tensor y = x;
  for (size_t b = 0; b < layer.blocks.size(); ++b) {
    // Only the last block's output leaves the layer; the others feed the next block.
    ctx.output_unused = output_unused && b + 1 == layer.blocks.size();
    y = layer.blocks[b]->forward(y, ctx, state ? state->blocks[b].get() : nullptr);
  }
  ctx.output_unused = false;
  return y;
}

ForwardStats Schedule::forward_backward(const MicroBatch& mb, float loss_scale, double aux_scale) {
  ForwardStats st;
  BatchContext ctx = begin(mb, Pass::train, st);
  ctx.defer_wgrad = opts_.delay_wgrad;
  if (opts_.recompute == RecomputePolicy::selective) ctx.recompute_drop = opts_.parts;
  const bool full = opts_.recompute == RecomputePolicy::full;
  std::vector<Layer>& layers = model_.layers();
  std::vector<LayerState> state(layers.size());

  for (LayerHooks* h : hooks_) h->embedding_rows(mb.tokens);
  before_end(ModelEnd::embed, Pass::train);
  Tensor x = model_.embed_forward(mb);
  after_end(ModelEnd::embed, Pass::train);
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& L = layers[l];
    for (LayerHooks* h : hooks_) h->before_forward(L, Pass::train);
    if (full) {
      state[l].x = x;  // full recompute: keep only the layer input
      x = forward_layer(L, x, ctx, nullptr);
    } else {
      x = forward_layer(L, x, ctx, &state[l]);
    }
    for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h) (*h)->after_forward(L, Pass::train);
    pace("forward", l);
  }
  layer_marks_.clear();
  if (ctx.aux) {
    aux_.finish();
    st.aux_loss = aux_.value();
  }
  st.z_loss *= mb.token_share();
  before_end(ModelEnd::head, Pass::train);
  Tensor d = model_.head_train(x, mb, loss_scale, st);
  x = Tensor();
  after_end(ModelEnd::head, Pass::train);

  const ModelOptions& o = model_.options();
  const double n_moe = static_cast<double>(std::max<int64_t>(1, model_.num_moe_layers()));
  ctx.aux_grad = aux_scale * o.aux_loss_coef;  // d objective / d (pooled) aux
  // A context shard's router z-loss is its share of the micro-batch's per-token mean.
  ctx.z_grad = aux_scale * o.z_loss_coef / n_moe * mb.token_share();
  for (size_t i = layers.size(); i-- > 0;) {
    Layer& L = layers[i];
    for (LayerHooks* h : hooks_) h->before_backward(L);
    if (full) {
      // Re-run this layer's forward to rebuild what its backward needs.
      BB_RANGE("layer_recompute");
      ctx.pass = Pass::recompute;
      for (LayerHooks* h : hooks_) h->before_forward(L, Pass::recompute);
      Tensor input = state[i].x;
      state[i] = LayerState{};
      // Its output is not used (the backward starts from d): the last block may skip the work
      // that only produced it (the MoE block's fc2 and combine, ctx.output_unused).
      forward_layer(L, input, ctx, &state[i], /*output_unused=*/true);
      for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h)
        (*h)->after_forward(L, Pass::recompute);
      ctx.pass = Pass::train;
    }
    auto weights = [&](size_t b) {
      L.blocks[b]->backward_weight(ctx, *state[i].blocks[b]);
      for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h) (*h)->after_block_backward(L, b);
    };
    for (size_t b = L.blocks.size(); b-- > 0;) {
      d = L.blocks[b]->backward_data(d, ctx, *state[i].blocks[b]);
      if (!opts_.delay_wgrad) weights(b);
    }
    if (opts_.delay_wgrad)
      for (size_t b = L.blocks.size(); b-- > 0;) weights(b);
    state[i] = LayerState{};  // free this layer's activations before the next one
    for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h) (*h)->after_backward(L);
    pace("backward", i);
  }
  layer_marks_.clear();
  before_end(ModelEnd::embed_backward, Pass::train);
  model_.embed_backward(d, mb);
  d = Tensor();
  after_end(ModelEnd::embed_backward, Pass::train);
  // Weight gradients issued on the wgrad stream (the experts', [backend] expert_wgrad_stream)
  // are final for whoever reads the gradients after the micro-batch (the optimizer, the norm).
  const Device dev = model_.options().device;
  if (dev.is_cuda()) Event::record(dev, Stream::wgrad).wait(Stream::compute);
  end();
  return st;
}

void Schedule::end() {
  // The stash is saved state of this micro-batch (activations); what outlives the step is a
  // copy for last_routing().
  last_routing_.clear();
  last_replays_.clear();
  for (const RoutingStash::Entry& e : routing_.layers) {
    if (e.valid) last_routing_.push_back(e.topk_idx.clone(MemCategory::other));
    last_replays_.push_back(e.replays);
  }
  routing_.layers.clear();
}

ForwardStats Schedule::forward(const MicroBatch& mb, Tensor* logits) {
  ForwardStats st;
  const Tensor x = forward_trunk(mb, st);
  before_end(ModelEnd::head, Pass::eval);
  model_.head_eval(x, mb, st, logits);
  after_end(ModelEnd::head, Pass::eval);
  end();
  return st;
}

void Schedule::forward_token_stats(const MicroBatch& mb, const LossHeadConfig& head, Tensor& logp, Tensor& entropy) {
  ForwardStats st;
  const Tensor x = forward_trunk(mb, st);
  before_end(ModelEnd::head, Pass::eval);
  model_.head_token_stats(x, mb, head, logp, entropy);
  after_end(ModelEnd::head, Pass::eval);
  end();
}

Tensor Schedule::forward_trunk(const MicroBatch& mb, ForwardStats& st) {
  BatchContext ctx = begin(mb, Pass::eval, st);
  before_end(ModelEnd::embed, Pass::eval);
  Tensor x = model_.embed_forward(mb);
  after_end(ModelEnd::embed, Pass::eval);
  for (Layer& L : model_.layers()) {
    for (LayerHooks* h : hooks_) h->before_forward(L, Pass::eval);
    x = forward_layer(L, x, ctx, nullptr);
    for (auto h = hooks_.rbegin(); h != hooks_.rend(); ++h) (*h)->after_forward(L, Pass::eval);
  }
  if (ctx.aux) {
    aux_.finish();
    st.aux_loss = aux_.value();
  }
  st.z_loss *= mb.token_share();
  return x;
}

}  // namespace bb

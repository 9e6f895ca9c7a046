// gdn_block.cpp — the Gated DeltaNet residual block (gdn_block.h). Backward convention: d_x
// WRITTEN; the projection gradients through block::linear_backward (now or queued, block.h); the
// norm, conv1d, A_log and dt_bias gradients added in backward_data.
//
// The fused in_proj_qkv and conv1d are used as three row blocks (q, k, v): the projections are
// three GEMMs on row views of the one weight, and the depthwise conv runs per block on row
// views of its filters. That is the same math as one [C, H] GEMM and one conv over C channels
// followed by a column split, without the split (a column block of [T, C] is not contiguous).
#include "models/gdn_block.h"

#include <cmath>

#include "core/trace.h"
#include "primitives/conv/causal_conv1d.h"
#include "primitives/elementwise/elementwise.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/gdn/gdn_gates.h"
#include "primitives/linear/linear.h"
#include "primitives/norm/gated_rmsnorm.h"

namespace bb {

// Under context parallelism the tensors after the exchange (pre, act, z, a, g, beta, o) hold this
// rank's heads of every row of the whole sequences ([T_all, rows / cp] ...); x, h and y its rows.
struct GdnBlock::Saved final : BlockSaved {
  Tensor x;  // [T, H] block input
  Tensor h;  // [T, H] input-norm output (the projections' input)
  RMSNormSaved rms;
  Tensor pre[3];   // [T, rows] f32 conv inputs of q, k, v (the projections)
  Tensor act[3];   // [T, rows] silu(conv(pre)) in the activation dtype: the gated delta rule's q, k, v
  Tensor z;        // [T, Hv Dv] output-gate projection
  Tensor a;        // [T, Hv] decay projection (g is recomputed from it in the gates' backward)
  Tensor g, beta;  // [T, Hv] f32 gates
  Tensor o;        // [T, Hv, Dv] gated delta rule output (activation dtype)
  GatedDeltaPrep prep;  // the rule's chunk_prep outputs for its backward (CUDA; see forward)
  GdnCpSaved cp;        // context parallelism by states: the conv halo, the pieces' start states
  Tensor y;        // [T, Hv Dv] gated-norm output in the weight dtype: out_proj's input
};

namespace {

// The backward of y = x w_rows^T for a row block [row0, row0 + rows) of parameter w: d_x =
// d_y w_rows (f32); w.grad[rows] += d_y^T x, now or queued (the views are taken when it runs,
// so a rebound gradient buffer is honoured).
// acc: add the data gradient into *acc (the GEMM's beta = 1) and return it; else a new one.
Tensor row_linear_backward(BatchContext& ctx, BlockSaved& saved, const Tensor& d_y, const Tensor& x,
                           Param* w, int64_t row0, int64_t rows, Tensor* acc) {
  const Tensor g = block::as_dtype(d_y, w->value.dtype());
  block::weight_grad(ctx, saved, [g, x, w, row0, rows] {
    Tensor d_w = w->grad.narrow(row0, rows);
    linear_backward_weight(g, x, d_w, nullptr);
  });
  if (!acc) return linear_backward_data(g, w->value.narrow(row0, rows));
  linear_backward_data_acc(g, w->value.narrow(row0, rows), *acc);
  return *acc;
}

}  // namespace

GdnBlock::GdnBlock(ParamStore& store, ParamUnit& unit, ParamUnit& f32_unit,
                   const std::string& prefix, const GdnBlockConfig& cfg, GdnContextParallel cp)
    : cfg_(cfg), cpx_(std::move(cp)) {
  const int64_t H = cfg.hidden, Hk = cfg.num_key_heads, Hv = cfg.num_value_heads;
  const int64_t Dk = cfg.key_head_dim, Dv = cfg.value_head_dim, W = cfg.conv_kernel;
  BB_CHECK(H > 0 && Hk > 0 && Hv > 0 && Dk > 0 && Dv > 0 && Hv % Hk == 0,
           "GdnBlock: bad shape (hidden ", H, ", key heads ", Hk, ", value heads ", Hv,
           ", key dim ", Dk, ", value dim ", Dv, "): value heads must be a multiple of key heads");
  BB_CHECK(W >= 1 && W <= 4, "GdnBlock: conv kernel width ", W, " is not in [1, 4]");
  BB_CHECK(f32_unit.f32_values, "GdnBlock: A_log and dt_bias need a unit whose values stay f32");
  const int64_t C = 2 * Hk * Dk + Hv * Dv;
  const std::string a = prefix + "linear_attn.";
  ln_ = &store.add(unit, prefix + "input_layernorm.weight", {H}, false, HfSplit::none,
                   cfg.zero_centered_norm ? ParamInit::zeros : ParamInit::ones);
  w_qkv_ = &store.add(unit, a + "in_proj_qkv.weight", {C, H}, true);
  w_z_ = &store.add(unit, a + "in_proj_z.weight", {Hv * Dv, H}, true);
  w_b_ = &store.add(unit, a + "in_proj_b.weight", {Hv, H}, true);
  w_a_ = &store.add(unit, a + "in_proj_a.weight", {Hv, H}, true);
  conv_ = &store.add(unit, a + "conv1d.weight", {C, 1, W}, true);
  norm_ = &store.add(unit, a + "norm.weight", {Dv}, false, HfSplit::none, ParamInit::ones);
  w_out_ = &store.add(unit, a + "out_proj.weight", {H, Hv * Dv}, true);
  dt_bias_ = &store.add(f32_unit, a + "dt_bias", {Hv}, false, HfSplit::none, ParamInit::ones);
  a_log_ = &store.add(f32_unit, a + "A_log", {Hv}, false, HfSplit::none, ParamInit::gdn_a_log);
}

std::unique_ptr<BlockSaved> GdnBlock::make_saved() const {
  return std::make_unique<Saved>();
}

Tensor GdnBlock::conv_act(int i, const Tensor& pre, const MicroBatch& mb, const Tensor& x, Tensor* halo) const {
  const auto [row0, rows] = my_conv_rows(i, mb);
  const Tensor filters = conv_->value.view({conv_->shape[0], cfg_.conv_kernel});
  // On a GPU the gated delta rule takes q, k, v in the activation dtype (bf16: its tensor-core
  // products run on bf16 operands; f32 inputs cost three products per multiply); its CPU
  // reference takes f32.
  // The conv writes that dtype itself (one pass over the activations, not a second cast).
  return cpx_.conv_forward(pre, block::as_dtype(filters.narrow(row0, rows), DType::f32), mb,
                           x.device().is_cpu() ? DType::f32 : x.dtype(), halo);
}

std::pair<int64_t, int64_t> GdnBlock::qkv_rows(int i) const {
  const int64_t key = cfg_.num_key_heads * cfg_.key_head_dim;
  const int64_t value = cfg_.num_value_heads * cfg_.value_head_dim;
  return i == 0   ? std::pair{int64_t{0}, key}
         : i == 1 ? std::pair{key, key}
                  : std::pair{2 * key, value};
}

std::pair<int64_t, int64_t> GdnBlock::qkv_heads(int i) const {
  return i < 2 ? std::pair{cfg_.num_key_heads, cfg_.key_head_dim}
               : std::pair{cfg_.num_value_heads, cfg_.value_head_dim};
}

std::pair<int64_t, int64_t> GdnBlock::my_conv_rows(int i, const MicroBatch& mb) const {
  const auto [heads, dim] = qkv_heads(i);
  const auto [first, count] = cpx_.my_heads(heads, mb);
  return {qkv_rows(i).first + first * dim, count * dim};
}

Tensor GdnBlock::forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) {
  BB_RANGE("gdn_block_forward");
  const MicroBatch& mb = *ctx.mb;
  const int64_t Hk = cfg_.num_key_heads, Hv = cfg_.num_value_heads;
  const int64_t Dk = cfg_.key_head_dim, Dv = cfg_.value_head_dim;
  constexpr MemCategory kAct = MemCategory::activations;
  Saved local;
  Saved& S = saved ? static_cast<Saved&>(*saved) : local;
  S.x = x;
  S.h = rmsnorm_forward(x, ln_->value, cfg_.rms_norm_eps, &S.rms, kAct, cfg_.zero_centered_norm);
  // The six projections (q, k, v per row block of the fused weight, then z, a, b), each one's
  // exchange to heads (under context parallelism) posted as soon as it is queued: the later
  // projections' GEMMs run while the earlier exchanges travel. They travel in the projections'
  // dtype (bf16 on a GPU); q, k and v are widened to f32 for the convs after the exchange (the
  // values widening before it gave, at half the bytes).
  PendingExchange pre[3];
  for (int i = 0; i < 3; ++i) {
    const auto [row0, rows] = qkv_rows(i);
    pre[i] = cpx_.start_to_heads(linear_forward(S.h, w_qkv_->value.narrow(row0, rows), Tensor()),
                                  qkv_heads(i).first, mb, kAct);
  }
  PendingExchange z = cpx_.start_to_heads(linear_forward(S.h, w_z_->value, Tensor()), Hv, mb, kAct);
  PendingExchange a = cpx_.start_to_heads(linear_forward(S.h, w_a_->value, Tensor()), Hv, mb, kAct);
  PendingExchange b = cpx_.start_to_heads(linear_forward(S.h, w_b_->value, Tensor()), Hv, mb, kAct);
  // q, k, v: (to heads) -> depthwise causal conv -> SiLU.
  for (int i = 0; i < 3; ++i) {
    S.pre[i] = block::as_dtype(pre[i].get(), DType::f32);
    S.act[i] = conv_act(i, S.pre[i], mb, x, &S.cp.halo[i]);
  }
  S.z = z.get();
  S.a = a.get();
  const auto [vh0, hv] = cpx_.my_heads(Hv, mb);
  const int64_t hk = hv * Hk / Hv;
  const int64_t T = S.a.size(0);  // rows of the head-sharded tensors (the whole sequences under heads)
  {
    GdnGates gates = gdn_gates_forward(S.a, b.get(), a_log_->value.narrow(vh0, hv), dt_bias_->value.narrow(vh0, hv));
    S.g = gates.g;
    S.beta = gates.beta;
  }
  GatedDeltaOptions opts;
  opts.scale = 1.0 / std::sqrt(static_cast<double>(Dk));
  opts.l2norm = true;
  opts.eps = 1e-6;
  // A forward whose state the backward takes keeps the rule's chunk_prep outputs (32.1 KiB per
  // token at Qwen3.5's shapes), so the backward skips that pass; selective recompute of `gdn`
  // drops them with the conv outputs. Under full recompute this is the recompute pass, right
  // before the backward, whose workspace would hold the same buffers anyway.
  const bool keep_prep = saved != nullptr && !ctx.recompute_drop.has(RecomputePart::gdn);
  S.o = cpx_.rule_forward(S.act[0].view({T, hk, Dk}), S.act[1].view({T, hk, Dk}), S.act[2].view({T, hv, Dv}), S.g,
                          S.beta, mb, opts, keep_prep ? &S.prep : nullptr, saved ? &S.cp : nullptr);
  const Tensor y = gated_rmsnorm_forward(S.o.view({T * hv, Dv}), S.z.view({T * hv, Dv}),
                                         norm_->value, cfg_.rms_norm_eps);
  S.y = cpx_.from_heads(block::as_dtype(y.view({T, hv * Dv}), w_out_->value.dtype()), Hv, mb, kAct);
  Tensor out = linear_forward(S.y, w_out_->value, Tensor());
  if (saved) {  // selective recompute: backward_data rebuilds what is dropped here
    if (ctx.recompute_drop.has(RecomputePart::gdn))
      for (Tensor& t : S.act) t = Tensor();
    if (ctx.recompute_drop.has(RecomputePart::norms)) S.h = Tensor();
  }
  return block::as_dtype(add(x, out, kAct), x.dtype());
}

Tensor GdnBlock::backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) {
  BB_RANGE("gdn_block_backward");
  Saved& S = static_cast<Saved&>(saved);
  const MicroBatch& mb = *ctx.mb;
  const int64_t Hk = cfg_.num_key_heads, Hv = cfg_.num_value_heads;
  const int64_t Dk = cfg_.key_head_dim, Dv = cfg_.value_head_dim;
  constexpr MemCategory kAct = MemCategory::activations;
  const auto [vh0, hv] = cpx_.my_heads(Hv, mb);
  const int64_t hk = hv * Hk / Hv, T = S.a.size(0);

  const Tensor d_norm_out =
      cpx_.to_heads(block::linear_backward(ctx, S, d_y, S.y, w_out_, nullptr), Hv, mb, kAct);
  auto [d_o, d_z] =
      gated_rmsnorm_backward(d_norm_out.view({T * hv, Dv}), S.o.view({T * hv, Dv}),
                             S.z.view({T * hv, Dv}), norm_->value, cfg_.rms_norm_eps, norm_->grad);
  // Selective recompute of `gdn`: the convs again on the kept conv inputs (bit-identical).
  for (int i = 0; i < 3; ++i)
    if (!S.act[i].defined()) S.act[i] = conv_act(i, S.pre[i], mb, S.x, &S.cp.halo[i]);
  GatedDeltaOptions opts;
  opts.scale = 1.0 / std::sqrt(static_cast<double>(Dk));
  opts.l2norm = true;
  opts.eps = 1e-6;
  GatedDeltaGrads gg = cpx_.rule_backward(d_o.view({T, hv, Dv}), S.act[0].view({T, hk, Dk}), S.act[1].view({T, hk, Dk}),
                                          S.act[2].view({T, hv, Dv}), S.g, S.beta, mb, opts, &S.prep, S.cp);
  d_o = Tensor();
  // This rank's heads' slices of A_log and dt_bias (and of their gradients: the other ranks add
  // theirs, and the dense gradient reduction sums them).
  Tensor d_a_log = a_log_->grad.narrow(vh0, hv), d_dt_bias = dt_bias_->grad.narrow(vh0, hv);
  auto [d_a, d_b] = gdn_gates_backward(gg.d_g, gg.d_beta, S.a, S.g, S.beta, a_log_->value.narrow(vh0, hv),
                                       dt_bias_->value.narrow(vh0, hv), d_a_log, d_dt_bias);
  // Every gradient goes back from heads as soon as it is ready, already in its projection's
  // weight dtype (the projections' backward rounds it to that dtype first anyway: the same
  // values at half the bytes on a GPU), and the convs' backward runs while z's, b's and a's
  // travel; the projections' backward then takes them in the order as before.
  PendingExchange back_z = cpx_.start_from_heads(block::as_dtype(d_z.view({T, hv * Dv}), w_z_->value.dtype()), Hv,
                                                  mb, kAct);
  PendingExchange back_b = cpx_.start_from_heads(block::as_dtype(d_b, w_b_->value.dtype()), Hv, mb, kAct);
  PendingExchange back_a = cpx_.start_from_heads(block::as_dtype(d_a, w_a_->value.dtype()), Hv, mb, kAct);
  d_z = d_b = d_a = Tensor();

  // Through the convs (their filter gradients added here) and the projections.
  const Tensor filters = conv_->value.view({conv_->shape[0], cfg_.conv_kernel});
  Tensor filter_grads = conv_->grad.view({conv_->shape[0], cfg_.conv_kernel});
  const Tensor* d_act[3] = {&gg.d_q, &gg.d_k, &gg.d_v};
  PendingExchange back_pre[3];
  for (int i = 0; i < 3; ++i) {
    const auto [c0, crows] = my_conv_rows(i, mb);
    Tensor d_w = filter_grads.narrow(c0, crows);
    back_pre[i] = cpx_.start_from_heads(
        block::as_dtype(cpx_.conv_backward(d_act[i]->view({T, crows}), S.pre[i],
                                           block::as_dtype(filters.narrow(c0, crows), DType::f32), mb, S.cp.halo[i], d_w),
                        w_qkv_->value.dtype()),
        qkv_heads(i).first, mb, kAct);
  }
  gg = GatedDeltaGrads{};
  if (!S.h.defined())  // selective recompute of `norms`
    S.h = rmsnorm_forward(S.x, ln_->value, cfg_.rms_norm_eps, nullptr, kAct, cfg_.zero_centered_norm);
  Tensor d_h;
  for (int i = 0; i < 3; ++i) {
    const auto [row0, rows] = qkv_rows(i);
    const Tensor d_pre = back_pre[i].get();
    if (i == 0)
      d_h = row_linear_backward(ctx, S, d_pre, S.h, w_qkv_, row0, rows, nullptr);
    else
      row_linear_backward(ctx, S, d_pre, S.h, w_qkv_, row0, rows, &d_h);
  }
  block::linear_backward_acc(ctx, S, back_z.get(), S.h, w_z_, nullptr, d_h);
  block::linear_backward_acc(ctx, S, back_b.get(), S.h, w_b_, nullptr, d_h);
  block::linear_backward_acc(ctx, S, back_a.get(), S.h, w_a_, nullptr, d_h);
  return block::norm_backward_with_skip(d_h, S.x, ln_, S.rms, cfg_.zero_centered_norm, d_y);
}

}  // namespace bb

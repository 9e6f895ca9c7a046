// gdn_block.h — the Gated DeltaNet token mixer (Qwen3.5 `linear_attention` layers) as a residual
// block (skills/gdn-block.md):
//   h = RMSNorm(x)                                   (zero-centred in Qwen3.5: scale 1 + w)
//   q, k, v = h Wq^T, h Wk^T, h Wv^T                 (row blocks of in_proj_qkv, in this order)
//   q, k, v = silu(causal_conv1d(q | k | v))         (depthwise, no bias; per packed sequence)
//   z = h Wz^T;  beta = sigmoid(h Wb^T);  g = -exp(A_log) * softplus(h Wa^T + dt_bias)   (fp32)
//   o = gated_delta_rule(q, k, v, g, beta)           (q, k L2-normalised, q scaled 1/sqrt(Dk);
//                                                     value head h reads key head h / (Hv/Hk))
//   y = x + out_proj(RMSNormGated(o, z))             (per value head: w * rmsnorm(o) * silu(z))
// Parameters (Hugging Face names under `prefix` + "linear_attn."; C = 2 Hk Dk + Hv Dv):
//   in_proj_qkv.weight [C, H] (rows: q [Hk Dk], k [Hk Dk], v [Hv Dv]), in_proj_z.weight
//   [Hv Dv, H], in_proj_b.weight [Hv, H], in_proj_a.weight [Hv, H], conv1d.weight [C, 1, W],
//   norm.weight [Dv], out_proj.weight [H, Hv Dv] in the layer's dense unit; dt_bias [Hv] and
//   A_log [Hv] in the layer's f32 unit (fp32 values even when the weights are bf16). The input
//   norm is `prefix` + "input_layernorm.weight" [H].
// Backward convention as every block (block.h): d_x written; the projection weight gradients
// through the deferred-wgrad queue; the vector-like gradients (both norms, conv1d, A_log,
// dt_bias) added in backward_data, since their primitives compute them with the data gradient.
// Context parallelism (a micro-batch sharded over cp ranks) goes through the family object
// GdnContextParallel (primitives.gdn_cp, primitives/gdn/gdn_context_parallel.h): under `heads`
// the projections go to heads (each rank gets Hk / cp key and Hv / cp value heads of every row of
// the whole sequences), the conv, gates, recurrence and norm run there, and the normed output
// comes back to its rows before out_proj; under `states` every rank keeps its rows and all heads,
// and only the conv's halo and the recurrence's state summaries cross ranks. Unsharded, every
// call is the plain primitive.
// Legend: T tokens, H hidden, Hk / Hv key / value heads, Dk / Dv their dims, W conv width.
#pragma once

#include "models/block.h"
#include "primitives/gdn/gdn_context_parallel.h"
#include "primitives/gdn/gdn_gates.h"  // the gates (gdn_gates_forward/backward), used by the tests too
#include "primitives/norm/rmsnorm.h"

namespace bb {

struct GdnBlockConfig {
  int64_t hidden = 0, num_key_heads = 0, num_value_heads = 0, key_head_dim = 0, value_head_dim = 0,
          conv_kernel = 4;
  double rms_norm_eps = 1e-6;      // the input RMSNorm and the gated output norm
  bool zero_centered_norm = true;  // the input RMSNorm scales by (1 + w), w initialised to 0
};

class GdnBlock final : public Block {
 public:
  // Declares the parameters: matrices and norms in `unit` (the layer's dense unit), A_log and
  // dt_bias in `f32_unit` (a unit whose values stay f32).
  GdnBlock(ParamStore& store, ParamUnit& unit, ParamUnit& f32_unit, const std::string& prefix,
           const GdnBlockConfig& cfg, GdnContextParallel cp = GdnContextParallel());
  const char* kind() const override { return "gated_delta_net"; }
  std::unique_ptr<BlockSaved> make_saved() const override;
  Tensor forward(const Tensor& x, BatchContext& ctx, BlockSaved* saved) override;
  Tensor backward_data(const Tensor& d_y, BatchContext& ctx, BlockSaved& saved) override;

  const GdnBlockConfig& config() const { return cfg_; }

 private:
  struct Saved;
  // Row block i of in_proj_qkv / conv1d: 0 = q, 1 = k, 2 = v (first row, row count).
  std::pair<int64_t, int64_t> qkv_rows(int i) const;
  // Heads and head dim of row block i.
  std::pair<int64_t, int64_t> qkv_heads(int i) const;
  // The conv filter rows of row block i that this rank's heads of mb use (first row, rows).
  std::pair<int64_t, int64_t> my_conv_rows(int i, const MicroBatch& mb) const;
  // silu(causal_conv1d(pre)) of row block i (this rank's heads) in the gated delta rule's input
  // dtype (the forward's, and the rebuild of selective recompute's `gdn` part). halo: the
  // conv's halo under context parallelism by states (kept by the forward, reused by a rebuild).
  Tensor conv_act(int i, const Tensor& pre, const MicroBatch& mb, const Tensor& x, Tensor* halo) const;
  GdnBlockConfig cfg_;
  GdnContextParallel cpx_;
  Param *ln_ = nullptr, *w_qkv_ = nullptr, *w_z_ = nullptr, *w_b_ = nullptr, *w_a_ = nullptr;
  Param *conv_ = nullptr, *norm_ = nullptr, *w_out_ = nullptr;
  Param *a_log_ = nullptr, *dt_bias_ = nullptr;
};

}  // namespace bb

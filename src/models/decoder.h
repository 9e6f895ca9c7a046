// decoder.h — a decoder-only MoE language model as a list of layers built from the config's
// `layer_types`, each layer a list of residual blocks (models/block.h):
//
//   ids -> embedding -> N x [token mixer block (attention | gated delta net) -> MLP block
//       (dense | MoE)] -> final RMSNorm -> loss head (loss family), tied or untied LM head.
//
// Families: Qwen3-MoE and Qwen2-MoE (every layer full attention; Qwen2-MoE adds q/k/v biases
// and a shared expert, Qwen3-MoE per-head QK norm), and the Qwen3.5 hybrid (Gated DeltaNet
// blocks in the linear_attention layers, gated full attention with partial RoPE in the others,
// every layer MoE with a sigmoid-gated shared expert, every RMSNorm zero-centred). A new layer
// type plugs in as a new block.
//
// The model owns its parameters (flat units, models/params.h) and its blocks, and offers the
// pieces a schedule composes: the embedding, the layers, the head. It does not own the layer
// loop, the recompute policy or anything about parallelism: runtime/schedule.h runs the loop,
// and the dispatcher each MoE block is given decides where experts live.
//
// Legend: T tokens of the micro-batch, H hidden, V vocab.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/tensor.h"
#include "models/block.h"
#include "models/config.h"
#include "models/params.h"
#include "primitives/registry.h"

namespace bb {

struct ModelOptions {
  PrimitiveSet prims;  // the model reads loss, router, experts, permute, moe_dispatch, attention
  double aux_loss_coef = 0, z_loss_coef = 0;
  // Where the model lives and how its weights are stored. On a GPU the weights are bf16 (fp32
  // master copies live in the optimizer) and the residual stream is bf16; on the CPU all f32.
  Device device = Device::cpu();
  DType param_dtype = DType::f32;
  // The expert-parallel group the MoE layers' dispatchers move rows over (the mesh's `ep`);
  // null: every expert on this rank. The model itself never looks at it.
  comm::GroupPtr ep_group;
  // The context-parallel group the attention layers' members exchange K/V or heads over (the
  // mesh's `cp`); null: each rank attends its whole micro-batch alone.
  comm::GroupPtr cp_group;
  // The MoE layers' expert weight gradient on the wgrad stream ([backend] expert_wgrad_stream,
  // DispatcherConfig::wgrad_stream): where work runs, not what it computes.
  bool expert_wgrad_stream = false;
  // Token-chunked MoE: every MoE layer runs its routed path over the micro-batch's tokens in
  // this many sequential chunks (MoeBlockConfig::token_chunks; the runtime derives it from
  // [backend] moe_chunk_tokens). 1 = off.
  int64_t moe_token_chunks = 1;
  // Sharded start: the model lays its units out without allocating or initialising them
  // (ParamStore::allocate with materialize = false); whoever takes the units over allocates what
  // it holds and fills it with init_unit_range (the state family: runtime/state.h). The values
  // are those of a whole start, element for element.
  bool defer_values = false;
  void validate() const;
};

// One Hugging Face tensor: a slice of one parameter, addressed through its unit's flat buffers
// (offset counts elements from the parameter's start).
struct HfTensor {
  std::string name;
  Param* param = nullptr;
  int64_t offset = 0;
  Shape shape;
  // A fused expert tensor of a unit that holds only some experts (expert parallelism) is the
  // rows [hf_first_row, hf_first_row + shape[0]) of the Hugging Face tensor, which has
  // hf_num_rows rows. Every other tensor is whole: hf_first_row 0, hf_num_rows shape[0].
  int64_t hf_first_row = 0, hf_num_rows = 0;
  bool whole() const { return hf_first_row == 0 && hf_num_rows == shape.at(0); }
  Tensor value() const;  // view into the unit's values
  Tensor grad() const;   // view into the unit's gradients
};

// How the routed experts appear among the Hugging Face tensors.
enum class HfExperts : uint8_t {
  native,      // the family's checkpoint layout (ModelConfig::hf_fused_experts)
  per_expert,  // mlp.experts.E.{gate,up,down}_proj.weight
  fused,       // mlp.experts.gate_up_proj [E, 2F, H], mlp.experts.down_proj [E, H, F]
};

class DecoderModel {
 public:
  // Builds the parameters and initialises them from `seed` as transformers does (each Param's
  // ParamInit: normal(0, init_std) for matrices and conv filters, ones for norms, zeros for
  // biases and zero-centred norms, log(U(0.01, 16)) for A_log, ones for dt_bias), counter-based
  // so the values do not depend on order.
  DecoderModel(const ModelConfig& cfg, const ModelOptions& opts, uint64_t seed);
  DecoderModel(const DecoderModel&) = delete;
  DecoderModel& operator=(const DecoderModel&) = delete;
  ~DecoderModel();

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  ParamStore& param_store() { return store_; }
  // The initial values of elements [lo, lo + len) of unit u's flat layout (alignment padding
  // zero) into `out` ([len], the unit's value dtype, any device): element for element what the
  // whole initialisation gives them, so a rank can initialise only its shard.
  void init_unit_range(const ParamUnit& u, int64_t lo, int64_t len, Tensor& out) const;
  std::vector<Param*> params() { return store_.params(); }
  std::vector<ParamUnit*> units() { return store_.units(); }
  Param* find_param(const std::string& name) { return store_.find(name); }
  int64_t num_params() const { return store_.num_params(); }
  void zero_grad() { store_.zero_grad(); }

  std::vector<Layer>& layers() { return layers_; }
  int64_t num_moe_layers() const { return num_moe_layers_; }

  // Checks a micro-batch (dtypes, lengths) before anything runs.
  void check_batch(const MicroBatch& mb) const;
  // The embedding: x [T, H] in the parameter dtype.
  Tensor embed_forward(const MicroBatch& mb);
  // Adds d_x [T, H]'s contribution to the embedding's gradient.
  void embed_backward(const Tensor& d_x, const MicroBatch& mb);
  // The head on the last layer's output x [T, H]: final norm, loss and, for training, the
  // gradient d(objective)/d(x) (returned; f32) with loss_scale = d(objective)/d(loss_sum) and the
  // LM head's gradient accumulated. Fills loss_sum and num_valid of `st`.
  Tensor head_train(const Tensor& x, const MicroBatch& mb, float loss_scale, ForwardStats& st);
  // Evaluation: the loss, and the [T, V] f32 logits if `logits` is non-null.
  void head_eval(const Tensor& x, const MicroBatch& mb, ForwardStats& st, Tensor* logits);
  // Per-token log-prob of each target and entropy (primitives/loss/policy.h policy_token_stats)
  // from the last layer's output: the forward-only pass of RL (old / ref log-probs).
  void head_token_stats(const Tensor& x, const MicroBatch& mb, const LossHeadConfig& head, Tensor& logp,
                        Tensor& entropy);

  // The Hugging Face tensors: the routed experts as `experts` says (native: per-expert
  // gate_proj/up_proj/down_proj slices named with the unit's global expert ids for Qwen3-MoE /
  // Qwen2-MoE, the fused gate_up_proj / down_proj for Qwen3.5), gate/up halves of the fused
  // dense and shared-expert projections, every other parameter whole. Reading and writing
  // through them round-trips the model.
  std::vector<HfTensor> hf_tensors(HfExperts experts = HfExperts::native);

 private:
  ModelConfig cfg_;
  ModelOptions opts_;
  ParamStore store_;
  Param* embed_ = nullptr;
  Param* final_norm_ = nullptr;
  Param* lm_head_ = nullptr;  // == embed_ when tied
  std::vector<Layer> layers_;
  int64_t num_moe_layers_ = 0;
  std::unique_ptr<LossHead> loss_;
  uint64_t seed_ = 0;
  std::map<const Param*, uint64_t> param_index_;  // declaration order: the Philox stream index
  // Elements [from, from + dst.numel()) of parameter p's initial values into dst.
  void init_param_slice(const Param& p, int64_t from, Tensor& dst) const;
};

}  // namespace bb

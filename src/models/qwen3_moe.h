// qwen3_moe.h — the Qwen3-MoE / Qwen2-MoE decoder composed from primitives.
//
//   ids -> embedding -> N x [RMSNorm -> GQA attention (q/k/v proj, per-head QK RMSNorm, RoPE,
//   causal packed attention, o proj) -> +residual -> RMSNorm -> dense SwiGLU MLP or MoE
//   (router -> permute -> experts -> unpermute, optional shared expert with sigmoid gate)
//   -> +residual] -> RMSNorm -> loss head (full_ce | linear_ce), tied or untied LM head.
//
// The model never re-implements a primitive and knows nothing about parallelism. There is no
// autograd: `forward_backward` runs the layers forward, keeping exactly what each backward
// needs (or, with recompute = full, only each layer's input), then calls the primitive
// backwards in reverse order. Parameter gradients accumulate across micro-batches.
//
// Legend: T tokens of the micro-batch, H hidden, Hq/Hkv query/kv heads, D head dim, E experts,
// F expert ffn, I dense ffn, V vocab.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "models/config.h"
#include "runtime/data.h"

namespace bb {
struct RMSNormSaved;
}

namespace bb {

struct ModelOptions {
  std::string loss = "linear_ce";       // full_ce | linear_ce
  std::string recompute = "none";       // none | full
  std::string router = "softmax_topk";  // softmax_topk | sigmoid_topk
  std::string experts = "sequential";   // sequential | grouped
  std::string permute = "standard";     // standard | memory_efficient
  int64_t loss_chunk_tokens = 2048, loss_chunk_vocab = 32768;
  double aux_loss_coef = 0, z_loss_coef = 0;
  // Where the model lives and how its weights are stored. On a GPU the weights are bf16 (fp32
  // master copies live in the optimizer) and the residual stream is bf16; on the CPU all f32.
  Device device = Device::cpu();
  DType param_dtype = DType::f32;
  void validate() const;
};

// One trainable tensor: its value (params, options.param_dtype), its gradient (grads, f32), the
// Hugging Face name, and whether weight decay applies (matrices yes; norms and biases no).
struct Param {
  std::string name;
  Tensor value;
  Tensor grad;
  bool decay = true;
};

// Sums over one micro-batch (forward) — loss is a sum over valid tokens; aux_loss is the
// load-balancing loss of transformers' load_balancing_loss_func, which POOLS the MoE layers:
//   aux = E * sum_e (c_e / R) * (P_e / R),  R = (MoE layers) x T,
//   c_e = top-k assignments to expert e summed over layers, P_e = sum over layers and tokens of
//   the routing probability p_te (softmax; sigmoid scores normalised per token);
// z_loss is the mean over MoE layers of the per-layer router z-loss.
struct ForwardStats {
  double loss_sum = 0;
  int64_t num_valid = 0;
  double aux_loss = 0;
  double z_loss = 0;
};

class Qwen3MoeModel {
 public:
  // Builds the parameters and initialises them from `seed` (normal(0, init_std) for matrices,
  // ones for norms, zeros for biases), counter-based so the values do not depend on order.
  Qwen3MoeModel(const ModelConfig& cfg, const ModelOptions& opts, uint64_t seed);
  Qwen3MoeModel(const Qwen3MoeModel&) = delete;
  Qwen3MoeModel& operator=(const Qwen3MoeModel&) = delete;
  ~Qwen3MoeModel();

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  std::vector<Param*> params();
  Param* find_param(const std::string& name);
  int64_t num_params() const;
  void zero_grad();

  // Forward + backward of one micro-batch. loss_scale = d(objective)/d(loss_sum), usually
  // 1 / (valid tokens in the whole optimizer step); aux_scale multiplies the aux/z-loss
  // gradients (1 / micro-batches per step), so the objective is
  //   sum_mb loss_sum * loss_scale + aux_scale * sum_mb (aux_coef * aux + z_coef * z).
  ForwardStats forward_backward(const MicroBatch& mb, float loss_scale, double aux_scale);
  // Forward only (no saved state). If logits is non-null it receives [T, V] f32 logits.
  ForwardStats forward(const MicroBatch& mb, Tensor* logits);

  // Hugging Face layout: per-expert gate_proj/up_proj/down_proj tensors are views into the
  // fused expert weights, so reading and writing through them round-trips the model.
  std::vector<std::pair<std::string, Tensor>> hf_tensors();
  // Routing of the last forward, per MoE layer ([T, K] i32); for tests and router replay.
  const std::vector<Tensor>& last_routing() const { return last_routing_; }

 private:
  struct Layer;
  struct LayerSaved;
  Param& add_param(const std::string& name, const Shape& shape, bool decay);
  Tensor layer_forward(Layer& L, const Tensor& x, const MicroBatch& mb, LayerSaved* s, ForwardStats& st);
  Tensor layer_backward(Layer& L, const Tensor& d_y, const MicroBatch& mb, LayerSaved& s, double aux_grad, double z_grad);
  // Activation dtype conversions at GEMM inputs and the residual stream (identity on the CPU).
  Tensor to_act(const Tensor& t) const;
  // d_in = d_out @ w (and w.grad += d_out^T x, b.grad += sum d_out).
  Tensor linear_backward(const Tensor& d_out, const Tensor& x, Param* w, Param* b);
  ForwardStats run(const MicroBatch& mb, bool backward, float loss_scale, double aux_scale, Tensor* logits);
  // From d(loss)/d(final-norm output) down to the embedding (recomputing layers when asked).
  ForwardStats backward_layers(const MicroBatch& mb, ForwardStats st, Tensor& x, RMSNormSaved& fn,
                               const Tensor& d_h, std::vector<LayerSaved>& saved, double aux_scale);
  // Pooled aux loss (see ForwardStats): pool_aux adds one MoE layer's counts and probability
  // sums during the forward; add_aux_grad adds d(d_aux * aux)/d(logits) of one layer, which
  // depends on the counts of ALL layers (so it cannot come from the per-layer router backward).
  void pool_aux(const Tensor& scores, const std::vector<int64_t>& counts);
  void add_aux_grad(Tensor& d_logits, const Tensor& scores, double d_aux) const;

  ModelConfig cfg_;
  ModelOptions opts_;
  std::deque<Param> params_;  // deque: references stay valid as params are added
  Param* embed_ = nullptr;
  Param* final_norm_ = nullptr;
  Param* lm_head_ = nullptr;  // == embed_ when tied
  std::vector<Layer> layers_;
  std::vector<Tensor> last_routing_;
  // Aux-loss pool of the current micro-batch: counts [E] (host), probability sums [1, E] f32 on
  // the model's device, rows = MoE layers x T. Only the forward pass fills it (not a recompute).
  std::vector<double> aux_counts_;
  Tensor aux_ones_;  // [T, 1] f32 ones for the aux pooling product, reused across layers
  Tensor aux_prob_sum_;
  int64_t aux_rows_ = 0;
  bool aux_pooling_ = false;
};

}  // namespace bb

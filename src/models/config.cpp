// config.cpp — strict HF config.json parsing for qwen3_moe / qwen2_moe and the Qwen3.5 hybrid
// MoE text model (qwen3_5_moe_text, or nested in a qwen3_5_moe config), and the parameter and
// FLOP counts. Defaults follow transformers (configuration_qwen3_moe.py,
// configuration_qwen2_moe.py, configuration_qwen3_5_moe.py) so that a config.json means here
// what it means there.
#include "models/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>

#include "core/checked.h"
#include "core/error.h"
#include "io/fs.h"
#include "io/json_limits.h"

namespace bb {

using nlohmann::json;

namespace {

// Keys that never change the training math (metadata, inference-only switches, token ids we
// store but do not compute with). Anything else must be read explicitly below.
const std::set<std::string>& irrelevant_keys() {
  static const std::set<std::string> keys = {
      "architectures",        "torch_dtype",       "dtype",
      "transformers_version", "use_cache",         "output_router_logits",
      "sliding_window",       "max_window_layers", "pad_token_id",
      "_name_or_path",        "output_attentions", "output_hidden_states",
      "return_dict",          "tokenizer_class"};
  return keys;
}

// Keys read for both families.
const std::set<std::string>& common_keys() {
  static const std::set<std::string> keys = {"model_type",
                                             "vocab_size",
                                             "hidden_size",
                                             "num_hidden_layers",
                                             "num_attention_heads",
                                             "num_key_value_heads",
                                             "head_dim",
                                             "intermediate_size",
                                             "moe_intermediate_size",
                                             "num_experts",
                                             "num_local_experts",
                                             "num_experts_per_tok",
                                             "norm_topk_prob",
                                             "decoder_sparse_step",
                                             "mlp_only_layers",
                                             "rope_theta",
                                             "rope_scaling",
                                             "rope_parameters",
                                             "rms_norm_eps",
                                             "router_aux_loss_coef",
                                             "initializer_range",
                                             "tie_word_embeddings",
                                             "max_position_embeddings",
                                             "bos_token_id",
                                             "eos_token_id",
                                             "hidden_act",
                                             "use_sliding_window",
                                             "attention_bias",
                                             "attention_dropout",
                                             "layer_types"};
  return keys;
}

const std::set<std::string>& qwen2_moe_keys() {
  static const std::set<std::string> keys = {"shared_expert_intermediate_size", "qkv_bias"};
  return keys;
}

// Qwen3.5 text config (Qwen3_5MoeTextConfig) keys that are read. The family has no dense MLP,
// no q/k/v bias and no sliding window; its layer pattern, Gated DeltaNet shapes and partial
// RoPE are read here.
const std::set<std::string>& qwen35_keys() {
  static const std::set<std::string> keys = {"model_type",
                                             "vocab_size",
                                             "hidden_size",
                                             "num_hidden_layers",
                                             "num_attention_heads",
                                             "num_key_value_heads",
                                             "head_dim",
                                             "moe_intermediate_size",
                                             "shared_expert_intermediate_size",
                                             "num_experts",
                                             "num_experts_per_tok",
                                             "norm_topk_prob",
                                             "decoder_sparse_step",
                                             "mlp_only_layers",
                                             "rope_theta",
                                             "rope_scaling",
                                             "rope_parameters",
                                             "partial_rotary_factor",
                                             "rms_norm_eps",
                                             "router_aux_loss_coef",
                                             "initializer_range",
                                             "tie_word_embeddings",
                                             "max_position_embeddings",
                                             "bos_token_id",
                                             "eos_token_id",
                                             "hidden_act",
                                             "attention_bias",
                                             "attention_dropout",
                                             "attn_output_gate",
                                             "layer_types",
                                             "full_attention_interval",
                                             "linear_conv_kernel_dim",
                                             "linear_key_head_dim",
                                             "linear_value_head_dim",
                                             "linear_num_key_heads",
                                             "linear_num_value_heads"};
  return keys;
}

// Qwen3.5 text keys that do not change the training math of the text model:
//   intermediate_size             no layer of Qwen3_5MoeForCausalLM is a dense MLP
//   mamba_ssm_dtype               dtype of the inference-time recurrent state cache
//   mtp_num_hidden_layers, mtp_use_dedicated_embeddings
//                                 the multi-token-prediction head, which is not trained here
//                                 (its `mtp.*` weights are ignored when loading)
const std::set<std::string>& qwen35_irrelevant_keys() {
  static const std::set<std::string> keys = {"intermediate_size", "mamba_ssm_dtype",
                                             "mtp_num_hidden_layers",
                                             "mtp_use_dedicated_embeddings"};
  return keys;
}

// The outer Qwen3_5MoeConfig (Qwen3_5MoeForConditionalGeneration) keys besides text_config and
// tie_word_embeddings: the vision tower and its special tokens, not part of the text model.
const std::set<std::string>& qwen35_outer_irrelevant_keys() {
  static const std::set<std::string> keys = {"vision_config", "image_token_id", "video_token_id",
                                             "vision_start_token_id", "vision_end_token_id"};
  return keys;
}

// Typed access with messages that name the key and the file.
struct Reader {
  const json& j;
  const std::string& src;

  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }

  [[noreturn]] void wrong_type(const std::string& key, const char* want) const {
    BB_FAIL("key '", key, "' in ", src, " must be ", want, ", got ", j.at(key).type_name(), " ",
            j.at(key).dump());
  }
  void require(const std::string& key) const {
    BB_CHECK(has(key), "missing required key '", key, "' in ", src,
             " (shape keys have no default: a wrong guess would build a different model)");
  }

  // An integer JSON value as int64; `key` names it in errors. nlohmann keeps non-negative
  // integers as uint64, so values in [2^63, 2^64) must be refused here, not wrapped negative.
  int64_t int_value(const json& v, const std::string& key, const char* want) const {
    if (!v.is_number_integer()) wrong_type(key, want);
    BB_CHECK(!v.is_number_unsigned() ||
                 v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
             "key '", key, "' in ", src, " is ", v.dump(), ": out of range for a 64-bit integer");
    return v.get<int64_t>();
  }
  int64_t get_int(const std::string& key) const {
    require(key);
    return int_value(j.at(key), key, "an integer");
  }
  int64_t get_int(const std::string& key, int64_t def) const {
    return has(key) ? get_int(key) : def;
  }

  double get_double(const std::string& key, double def) const {
    if (!has(key)) return def;
    if (!j.at(key).is_number()) wrong_type(key, "a number");
    return j.at(key).get<double>();
  }
  bool get_bool(const std::string& key, bool def) const {
    if (!has(key)) return def;
    if (!j.at(key).is_boolean()) wrong_type(key, "a boolean");
    return j.at(key).get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& def) const {
    if (!has(key)) return def;
    if (!j.at(key).is_string()) wrong_type(key, "a string");
    return j.at(key).get<std::string>();
  }
};

// A RoPE spec object (rope_scaling of transformers 4.x, rope_parameters of 5.x). Only the
// plain "default" rotary embedding is implemented; anything else changes the frequencies.
// Returns the rope_theta inside it, or -1 when it has none.
// What a RoPE spec object holds; -1 = absent.
struct RopeSpec {
  double theta = -1;
  double partial_rotary_factor = -1;
};

// A RoPE spec object (rope_scaling of transformers 4.x, rope_parameters of 5.x). Only the
// plain "default" rotary embedding is implemented; anything else changes the frequencies.
// qwen35: also `partial_rotary_factor` and the multimodal `mrope_section` / `mrope_interleaved`
// entries, which are accepted because bumblebee feeds text-only positions: the temporal, height
// and width position rows are then identical, and so are the frequencies of every section.
RopeSpec check_rope_object(const json& r, const std::string& key, const std::string& src,
                           bool qwen35 = false) {
  BB_CHECK(r.is_object(), "key '", key, "' in ", src, " must be an object or null, got ",
           r.type_name());
  // The type first: it is the informative part of the message ("yarn", "linear", ...).
  for (const char* k : {"rope_type", "type"}) {
    if (!r.contains(k)) continue;
    const json& v = r.at(k);
    BB_CHECK(v.is_string() && v.get<std::string>() == "default", "key '", key, "' in ", src,
             " has ", k, " ", v.dump(), ": only the default RoPE is implemented (no scaling",
             qwen35 ? "; multimodal positions are not: text positions need only the default)"
                    : ")");
  }
  RopeSpec out;
  for (const auto& [k, v] : r.items()) {
    if (k == "rope_type" || k == "type") {
      continue;
    } else if (k == "rope_theta") {
      BB_CHECK(v.is_number(), "key '", key, ".rope_theta' in ", src, " must be a number");
      out.theta = v.get<double>();
    } else if (qwen35 && k == "partial_rotary_factor") {
      BB_CHECK(v.is_number(), "key '", key, ".partial_rotary_factor' in ", src, " must be a number");
      out.partial_rotary_factor = v.get<double>();
    } else if (qwen35 && k == "mrope_section") {
      bool ok = v.is_array();
      if (ok)
        for (const json& e : v) ok = ok && e.is_number_integer() && e.get<int64_t>() >= 0;
      BB_CHECK(ok, "key '", key, ".mrope_section' in ", src,
               " must be a list of non-negative integers, got ", v.dump());
    } else if (qwen35 && k == "mrope_interleaved") {
      BB_CHECK(v.is_boolean(), "key '", key, ".mrope_interleaved' in ", src, " must be a boolean");
    } else {
      BB_FAIL("key '", key, "' in ", src, " has entry '", k, "': only the default RoPE with rope_theta",
              qwen35 ? ", partial_rotary_factor and the (text-only, hence inert) mrope entries" : "",
              " is implemented");
    }
  }
  return out;
}

// bos_token_id / eos_token_id into c. -1 is "none" inside; in the file "none" is null or
// absent, so a negative id there is an error, not a second spelling.
void read_token_ids(const Reader& r, ModelConfig& c) {
  const json& j = r.j;
  const std::string& src = r.src;
  c.bos_token_id = r.get_int("bos_token_id", -1);
  if (r.has("eos_token_id")) {
    const json& e = j.at("eos_token_id");
    if (e.is_array()) {  // HF allows several; the first is the one we append
      for (const json& v : e) {
        const int64_t id = r.int_value(v, "eos_token_id", "an integer or a list of integers");
        BB_CHECK(id >= 0, "key 'eos_token_id' in ", src, " contains ", id,
                 ": token ids are >= 0 (use null for none)");
      }
      c.eos_token_id = e.empty() ? -1 : e.front().get<int64_t>();
    } else {
      c.eos_token_id = r.get_int("eos_token_id");
    }
  }
  BB_CHECK(!r.has("bos_token_id") || c.bos_token_id >= 0, "key 'bos_token_id' in ", src, " is ",
           c.bos_token_id, ": token ids are >= 0 (use null for none)");
  BB_CHECK(!r.has("eos_token_id") || j.at("eos_token_id").is_array() || c.eos_token_id >= 0,
           "key 'eos_token_id' in ", src, " is ", c.eos_token_id,
           ": token ids are >= 0 (use null for none)");
}

// validate(), with its "model config: " prefix replaced by "invalid model config <src>: ".
void validate_parsed(const ModelConfig& c, const std::string& src) {
  try {
    c.validate();
  } catch (const Error& e) {
    std::string msg = e.what();
    const std::string prefix = "model config: ";
    if (msg.rfind(prefix, 0) == 0) msg.erase(0, prefix.size());
    BB_FAIL("invalid model config ", src, ": ", msg);
  }
}

}  // namespace


bool ModelConfig::is_moe_layer(int64_t layer) const {
  BB_CHECK(layer >= 0 && layer < num_layers, "is_moe_layer: layer ", layer, " out of range [0, ",
           num_layers, ")");
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

const char* layer_type_name(LayerType t) {
  return t == LayerType::full_attention ? "full_attention" : "linear_attention";
}

LayerType ModelConfig::layer_type(int64_t layer) const {
  BB_CHECK(layer >= 0 && layer < num_layers, "layer_type: layer ", layer, " out of range [0, ",
           num_layers, ")");
  return layer_types.empty() ? LayerType::full_attention : layer_types[static_cast<size_t>(layer)];
}

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelConfig::num_linear_attention_layers() const {
  return std::count(layer_types.begin(), layer_types.end(), LayerType::linear_attention);
}

int64_t ModelConfig::rotary_dim() const {
  // Python's int(head_dim * partial_rotary_factor), as transformers computes the rotary width.
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

void ModelConfig::validate() const {
  const char* p = "model config: ";
  BB_CHECK(model_type == "qwen3_moe" || model_type == "qwen2_moe" || is_qwen35(), p,
           "model_type '", model_type, "' is not supported (expected qwen3_moe, qwen2_moe or ",
           kQwen35MoeText, ")");
  BB_CHECK(vocab_size > 0, p, "vocab_size must be > 0, got ", vocab_size);
  // Upper bounds first: everything below (num_moe_layers, the counts) loops or multiplies over
  // these values.
  auto at_most = [&](int64_t v, int64_t limit, const char* key) {
    BB_CHECK(v <= limit, p, key, " = ", v, " exceeds bumblebee's limit of ", limit,
             " (skills/model-config.md: bounds)");
  };
  at_most(vocab_size, kMaxVocabSize, "vocab_size");
  at_most(hidden_size, kMaxModelDim, "hidden_size");
  at_most(num_layers, kMaxLayers, "num_hidden_layers");
  at_most(num_heads, kMaxHeads, "num_attention_heads");
  at_most(num_kv_heads, kMaxHeads, "num_key_value_heads");
  at_most(head_dim, kMaxModelDim, "head_dim");
  at_most(intermediate_size, kMaxModelDim, "intermediate_size");
  at_most(moe_intermediate_size, kMaxModelDim, "moe_intermediate_size");
  at_most(shared_expert_intermediate_size, kMaxModelDim, "shared_expert_intermediate_size");
  at_most(num_experts, kMaxExperts, "num_experts");
  at_most(top_k, kMaxExperts, "num_experts_per_tok");
  at_most(decoder_sparse_step, kMaxLayers, "decoder_sparse_step");
  at_most(linear_num_key_heads, kMaxHeads, "linear_num_key_heads");
  at_most(linear_num_value_heads, kMaxHeads, "linear_num_value_heads");
  at_most(linear_key_head_dim, kMaxModelDim, "linear_key_head_dim");
  at_most(linear_value_head_dim, kMaxModelDim, "linear_value_head_dim");
  at_most(linear_conv_kernel_dim, kMaxModelDim, "linear_conv_kernel_dim");
  BB_CHECK(intermediate_size >= 0, p, "intermediate_size must be >= 0, got ", intermediate_size);
  BB_CHECK(moe_intermediate_size >= 0, p, "moe_intermediate_size must be >= 0, got ",
           moe_intermediate_size);
  BB_CHECK(top_k >= 0, p, "num_experts_per_tok must be >= 0, got ", top_k);
  for (const auto& [v, key] : {std::pair{rope_theta, "rope_theta"}, {rms_norm_eps, "rms_norm_eps"},
                               {router_aux_loss_coef, "router_aux_loss_coef"},
                               {init_std, "initializer_range"},
                               {partial_rotary_factor, "partial_rotary_factor"}})
    BB_CHECK(std::isfinite(v), p, key, " must be a finite number, got ", v);
  BB_CHECK(hidden_size > 0, p, "hidden_size must be > 0, got ", hidden_size);
  BB_CHECK(num_layers > 0, p, "num_hidden_layers must be > 0, got ", num_layers);
  BB_CHECK(num_heads > 0, p, "num_attention_heads must be > 0, got ", num_heads);
  BB_CHECK(num_kv_heads > 0, p, "num_key_value_heads must be > 0, got ", num_kv_heads);
  BB_CHECK(num_heads % num_kv_heads == 0, p, "num_attention_heads (", num_heads,
           ") must be a multiple of num_key_value_heads (", num_kv_heads, ")");
  BB_CHECK(head_dim > 0, p, "head_dim must be > 0, got ", head_dim);
  BB_CHECK(head_dim % 2 == 0, p, "head_dim must be even for RoPE, got ", head_dim);
  BB_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1, p,
           "partial_rotary_factor must be in (0, 1], got ", partial_rotary_factor);
  BB_CHECK(rotary_dim() >= 2 && rotary_dim() % 2 == 0, p, "partial_rotary_factor ",
           partial_rotary_factor, " x head_dim ", head_dim, " gives a rotary dim of ", rotary_dim(),
           ": it must be even and >= 2 (RoPE rotates pairs of dims)");
  BB_CHECK(decoder_sparse_step >= 1, p, "decoder_sparse_step must be >= 1, got ",
           decoder_sparse_step);
  BB_CHECK(layer_types.empty() || static_cast<int64_t>(layer_types.size()) == num_layers, p,
           "layer_types has ", layer_types.size(), " entries, expected num_hidden_layers = ",
           num_layers);
  std::set<int64_t> dense_layers;
  for (int64_t l : mlp_only_layers) {
    BB_CHECK(l >= 0 && l < num_layers, p, "mlp_only_layers entry ", l,
             " is not a layer index in [0, ", num_layers, ")");
    BB_CHECK(dense_layers.insert(l).second, p, "mlp_only_layers lists layer ", l, " twice");
  }
  BB_CHECK(num_experts >= 0, p, "num_experts must be >= 0, got ", num_experts);
  const int64_t n_moe = num_moe_layers();
  if (n_moe > 0) {
    BB_CHECK(top_k >= 1 && top_k <= num_experts, p, "num_experts_per_tok (", top_k,
             ") must be in [1, num_experts = ", num_experts, "]");
    BB_CHECK(moe_intermediate_size > 0, p, "moe_intermediate_size must be > 0, got ",
             moe_intermediate_size);
  }
  if (n_moe < num_layers)
    BB_CHECK(intermediate_size > 0, p, "intermediate_size must be > 0 (", num_layers - n_moe,
             " dense layers), got ", intermediate_size);
  BB_CHECK(shared_expert_intermediate_size >= 0, p,
           "shared_expert_intermediate_size must be >= 0, got ", shared_expert_intermediate_size);
  BB_CHECK(rope_theta > 0, p, "rope_theta must be > 0, got ", rope_theta);
  BB_CHECK(rms_norm_eps > 0, p, "rms_norm_eps must be > 0, got ", rms_norm_eps);
  BB_CHECK(router_aux_loss_coef >= 0, p, "router_aux_loss_coef must be >= 0, got ",
           router_aux_loss_coef);
  BB_CHECK(init_std > 0, p, "initializer_range must be > 0, got ", init_std);
  BB_CHECK(max_position_embeddings >= 0, p, "max_position_embeddings must be >= 0, got ",
           max_position_embeddings);
  BB_CHECK(bos_token_id < vocab_size, p, "bos_token_id ", bos_token_id, " >= vocab_size ",
           vocab_size);
  BB_CHECK(eos_token_id < vocab_size, p, "eos_token_id ", eos_token_id, " >= vocab_size ",
           vocab_size);
  BB_CHECK(bos_token_id >= -1 && eos_token_id >= -1, p, "token ids are >= 0 or -1 (none), got bos ",
           bos_token_id, ", eos ", eos_token_id);
  for (const auto& [v, key] : {std::pair{linear_num_key_heads, "linear_num_key_heads"},
                               {linear_num_value_heads, "linear_num_value_heads"},
                               {linear_key_head_dim, "linear_key_head_dim"},
                               {linear_value_head_dim, "linear_value_head_dim"},
                               {linear_conv_kernel_dim, "linear_conv_kernel_dim"}})
    BB_CHECK(v >= 0, p, key, " must be >= 0, got ", v);
  // The families differ exactly here; anything else would not round-trip through HF.
  if (is_qwen35()) {
    const char* f = kQwen35MoeText;
    BB_CHECK(qk_norm && !qkv_bias, p, f, " has per-head q/k RMSNorm and no q/k/v bias");
    BB_CHECK(zero_centered_norm, p, f, " RMSNorms are zero-centred (scale 1 + w)");
    BB_CHECK(attn_output_gate, p, f, " full attention has the sigmoid output gate");
    BB_CHECK(num_experts > 0 && n_moe == num_layers, p, f,
             ": every layer is MoE (num_experts > 0, no mlp_only_layers, decoder_sparse_step 1)");
    BB_CHECK(intermediate_size == 0, p, f,
             " has no dense MLP: intermediate_size must be 0 (its config.json key is ignored), got ",
             intermediate_size);
    BB_CHECK(shared_expert_intermediate_size > 0, p, f,
             " has a shared expert: shared_expert_intermediate_size must be > 0, got ",
             shared_expert_intermediate_size);
    BB_CHECK(norm_topk_prob, p, f, " renormalises the top-k routing probabilities (norm_topk_prob)");
    BB_CHECK(static_cast<int64_t>(layer_types.size()) == num_layers, p, f,
             " needs layer_types (one entry per layer), got ", layer_types.size(), " entries");
    if (num_linear_attention_layers() > 0) {
      for (const auto& [v, key] : {std::pair{linear_num_key_heads, "linear_num_key_heads"},
                                   {linear_num_value_heads, "linear_num_value_heads"},
                                   {linear_key_head_dim, "linear_key_head_dim"},
                                   {linear_value_head_dim, "linear_value_head_dim"},
                                   {linear_conv_kernel_dim, "linear_conv_kernel_dim"}})
        BB_CHECK(v > 0, p, key, " must be > 0 (", num_linear_attention_layers(),
                 " linear_attention layers), got ", v);
      BB_CHECK(linear_num_value_heads % linear_num_key_heads == 0, p, "linear_num_value_heads (",
               linear_num_value_heads, ") must be a multiple of linear_num_key_heads (",
               linear_num_key_heads, ")");
      BB_CHECK(linear_conv_kernel_dim <= 4, p, "linear_conv_kernel_dim = ", linear_conv_kernel_dim,
               ": the causal_conv1d primitive implements kernel widths 1..4");
    }
  } else {
    BB_CHECK(!zero_centered_norm && !attn_output_gate && partial_rotary_factor == 1.0 &&
                 linear_num_key_heads == 0 && linear_num_value_heads == 0 &&
                 linear_key_head_dim == 0 && linear_value_head_dim == 0 &&
                 linear_conv_kernel_dim == 0,
             p, model_type,
             " has none of the Qwen3.5 features (zero-centred norms, attention output gate, "
             "partial RoPE, Gated DeltaNet shapes)");
    for (LayerType t : layer_types)
      BB_CHECK(t == LayerType::full_attention, p, model_type,
               " has only full_attention layers, layer_types has ", layer_type_name(t));
    if (model_type == "qwen3_moe") {
      BB_CHECK(qk_norm && !qkv_bias, p, "qwen3_moe has per-head q/k RMSNorm and no q/k/v bias");
      BB_CHECK(shared_expert_intermediate_size == 0, p, "qwen3_moe has no shared expert");
    } else {
      BB_CHECK(!qk_norm, p, "qwen2_moe has no q/k RMSNorm");
    }
  }
}

namespace {
// Overflow-checked sums of products for the parameter counts; `what` names the count.
struct CountSum {
  const char* what;
  int64_t total = 0;
  void add(std::initializer_list<int64_t> factors) {
    const int64_t term = checked_product(factors, "model config: ", what);
    total = checked_add(total, term, "model config: ", what);
  }
};

// Width of q_proj's output: the queries, and as much again for the output gate.
int64_t q_proj_rows(const ModelConfig& c, const char* what) {
  return checked_product({c.num_heads, c.head_dim, c.attn_output_gate ? 2 : 1}, "model config: ",
                         what);
}

// Channels of a Gated DeltaNet layer's in_proj_qkv and conv1d: q and k (Hk x Dk each), v (Hv x Dv).
int64_t gdn_conv_channels(const ModelConfig& c, const char* what) {
  CountSum ch{what};
  ch.add({2, c.linear_num_key_heads, c.linear_key_head_dim});
  ch.add({c.linear_num_value_heads, c.linear_value_head_dim});
  return ch.total;
}

// The matmul weights of a Gated DeltaNet layer: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
// out_proj.
int64_t gdn_matmul_params(const ModelConfig& c, const char* what) {
  const int64_t H = c.hidden_size, Hv = c.linear_num_value_heads, Dv = c.linear_value_head_dim;
  CountSum s{what};
  s.add({H, gdn_conv_channels(c, what)});
  s.add({H, Hv, Dv});
  s.add({2, H, Hv});
  s.add({Hv, Dv, H});
  return s.total;
}
}  // namespace

int64_t ModelConfig::num_params() const {
  const int64_t H = hidden_size, D = head_dim;
  const char* what = "num_params";
  CountSum attn{what};
  attn.add({H, q_proj_rows(*this, what)});  // q (+ gate)
  attn.add({2, H, num_kv_heads, D});        // k, v
  attn.add({num_heads, D, H});              // o
  if (qkv_bias) {
    attn.add({q_proj_rows(*this, what)});
    attn.add({2, num_kv_heads, D});
  }
  if (qk_norm) attn.add({2, D});
  CountSum gdn{what};
  if (num_linear_attention_layers() > 0) {
    gdn.add({gdn_matmul_params(*this, what)});
    gdn.add({gdn_conv_channels(*this, what), linear_conv_kernel_dim});  // conv1d
    gdn.add({2, linear_num_value_heads});                               // A_log, dt_bias
    gdn.add({linear_value_head_dim});                                   // gated output norm
  }
  CountSum total{what};
  for (int64_t l = 0; l < num_layers; ++l) {
    total.add({layer_type(l) == LayerType::linear_attention ? gdn.total : attn.total});
    total.add({2, H});  // input and post-attention RMSNorm
    if (is_moe_layer(l)) {
      total.add({num_experts, 3, H, moe_intermediate_size});
      total.add({num_experts, H});
      if (shared_expert_intermediate_size > 0) {
        total.add({3, H, shared_expert_intermediate_size});
        total.add({H});
      }
    } else {
      total.add({3, H, intermediate_size});
    }
  }
  total.add({H});  // final norm
  total.add({vocab_size, H, tie_word_embeddings ? 1 : 2});
  return total.total;
}

int64_t ModelConfig::num_expert_params() const {
  CountSum total{"num_expert_params"};
  total.add({num_moe_layers(), num_experts, 3, hidden_size, moe_intermediate_size});
  return total.total;
}

int64_t ModelConfig::active_matmul_params_per_token() const {
  const int64_t H = hidden_size, D = head_dim;
  const char* what = "active_matmul_params_per_token";
  CountSum attn{what};
  attn.add({H, q_proj_rows(*this, what)});
  attn.add({num_heads, D, H});
  attn.add({2, H, num_kv_heads, D});
  const int64_t gdn = num_linear_attention_layers() > 0 ? gdn_matmul_params(*this, what) : 0;
  CountSum total{what};
  for (int64_t l = 0; l < num_layers; ++l) {
    total.add({layer_type(l) == LayerType::linear_attention ? gdn : attn.total});
    if (is_moe_layer(l)) {
      total.add({top_k, 3, H, moe_intermediate_size});
      total.add({num_experts, H});
      if (shared_expert_intermediate_size > 0) {
        total.add({3, H, shared_expert_intermediate_size});
        total.add({H});
      }
    } else {
      total.add({3, H, intermediate_size});
    }
  }
  total.add({vocab_size, H});  // LM head multiplies even when tied
  return total.total;
}

int64_t ModelConfig::num_active_params() const {
  CountSum total{"num_active_params"};
  total.add({active_matmul_params_per_token()});
  total.add({vocab_size, hidden_size});
  return total.total;
}

namespace {

// The text-only Qwen3.5 config.json (Qwen3_5MoeForCausalLM): only keys Qwen3_5MoeTextConfig
// defines, so transformers' strict config class takes every one of them.
json qwen35_to_hf_json(const ModelConfig& c) {
  json j;
  j["architectures"] = json::array({"Qwen3_5MoeForCausalLM"});
  j["model_type"] = kQwen35MoeText;
  j["torch_dtype"] = "bfloat16";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.top_k;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  j["initializer_range"] = c.init_std;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  j["eos_token_id"] = c.eos_token_id >= 0 ? json(c.eos_token_id) : json(nullptr);
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  j["output_router_logits"] = false;
  json lt = json::array();
  for (LayerType t : c.layer_types) lt.push_back(layer_type_name(t));
  j["layer_types"] = lt;
  j["linear_num_key_heads"] = c.linear_num_key_heads;
  j["linear_num_value_heads"] = c.linear_num_value_heads;
  j["linear_key_head_dim"] = c.linear_key_head_dim;
  j["linear_value_head_dim"] = c.linear_value_head_dim;
  j["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  // Both spellings: transformers moves a top-level partial_rotary_factor (it defaults one to
  // 0.25) into rope_parameters; with equal values the order of that merge cannot matter.
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  j["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", c.rope_theta},
                          {"partial_rotary_factor", c.partial_rotary_factor}};
  return j;
}

}  // namespace

json ModelConfig::to_hf_json() const {
  validate();
  if (is_qwen35()) return qwen35_to_hf_json(*this);
  const bool q3 = model_type == "qwen3_moe";
  json j;
  j["architectures"] = json::array({q3 ? "Qwen3MoeForCausalLM" : "Qwen2MoeForCausalLM"});
  j["model_type"] = model_type;
  j["torch_dtype"] = "bfloat16";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = top_k;
  j["norm_topk_prob"] = norm_topk_prob;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
  j["hidden_act"] = "silu";
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["rms_norm_eps"] = rms_norm_eps;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["initializer_range"] = init_std;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["max_position_embeddings"] = max_position_embeddings;
  j["bos_token_id"] = bos_token_id >= 0 ? json(bos_token_id) : json(nullptr);
  j["eos_token_id"] = eos_token_id >= 0 ? json(eos_token_id) : json(nullptr);
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  j["output_router_logits"] = false;
  if (q3) {
    j["attention_bias"] = false;
  } else {
    j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
    j["qkv_bias"] = qkv_bias;
  }
  return j;
}

namespace {

// Keys whose value must be the one bumblebee implements (shared by the families).
void check_implemented_values(const Reader& r, const char* bias_note) {
  const std::string& src = r.src;
  const std::string act = r.get_string("hidden_act", "silu");
  BB_CHECK(act == "silu", "key 'hidden_act' in ", src, " is '", act,
           "': only silu (SwiGLU experts) is implemented");
  BB_CHECK(!r.get_bool("use_sliding_window", false), "key 'use_sliding_window' in ", src,
           " is true: sliding-window attention is not implemented");
  BB_CHECK(!r.get_bool("attention_bias", false), "key 'attention_bias' in ", src, " is true: ",
           bias_note);
  const double dropout = r.get_double("attention_dropout", 0.0);
  BB_CHECK(dropout == 0.0, "key 'attention_dropout' in ", src, " is ", dropout,
           ": attention dropout is not implemented (set it to 0)");
}

// The behaviour keys every family reads with transformers' defaults.
void read_common_behaviour(const Reader& r, ModelConfig& c) {
  c.rms_norm_eps = r.get_double("rms_norm_eps", 1e-6);
  c.router_aux_loss_coef = r.get_double("router_aux_loss_coef", 0.001);
  c.init_std = r.get_double("initializer_range", 0.02);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  c.max_position_embeddings = r.get_int("max_position_embeddings", 32768);
  read_token_ids(r, c);
}

// Shape keys both families require.
void read_shape(const Reader& r, ModelConfig& c) {
  c.vocab_size = r.get_int("vocab_size");
  c.hidden_size = r.get_int("hidden_size");
  c.num_layers = r.get_int("num_hidden_layers");
  c.num_heads = r.get_int("num_attention_heads");
  c.num_kv_heads = r.get_int("num_key_value_heads");
  c.moe_intermediate_size = r.get_int("moe_intermediate_size");
  BB_CHECK(c.num_heads > 0, "key 'num_attention_heads' in ", r.src, " must be > 0, got ",
           c.num_heads);
}

// qwen3_moe / qwen2_moe.
ModelConfig parse_classic(const json& j, const std::string& src, const std::string& model_type) {
  Reader r{j, src};
  ModelConfig c;
  c.model_type = model_type;
  const bool q2 = c.model_type == "qwen2_moe";

  for (const auto& [key, value] : j.items()) {
    if (irrelevant_keys().count(key) || common_keys().count(key)) continue;
    if (q2 && qwen2_moe_keys().count(key)) continue;
    BB_FAIL("unknown key '", key, "' in ", src,
            ": bumblebee does not know whether it changes the model; remove it or file an issue");
  }

  // Shape keys: required.
  read_shape(r, c);
  c.intermediate_size = r.get_int("intermediate_size");
  // transformers 5 writes Qwen3-MoE configs with `num_local_experts`; older ones `num_experts`.
  if (r.has("num_local_experts")) {
    c.num_experts = r.get_int("num_local_experts");
    BB_CHECK(!r.has("num_experts") || r.get_int("num_experts") == c.num_experts, "keys 'num_experts' (",
             r.get_int("num_experts"), ") and 'num_local_experts' (", c.num_experts, ") in ", src, " disagree");
  } else {
    c.num_experts = r.get_int("num_experts");
  }
  c.top_k = r.get_int("num_experts_per_tok");
  c.head_dim = r.get_int("head_dim", c.hidden_size / c.num_heads);
  if (q2) c.shared_expert_intermediate_size = r.get_int("shared_expert_intermediate_size");

  // Behaviour keys: transformers' defaults.
  c.decoder_sparse_step = r.get_int("decoder_sparse_step", 1);
  if (r.has("mlp_only_layers")) {
    const json& m = j.at("mlp_only_layers");
    if (!m.is_array()) r.wrong_type("mlp_only_layers", "a list of integers");
    for (const json& e : m)
      c.mlp_only_layers.push_back(r.int_value(e, "mlp_only_layers", "a list of integers"));
  }
  c.norm_topk_prob = r.get_bool("norm_topk_prob", false);  // HF default for both families
  read_common_behaviour(r, c);

  // RoPE: rope_theta (4.x) and/or rope_parameters (5.x); scaling of any kind is rejected.
  c.rope_theta = r.get_double("rope_theta", 10000.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!r.has(key)) continue;
    const double theta = check_rope_object(j.at(key), key, src).theta;
    if (theta < 0) continue;
    BB_CHECK(!r.has("rope_theta") || theta == c.rope_theta, "key '", key, ".rope_theta' (", theta,
             ") in ", src, " disagrees with rope_theta (", c.rope_theta, ")");
    c.rope_theta = theta;
  }

  // Values that would change the math in ways not implemented.
  check_implemented_values(r, q2 ? "qwen2_moe q/k/v biases are set by qkv_bias; o_proj bias is not implemented"
                                 : "qwen3_moe attention biases are not implemented");
  if (r.has("layer_types")) {
    const json& lt = j.at("layer_types");
    if (!lt.is_array()) r.wrong_type("layer_types", "a list of strings");
    BB_CHECK(static_cast<int64_t>(lt.size()) == c.num_layers, "key 'layer_types' in ", src, " has ",
             lt.size(), " entries, expected num_hidden_layers = ", c.num_layers);
    for (const json& t : lt)
      BB_CHECK(t.is_string() && t.get<std::string>() == "full_attention", "key 'layer_types' in ",
               src, " contains ", t.dump(), ": only full_attention is implemented");
  }

  // Family differences.
  c.qk_norm = !q2;
  c.qkv_bias = q2 ? r.get_bool("qkv_bias", true) : false;
  validate_parsed(c, src);
  return c;
}

// The Qwen3.5 text config (Qwen3_5MoeTextConfig). `outer_tie` is the outer
// Qwen3_5MoeConfig's tie_word_embeddings when the text part is nested and the outer config
// sets it (null otherwise).
ModelConfig parse_qwen35_text(const json& j, const std::string& src, const json* outer_tie,
                              const std::string& outer_src) {
  BB_CHECK(j.is_object(), "model config ", src, " must be a JSON object, got ", j.type_name());
  Reader r{j, src};
  ModelConfig c;
  c.model_type = kQwen35MoeText;
  for (const auto& [key, value] : j.items()) {
    if (irrelevant_keys().count(key) || qwen35_irrelevant_keys().count(key) ||
        qwen35_keys().count(key))
      continue;
    BB_FAIL("unknown key '", key, "' in ", src,
            ": bumblebee does not know whether it changes the model; remove it or file an issue");
  }

  // Shape keys: required (the Gated DeltaNet ones too: no guessed default).
  read_shape(r, c);
  c.num_experts = r.get_int("num_experts");
  c.top_k = r.get_int("num_experts_per_tok");
  c.shared_expert_intermediate_size = r.get_int("shared_expert_intermediate_size");
  c.linear_num_key_heads = r.get_int("linear_num_key_heads");
  c.linear_num_value_heads = r.get_int("linear_num_value_heads");
  c.linear_key_head_dim = r.get_int("linear_key_head_dim");
  c.linear_value_head_dim = r.get_int("linear_value_head_dim");
  c.linear_conv_kernel_dim = r.get_int("linear_conv_kernel_dim");
  c.head_dim = r.get_int("head_dim", 256);  // Qwen3_5MoeTextConfig's default (not hidden / heads)

  // Fixed by the family: what transformers' Qwen3_5Moe classes do whatever the config says. A
  // key that says otherwise is refused rather than silently overridden.
  c.qk_norm = true;
  c.zero_centered_norm = true;
  c.attn_output_gate = true;
  c.norm_topk_prob = true;
  BB_CHECK(r.get_bool("attn_output_gate", true), "key 'attn_output_gate' in ", src,
           " is false: Qwen3_5MoeAttention always gates its output (q_proj is 2 x wide)");
  BB_CHECK(r.get_bool("norm_topk_prob", true), "key 'norm_topk_prob' in ", src,
           " is false: Qwen3_5MoeTopKRouter always renormalises the top-k probabilities");
  BB_CHECK(r.get_int("decoder_sparse_step", 1) == 1, "key 'decoder_sparse_step' in ", src,
           " is ", r.get_int("decoder_sparse_step", 1), ": every Qwen3.5 layer is MoE (use 1)");
  if (r.has("mlp_only_layers")) {
    const json& m = j.at("mlp_only_layers");
    BB_CHECK(m.is_array() && m.empty(), "key 'mlp_only_layers' in ", src, " is ", m.dump(),
             ": every Qwen3.5 layer is MoE (Qwen3_5MoeDecoderLayer has no dense MLP; use [])");
  }
  read_common_behaviour(r, c);
  if (outer_tie) {
    BB_CHECK(outer_tie->is_boolean(), "key 'tie_word_embeddings' in ", outer_src,
             " must be a boolean, got ", outer_tie->dump());
    BB_CHECK(!r.has("tie_word_embeddings") || c.tie_word_embeddings == outer_tie->get<bool>(),
             "key 'tie_word_embeddings' in ", outer_src, " (", outer_tie->dump(),
             ") disagrees with the one in ", src, " (", c.tie_word_embeddings, ")");
    c.tie_word_embeddings = outer_tie->get<bool>();
  }

  // RoPE: rope_parameters (5.x; rope_scaling of 4.x read alike), a top-level rope_theta or
  // partial_rotary_factor (transformers moves them into rope_parameters; 0.25 when absent).
  c.rope_theta = r.get_double("rope_theta", 10000.0);
  c.partial_rotary_factor = r.get_double("partial_rotary_factor", 0.25);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!r.has(key)) continue;
    const RopeSpec spec = check_rope_object(j.at(key), key, src, true);
    if (spec.theta >= 0) {
      BB_CHECK(!r.has("rope_theta") || spec.theta == c.rope_theta, "key '", key, ".rope_theta' (",
               spec.theta, ") in ", src, " disagrees with rope_theta (", c.rope_theta, ")");
      c.rope_theta = spec.theta;
    }
    if (spec.partial_rotary_factor >= 0) {
      // transformers 5.x writes both: the top-level key keeps the config class's default (0.25)
      // while rope_parameters holds the value; its rotary embedding reads
      // rope_parameters["partial_rotary_factor"] (the top level only fills a missing entry). So
      // does this loader, and it says so when the two differ.
      if (r.has("partial_rotary_factor") && spec.partial_rotary_factor != c.partial_rotary_factor) {
        std::ostringstream note;
        note << src << ": partial_rotary_factor " << spec.partial_rotary_factor << " from " << key
             << " (the value transformers uses); the top-level partial_rotary_factor "
             << c.partial_rotary_factor << " is ignored";
        c.load_notes.push_back(note.str());
      }
      c.partial_rotary_factor = spec.partial_rotary_factor;
    }
  }

  check_implemented_values(r, "Qwen3.5 attention has no biases");

  // Layer pattern: layer_types, else every full_attention_interval-th layer is full attention
  // (transformers' rule: layer i is linear_attention iff (i + 1) % interval != 0; interval 4).
  const bool has_interval = r.has("full_attention_interval");
  const int64_t interval = r.get_int("full_attention_interval", 4);
  BB_CHECK(interval >= 1, "key 'full_attention_interval' in ", src, " must be >= 1, got ", interval);
  BB_CHECK(c.num_layers > 0 && c.num_layers <= kMaxLayers, "key 'num_hidden_layers' in ", src, " is ",
           c.num_layers, ": must be in [1, ", kMaxLayers, "]");
  std::vector<LayerType> derived;
  for (int64_t i = 0; i < c.num_layers; ++i)
    derived.push_back((i + 1) % interval ? LayerType::linear_attention : LayerType::full_attention);
  if (r.has("layer_types")) {
    const json& lt = j.at("layer_types");
    if (!lt.is_array()) r.wrong_type("layer_types", "a list of strings");
    BB_CHECK(static_cast<int64_t>(lt.size()) == c.num_layers, "key 'layer_types' in ", src, " has ",
             lt.size(), " entries, expected num_hidden_layers = ", c.num_layers);
    for (const json& t : lt) {
      const std::string name = t.is_string() ? t.get<std::string>() : "";
      BB_CHECK(name == "full_attention" || name == "linear_attention", "key 'layer_types' in ", src,
               " contains ", t.dump(), ": only full_attention and linear_attention are implemented");
      c.layer_types.push_back(name == "full_attention" ? LayerType::full_attention
                                                       : LayerType::linear_attention);
    }
    BB_CHECK(!has_interval || c.layer_types == derived, "keys 'layer_types' and ",
             "'full_attention_interval' (", interval, ") in ", src,
             " describe different layer patterns; keep one of them");
  } else {
    c.layer_types = derived;
  }
  validate_parsed(c, src);
  return c;
}

// The released Qwen3_5MoeForConditionalGeneration config: the text model under text_config,
// the vision tower beside it (not part of the text model, so its keys are accepted unread).
ModelConfig parse_qwen35_outer(const json& j, const std::string& src) {
  Reader r{j, src};
  for (const auto& [key, value] : j.items()) {
    if (key == "model_type" || key == "text_config" || key == "tie_word_embeddings") continue;
    if (irrelevant_keys().count(key) || qwen35_outer_irrelevant_keys().count(key)) continue;
    BB_FAIL("unknown key '", key, "' in ", src,
            ": bumblebee does not know whether it changes the model; remove it or file an issue");
  }
  BB_CHECK(r.has("text_config"), "missing required key 'text_config' in ", src,
           " (a qwen3_5_moe config nests the text model there)");
  const json& t = j.at("text_config");
  if (!t.is_object()) r.wrong_type("text_config", "an object");
  const std::string text_src = "text_config of " + src;
  if (t.contains("model_type") && !t.at("model_type").is_null()) {
    const json& mt = t.at("model_type");
    BB_CHECK(mt.is_string() && (mt.get<std::string>() == kQwen35MoeText ||
                                mt.get<std::string>() == "qwen3_5_moe"),
             "key 'model_type' in ", text_src, " is ", mt.dump(), ": expected \"", kQwen35MoeText,
             "\"");
  }
  const json* tie = r.has("tie_word_embeddings") ? &j.at("tie_word_embeddings") : nullptr;
  return parse_qwen35_text(t, text_src, tie, src);
}

}  // namespace

ModelConfig parse_hf_config(const json& j, const std::string& src) {
  BB_CHECK(j.is_object(), "model config ", src, " must be a JSON object, got ", j.type_name());
  Reader r{j, src};
  const std::string model_type = r.get_string("model_type", "");
  BB_CHECK(!model_type.empty(), "missing required key 'model_type' in ", src);
  if (model_type == kQwen35MoeText) return parse_qwen35_text(j, src, nullptr, src);
  if (model_type == "qwen3_5_moe") return parse_qwen35_outer(j, src);
  BB_CHECK(model_type == "qwen3_moe" || model_type == "qwen2_moe", "key 'model_type' in ", src,
           " is '", model_type, "': bumblebee implements qwen3_moe, qwen2_moe, ", kQwen35MoeText,
           " and qwen3_5_moe (its text model) only");
  return parse_classic(j, src, model_type);
}

ModelConfig load_hf_config(const std::string& path_or_dir) {
  namespace fs = std::filesystem;
  fs::path path(path_or_dir);
  if (fs::is_directory(path)) path /= "config.json";
  BB_CHECK(fs::is_regular_file(path), "model config not found: ", path.string(),
           " (expected a config.json or a directory containing one)");
  const json j =
      parse_json_bounded(read_file(path.string()), "cannot parse model config " + path.string());
  return parse_hf_config(j, path.string());
}

double model_flops(const ModelConfig& c, const std::vector<int64_t>& seq_lens) {
  c.validate();
  double tokens = 0, attn_pairs = 0;  // attn_pairs = sum_i s_i^2 / 2 (causal half)
  for (int64_t s : seq_lens) {
    BB_CHECK(s >= 0, "model_flops: sequence length must be >= 0, got ", s);
    tokens += static_cast<double>(s);
    attn_pairs += static_cast<double>(s) * static_cast<double>(s) / 2;
  }
  const double linear_layers = static_cast<double>(c.num_linear_attention_layers());
  const double full_layers = static_cast<double>(c.num_layers) - linear_layers;
  const double recurrence_per_token = 6.0 * static_cast<double>(c.linear_key_head_dim) *
                                      static_cast<double>(c.linear_value_head_dim) *
                                      static_cast<double>(c.linear_num_value_heads);
  const double forward = 2.0 * static_cast<double>(c.active_matmul_params_per_token()) * tokens +
                         full_layers * 2 * 2 * attn_pairs * static_cast<double>(c.num_heads) *
                             static_cast<double>(c.head_dim) +
                         linear_layers * recurrence_per_token * tokens;
  return 3 * forward;
}

}  // namespace bb

// hf_io.h — Hugging Face checkpoints in and out: load a transformers checkpoint directory into a
// DecoderModel, and export a model (or a bumblebee training checkpoint) as a directory that
// transformers loads with from_pretrained.
//
// Names are the Hugging Face ones (DecoderModel::hf_tensors()). Inside bumblebee the experts of
// a layer are fused ([E, 2F, H] gate+up, [E, H, F] down) and so are the dense / shared-expert
// gate+up projections ([2I, H]); for Qwen3-MoE / Qwen2-MoE hf_tensors() exposes per-expert
// `gate_proj` / `up_proj` / `down_proj` slices of them (addressed by unit offsets), for Qwen3.5
// the fused tensors themselves (that family's native checkpoint layout), so reading and writing
// through those names round-trips exactly.
//
// Loading accepts both expert layouts a checkpoint can have:
//   per-expert (the classic layout; what save_pretrained writes by default for Qwen3-MoE)
//     model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight   [F, H] [F, H] [H, F]
//   fused (transformers 5 in memory, save_original_format=False, and Qwen3.5 checkpoints)
//     model.layers.L.mlp.experts.gate_up_proj   [E, 2F, H]  (rows 0..F-1 gate, F..2F-1 up)
//     model.layers.L.mlp.experts.down_proj      [E, H, F]
// chosen per layer and projection by which names the files hold (a unit holding some experts
// keeps its rows of a fused tensor). Every tensor is converted from its stored float dtype
// (f32/bf16/f16) to the parameter dtype.
//
// Qwen3.5 checkpoints come in two layouts, recognised by their names:
//   text model (Qwen3_5MoeForCausalLM, config model_type qwen3_5_moe_text): model.*, lm_head.weight
//   released (Qwen3_5MoeForConditionalGeneration, config qwen3_5_moe + text_config): the text
//     model under model.language_model.*, lm_head.weight, a vision tower model.visual.* and a
//     multi-token-prediction head mtp.*
// The vision and MTP tensors (in either layout) are not part of the text model: they are
// listed in HfLoadReport::ignored, and summary() counts them in one line. Export always writes
// the text-model layout.
//
// Loading is all-or-nothing: the config is compared first, then every expected tensor is found,
// shape-checked and read into a staging copy; all problems (missing, unexpected, misshaped,
// non-float tensors) are collected into ONE error, and the model is written only when there
// are none. Staging holds one extra copy of the weights in host memory (param dtype).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "models/decoder.h"

namespace bb {

// What a successful load did (for logs and tests).
struct HfLoadReport {
  int64_t tensors_read = 0;          // tensors read from the files
  int64_t fused_expert_tensors = 0;  // of those, fused [E, ...] expert tensors
  std::vector<std::string> ignored;  // present in the files, deliberately not loaded
  std::string language_model_prefix;  // "model.language_model." for a wrapped Qwen3.5 checkpoint
  // Per-expert tensors of experts another expert-parallel rank holds (skipped, not a problem).
  int64_t other_ranks_expert_tensors = 0;
  // One log line: what was read, and the ignored tensors grouped ("...; ignored 351: 15 mtp.*
  // (multi-token prediction head), 333 model.visual.* (vision tower), 3 rotary ...").
  std::string summary() const;
};

// Loads the weights of the Hugging Face checkpoint in `dir` into `model`:
//   dir/config.json must describe the same model (parse_hf_config(...) == model.config());
//     otherwise the error names every differing config.json key with both values.
//   dir/model.safetensors or dir/model.safetensors.index.json + shards (SafetensorsDir).
// Ignored without complaint: rotary `inv_freq` buffers (`...rotary_emb.inv_freq`), which are
// recomputed; with tied embeddings an `lm_head.weight` equal to the embedding (a different one
// is an error); for Qwen3.5 the `model.visual.*` and `mtp.*` tensors. Any other tensor the model
// does not have is "unexpected".
// Throws bb::Error (model untouched) on any mismatch. Gradients are not touched.
// f32_units: when given, one [numel] f32 tensor per parameter unit (model.units() order, e.g.
// the optimizer's fp32 master weights) that receives the checkpoint's values converted to f32
// from their stored dtype, not from the (possibly bf16-rounded) parameters; staging then holds
// an f32 host copy of the weights.
HfLoadReport load_hf_weights(DecoderModel& model, const std::string& dir,
                             std::vector<Tensor>* f32_units = nullptr);

// A sharded start from a Hugging Face checkpoint: the same checks, but only elements
// [lo, lo + len) of each unit (ranges[u], model.units() order) are kept, as f32, in
// (*f32_ranges)[u] ([len], on `dev`); the model's own buffers are not touched (it may have been
// built with ModelOptions::defer_values). Host staging holds the kept ranges plus one tensor at
// a time, never the whole checkpoint; still nothing is written before every read succeeded.
HfLoadReport load_hf_weight_ranges(DecoderModel& model, const std::string& dir,
                                   const std::vector<std::pair<int64_t, int64_t>>& ranges, Device dev,
                                   std::vector<Tensor>* f32_ranges);

struct HfExportOptions {
  DType dtype = DType::bf16;                 // f32 or bf16 (f16 also accepted)
  uint64_t max_shard_bytes = 5'000'000'000;  // per shard file (HF's default "5GB")
  bool allow_nonfinite = false;  // false: a weight holding Inf/NaN is an error naming it
};

// Writes `dir` (created if missing) so that transformers' from_pretrained loads it:
//   config.json              ModelConfig::to_hf_json() with "torch_dtype" set to opts.dtype
//   generation_config.json   {"bos_token_id", "eos_token_id"} (those the config has)
//   model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json when
//   the tensors exceed max_shard_bytes (write_sharded_safetensors; metadata {"format": "pt"}).
// Tensors are the names of hf_tensors() (per-expert for Qwen3-MoE / Qwen2-MoE, fused experts
// for Qwen3.5), converted to opts.dtype. The model must hold every expert.
void export_hf(DecoderModel& model, const std::string& dir, const HfExportOptions& opts = {});
// The same files from a list of whole HF tensors (hf_tensors() of a model, which may hold no
// values) and `value(i)`, tensor i's values in any float dtype, asked for once each as its file
// is written: host memory holds one weight at a time (`bumblebee export` reads each from the
// checkpoint's shards).
void export_hf_streamed(const ModelConfig& config, const std::vector<HfTensor>& tensors,
                        const std::function<Tensor(size_t)>& value, const std::string& dir,
                        const HfExportOptions& opts = {});

// `bumblebee export`: builds the model a training checkpoint step directory describes
// (STEP/config.json, as the trainer writes it), loads STEP/model.safetensors through
// load_hf_weights and export_hf's it to `out_dir`. With opts.dtype f32 and the step's
// optimizer.safetensors present, the weights written are the optimizer's fp32 master weights
// (`<param>.master`), not the parameters (bf16 in a GPU run). The caller resolves a checkpoint
// root to its step directory (resolve_checkpoint in runtime/trainer.h). Returns step_dir.
std::string export_checkpoint(const std::string& step_dir, const std::string& out_dir,
                              const HfExportOptions& opts = {});

// "5GB", "500MB", "1.5GiB", "64KiB", "1000" (bytes): decimal units KB/MB/GB/TB = 1000^n and
// binary units KiB/MiB/GiB/TiB = 1024^n, case-insensitive, optional "B". Throws on anything
// else or on 0.
uint64_t parse_byte_size(const std::string& text);

// The model's Hugging Face tensors as (name, view of the values): what a checkpoint file holds.
std::vector<std::pair<std::string, Tensor>> hf_state(DecoderModel& model);

// One Hugging Face-named tensor with its gradient: `value` is the hf_tensors() view and `grad`
// the same slice of the unit's gradient (f32). For comparing against reference dumps.
struct HfNamedParam {
  std::string name;
  Tensor value;
  Tensor grad;
};
std::vector<HfNamedParam> hf_named_params(DecoderModel& model);

}  // namespace bb

// hf_io.cpp — Hugging Face checkpoint load (staged, all-or-nothing) and export. See hf_io.h.
#include "models/hf_io.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "io/fs.h"
#include "io/safetensors.h"

namespace bb {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "model.layers.3.mlp.experts.17.up_proj.weight" -> "model.layers.3.mlp.experts.gate_up_proj":
// the fused tensor a per-expert name is a slice of; "" for any other name.
std::string fused_group_of(const std::string& name) {
  const std::string key = "mlp.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return "";
  size_t i = at + key.size();
  const size_t digits = i;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == digits || i >= name.size() || name[i] != '.') return "";
  const std::string prefix = name.substr(0, at + key.size());
  const std::string rest = name.substr(i + 1);
  if (rest == "gate_proj.weight" || rest == "up_proj.weight") return prefix + "gate_up_proj";
  if (rest == "down_proj.weight") return prefix + "down_proj";
  return "";
}

// Buffers the model does not keep as parameters (recomputed from the config).
bool is_ignored_buffer(const std::string& name) {
  return ends_with(name, "rotary_emb.inv_freq");
}

// Every config.json key whose value differs, as " key (checkpoint X, model Y)".
std::string config_diff(const ModelConfig& file, const ModelConfig& run) {
  const nlohmann::json a = file.to_hf_json(), b = run.to_hf_json();
  std::set<std::string> keys;
  for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
  for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
  std::string out;
  for (const std::string& k : keys) {
    const std::string va = a.contains(k) ? a[k].dump() : "absent";
    const std::string vb = b.contains(k) ? b[k].dump() : "absent";
    if (va != vb) out += "\n  " + k + ": checkpoint " + va + ", model " + vb;
  }
  // Fields that to_hf_json does not spell out (e.g. the family flags) still differ somewhere.
  return out.empty() ? "\n  (fields derived from the model type differ)" : out;
}

// Problems found while matching the files against the model, reported together.
struct Problems {
  std::vector<std::string> missing, unexpected, shape, dtype;
  size_t count() const { return missing.size() + unexpected.size() + shape.size() + dtype.size(); }
  static void list(std::string& out, const char* what, const std::vector<std::string>& v) {
    if (v.empty()) return;
    constexpr size_t kMaxListed = 20;
    out += "\n  " + std::string(what) + " (" + std::to_string(v.size()) + "):";
    for (size_t i = 0; i < v.size() && i < kMaxListed; ++i) out += "\n    " + v[i];
    if (v.size() > kMaxListed)
      out += "\n    ... and " + std::to_string(v.size() - kMaxListed) + " more";
  }
  std::string str() const {
    std::string out;
    list(out, "missing from the checkpoint", missing);
    list(out, "unexpected (in the checkpoint, not in the model)", unexpected);
    list(out, "wrong shape", shape);
    list(out, "not a float tensor", dtype);
    return out;
  }
};

const char* hf_dtype_name(DType dt) {
  switch (dt) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      BB_FAIL("export: dtype ", dtype_name(dt), " is not a float type (use f32 or bf16)");
  }
}

}  // namespace

std::string HfLoadReport::summary() const {
  // Group the ignored names so that a vision tower of hundreds of tensors is one clause.
  std::map<std::string, int64_t> groups;
  for (const std::string& n : ignored) {
    if (n.rfind("model.visual.", 0) == 0) ++groups["model.visual.* (vision tower)"];
    else if (n.rfind("mtp.", 0) == 0) ++groups["mtp.* (multi-token prediction head)"];
    else if (ends_with(n, "rotary_emb.inv_freq")) ++groups["rotary inv_freq buffers (recomputed)"];
    else if (ends_with(n, "lm_head.weight")) ++groups["lm_head.weight (tied, equal to the embedding)"];
    else ++groups["other"];
  }
  std::string out = "read " + std::to_string(tensors_read) + " tensors";
  if (fused_expert_tensors > 0)
    out += " (" + std::to_string(fused_expert_tensors) + " fused expert tensors)";
  if (!language_model_prefix.empty()) out += " under " + language_model_prefix + "*";
  if (other_ranks_expert_tensors > 0)
    out += "; " + std::to_string(other_ranks_expert_tensors) +
           " expert tensors left to the other expert-parallel ranks";
  out += "; ignored " + std::to_string(ignored.size());
  const char* sep = ": ";
  for (const auto& [what, n] : groups) {
    out += sep + std::to_string(n) + " " + what;
    sep = ", ";
  }
  return out;
}

namespace {

// The checkpoint names of a model name: Qwen3_5MoeForConditionalGeneration files keep the text
// model under model.language_model.* (lm_head.weight stays at the top).
struct FileNames {
  std::string lm_prefix;  // "" or "model.language_model."
  std::string of(const std::string& model_name) const {
    if (lm_prefix.empty() || model_name.rfind("model.", 0) != 0) return model_name;
    return lm_prefix + model_name.substr(6);
  }
};

// Tensors of a Qwen3.5 checkpoint that are not part of the text model: transformers'
// Qwen3_5MoeForCausalLM ignores them on load too (_keys_to_ignore_on_load_unexpected).
bool is_qwen35_non_text(const std::string& name) {
  return name.rfind("model.visual.", 0) == 0 || name.rfind("mtp.", 0) == 0;
}

}  // namespace

namespace {

// load_hf_weights (ranges == nullptr) or load_hf_weight_ranges.
HfLoadReport load_hf(DecoderModel& model, const std::string& dir, std::vector<Tensor>* f32_units,
                     const std::vector<std::pair<int64_t, int64_t>>* ranges, Device range_dev,
                     std::vector<Tensor>* f32_ranges) {
  const std::string what = "load_hf_weights(" + dir + ")";
  BB_CHECK(is_directory(dir), what, ": not a directory");
  const std::string cfg_path = path_join(dir, "config.json");
  BB_CHECK(path_exists(cfg_path), what, ": no config.json (a Hugging Face checkpoint directory ",
           "holds config.json and model.safetensors or model.safetensors.index.json)");
  const ModelConfig file_cfg = load_hf_config(cfg_path);
  if (!(file_cfg == model.config()))
    BB_FAIL(what, ": config.json describes a different model than the one being loaded into ",
            "(set model.config to this checkpoint's config.json):",
            config_diff(file_cfg, model.config()));
  const ModelConfig& cfg = model.config();
  SafetensorsDir files(dir);

  // Qwen3.5 checkpoints come as the text model (Qwen3_5MoeForCausalLM: model.*) or wrapped
  // with a vision tower (Qwen3_5MoeForConditionalGeneration: model.language_model.*).
  FileNames fn;
  if (cfg.is_qwen35())
    for (const std::string& n : files.names())
      if (n.rfind("model.language_model.", 0) == 0) {
        fn.lm_prefix = "model.language_model.";
        break;
      }

  // Which expert tensors the files hold fused: a per layer and projection choice, keyed by the
  // model's fused parameter name. Native-fused families (Qwen3.5) read the per-expert names
  // only when the files hold them and not the fused tensor.
  std::set<std::string> fused, fused_files;
  for (Param* p : model.params()) {
    if (p->hf != HfSplit::experts_gate_up && p->hf != HfSplit::experts_down) continue;
    const std::string file_name = fn.of(p->name);
    const std::string base = p->name.substr(0, p->name.rfind('.') + 1);  // "...mlp.experts."
    const std::string probe = fn.of(base + std::to_string(p->unit->first_expert) +
                                    (p->hf == HfSplit::experts_down ? ".down_proj.weight"
                                                                    : ".gate_proj.weight"));
    if (files.has(file_name) || (cfg.hf_fused_experts() && !files.has(probe))) {
      fused.insert(p->name);
      fused_files.insert(file_name);
    }
  }

  // Targets: checkpoint name -> where it goes in the model (a parameter slice).
  std::vector<ParamUnit*> units = model.units();
  if (ranges) {
    BB_CHECK(ranges->size() == units.size() && f32_ranges, what, ": ", ranges->size(), " ranges for ", units.size(),
             " parameter units");
    for (size_t u = 0; u < units.size(); ++u) {
      const auto [lo, len] = (*ranges)[u];
      BB_CHECK(lo >= 0 && len >= 0 && lo + len <= units[u]->numel, what, ": range [", lo, ", ", lo + len,
               ") is outside unit ", units[u]->name, " (", units[u]->numel, " elements)");
    }
  }
  if (f32_units) {
    BB_CHECK(f32_units->size() == units.size(), what, ": ", f32_units->size(),
             " f32 targets for ", units.size(), " parameter units");
    for (size_t u = 0; u < units.size(); ++u)
      BB_CHECK((*f32_units)[u].dtype() == DType::f32 && (*f32_units)[u].numel() == units[u]->numel,
               what, ": the f32 target of unit ", units[u]->name, " is ", (*f32_units)[u].str(),
               ", expected f32[", units[u]->numel, "]");
  }
  struct Target {
    std::string model_name, name;  // the HF name in the model, and in the files
    Tensor dst;            // the parameter slice (undefined in ranges mode)
    Tensor dst_f32;        // the same slice of the unit's f32 target, when asked for
    Shape file_shape;      // what the file must hold
    int64_t first_row = 0;  // rows [first_row, first_row + rows of shape) of it go into dst
    size_t unit = 0;        // ranges mode: the unit, and the elements [elem_lo, + numel) it fills
    int64_t elem_lo = 0;
    Shape shape;
  };
  auto target = [&](const HfTensor& t) {
    Target g{t.name, fn.of(t.name), Tensor(), {}, t.shape, t.hf_first_row,
             static_cast<size_t>(t.param->unit->index), t.param->offset + t.offset, t.shape};
    if (!ranges) g.dst = unit_slice(t.param->unit->value, *t.param, t.offset, t.shape);
    g.file_shape[0] = t.hf_num_rows;
    if (f32_units)
      g.dst_f32 = unit_slice((*f32_units)[static_cast<size_t>(t.param->unit->index)], *t.param,
                             t.offset, t.shape);
    return g;
  };
  std::vector<Target> targets;
  for (const HfTensor& t : model.hf_tensors(HfExperts::per_expert))
    if (!fused.count(t.param->name)) targets.push_back(target(t));
  for (const HfTensor& t : model.hf_tensors(HfExperts::fused))
    if (fused.count(t.name)) targets.push_back(target(t));

  Problems pr;
  std::set<std::string> claimed;
  for (const Target& t : targets) {
    claimed.insert(t.name);
    if (!files.has(t.name)) {
      pr.missing.push_back(t.name);
      continue;
    }
    const SafetensorsEntry& e = files.entry(t.name);
    if (!is_floating(e.dtype))
      pr.dtype.push_back(t.name + " (" + safetensors_dtype_name(e.dtype) + ")");
    else if (e.shape != t.file_shape)
      pr.shape.push_back(t.name + ": checkpoint " + shape_str(e.shape) + ", model expects " +
                         shape_str(t.file_shape));
  }
  HfLoadReport report;
  report.language_model_prefix = fn.lm_prefix;
  // Per-expert tensors of experts this model does not hold (expert parallelism: another EP rank
  // holds them) belong to the checkpoint, not to the problems.
  struct Held {
    std::string base;  // "model.layers.L.mlp.experts." as the files name it
    int64_t first = 0, num = 0;
  };
  std::vector<Held> held;
  for (Param* p : model.params())
    if (p->hf == HfSplit::experts_gate_up && p->unit->num_experts < cfg.num_experts)
      held.push_back({fn.of(p->name.substr(0, p->name.rfind('.') + 1)), p->unit->first_expert, p->unit->num_experts});
  auto other_ranks_expert = [&](const std::string& name) {
    for (const Held& h : held) {
      if (name.rfind(h.base, 0) != 0) continue;
      const std::string rest = name.substr(h.base.size());
      const size_t dot = rest.find('.');
      if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789") != dot) continue;
      const std::string proj = rest.substr(dot + 1);
      if (proj != "gate_proj.weight" && proj != "up_proj.weight" && proj != "down_proj.weight") continue;
      if (dot > 9) continue;
      const int64_t e = std::stoll(rest.substr(0, dot));
      if (e < cfg.num_experts && (e < h.first || e >= h.first + h.num)) return true;
    }
    return false;
  };
  bool tied_head_in_file = false;
  for (const std::string& name : files.names()) {
    if (claimed.count(name)) continue;
    if (other_ranks_expert(name)) {
      ++report.other_ranks_expert_tensors;
      continue;
    }
    if (is_ignored_buffer(name) || (cfg.is_qwen35() && is_qwen35_non_text(name))) {
      report.ignored.push_back(name);
    } else if (cfg.tie_word_embeddings && name == "lm_head.weight") {
      tied_head_in_file = true;  // checked against the embedding below
      report.ignored.push_back(name);
    } else {
      std::string note;
      if (const std::string g = fused_group_of(name); !g.empty() && fused_files.count(g))
        note = " (the checkpoint also holds the fused " + g + ")";
      pr.unexpected.push_back(name + note);
    }
  }
  if (pr.count() > 0)
    BB_FAIL(what, ": the checkpoint does not fit the model (", pr.count(),
            " problem(s); nothing was loaded):", pr.str());

  // Stage every tensor on the host (in the parameter dtype, or f32 for f32 targets); the model
  // is untouched until all reads succeeded. A unit holding some experts keeps only its rows.
  // In ranges mode only the part of each tensor inside its unit's kept range stays staged
  // (kept_at: the unit element it starts at), so the host holds the ranges plus one tensor.
  std::vector<Tensor> staged;
  std::vector<int64_t> kept_at;
  staged.reserve(targets.size());
  const Tensor head =
      tied_head_in_file ? files.read_as("lm_head.weight", DType::f32, MemCategory::other) : Tensor();
  for (const Target& t : targets) {
    Tensor v = files.read_as(t.name, f32_units || ranges ? DType::f32 : t.dst.dtype(), MemCategory::other);
    if (v.size(0) != t.shape[0]) v = v.narrow(t.first_row, t.shape[0]).clone(MemCategory::other);
    if (tied_head_in_file && t.model_name == "model.embed_tokens.weight") {
      const Tensor e = v.dtype() == DType::f32 ? v : v.to_dtype(DType::f32);
      BB_CHECK(head.shape() == e.shape() && head.to_floats() == e.to_floats(), what,
               ": tie_word_embeddings is true but lm_head.weight differs from ", t.name, " (nothing was loaded)");
    }
    if (!ranges) {
      staged.push_back(v);
      continue;
    }
    const auto [lo, len] = (*ranges)[t.unit];
    const int64_t a = std::max(lo, t.elem_lo), b = std::min(lo + len, t.elem_lo + v.numel());
    staged.push_back(a < b ? v.view({v.numel()}).narrow(a - t.elem_lo, b - a).clone(MemCategory::other) : Tensor());
    kept_at.push_back(a);
  }
  if (ranges) {
    f32_ranges->assign(units.size(), Tensor());
    for (size_t u = 0; u < units.size(); ++u)  // zeros: the alignment padding stays zero
      (*f32_ranges)[u] = Tensor::zeros({(*ranges)[u].second}, DType::f32, range_dev, MemCategory::optimizer);
    for (size_t i = 0; i < targets.size(); ++i) {
      if (staged[i].defined()) {
        const size_t u = targets[i].unit;
        (*f32_ranges)[u].narrow(kept_at[i] - (*ranges)[u].first, staged[i].numel()).copy_from(staged[i].to(range_dev));
      }
      ++report.tensors_read;
      if (fused.count(targets[i].model_name)) ++report.fused_expert_tensors;
    }
    return report;
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (f32_units) targets[i].dst_f32.copy_from(staged[i]);
    targets[i].dst.copy_from(staged[i].dtype() == targets[i].dst.dtype()
                                 ? staged[i]
                                 : staged[i].to_dtype(targets[i].dst.dtype()));
    ++report.tensors_read;
    if (fused.count(targets[i].model_name)) ++report.fused_expert_tensors;
  }
  return report;
}

}  // namespace

HfLoadReport load_hf_weights(DecoderModel& model, const std::string& dir, std::vector<Tensor>* f32_units) {
  return load_hf(model, dir, f32_units, nullptr, Device::cpu(), nullptr);
}

HfLoadReport load_hf_weight_ranges(DecoderModel& model, const std::string& dir,
                                   const std::vector<std::pair<int64_t, int64_t>>& ranges, Device dev,
                                   std::vector<Tensor>* f32_ranges) {
  return load_hf(model, dir, nullptr, &ranges, dev, f32_ranges);
}

void export_hf(DecoderModel& model, const std::string& dir, const HfExportOptions& opts) {
  const std::vector<HfTensor> tensors = model.hf_tensors();
  export_hf_streamed(model.config(), tensors, [&](size_t i) { return tensors[i].value(); }, dir, opts);
}

void export_hf_streamed(const ModelConfig& config, const std::vector<HfTensor>& tensors,
                        const std::function<Tensor(size_t)>& value, const std::string& dir,
                        const HfExportOptions& opts) {
  const char* torch_dtype = hf_dtype_name(opts.dtype);
  BB_CHECK(opts.max_shard_bytes > 0, "export: max shard size must be > 0");
  make_dirs(dir);
  std::vector<TensorSpec> specs;
  for (const HfTensor& t : tensors) {
    BB_CHECK(t.whole(), "export: ", t.name, " holds experts ", t.hf_first_row, "..",
             t.hf_first_row + t.shape[0] - 1, " of ", t.hf_num_rows,
             ": export a model that holds every expert (bumblebee export consolidates a "
             "training checkpoint into one)");
    specs.push_back({t.name, t.shape, opts.dtype});
  }
  // Each weight is made, checked and converted when its file gets to it: host memory holds one
  // weight (in its dtype and the export's), not the model.
  write_sharded_safetensors(dir, specs, [&](size_t i) {
    const std::string& name = tensors[i].name;
    Tensor t = value(i);
    Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu(), MemCategory::other);
    if (!opts.allow_nonfinite) {
      const int64_t k = first_nonfinite(h);
      BB_CHECK(k < 0, "export: ", name, " holds a non-finite value (", h.view({-1}).narrow(k, 1).to_floats()[0],
               " at element ", k, "); nothing was written. Export an earlier checkpoint, or pass --allow-nonfinite to ",
               "write it anyway");
    }
    if (h.dtype() != opts.dtype) h = h.to_dtype(opts.dtype, MemCategory::other);
    return h;
  }, opts.max_shard_bytes, {{"format", "pt"}});

  nlohmann::json cfg = config.to_hf_json();
  cfg["torch_dtype"] = torch_dtype;
  atomic_write(path_join(dir, "config.json"), cfg.dump(2) + "\n");
  nlohmann::json gen = nlohmann::json::object();
  if (config.bos_token_id >= 0) gen["bos_token_id"] = config.bos_token_id;
  if (config.eos_token_id >= 0) gen["eos_token_id"] = config.eos_token_id;
  atomic_write(path_join(dir, "generation_config.json"), gen.dump(2) + "\n");
}

std::string export_checkpoint(const std::string& step_dir, const std::string& out_dir,
                              const HfExportOptions& opts) {
  BB_CHECK(path_exists(path_join(step_dir, "model.safetensors")), "export: ", step_dir,
           " is not a bumblebee checkpoint step directory (no model.safetensors)");
  const ModelConfig cfg = load_hf_config(path_join(step_dir, "config.json"));
  DecoderModel model(cfg, ModelOptions{}, 0);  // CPU f32; every weight is overwritten below
  load_hf_weights(model, step_dir);
  const std::string opt_path = path_join(step_dir, "optimizer.safetensors");
  if (opts.dtype == DType::f32 && path_exists(opt_path)) {
    // The fp32 master weights, not the (bf16 in a GPU run) parameters: all read first.
    SafetensorsReader opt(opt_path);
    std::vector<Tensor> masters;
    for (Param* p : model.params()) {
      const std::string name = p->name + ".master";
      BB_CHECK(opt.has(name), "export: ", opt_path, " has no ", name,
               " (export with --dtype bf16 to write the parameters instead)");
      Tensor m = opt.read(name, MemCategory::other);
      BB_CHECK(m.dtype() == DType::f32 && m.shape() == p->shape, "export: ", opt_path, ": ", name,
               " is ", m.str(), ", expected f32", shape_str(p->shape));
      masters.push_back(m);
    }
    std::vector<Param*> ps = model.params();
    for (size_t i = 0; i < ps.size(); ++i) ps[i]->value.copy_from(masters[i]);
  }
  export_hf(model, out_dir, opts);
  return step_dir;
}

uint64_t parse_byte_size(const std::string& text) {
  std::string s;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch))) s += static_cast<char>(std::tolower(ch));
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  const std::string num = s.substr(0, i), unit = s.substr(i);
  static const std::map<std::string, double> kUnits = {{"", 1},
                                                       {"b", 1},
                                                       {"kb", 1e3},
                                                       {"mb", 1e6},
                                                       {"gb", 1e9},
                                                       {"tb", 1e12},
                                                       {"k", 1e3},
                                                       {"m", 1e6},
                                                       {"g", 1e9},
                                                       {"t", 1e12},
                                                       {"kib", 1024.0},
                                                       {"mib", 1048576.0},
                                                       {"gib", 1073741824.0},
                                                       {"tib", 1099511627776.0}};
  double v = 0;
  bool ok = !num.empty() && std::count(num.begin(), num.end(), '.') <= 1 && num != "." &&
            kUnits.count(unit);
  if (ok) {
    v = std::stod(num) * kUnits.at(unit);
    ok = v >= 1 && std::isfinite(v) && v < 1.8e19;
  }
  BB_CHECK(ok, "bad size '", text, "': expected a positive number with an optional unit, e.g. ",
           "5GB, 500MB, 2GiB or 1000 (bytes)");
  return static_cast<uint64_t>(std::llround(v));
}

std::vector<std::pair<std::string, Tensor>> hf_state(DecoderModel& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const HfTensor& t : model.hf_tensors()) out.emplace_back(t.name, t.value());
  return out;
}

std::vector<HfNamedParam> hf_named_params(DecoderModel& model) {
  model.param_store().materialize_grads();  // lazily zeroed gradients a backward did not write
  std::vector<HfNamedParam> out;
  for (const HfTensor& t : model.hf_tensors()) out.push_back({t.name, t.value(), t.grad()});
  return out;
}

}  // namespace bb

// checkpoint.cpp — unit tables, shard indexes and the export of distributed checkpoints
// (checkpoint.h).
#include "runtime/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "io/fs.h"
#include "io/json_limits.h"
#include "runtime/data.h"
#include "runtime/state.h"

namespace bb {

std::string checkpoint_optimizer(const nlohmann::json& state) {
  const auto it = state.find("optimizer");
  return it != state.end() && it->is_string() ? it->get<std::string>() : std::string("adamw");
}

void check_checkpoint_optimizer(const nlohmann::json& state, const std::string& run_optimizer,
                                const std::string& dir) {
  const std::string saved = checkpoint_optimizer(state);
  if (saved == run_optimizer) return;
  auto moments = [&](const std::string& name) -> std::string {
    for (const auto& m : optimizer_family().members())
      if (m.name == name) return std::string(dtype_name(moment_dtype(m.value))) + " moments";
    return "an optimizer this build does not know";
  };
  BB_FAIL("checkpoint ", dir, " was written with primitives.optimizer = '", saved, "' (", moments(saved),
          ") but this run uses '", run_optimizer, "' (", moments(run_optimizer),
          "); a resume does not convert optimizer state. Resume with primitives.optimizer = \"", saved,
          "\", or start a new run from the checkpoint's weights (`bumblebee export --checkpoint ", dir,
          " --out DIR --dtype f32`, then model.init = \"hf:DIR\"; the moments restart at zero)");
}

nlohmann::json unit_table(const std::vector<ParamUnit*>& units) {
  nlohmann::json t = nlohmann::json::array();
  for (const ParamUnit* u : units) {
    nlohmann::json ps = nlohmann::json::array();
    for (const Param* p : u->params) ps.push_back({{"name", p->name}, {"offset", p->offset}, {"shape", p->shape}});
    t.push_back({{"name", u->name}, {"numel", u->numel}, {"decay_numel", u->decay_numel},
                 {"first_expert", u->first_expert}, {"params", ps}});
  }
  return t;
}

void check_unit_table(const nlohmann::json& table, const std::vector<ParamUnit*>& units,
                      const std::string& dir) {
  const nlohmann::json mine = unit_table(units);
  BB_CHECK(table.is_array(), "checkpoint ", dir, ": state.json has no unit table");
  BB_CHECK(table.size() == mine.size(), "checkpoint ", dir, " has ", table.size(), " parameter units, the model ",
           mine.size(), " (written for a different model)");
  for (size_t i = 0; i < mine.size(); ++i) {
    if (table[i] == mine[i]) continue;
    const std::string name = mine[i]["name"].get<std::string>();
    for (const char* key : {"name", "numel", "decay_numel", "first_expert", "params"})
      BB_CHECK(table[i].contains(key) && table[i][key] == mine[i][key], "checkpoint ", dir, ": unit ", i, " (", name,
               ") differs in '", key, "' (checkpoint ", table[i].contains(key) ? table[i][key].dump() : "absent",
               ", model ", mine[i][key].dump().substr(0, 200), "): written for a different model or layout");
  }
}

nlohmann::json read_checkpoint_state(const std::string& dir) {
  const std::string path = path_join(dir, "state.json");
  BB_CHECK(path_exists(path), "checkpoint ", dir, " has no state.json");
  return parse_checkpoint_state(read_file(path), dir);
}

nlohmann::json parse_checkpoint_state(std::string_view text, const std::string& dir) {
  const nlohmann::json st = parse_json_bounded(text, "checkpoint " + dir + ": state.json");
  BB_CHECK(st.is_object(), "checkpoint ", dir, ": state.json is not a JSON object");
  const auto ver = st.find("format_version");
  const int64_t version = ver != st.end() && ver->is_number_integer() ? ver->get<int64_t>() : 0;
  BB_CHECK(version == kCheckpointFormat, "checkpoint ", dir, " has format_version ", version, "; this build reads ",
           kCheckpointFormat, " (version 1 checkpoints, from before distributed state, can be exported to a "
           "Hugging Face directory with `bumblebee export` and loaded with model.init = \"hf:DIR\")");
  for (const char* key : {"step", "data_position", "model_config", "units", "shards", "layout"})
    BB_CHECK(st.contains(key), "checkpoint ", dir, ": state.json lacks '", key, "'");
  auto bad = [&](const char* key, const char* want) {
    BB_FAIL("checkpoint ", dir, ": state.json field '", key, "' must be ", want, " (got ", st[key].dump().substr(0, 80),
            ")");
  };
  if (!st["step"].is_number_integer() || st["step"].get<int64_t>() < 0) bad("step", "an integer >= 0");
  if (!st["model_config"].is_object()) bad("model_config", "an object");
  if (!st["units"].is_array()) bad("units", "an array");
  if (!st["layout"].is_object()) bad("layout", "an object");
  if (!st["shards"].is_array() || st["shards"].empty()) bad("shards", "a non-empty array of file names");
  for (const auto& f : st["shards"])
    if (!f.is_string()) bad("shards", "a non-empty array of file names");
  if (st.contains("run_id") && !st["run_id"].is_string()) bad("run_id", "a string");
  if (st.contains("seed") && !st["seed"].is_number_unsigned()) bad("seed", "an integer >= 0");
  if (st.contains("optimizer") && !st["optimizer"].is_string()) bad("optimizer", "a string");
  for (const char* key : {"dp", "grad_accum"}) {
    const auto it = st["layout"].find(key);
    BB_CHECK(it == st["layout"].end() ||
                 (it->is_number_integer() && it->get<int64_t>() >= 1 && it->get<int64_t>() <= (int64_t{1} << 20)),
             "checkpoint ", dir, ": state.json field 'layout.", key, "' must be an integer in [1, 2^20]");
  }
  try {
    (void)st["data_position"].get<DataPosition>();
  } catch (const std::exception& e) {
    BB_FAIL("checkpoint ", dir, ": state.json field 'data_position': ", e.what());
  }
  return st;
}

ShardSet::ShardSet(const std::string& dir, const nlohmann::json& state) : dir_(dir) {
  for (const auto& f : state["shards"]) {
    const std::string name = f.get<std::string>();
    BB_CHECK(name.find("..") == std::string::npos && !name.empty() && name[0] != '/', "checkpoint ", dir,
             ": bad shard file name '", name, "'");
    auto file = std::make_shared<SafetensorsReader>(path_join(dir, name));
    for (const auto& [unit, range] : file->metadata()) {
      if (unit == "format" || unit == "rank" || unit == "world") continue;
      long long lo = -1, len = -1;
      BB_CHECK(std::sscanf(range.c_str(), "%lld %lld", &lo, &len) == 2 && lo >= 0 && len >= 0, "checkpoint ", dir,
               ": shard ", name, " has a bad range '", range, "' for unit ", unit);
      if (len > 0) pieces_[unit].push_back({file, lo, len});
    }
  }
}

Tensor ShardSet::read(const std::string& unit, const std::string& which, int64_t lo, int64_t len,
                      DType dtype) const {
  Tensor out = Tensor::zeros({len}, dtype, Device::cpu(), MemCategory::other);
  if (len == 0) return out;
  int64_t covered = 0;
  auto it = pieces_.find(unit);
  if (it != pieces_.end()) {
    for (const Piece& p : it->second) {
      const int64_t a = std::max(lo, p.lo), b = std::min(lo + len, p.lo + p.len);
      if (a >= b) continue;
      const std::string name = unit + "." + which;
      BB_CHECK(p.file->has(name), "checkpoint ", dir_, ": ", p.file->path(), " lacks ", name);
      Tensor t = p.file->read(name, MemCategory::other);
      BB_CHECK(t.dtype() == dtype && t.numel() == p.len, "checkpoint ", dir_, ": ", p.file->path(), ": ", name,
               " is ", t.str(), ", expected ", dtype_name(dtype), "[", p.len, "]");
      out.narrow(a - lo, b - a).copy_from(t.narrow(a - p.lo, b - a));
      covered += b - a;
    }
  }
  BB_CHECK(covered == len, "checkpoint ", dir_, ": the shard files cover ", covered, " of elements [", lo, ", ",
           lo + len, ") of unit ", unit, " (", which, "); a shard file is missing or truncated");
  if (check_finite_) {
    const std::vector<float> widened = dtype == DType::f32 ? std::vector<float>() : out.to_floats();
    const float* v = dtype == DType::f32 ? out.data<float>() : widened.data();
    for (int64_t k = 0; k < len; ++k)
      BB_CHECK(std::isfinite(v[k]), "checkpoint ", dir_, ": ", unit, ".", which, " holds a non-finite value (", v[k],
               " at element ", lo + k, "); it cannot be resumed. Resume from an earlier checkpoint");
  }
  return out;
}

void export_distributed_checkpoint(const std::string& step_dir, const std::string& out_dir,
                                   const HfExportOptions& opts) {
  const nlohmann::json st = read_checkpoint_state(step_dir);
  const ModelConfig cfg = parse_hf_config(st["model_config"], step_dir + "/state.json");
  DecoderModel model(cfg, ModelOptions{}, 0);  // CPU f32; every weight is overwritten below
  std::vector<ParamUnit*> units = model.units();
  check_unit_table(st["units"], units, step_dir);
  ShardSet shards(step_dir, st);
  shards.set_check_finite(false);  // export_hf checks the weights it writes (or not: --allow-nonfinite)
  for (ParamUnit* u : units) {
    // The whole unit (padding included, which is zero) at full precision.
    u->value.copy_from(shards.read(u->name, "master", 0, u->numel));
  }
  export_hf(model, out_dir, opts);
}

}  // namespace bb

// checkpoint.cpp — unit tables, shard indexes and the export of distributed checkpoints
// (checkpoint.h).
#include "runtime/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <set>

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
  // adamw and adamw_offload hold the same state (an f32 master and f32 moments), only in
  // different memory: either resumes the other's checkpoints.
  auto f32_adamw = [](const std::string& n) { return n == "adamw" || n == "adamw_offload"; };
  if (f32_adamw(saved) && f32_adamw(run_optimizer)) return;
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

GlobalUnit global_unit(const ParamUnit& u, int64_t num_experts) {
  GlobalUnit g;
  const bool split = u.kind == UnitKind::experts && num_experts > 0 && u.num_experts != num_experts;
  std::vector<int64_t> numels;
  std::vector<bool> decay;
  for (const Param* p : u.params) {
    Shape shape = p->shape;
    if (split) {
      BB_CHECK(!shape.empty() && shape[0] == u.num_experts, "checkpoint: expert parameter ", p->name, " has shape ",
               shape_str(shape), " but its unit holds ", u.num_experts, " experts");
      shape[0] = num_experts;
    }
    g.params.push_back({p->name, shape, 0});
    numels.push_back(shape_numel(shape));
    decay.push_back(p->decay);
  }
  const UnitLayout l = lay_out_unit(numels, decay);
  g.numel = l.numel;
  g.decay_numel = l.decay_numel;
  for (size_t i = 0; i < u.params.size(); ++i) {
    const Param& p = *u.params[i];
    g.params[i].offset = l.offsets[i];
    const int64_t per_expert = split ? p.numel() / p.shape[0] : 0;
    g.param_runs.push_back({p.offset, l.offsets[i] + (split ? u.first_expert * per_expert : 0), p.numel()});
  }
  g.identity = !split;
  return g;
}

std::vector<GlobalUnit::Run> global_runs(const GlobalUnit& g, int64_t lo, int64_t len) {
  std::vector<GlobalUnit::Run> out;
  for (const GlobalUnit::Run& r : g.param_runs) {
    const int64_t a = std::max(lo, r.local), b = std::min(lo + len, r.local + r.n);
    if (a < b) out.push_back({a, r.global + (a - r.local), b - a});
  }
  return out;
}

nlohmann::json unit_table(const std::vector<ParamUnit*>& units, int64_t num_experts) {
  nlohmann::json t = nlohmann::json::array();
  for (const ParamUnit* u : units) {
    const GlobalUnit g = global_unit(*u, num_experts);
    nlohmann::json ps = nlohmann::json::array();
    for (const GlobalUnit::Param& p : g.params)
      ps.push_back({{"name", p.name}, {"offset", p.offset}, {"shape", p.shape}});
    t.push_back({{"name", u->name}, {"numel", g.numel}, {"decay_numel", g.decay_numel},
                 {"first_expert", g.identity ? u->first_expert : 0}, {"params", ps}});
  }
  return t;
}

void check_unit_table(const nlohmann::json& table, const std::vector<ParamUnit*>& units, int64_t num_experts,
                      const std::string& dir) {
  const nlohmann::json mine = unit_table(units, num_experts);
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
  // Every range a shard declares is for a unit of state.json's table: a name it does not list
  // is a corrupt file, not something to skip (the load would later find a unit uncovered and
  // blame a missing file).
  std::set<std::string> units;
  if (state.contains("units") && state["units"].is_array())
    for (const auto& u : state["units"])
      if (u.is_object() && u.contains("name") && u["name"].is_string()) units.insert(u["name"].get<std::string>());
  for (const auto& f : state["shards"]) {
    const std::string name = f.get<std::string>();
    BB_CHECK(name.find("..") == std::string::npos && !name.empty() && name[0] != '/', "checkpoint ", dir,
             ": bad shard file name '", name, "'");
    auto file = std::make_shared<SafetensorsReader>(path_join(dir, name));
    for (const auto& [unit, range] : file->metadata()) {
      if (unit == "format" || unit == "rank" || unit == "world" || unit.rfind(kChecksumKeyPrefix, 0) == 0) continue;
      BB_CHECK(units.count(unit), "checkpoint ", dir, ": shard ", name, " holds a range for unit '", unit.substr(0, 80),
               "', which state.json's unit table does not list: the shard file is corrupt");
      // "lo len" or several runs "lo1 len1 lo2 len2 ..." (their elements one after the other).
      std::vector<Piece> runs;
      const char* at = range.c_str();
      int64_t total = 0;
      bool any = false;
      while (true) {
        while (*at == ' ') ++at;
        if (!*at) break;
        long long lo = -1, len = -1;
        int used = 0;
        BB_CHECK(std::sscanf(at, "%lld %lld%n", &lo, &len, &used) == 2 && lo >= 0 && len >= 0 &&
                     len <= (int64_t{1} << 50) && lo <= (int64_t{1} << 50),
                 "checkpoint ", dir, ": shard ", name, " has a bad range '", range.substr(0, 80), "' for unit ", unit);
        at += used;
        any = true;
        if (len > 0) runs.push_back({file, lo, len, total, 0});
        total += len;
        BB_CHECK(total <= (int64_t{1} << 50), "checkpoint ", dir, ": shard ", name, " has runs of more than 2^50 ",
                 "elements for unit ", unit);
      }
      BB_CHECK(any, "checkpoint ", dir, ": shard ", name, " has an empty range for unit ", unit);
      for (Piece& p : runs) {
        p.total = total;
        pieces_[unit].push_back(p);
      }
    }
  }
}

Tensor ShardSet::read(const std::string& unit, const std::string& which, int64_t lo, int64_t len,
                      DType dtype) const {
  if (len == 0) return Tensor::zeros({0}, dtype, Device::cpu(), MemCategory::other);
  // Every element is written below or the coverage check fails: no zero fill.
  Tensor out;
  int64_t covered = 0;
  auto it = pieces_.find(unit);
  if (it != pieces_.end()) {
    for (const Piece& p : it->second) {
      const int64_t a = std::max(lo, p.lo), b = std::min(lo + len, p.lo + p.len);
      if (a >= b) continue;
      const std::string name = unit + "." + which;
      BB_CHECK(p.file->has(name), "checkpoint ", dir_, ": ", p.file->path(), " lacks ", name);
      // A unit's runs are read one after another (read_runs): the file's tensor, read and
      // checksummed once, serves them all.
      Tensor t;
      if (cached_.defined() && cached_file_ == p.file.get() && cached_name_ == name) {
        t = cached_;
      } else {
        cached_ = Tensor();
        t = p.file->read(name, MemCategory::other);
        BB_CHECK(t.dtype() == dtype && t.numel() == p.total, "checkpoint ", dir_, ": ", p.file->path(), ": ", name,
                 " is ", t.str(), ", expected ", dtype_name(dtype), "[", p.total, "]");
        // Shards written since checksums exist carry one per tensor; older ones load as before.
        verify_checksum(p.file->metadata(), "checkpoint " + dir_ + ": " + p.file->path(), name, t);
      }
      if (a == lo && b - a == len && p.at + a - p.lo == 0 && p.total == len) {
        out = t;  // the file's tensor is exactly the range (one shard holds it all): no copy
        cached_ = Tensor();  // handed to the caller, who may change it
      } else {
        cached_ = t;
        cached_file_ = p.file.get();
        cached_name_ = name;
        if (!out.defined()) out = Tensor::empty({len}, dtype, Device::cpu(), MemCategory::other);
        out.narrow(a - lo, b - a).copy_from(t.narrow(p.at + a - p.lo, b - a));
      }
      covered += b - a;
    }
  }
  BB_CHECK(covered == len, "checkpoint ", dir_, ": the shard files cover ", covered, " of elements [", lo, ", ",
           lo + len, ") of unit ", unit, " (", which, "); a shard file is missing or truncated");
  if (check_finite_) {
    const std::vector<float> widened = dtype == DType::f32 ? std::vector<float>() : out.to_floats();
    const float* v = dtype == DType::f32 ? out.data<float>() : widened.data();
    // The second moment is a running mean of squares: a negative one is corrupt data, which
    // AdamW would turn into NaN (or, under skip_step, into every step skipped).
    const bool squares = which == "exp_avg_sq";
    for (int64_t k = 0; k < len; ++k) {
      BB_CHECK(std::isfinite(v[k]), "checkpoint ", dir_, ": ", unit, ".", which, " holds a non-finite value (", v[k],
               " at element ", lo + k, "); it cannot be resumed. Resume from an earlier checkpoint");
      BB_CHECK(!squares || v[k] >= 0, "checkpoint ", dir_, ": ", unit, ".", which, " holds a negative value (", v[k],
               " at element ", lo + k, "), which a mean of squares cannot be: the file is corrupt. Resume from an ",
               "earlier checkpoint");
    }
  }
  return out;
}

Tensor ShardSet::read_runs(const std::string& unit, const std::string& which, const std::vector<GlobalUnit::Run>& runs,
                           int64_t lo, int64_t len, DType dtype) const {
  if (runs.size() == 1 && runs[0].local == lo && runs[0].n == len) return read(unit, which, runs[0].global, len, dtype);
  Tensor out = Tensor::zeros({len}, dtype, Device::cpu(), MemCategory::other);
  for (const GlobalUnit::Run& r : runs) {
    BB_CHECK(r.local >= lo && r.local + r.n <= lo + len, "ShardSet::read_runs: run outside the range");
    out.narrow(r.local - lo, r.n).copy_from(read(unit, which, r.global, r.n, dtype));
  }
  return out;
}

void export_distributed_checkpoint(const std::string& step_dir, const std::string& out_dir,
                                   const HfExportOptions& opts) {
  const nlohmann::json st = read_checkpoint_state(step_dir);
  const ModelConfig cfg = parse_hf_config(st["model_config"], step_dir + "/state.json");
  // The layout only (every expert; no values allocated): each weight is cut from its unit's
  // masters when the export writes it. The shard files hold a unit's masters as one tensor
  // (read, and checksummed, whole), so the last two units read stay (a layer's weights
  // alternate between its dense and expert units): host memory holds two units, not the model.
  ModelOptions mo;
  mo.defer_values = true;
  DecoderModel model(cfg, mo, 0);
  std::vector<ParamUnit*> units = model.units();
  check_unit_table(st["units"], units, cfg.num_experts, step_dir);
  ShardSet shards(step_dir, st);
  shards.set_check_finite(false);  // the export checks the weights it writes (or not: --allow-nonfinite)
  const std::vector<HfTensor> tensors = model.hf_tensors();
  auto read_unit = [&](const ParamUnit* u) {
    // A unit whose local elements are the global ones is read whole (from a one-shard
    // checkpoint: the file's tensor as it is); only the parameters' elements are exported, so
    // its padding need not be zeroed as read_runs does.
    const GlobalUnit g = global_unit(*u, cfg.num_experts);
    return g.identity ? shards.read(u->name, "master", 0, u->numel)
                      : shards.read_runs(u->name, "master", global_runs(g, 0, u->numel), 0, u->numel);
  };
  // The units in the order the weights first need them. While the weights of one are converted
  // and written, the next is read on a thread of its own (one read at a time: the ShardSet is
  // not shared), so the disk reads overlap the writes; host memory holds three units.
  std::vector<const ParamUnit*> order;
  for (const HfTensor& t : tensors)
    if (std::find(order.begin(), order.end(), t.param->unit) == order.end()) order.push_back(t.param->unit);
  std::vector<std::pair<const ParamUnit*, Tensor>> cache;
  auto cached = [&](const ParamUnit* u) {
    for (const auto& [p, t] : cache)
      if (p == u) return true;
    return false;
  };
  std::future<Tensor> ahead;
  const ParamUnit* ahead_unit = nullptr;
  auto unit_values = [&](const ParamUnit& u) -> Tensor {
    for (const auto& [p, t] : cache)
      if (p == &u) return t;
    Tensor v;
    if (ahead_unit == &u) {
      v = ahead.get();
    } else {
      if (ahead.valid()) ahead.wait();  // its unit is read again when it is needed
      v = read_unit(&u);
    }
    ahead_unit = nullptr;
    ahead = std::future<Tensor>();
    if (cache.size() == 2) cache.erase(cache.begin());
    cache.emplace_back(&u, v);
    // Read ahead: the first unit after this one in the order that is not at hand.
    size_t at = static_cast<size_t>(std::find(order.begin(), order.end(), &u) - order.begin()) + 1;
    while (at < order.size() && cached(order[at])) ++at;
    if (at < order.size()) {
      ahead_unit = order[at];
      ahead = std::async(std::launch::async, read_unit, ahead_unit);
    }
    return v;
  };
  export_hf_streamed(cfg, tensors, [&](size_t i) {
    const HfTensor& t = tensors[i];
    return unit_slice(unit_values(*t.param->unit), *t.param, t.offset, t.shape);
  }, out_dir, opts);
}

}  // namespace bb

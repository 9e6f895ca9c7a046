// checkpoint.h — the distributed checkpoint format (DESIGN.md sec. 11; skills/checkpoints-distributed.md).
//
// A checkpoint step directory holds
//   state.json                 format_version 2, step, seed, data position, model config,
//                              primitives, optimizer (primitives.optimizer; absent in
//                              checkpoints from before it existed: adamw), backend, layout
//                              (dp/cp/ep/pp, world size, state family, grad_accum), the unit table
//                              (name, numel, decay_numel, first_expert, parameters with offsets
//                              and shapes) and the list of shard files
//   config.json                the model's Hugging Face config
//   shards/rank_RRRRR.safetensors  what rank R holds: per unit `<unit>.master` (f32),
//                              `.exp_avg`, `.exp_avg_sq` (the optimizer's moment dtype: f32 for
//                              adamw, bf16 for adamw_bf16_moments) of elements [lo, lo + len) of
//                              the unit's flat layout, with "lo len" in the file's metadata under
//                              the unit's name; or of several runs "lo1 len1 lo2 len2 ..." (the
//                              tensors are the runs' elements one after the other)
// Coordinates are global: every unit is described (unit table) and addressed (ranges) as the
// model holding every expert lays it out. An expert unit of an expert-parallel rank holds experts
// [first_expert, first_expert + E_l) of each of its parameters, which are runs of the global
// unit; it writes those runs (its parameters' elements, no alignment padding), and reads them
// back. So a checkpoint written at any EP degree reads at any other.
// Parameter values are not stored: they are the masters in the parameter dtype, which is what
// the optimizer writes after every step. Any layout can read any other: each rank reads the
// pieces that overlap what it holds under its own layout; padding is never read (it is zero).
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "models/decoder.h"
#include "models/hf_io.h"

namespace bb {

constexpr int kCheckpointFormat = 2;

// The optimizer a checkpoint was written with (state.json "optimizer"; "adamw" when absent).
std::string checkpoint_optimizer(const nlohmann::json& state);
// Throws, naming both and what to do, when the checkpoint's optimizer is not `run_optimizer`:
// the moments are stored in that optimizer's dtype and are not converted on load.
void check_checkpoint_optimizer(const nlohmann::json& state, const std::string& run_optimizer,
                                const std::string& dir);

// A unit in global coordinates (the model holding all `num_experts` experts): the unit itself,
// except an expert unit holding E_l < E experts, laid out as the E-expert unit.
struct GlobalUnit {
  struct Param {
    std::string name;
    Shape shape;         // global ([E, ...] for expert parameters)
    int64_t offset = 0;  // global
  };
  // Elements [local, local + n) of the rank's unit are elements [global, global + n) of the
  // global unit.
  struct Run {
    int64_t local = 0, global = 0, n = 0;
  };
  int64_t numel = 0, decay_numel = 0;
  std::vector<Param> params;   // layout order
  std::vector<Run> param_runs;  // every parameter's local elements (no padding), layout order
  bool identity = true;         // local coordinates are the global ones
};
GlobalUnit global_unit(const ParamUnit& u, int64_t num_experts);
// The parameter runs of `g` clipped to local elements [lo, lo + len).
std::vector<GlobalUnit::Run> global_runs(const GlobalUnit& g, int64_t lo, int64_t len);

// The unit table of state.json, in global coordinates (num_experts: the model's routed experts).
nlohmann::json unit_table(const std::vector<ParamUnit*>& units, int64_t num_experts);
// Throws naming the first difference when the table of a checkpoint does not describe `units`.
void check_unit_table(const nlohmann::json& table, const std::vector<ParamUnit*>& units,
                      int64_t num_experts, const std::string& dir);

// The shard files of a step directory, indexed by unit.
class ShardSet {
 public:
  ShardSet(const std::string& dir, const nlohmann::json& state);
  // Elements [lo, lo + len) of unit `unit`'s `which` (master | exp_avg | exp_avg_sq) as a host
  // tensor of `dtype`, which every piece must have (a piece of another dtype is an error naming
  // it). Throws naming the unit and the missing range if the files do not cover it.
  // Values that are not finite are an error naming the tensor and element, unless
  // set_check_finite(false) (export --allow-nonfinite).
  Tensor read(const std::string& unit, const std::string& which, int64_t lo, int64_t len,
              DType dtype = DType::f32) const;
  // Local elements [lo, lo + len) of a rank's unit whose elements are the global `runs`
  // (global_runs): each run read, the rest (padding) zero.
  Tensor read_runs(const std::string& unit, const std::string& which, const std::vector<GlobalUnit::Run>& runs,
                   int64_t lo, int64_t len, DType dtype = DType::f32) const;
  void set_check_finite(bool on) { check_finite_ = on; }

 private:
  struct Piece {
    std::shared_ptr<SafetensorsReader> file;
    int64_t lo = 0, len = 0;  // global elements [lo, lo + len) of the unit
    int64_t at = 0;           // their first element in the file's tensor
    int64_t total = 0;        // the file tensor's elements (all runs of the unit)
  };
  std::string dir_;
  bool check_finite_ = true;
  std::map<std::string, std::vector<Piece>> pieces_;
  // The last file tensor read (a unit's runs come one after another), kept for the next run.
  mutable Tensor cached_;
  mutable const SafetensorsReader* cached_file_ = nullptr;
  mutable std::string cached_name_;
};

// Parses state.json of a step directory (clear errors for missing or foreign files).
nlohmann::json read_checkpoint_state(const std::string& dir);
// The same from the text of a state.json (`dir` names it in errors): bounded nesting, the
// format version, and every field the loader reads present with the right type and range
// (step >= 0, data_position, model_config object, units / shards arrays, layout object,
// run_id string when present). A crafted file gives an error naming the field, never a crash.
nlohmann::json parse_checkpoint_state(std::string_view text, const std::string& dir);

// `bumblebee export` of a format-2 checkpoint: the fp32 masters consolidated into a Hugging Face
// directory (opts.dtype: the dtype written).
void export_distributed_checkpoint(const std::string& step_dir, const std::string& out_dir,
                                   const HfExportOptions& opts);

}  // namespace bb

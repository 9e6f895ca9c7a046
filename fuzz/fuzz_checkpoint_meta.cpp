// fuzz_checkpoint_meta.cpp — the metadata of a distributed checkpoint (runtime/checkpoint.h):
// state.json as the resume path reads it, before any shard is opened.
//
// Input: the text of a state.json. parse_checkpoint_state must accept it or throw bb::Error;
// an accepted state then goes where Trainer::load_checkpoint sends it: check_unit_table
// against the demo-tiny model (built once; the committed seeds were written for it), the
// saved model config through parse_hf_config, and the data position. Each step may reject
// with bb::Error; nothing may throw anything else or crash. A state whose unit table matches
// the model must describe it exactly (same unit count, names and sizes).
#include "fuzz_common.h"
#include "io/json_limits.h"
#include "models/decoder.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"

namespace {

using namespace bb;

DecoderModel& demo_model() {
  static DecoderModel* model = [] {
    const ModelConfig cfg =
        parse_hf_config(parse_json_bounded(fuzz::kDemoTinyConfig, "demo-tiny"), "demo-tiny");
    return new DecoderModel(cfg, ModelOptions{}, 1234);  // kept for the whole process
  }();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  DecoderModel& model = demo_model();
  const std::string dir = "fuzz/step_00000001";
  nlohmann::json st;
  if (!fuzz::accept_or_reject("parse_checkpoint_state",
                              [&] { st = parse_checkpoint_state(fuzz::as_text(data, size), dir); }))
    return 0;
  const nlohmann::json& cst = st;  // the loader reads the state through a const reference
  fuzz::accept_or_reject("model_config", [&] {
    const ModelConfig saved = parse_hf_config(cst["model_config"], dir + "/state.json");
    (void)saved.to_hf_json();
  });
  std::vector<ParamUnit*> units = model.units();
  if (fuzz::accept_or_reject("check_unit_table",
                             [&] { check_unit_table(cst["units"], units, model.config().num_experts, dir); })) {
    FUZZ_CHECK(cst["units"].size() == units.size(), "unit table of %zu units accepted for %zu",
               cst["units"].size(), units.size());
  }
  fuzz::must_succeed("step and data position", [&] {
    // parse_checkpoint_state promises these are present and well typed.
    FUZZ_CHECK(cst["step"].get<int64_t>() >= 0, "negative step accepted");
    (void)cst["data_position"].get<DataPosition>();
  });
  return 0;
}

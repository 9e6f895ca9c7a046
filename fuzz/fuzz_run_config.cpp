// fuzz_run_config.cpp — the run configuration (runtime/run_config.h): TOML text plus
// `--set table.key=value` overrides, validated strictly.
//
// Input: leading lines that start with "--set " are overrides (the rest of the line), the
// remainder is the TOML text. The run config needs model.config to name an HF config.json;
// the harness writes the demo-tiny config to a scratch file at startup and appends the
// override model.config="<that file>" last, so every input reaches the tables after [model].
// An accepted config must resolve its parameter dtype (the device may still be refused in a
// CPU build) and keep the values the validation promises.
#include <vector>

#include "fuzz_common.h"
#include "runtime/run_config.h"

namespace {

using namespace bb;

const std::string& model_config_override() {
  static const std::string ov = [] {
    const std::string path = path_join(fuzz::scratch_dir(), "config.json");
    fuzz::write_bytes(path, fuzz::kDemoTinyConfig);
    // A TOML basic string: the scratch path has no quotes or backslashes (mkdtemp's letters).
    return "model.config=\"" + path + "\"";
  }();
  return ov;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in = fuzz::as_text(data, size);
  std::vector<std::string> overrides;
  size_t pos = 0;
  while (pos < in.size() && in.substr(pos).rfind("--set ", 0) == 0) {
    size_t end = in.find('\n', pos);
    if (end == std::string_view::npos) end = in.size();
    overrides.emplace_back(in.substr(pos + 6, end - pos - 6));
    pos = end < in.size() ? end + 1 : end;
  }
  overrides.push_back(model_config_override());
  const std::string text(in.substr(pos));

  RunConfig c;
  if (!fuzz::accept_or_reject("parse_run_config",
                              [&] { c = parse_run_config(text, "fuzz.toml", overrides); }))
    return 0;
  FUZZ_CHECK(c.model.vocab_size == 264, "model.config override was not applied");
  FUZZ_CHECK(c.steps >= 0 && c.micro_batch_tokens > 0 && c.grad_accum >= 1 && c.log_every >= 1,
             "validated integers out of range (steps %lld, micro_batch_tokens %lld)",
             static_cast<long long>(c.steps), static_cast<long long>(c.micro_batch_tokens));
  FUZZ_CHECK(c.data.eos_id >= 0 && c.data.eos_id < c.model.vocab_size, "data.eos_id %d",
             static_cast<int>(c.data.eos_id));
  fuzz::accept_or_reject("resolved_param_dtype", [&] { (void)c.resolved_param_dtype(); });
  (void)c.primitives_summary();
  return 0;
}

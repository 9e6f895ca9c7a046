// fuzz_hf_config.cpp — Hugging Face config.json parsing (models/config.h) on arbitrary bytes.
//
// Input: the text of a config.json. It is parsed with parse_json_bounded (as load_hf_config
// does) and handed to parse_hf_config. For an accepted config:
//   - every layer answers is_moe_layer / layer_type, and num_moe_layers counts them;
//   - the parameter counts and model_flops either succeed or throw bb::Error (overflow near
//     the bounds); when they succeed they are non-negative and ordered (the routed experts are
//     part of the total, the active matmul params are within the total plus the LM head);
//   - to_hf_json() must not throw and must parse back to an equal config, directly, through
//     its text and through load_hf_config on a file. That is the documented round trip.
#include <cmath>

#include "fuzz_common.h"
#include "io/json_limits.h"
#include "models/config.h"

namespace {

using namespace bb;

void check_counts(const ModelConfig& c) {
  int64_t total = 0, experts = 0, active = 0;
  bool counted = false;
  fuzz::accept_or_reject("parameter counts", [&] {
    total = c.num_params();
    experts = c.num_expert_params();
    active = c.active_matmul_params_per_token();
    (void)c.num_active_params();
    counted = true;
  });
  if (!counted) return;
  FUZZ_CHECK(total > 0 && experts >= 0 && active > 0, "counts total %lld experts %lld active %lld",
             static_cast<long long>(total), static_cast<long long>(experts),
             static_cast<long long>(active));
  FUZZ_CHECK(experts <= total, "expert params %lld exceed the total %lld",
             static_cast<long long>(experts), static_cast<long long>(total));
  fuzz::accept_or_reject("model_flops", [&] {
    const double f = model_flops(c, {1, 7, 0, 128});
    FUZZ_CHECK(std::isfinite(f) && f > 0, "model_flops = %g", f);
    FUZZ_CHECK(model_flops(c, {}) == 0, "model_flops of no tokens is not 0");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ModelConfig c;
  const bool ok = fuzz::accept_or_reject("parse_hf_config", [&] {
    const nlohmann::json j = parse_json_bounded(fuzz::as_text(data, size), "fuzz config.json");
    c = parse_hf_config(j, "fuzz config.json");
  });
  if (!ok) return 0;

  int64_t moe = 0;
  fuzz::must_succeed("layer queries", [&] {
    for (int64_t l = 0; l < c.num_layers; ++l) {
      moe += c.is_moe_layer(l) ? 1 : 0;
      FUZZ_CHECK(c.layer_type(l) == LayerType::full_attention, "layer %lld is not full attention",
                 static_cast<long long>(l));
    }
    FUZZ_CHECK(moe == c.num_moe_layers(), "num_moe_layers %lld, counted %lld",
               static_cast<long long>(c.num_moe_layers()), static_cast<long long>(moe));
  });
  check_counts(c);

  fuzz::must_succeed("to_hf_json round trip", [&] {
    const nlohmann::json out = c.to_hf_json();
    const ModelConfig back = parse_hf_config(out, "round trip");
    FUZZ_CHECK(back == c, "parse_hf_config(to_hf_json()) differs: %s", out.dump().c_str());
    const std::string text = out.dump(2);
    const ModelConfig from_text =
        parse_hf_config(parse_json_bounded(text, "round trip text"), "text");
    FUZZ_CHECK(from_text == c, "the dumped config.json parses to a different config: %s",
               text.c_str());
    const std::string file = path_join(fuzz::scratch_dir(), "config.json");
    fuzz::write_bytes(file, text);
    FUZZ_CHECK(load_hf_config(fuzz::scratch_dir()) == c, "load_hf_config(dir) differs");
  });
  return 0;
}

// run.h — small training runs for tests: a temporary directory, a two-layer MoE config and a
// run config that trains it on the demo corpus in well under a second per step.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "models/config.h"

namespace bb {

inline std::string make_tmpdir() {
  char tmpl[] = "/tmp/bb_trainer_XXXXXX";
  char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d;
}

inline ModelConfig small_model(int64_t hidden = 32) {
  ModelConfig c = load_hf_config("configs/models/demo-tiny/config.json");
  c.hidden_size = hidden;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 16;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 24;
  c.num_experts = 4;
  c.top_k = 2;
  return c;
}

// Writes the model config and a run config into `dir`; returns the run-config path.
inline std::string write_run(const std::string& dir, const ModelConfig& m, const std::string& extra = "") {
  std::ofstream(dir + "/config.json") << m.to_hf_json().dump(2);
  std::ofstream f(dir + "/run.toml");
  f << "[model]\nconfig = \"" << dir << "/config.json\"\n"
    << "[train]\nsteps = 20\nmicro_batch_tokens = 96\nlr = 5e-3\nmin_lr = 5e-4\nwarmup_steps = 3\nseed = 7\n"
    << "[data]\npath = \"demo\"\ndemo_documents = 40\n"
    << "[checkpoint]\ndir = \"" << dir << "/ckpt\"\nevery = 0\nsave_final = false\n"
    << "[log]\nevery = 1\n"
    << extra;
  return dir + "/run.toml";
}

}  // namespace bb

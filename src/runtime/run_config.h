// run_config.h — the run configuration (TOML) every command reads, validated strictly.
//
// Tables: [model] [primitives] [parallel] [emulate] [train] [data] [checkpoint] [log] [backend]. Every key
// is documented in docs/config.md. Unknown tables or keys and bad values are errors naming the
// key; `--set table.key=value` overrides apply before validation, with the same checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/config.h"
#include "comm/emulated.h"
#include "core/memory.h"
#include "models/config.h"
#include "primitives/registry.h"
#include "runtime/data.h"

namespace bb {

struct RunConfig {
  // [model]
  std::string model_config;  // path to an HF config.json (or its directory)
  std::string model_init = "random";  // random
  std::string model_dtype = "auto";   // parameter storage: auto (f32 on CPU, bf16 on GPU), f32, bf16
  ModelConfig model;                  // parsed from model_config
  // [primitives]: every family's choice, typed (primitives/registry.h)
  PrimitiveSet prim;
  // [parallel]
  std::string device = "cpu";  // cpu | cuda | cuda:N | auto (cuda:0 when a GPU is visible)
  int64_t tp = 1, pp = 1, ep = 1, cp = 1;
  int64_t dp = 0;               // 0 = ranks / (cp x pp)
  // "auto" (parallel = "auto", parallel.layout = "auto", or per key): the planner picks the value
  // for the job's world size at startup (plan::choose_auto_layout); the fields above hold the
  // choice afterwards.
  bool auto_dp = false, auto_cp = false, auto_ep = false;
  bool auto_layout() const { return auto_dp || auto_cp || auto_ep; }
  std::string comm = "auto";    // auto | mpi | nccl | emulated (comm/comm.h)
  double comm_timeout_s = 50;   // a collective that takes longer aborts the job
  // [emulate]: the job one process plays a rank of when comm = "emulated" (comm/emulated.h)
  comm::EmulateConfig emulate;
  // [train]
  int64_t steps = 100;
  int64_t micro_batch_tokens = 2048;
  int64_t grad_accum = 1;
  double lr = 3e-3, min_lr = 3e-4;
  int64_t warmup_steps = 10;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8;
  double grad_clip = 1.0;       // 0 = off
  double aux_loss_coef = -1;    // < 0: the model config's router_aux_loss_coef
  double z_loss_coef = 0;
  uint64_t seed = 1234;
  // What a non-finite loss, gradient norm or update does: "abort" (exit naming the step and the
  // quantity; nothing is saved) or "skip_step" (the step's update is undone and counted).
  std::string on_nonfinite = "abort";
  double loss_spike_factor = 10;  // warn when a step's loss exceeds this x the running mean; 0 = off
  // A GPU run whose predicted peak (plan/estimate.h) exceeds the device: "refuse" (the default:
  // it stops before allocating, naming the largest categories and a setting that fits) or
  // "warn" (it starts anyway; `--force`).
  std::string memory_check = "refuse";
  // [data]
  DataConfig data;
  // [checkpoint]
  std::string ckpt_dir;         // empty = no checkpoints
  int64_t ckpt_every = 0;       // 0 = only the final one (if save_final)
  bool ckpt_save_final = true;
  int64_t ckpt_keep = 2;        // newest N kept; 0 = keep all
  bool ckpt_async = false;      // periodic saves: snapshot to host, write beside training
  std::string resume;           // "" | "auto" (latest in ckpt_dir, if any) | a checkpoint path
  // [log]
  int64_t log_every = 1;
  std::string metrics_path;     // JSON lines, one object per step; empty = none
  bool log_all_ranks = false;   // every rank prints its own log lines (prefixed with its rank)
  // [backend]
  BackendConfig backend;

  double effective_aux_coef() const { return aux_loss_coef < 0 ? model.router_aux_loss_coef : aux_loss_coef; }
  // The device the run uses ("auto" resolved) and the parameter dtype ("auto" resolved).
  Device resolved_device() const;
  DType resolved_param_dtype() const;
  // A one-line summary of the primitive choices, for logs.
  std::string primitives_summary() const { return prim.summary(); }
};

// Makes `c` the process-wide setting of the CUDA backend (grouped GEMM defaults, heuristics
// mode, cuDNN library). Nothing to set in a CPU-only build. The cuDNN library is loaded once:
// asking for another file after it was loaded is an error.
void apply_backend_config(const BackendConfig& c);

// Loads and validates a run config; `overrides` are "table.key=value" strings (value in TOML
// syntax; a bare word is taken as a string). Relative paths in the file are resolved against
// the current directory.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from TOML text (for tests and `paired`); `source` names it in messages.
RunConfig parse_run_config(const std::string& toml_text, const std::string& source,
                           const std::vector<std::string>& overrides = {});

}  // namespace bb

// trainer.h — the training protocol: step loop, LR schedule, AdamW with fp32 master weights,
// gradient accumulation and clipping, metrics, checkpoints.
//
// One optimizer step = grad_accum micro-batches. Their valid-token counts are summed first so
// that every micro-batch's loss gradient is scaled by 1 / (valid tokens in the step): the loss
// is a per-token average over the whole step, whatever the packing.
#pragma once

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/memory.h"
#include "models/decoder.h"
#include "runtime/data.h"
#include "runtime/run_config.h"
#include "runtime/schedule.h"

namespace bb {

struct StepMetrics {
  int64_t step = 0;         // 1-based index of the step just taken
  double loss = 0;          // mean CE per valid token over the step
  double aux_loss = 0;      // mean over micro-batches of the aux loss (pooled over MoE layers, as HF)
  double z_loss = 0;
  double grad_norm = 0;     // before clipping
  double lr = 0;
  int64_t tokens = 0;       // tokens processed in the step
  int64_t valid_tokens = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double model_tflops = 0;  // model FLOPs / step time (DESIGN.md sec. 6), per GPU/process
  MemoryStats mem;          // peaks over this step
  int64_t host_syncs = 0;   // deliberate host-device synchronisations in the step (GPU)
};

class Trainer {
 public:
  // Builds model, optimizer state and data loader; resumes if cfg.resume says so.
  explicit Trainer(const RunConfig& cfg, FILE* log = stdout);
  // The same with data given in memory (benchmarks, tests) instead of cfg.data's source.
  Trainer(const RunConfig& cfg, FILE* log, Corpus corpus);
  ~Trainer();

  // One optimizer step.
  StepMetrics train_step();
  // The whole run: cfg.steps steps with log lines, metrics file and checkpoints.
  // Returns the per-step metrics.
  std::vector<StepMetrics> run();

  int64_t step() const { return step_; }
  double lr_at(int64_t step) const;  // learning rate of (1-based) step
  DecoderModel& model() { return *model_; }
  Schedule& schedule() { return *schedule_; }
  DataLoader& data() { return *data_; }
  const RunConfig& config() const { return cfg_; }

  // Writes <dir>/step_NNNNNNNN atomically (temp dir + rename) and points <dir>/latest at it.
  std::string save_checkpoint(const std::string& dir);
  // Loads a checkpoint directory (a step_* dir, or a checkpoint root with `latest`). Everything
  // is validated and staged before any state changes: on error nothing is modified.
  void load_checkpoint(const std::string& path);

 private:
  // AdamW state of one parameter unit: flat [numel] f32 tensors, stepped as two buckets (the
  // weight-decayed elements [0, decay_numel) and the rest).
  struct OptState {
    Tensor master, exp_avg, exp_avg_sq;
  };
  void log_line(const StepMetrics& m);

  RunConfig cfg_;
  FILE* log_;
  std::unique_ptr<DecoderModel> model_;
  std::unique_ptr<Schedule> schedule_;
  std::unique_ptr<DataLoader> data_;
  std::vector<OptState> opt_;
  int64_t step_ = 0;
  Device device_;
};

// Resolves a checkpoint path: a step directory is returned as is; a root with a `latest` file
// resolves to the step it names. Returns "" when `root` has no checkpoint yet.
std::string resolve_checkpoint(const std::string& path);

// Moves a micro-batch's targets and positions to `d` (host -> device from pinned staging, no
// host sync); token ids and cu_seqlens stay on the host (the embedding checks the ids there and
// uploads them itself; attention plans and packing metadata are host-side).
MicroBatch to_device(MicroBatch mb, Device d);

// "12.3K", "4.56M" style for log lines.
std::string human_count(double v);

}  // namespace bb

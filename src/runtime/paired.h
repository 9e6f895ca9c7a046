// paired.h — the paired baseline: the same model, data and seed run twice, once per side
// (A and B differ only by the overrides given), compared on loss, grad norm, first-batch
// logits, every parameter's gradient after step 1, peak memory per category and step time.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "runtime/trainer.h"

namespace bb {

struct PairedOptions {
  std::string config_path;
  std::vector<std::string> common;  // overrides for both sides
  std::vector<std::string> a, b;    // overrides for side A / side B
  int64_t steps = 5;
  double tol_loss = 1e-4;       // relative, per step
  double tol_grad_norm = 1e-3;  // relative, per step
  double tol_logits = 1e-3;     // absolute, max over the first micro-batch's logits
  double tol_grad = 1e-3;       // relative, per parameter gradient after step 1
  // Untimed steps run first for each side in a throw-away trainer, so that one-time costs of the
  // process (GPU memory pool growth, attention graph builds, GEMM heuristics) do not land on side
  // A's timed steps only. -1: 1 on a GPU, 0 on the CPU.
  int64_t warmup_steps = -1;
  // Non-empty: each side's steps as log.metrics rows (Trainer::metrics_line), in
  // <metrics>.a.jsonl and <metrics>.b.jsonl (written whole by the side's first rank, through a
  // temporary name), for `bumblebee report` to overlay. The sides' run ids differ.
  std::string metrics;
};

struct PairedResult {
  std::vector<StepMetrics> a, b;
  double max_logits_diff = 0;    // max |logits_a - logits_b| on the first micro-batch, before training
  double max_loss_rel = 0, max_grad_norm_rel = 0;
  // ||g_a - g_b|| / ||g_a|| per parameter after step 1, worst first (name, relative error).
  std::vector<std::pair<std::string, double>> grad_rel;
  double max_grad_rel = 0;
  double step_time_ratio = 0;    // median step time b / a (steps after the first)
  bool pass = false;
  std::string verdict;           // one line
};

PairedResult run_paired(const PairedOptions& opts, FILE* out);

}  // namespace bb

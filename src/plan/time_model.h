// time_model.h — the planner's step-time model (DESIGN.md sec. 8, skills/planner.md "Time").
//
// A rank's training step priced operation by operation: each GEMM's FLOPs at the dense GEMM rate
// of its size, the expert GEMMs at the grouped rate of their rows per expert, the attention core
// at the causal attention rate of its sequence, the Gated DeltaNet rule per token and value head,
// the memory-bound kernels (norms, activations, permutes, the optimizer update) by the bytes they
// move at the measured elementwise and copy rates. The rates come from a Calibration, measured on
// the GPU by `bumblebee plan --calibrate` (plan/calibrate.h); the built-in one was measured on an
// H100 80GB HBM3. Communication is the memory estimator's wire time per operation (the [emulate] link
// model, comm/link_model.h) with the overlaps the schedule performs (skills/planner.md lists them
// and what is assumed). Everything is a prediction: tables made from it say PREDICTED.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/run_config.h"

namespace bb::plan {

struct MemoryEstimate;  // plan/estimate.h

// Rates measured on one GPU. Curves are (x, y) points with x ascending, read log-linearly in x
// (linear in log x between points, the end values beyond them).
struct Curve {
  std::vector<std::pair<double, double>> pts;
  double at(double x) const;
};

struct Calibration {
  std::string device;  // the card, as the driver names it
  std::string source;  // how and when it was measured
  Curve gemm_tflops;     // dense bf16 GEMM (f32 accumulation): x = FLOPs of one call
  Curve grouped_tflops;  // expert GEMMs, forward + data and weight gradients: x = rows per expert
  Curve attn_fwd_tflops; // causal attention forward (4 (S^2 / 2) Hq D FLOPs): x = tokens of the sequence
  Curve attn_bwd_tflops; // its backward (2.5 x the forward's FLOPs)
  // Attention at further head dims (plan --calibrate measures 256, Qwen3.5's, beside 128): a
  // model whose head dim is listed is priced with its own curves; otherwise with the ones above.
  struct AttentionRates {
    int64_t head_dim = 0, heads = 0;
    Curve fwd_tflops, bwd_tflops;
  };
  std::vector<AttentionRates> attn_by_head_dim;
  // The forward and backward curves for head dim `d`, and whether they were measured at it.
  std::pair<const Curve*, const Curve*> attention_curves(int64_t d, bool* exact = nullptr) const;
  Curve gdn_fwd_ns;      // Gated DeltaNet rule forward: ns per token and value head; x = tokens
  Curve gdn_bwd_ns;      // its backward
  double elementwise_gbps = 0;  // norms, activations, permutes: bytes read + written per ns
  double copy_gbps = 0;         // a device copy (the optimizer's bound): bytes read + written per ns
  // primitives.optimizer = "adamw_offload" (optional in a file; 0 = not measured, the time model
  // then takes 1.0 and 25 and says so): the host pool's AdamW update in elements per ns, and a
  // page-locked host <-> device copy in one direction, bytes per ns.
  double host_adamw_geps = 0, pcie_gbps = 0;
  // The shapes the curves were measured at (skills/planner.md says how far they carry).
  int64_t grouped_hidden = 0, grouped_ffn = 0, attn_heads = 0, attn_head_dim = 0;
  int64_t gdn_key_dim = 0, gdn_value_dim = 0;

  // Errors naming the field for empty curves, x not ascending, rates <= 0.
  void validate(const std::string& where) const;
  nlohmann::json to_json() const;
  static Calibration from_json(const nlohmann::json& j, const std::string& where);
  // Reads (errors name the file) and validates; save writes to a temporary name, then renames.
  static Calibration load(const std::string& path);
  void save(const std::string& path) const;
  // The rates `bumblebee plan --calibrate` measured on an H100 80GB HBM3 (`source` names the results file).
  static const Calibration& builtin();
};

// One step of one rank, in seconds, by what runs. The compute categories are the compute stream's
// time (they run one after the other); optimizer is the update, the gradient norm and the zeroing
// (exposed: what is not hidden behind the backward when the update runs in it); the exposed_*
// terms are the communication the schedule does not hide, by class.
struct TimeEstimate {
  double dense_gemm = 0, expert_gemm = 0, attention = 0, gdn = 0, head = 0, elementwise = 0;
  double optimizer = 0;
  double exposed_gather = 0, exposed_reduce = 0, exposed_ep = 0, exposed_cp = 0;
  double wire_s = 0;            // the step's wire time with nothing overlapped (CommEstimate)
  double step_s = 0;            // the sum of the above
  int64_t tokens = 0;           // tokens of the step on this rank (micro-batches x T)
  double model_flops = 0;       // model FLOPs of the step per GPU (DESIGN.md sec. 6)
  double flops_counted = 0;     // every FLOP priced, the recompute's included
  double tokens_per_s() const { return step_s > 0 ? tokens / step_s : 0; }
  double tflops() const { return step_s > 0 ? model_flops / step_s / 1e12 : 0; }
  std::vector<std::string> assumptions;  // what the prediction takes for granted for this run

  // "| category | ms | % |" rows, labelled PREDICTED.
  std::string table() const;
  nlohmann::json json() const;
};

// The step of the rank `mem` describes (estimate_memory of the same cfg): its layout, its tokens,
// its collectives. Throws for a run the model cannot price (pp > 1).
TimeEstimate estimate_time(const RunConfig& cfg, const MemoryEstimate& mem, const Calibration& cal);

// Bytes one AdamW update moves per owned element: it reads the f32 gradient, both moments and the
// master and writes the moments and the master: 4 + 4 x (4, or 2 for bf16 moments) + the master's
// 8 (an f32 parameter read and written; a split master's two 16-bit halves both ways) or 10 (a
// separate f32 master read and written, the bf16 weight written). 28 with the defaults.
double adamw_update_bytes(OptimizerKind opt, DType param_dtype, const std::string& master_storage);

// The three-stage pipeline of a chunked MoE dispatcher: `C` chunks of a send (a), the experts (b)
// and a return (c), each stage one chunk at a time, a chunk's stages in order: (a + b + c) / C +
// (C - 1) / C x max(a, b, c), and at least a + c (the send and the return share the link). C = 1
// is the serial a + b + c.
double chunk_pipeline_s(double a, double b, double c, int64_t C);

}  // namespace bb::plan

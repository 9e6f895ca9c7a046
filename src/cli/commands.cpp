#include "cli/commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <unistd.h>

#include "io/fs.h"
#include "plan/calibrate.h"
#include "plan/estimate.h"
#include "models/hf_io.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/logprobs.h"
#include "runtime/paired.h"
#include "runtime/report.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb::cli {

namespace {

constexpr const char* kTrainHelp = R"(Train a model from a run config (TOML).

The run config has tables [model] [primitives] [parallel] [emulate] [train] [data] [checkpoint]
[log] [backend];
docs/config.md documents every key. Any key can be overridden on the command line:
  bumblebee train --config configs/demo.toml --set train.steps=50 --set primitives.loss=full_ce
Each step prints one log line (loss, aux loss, grad norm, lr, tokens/s, model TFLOP/s, peak
memory per category); log.metrics writes the same as JSON lines. With checkpoint.dir set,
checkpoints are written atomically to <dir>/step_NNNNNNNN; checkpoint.resume = "auto" continues
from the newest one. SIGTERM or SIGINT (Ctrl-C, SLURM's warning before a kill) stops the run after
its current step, saves that step's checkpoint and exits 128 + signal; a second signal stops at
once (the last checkpoint stays whole).

Several processes: mpirun -np N bumblebee train ... (or srun). [parallel] sets the layout
(dp, cp, ep, pp; dp = 0: all ranks data-parallel), comm (auto | mpi | nccl) and timeout_s;
primitives.state picks replicated, zero1 or fsdp. Rank 0 prints the log; --log-all-ranks makes
every rank print its own lines.

One rank of a larger job on one GPU: parallel.comm = "emulated" with [emulate] ranks = N (and
the link's bandwidths and latencies) runs this process as one rank of N: real compute, memory
and streams, modelled wire time. Every line it prints says EMULATED; its losses are not the
real job's (skills/emulated-comm.md).)";

constexpr const char* kPairedHelp = R"(Run the same model, data and seed twice (side A and side B) and compare them.

A and B differ only by the overrides you give (KEY=VALUE, same syntax as --set):
  bumblebee paired --config configs/demo.toml --a primitives.loss=full_ce --b primitives.loss=linear_ce
Prints loss and grad norm per step, max |logits A - logits B| on the first micro-batch (before
training), the ten parameters whose gradients after step 1 differ most (relative), peak memory
per category and the step-time ratio B/A. Exits 0 when every step's loss and grad norm, the
logits and every gradient agree within the tolerances, 1 when they do not, 2 on errors.
Checkpoints and metrics files of the run config are not touched; --metrics PREFIX writes each
side's steps to PREFIX.a.jsonl and PREFIX.b.jsonl, which `bumblebee report` overlays.)";

constexpr const char* kExportHelp =
    R"(Export a training checkpoint as a Hugging Face model directory.

  bumblebee export --checkpoint runs/demo/checkpoints --out hf/demo [--dtype bf16|f32]
                   [--max-shard-size 5GB] [--force] [--allow-nonfinite]
CKPT is a step_NNNNNNNN directory or a checkpoint root (its `latest` step is used). OUT must be
new or empty (--force: replace the model files of a non-empty one) and never inside a
checkpoint directory; weights holding Inf/NaN are refused unless --allow-nonfinite. OUT gets
config.json, generation_config.json and model.safetensors, or model-0000i-of-0000n.safetensors
+ model.safetensors.index.json when the weights exceed --max-shard-size. Tensor names are the
classic per-expert Qwen3MoeForCausalLM / Qwen2MoeForCausalLM names, so
AutoModelForCausalLM.from_pretrained(OUT) loads it; model.init = "hf:OUT" loads it back here.)";

constexpr const char* kPlanHelp = R"(Predict a run's memory per rank, phase by phase, and its step time, without allocating.

  bumblebee plan --explain configs/qwen3-30b-a3b-8gpu.toml [--ranks 8] [--set KEY=VALUE ...]
  bumblebee plan --model configs/models/qwen3.5-35b-a3b --gpus 32 --seq 131072 [--gpu-memory 80]
                 [--gpus-per-node 8] [--global-batch-tokens B] [--json]
  bumblebee plan --calibrate [--out calibration.json] [--quick]
Prints, per category (params, grads, optimizer, activations, logits, moe, comm, workspace,
other), the bytes live at the largest moment of each phase of a training step (startup, each
layer's forward, the loss head, each layer's recompute and backward, the embedding backward,
the update) and each category's peak over the step. params, grads, optimizer and comm are exact;
activations, logits and moe follow the blocks' formulas (skills/planner.md gives them and the
measured errors); routing is taken as balanced unless --expert-load says how much more the
busiest rank receives. For a GPU run it also predicts the step's time by category: GEMMs,
attention, Gated DeltaNet and memory-bound kernels priced from a calibration table, and the
communication the schedule does not hide (the [emulate] link model).

With --model, --gpus and --seq it searches the layouts of that many GPUs under the default recipe
(fsdp, full recompute, linear_ce, chunked_alltoall:2, cp_ring), predicts each, drops those above the
GPU's memory less --margin, and picks the one with the most predicted tokens/s per GPU, saying why
this CP and this EP.

--calibrate measures the rates on this machine's GPU (about a minute) and writes them to --out;
--calibration FILE uses such a file instead of the built-in one (measured on an H100 80GB HBM3).)";

constexpr const char* kLogprobsHelp = R"(Per-token log-probs, entropies and (with --routing) the routed experts of documents
under a model's weights: the forward-only pass of RL (a rollout's old or ref log-probs; R2 router
replay records the routing here and replays it in the update).

  bumblebee logprobs --checkpoint hf:DIR|CKPT --data rollouts.jsonl --out scored.jsonl
                     [--config RUN.toml] [--set KEY=VALUE ...] [--temperature T] [--routing]
  mpirun -np N bumblebee logprobs ... --set parallel.layout=auto
CKPT is a step_NNNNNNNN directory or a checkpoint root; hf:DIR a Hugging Face model directory;
init the model's seeded initialisation (with --config: smoke tests and throughput checks).
Without --config the model comes from the weights (DIR's config.json, the checkpoint's
state.json) with the default primitives; --config / --set give the layout (dp, cp, ep; auto),
the primitives and train.micro_batch_tokens, the budget of one forward. The data is JSON lines
with "tokens" (other rollout keys are read and ignored); every token is scored. The output has
one line per record: {"id", "logprobs", "entropy"[, "routing"]}, entry j for token j (entry 0 is
0), as a rollout record's old_logprobs. Memory: the weights and one forward's activations; no
gradients, no optimizer state, no [T, V] logits.)";

constexpr const char* kReportHelp = R"(Write one self-contained HTML page of runs' metrics over steps (inline SVG and CSS: no
script, nothing fetched; it opens from a file, offline, and can be mailed or archived).

  bumblebee report runs/demo --out runs/demo/report.html
  bumblebee report a.jsonl b.jsonl [--label A --label B] --out report.html
Each input is a metrics file (JSON lines, what log.metrics writes) or a run directory holding
metrics.jsonl. The page has a table (per run: run id, steps, final loss, median tokens/s and
model TFLOP/s, peak memory, ranks) and one plot per quantity: loss, grad norm, learning rate,
tokens/s, model TFLOP/s, peak memory per category (a plot per run, on one scale) and, for
policy-loss runs, the policy metrics. Inputs overlay, a colour per run; a file holding rows of
several run ids gives one run per id. Skipped steps and missing values are gaps in the lines.

paired writes no metrics files (its sides run with log.metrics cleared). To overlay a pair's two
sides over many steps, train each side with its overrides and its own metrics file, then pass both:
  bumblebee train -c configs/demo.toml --steps 50 --set 'checkpoint.dir=""' \
      --set primitives.loss=full_ce --set 'log.metrics="a.jsonl"'
  bumblebee train -c configs/demo.toml --steps 50 --set 'checkpoint.dir=""' \
      --set primitives.loss=linear_ce --set 'log.metrics="b.jsonl"'
  bumblebee report a.jsonl b.jsonl --label full_ce --label linear_ce --out pair.html
A last line cut off mid-write (a killed run) is skipped with a warning; any other bad line is an
error naming file:line (exit 2). The page is written atomically (skills/run-report.md).)";

// --out must not be a checkpoint root or inside one (whatever --force says: exports there would
// mix with training state), and must be empty or absent unless --force.
void check_export_target(const std::string& out, bool force) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(out), ec).lexically_normal();
  BB_CHECK(!ec, "export: bad --out path '", out, "'");
  if (!p.has_filename()) p = p.parent_path();  // trailing slash
  // A step directory has state.json beside shards/ (or model.safetensors, format 1); a root has
  // a `latest` naming one of its steps, or the lock file beside step_* directories.
  auto is_checkpoint_dir = [&](const fs::path& q) {
    if (fs::exists(q / "state.json", ec) && (fs::exists(q / "shards", ec) || fs::exists(q / "model.safetensors", ec)))
      return true;
    if (fs::is_regular_file(q / "latest", ec) && fs::file_size(q / "latest", ec) < 256) {
      std::string name = read_file((q / "latest").string());
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
      if (name.rfind("step_", 0) == 0 && fs::is_directory(q / name, ec)) return true;
    }
    if (fs::exists(q / ".lock", ec))
      for (const auto& e : fs::directory_iterator(q, ec))
        if (e.path().filename().string().rfind("step_", 0) == 0) return true;
    return false;
  };
  for (fs::path q = p; !q.empty(); q = q.parent_path()) {
    BB_CHECK(!is_checkpoint_dir(q), "export: --out '", out, "' is ", q == p ? "" : "inside ",
             "the checkpoint directory ", q.string(), "; export to a directory outside it");
    if (q == q.parent_path()) break;
  }
  if (!fs::exists(p, ec)) return;
  BB_CHECK(fs::is_directory(p, ec), "export: --out '", out, "' exists and is not a directory");
  if (!force)
    BB_CHECK(fs::is_empty(p, ec), "export: --out '", out, "' is not empty; pass --force to replace the model files ",
             "in it, or pick a new directory");
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"bumblebee: long-sequence MoE training on few GPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "bumblebee 0.1.0");

  // train
  auto* train = app.add_subcommand("train", "Train a model from a run config");
  train->footer(kTrainHelp);
  std::string train_config;
  std::vector<std::string> train_sets;
  int64_t train_steps = 0;
  std::string train_device;
  train->add_option("--config,-c", train_config, "Run config (TOML), e.g. configs/demo.toml")->required();
  train->add_option("--set,-s", train_sets, "Override a config key: table.key=value (repeatable)");
  train->add_option("--steps", train_steps, "Shortcut for --set train.steps=N")->check(CLI::NonNegativeNumber);
  train->add_option("--device", train_device, "Shortcut for --set parallel.device=DEV (cpu)");
  bool log_all_ranks = false, train_force = false;
  train->add_flag("--log-all-ranks", log_all_ranks,
                  "Every rank prints its own log lines (prefixed with its rank); default: rank 0 only");
  train->add_flag("--force", train_force,
                  "Start a GPU run even when its predicted memory exceeds the device (train.memory_check = \"warn\")");

  // paired
  auto* paired = app.add_subcommand("paired", "Paired baseline: run A and B, compare loss, grads, memory, time");
  paired->footer(kPairedHelp);
  PairedOptions po;
  paired->add_option("--config,-c", po.config_path, "Run config (TOML)")->required();
  paired->add_option("--a", po.a, "Override for side A: table.key=value (repeatable)");
  paired->add_option("--b", po.b, "Override for side B: table.key=value (repeatable)");
  paired->add_option("--set,-s", po.common, "Override for both sides (repeatable)");
  paired->add_option("--steps", po.steps, "Optimizer steps per side (default 5)")->check(CLI::PositiveNumber);
  paired->add_option("--tol-loss", po.tol_loss, "Max relative loss difference per step (default 1e-4)");
  paired->add_option("--tol-grad-norm", po.tol_grad_norm, "Max relative grad-norm difference per step (default 1e-3)");
  paired->add_option("--tol-logits", po.tol_logits,
                     "Max |logits A - logits B| on the first micro-batch (default 1e-3)");
  paired->add_option("--tol-grad", po.tol_grad,
                     "Max relative difference of any parameter's gradient after step 1 (default 1e-3)");
  paired->add_option("--metrics", po.metrics,
                     "Write each side's steps as log.metrics rows to PREFIX.a.jsonl and PREFIX.b.jsonl "
                     "(for bumblebee report)");
  bool paired_force = false;
  paired->add_flag("--force", paired_force,
                   "Start both sides even when their predicted GPU memory exceeds the device (train.memory_check = \"warn\")");
  paired->add_option("--warmup", po.warmup_steps,
                     "Untimed steps per side before the timed runs, so one-time costs do not land "
                     "on side A (default: 1 on a GPU, 0 on the CPU)")
      ->check(CLI::NonNegativeNumber);

  // export
  auto* exp = app.add_subcommand("export", "Export a checkpoint as a Hugging Face model directory");
  exp->footer(kExportHelp);
  std::string exp_ckpt, exp_out, exp_dtype = "bf16", exp_shard = "5GB";
  exp->add_option("--checkpoint", exp_ckpt, "Checkpoint step directory or checkpoint root")
      ->required();
  exp->add_option("--out", exp_out, "Output directory (created if missing)")->required();
  exp->add_option("--dtype", exp_dtype, "Weight dtype in the files: bf16 (default) or f32")
      ->check(CLI::IsMember({"bf16", "f32"}));
  exp->add_option("--max-shard-size", exp_shard,
                  "Largest shard file, e.g. 5GB (default), 500MB, 2GiB");
  bool exp_force = false, exp_allow_nonfinite = false;
  exp->add_flag("--force", exp_force, "Write into a non-empty --out directory (its model files are replaced)");
  exp->add_flag("--allow-nonfinite", exp_allow_nonfinite,
                "Write weights that hold Inf/NaN (default: refused, naming the tensor)");

  // plan
  auto* plan = app.add_subcommand("plan", "Predict a run's memory per rank before launching it");
  plan->footer(kPlanHelp);
  std::string plan_explain;
  std::vector<std::string> plan_sets;
  int64_t plan_ranks = 0, plan_rank = -1;
  double plan_expert_load = 1.0;
  plan->add_option("--explain", plan_explain, "Run config (TOML) whose memory to predict, phase by phase");
  std::string plan_model;
  plan::PlanRequest preq;
  plan->add_option("--model", plan_model, "Model config (HF config.json or its directory): search layouts for it");
  plan->add_option("--gpus", preq.gpus, "GPUs of the job (with --model)")->check(CLI::PositiveNumber);
  plan->add_option("--gpus-per-node", preq.gpus_per_node, "GPUs per node (default 8)")->check(CLI::PositiveNumber);
  plan->add_option("--gpu-memory", preq.gpu_memory_gib, "Memory per GPU in GiB (default 80)")->check(CLI::PositiveNumber);
  plan->add_option("--seq", preq.seq, "Tokens per sequence (with --model)")->check(CLI::PositiveNumber);
  plan->add_option("--margin", preq.margin, "Fraction of the GPU's memory kept free (default 0.05)")
      ->check(CLI::Range(0.0, 0.9));
  plan->add_option("--set,-s", plan_sets, "Override a config key: table.key=value (repeatable)");
  plan->add_option("--ranks", plan_ranks, "World size of the run (default: emulate.ranks of an emulated run, else dp x cp; dp = 0: the fewest ranks that hold ep)")
      ->check(CLI::PositiveNumber);
  plan->add_option("--rank", plan_rank, "Predict this rank (default: the largest over ranks)")->check(CLI::NonNegativeNumber);
  plan->add_option("--expert-load", plan_expert_load,
                   "The busiest rank's routed rows over the balanced count (default 1: balanced routing)")
      ->check(CLI::Range(1.0, 1000.0));
  plan->add_option("--global-batch-tokens", preq.global_batch_tokens,
                   "Tokens of a step over all GPUs (with --model; default: one sequence per data rank)")
      ->check(CLI::NonNegativeNumber);
  std::string plan_calibration, plan_out;
  bool plan_calibrate = false, plan_quick = false;
  plan->add_option("--calibration", plan_calibration, "Calibration file of the time model (default: the built-in one, measured on an H100)");
  plan->add_flag("--calibrate", plan_calibrate, "Measure the time model's rates on this machine's GPU");
  plan->add_option("--out", plan_out, "With --calibrate: the file to write (default: print it)");
  plan->add_flag("--quick", plan_quick, "With --calibrate: small shapes (a smoke test; runs on the CPU without a GPU)");
  bool plan_moments = false, plan_json = false;
  plan->add_flag("--moments", plan_moments, "Print every moment of the step, not one row per phase");
  plan->add_flag("--json", plan_json, "Print the prediction as one JSON object (bytes)");

  // logprobs
  auto* lpc = app.add_subcommand("logprobs", "Per-token log-probs (and routing) of documents, forward only");
  lpc->footer(kLogprobsHelp);
  std::string lp_weights, lp_data, lp_out, lp_config;
  std::vector<std::string> lp_sets;
  double lp_temperature = 1.0;
  bool lp_routing = false;
  lpc->add_option("--checkpoint", lp_weights, "hf:DIR (a Hugging Face model) or a checkpoint directory / root")->required();
  lpc->add_option("--data", lp_data, "JSON lines with \"tokens\" (rollout records)")->required();
  lpc->add_option("--out", lp_out, "Output JSON lines (written atomically)")->required();
  lpc->add_option("--config,-c", lp_config, "Run config for the layout, primitives and micro-batch budget (optional)");
  lpc->add_option("--set,-s", lp_sets, "Override a config key: table.key=value (repeatable)");
  lpc->add_option("--temperature", lp_temperature, "Sampling temperature of the rollouts (default 1)")
      ->check(CLI::PositiveNumber);
  lpc->add_flag("--routing", lp_routing, "Also write the experts each token was routed to (MoE models)");

  // report
  auto* rep = app.add_subcommand("report", "Write an HTML page of runs' metrics (loss, speed, memory) over steps");
  rep->footer(kReportHelp);
  std::vector<std::string> rep_inputs, rep_labels;
  std::string rep_out;
  rep->add_option("inputs", rep_inputs, "Metrics files (JSON lines) or run directories; several overlay")->required();
  rep->add_option("--out,-o", rep_out, "Output HTML file (written atomically)")->required();
  rep->add_option("--label", rep_labels,
                  "Legend name of each input, in order (repeatable; default: the file's or run directory's name)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2, as every other error does.
    return app.exit(e) == 0 ? 0 : 2;
  }

  if (train->parsed()) {
    if (train->count("--steps")) train_sets.push_back("train.steps=" + std::to_string(train_steps));
    if (!train_device.empty()) train_sets.push_back("parallel.device=\"" + train_device + "\"");
    if (log_all_ranks) train_sets.push_back("log.all_ranks=true");
    if (train_force) train_sets.push_back("train.memory_check=\"warn\"");
    RunConfig cfg = load_run_config(train_config, train_sets);
    comm::catch_stop_signals();  // SIGTERM / SIGINT: stop after the step, with a checkpoint
    Trainer trainer(cfg, stdout);
    auto metrics = trainer.run();
    if (const int sig = trainer.stopped_by_signal()) {
      if (trainer.writer())
        std::fprintf(stderr, "bumblebee: stopped by signal %d after step %lld\n", sig,
                     static_cast<long long>(trainer.step()));
      return 128 + sig;
    }
    if (!metrics.empty() && trainer.writer())
      std::printf("%s[done] %lld steps, final loss %.4f (first %.4f)%s\n", trainer.log_prefix().c_str(),
                  static_cast<long long>(metrics.back().step), metrics.back().loss, metrics.front().loss,
                  cfg.comm == "emulated" ? " (an emulated rank: the loss is not the real job's)" : "");
    return 0;
  }
  if (exp->parsed()) {
    HfExportOptions eo;
    eo.dtype = dtype_from_name(exp_dtype);
    eo.max_shard_bytes = parse_byte_size(exp_shard);
    eo.allow_nonfinite = exp_allow_nonfinite;
    BB_CHECK(path_exists(exp_ckpt), "export: no checkpoint at '", exp_ckpt, "'");
    const std::string step = resolve_checkpoint(exp_ckpt);
    BB_CHECK(!step.empty(), "export: no checkpoint at '", exp_ckpt,
             "' (expected a step_* directory or a checkpoint root with a 'latest' file)");
    check_export_target(exp_out, exp_force);
    if (path_exists(path_join(step, "shards"))) export_distributed_checkpoint(step, exp_out, eo);
    else export_checkpoint(step, exp_out, eo);  // format 1 (single rank, before distributed state)
    std::printf("[export] %s -> %s (%s)\n", step.c_str(), exp_out.c_str(), exp_dtype.c_str());
    return 0;
  }
  if (plan->parsed() && plan_calibrate) {
    Device dev = Device::cpu();
#ifdef BB_WITH_CUDA
    if (cuda::device_count() > 0) dev = Device::cuda(0);
#endif
    BB_CHECK(dev.is_cuda() || plan_quick, "plan --calibrate: no usable GPU here; the time model's rates must be "
             "measured on the GPU the runs will use (--quick runs small shapes on the CPU as a smoke test)");
    std::fprintf(stderr, "[plan] calibrating on %s%s\n", dev.str().c_str(), plan_quick ? " (--quick: small shapes)" : "");
    const plan::Calibration cal =
        plan::calibrate(dev, plan_quick, [](const std::string& m) { std::fprintf(stderr, "[plan] %s\n", m.c_str()); });
    if (plan_out.empty()) {
      std::printf("%s\n", cal.to_json().dump(2).c_str());
    } else {
      cal.save(plan_out);
      std::fprintf(stderr, "[plan] wrote %s\n", plan_out.c_str());
    }
    return 0;
  }
  plan::Calibration loaded_cal;
  if (!plan_calibration.empty()) loaded_cal = plan::Calibration::load(plan_calibration);
  const plan::Calibration& cal = plan_calibration.empty() ? plan::Calibration::builtin() : loaded_cal;
  preq.calibration = &cal;
  if (plan->parsed() && plan_explain.empty()) {
    BB_CHECK(!plan_model.empty() && plan->count("--gpus") && plan->count("--seq"),
             "plan: give --explain RUN.toml, or --model CONFIG --gpus N --seq TOKENS to search layouts (see plan --help)");
    std::string toml = "[model]\nconfig = \"" + plan_model + "\"\n[parallel]\ndevice = \"cuda\"\n";
    RunConfig base = parse_run_config(toml, "plan --model", plan_sets);
    std::fprintf(stderr, "[plan] searching layouts of %lld GPUs for %s at %lld tokens per sequence\n",
                 static_cast<long long>(preq.gpus), plan_model.c_str(), static_cast<long long>(preq.seq));
    const plan::PlanResult r = plan::plan_layouts(base, preq, [](int64_t done, int64_t total) {
      if (done % 16 == 0 || done == total)
        std::fprintf(stderr, "[plan] %lld / %lld layouts predicted\n", static_cast<long long>(done), static_cast<long long>(total));
    });
    if (plan_json) {
      nlohmann::json j;
      j["usable_bytes"] = r.usable;
      j["why"] = r.why;
      j["calibration"] = cal.device;
      j["candidates"] = nlohmann::json::array();
      for (const plan::PlanCandidate& c : r.candidates) {
        nlohmann::json cj = nlohmann::json::parse(c.estimate.json());
        cj["fits"] = c.fits;
        cj["chosen"] = c.chosen;
        cj["time"] = c.time.json();
        j["candidates"].push_back(cj);
      }
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    std::printf("[plan] %s, %lld GPUs (%lld per node), %.1f GiB each (%s usable after the %.0f %% margin), %lld tokens "
                "per sequence: predicted peak per rank and step time (PREDICTED, not measured; calibration: %s)\n",
                plan_model.c_str(), static_cast<long long>(preq.gpus), static_cast<long long>(preq.gpus_per_node),
                preq.gpu_memory_gib, format_bytes(r.usable).c_str(), preq.margin * 100, static_cast<long long>(preq.seq),
                cal.device.c_str());
    std::printf("| layout | tokens/GPU | peak GiB | params+grads+optim | activations | moe | comm | logits | fits | "
                "step ms | tokens/s/GPU | TFLOP/s/GPU | not hidden ms (gather, reduce, ep, cp) | wire ms |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|\n");
    auto g = [](int64_t b) { return static_cast<double>(b) / double(int64_t{1} << 30); };
    for (const plan::PlanCandidate& c : r.candidates) {
      const plan::Bytes& p = c.estimate.peak;
      const plan::CommEstimate& ce = c.estimate.comm;
      const plan::TimeEstimate& t = c.time;
      std::printf("| %s%s | %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %.1f | %.0f | %.1f | %.1f, %.1f, %.1f, %.1f | %.1f |\n",
                  c.layout.str().c_str(), c.chosen ? " **chosen**" : "", static_cast<long long>(c.estimate.tokens_local),
                  g(c.estimate.peak_total), g(c.estimate.persistent.total()), g(p[MemCategory::activations]),
                  g(p[MemCategory::moe]), g(p[MemCategory::comm]), g(p[MemCategory::logits]), c.fits ? "yes" : "no",
                  t.step_s * 1e3, t.tokens_per_s(), t.tflops(), t.exposed_gather * 1e3, t.exposed_reduce * 1e3,
                  t.exposed_ep * 1e3, t.exposed_cp * 1e3, ce.total_s() * 1e3);
    }
    std::printf("[plan] %s\n", r.why.c_str());
    return 0;
  }
  if (plan->parsed()) {
    RunConfig cfg = load_run_config(plan_explain, plan_sets);
    if (cfg.auto_layout()) {
      // parallel = "auto": the layout the trainer would choose for --ranks (CPU ranks: no memory
      // limit; --gpu-memory for a GPU job).
      BB_CHECK(plan_ranks > 0 || cfg.comm == "emulated", "plan --explain: ", plan_explain,
               " leaves the layout to parallel = \"auto\"; give the job's size with --ranks N");
      const int64_t ranks = plan_ranks > 0 ? plan_ranks : cfg.emulate.ranks;
      const Device d = Device::parse(cfg.device == "auto" ? "cpu" : cfg.device);
      const int64_t available =
          d.is_cuda() ? static_cast<int64_t>(preq.gpu_memory_gib * (1 - preq.margin) * double(int64_t{1} << 30)) : 0;
      std::string why;
      cfg = plan::choose_auto_layout(cfg, ranks, available, &why);
      std::printf("[plan] %s\n", why.c_str());
    }
    // Without --ranks: the emulated job's, else dp x cp x pp, dp = 0 read as the fewest data
    // ranks that hold the expert-parallel group.
    const int64_t dp = cfg.dp > 0 ? cfg.dp : std::max<int64_t>(1, (cfg.ep + cfg.cp - 1) / cfg.cp);
    const int64_t world = plan_ranks > 0 ? plan_ranks : cfg.comm == "emulated" ? cfg.emulate.ranks : dp * cfg.cp * cfg.pp;
    plan::EstimateOptions eo;
    eo.rank = plan_rank;
    eo.expert_load = plan_expert_load;
    const plan::MemoryEstimate e = plan::estimate_memory(cfg, world, eo);
    const bool timed = e.device.is_cuda();
    plan::TimeEstimate te;
    if (timed) te = plan::estimate_time(cfg, e, cal);
    if (plan_json) {
      nlohmann::json j = nlohmann::json::parse(e.json());
      if (timed) j["time"] = te.json();
      std::printf("%s\n", j.dump().c_str());
      return 0;
    }
    std::printf("[plan] %s on %lld rank(s), layout %s, %s, %lld tokens per micro-batch on this rank (x %lld "
                "micro-batches): predicted memory per rank (PREDICTED, not measured)\n",
                cfg.model_config.c_str(), static_cast<long long>(world), e.layout.str().c_str(), e.device.str().c_str(),
                static_cast<long long>(e.tokens_local), static_cast<long long>(cfg.grad_accum));
    std::printf("%s", e.table(plan_moments).c_str());
    std::printf("[plan] peak %s at %s\n", format_bytes(e.peak_total).c_str(), e.peak_moment.c_str());
    for (const std::string& n : e.notes) std::printf("[plan] note: %s\n", n.c_str());
    if (timed) {
      std::printf("\n[plan] step time of this rank (PREDICTED, calibration: %s)\n%s", cal.device.c_str(), te.table().c_str());
      for (const std::string& n : te.assumptions) std::printf("[plan] assumed: %s\n", n.c_str());
    } else {
      std::printf("[plan] no step time: the time model is calibrated for GPUs (parallel.device = \"cuda\")\n");
    }
    return 0;
  }
  if (lpc->parsed()) {
    RunConfig cfg;
    if (!lp_config.empty()) {
      cfg = load_run_config(lp_config, lp_sets);
    } else {
      // The model from the weights: an HF directory's config.json, or the checkpoint's own.
      std::string model_cfg;
      std::string tmp;
      BB_CHECK(lp_weights != "init", "logprobs: --checkpoint init takes the model from --config; give one");
      if (lp_weights.rfind("hf:", 0) == 0) {
        model_cfg = lp_weights.substr(3);
      } else {
        BB_CHECK(path_exists(lp_weights), "logprobs: no checkpoint at '", lp_weights, "'");
        const std::string step = resolve_checkpoint(lp_weights);
        BB_CHECK(!step.empty(), "logprobs: no checkpoint at '", lp_weights, "'");
        tmp = path_join(std::filesystem::temp_directory_path().string(),
                        "bb_logprobs_model_" + std::to_string(::getpid()) + ".json");
        atomic_write(tmp, read_checkpoint_state(step)["model_config"].dump(2));
        model_cfg = tmp;
      }
      try {
        // A JSON string literal is a TOML basic string (the path quoted and escaped).
        cfg = parse_run_config("[model]\nconfig = " + nlohmann::json(model_cfg).dump() + "\n", "logprobs", lp_sets);
      } catch (...) {
        if (!tmp.empty()) std::filesystem::remove(tmp);
        throw;
      }
      if (!tmp.empty()) {
        std::filesystem::remove(tmp);
        cfg.model_config = lp_weights + " (its state.json)";
      }
    }
    DataConfig dc = cfg.data;
    dc.path = lp_data;
    dc.format = "jsonl";
    const Corpus docs = load_corpus(dc);
    LogprobsRunner runner(cfg, lp_weights, stdout);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<DocLogprobs> out = runner.run(docs, lp_temperature, lp_routing);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (runner.mesh().rank() == 0) {
      write_logprobs_jsonl(lp_out, docs, out, runner.model().num_moe_layers(), cfg.model.top_k);
      const MemoryStats m = allocator_for(cfg.resolved_device()).stats();
      std::printf("[logprobs] %lld documents, %lld tokens in %.2f s (%.0f tokens/s over %lld rank(s)); peak %s "
                  "(params %s, grads %s, optimizer %s); wrote %s\n",
                  static_cast<long long>(docs.num_documents()), static_cast<long long>(docs.num_tokens()), s,
                  static_cast<double>(docs.num_tokens()) / s, static_cast<long long>(runner.mesh().world()->size()),
                  format_bytes(m.peak_total).c_str(), format_bytes(m.peak[static_cast<int>(MemCategory::params)]).c_str(),
                  format_bytes(m.peak[static_cast<int>(MemCategory::grads)]).c_str(),
                  format_bytes(m.peak[static_cast<int>(MemCategory::optimizer)]).c_str(), lp_out.c_str());
    }
    return 0;
  }
  if (rep->parsed()) {
    const ReportSummary r = write_report(rep_inputs, rep_labels, rep_out);
    for (const std::string& w : r.warnings) std::fprintf(stderr, "[report] warning: %s\n", w.c_str());
    std::string runs;
    for (const MetricsRun& m : r.runs)
      runs += (runs.empty() ? "" : ", ") + m.label + ": " + std::to_string(m.rows.size()) + " steps";
    std::printf("[report] %zu run(s) (%s), %lld plots, %lld series -> %s\n", r.runs.size(), runs.c_str(),
                static_cast<long long>(r.num_plots), static_cast<long long>(r.num_series), rep_out.c_str());
    return 0;
  }
  if (paired->parsed()) {
    if (paired_force) po.common.push_back("train.memory_check=\"warn\"");
    PairedResult r = run_paired(po, stdout);
    return r.pass ? 0 : 1;
  }
  return 0;
}

}  // namespace bb::cli

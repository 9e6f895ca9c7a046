// bench_train_step — end-to-end training step of a model on one device, one sequence of S
// tokens per step, at several S. Prints tokens/s, model and hardware TFLOP/s and peak memory per
// category (DESIGN.md sec. 6: timings after warm-up, median of several steps).
//
//   bench_train_step [--config PATH] [--seq 8192,32768,65536,131072] [--steps 5] [--warmup 2]
//                    [--set table.key=value ...] [--profile] [--gpu-idle] [--kernels N] [--host-calls]
// --profile: the last step of each size runs under the built-in range profiler (core/trace.h)
// and its GPU time per BB_RANGE name is printed (CUDA builds), then per category (dense GEMMs,
// expert GEMMs, attention, Gated DeltaNet, loss head, optimizer, elementwise and other kernels,
// and the step time outside any range: idle / launch) with each category's achieved rate against
// its ceiling (category_table below). That last row is the step minus the ranges' GPU time, which
// is 0 whenever side streams overlap the compute stream; --gpu-idle measures the idle time itself.
// --gpu-idle: two more steps of each size (not in the median) run under CUPTI's activity
// records (bench/gpu_activity.h; libcupti.so.13 on the library path): the GPU's busy time (the
// union of every kernel, copy and memset on any stream), its idle time over the step (waiting
// for the host: launches, host syncs, host work between steps) and the longest idle gaps, of the
// second one (turning the records on costs the first one's early launches a few ms).
// --kernels N: --gpu-idle, and the N kernels of the traced step with the most GPU time (name,
// launches, summed ms; kernels on side streams overlap others, so the sums exceed the busy time),
// then its N longest idle gaps with what ran before and after each (a gap after a short kernel
// whose result the host reads, before the next launch, is a host synchronisation).
// --host-calls: --kernels (20 unless given), and the traced steps also record the host's CUDA runtime and driver
// calls (each costs ~1 us more, so the traced step is a little slower) and each listed gap shows
// them: the calls the host was in while the GPU waited, and the longest stretch without any
// CUDA call (host code) with the calls around it.
// --timeline PREFIX: after the timed steps, one more step of each size is traced with CUPTI
// (after a first traced step that absorbs CUPTI's setup) and written as a Chrome trace,
// PREFIX-<tokens>.json (one row per stream: chrome://tracing or ui.perfetto.dev), and a table
// says how much of each emulated communication class's wire time other GPU work covered
// (bench/timeline.h; meaningful with parallel.comm = "emulated").
// Emulated runs (--set parallel.comm='"emulated"' --set emulate.ranks=N ...): the process is
// one rank of an N-rank job (comm/emulated.h); the table is per GPU (a micro-batch of S tokens
// is split over parallel.cp ranks) and labelled EMULATED with the link model, and the modelled
// wire time of the step per communication class is printed beside it.
// --predict CAL: beside each measured step, the planner's prediction of the same run
// (plan::estimate_memory and plan::estimate_time with the calibration file CAL, or "builtin"):
// step ms, its error against the measured median, the predicted live peak against the measured
// peak and reserved peak (skills/planner.md, validation), and the predicted categories.
// --predict-only: no training; the prediction of each size for a GPU run (parallel.device =
// "cuda"), on any machine (to re-predict a measured table after a change of the model).
// Default model: the 4-layer slice of Qwen3-30B-A3B with recompute=full, loss=linear_ce,
// experts=grouped, on cuda:0 (falls back to a tiny CPU run if no GPU is visible).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#ifdef BB_WITH_CUDA
#include "gpu_activity.h"
#include "timeline.h"
#endif
#include "comm/emulated.h"
#include "core/rng.h"
#include "core/trace.h"
#include "plan/estimate.h"
#include "runtime/trainer.h"

using namespace bb;

namespace {
// Documents of exactly `len` tokens, one per step when `len` is the step's token count: the model
// sees one sequence of S tokens and trains S - 1 next-token targets, as the PyTorch reference
// (bench/hf_train_step.py) does. (Documents of S + 1 tokens would leave a one-token remainder,
// so every step after the first would be two sequences: 1 and S - 1 tokens.)
Corpus one_long_document(int64_t len, int64_t vocab, int64_t copies) {
  Corpus c;
  for (int64_t d = 0; d < copies; ++d) {
    std::vector<int32_t> doc(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i)
      doc[i] = static_cast<int32_t>(philox4x32_10(99 + d, static_cast<uint64_t>(i)).v[0] % vocab);
    c.add(doc);
  }
  return c;
}

// Recompute reruns every layer's forward once more (not the loss head).
double recompute_flops(const ModelConfig& m, int64_t S) {
  ModelConfig no_head = m;
  const double head = 2.0 * static_cast<double>(m.vocab_size) * m.hidden_size * S;
  return model_flops(no_head, {S}) / 3.0 - head;
}
// The categories of a step profile: which range names each one's exclusive GPU time comes from,
// and its work. Ranges not named here (block-level ranges: their glue kernels, copies and waits
// between the named primitives) count as "elementwise / other". Ceilings measured on an H200
// (bench/results/2026-11-30-h200.md: bf16 GEMM 769 TFLOP/s, copy kernel 3.87 TB/s).
struct Category {
  const char* name;
  std::vector<const char*> ranges;
  double work = 0;      // FLOPs, or bytes for the optimizer; 0: not rated
  const char* unit = "";
  double ceiling = 0;   // FLOP/s or B/s
};

void category_table(const std::vector<trace::RangeTotal>& totals, const RunConfig& cfg, int64_t S, double step_ms) {
  if (totals.empty()) return;  // no profile (a CPU build)
  const ModelConfig& m = cfg.model;
  const double T = static_cast<double>(S), H = static_cast<double>(m.hidden_size);
  const double n_moe = static_cast<double>(m.num_moe_layers());
  const double lin = static_cast<double>(m.num_linear_attention_layers());
  const double full = static_cast<double>(m.num_layers) - lin;
  // Layers run forward twice under full recompute: 3 passes (fwd + 2 bwd) -> 4.
  const double layer_passes = cfg.prim.recompute.value == RecomputePolicy::full ? 4.0 : 3.0;
  const double expert = 2.0 * T * static_cast<double>(m.top_k) * 3 * H * static_cast<double>(m.moe_intermediate_size) * n_moe;
  const double head = 2.0 * T * H * static_cast<double>(m.vocab_size);
  const double dense = 2.0 * T * static_cast<double>(m.active_matmul_params_per_token()) - expert - head;
  const double attn = full * 4.0 * (T * T / 2) * static_cast<double>(m.num_heads) * static_cast<double>(m.head_dim);
  const double gdn = lin * 6.0 * static_cast<double>(m.linear_key_head_dim) * static_cast<double>(m.linear_value_head_dim) *
                     static_cast<double>(m.linear_num_value_heads) * T;
  // AdamW per parameter (plan::adamw_update_bytes: 28 bytes with a split master and f32 moments).
  const double opt_bytes = static_cast<double>(m.num_params()) *
                           plan::adamw_update_bytes(cfg.prim.optimizer.value, cfg.resolved_param_dtype(),
                                                    cfg.backend.master_storage);
  const double gemm = 769e12, hbm = 3.87e12;
  std::vector<Category> cats = {
      {"dense GEMMs", {"linear_forward", "linear_backward_data", "linear_backward_weight"}, dense * layer_passes, "TFLOP/s", gemm},
      {"expert GEMMs", {"experts_forward", "experts_backward_data", "experts_backward_weight", "experts_forward_saved"},
       expert * layer_passes, "TFLOP/s", gemm},
      {"attention", {"attention_forward", "attention_backward"}, attn * layer_passes, "TFLOP/s", gemm},
      {"Gated DeltaNet", {"gated_delta_rule_forward", "gated_delta_rule_backward"}, gdn * layer_passes, "TFLOP/s", gemm},
      {"loss head",
       {"loss_head", "linear_ce_fused", "linear_ce_forward", "linear_ce_backward", "full_ce_forward", "full_ce_backward"},
       head * 3, "TFLOP/s", gemm},
      {"optimizer", {"optimizer_step", "adamw_step", "grad_norm", "global_grad_norm", "zero_grad"}, opt_bytes, "TB/s", hbm},
  };
  std::vector<double> ms(cats.size() + 1, 0.0);  // the last: elementwise / other
  double ranged = 0;
  for (const trace::RangeTotal& t : totals) {
    ranged += t.exclusive_ms;
    size_t c = cats.size();
    for (size_t i = 0; i < cats.size(); ++i)
      for (const char* r : cats[i].ranges)
        if (t.name == r) c = i;
    ms[c] += t.exclusive_ms;
  }
  std::printf("\nstep profile by category at %lld tokens (%.1f ms; exclusive GPU time of the ranges, so a "
              "range's nested primitives count in their own category; GPU waits for the host inside a "
              "range count there):\n", static_cast<long long>(S), step_ms);
  std::printf("%-22s | %9s | %6s | %12s | %10s | %10s\n", "category", "GPU ms", "%", "work", "rate", "of ceiling");
  auto row = [&](const char* name, double t, const Category* c) {
    if (c && c->work > 0 && t > 0) {
      const bool bytes = std::strcmp(c->unit, "TB/s") == 0;
      const double rate = c->work / (t * 1e-3);
      std::printf("%-22s | %9.2f | %5.1f%% | %9.2f %s | %6.1f %s | %9.1f%%\n", name, t, 100 * t / step_ms,
                  c->work / (bytes ? 1e9 : 1e12), bytes ? "GB" : "TF", rate / 1e12, c->unit, 100 * rate / c->ceiling);
    } else {
      std::printf("%-22s | %9.2f | %5.1f%% | %12s | %10s | %10s\n", name, t, 100 * t / step_ms, "-", "-", "-");
    }
  };
  for (size_t i = 0; i < cats.size(); ++i)
    if (ms[i] > 0 || cats[i].work > 0) row(cats[i].name, ms[i], &cats[i]);
  row("elementwise / other", ms[cats.size()], nullptr);
  row("idle / launch", std::max(0.0, step_ms - ranged), nullptr);
  std::printf("(work: model FLOPs per category for the step, 3 passes per layer, 4 under full recompute; "
              "optimizer: bytes moved. Ceilings: bf16 GEMM 769 TFLOP/s, copy kernel 3.87 TB/s, H200.)\n");
}
}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/models/qwen3-30b-a3b-4layer/config.json";
  std::vector<int64_t> seqs = {8192, 32768, 65536, 131072};
  int64_t steps = 5, warmup = 2;
  std::vector<std::string> sets;
  bool profile = false, gpu_idle = false;
  int64_t top_kernels = 0;
  bool host_calls = false;  // --host-calls
  std::string timeline;     // --timeline PREFIX
  std::string predict;      // --predict CALIBRATION|builtin
  bool predict_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "missing value after %s\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--config") config = next();
    else if (a == "--seq") seqs = bench::parse_list(next());
    else if (a == "--steps") steps = std::stoll(next());
    else if (a == "--warmup") warmup = std::stoll(next());
    else if (a == "--set") sets.push_back(next());
    else if (a == "--profile") profile = true;
    else if (a == "--gpu-idle") gpu_idle = true;
    else if (a == "--kernels") {
      top_kernels = std::stoll(next());
      if (top_kernels < 1) { std::fprintf(stderr, "--kernels needs a count >= 1\n"); return 2; }
      gpu_idle = true;
    } else if (a == "--host-calls") {
      host_calls = true;
    } else if (a == "--timeline") {
      timeline = next();
    } else if (a == "--predict") {
      predict = next();
    } else if (a == "--predict-only") {
      predict_only = true;
    } else { std::fprintf(stderr, "unknown argument %s (see the header of bench_train_step.cpp)\n", a.c_str()); return 2; }
  }
  if (host_calls && top_kernels == 0) top_kernels = 20, gpu_idle = true;  // the gaps are listed with --kernels
  struct Row {
    int64_t S;
    double tok_s, model_tf, hw_tf, step_ms;
    MemoryStats mem;
    int64_t syncs;
    std::string err;
    std::string idle;     // --gpu-idle: the traced step's line
    std::string kernels;  // --kernels: its table
    std::string comm;     // emulated: modelled wire ms per class of one step
    std::string overlap;  // --timeline: the traced step's hidden communication
    double pred_ms = 0;   // --predict: the planner's step time
    int64_t pred_peak = 0;
    std::string pred_table;
  };
#ifdef BB_WITH_CUDA
  std::unique_ptr<bench::GpuActivity> activity;
  if (gpu_idle) activity = std::make_unique<bench::GpuActivity>();
#endif
#ifdef BB_WITH_CUDA
  if (!timeline.empty() && !activity) activity = std::make_unique<bench::GpuActivity>();
#endif
  std::vector<Row> rows;
  std::string summary, emulated;
  plan::Calibration cal;
  if (!predict.empty()) cal = predict == "builtin" ? plan::Calibration::builtin() : plan::Calibration::load(predict);
  for (int64_t S : seqs) {
    Row r{S, 0, 0, 0, 0, {}, 0, "", "", "", "", "", 0, 0, ""};
    try {
      std::ostringstream toml;
      toml << "[model]\nconfig = \"" << config << "\"\n"
           << "[primitives]\nloss = \"linear_ce\"\nrecompute = \"full\"\nexperts = \"grouped\"\n"
           << "[parallel]\ndevice = \"auto\"\n"
           << "[train]\nsteps = " << (steps + warmup) << "\nmicro_batch_tokens = " << S
           << "\nwarmup_steps = 1\nlr = 1e-4\nmin_lr = 1e-5\n";
      std::vector<std::string> ov = sets;
      RunConfig cfg = parse_run_config(toml.str(), "bench_train_step", ov);
      if (predict_only) {
        RunConfig pc = cfg;
        pc.device = "cuda";
        const int64_t world = pc.comm == "emulated" ? pc.emulate.ranks : 1;
        const plan::MemoryEstimate pm = plan::estimate_memory(pc, world);
        const plan::TimeEstimate pt = plan::estimate_time(pc, pm, predict.empty() ? plan::Calibration::builtin() : cal);
        std::printf("PREDICTED at %lld tokens: step %.1f ms, live peak %.2f GiB\n%s\n", static_cast<long long>(S),
                    pt.step_s * 1e3, static_cast<double>(pm.peak_total) / double(int64_t{1} << 30), pt.table().c_str());
        continue;
      }
      Trainer tr(cfg, nullptr, one_long_document(S, cfg.model.vocab_size, 2));
      {  // what the start left on the device: the model's units taken over by the state family
        const MemoryStats st = allocator_for(tr.config().resolved_device()).stats();
        auto gib = [](int64_t b) { return static_cast<double>(b) / double(1 << 30); };
        std::fprintf(stderr,
                     "[bench] S=%lld startup: live %.2f GiB (params %.2f, grads %.2f, optimizer %.2f), peak %.2f GiB, "
                     "reserved %.2f GiB\n",
                     static_cast<long long>(S), gib(st.live_total), gib(st.live_of(MemCategory::params)),
                     gib(st.live_of(MemCategory::grads)), gib(st.live_of(MemCategory::optimizer)), gib(st.peak_total),
                     gib(st.reserved_peak));
      }
      const bool emu = tr.mesh().world()->backend() == comm::Backend::emulated;
      if (emu) emulated = cfg.emulate.str();
      std::vector<StepMetrics> ms;
      for (int64_t i = 0; i < steps + warmup; ++i) {
        const bool prof = profile && i + 1 == steps + warmup;
        if (prof) trace::profile_begin();
        const bool last = i + 1 == steps + warmup;
        if (emu && last) comm::reset_emulated_totals();
        StepMetrics m = tr.train_step();
        if (emu && last) {  // the modelled wire time of one step, per class
          const comm::EmulatedTotals t = comm::emulated_totals();
          std::ostringstream c;
          for (int k = 0; k < comm::EmulatedTotals::kClasses; ++k)
            if (t.ops[k] > 0) {
              char b[128];
              std::snprintf(b, sizeof b, "%s%s %.2f ms (%lld ops, %.2f GB)", c.tellp() > 0 ? ", " : "",
                            comm::EmulatedTotals::class_name(k), t.seconds[k] * 1e3, static_cast<long long>(t.ops[k]),
                            static_cast<double>(t.bytes[k]) / 1e9);
              c << b;
            }
          r.comm = c.str();
        }
        if (prof) {
          std::printf("\nprofile of one step at %lld tokens (%.1f ms):\n", static_cast<long long>(S),
                      m.step_time_s * 1e3);
          category_table(trace::profile_report(stdout, m.step_time_s * 1e3), cfg, S, m.step_time_s * 1e3);
        }
        std::string host_update;  // primitives.optimizer = "adamw_offload": the host's update time so far
        if (OptimizerOffload* off = tr.state().offload()) {
          char b[96];
          std::snprintf(b, sizeof b, ", host update %.3fs on %d threads", off->take_busy_seconds(), off->threads());
          host_update = b;
        }
        std::fprintf(stderr, "[bench] S=%lld step %lld: %.3fs loss %.4f, peak %.2f GiB, reserved %.2f GiB%s\n",
                     static_cast<long long>(S), static_cast<long long>(i + 1), m.step_time_s, m.loss,
                     static_cast<double>(m.mem.peak_total) / double(1 << 30),
                     static_cast<double>(m.mem.reserved_peak) / double(1 << 30), host_update.c_str());
        if (i >= warmup) ms.push_back(m);
      }
      if (gpu_idle) {
#ifdef BB_WITH_CUDA
        if (!activity->usable()) {
          r.idle = "not measured: " + activity->error;
        } else {
          activity->begin(host_calls);  // a first traced step absorbs CUPTI's setup
          tr.train_step();
          activity->end();
          activity->begin(host_calls);
          const StepMetrics m = tr.train_step();  // ends with a device sync
          const bench::GpuActivity::Result a = activity->end();
          char buf[512];
          int n = std::snprintf(buf, sizeof buf,
                                "step %.1f ms (traced; window %.1f ms), GPU busy %.2f ms, idle %.2f ms (%.1f %%) in %zu gaps >= 10 us; "
                                "longest (length @ start):", m.step_time_s * 1e3, a.window_ms, a.busy_ms, a.idle_ms,
                                a.window_ms > 0 ? 100 * a.idle_ms / a.window_ms : 0.0, a.gaps.size());
          for (size_t i = 0; i < a.gaps.size() && i < 5 && n > 0 && n < static_cast<int>(sizeof buf); ++i)
            n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), " %.3f @ %.1f", a.gaps[i].ms,
                               a.gaps[i].start);
          if (a.gaps.empty() && n > 0 && n < static_cast<int>(sizeof buf)) n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), " -");
          r.idle = a.window_ms > 0 ? std::string(buf) + " ms; " + std::to_string(a.records) + " records"
                                   : "not measured: CUPTI gave no timestamps (is the run on a GPU?)";
          if (top_kernels > 0 && a.window_ms > 0) {
            double all = 0;
            for (const auto& k : a.kernels) all += k.ms;
            std::ostringstream t;
            char line[256];
            std::snprintf(line, sizeof line, "kernels of the traced step at %lld tokens (%zu names, %.1f kernel-ms in all), most GPU time first:\n",
                          static_cast<long long>(S), a.kernels.size(), all);
            t << line;
            for (size_t i = 0; i < a.kernels.size() && static_cast<int64_t>(i) < top_kernels; ++i) {
              const auto& k = a.kernels[i];
              std::snprintf(line, sizeof line, "  %9.3f ms %6lld x %8.1f us  %s\n", k.ms,
                            static_cast<long long>(k.launches), 1e3 * k.ms / static_cast<double>(k.launches),
                            k.name.c_str());
              t << line;
            }
            std::snprintf(line, sizeof line, "longest idle gaps of that step (at most %lld; ms after the step's start, length, what ran before and after):\n",
                          static_cast<long long>(top_kernels));
            t << line;
            for (size_t i = 0; i < a.gaps.size() && static_cast<int64_t>(i) < top_kernels; ++i) {
              const auto& g = a.gaps[i];
              char gl[384];
              std::snprintf(gl, sizeof gl, "  %8.2f ms  %7.1f us  after %s  before %s\n", g.start, 1e3 * g.ms,
                            g.before.c_str(), g.after.c_str());
              t << gl;
              if (!g.host.empty()) t << "             host: " << g.host << "\n";
            }
            r.kernels = t.str();
          }
        }
#else
        r.idle = "not measured: a CPU build";
#endif
      }
      if (!timeline.empty()) {
#ifdef BB_WITH_CUDA
        if (!activity->usable()) {
          r.overlap = "not traced: " + activity->error;
        } else if (tr.config().resolved_device().is_cuda()) {
          activity->begin();
          tr.train_step();  // absorbs CUPTI's setup
          activity->end();
          activity->begin();
          bench::StreamMarker marker(tr.config().resolved_device());
          const StepMetrics m = tr.train_step();
          const bench::GpuActivity::Result a = activity->end();
          const std::string path = timeline + "-" + std::to_string(S) + ".json";
          char title[512];
          std::snprintf(title, sizeof title, "%s, %lld tokens per micro-batch, step %.1f ms%s%s", config.c_str(),
                        static_cast<long long>(S), m.step_time_s * 1e3, emu ? ", " : "", emulated.c_str());
          const bool ok = bench::write_chrome_trace(path, a, marker.names(a), title);
          r.overlap = std::string("traced step ") + std::to_string(m.step_time_s * 1e3).substr(0, 8) + " ms, " +
                      (ok ? "timeline " + path : "could not write " + path) + "\n" +
                      bench::overlap_table(bench::comm_overlap(a));
        }
#else
        r.overlap = "not traced: a CPU build";
#endif
      }
      std::sort(ms.begin(), ms.end(), [](const StepMetrics& a, const StepMetrics& b) { return a.step_time_s < b.step_time_s; });
      // The median; with an even count the lower middle (2 steps: the faster, since a second step
      // can still be warming up: allocator growth, plan caches).
      const StepMetrics& med = ms[(ms.size() - 1) / 2];
      // Per GPU: a micro-batch's tokens (and work) are split over its cp ranks.
      const double cp = static_cast<double>(tr.mesh().layout().cp);
      const double mf = model_flops(cfg.model, {S}) / cp;
      r.step_ms = med.step_time_s * 1e3;
      r.tok_s = static_cast<double>(S) / cp / med.step_time_s;
      r.model_tf = mf / med.step_time_s / 1e12;
      r.hw_tf = (mf + (cfg.prim.recompute.value == RecomputePolicy::full ? recompute_flops(cfg.model, S) / cp : 0.0)) /
                med.step_time_s / 1e12;
      if (summary.empty()) summary = cfg.primitives_summary() + "\nbackend: " + cfg.backend.summary();
      r.mem = med.mem;
      r.syncs = med.host_syncs;
      if (!predict.empty()) {
        const int64_t world = tr.mesh().world()->size();
        RunConfig pc = cfg;
        if (pc.device == "auto") pc.device = tr.config().resolved_device().is_cuda() ? "cuda" : "cpu";
        const plan::MemoryEstimate pm = plan::estimate_memory(pc, world);
        const plan::TimeEstimate pt = plan::estimate_time(pc, pm, cal);
        r.pred_ms = pt.step_s * 1e3;
        r.pred_peak = pm.peak_total;
        r.pred_table = pt.table();
      }
    } catch (const std::exception& e) {
      r.err = e.what();
    }
    rows.push_back(r);
  }
  if (predict_only) return 0;
  std::printf("\nend-to-end training step: %s\nprimitives: %s\n", config.c_str(), summary.c_str());
  if (!emulated.empty())
    std::printf("%s\nEMULATED: one rank of the job; compute, memory and streams measured, the wire time modelled. "
                "Per GPU: tokens/s and TFLOP/s of this rank (a micro-batch split over cp ranks); memory: this rank's.\n",
                emulated.c_str());
  std::printf("%8s | %10s | %12s | %10s | %10s | %8s | %10s %10s %10s %10s %10s %10s %10s | %10s\n", "tokens",
              "step ms", "tokens/s/GPU", "model TF/s", "hw TF/s", "syncs", "params", "grads", "optim", "activ",
              "logits", "moe", "workspace", "reserved");
  auto g = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024 * 1024); };
  for (const Row& r : rows) {
    if (!r.err.empty()) {
      std::printf("%8lld | failed: %s\n", static_cast<long long>(r.S), r.err.c_str());
      continue;
    }
    const auto& p = r.mem.peak;
    std::printf("%8lld | %10.1f | %12.0f | %10.1f | %10.1f | %8lld | %9.2fG %9.2fG %9.2fG %9.2fG %9.2fG %9.2fG %9.2fG | %9.2fG\n",
                static_cast<long long>(r.S), r.step_ms, r.tok_s, r.model_tf, r.hw_tf, static_cast<long long>(r.syncs),
                g(p[0]), g(p[1]), g(p[2]), g(p[3]), g(p[4]), g(p[5]), g(p[7]), g(r.mem.reserved_peak));
  }
  if (!predict.empty()) {
    std::printf("\nPREDICTED (bumblebee's planner, calibration: %s) against the measured step above:\n", cal.device.c_str());
    std::printf("| tokens | measured step ms | predicted ms | error | measured peak GiB | predicted peak GiB | error | "
                "measured reserved GiB |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const Row& r : rows) {
      if (!r.err.empty() || r.pred_ms <= 0) continue;
      std::printf("| %lld | %.1f | %.1f | %+.1f %% | %.2f | %.2f | %+.1f %% | %.2f |\n", static_cast<long long>(r.S),
                  r.step_ms, r.pred_ms, 100 * (r.pred_ms / r.step_ms - 1), g(r.mem.peak_total), g(r.pred_peak),
                  100 * (static_cast<double>(r.pred_peak) / static_cast<double>(std::max<int64_t>(1, r.mem.peak_total)) - 1),
                  g(r.mem.reserved_peak));
    }
    for (const Row& r : rows)
      if (!r.pred_table.empty()) std::printf("\nat %lld tokens:\n%s", static_cast<long long>(r.S), r.pred_table.c_str());
  }
  for (const Row& r : rows)
    if (!r.comm.empty())
      std::printf("EMULATED wire time of one step at %lld tokens (modelled): %s\n", static_cast<long long>(r.S),
                  r.comm.c_str());
  for (const Row& r : rows)
    if (!r.overlap.empty())
      std::printf("\n%scommunication of the traced step at %lld tokens: %s\n", emulated.empty() ? "" : "EMULATED ",
                  static_cast<long long>(r.S), r.overlap.c_str());
  for (const Row& r : rows)
    if (!r.idle.empty()) std::printf("GPU idle at %lld tokens: %s\n", static_cast<long long>(r.S), r.idle.c_str());
  for (const Row& r : rows)
    if (!r.kernels.empty()) std::printf("\n%s", r.kernels.c_str());
  return 0;
}

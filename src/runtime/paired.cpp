#include "runtime/paired.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "io/fs.h"
#include "runtime/context_shard.h"

namespace bb {

namespace {

struct Side {
  std::vector<StepMetrics> steps;
  std::vector<float> logits;
  std::vector<std::pair<std::string, std::vector<float>>> grads;  // after step 1
  int ranks = 1;
  std::vector<int64_t> rank_peaks;  // peak total per rank over the side's steps
};

// The ranks a side runs on: its layout's product (dp = 0: every rank) of the job's first ranks;
// the others wait. Returns the side's group on its ranks, null on the others. Collective.
comm::GroupPtr side_group(const RunConfig& cfg, const comm::GroupPtr& world) {
  const int64_t n = cfg.dp == 0 ? world->size() : cfg.dp * cfg.cp * cfg.pp;
  BB_CHECK(n >= 1 && n <= world->size(), "paired: a side's layout needs ", n, " ranks, the job has ",
           world->size(), " (launch with mpirun -np ", n, " or more)");
  const bool in = world->rank() < n;
  comm::GroupPtr g = world->split(in ? 0 : 1, world->rank(), "world");
  return in ? g : nullptr;
}

Side run_side(const PairedOptions& o, const std::vector<std::string>& side, const char* label, FILE* out,
              const comm::GroupPtr& world) {
  std::vector<std::string> ov = o.common;
  ov.insert(ov.end(), side.begin(), side.end());
  ov.push_back("train.steps=" + std::to_string(o.steps));
  // The paired tool never touches the run's checkpoints or metrics file.
  ov.push_back("checkpoint.dir=\"\"");
  ov.push_back("checkpoint.resume=\"\"");
  ov.push_back("log.metrics=\"\"");
  RunConfig cfg = load_run_config(o.config_path, ov);
  comm::GroupPtr group = side_group(cfg, world);
  Side s;
  if (!group) {  // not a rank of this side: wait for it however long it runs
    const double t = comm::timeout();
    comm::set_timeout(86400);
    world->barrier();
    comm::set_timeout(t);
    return s;
  }
  Trainer tr(cfg, nullptr, Corpus{}, group);
  s.ranks = group->size();
  if (out) {
    std::fprintf(out, "[paired] side %s: %s\n", label, cfg.primitives_summary().c_str());
    std::fprintf(out, "[paired] side %s: %d rank(s), layout %s, state %s\n", label, group->size(),
                 tr.mesh().layout().str().c_str(), cfg.prim.state.name.c_str());
    std::fprintf(out, "[paired] side %s backend: %s\n", label, cfg.backend.summary().c_str());
    std::fflush(out);
  }
  {
    DataLoader first(cfg.data);  // the same first micro-batch the trainer will see
    const int64_t cp = tr.mesh().layout().cp;
    MicroBatch mb = to_device(shard_micro_batch(first.next_step(1).front(), cp, tr.mesh().cp_rank()), cfg.resolved_device());
    Tensor logits;
    tr.schedule().forward(mb, &logits);
    if (cp == 1) {
      s.logits = logits.to_floats();
    } else {
      // Context parallelism: each rank has its shard's rows; gather them (rank order) and put
      // them back in the whole micro-batch's order.
      std::vector<int64_t> counts, order;
      for (int64_t r = 0; r < cp; ++r) {
        const std::vector<int64_t> rows = cp_layout::global_rows(mb.shard.seqlens, cp, r);
        counts.push_back(static_cast<int64_t>(rows.size()));
        order.insert(order.end(), rows.begin(), rows.end());
      }
      const int64_t V = logits.size(1);
      Tensor mine = logits.to_dtype(DType::f32, MemCategory::other);
      Tensor all = Tensor::empty({static_cast<int64_t>(order.size()), V}, DType::f32, mine.device(), MemCategory::other);
      tr.mesh().cp()->all_gather_v(mine, all, counts)->wait();
      const std::vector<float> gathered = all.to_floats();
      s.logits.assign(gathered.size(), 0.0f);
      for (size_t m = 0; m < order.size(); ++m)
        std::copy_n(gathered.begin() + static_cast<int64_t>(m) * V, V,
                    s.logits.begin() + order[m] * V);
    }
  }
  for (int64_t i = 0; i < o.steps; ++i) {
    s.steps.push_back(tr.train_step());
    if (i == 0) {  // the gradients of step 1 stay until the next step zeroes them
      std::vector<ParamUnit*> units = tr.model().units();
      std::vector<Tensor> whole;  // gathered where the state family shards them (collective)
      for (size_t u = 0; u < units.size(); ++u) whole.push_back(tr.state().gather_grad(u));
      const int64_t E = cfg.model.num_experts;
      for (Param* p : tr.model().params()) {
        Tensor g = unit_slice(whole[static_cast<size_t>(p->unit->index)], *p);
        if (p->unit->kind == UnitKind::experts && p->unit->num_experts < E) {
          // Expert parallelism: this rank holds experts [first, first + E_l) of the parameter;
          // the EP group's slices in rank order are the whole [E, ...] gradient (collective).
          comm::Group& ep = *tr.mesh().ep();
          const Device dev = cfg.resolved_device();
          Tensor mine = g.view({g.numel()}).to(dev, MemCategory::other);
          Tensor all = Tensor::empty({g.numel() * ep.size()}, DType::f32, dev, MemCategory::other);
          ep.all_gather(mine, all)->wait();
          s.grads.emplace_back(p->name, all.to_floats());
          continue;
        }
        s.grads.emplace_back(p->name, g.to_floats());
      }
    }
    if (out) {
      std::fprintf(out, "[paired] side %s step %lld/%lld loss %.6f\n", label,
                   static_cast<long long>(i + 1), static_cast<long long>(o.steps), s.steps.back().loss);
      std::fflush(out);
    }
  }
  if (!o.metrics.empty()) {
    // The side's first rank writes; every rank of the side learns whether it could.
    std::string side_name = label, err;
    for (char& c : side_name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const std::string path = o.metrics + "." + side_name + ".jsonl";
    int64_t failed = 0;
    if (group->rank() == 0) {
      try {
        std::string rows;
        for (const StepMetrics& m : s.steps) rows += tr.metrics_line(m) + "\n";
        const auto slash = path.find_last_of('/');
        if (slash != std::string::npos && slash > 0) make_dirs(path.substr(0, slash));
        atomic_write(path, rows);
      } catch (const std::exception& e) {
        err = e.what();
        failed = 1;
      }
    }
    group->all_reduce_host(&failed, 1, comm::ReduceOp::max);
    BB_CHECK(failed == 0, "paired --metrics: cannot write side ", label, "'s metrics file ", path,
             err.empty() ? std::string(" (see the side's first rank)") : ": " + err);
    if (out) {
      std::fprintf(out, "[paired] side %s metrics: %s\n", label, path.c_str());
      std::fflush(out);
    }
  }
  s.rank_peaks.assign(static_cast<size_t>(group->size()), 0);
  for (const StepMetrics& m : s.steps)
    s.rank_peaks[static_cast<size_t>(group->rank())] = std::max(s.rank_peaks[static_cast<size_t>(group->rank())], m.mem.peak_total);
  group->all_reduce_host(s.rank_peaks.data(), static_cast<int64_t>(s.rank_peaks.size()), comm::ReduceOp::sum);
  world->barrier();
  return s;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(a), 1e-12); }

double median_time(const std::vector<StepMetrics>& v) {
  std::vector<double> t;
  for (size_t i = v.size() > 1 ? 1 : 0; i < v.size(); ++i) t.push_back(v[i].step_time_s);
  std::sort(t.begin(), t.end());
  return t.empty() ? 0 : t[t.size() / 2];
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s.empty() ? "(baseline)" : s;
}

}  // namespace

namespace {

// Runs `steps` untimed steps of one side in a trainer that is then dropped.
void warm_up(const PairedOptions& o, const std::vector<std::string>& side, int64_t steps,
             const char* label, FILE* out, const comm::GroupPtr& world) {
  std::vector<std::string> ov = o.common;
  ov.insert(ov.end(), side.begin(), side.end());
  ov.push_back("train.steps=" + std::to_string(steps));
  ov.push_back("checkpoint.dir=\"\"");
  ov.push_back("checkpoint.resume=\"\"");
  ov.push_back("log.metrics=\"\"");
  const RunConfig cfg = load_run_config(o.config_path, ov);
  if (comm::GroupPtr group = side_group(cfg, world)) {
    Trainer tr(cfg, nullptr, Corpus{}, group);
    for (int64_t i = 0; i < steps; ++i) tr.train_step();
    world->barrier();
  } else {  // not a rank of this side: wait for it however long it runs
    const double t = comm::timeout();
    comm::set_timeout(86400);
    world->barrier();
    comm::set_timeout(t);
  }
  if (out) {
    std::fprintf(out, "[paired] warm-up of side %s: %lld untimed step(s)\n", label,
                 static_cast<long long>(steps));
    std::fflush(out);
  }
}

}  // namespace

PairedResult run_paired(const PairedOptions& o, FILE* out) {
  BB_CHECK(o.steps >= 1, "paired: --steps must be >= 1");
  BB_CHECK(!o.a.empty() || !o.b.empty(), "paired: give at least one --a or --b override (KEY=VALUE)");
  BB_CHECK(o.warmup_steps >= -1, "paired: --warmup must be >= 0 (or -1 for the default)");
  // Both sides' configs are checked before either runs.
  RunConfig cfg_a, cfg_b;
  {
    std::vector<std::string> ova = o.common, ovb = o.common;
    ova.insert(ova.end(), o.a.begin(), o.a.end());
    ovb.insert(ovb.end(), o.b.begin(), o.b.end());
    cfg_a = load_run_config(o.config_path, ova);
    cfg_b = load_run_config(o.config_path, ovb);
  }
  BB_CHECK(cfg_a.backend.cudnn_library == cfg_b.backend.cudnn_library,
           "paired: backend.cudnn_library differs between the sides ('", cfg_a.backend.cudnn_library,
           "' vs '", cfg_b.backend.cudnn_library,
           "'); cuDNN is loaded once per process, so compare two libraries with two `train` runs");
  // An emulated rank's losses and gradients are not its job's (comm/emulated.h): nothing for
  // paired to compare. Its timings are bench_train_step's and bench_moe_layer's business.
  for (const RunConfig* c : {&cfg_a, &cfg_b})
    BB_CHECK(c->comm != "emulated", "paired compares the losses, logits and gradients of two runs, but parallel.comm = ",
             "\"emulated\" times and sizes one rank whose numbers are not the real job's; compare emulated step times ",
             "with bench_train_step (or bench/emulated.sh) instead");
  // One communicator for the job; each side runs on its first ranks. Only rank 0 reports.
  comm::set_timeout(cfg_a.comm_timeout_s);
  comm::GroupPtr world = default_world(cfg_a);
  if (world->rank() != 0) out = nullptr;
  // What the trainer of either side would refuse is refused now, before side A spends its time:
  // the layout on the side's ranks, the device, the data source, and that both are one model.
  for (const auto& [cfg, label] : {std::pair<const RunConfig&, const char*>{cfg_a, "A"}, {cfg_b, "B"}}) {
    try {
      const int64_t n = cfg.dp == 0 ? world->size() : cfg.dp * cfg.cp * cfg.pp;
      BB_CHECK(n >= 1 && n <= world->size(), "its layout needs ", n, " ranks, the job has ", world->size(),
               " (launch with mpirun -np ", n, " or more)");
      resolve_layout(cfg, n);
      (void)cfg.resolved_device();
      (void)cfg.resolved_param_dtype();
      const std::string fmt = resolve_format(cfg.data);
      BB_CHECK(fmt == "demo" || path_exists(cfg.data.path), "data file '", cfg.data.path, "' not found");
      // The data's content too (a bad record of side B's file was found after side A's steps):
      // loaded once here for each side whose data source differs from side A's.
      const bool same_as_a = &cfg != &cfg_a && cfg.data.path == cfg_a.data.path && cfg.data.format == cfg_a.data.format &&
                             cfg.data.vocab_size == cfg_a.data.vocab_size && cfg.data.eos_id == cfg_a.data.eos_id &&
                             cfg.data.demo_documents == cfg_a.data.demo_documents &&
                             cfg.data.max_line_bytes == cfg_a.data.max_line_bytes;
      if (fmt != "demo" && !same_as_a) (void)load_corpus(cfg.data);
      if (cfg.model_init.rfind("hf:", 0) == 0) {
        const std::string hf = cfg.model_init.substr(3);
        BB_CHECK(is_directory(hf) && path_exists(path_join(hf, "config.json")), "model.init = '", cfg.model_init,
                 "': no Hugging Face checkpoint directory with a config.json there");
      }
    } catch (const std::exception& e) {
      BB_FAIL("paired: side ", label, " cannot run: ", e.what());
    }
  }
  BB_CHECK(cfg_a.model == cfg_b.model, "paired: the sides train different models (model.config '",
           cfg_a.model_config, "' vs '", cfg_b.model_config, "'); A and B must be the same model");
  int64_t warm = o.warmup_steps;
  if (warm < 0)
    warm = cfg_a.resolved_device().is_cuda() || cfg_b.resolved_device().is_cuda() ? 1 : 0;
  if (warm > 0) {
    warm_up(o, o.a, warm, "A", out, world);
    warm_up(o, o.b, warm, "B", out, world);
  }
  Side a = run_side(o, o.a, "A", out, world);
  Side b = run_side(o, o.b, "B", out, world);
  PairedResult r;
  if (world->rank() != 0) {
    // The verdict is rank 0's; every rank returns it.
    std::string verdict;
    world->broadcast_host(verdict, 0);
    r.pass = verdict.rfind("PASS", 0) == 0;
    r.verdict = verdict;
    return r;
  }
  r.a = a.steps;
  r.b = b.steps;
  BB_CHECK(a.logits.size() == b.logits.size(), "paired: the two sides produce logits of different sizes (",
           a.logits.size(), " vs ", b.logits.size(), "): A and B must be the same model");
  // A difference that is not a number (one side's loss, norm, logit or gradient is NaN or Inf) is
  // the largest there is, not one that std::max would drop.
  auto worst = [](double m, double v) { return std::isnan(v) ? INFINITY : std::max(m, v); };
  for (size_t i = 0; i < a.logits.size(); ++i)
    r.max_logits_diff = worst(r.max_logits_diff, static_cast<double>(std::fabs(a.logits[i] - b.logits[i])));
  for (size_t i = 0; i < r.a.size(); ++i) {
    // A step both sides skipped for the same reason (no loss targets, say) has nothing to compare.
    if (!r.a[i].skipped.empty() && r.a[i].skipped == r.b[i].skipped) continue;
    r.max_loss_rel = worst(r.max_loss_rel, rel(r.a[i].loss, r.b[i].loss));
    r.max_grad_norm_rel = worst(r.max_grad_norm_rel, rel(r.a[i].grad_norm, r.b[i].grad_norm));
  }
  BB_CHECK(a.grads.size() == b.grads.size(), "paired: the two sides have different parameters (",
           a.grads.size(), " vs ", b.grads.size(), "): A and B must be the same model");
  for (size_t i = 0; i < a.grads.size(); ++i) {
    const auto& [name, ga] = a.grads[i];
    const std::vector<float>& gb = b.grads[i].second;
    BB_CHECK(name == b.grads[i].first && ga.size() == gb.size(), "paired: parameter ", name,
             " differs between the sides");
    double num = 0, den = 0;
    for (size_t j = 0; j < ga.size(); ++j) {
      const double d = static_cast<double>(ga[j]) - gb[j];
      num += d * d;
      den += static_cast<double>(ga[j]) * ga[j];
    }
    // Both zero: equal. A zero, B not: as different as it gets; so is a NaN or Inf anywhere.
    const double e = !std::isfinite(num) || !std::isfinite(den) ? INFINITY
                     : num == 0                                  ? 0.0
                     : den == 0                                  ? INFINITY
                                                                 : std::sqrt(num / den);
    r.grad_rel.emplace_back(name, e);
    r.max_grad_rel = worst(r.max_grad_rel, e);
  }
  std::stable_sort(r.grad_rel.begin(), r.grad_rel.end(),
                   [](const auto& x, const auto& y) { return x.second > y.second; });
  const double ta = median_time(r.a), tb = median_time(r.b);
  r.step_time_ratio = ta > 0 ? tb / ta : 0;
  r.pass = r.max_loss_rel <= o.tol_loss && r.max_grad_norm_rel <= o.tol_grad_norm &&
           r.max_logits_diff <= o.tol_logits && r.max_grad_rel <= o.tol_grad;

  if (out) {
    std::fprintf(out, "\npaired baseline: %s\n  A: %s\n  B: %s\n\n", o.config_path.c_str(), join(o.a).c_str(), join(o.b).c_str());
    std::fprintf(out, "%5s | %14s %14s %10s | %12s %12s %10s\n", "step", "loss A", "loss B", "rel diff",
                 "gnorm A", "gnorm B", "rel diff");
    for (size_t i = 0; i < r.a.size(); ++i)
      std::fprintf(out, "%5lld | %14.8f %14.8f %10.2e | %12.6f %12.6f %10.2e\n", static_cast<long long>(r.a[i].step),
                   r.a[i].loss, r.b[i].loss, rel(r.a[i].loss, r.b[i].loss), r.a[i].grad_norm, r.b[i].grad_norm,
                   rel(r.a[i].grad_norm, r.b[i].grad_norm));
    std::fprintf(out, "\nmax |logits A - logits B| on the first micro-batch: %.3e (tol %.1e)\n",
                 r.max_logits_diff, o.tol_logits);
    std::fprintf(out, "\ngradients after step 1, ||g_A - g_B|| / ||g_A|| (worst %d of %zu, tol %.1e):\n",
                 static_cast<int>(std::min<size_t>(10, r.grad_rel.size())), r.grad_rel.size(),
                 o.tol_grad);
    for (size_t i = 0; i < r.grad_rel.size() && i < 10; ++i)
      std::fprintf(out, "  %-60s %10.2e%s\n", r.grad_rel[i].first.c_str(), r.grad_rel[i].second,
                   r.grad_rel[i].second > o.tol_grad ? "  <- above tolerance" : "");
    std::fprintf(out, "\n");
    std::fprintf(out, "%-12s | %14s %14s\n", "peak memory", "A", "B");
    // Maxima over the steps and over each side's ranks.
    std::fprintf(out, "(ranks: A %d, B %d; the maximum over ranks)\n", a.ranks, b.ranks);
    auto peak_max = [](const std::vector<StepMetrics>& v, int c) {
      int64_t m = 0;
      for (const auto& s : v) m = std::max(m, c < 0 ? s.mem_max.peak_total : s.mem_max.peak[c]);
      return m;
    };
    for (int c = -1; c < kNumMemCategories; ++c) {
      const int64_t pa = peak_max(r.a, c), pb = peak_max(r.b, c);
      if (c >= 0 && pa == 0 && pb == 0) continue;
      std::fprintf(out, "%-12s | %14s %14s\n", c < 0 ? "total" : category_name(static_cast<MemCategory>(c)),
                   format_bytes(pa).c_str(), format_bytes(pb).c_str());
    }
    for (const auto& [label, side] : {std::pair<const char*, const Side*>{"A", &a}, {"B", &b}}) {
      std::fprintf(out, "peak total per rank, %s:", label);
      for (int64_t v : side->rank_peaks) std::fprintf(out, " %s", format_bytes(v).c_str());
      std::fprintf(out, "\n");
    }
    std::fprintf(out, "\nstep time (median): A %.4fs, B %.4fs, ratio B/A %.3f\n", ta, tb, r.step_time_ratio);
  }
  char buf[768];
  std::snprintf(buf, sizeof buf,
                "%s: max loss rel diff %.2e (tol %.1e), max grad-norm rel diff %.2e (tol %.1e), "
                "max logits diff %.2e (tol %.1e), max gradient rel diff %.2e (tol %.1e)",
                r.pass ? "PASS" : "FAIL", r.max_loss_rel, o.tol_loss, r.max_grad_norm_rel,
                o.tol_grad_norm, r.max_logits_diff, o.tol_logits, r.max_grad_rel, o.tol_grad);
  r.verdict = buf;
  if (out) std::fprintf(out, "%s\n", r.verdict.c_str());
  std::string verdict = r.verdict;
  world->broadcast_host(verdict, 0);
  return r;
}

}  // namespace bb

#include "runtime/trainer.h"

#include "core/trace.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include "io/fs.h"
#include "io/safetensors.h"
#include "models/hf_io.h"
#include "primitives/optim/adamw.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

ModelOptions model_options(const RunConfig& c) {
  ModelOptions o;
  o.prims = c.prim;
  o.aux_loss_coef = c.effective_aux_coef();
  o.z_loss_coef = c.z_loss_coef;
  o.device = c.resolved_device();
  o.param_dtype = c.resolved_param_dtype();
  return o;
}

std::vector<int64_t> seq_lens(const MicroBatch& mb) {
  std::vector<int32_t> cu = mb.cu_seqlens.to_ints();
  std::vector<int64_t> out;
  for (size_t i = 1; i < cu.size(); ++i) out.push_back(cu[i] - cu[i - 1]);
  return out;
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  if (is_directory(path)) {
    if (DIR* d = opendir(path.c_str())) {
      while (dirent* e = readdir(d)) {
        const std::string n = e->d_name;
        if (n == "." || n == "..") continue;
        remove_tree(path_join(path, n));
      }
      closedir(d);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

std::vector<std::string> list_step_dirs(const std::string& root) {
  std::vector<std::string> out;
  if (DIR* d = opendir(root.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("step_", 0) == 0 && n.find('.') == std::string::npos) out.push_back(n);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

MicroBatch to_device(MicroBatch mb, Device d) {
  if (d.is_cpu()) return mb;
  mb.targets = mb.targets.to(d, MemCategory::activations);
  mb.positions = mb.positions.to(d, MemCategory::activations);
  return mb;
}

std::string human_count(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string resolve_checkpoint(const std::string& path) {
  BB_CHECK(!path.empty(), "empty checkpoint path");
  if (path_exists(path_join(path, "state.json"))) return path;
  const std::string latest = path_join(path, "latest");
  if (path_exists(latest)) {
    std::string name = read_file(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const std::string dir = path_join(path, name);
    BB_CHECK(path_exists(path_join(dir, "state.json")), "checkpoint root ", path,
             " names '", name, "' in its 'latest' file, but ", dir, "/state.json does not exist");
    return dir;
  }
  return "";
}

Trainer::Trainer(const RunConfig& cfg, FILE* log) : Trainer(cfg, log, Corpus{}) {}

Trainer::Trainer(const RunConfig& cfg, FILE* log, Corpus corpus) : cfg_(cfg), log_(log) {
  device_ = cfg.resolved_device();
  const double t0 = now_s();
  apply_backend_config(cfg.backend);
  if (log_) {
    std::fprintf(log_, "[startup] model %s: %lld layers, hidden %lld, %lld experts top-%lld, %s parameters\n",
                 cfg.model_config.c_str(), static_cast<long long>(cfg.model.num_layers),
                 static_cast<long long>(cfg.model.hidden_size), static_cast<long long>(cfg.model.num_experts),
                 static_cast<long long>(cfg.model.top_k), human_count(static_cast<double>(cfg.model.num_params())).c_str());
    std::fprintf(log_, "[startup] primitives: %s | device %s, weights %s\n", cfg.primitives_summary().c_str(),
                 device_.str().c_str(), dtype_name(cfg.resolved_param_dtype()));
    std::fprintf(log_, "[startup] backend: %s\n", cfg.backend.summary().c_str());
    std::fflush(log_);
  }
  model_ = std::make_unique<DecoderModel>(cfg.model, model_options(cfg), cfg.seed);
  schedule_ = std::make_unique<Schedule>(*model_, ScheduleOptions{cfg.prim.recompute.value, false});
  std::vector<ParamUnit*> units = model_->units();
  std::vector<Tensor> masters;
  if (cfg.model_init.rfind("hf:", 0) == 0) {
    // Zeros: the loader writes only the parameters' slices, and the alignment padding between
    // them must stay zero (AdamW steps whole buckets and copies the masters into the units).
    for (ParamUnit* u : units)
      masters.push_back(Tensor::zeros({u->numel}, DType::f32, device_, MemCategory::optimizer));
    // The fp32 masters take the checkpoint's values at full precision (the parameters may be
    // bf16), so they are loaded together.
    const std::string dir = cfg.model_init.substr(3);
    const HfLoadReport rep = load_hf_weights(*model_, dir, &masters);
    if (log_) {
      std::fprintf(log_, "[startup] loaded %lld tensors from %s\n",
                   static_cast<long long>(rep.tensors_read), dir.c_str());
      std::fflush(log_);
    }
  } else {
    for (ParamUnit* u : units) masters.push_back(u->value.to_dtype(DType::f32, MemCategory::optimizer));
  }
  for (size_t u = 0; u < units.size(); ++u) {
    OptState s;
    s.master = masters[u];
    s.exp_avg = Tensor::zeros({units[u]->numel}, DType::f32, device_, MemCategory::optimizer);
    s.exp_avg_sq = Tensor::zeros({units[u]->numel}, DType::f32, device_, MemCategory::optimizer);
    opt_.push_back(std::move(s));
  }
  if (log_) {
    std::fprintf(log_, "[startup] loading data '%s'\n", cfg.data.path.c_str());
    std::fflush(log_);
  }
  data_ = corpus.num_documents() > 0 ? std::make_unique<DataLoader>(cfg.data, std::move(corpus))
                                     : std::make_unique<DataLoader>(cfg.data);
  if (!cfg.resume.empty()) {
    std::string path = cfg.resume == "auto" ? cfg.ckpt_dir : cfg.resume;
    std::string resolved = path_exists(path) ? resolve_checkpoint(path) : "";
    if (resolved.empty()) {
      BB_CHECK(cfg.resume == "auto", "checkpoint.resume = '", cfg.resume, "': no checkpoint there");
      if (log_) std::fprintf(log_, "[startup] resume = auto: no checkpoint in %s yet, starting fresh\n", path.c_str());
    } else {
      load_checkpoint(resolved);
      if (log_) std::fprintf(log_, "[startup] resumed from %s at step %lld\n", resolved.c_str(), static_cast<long long>(step_));
    }
  }
  if (log_) {
    std::fprintf(log_, "[startup] ready in %.2fs: %s tokens in %lld documents, %lld tokens per micro-batch x %lld\n",
                 now_s() - t0, human_count(static_cast<double>(data_->num_tokens())).c_str(),
                 static_cast<long long>(data_->num_documents()), static_cast<long long>(cfg.micro_batch_tokens),
                 static_cast<long long>(cfg.grad_accum));
    std::fflush(log_);
  }
}

Trainer::~Trainer() = default;

double Trainer::lr_at(int64_t step) const {
  const double peak = cfg_.lr, lo = cfg_.min_lr;
  if (cfg_.warmup_steps > 0 && step <= cfg_.warmup_steps)
    return peak * static_cast<double>(step) / static_cast<double>(cfg_.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, cfg_.steps - cfg_.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - cfg_.warmup_steps) / decay_steps);
  return lo + 0.5 * (peak - lo) * (1.0 + std::cos(M_PI * progress));
}

StepMetrics Trainer::train_step() {
  Allocator& alloc = allocator_for(device_);
  alloc.reset_peak();
  const double t0 = now_s();
  StepMetrics m;
  m.step = step_ + 1;
#ifdef BB_WITH_CUDA
  const int64_t syncs0 = cuda::host_sync_count();
#endif

  std::vector<MicroBatch> mbs;  // uploaded without a host sync (pinned staging)
  for (int64_t i = 0; i < cfg_.grad_accum; ++i) mbs.push_back(to_device(data_->next(), device_));
  int64_t valid = 0;
  for (const MicroBatch& mb : mbs) valid += mb.num_valid;
  BB_CHECK(valid > 0, "step ", m.step, ": no token in the step has a loss target (all masked)");

  {
    BB_RANGE("zero_grad");
    model_->zero_grad();
  }
  double loss_sum = 0, flops = 0;
  const float loss_scale = 1.0f / static_cast<float>(valid);
  const double aux_scale = 1.0 / static_cast<double>(cfg_.grad_accum);
  for (const MicroBatch& mb : mbs) {
    ForwardStats st = schedule_->forward_backward(mb, loss_scale, aux_scale);
    loss_sum += st.loss_sum;
    m.aux_loss += st.aux_loss * aux_scale;
    m.z_loss += st.z_loss * aux_scale;
    m.tokens += mb.tokens.numel();
    flops += model_flops(cfg_.model, seq_lens(mb));
  }
  m.valid_tokens = valid;
  m.loss = loss_sum / static_cast<double>(valid);

  // The global grad norm: one sum of squares per unit, added (a later all-reduce is one call).
  std::vector<ParamUnit*> units = model_->units();
  std::vector<Tensor> grads;
  for (ParamUnit* u : units) grads.push_back(u->grad);
  {
    BB_RANGE("grad_norm");
    m.grad_norm = global_grad_norm(grads);
  }
  BB_CHECK(std::isfinite(m.grad_norm), "step ", m.step, ": gradient norm is ", m.grad_norm,
           " (loss ", m.loss, "); lower train.lr or check the data");
  m.lr = lr_at(m.step);
  AdamWConfig ac{cfg_.beta1, cfg_.beta2, cfg_.adam_eps};
  // Clipping is folded into the update (one pass over the gradients instead of two).
  if (cfg_.grad_clip > 0 && m.grad_norm > cfg_.grad_clip)
    ac.grad_scale = static_cast<float>(cfg_.grad_clip / (m.grad_norm + 1e-6));
  BB_RANGE("optimizer_step");
  for (size_t i = 0; i < units.size(); ++i) {
    // Two flat buckets per unit: the weight-decayed elements, then the others.
    const ParamUnit& u = *units[i];
    OptState& s = opt_[i];
    const int64_t bounds[3] = {0, u.decay_numel, u.numel};
    for (int b = 0; b < 2; ++b) {
      const int64_t n = bounds[b + 1] - bounds[b];
      if (n == 0) continue;
      Tensor master = s.master.narrow(bounds[b], n), m1 = s.exp_avg.narrow(bounds[b], n),
             m2 = s.exp_avg_sq.narrow(bounds[b], n), value = u.value.narrow(bounds[b], n);
      adamw_step(master, u.grad.narrow(bounds[b], n), m1, m2, m.step, m.lr,
                 b == 0 ? cfg_.weight_decay : 0.0, ac, &value);
    }
  }
  step_ = m.step;
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) {
    synchronize_device(device_);  // the step's time includes all its device work, every stream
    m.host_syncs = cuda::host_sync_count() - syncs0;
  }
#endif
  m.step_time_s = now_s() - t0;
  m.tokens_per_s = static_cast<double>(m.tokens) / m.step_time_s;
  m.model_tflops = flops / m.step_time_s / 1e12;
  m.mem = alloc.stats();
  return m;
}

void Trainer::log_line(const StepMetrics& m) {
  if (!log_) return;
  const auto& pk = m.mem.peak;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::fprintf(log_,
               "step %6lld | loss %.4f | aux %.4f | gnorm %.3f | lr %.2e | %s tok/s | %.4f TFLOP/s | "
               "peak MiB: act %.1f logits %.1f moe %.1f params %.1f grads %.1f opt %.1f total %.1f\n",
               static_cast<long long>(m.step), m.loss, m.aux_loss, m.grad_norm, m.lr,
               human_count(m.tokens_per_s).c_str(), m.model_tflops,
               mib(pk[static_cast<int>(MemCategory::activations)]), mib(pk[static_cast<int>(MemCategory::logits)]),
               mib(pk[static_cast<int>(MemCategory::moe)]), mib(pk[static_cast<int>(MemCategory::params)]),
               mib(pk[static_cast<int>(MemCategory::grads)]), mib(pk[static_cast<int>(MemCategory::optimizer)]),
               mib(m.mem.peak_total));
  if (device_.is_cuda())
    std::fprintf(log_, "           reserved peak %.1f MiB | host syncs %lld\n", mib(m.mem.reserved_peak),
                 static_cast<long long>(m.host_syncs));
  std::fflush(log_);
}

std::vector<StepMetrics> Trainer::run() {
  std::vector<StepMetrics> out;
  std::unique_ptr<std::ofstream> metrics;
  if (!cfg_.metrics_path.empty()) {
    const auto slash = cfg_.metrics_path.find_last_of('/');
    if (slash != std::string::npos && slash > 0) make_dirs(cfg_.metrics_path.substr(0, slash));
    metrics = std::make_unique<std::ofstream>(cfg_.metrics_path, step_ > 0 ? std::ios::app : std::ios::trunc);
    BB_CHECK(metrics->good(), "cannot open log.metrics file '", cfg_.metrics_path, "' for writing");
  }
  while (step_ < cfg_.steps) {
    StepMetrics m = train_step();
    out.push_back(m);
    if (m.step % cfg_.log_every == 0 || m.step == cfg_.steps || m.step == 1) log_line(m);
    if (metrics) {
      nlohmann::json j;
      j["step"] = m.step;
      j["loss"] = m.loss;
      j["aux_loss"] = m.aux_loss;
      j["z_loss"] = m.z_loss;
      j["grad_norm"] = m.grad_norm;
      j["lr"] = m.lr;
      j["tokens"] = m.tokens;
      j["valid_tokens"] = m.valid_tokens;
      j["step_time_s"] = m.step_time_s;
      j["tokens_per_s"] = m.tokens_per_s;
      j["tflops"] = m.model_tflops;
      nlohmann::json pk;
      for (int c = 0; c < kNumMemCategories; ++c) pk[category_name(static_cast<MemCategory>(c))] = m.mem.peak[c];
      pk["total"] = m.mem.peak_total;
      j["peak_bytes"] = pk;
      j["reserved_peak_bytes"] = m.mem.reserved_peak;
      j["host_syncs"] = m.host_syncs;
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    const bool periodic = cfg_.ckpt_every > 0 && m.step % cfg_.ckpt_every == 0;
    const bool final = m.step == cfg_.steps && cfg_.ckpt_save_final;
    if (!cfg_.ckpt_dir.empty() && (periodic || final)) save_checkpoint(cfg_.ckpt_dir);
  }
  return out;
}

std::string Trainer::save_checkpoint(const std::string& root) {
  const double t0 = now_s();
  const std::string name = step_dir_name(step_);
  const std::string final_dir = path_join(root, name);
  const std::string tmp_dir = path_join(root, "." + name + ".tmp." + std::to_string(::getpid()));
  if (log_) {
    std::fprintf(log_, "[checkpoint] saving step %lld to %s ...\n", static_cast<long long>(step_), final_dir.c_str());
    std::fflush(log_);
  }
  make_dirs(root);
  remove_tree(tmp_dir);
  make_dirs(tmp_dir);
  try {
    std::map<std::string, std::string> meta = {{"format", "pt"}, {"bumblebee_step", std::to_string(step_)}};
    write_safetensors(path_join(tmp_dir, "model.safetensors"), hf_state(*model_), meta);
    // Optimizer state per parameter (the same slices of the unit's flat buffers), so the file
    // does not depend on the unit layout.
    std::vector<std::pair<std::string, Tensor>> opt;
    for (Param* p : model_->params()) {
      const OptState& s = opt_[static_cast<size_t>(p->unit->index)];
      opt.emplace_back(p->name + ".master", unit_slice(s.master, *p));
      opt.emplace_back(p->name + ".exp_avg", unit_slice(s.exp_avg, *p));
      opt.emplace_back(p->name + ".exp_avg_sq", unit_slice(s.exp_avg_sq, *p));
    }
    write_safetensors(path_join(tmp_dir, "optimizer.safetensors"), opt, {{"bumblebee_step", std::to_string(step_)}});
    nlohmann::json st;
    st["format_version"] = 1;
    st["step"] = step_;
    st["seed"] = cfg_.seed;
    st["data_position"] = data_->position();
    st["model_config"] = cfg_.model.to_hf_json();
    st["primitives"] = cfg_.primitives_summary();
    st["backend"] = cfg_.backend;
    atomic_write(path_join(tmp_dir, "state.json"), st.dump(2));
    atomic_write(path_join(tmp_dir, "config.json"), cfg_.model.to_hf_json().dump(2));
    remove_tree(final_dir);  // a stale directory of the same step (e.g. a re-run) is replaced
    BB_CHECK(::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, "checkpoint: cannot rename ", tmp_dir,
             " to ", final_dir);
  } catch (...) {
    remove_tree(tmp_dir);
    throw;
  }
  atomic_write(path_join(root, "latest"), name + "\n");
  if (cfg_.ckpt_keep > 0) {
    std::vector<std::string> dirs = list_step_dirs(root);
    for (size_t i = 0; i + static_cast<size_t>(cfg_.ckpt_keep) < dirs.size(); ++i)
      if (dirs[i] != name) remove_tree(path_join(root, dirs[i]));
  }
  if (log_) {
    std::fprintf(log_, "[checkpoint] saved %s in %.2fs\n", final_dir.c_str(), now_s() - t0);
    std::fflush(log_);
  }
  return final_dir;
}

void Trainer::load_checkpoint(const std::string& path) {
  const std::string dir = resolve_checkpoint(path);
  BB_CHECK(!dir.empty(), "no checkpoint at '", path, "' (expected a step_* directory or a checkpoint root with a 'latest' file)");
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(read_file(path_join(dir, "state.json")));
  } catch (const nlohmann::json::exception& e) {
    BB_FAIL("checkpoint ", dir, ": state.json is not valid JSON (", e.what(), ")");
  }
  BB_CHECK(st.is_object() && st.contains("step") && st.contains("data_position") && st.contains("model_config"),
           "checkpoint ", dir, ": state.json lacks step, data_position or model_config");
  const ModelConfig saved_cfg = parse_hf_config(st["model_config"], dir + "/state.json");
  if (!(saved_cfg == cfg_.model)) {
    const nlohmann::json a = saved_cfg.to_hf_json(), b = cfg_.model.to_hf_json();
    std::string diff;
    for (auto it = a.begin(); it != a.end(); ++it)
      if (!b.contains(it.key()) || b[it.key()] != it.value())
        diff += " " + it.key() + " (checkpoint " + it.value().dump() + ", run " + (b.contains(it.key()) ? b[it.key()].dump() : "absent") + ")";
    BB_FAIL("checkpoint ", dir, " was written for a different model:", diff);
  }
  const int64_t step = st["step"].get<int64_t>();
  const DataPosition pos = st["data_position"].get<DataPosition>();

  // Stage everything; commit only when all tensors were read and checked.
  SafetensorsReader model_file(path_join(dir, "model.safetensors"));
  SafetensorsReader opt_file(path_join(dir, "optimizer.safetensors"));
  std::vector<HfTensor> hf = model_->hf_tensors();
  std::vector<Tensor> staged_model;
  std::vector<std::string> missing;
  for (const HfTensor& t : hf) {
    if (!model_file.has(t.name)) {
      missing.push_back(t.name);
      continue;
    }
    Tensor v = model_file.read_as(t.name, DType::f32, MemCategory::other);
    BB_CHECK(v.shape() == t.shape, "checkpoint ", dir, ": tensor ", t.name, " has shape ",
             shape_str(v.shape()), ", the model expects ", shape_str(t.shape));
    staged_model.push_back(v);
  }
  // Host staging of the optimizer state, per parameter: [param][master, exp_avg, exp_avg_sq].
  std::vector<Param*> ps = model_->params();
  std::vector<std::array<Tensor, 3>> staged_opt(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const char* suffix[3] = {".master", ".exp_avg", ".exp_avg_sq"};
    for (int k = 0; k < 3; ++k) {
      const std::string name = ps[i]->name + suffix[k];
      if (!opt_file.has(name)) {
        missing.push_back(name);
        continue;
      }
      Tensor v = opt_file.read(name, MemCategory::other);
      BB_CHECK(v.shape() == ps[i]->shape && v.dtype() == DType::f32, "checkpoint ", dir,
               ": optimizer tensor ", name, " is ", v.str(), ", expected f32", shape_str(ps[i]->shape));
      staged_opt[i][static_cast<size_t>(k)] = v;
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += " " + missing[i];
    BB_FAIL("checkpoint ", dir, " is missing ", missing.size(), " tensor(s):", list,
            missing.size() > 8 ? " ..." : "");
  }
  // Commit.
  for (size_t i = 0; i < hf.size(); ++i) {
    Tensor dst = hf[i].value();
    dst.copy_from(staged_model[i].to_dtype(dst.dtype()));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    OptState& s = opt_[static_cast<size_t>(ps[i]->unit->index)];
    Tensor* flat[3] = {&s.master, &s.exp_avg, &s.exp_avg_sq};
    for (int k = 0; k < 3; ++k)
      unit_slice(*flat[k], *ps[i]).copy_from(staged_opt[i][static_cast<size_t>(k)]);
  }
  data_->restore(pos);
  step_ = step;
}

}  // namespace bb

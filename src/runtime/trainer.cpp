#include "runtime/trainer.h"

#include "core/parallel.h"
#include "core/trace.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include "io/fs.h"
#include "io/safetensors.h"
#include "models/hf_io.h"
#include "models/moe_block.h"
#include "plan/estimate.h"
#include "primitives/moe/router.h"
#include "primitives/optim/adamw.h"
#include "runtime/checkpoint.h"
#include "runtime/ckpt_root.h"
#include "runtime/context_shard.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}


std::vector<int64_t> seq_lens(const MicroBatch& mb) {
  std::vector<int32_t> cu = mb.cu_seqlens.to_ints();
  std::vector<int64_t> out;
  for (size_t i = 1; i < cu.size(); ++i) out.push_back(cu[i] - cu[i - 1]);
  return out;
}

// The routing of one micro-batch as a number that does not depend on how it was sharded: the
// sum over tokens and MoE layers of a mix of (layer, token's row in the whole micro-batch, its
// top-k expert ids), modulo a prime below 2^31 (so the per-rank parts sum without overflow).
constexpr int64_t kRoutingHashPrime = 2147483647;

// The logit bias of the emulated backend's balanced routing: far above any router logit of a
// model in training (|logit| of a few units), far below f32's range.
constexpr float kBalancedRoutingBias = 1000.0f;

int64_t routing_hash(const std::vector<Tensor>& layers, const MicroBatch& mb) {
  const std::vector<int64_t> rows = mb.shard.split() ? cp_layout::global_rows(mb.shard.seqlens, mb.shard.cp, mb.shard.rank)
                                                     : std::vector<int64_t>{};
  uint64_t sum = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::vector<int32_t> ids = layers[l].to_ints();
    const int64_t T = layers[l].size(0), K = T > 0 ? layers[l].size(1) : 0;
    for (int64_t t = 0; t < T; ++t) {
      const uint64_t row = rows.empty() ? static_cast<uint64_t>(t) : static_cast<uint64_t>(rows[static_cast<size_t>(t)]);
      uint64_t h = 1469598103934665603ull;  // FNV-1a over (layer, row, ids)
      for (uint64_t v : {static_cast<uint64_t>(l), row}) h = (h ^ v) * 1099511628211ull;
      for (int64_t k = 0; k < K; ++k) h = (h ^ static_cast<uint32_t>(ids[static_cast<size_t>(t * K + k)])) * 1099511628211ull;
      sum = (sum + h % static_cast<uint64_t>(kRoutingHashPrime)) % static_cast<uint64_t>(kRoutingHashPrime);
    }
  }
  return static_cast<int64_t>(sum);
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// Removes `path` and everything under it; true when nothing of it is left.
bool remove_tree(const std::string& path) {
  if (!path_exists(path)) return true;
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
  return !path_exists(path);
}

// Polls `marks` until all are done; aborts the job naming `where` when that takes longer than
// the communication timeout (a hung peer leaves collectives, and the work after them, waiting).
void wait_or_abort(const std::vector<Event>& marks, const std::string& where) {
  const double t0 = now_s();
  for (const Event& e : marks) {
    while (!e.done()) {
      if (now_s() - t0 > comm::timeout())
        comm::abort_job(3, "communication timeout: the GPU work queued before " + where + " did not finish within " +
                               std::to_string(static_cast<int>(comm::timeout())) +
                               " s; a peer rank is dead or hung (its collectives never complete). Aborting the job.");
      std::this_thread::yield();
    }
  }
}

#ifdef BB_WITH_CUDA
// Waits for every stream of `dev`, with the job's deadline.
void wait_device_or_abort(Device dev, const std::string& where) {
  std::vector<Event> marks;
  for (int s = 0; s < kNumStreams; ++s) marks.push_back(Event::record(dev, static_cast<Stream>(s)));
  wait_or_abort(marks, where);
  cuda::note_host_sync();
}
#endif

std::string shard_name(int rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "shards/rank_%05d.safetensors", rank);
  return buf;
}

// Every rank learns whether any rank failed a phase; the failing rank's message is thrown on it,
// the others throw naming the phase (nobody waits in a later collective for a rank that left).
void agree(comm::Group& g, const std::string& err, const char* phase) {
  const int64_t failed = g.max(err.empty() ? 0 : static_cast<int64_t>(1));
  if (!failed) return;
  if (!err.empty()) throw Error(err);  // the message has its source line already
  BB_FAIL("checkpoint: another rank failed while ", phase, " (see its message)");
}

void accumulate_policy(PolicyMetrics& a, const PolicyMetrics& b) {
  a.clipped += b.clipped;
  a.dual_clipped += b.dual_clipped;
  a.approx_kl += b.approx_kl;
  a.entropy += b.entropy;
  a.ratio += b.ratio;
  a.ratio_max = std::max(a.ratio_max, b.ratio_max);
  a.ref_kl += b.ref_kl;
  a.sequences += b.sequences;
}

// The step's policy metrics over every rank: sums, then means over the valid tokens.
StepMetrics::Policy reduce_policy(comm::Group& world, const PolicyMetrics& pm, int64_t valid) {
  double v[7] = {static_cast<double>(pm.clipped), static_cast<double>(pm.dual_clipped), pm.approx_kl, pm.entropy,
                 pm.ratio, pm.ref_kl, pm.sequences};
  world.all_reduce_host(v, 7, comm::ReduceOp::sum);
  double mx = pm.ratio_max;
  world.all_reduce_host(&mx, 1, comm::ReduceOp::max);
  const double n = static_cast<double>(valid);
  StepMetrics::Policy p;
  p.clip_frac = v[0] / n;
  p.dual_clip_frac = v[1] / n;
  p.approx_kl = v[2] / n;
  p.entropy = v[3] / n;
  p.ratio_mean = v[4] / n;
  p.ref_kl = v[5] / n;
  p.sequences = v[6];
  p.ratio_max = mx;
  return p;
}

// primitives.router_replay: the data's routing must fit the model (its MoE layers, top-k and
// experts); a bad id is named with its document.
void check_replay_routing(const RunConfig& cfg, const Corpus& c) {
  const ModelConfig& m = cfg.model;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < m.num_layers; ++l) moe_layers += m.is_moe_layer(l);
  BB_CHECK(moe_layers > 0, "primitives.router_replay is on but the model has no MoE layer");
  BB_CHECK(c.has_routing(), "primitives.router_replay is on but data '", cfg.data.path,
           "' has no \"routing\" (give rollout records with the routed experts, e.g. vLLM's "
           "--enable-return-routed-experts output; or set primitives.router_replay = false)");
  BB_CHECK(c.routing_layers == moe_layers && c.routing_topk == m.top_k, "data '", cfg.data.path, "': \"routing\" has ",
           c.routing_layers, " MoE layers x top-k ", c.routing_topk, " per token; the model routes ", moe_layers,
           " MoE layers x top-k ", m.top_k);
  const int64_t per = c.routing_layers * c.routing_topk;
  for (int64_t d = 0; d < c.num_documents(); ++d)
    for (int64_t i = c.offsets[d] * per; i < c.offsets[d + 1] * per; ++i)
      BB_CHECK(c.routing[static_cast<size_t>(i)] < m.num_experts, "data '", cfg.data.path, "': document ", d,
               c.ids.empty() ? std::string() : " (id " + c.ids[static_cast<size_t>(d)] + ")", ": \"routing\" names expert ",
               c.routing[static_cast<size_t>(i)], ", but the model has ", m.num_experts, " experts");
}

}  // namespace

std::function<double(int64_t)> flops_cost(const ModelConfig& m) {
  return [m](int64_t len) { return model_flops(m, {len}); };
}

DataLoader whole_loader(const RunConfig& cfg, Corpus docs) {
  DataConfig dc = cfg.data;
  dc.packing = "whole";
  dc.shuffle = false;
  dc.tokens_per_micro_batch = cfg.micro_batch_tokens;
  DataLoader loader(dc, std::move(docs));
  loader.set_sequence_cost(flops_cost(cfg.model));
  return loader;
}

ModelOptions model_options(const RunConfig& c) {
  ModelOptions o;
  o.prims = c.prim;
  o.aux_loss_coef = c.effective_aux_coef();
  o.z_loss_coef = c.z_loss_coef;
  o.device = c.resolved_device();
  o.param_dtype = c.resolved_param_dtype();
  o.expert_wgrad_stream = c.backend.expert_wgrad_stream;
  // c.cp is the layout's (parallel = "auto" is resolved into the config before the model is built).
  o.moe_token_chunks = moe_token_chunks(c, std::max<int64_t>(1, c.cp));
  // The start is sharded: the state family allocates and fills only what this rank holds (an
  // fsdp rank never holds a whole unit), from the initialisation or from the hf: checkpoint's
  // ranges.
  o.defer_values = true;
  return o;
}

int64_t moe_token_chunks(const RunConfig& c, int64_t cp) {
  const int64_t chunk = c.backend.moe_chunk_tokens;
  if (chunk <= 0) return 1;
  BB_CHECK(cp >= 1, "moe_token_chunks: cp = ", cp);
  const int64_t per_rank = (c.micro_batch_tokens + cp - 1) / cp;
  const int64_t n = (per_rank + chunk - 1) / chunk;
  BB_CHECK(n <= kMaxMoeTokenChunks, "backend.moe_chunk_tokens = ", chunk, " cuts the ", per_rank,
           " tokens per rank (train.micro_batch_tokens / cp) into ", n, " MoE chunks, more than the ",
           kMaxMoeTokenChunks, " a layer accepts; raise backend.moe_chunk_tokens to at least ",
           (per_rank + kMaxMoeTokenChunks - 1) / kMaxMoeTokenChunks);
  return n;
}

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
    // `latest` names a step directory of this root, nothing else (not "..", not a path into
    // another root).
    BB_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                 name.find('\0') == std::string::npos,
             "checkpoint root ", path, ": its 'latest' file names '", name,
             "', which is not a step directory of this root; fix or remove the file");
    const std::string dir = path_join(path, name);
    BB_CHECK(path_exists(path_join(dir, "state.json")), "checkpoint root ", path,
             " names '", name, "' in its 'latest' file, but ", dir, "/state.json does not exist");
    return dir;
  }
  return "";
}

comm::GroupPtr default_world(const RunConfig& cfg) {
  const comm::World& w = comm::world();
  if (cfg.comm == "emulated") {
    BB_CHECK(w.size == 1, "parallel.comm = \"emulated\": one process plays one rank of the job (emulate.ranks = ",
             cfg.emulate.ranks, "); start it without mpirun / srun (", w.size, " processes were started)");
    return comm::make_emulated_world(cfg.emulate);
  }
  if (w.size == 1 && cfg.comm != "nccl") return comm::self_group("world");
  std::string b = cfg.comm;
  if (b == "auto") {
    b = "mpi";
#ifdef BB_WITH_CUDA
    // NCCL needs a GPU per process; processes sharing a GPU (tests on one card) use mpi.
    if (cfg.resolved_device().is_cuda() && w.local_size <= cuda::device_count()) b = "nccl";
#endif
  }
  if (b == "nccl") {
    BB_CHECK(cfg.resolved_device().is_cuda(), "parallel.comm = 'nccl' needs parallel.device = 'cuda'");
#ifdef BB_WITH_CUDA
    BB_CHECK(w.local_size <= cuda::device_count(), "parallel.comm = 'nccl': ", w.local_size,
             " processes on this host but ", cuda::device_count(), " GPU(s); NCCL needs one GPU per process ",
             "(use parallel.comm = 'mpi' to share GPUs, e.g. for tests)");
    cuda::set_device(cfg.resolved_device().index);
#endif
    return comm::world_group(comm::Backend::nccl);
  }
  BB_CHECK(w.mpi, "parallel.comm = 'mpi' needs a launch by mpirun or srun (", w.size, " rank(s))");
  return comm::world_group(comm::Backend::mpi);
}

ParallelLayout resolve_layout(const RunConfig& cfg, int64_t world_size) {
  ParallelLayout l;
  l.cp = cfg.cp;
  l.ep = cfg.ep;
  l.pp = cfg.pp;
  l.dp = cfg.dp;
  if (l.dp == 0) {
    BB_CHECK(world_size % (l.cp * l.pp) == 0, "parallel.dp = 0 takes dp = ranks / (cp x pp), but ", world_size,
             " rank(s) are not a multiple of cp x pp = ", l.cp * l.pp);
    l.dp = world_size / (l.cp * l.pp);
  }
  l.validate(world_size, cfg.model.num_experts);
  if (l.cp > 1) {
    // Context parallelism splits every sequence over the cp ranks; the attention layers need a
    // member that attends across them, and the token mixers without one are refused.
    const std::string& attn = cfg.prim.attention.name;
    BB_CHECK(attn != "sdpa", "parallel.cp = ", l.cp, " splits every sequence over ", l.cp, " ranks, but primitives.attention = "
             "\"sdpa\" attends within one rank's tokens; set primitives.attention = \"cp_ring\" (any head count) or "
             "\"cp_a2a\" (query heads divisible by cp)");
    if (attn == "cp_a2a") check_cp_a2a_heads(cfg.model.num_heads, cfg.model.num_kv_heads, l.cp);
    for (int64_t i = 0; i < cfg.model.num_layers; ++i)
      if (cfg.model.layer_type(i) == LayerType::linear_attention) {  // primitives.gdn_cp = heads needs cp | heads
        (void)gdn_cp_by_states(cfg.prim.gdn_cp.value, cfg.model.linear_num_key_heads, cfg.model.linear_num_value_heads,
                               l.cp);
        break;
      }
  }
  return l;
}

Trainer::Trainer(const RunConfig& cfg, FILE* log) : Trainer(cfg, log, Corpus{}) {}

Trainer::Trainer(const RunConfig& cfg_in, FILE* log, Corpus corpus, comm::GroupPtr base) : cfg_(cfg_in), log_(log) {
  const double t0 = now_s();
  comm::set_timeout(cfg_in.comm_timeout_s);
  if (!base) base = default_world(cfg_in);
  // parallel = "auto": the planner fills the open degrees for this world before anything else
  // reads the layout; the rest of the constructor sees the resolved config (`cfg`).
  if (cfg_in.auto_layout()) {
    int64_t available = 0;  // CPU ranks: no memory limit
#ifdef BB_WITH_CUDA
    const Device d = cfg_in.resolved_device();
    if (d.is_cuda()) {
      cuda::set_device(d.index);
      available = static_cast<int64_t>(0.95 * static_cast<double>(cuda::memory_available(d.index)));
    }
#endif
    // Every rank must choose the same layout: the least free memory of any rank bounds it.
    if (base->size() > 1) {
      int64_t v = available > 0 ? available : INT64_MAX;
      base->all_reduce_host(&v, 1, comm::ReduceOp::min);
      available = v == INT64_MAX ? 0 : v;
    }
    cfg_ = plan::choose_auto_layout(cfg_in, base->size(), available, &auto_why_);
  }
  const RunConfig& cfg = cfg_;
  // The layout is checked before anything is allocated.
  const ParallelLayout layout = resolve_layout(cfg, base->size());
  const int rank = base->rank();
  // An emulated rank is the only process of its job: it logs and writes the metrics, whatever
  // rank it plays.
  const bool emulated = base->backend() == comm::Backend::emulated;
  writer_ = rank == 0 || emulated;
  if (!writer_ && !cfg.log_all_ranks) log_ = nullptr;
  if (cfg.log_all_ranks && base->size() > 1 && !emulated) log_prefix_ = "[rank " + std::to_string(rank) + "] ";
  device_ = cfg.resolved_device();
  if (emulated) log_prefix_ = cfg.emulate.tag();
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) cuda::set_device(device_.index);
#endif
  if (emulated && cfg.emulate.device_memory_gib > 0) {
    // Before the run allocates: the pool then fails where the emulated card would.
    BB_CHECK(device_.is_cuda(), "emulate.device_memory_gib = ", cfg.emulate.device_memory_gib,
             " caps GPU memory, but the run is on ", device_.str());
#ifdef BB_WITH_CUDA
    cuda::set_memory_limit(device_.index, static_cast<int64_t>(cfg.emulate.device_memory_gib * double(1 << 30)));
#endif
  }
  apply_backend_config(cfg.backend);
  mesh_ = std::make_unique<Mesh>(base, layout);
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) check_memory_fits(*base, rank);
#endif
  // The checkpoint root is checked and locked before anything slow happens, so an unusable or
  // busy root fails now instead of at the first save.
  if (!cfg.ckpt_dir.empty()) {
    std::string err;
    if (rank == 0) {
      try {
        root_ = std::make_unique<CheckpointRoot>(cfg.ckpt_dir, log_, log_prefix_);
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(*base, err, "checking checkpoint.dir");
  }
  if (log_) {
    const char* p = log_prefix_.c_str();
    std::fprintf(log_, "%s[startup] model %s: %lld layers, hidden %lld, %lld experts top-%lld, %s parameters\n", p,
                 cfg.model_config.c_str(), static_cast<long long>(cfg.model.num_layers),
                 static_cast<long long>(cfg.model.hidden_size), static_cast<long long>(cfg.model.num_experts),
                 static_cast<long long>(cfg.model.top_k), human_count(static_cast<double>(cfg.model.num_params())).c_str());
    for (const std::string& n : cfg.model.load_notes) std::fprintf(log_, "%s[startup] model config: %s\n", p, n.c_str());
    if (!auto_why_.empty()) std::fprintf(log_, "%s[startup] %s\n", p, auto_why_.c_str());
    std::fprintf(log_, "%s[startup] primitives: %s | device %s, weights %s\n", p, cfg.primitives_summary().c_str(),
                 device_.str().c_str(), dtype_name(cfg.resolved_param_dtype()));
    std::fprintf(log_, "%s[startup] parallel: %d rank(s) over %s (launcher %s), layout %s, state %s\n", p,
                 base->size(), comm::backend_name(base->backend()), comm::world().launcher.c_str(),
                 layout.str().c_str(), cfg.prim.state.name.c_str());
    if (layout.cp > 1)
      for (int64_t i = 0; i < cfg.model.num_layers; ++i)
        if (cfg.model.layer_type(i) == LayerType::linear_attention) {
          const bool st = gdn_cp_by_states(cfg.prim.gdn_cp.value, cfg.model.linear_num_key_heads,
                                           cfg.model.linear_num_value_heads, layout.cp);
          std::fprintf(log_, "%s[startup] gated deltanet layers over cp %lld: %s (primitives.gdn_cp = \"%s\")\n", p,
                       static_cast<long long>(layout.cp),
                       st ? "states (own tokens; conv halo and state summaries cross ranks)"
                          : "heads (projections all-to-all to heads and back)",
                       cfg.prim.gdn_cp.name.c_str());
          break;
        }
    if (emulated)
      std::fprintf(log_, "%s[startup] %s: compute, memory and streams are this rank's, the wire time is modelled; "
                   "routing is balanced and every peer is a copy of this rank, so losses are not the real job's\n",
                   p, cfg.emulate.str().c_str());
    std::fprintf(log_, "%s[startup] backend: %s\n", p, cfg.backend.summary().c_str());
    if (cfg.backend.moe_chunk_tokens > 0 && cfg.model.num_moe_layers() > 0) {
      const int64_t n = moe_token_chunks(cfg, layout.cp);
      const int64_t per_rank = (cfg.micro_batch_tokens + layout.cp - 1) / layout.cp;
      std::fprintf(log_, "%s[startup] MoE token chunks: %lld per layer of <= %lld tokens (%lld tokens per rank, "
                   "backend.moe_chunk_tokens = %lld)\n", p, static_cast<long long>(n),
                   static_cast<long long>((per_rank + n - 1) / n), static_cast<long long>(per_rank),
                   static_cast<long long>(cfg.backend.moe_chunk_tokens));
    }
    std::fflush(log_);
  }
  build_model(emulated);
  std::vector<ParamUnit*> units = model_->units();
  std::vector<Tensor> masters;
  if (cfg.model_init.rfind("hf:", 0) == 0) {
    // The fp32 masters take the checkpoint's values at full precision (the parameters may be
    // bf16); the state family rounds its values from them. Only the elements this rank starts
    // with are read (ModelState::start_range: its shard under fsdp), so neither the host nor the
    // device ever holds the whole checkpoint.
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (ParamUnit* u : units) ranges.push_back(ModelState::start_range(cfg.prim.state.value, *u, *mesh_));
    const std::string dir = cfg.model_init.substr(3);
    const HfLoadReport rep = load_hf_weight_ranges(*model_, dir, ranges, device_, &masters);
    if (log_) {
      std::fprintf(log_, "%s[startup] loaded %s: %s\n", log_prefix_.c_str(), dir.c_str(), rep.summary().c_str());
      std::fflush(log_);
    }
  }
  // The state family takes the units over (fsdp frees the whole buffers here).
  build_state(masters.empty() ? nullptr : &masters);
  masters.clear();
  const bool split = splits_master(cfg.backend.master_storage, cfg.resolved_param_dtype());
  if (log_) {
    std::fprintf(log_, "%s[startup] loading data '%s'\n", log_prefix_.c_str(), cfg.data.path.c_str());
    std::fflush(log_);
  }
  // data.path = "none": no data source; every step's batch comes from the caller (train_on).
  if (corpus.num_documents() > 0) data_ = std::make_unique<DataLoader>(cfg.data, std::move(corpus));
  else if (cfg.data.path != "none") data_ = std::make_unique<DataLoader>(cfg.data);
  policy_ = cfg.prim.name_of("loss") == "policy";
  if (data_) {
    check_batch_data(data_->corpus());
    // Whole packing balances each step's micro-batches by the model's FLOPs per sequence.
    data_->set_sequence_cost(flops_cost(cfg.model));
  }
  if (!cfg.resume.empty()) {
    std::string resolved;
    if (cfg.resume == "auto") {
      resolved = resolve_auto_resume(cfg.ckpt_dir);
      if (resolved.empty() && log_)
        std::fprintf(log_, "%s[startup] resume = auto: no checkpoint in %s yet, starting fresh\n", log_prefix_.c_str(),
                     cfg.ckpt_dir.c_str());
    } else {
      resolved = path_exists(cfg.resume) ? resolve_checkpoint(cfg.resume) : "";
      BB_CHECK(!resolved.empty(), "checkpoint.resume = '", cfg.resume, "': no checkpoint there");
    }
    if (!resolved.empty()) {
      load_checkpoint(resolved);
      if (log_) std::fprintf(log_, "%s[startup] resumed from %s at step %lld (run %s)\n", log_prefix_.c_str(), resolved.c_str(), static_cast<long long>(step_), run_id_.c_str());
    }
  }
  if (run_id_.empty()) run_id_ = new_run_id();
  world_broadcast_run_id();
  if (!cfg.ckpt_dir.empty()) check_foreign_checkpoints();
  const int64_t backup_bytes = optimizer_bytes_per_element(cfg.prim.optimizer.value, split) + (split ? 2 : 0);
  if (cfg.on_nonfinite == "skip_step" && log_)
    std::fprintf(log_, "%s[startup] train.on_nonfinite = skip_step: a copy of the optimizer state is kept to undo "
                 "a step (+%lld bytes per owned parameter)\n", log_prefix_.c_str(),
                 static_cast<long long>(backup_bytes));
  if (log_) {
    if (data_)
      std::fprintf(log_, "%s[startup] ready in %.2fs: %s tokens in %lld documents, %s%lld tokens per micro-batch x %lld per rank x %lld data ranks (data.packing = %s)\n",
                   log_prefix_.c_str(), now_s() - t0, human_count(static_cast<double>(data_->num_tokens())).c_str(),
                   static_cast<long long>(data_->num_documents()), cfg.data.packing == "whole" ? "up to " : "",
                   static_cast<long long>(cfg.micro_batch_tokens), static_cast<long long>(cfg.grad_accum),
                   static_cast<long long>(layout.dp), cfg.data.packing.c_str());
    else
      std::fprintf(log_, "%s[startup] ready in %.2fs: batches from the caller (data.path = \"none\"), up to %lld tokens per micro-batch x %lld per rank x %lld data ranks\n",
                   log_prefix_.c_str(), now_s() - t0, static_cast<long long>(cfg.micro_batch_tokens),
                   static_cast<long long>(cfg.grad_accum), static_cast<long long>(layout.dp));
    std::fflush(log_);
  }
}

// The model and its schedule (the constructor; onload() again).
void Trainer::build_model(bool emulated) {
  ModelOptions mo = model_options(cfg_);
  mo.ep_group = mesh_->ep();  // the MoE dispatchers move rows over the mesh's expert-parallel group
  mo.cp_group = mesh_->cp();  // the attention members over its context-parallel group
  model_ = std::make_unique<DecoderModel>(cfg_.model, mo, cfg_.seed);
  schedule_ = std::make_unique<Schedule>(
      *model_, ScheduleOptions{cfg_.prim.recompute.value, false, recompute_parts(cfg_.prim.recompute),
                               cfg_.backend.max_layers_ahead});
  schedule_->set_host_wait([](const Event& e, const std::string& where) { wait_or_abort({e}, where); });
  if (emulated && model_->num_moe_layers() > 0) {
    // Balanced routing: the emulated rank's experts get the rows a balanced job would send them.
    // A bias on the router logits steers the router's own top-k (its count read-back, a host
    // sync per MoE layer today, stays as in the real run); one bias per token count, shared by
    // every MoE layer.
    const ModelConfig& mc = cfg_.model;
    const Device dev = device_;
    auto cache = std::make_shared<std::map<int64_t, Tensor>>();
    schedule_->set_routing_source([mc, dev, cache](const MicroBatch& mb, std::vector<RoutingStash::Entry>& layers) {
      const int64_t T = mb.tokens.numel();
      auto it = cache->find(T);
      if (it == cache->end()) {
        const RouterReplay r = balanced_routing(T, mc.num_experts, mc.top_k, Device::cpu());
        it = cache->emplace(T, routing_logit_bias(r, mc.num_experts, kBalancedRoutingBias, dev)).first;
      }
      for (RoutingStash::Entry& e : layers) e.logit_bias = it->second;
    });
  }
}

// The state family over the model's units, hooked into the schedule; `masters` as ModelState
// takes them (null: the model's initialisation).
void Trainer::build_state(const std::vector<Tensor>* masters) {
  const bool split = splits_master(cfg_.backend.master_storage, cfg_.resolved_param_dtype());
  OffloadOptions oo;
  oo.threads = static_cast<int>(cfg_.backend.offload_threads);
  state_ = std::make_unique<ModelState>(cfg_.prim.state.value, *model_, *mesh_, masters, cfg_.prim.optimizer.value,
                                        cfg_.seed, split, oo);
  if (const OptimizerOffload* off = state_->offload(); off && log_)
    std::fprintf(log_, "%s[startup] primitives.optimizer = adamw_offload: master and moments in host memory (%s%s), "
                 "updated by %d host thread%s\n", log_prefix_.c_str(), format_bytes(off->host_bytes()).c_str(),
                 off->pinned() ? ", page-locked" : (device_.is_cuda() ? ", NOT page-locked: copies run synchronously" : ""),
                 off->threads(), off->threads() == 1 ? "" : "s");
  state_->set_reduction(cfg_.backend.grad_reduce_dtype == "bf16" ? DType::bf16 : DType::f32,
                        cfg_.backend.fsdp_reduce == "step");
  schedule_->add_hooks(state_.get());
  if (mesh_->layout().cp > 1) {
    // The aux loss pools its counts and probabilities over the whole micro-batch: summed over
    // the cp ranks that share it.
    comm::GroupPtr cpg = mesh_->cp();
    schedule_->aux_pool().reduce_hook = [cpg](std::vector<double>& counts, Tensor& prob_sum, int64_t& rows) {
      cpg->all_reduce_host(counts.data(), static_cast<int64_t>(counts.size()), comm::ReduceOp::sum);
      cpg->all_reduce(prob_sum)->wait();
      rows = cpg->sum(rows);
    };
  }
}

// offload()'s host copy: one buffer (pinned on a GPU) holding every resident tensor at 256-byte
// aligned offsets.
struct Trainer::HostStash {
  bool pinned = false;
  uint8_t* data = nullptr;
  size_t capacity = 0;
  std::vector<uint8_t> plain;  // CPU runs
  std::vector<size_t> offsets, bytes;
  HostStash() = default;
  HostStash(const HostStash&) = delete;
  HostStash& operator=(const HostStash&) = delete;
  ~HostStash() {
#ifdef BB_WITH_CUDA
    if (pinned) cuda::pinned_free(data);
#endif
  }
  void reserve(size_t n, bool gpu) {
    if (n <= capacity) return;
    // The old buffer goes first (both at once may not fit); nothing points at it if the new
    // allocation throws.
#ifdef BB_WITH_CUDA
    if (pinned) cuda::pinned_free(data);
#endif
    pinned = false;
    data = nullptr;
    capacity = 0;
    plain.clear();
    plain.shrink_to_fit();
#ifdef BB_WITH_CUDA
    if (gpu) {
      data = static_cast<uint8_t*>(cuda::pinned_alloc(n));
      pinned = true;
      capacity = n;
      return;
    }
#else
    (void)gpu;
#endif
    plain.assign(n, 0);
    data = plain.data();
    capacity = n;
  }
};

// The async save's host copies (Trainer::snapshot_): buffer k holds the snapshot's k-th tensor,
// reused by the next snapshot when its shape and dtype match (they do from one save to the
// next), page-locked when its source is on a GPU so that the device -> host copy runs at the
// link's rate instead of through the driver's pageable staging, with first-touch page faults.
// Locking goes in pieces of kPiece bytes, each its own registration (after the pages are
// faulted in by several threads), and the snapshot copies piece by piece, never across two
// registrations. Whoever allocates pays the locking (run() does before the first step, with
// periodic async saves); later snapshots only the copies.
struct Trainer::SnapshotBuffers {
  static constexpr size_t kPiece = size_t{256} << 20;
  std::vector<Tensor> bufs;
  std::vector<std::vector<size_t>> starts;  // per buffer: its pieces' first bytes
  std::vector<std::vector<void*>> locked;   // per buffer: its page-locked pieces
  int64_t unlocked_bytes = 0;               // of buffers to lock, the bytes that stayed pageable
  SnapshotBuffers() = default;
  SnapshotBuffers(const SnapshotBuffers&) = delete;
  SnapshotBuffers& operator=(const SnapshotBuffers&) = delete;
  ~SnapshotBuffers() { trim(0); }
  void release(size_t k) {
#ifdef BB_WITH_CUDA
    for (void* p : locked[k]) cuda::host_unregister(p);
#endif
    locked[k].clear();
    starts[k].clear();
    bufs[k] = Tensor();
  }
  // Pieces of kPiece bytes whose boundaries fall on page starts (the buffer itself need not
  // start on one), so that no two registrations share a page. Offsets stay multiples of the
  // allocation's 64-byte alignment: every piece starts on an element.
  static std::vector<size_t> piece_starts(const char* base, size_t n) {
    std::vector<size_t> s{0};
    const uintptr_t a = reinterpret_cast<uintptr_t>(base);
    for (size_t at = ((a + 4095) & ~uintptr_t{4095}) - a + kPiece; at < n; at += kPiece) s.push_back(at);
    return s;
  }
  // Host buffer k shaped like t; *fresh: whether it was allocated now.
  Tensor take(size_t k, const Tensor& t, bool* fresh) { return take(k, t.shape(), t.dtype(), t.device().is_cuda(), fresh); }
  // The same by shape and dtype; lock: page-lock a new buffer (its source is on a GPU).
  Tensor take(size_t k, const std::vector<int64_t>& shape, DType dtype, bool lock, bool* fresh) {
    if (k >= bufs.size()) {
      bufs.resize(k + 1);
      starts.resize(k + 1);
      locked.resize(k + 1);
    }
    *fresh = !(bufs[k].defined() && bufs[k].shape() == shape && bufs[k].dtype() == dtype);
    if (!*fresh) return bufs[k];
    release(k);
    bufs[k] = Tensor::empty(shape, dtype, Device::cpu(), MemCategory::other);
    char* base = static_cast<char*>(bufs[k].raw());
    const size_t n = bufs[k].nbytes();
    starts[k] = piece_starts(base, n);
#ifdef BB_WITH_CUDA
    if (lock && n > 0) {
      prefault(base, n);
      // A piece that cannot be locked stays pageable (its copy is slower, not wrong; counted).
      for (size_t i = 0; i < starts[k].size(); ++i) {
        const size_t end = i + 1 < starts[k].size() ? starts[k][i + 1] : n;
        if (cuda::host_register(base + starts[k][i], end - starts[k][i])) locked[k].push_back(base + starts[k][i]);
        else unlocked_bytes += static_cast<int64_t>(end - starts[k][i]);
      }
    }
#else
    (void)lock;
#endif
    return bufs[k];
  }
  // Touches every page of [p, p + n) from several threads: page-locking a range faults its
  // pages in one by one on the calling thread, which then only pins them.
  static void prefault(char* p, size_t n) {
    constexpr int64_t kPage = 4096;
    parallel_ranges((static_cast<int64_t>(n) + kPage - 1) / kPage, (int64_t{64} << 20) / kPage, [p](int64_t lo, int64_t hi) {
      for (int64_t page = lo; page < hi; ++page) p[page * kPage] = 0;
    });
  }
  // Copies src into buffer k (src: its shape and dtype) piece by piece.
  void fill(size_t k, const Tensor& src) {
    const Tensor dst = bufs[k].view({-1});
    const Tensor from = src.view({-1});
    const int64_t es = static_cast<int64_t>(dtype_size(src.dtype()));
    for (size_t i = 0; i < starts[k].size(); ++i) {
      const int64_t lo = static_cast<int64_t>(starts[k][i]) / es;
      const int64_t hi = i + 1 < starts[k].size() ? static_cast<int64_t>(starts[k][i + 1]) / es : dst.numel();
      if (hi > lo) dst.narrow(lo, hi - lo).copy_from(from.narrow(lo, hi - lo));
    }
  }
  int64_t bytes() const {
    int64_t n = 0;
    for (const Tensor& b : bufs)
      if (b.defined()) n += static_cast<int64_t>(b.nbytes());
    return n;
  }
  void trim(size_t n) {
    while (bufs.size() > n) {
      release(bufs.size() - 1);
      bufs.pop_back();
      starts.pop_back();
      locked.pop_back();
    }
  }
};

Trainer::~Trainer() {
  // A shard still being written is waited for, not committed (a destructor cannot run the
  // collective commit): its temporary directory stays, as after a crash, and `latest` still
  // names the previous checkpoint.
  if (save_job_ && save_job_->writer.joinable()) save_job_->writer.join();
  // The model's buffers go before the stash and the flags (declaration order would free them last).
  schedule_.reset();
  state_.reset();
  model_.reset();
#ifdef BB_WITH_CUDA
  cuda::pinned_free(pinned_flags_);
#endif
}

void Trainer::check_onloaded(const char* what) const {
  BB_CHECK(!offloaded_, what, ": the trainer is offloaded (its state is in host memory); call onload() first");
}

namespace {

// Host <-> this run's device, synchronously (both ends plain pointers).
void copy_bytes(void* dst, Device ddev, const void* src, Device sdev, size_t n) {
  if (n == 0) return;
#ifdef BB_WITH_CUDA
  if (ddev.is_cuda() || sdev.is_cuda()) {
    cuda::memcpy(dst, ddev, src, sdev, n);
    return;
  }
#endif
  (void)ddev;
  (void)sdev;
  std::memcpy(dst, src, n);
}

}  // namespace

OffloadReport Trainer::offload() {
  BB_CHECK(!pending_, "offload: a forward_backward is waiting for its optim_step; call optim_step first");
  check_onloaded("offload");
  const double t0 = now_s();
  synchronize_device(device_);
  std::vector<Tensor> res = state_->resident();
  if (!stash_) stash_ = std::make_unique<HostStash>();
  HostStash& st = *stash_;
  st.offsets.clear();
  st.bytes.clear();
  size_t total = 0;
  for (const Tensor& t : res) {
    st.offsets.push_back(total);
    st.bytes.push_back(t.nbytes());
    total += (t.nbytes() + 255) / 256 * 256;
  }
  st.reserve(total, device_.is_cuda());
  for (size_t i = 0; i < res.size(); ++i)
    copy_bytes(st.data + st.offsets[i], Device::cpu(), res[i].raw(), device_, st.bytes[i]);
  res.clear();
  // Every device buffer of the model, its schedule and the state family goes with them.
  schedule_.reset();
  state_.reset();
  model_.reset();
  nonfinite_flags_ = Tensor();
  offloaded_ = true;
  OffloadReport r;
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) {
    cuda::release_cached_memory(device_.index);
    r.device_used = cuda::device_memory_used(device_.index);
  }
#endif
  r.seconds = now_s() - t0;
  for (size_t b : st.bytes) r.host_bytes += static_cast<int64_t>(b);
  r.allocator_live = allocator_for(device_).stats().live_total;
  return r;
}

OffloadReport Trainer::onload() {
  BB_CHECK(offloaded_, "onload: the trainer is not offloaded (call offload() first)");
  const double t0 = now_s();
  OffloadReport r;
  // A failed attempt (the GPU still full, say) frees what it built and stays offloaded, with
  // the host copy intact: onload() can be called again.
  auto drop = [this] {
    schedule_.reset();
    state_.reset();
    model_.reset();
#ifdef BB_WITH_CUDA
    if (device_.is_cuda()) cuda::release_cached_memory(device_.index);
#endif
  };
  try {
    build_model(mesh_->world()->backend() == comm::Backend::emulated);
    build_state(nullptr);  // the model's initialisation, overwritten below
    std::vector<Tensor> res = state_->resident();
    const HostStash& st = *stash_;
    BB_CHECK(res.size() == st.bytes.size(), "onload: the rebuilt state has ", res.size(), " resident tensors, the "
             "offloaded one ", st.bytes.size());
    for (size_t i = 0; i < res.size(); ++i) {
      BB_CHECK(res[i].nbytes() == st.bytes[i], "onload: resident tensor ", i, " has ", res[i].nbytes(),
               " bytes, the offloaded one ", st.bytes[i]);
      copy_bytes(res[i].raw(), device_, st.data + st.offsets[i], Device::cpu(), st.bytes[i]);
      r.host_bytes += static_cast<int64_t>(st.bytes[i]);
    }
    res.clear();
    synchronize_device(device_);
  } catch (...) {
    drop();
    throw;
  }
  offloaded_ = false;
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) r.device_used = cuda::device_memory_used(device_.index);
#endif
  r.seconds = now_s() - t0;
  r.allocator_live = allocator_for(device_).stats().live_total;
  return r;
}

void Trainer::world_broadcast_run_id() {
  // Rank 0's id is the run's (a resumed run keeps the checkpoint's; every rank read the same).
  mesh_->world()->broadcast_host(run_id_, 0);
}

std::string Trainer::resolve_auto_resume(const std::string& root) {
  // `latest` names the newest committed step. Without it (deleted, or a root written before it
  // existed), the newest complete checkpoint is taken; step directories that are all incomplete
  // are an error listing them rather than a silent fresh start that would overwrite them.
  if (!path_exists(root)) return "";
  if (path_exists(path_join(root, "latest"))) return resolve_checkpoint(root);
  const std::vector<CheckpointEntry> found = list_checkpoints(root);
  for (auto it = found.rbegin(); it != found.rend(); ++it)
    if (it->complete) {
      if (log_)
        std::fprintf(log_, "%s[startup] resume = auto: %s has no 'latest' file; taking the newest complete checkpoint %s\n",
                     log_prefix_.c_str(), root.c_str(), it->name.c_str());
      return path_join(root, it->name);
    }
  if (found.empty()) return "";
  std::string list;
  for (const CheckpointEntry& c : found) list += "\n  " + c.name + ": " + c.problem;
  BB_FAIL("checkpoint.resume = 'auto': ", root, " has no 'latest' file and no complete checkpoint:", list,
          "\nRepair or remove these directories, or set checkpoint.resume to a checkpoint path");
}

void Trainer::check_foreign_checkpoints() {
  // Another run's checkpoints in the root are kept (pruning touches only this run's); one this
  // run would overwrite (same step name) is refused now, before training.
  if (mesh_->rank() != 0) {
    agree(*mesh_->world(), "", "checking checkpoint.dir");
    return;
  }
  std::string err;
  std::vector<std::string> foreign, clash;
  for (const CheckpointEntry& c : list_checkpoints(cfg_.ckpt_dir)) {
    if (c.complete && c.run_id == run_id_) continue;
    if (c.complete) foreign.push_back(c.name);
    // The step the directory's name says (names are step_ + digits; a huge number never clashes).
    const int64_t s = c.name.size() <= 5 + 15 ? std::strtoll(c.name.c_str() + 5, nullptr, 10) : -1;
    const bool periodic = cfg_.ckpt_every > 0 && s > step_ && s <= cfg_.steps && s % cfg_.ckpt_every == 0;
    const bool final = cfg_.ckpt_save_final && s == cfg_.steps && s > step_;
    if (periodic || final) clash.push_back(c.name);
  }
  if (!clash.empty()) {
    std::string list;
    for (const std::string& n : clash) list += " " + n;
    err = "checkpoint.dir = '" + cfg_.ckpt_dir + "' holds checkpoints of another run that this run would overwrite:" +
          list + ". Resume that run (checkpoint.resume = \"auto\"), remove them, or use another checkpoint.dir";
  } else if (!foreign.empty() && log_) {
    std::fprintf(log_, "%s[startup] %s also holds %zu checkpoint(s) of other runs (%s ... %s); they are kept\n",
                 log_prefix_.c_str(), cfg_.ckpt_dir.c_str(), foreign.size(), foreign.front().c_str(),
                 foreign.back().c_str());
  }
  agree(*mesh_->world(), err, "checking checkpoint.dir");
}

double Trainer::lr_at(int64_t step) const {
  const double peak = cfg_.lr, lo = cfg_.min_lr;
  if (cfg_.warmup_steps > 0 && step <= cfg_.warmup_steps)
    return peak * static_cast<double>(step) / static_cast<double>(cfg_.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, cfg_.steps - cfg_.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - cfg_.warmup_steps) / decay_steps);
  return lo + 0.5 * (peak - lo) * (1.0 + std::cos(M_PI * progress));
}

void Trainer::check_memory_fits([[maybe_unused]] comm::Group& base, [[maybe_unused]] int rank) {
#ifdef BB_WITH_CUDA
  // Before anything is allocated: the predicted peak against what the device has (every rank
  // checks its own; all stop when one would run out).
  const char* p = log_prefix_.c_str();
  const int64_t available = cuda::memory_available(device_.index);
  std::string err;
  try {
    const plan::FitCheck fc = plan::check_fit(cfg_, base.size(), rank, available);
    predicted_memory_ = fc.estimate.table();
    if (!fc.fits && cfg_.memory_check == "refuse") err = "rank " + std::to_string(rank) + ": " + fc.message;
    else if (!fc.fits && log_)
      std::fprintf(log_, "%s[startup] WARNING (train.memory_check = \"warn\", --force): %s\n", p, fc.message.c_str());
    else if (log_)
      std::fprintf(log_, "%s[startup] memory: predicted peak %s per rank (%s), %s available\n", p,
                   format_bytes(fc.estimate.peak_total).c_str(), fc.estimate.peak_moment.c_str(),
                   format_bytes(available).c_str());
  } catch (const std::exception& e) {
    // A configuration the estimator does not model yet must not stop a run that is valid.
    if (log_)
      std::fprintf(log_, "%s[startup] WARNING: the memory prediction failed (%s); starting without the check\n", p,
                   e.what());
  }
  agree(base, err, "checking that the run fits in GPU memory");
#endif
}

StepMetrics Trainer::train_step() {
  check_onloaded("train_step");
  BB_CHECK(!pending_, "train_step: a forward_backward is waiting for its optim_step; call optim_step first");
  return guarded([&] { return step_impl(false); });
}

StepMetrics Trainer::guarded(const std::function<StepMetrics()>& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    // An out-of-memory error says what the estimator expected of this rank.
    if (predicted_memory_.empty() || std::string(e.what()).find("out of GPU memory") == std::string::npos) throw;
    throw Error(std::string(e.what()) + "\nThe estimator predicted for this rank (bumblebee plan --explain):\n" +
                predicted_memory_);
  }
}

void Trainer::check_batch_data(const Corpus& c) const {
  const std::string src = data_ && &c == &data_->corpus() ? "data '" + cfg_.data.path + "'" : std::string("the batch");
  if (cfg_.prim.router_replay) check_replay_routing(cfg_, c);
  if (!policy_) return;
  BB_CHECK(c.has_rl(), "primitives.loss = \"policy\" trains on rollouts, but ", src,
           " has no \"advantages\": give JSONL rollout records (tokens, loss_mask, advantages, old_logprobs, ...; "
           "skills/rl-data.md), or choose primitives.loss = \"linear_ce\"");
  BB_CHECK(cfg_.prim.loss_chunks.policy.kl_coef == 0 || !c.ref_logprobs.empty(), "policy.kl_coef = ",
           cfg_.prim.loss_chunks.policy.kl_coef, " needs \"ref_logprobs\" in the rollout records of ", src,
           " (or set policy.kl_coef = 0)");
}

std::vector<MicroBatch> Trainer::pack_batch(Corpus batch) {
  BB_CHECK(batch.num_documents() > 0, "the batch has no document");
  check_batch_data(batch);
  return whole_loader(cfg_, std::move(batch)).pack_all(mesh_->layout().dp * cfg_.grad_accum);
}

StepMetrics Trainer::step_on(Corpus batch, bool split) {
  std::vector<MicroBatch> mbs = pack_batch(std::move(batch));
  given_ = &mbs;
  try {
    StepMetrics m = guarded([&] { return step_impl(split); });
    given_ = nullptr;
    return m;
  } catch (...) {
    given_ = nullptr;
    pending_.reset();
    throw;
  }
}

StepMetrics Trainer::train_on(Corpus batch) {
  check_onloaded("train_on");
  BB_CHECK(!pending_, "train_on: a forward_backward is waiting for its optim_step; call optim_step first");
  return step_on(std::move(batch), false);
}

StepMetrics Trainer::forward_backward_on(Corpus batch) {
  check_onloaded("forward_backward");
  BB_CHECK(!pending_, "forward_backward: the previous forward_backward has not been applied; call optim_step first "
           "(gradients do not accumulate across calls: give the whole step's documents to one call)");
  return step_on(std::move(batch), true);
}

StepMetrics Trainer::optim_step() {
  BB_CHECK(pending_, "optim_step: no forward_backward to apply (call forward_backward first)");
  std::unique_ptr<PendingStep> p = std::move(pending_);
  if (p->finished) return p->m;  // a step without targets: nothing to apply
  return guarded([&] { return finish_step(*p); });
}

Tensor Trainer::forward_logits(const MicroBatch& mb) {
  check_onloaded("forward_logits");
  BB_CHECK(mesh_->world()->size() == 1, "forward_logits runs on one rank (this run has ", mesh_->world()->size(),
           "); the multi-rank forward-only pass is the logprobs command's");
  Tensor logits;
  schedule_->forward(to_device(mb, device_), &logits);
  return logits.to(Device::cpu(), MemCategory::other);
}

std::vector<DocLogprobs> Trainer::score(const Corpus& docs, double temperature, bool routing) {
  check_onloaded("score");
  BB_CHECK(!pending_, "logprobs: a forward_backward is waiting for its optim_step; call optim_step first");
  return score_documents(cfg_, *mesh_, *model_, *schedule_, device_, docs, temperature, routing);
}

StepMetrics Trainer::step_impl(bool split) {
  Allocator& alloc = allocator_for(device_);
  alloc.reset_peak();
  const double t0 = now_s();
  StepMetrics m;
  m.step = step_ + 1;
#ifdef BB_WITH_CUDA
  const int64_t syncs0 = cuda::host_sync_count();
#endif
  comm::Group& world = *mesh_->world();
  const int64_t dp = mesh_->layout().dp, dp_rank = mesh_->dp_rank(), accum = cfg_.grad_accum;
  const int64_t cp = mesh_->layout().cp;

  // The step's dp x grad_accum micro-batches come from one global stream; DP rank r takes
  // [r A, (r + 1) A). Every rank packs all of them (cheap) so the data position is global.
  std::vector<MicroBatch> mbs;  // uploaded without a host sync (pinned staging)
  BB_CHECK(given_ || data_, "data.path = \"none\": this trainer takes each step's batch from its caller "
           "(Trainer::train_on, the Python API's train_batch)");
  std::vector<MicroBatch> step_mbs = given_ ? std::move(*given_) : data_->next_step(dp * accum);
  given_ = nullptr;
  for (int64_t i = 0; i < dp * accum; ++i) {
    // Context parallelism: the cp ranks of a data rank share its micro-batches, each keeping its
    // head-tail shard of every sequence (runtime/context_shard.h).
    if (i / accum == dp_rank)
      mbs.push_back(to_device(shard_micro_batch(step_mbs[static_cast<size_t>(i)], cp, mesh_->cp_rank()), device_));
  }
  step_mbs.clear();
  int64_t local_valid = 0;
  for (const MicroBatch& mb : mbs) local_valid += mb.num_valid;
  const int64_t valid = world.sum(local_valid);
  if (valid == 0) {
    // Nothing to learn from (every target masked): the step is counted and skipped, the data
    // moves on, so a resume does not meet the same batch again at the same step.
    m.skipped = "no_targets";
    ++skipped_no_targets_;
    step_ = m.step;
    m.lr = lr_at(m.step);
    m.loss = m.grad_norm = std::nan("");
    for (const MicroBatch& mb : mbs) m.tokens += mb.tokens.numel();
    m.tokens = world.sum(m.tokens);
    m.step_time_s = now_s() - t0;
    m.mem = m.mem_max = alloc.stats();
    if (split) {
      pending_ = std::make_unique<PendingStep>();
      pending_->finished = true;
      pending_->m = m;
    }
    return m;
  }

  // The update during the backward ([backend] optimizer_in_backward): with clipping off nothing
  // global is needed before a unit's update, so the state runs it as soon as the unit's gradient
  // is final. The flags and (skip_step) the backup exist before the first update.
  // Not with a separate optim_step (split): the update waits for it.
  const bool early_update = !split && cfg_.backend.optimizer_in_backward && cfg_.grad_clip == 0;
  Tensor flags;
  if (early_update) {
    flags = Tensor::zeros({static_cast<int64_t>(state_->num_units())}, DType::i32, device_, MemCategory::workspace);
    if (cfg_.on_nonfinite == "skip_step") state_->save_backup();
  }
  {
    BB_RANGE("zero_grad");
    if (early_update) {
      ModelState::EarlyUpdate eu;
      eu.step = m.step;
      eu.lr = lr_at(m.step);
      eu.weight_decay = cfg_.weight_decay;
      eu.cfg = AdamWConfig{cfg_.beta1, cfg_.beta2, cfg_.adam_eps};
      eu.nonfinite = &flags;
      state_->begin_step(&eu);
    } else {
      state_->begin_step();
    }
  }
  double sums[6] = {0, 0, 0, 0, 0, 0};  // loss_sum, aux, z, tokens, flops, expert rows received
  // The loss's denominator: valid tokens, or (policy loss, sequence aggregation) the step's
  // sequences, each document counted by the share of its targets in the step (seq_weight).
  double denom = static_cast<double>(valid);
  if (policy_ && cfg_.prim.loss_chunks.policy.aggregation != PolicyAggregation::token_mean) {
    double seqs = 0;
    for (const MicroBatch& mb : mbs) {
      const float* sw = mb.seq_weight.data<float>();
      for (int64_t t = 0; t < mb.seq_weight.numel(); ++t) seqs += sw[t];
    }
    world.all_reduce_host(&seqs, 1, comm::ReduceOp::sum);
    denom = seqs;
  }
  const float loss_scale = static_cast<float>(1.0 / denom);
  PolicyMetrics pm;
  const double aux_scale = 1.0 / static_cast<double>(dp * accum);
  std::vector<int64_t> routing(record_routing_ ? static_cast<size_t>(dp * accum) : 0, 0);
  for (size_t i = 0; i < mbs.size(); ++i) {
    state_->begin_micro_batch(i + 1 == mbs.size());
    ForwardStats st = schedule_->forward_backward(mbs[i], loss_scale, aux_scale);
    sums[0] += st.loss_sum;
    // The pooled aux loss is the micro-batch's on each of its cp ranks (the pool is reduced over
    // them); the z-loss is each shard's part already.
    sums[1] += st.aux_loss * aux_scale / static_cast<double>(cp);
    sums[2] += st.z_loss * aux_scale;
    sums[3] += static_cast<double>(mbs[i].tokens.numel());
    // Each cp rank counts its share of the whole sequences' work.
    sums[4] += mbs[i].shard.split() ? model_flops(cfg_.model, mbs[i].shard.seqlens) / static_cast<double>(cp)
                                    : model_flops(cfg_.model, seq_lens(mbs[i]));
    sums[5] += static_cast<double>(st.moe_rows_received);
    if (policy_) accumulate_policy(pm, st.policy);
    if (record_routing_)
      routing[static_cast<size_t>(dp_rank * accum) + i] = routing_hash(schedule_->last_routing(), mbs[i]);
  }
  const int64_t my_rows = static_cast<int64_t>(sums[5]);
  state_->end_backward();
  world.all_reduce_host(sums, 6, comm::ReduceOp::sum);
  if (record_routing_) {  // each slot is summed over the cp ranks of one data rank
    world.all_reduce_host(routing.data(), static_cast<int64_t>(routing.size()), comm::ReduceOp::sum);
    for (int64_t& h : routing) h %= kRoutingHashPrime;
    m.routing = routing;
  }
  m.moe_rows_mean = sums[5] / static_cast<double>(world.size());
  m.valid_tokens = valid;
  m.loss = sums[0] / denom;
  if (policy_) m.policy = reduce_policy(world, pm, valid);
  m.aux_loss = sums[1];
  m.z_loss = sums[2];
  m.tokens = static_cast<int64_t>(sums[3]);
  const double flops = sums[4] / static_cast<double>(world.size());  // per rank

  m.grad_norm = state_->grad_norm();
  auto p = std::make_unique<PendingStep>();
  p->m = m;
  p->elapsed = now_s() - t0;
#ifdef BB_WITH_CUDA
  p->syncs0 = syncs0;
#endif
  p->flops = flops;
  p->my_rows = my_rows;
  p->early_update = early_update;
  p->flags = flags;
  if (split) {  // the update comes with optim_step()
    m.lr = lr_at(m.step);
    pending_ = std::move(p);
    return m;
  }
  return finish_step(*p);
}

// The update and the step's accounting (step_impl's second half; optim_step's whole).
StepMetrics Trainer::finish_step(PendingStep& p) {
  Allocator& alloc = allocator_for(device_);
  comm::Group& world = *mesh_->world();
  StepMetrics& m = p.m;
  // The step's time is its own work: a split step does not count the caller's time between the
  // two calls.
  const double t0 = now_s() - p.elapsed, flops = p.flops;
  const int64_t my_rows = p.my_rows;
  const bool early_update = p.early_update;
  Tensor flags = p.flags;
#ifdef BB_WITH_CUDA
  const int64_t syncs0 = p.syncs0;
#endif
  m.lr = lr_at(m.step);
  // The non-finite guard, part 1: loss and gradient norm are host values already (the same on
  // every rank). A non-finite one means no update is applied.
  const char* bad_quantity = !std::isfinite(m.loss)        ? "the loss"
                             : !std::isfinite(m.grad_norm) ? "the gradient norm"
                             : !std::isfinite(m.aux_loss)  ? "the aux loss"
                             : !std::isfinite(m.z_loss)    ? "the z loss"
                                                           : nullptr;
  if (bad_quantity) {
    // Updates made during the backward (the offload's host updates start with the backward).
    const bool applied = state_->early_updates() > 0 || (early_update && state_->offload());
    BB_CHECK(cfg_.on_nonfinite == "skip_step", "step ", m.step, ": ", bad_quantity, " is not finite (loss ", m.loss,
             ", grad norm ", m.grad_norm, "); ",
             applied ? "the run stops before saving the update made during the backward"
                     : "no update was applied",
             " and nothing was saved. Lower train.lr, check the data, or set train.on_nonfinite = \"skip_step\" to "
             "skip such steps");
    if (applied) state_->restore_backup();  // taken before the step's first update
    m.skipped = "nonfinite";
  }
  const bool guard_update = !bad_quantity;
  if (guard_update) {
    AdamWConfig ac{cfg_.beta1, cfg_.beta2, cfg_.adam_eps};
    // Clipping is folded into the update (one pass over the gradients instead of two).
    if (cfg_.grad_clip > 0 && m.grad_norm > cfg_.grad_clip)
      ac.grad_scale = static_cast<float>(cfg_.grad_clip / (m.grad_norm + 1e-6));
    if (cfg_.on_nonfinite == "skip_step" && !early_update) state_->save_backup();
    // Part 2: one flag per unit, set by the update kernels themselves when a new master or
    // moment is Inf/NaN; read back with the step's end-of-step sync (GPU) and or-ed over ranks
    // in the all-reduce of the memory peaks below.
    const int64_t nu = static_cast<int64_t>(state_->num_units());
    if (!early_update) flags = Tensor::zeros({nu}, DType::i32, device_, MemCategory::workspace);
    state_->step(m.step, m.lr, cfg_.weight_decay, ac, &flags);  // the units not updated yet
#ifdef BB_WITH_CUDA
    if (device_.is_cuda()) {
      if (!pinned_flags_ || pinned_flags_n_ < nu) {
        cuda::pinned_free(pinned_flags_);
        pinned_flags_ = static_cast<int32_t*>(cuda::pinned_alloc(static_cast<size_t>(nu) * sizeof(int32_t)));
        pinned_flags_n_ = nu;
      }
      cuda::copy_to_pinned_async(pinned_flags_, flags.raw(), static_cast<size_t>(nu) * sizeof(int32_t));
    }
#endif
    nonfinite_flags_ = flags;
  }
  step_ = m.step;
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) {
    // The step's time includes all its device work, every stream. With peers, the wait has the
    // job's deadline: a hung peer leaves NCCL kernels waiting forever, and this is where the
    // host would otherwise block on them.
    if (world.size() > 1) wait_device_or_abort(device_, "the end of step " + std::to_string(m.step));
    else synchronize_device(device_);
    m.host_syncs = cuda::host_sync_count() - syncs0;
  }
#endif
  m.step_time_s = now_s() - t0;
  m.tokens_per_s = static_cast<double>(m.tokens) / m.step_time_s;
  m.model_tflops = flops / m.step_time_s / 1e12;
  m.mem = alloc.stats();
  // The first unit (1-based) whose update went non-finite on this rank, 0 if none.
  int64_t bad_unit = 0;
  if (guard_update) {
    const int32_t* f = nullptr;
#ifdef BB_WITH_CUDA
    if (device_.is_cuda()) f = pinned_flags_;  // the copy finished with the sync above
#endif
    if (!f) f = nonfinite_flags_.data<int32_t>();
    for (int64_t i = 0; i < nonfinite_flags_.numel() && !bad_unit; ++i)
      if (f[i]) bad_unit = i + 1;
  }
  nonfinite_flags_ = Tensor();
  // adamw_offload: the host sets the flags of the updates it has finished. Under skip_step the
  // step waits for its own (it may have to undo them); otherwise an update still running when the
  // step ends is checked at the next step's end, before any later update or save can use it (a
  // checkpoint waits for every update and refuses Inf/NaN itself).
  int64_t offload_bad_step = 0;
  if (state_->offload() && guard_update && cfg_.on_nonfinite == "skip_step") state_->settle_updates();
  if (const auto b = state_->take_offload_nonfinite(); b && !bad_unit) {
    bad_unit = static_cast<int64_t>(b->unit) + 1;
    offload_bad_step = b->step;
  }
  // Per-rank maxima of the peaks and of the non-finite flag (one small all-reduce).
  std::array<int64_t, kNumMemCategories + 5> pk{};
  for (int c = 0; c < kNumMemCategories; ++c) pk[static_cast<size_t>(c)] = m.mem.peak[static_cast<size_t>(c)];
  pk[kNumMemCategories] = m.mem.peak_total;
  pk[kNumMemCategories + 1] = m.mem.reserved_peak;
  pk[kNumMemCategories + 2] = bad_unit;
  pk[kNumMemCategories + 3] = my_rows;
  pk[kNumMemCategories + 4] = comm::stop_signal();  // a stop asked of any rank stops every rank here
  world.all_reduce_host(pk.data(), static_cast<int64_t>(pk.size()), comm::ReduceOp::max);
  m.moe_rows_max = pk[kNumMemCategories + 3];
  m.stop_signal = static_cast<int>(pk[kNumMemCategories + 4]);
  if (const int64_t bu = pk[kNumMemCategories + 2]; bu > 0) {
    const std::string unit = state_->unit_name(static_cast<size_t>(bu - 1));
    BB_CHECK(cfg_.on_nonfinite == "skip_step", "step ", m.step, ": the update ",
             offload_bad_step > 0 && offload_bad_step != m.step
                 ? "of step " + std::to_string(offload_bad_step) + " (primitives.optimizer = adamw_offload updates "
                   "on the host beside the next step, and is checked when it finishes) "
                 : std::string(),
             "made the weights or optimizer moments of ",
             "unit '", unit, "' non-finite (Inf/NaN) at lr ", m.lr, " (loss ", m.loss, ", grad norm ", m.grad_norm,
             "); the run stops before saving it, so checkpoint.dir still holds the last good step. Lower train.lr, or set "
             "train.on_nonfinite = \"skip_step\" to undo such steps");
    state_->restore_backup();
    m.skipped = "nonfinite";
  }
  if (m.skipped == "nonfinite") ++skipped_nonfinite_;
  m.mem_max = m.mem;
  for (int c = 0; c < kNumMemCategories; ++c) m.mem_max.peak[static_cast<size_t>(c)] = pk[static_cast<size_t>(c)];
  m.mem_max.peak_total = pk[kNumMemCategories];
  m.mem_max.reserved_peak = pk[kNumMemCategories + 1];
  return m;
}

void Trainer::log_line(const StepMetrics& m) {
  if (!log_) return;
  if (!m.skipped.empty()) {
    std::fprintf(log_, "%sstep %6lld | skipped (%s) | loss %.4g | gnorm %.4g | lr %.2e | skipped so far: %lld non-finite, "
                 "%lld without loss targets\n", log_prefix_.c_str(), static_cast<long long>(m.step),
                 m.skipped == "nonfinite" ? "non-finite loss, gradient or update: no update applied"
                                          : "no token of the step has a loss target",
                 m.loss, m.grad_norm, m.lr, static_cast<long long>(skipped_nonfinite_),
                 static_cast<long long>(skipped_no_targets_));
    std::fflush(log_);
    return;
  }
  // Rank 0 prints the maxima over ranks; with log.all_ranks each rank its own peaks.
  const MemoryStats& mem = cfg_.log_all_ranks ? m.mem : m.mem_max;
  const auto& pk = mem.peak;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::fprintf(log_,
               "%sstep %6lld | loss %.4f | aux %.4f | gnorm %.3f | lr %.2e | %s tok/s | %.4f TFLOP/s | "
               "peak MiB: act %.1f logits %.1f moe %.1f params %.1f grads %.1f opt %.1f comm %.1f total %.1f\n",
               log_prefix_.c_str(), static_cast<long long>(m.step), m.loss, m.aux_loss, m.grad_norm, m.lr,
               human_count(m.tokens_per_s).c_str(), m.model_tflops,
               mib(pk[static_cast<int>(MemCategory::activations)]), mib(pk[static_cast<int>(MemCategory::logits)]),
               mib(pk[static_cast<int>(MemCategory::moe)]), mib(pk[static_cast<int>(MemCategory::params)]),
               mib(pk[static_cast<int>(MemCategory::grads)]), mib(pk[static_cast<int>(MemCategory::optimizer)]),
               mib(pk[static_cast<int>(MemCategory::comm)]), mib(mem.peak_total));
  if (device_.is_cuda())
    std::fprintf(log_, "%s           reserved peak %.1f MiB | host syncs %lld\n", log_prefix_.c_str(), mib(mem.reserved_peak),
                 static_cast<long long>(m.host_syncs));
  if (policy_)
    std::fprintf(log_, "%s           policy: clip %.4f dual %.4f | kl(old) %.2e | entropy %.4f | ratio mean %.4f max %.4f | kl(ref) %.2e | seqs %.1f\n",
                 log_prefix_.c_str(), m.policy.clip_frac, m.policy.dual_clip_frac, m.policy.approx_kl, m.policy.entropy,
                 m.policy.ratio_mean, m.policy.ratio_max, m.policy.ref_kl, m.policy.sequences);
  if (mesh_->layout().ep > 1)  // token-count skew of expert parallelism
    std::fprintf(log_, "%s           expert rows per rank: max %s mean %s (skew %.2f)\n", log_prefix_.c_str(),
                 human_count(static_cast<double>(m.moe_rows_max)).c_str(), human_count(m.moe_rows_mean).c_str(),
                 m.moe_rows_mean > 0 ? static_cast<double>(m.moe_rows_max) / m.moe_rows_mean : 1.0);
  std::fflush(log_);
}

void Trainer::check_loss_spike(StepMetrics& m) {
  // Compared against an exponential mean of the earlier steps' losses (weight 0.1), from the
  // fourth step on; a warning only. Not for the policy loss: its objective sits near 0 and
  // changes sign, so a ratio to its mean means nothing.
  if (policy_) return;
  if (cfg_.loss_spike_factor > 0 && loss_mean_n_ >= 3 && m.loss > cfg_.loss_spike_factor * loss_mean_) {
    m.loss_spike = true;
    if (log_) {
      std::fprintf(log_, "%s[warn] step %lld: loss %.4g is %.1fx the running mean %.4g (train.loss_spike_factor = %g)\n",
                   log_prefix_.c_str(), static_cast<long long>(m.step), m.loss, m.loss / loss_mean_, loss_mean_,
                   cfg_.loss_spike_factor);
      std::fflush(log_);
    }
  }
  loss_mean_ = loss_mean_n_ == 0 ? m.loss : 0.9 * loss_mean_ + 0.1 * m.loss;
  ++loss_mean_n_;
}

// One row of log.metrics (JSON, no newline): the step's metrics as the run writes them.
std::string Trainer::metrics_line(const StepMetrics& m) const {
  nlohmann::json j;
  j["step"] = m.step;
  j["run_id"] = run_id_;
  if (!m.skipped.empty()) j["skipped"] = m.skipped;
  if (m.loss_spike) j["loss_spike"] = true;
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
  for (int c = 0; c < kNumMemCategories; ++c) pk[category_name(static_cast<MemCategory>(c))] = m.mem_max.peak[c];
  pk["total"] = m.mem_max.peak_total;
  j["peak_bytes"] = pk;  // maxima over ranks
  j["reserved_peak_bytes"] = m.mem_max.reserved_peak;
  j["ranks"] = mesh_->world()->size();
  if (mesh_->world()->backend() == comm::Backend::emulated) j["emulated"] = cfg_.emulate.str();
  j["host_syncs"] = m.host_syncs;
  j["moe_rows_max"] = m.moe_rows_max;  // expert rows received per rank: max and mean
  j["moe_rows_mean"] = m.moe_rows_mean;
  if (policy_ && m.skipped != "no_targets")
    j["policy"] = {{"clip_frac", m.policy.clip_frac},   {"dual_clip_frac", m.policy.dual_clip_frac},
                   {"approx_kl", m.policy.approx_kl},   {"entropy", m.policy.entropy},
                   {"ratio_mean", m.policy.ratio_mean}, {"ratio_max", m.policy.ratio_max},
                   {"ref_kl", m.policy.ref_kl},         {"sequences", m.policy.sequences}};
  return j.dump();
}

std::vector<StepMetrics> Trainer::run() {
  check_onloaded("run");
  std::vector<StepMetrics> out;
  std::unique_ptr<std::ofstream> metrics;
  const std::string& mpath = cfg_.metrics_path;
  int lock_fd = -1;  // held for the run: one writer per metrics file
  struct LockGuard {
    int& fd;
    ~LockGuard() {
      if (fd >= 0) ::close(fd);  // closing releases the flock
    }
  } lock_guard{lock_fd};
  if (!mpath.empty() && writer_) {
    const auto slash = mpath.find_last_of('/');
    if (slash != std::string::npos && slash > 0) make_dirs(mpath.substr(0, slash));
    // Two runs writing one metrics file would truncate and interleave each other's rows: the
    // second is refused. The lock file stays (never unlinked, as the checkpoint root's).
    // (A device or pipe given as the metrics "file" gets no lock file beside it.)
    const std::string lock = mpath + ".lock";
    struct stat sb {};
    const bool regular = ::stat(mpath.c_str(), &sb) != 0 || S_ISREG(sb.st_mode);
    lock_fd = regular ? ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (lock_fd >= 0) {
      BB_CHECK(::flock(lock_fd, LOCK_EX | LOCK_NB) == 0, "log.metrics = '", mpath,
               "' is being written by another run (lock file ", lock, "); wait for it to finish or give this run ",
               "another log.metrics");
    } else if (regular && log_) {  // a directory where the lock cannot be made: unguarded
      std::fprintf(log_, "%s[warn] log.metrics: cannot create the lock file %s (%s); a second run given the same file "
                   "would not be stopped\n", log_prefix_.c_str(), lock.c_str(), std::strerror(errno));
    }
    if (step_ > 0 && path_exists(mpath)) {
      // A resumed run continues the file from its checkpoint: the lines of later steps (written
      // before a crash, and about to be written again) are dropped, as is a torn last line.
      std::string kept;
      int64_t dropped = 0;
      const std::string old = read_file(mpath);
      size_t at = 0;
      while (at < old.size()) {
        size_t end = old.find('\n', at);
        if (end == std::string::npos) end = old.size();
        const std::string line = old.substr(at, end - at);
        at = end + 1;
        if (line.empty()) continue;
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        // Rows of this run (rows written before run ids were recorded count as its own).
        const bool mine = !j.is_discarded() && j.is_object() &&
                          (!j.contains("run_id") || (j["run_id"].is_string() && j["run_id"].get<std::string>() == run_id_));
        if (mine && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step_)
          kept += line + "\n";
        else
          ++dropped;
      }
      atomic_write(mpath, kept);
      if (dropped && log_)
        std::fprintf(log_, "%s[startup] log.metrics: dropped %lld line(s) after step %lld or of other runs from %s (the run resumes there)\n",
                     log_prefix_.c_str(), static_cast<long long>(dropped), static_cast<long long>(step_), mpath.c_str());
    }
    metrics = std::make_unique<std::ofstream>(mpath, step_ > 0 ? std::ios::app : std::ios::trunc);
    BB_CHECK(metrics->good(), "cannot open log.metrics file '", mpath, "' for writing");
  }
  // A periodic async save will come before the last step: its host buffers are made now.
  if (!cfg_.ckpt_dir.empty() && cfg_.ckpt_async && cfg_.ckpt_every > 0 &&
      (step_ / cfg_.ckpt_every + 1) * cfg_.ckpt_every < cfg_.steps)
    prepare_snapshot_buffers();
  while (step_ < cfg_.steps) {
    StepMetrics m;
    try {
      m = train_step();
    } catch (...) {
      // A save being written beside the failed step holds a good step. In one process it is
      // committed now; with peers the commit is a collective that ranks which did not fail
      // would not join, so its temporary directory stays, as after a crash (removed at the next
      // start), and `latest` names the checkpoint before it.
      if (save_job_) {
        std::unique_ptr<SaveJob> job = std::move(save_job_);
        if (job->writer.joinable()) job->writer.join();
        if (mesh_->world()->size() == 1) {
          try {
            commit_save(*job);
          } catch (const std::exception& e) {
            if (log_) std::fprintf(log_, "%s[checkpoint] %s\n", log_prefix_.c_str(), e.what());
          }
        }
      }
      throw;
    }
    if (m.skipped.empty()) check_loss_spike(m);
    out.push_back(m);
    if (m.step % cfg_.log_every == 0 || m.step == cfg_.steps || m.step == 1 || !m.skipped.empty()) log_line(m);
    if (metrics) {
      *metrics << metrics_line(m) << "\n";
      metrics->flush();
      BB_CHECK(metrics->good(), "cannot write log.metrics file '", mpath, "' at step ", m.step,
               " (disk full or file system error); the run stops rather than lose its metrics");
    }
    const bool periodic = cfg_.ckpt_every > 0 && m.step % cfg_.ckpt_every == 0;
    const bool final = m.step == cfg_.steps && cfg_.ckpt_save_final;
    const bool stopping = m.stop_signal != 0;
    poll_save();  // a shard written beside the steps since: committed once every rank's is done
    // A stop asked by a signal saves the step it ended on (once), then leaves the loop. The
    // final and stopping saves are written before run() returns; a periodic one beside the
    // next steps with checkpoint.async.
    if (!cfg_.ckpt_dir.empty() && (periodic || final || stopping)) {
      if (cfg_.ckpt_async && periodic && !final && !stopping) start_save(cfg_.ckpt_dir);
      else save_checkpoint(cfg_.ckpt_dir);
    }
    if (stopping) {
      stopped_by_ = m.stop_signal;
      if (log_) {
        std::fprintf(log_, "%s[stopped] by signal %d after step %lld%s\n", log_prefix_.c_str(), m.stop_signal,
                     static_cast<long long>(m.step),
                     cfg_.ckpt_dir.empty() ? " (no checkpoint.dir: nothing saved)"
                                           : "; the checkpoint of that step is saved, checkpoint.resume = \"auto\" "
                                             "continues from it");
        std::fflush(log_);
      }
      break;
    }
  }
  finish_save();
  return out;
}


namespace {

// The runs of unit i's owned elements a checkpoint shard holds, in global coordinates: an
// expert unit of an expert-parallel rank its experts' runs of the global unit; every other unit
// its range as it is.
std::vector<GlobalUnit::Run> save_runs(ModelState& state, ParamUnit& unit, size_t i, int64_t num_experts) {
  const auto [lo, len] = state.checkpoint_range(i);
  const GlobalUnit g = global_unit(unit, num_experts);
  return g.identity ? std::vector<GlobalUnit::Run>{{lo, lo, len}} : global_runs(g, lo, len);
}

}  // namespace

std::vector<std::pair<std::vector<int64_t>, DType>> Trainer::snapshot_layout() {
  // begin_save's order: per unit the master (unless split), exp_avg and exp_avg_sq; then the
  // split masters' halves, upper and lower, unit by unit.
  std::vector<std::pair<std::vector<int64_t>, DType>> out, halves;
  std::vector<ParamUnit*> units = model_->units();
  for (size_t i = 0; i < units.size(); ++i) {
    int64_t total = 0;
    for (const GlobalUnit::Run& r : save_runs(*state_, *units[i], i, cfg_.model.num_experts)) total += r.n;
    if (total == 0) continue;
    const ModelState::Owned o = state_->owned(i);
    const std::pair<Tensor, Tensor> split = state_->master_halves(i, 0, 0);
    if (split.first.defined()) {
      halves.push_back({{total}, split.first.dtype()});
      halves.push_back({{total}, split.second.dtype()});
    } else {
      out.push_back({{total}, DType::f32});
    }
    out.push_back({{total}, o.exp_avg.dtype()});
    out.push_back({{total}, o.exp_avg_sq.dtype()});
  }
  out.insert(out.end(), halves.begin(), halves.end());
  return out;
}

void Trainer::prepare_snapshot_buffers() {
  if (offloaded_) return;
  if (!snapshot_) snapshot_ = std::make_unique<SnapshotBuffers>();
  const std::vector<std::pair<std::vector<int64_t>, DType>> layout = snapshot_layout();
  const bool lock = device_.is_cuda();
  const double t0 = now_s();
  try {
    bool fresh = false;
    for (size_t k = 0; k < layout.size(); ++k) snapshot_->take(k, layout[k].first, layout[k].second, lock, &fresh);
    if (log_) {
      const std::string how =
          !lock ? " (the saves reuse them)"
          : snapshot_->unlocked_bytes == 0
              ? " (page-locked; the saves reuse them)"
              : " (the saves reuse them; " + format_bytes(snapshot_->unlocked_bytes) +
                    " could not be page-locked and copies slower)";
      std::fprintf(log_, "%s[checkpoint] async-save host buffers ready before the first step: %s in %.2fs%s\n",
                   log_prefix_.c_str(), format_bytes(snapshot_->bytes()).c_str(), now_s() - t0, how.c_str());
      std::fflush(log_);
    }
  } catch (const std::exception& e) {
    // Out of host memory, say: the first snapshot allocates what is missing (and fails there,
    // on every rank, if it still cannot).
    if (log_)
      std::fprintf(log_, "%s[checkpoint] could not prepare the async-save host buffers (%s); the first save "
                   "allocates them\n", log_prefix_.c_str(), e.what());
  }
}

// Phase 1 of a save (collective): the shard's tensors (host copies with `to_host`), the finite
// check, the temporary directory, and rank 0's state.json as of this step.
std::unique_ptr<Trainer::SaveJob> Trainer::begin_save(const std::string& root, bool to_host) {
  comm::Group& world = *mesh_->world();
  const int rank = world.rank();
  auto job = std::make_unique<SaveJob>();
  job->t0 = now_s();
  job->root = root;
  job->name = step_dir_name(step_);
  const std::string& name = job->name;
  const std::string final_dir = job->final_dir = path_join(root, name);
  // One temporary directory for every rank, named by rank 0.
  std::string tmp_dir = path_join(root, "." + name + ".tmp." + std::to_string(::getpid()));
  world.broadcast_host(tmp_dir, 0);
  job->tmp_dir = tmp_dir;
  if (log_) {
    std::fprintf(log_, "%s[checkpoint] saving step %lld to %s ...\n", log_prefix_.c_str(), static_cast<long long>(step_),
                 final_dir.c_str());
    std::fflush(log_);
  }
  std::string err;
  // This rank's shard: what the state family owns (replicated: its 1/N of every unit), in
  // global coordinates (checkpoint.h): an expert unit of an expert-parallel rank writes its
  // experts' runs of the global unit; every other unit its range as it is.
  std::map<std::string, std::string>& meta = job->meta;
  meta = {{"format", "bumblebee-shard"},
                                             {"rank", std::to_string(rank)},
                                             {"world", std::to_string(world.size())}};
  std::vector<std::pair<std::string, Tensor>>& tensors = job->tensors;
  try {
    std::vector<ParamUnit*> units = model_->units();
    for (size_t i = 0; i < units.size(); ++i) {
      const ModelState::Owned o = state_->owned(i);
      const std::vector<GlobalUnit::Run> runs = save_runs(*state_, *units[i], i, cfg_.model.num_experts);
      std::string range;
      int64_t total = 0;
      for (const GlobalUnit::Run& r : runs) {
        range += (range.empty() ? "" : " ") + std::to_string(r.global) + " " + std::to_string(r.n);
        total += r.n;
      }
      meta[units[i]->name] = range.empty() ? "0 0" : range;
      if (total == 0) continue;
      // The runs of a tensor of the owned elements; part(from, n): its elements [from, from + n)
      // of the owned range (the master's joined on the host when it is split: only these).
      auto take = [&](auto&& part) {
        if (runs.size() == 1) return part(runs[0].local - o.lo, runs[0].n);
        Tensor out;
        int64_t at = 0;
        for (const GlobalUnit::Run& r : runs) {
          const Tensor piece = part(r.local - o.lo, r.n);
          if (!out.defined()) out = Tensor::empty({total}, piece.dtype(), piece.device(), MemCategory::other);
          out.narrow(at, r.n).copy_from(piece);
          at += r.n;
        }
        return out;
      };
      if (to_host && state_->master_halves(i, 0, 0).first.defined()) {
        // A split master in an async save: its halves are copied as they are and the writer
        // joins them, so that the step waits neither for the join nor for its host pass.
        tensors.emplace_back(units[i]->name + ".master", Tensor());
        job->joins.push_back({tensors.size() - 1,
                              take([&](int64_t from, int64_t n) { return state_->master_halves(i, from, n).first; }),
                              take([&](int64_t from, int64_t n) { return state_->master_halves(i, from, n).second; })});
      } else {
        tensors.emplace_back(units[i]->name + ".master",
                             take([&](int64_t from, int64_t n) { return state_->master_f32(i, from, n); }));
      }
      tensors.emplace_back(units[i]->name + ".exp_avg",
                           take([&](int64_t from, int64_t n) { return o.exp_avg.narrow(from, n); }));
      tensors.emplace_back(units[i]->name + ".exp_avg_sq",
                           take([&](int64_t from, int64_t n) { return o.exp_avg_sq.narrow(from, n); }));
    }
    // Never write Inf/NaN: the step guard stops such values earlier; this is the last line. Each
    // tensor is checked where it lives (a split master's joined elements are on the host); the
    // ranks' shards together hold every element. A split master still in halves is checked here
    // by its upper half (the values: Inf and the usual NaNs show there), and whole by the writer
    // once joined: a NaN whose payload is near all ones rounds to a finite upper half.
    std::vector<std::pair<const std::string*, Tensor>> checked;
    for (const auto& [n, t] : tensors)
      if (t.defined()) checked.emplace_back(&n, t);
    for (const SaveJob::Join& j : job->joins) checked.emplace_back(&tensors[j.index].first, j.hi);
    std::vector<Device> devices = {device_};
    if (!device_.is_cpu()) devices.push_back(Device::cpu());
    for (const Device& d : devices) {
      std::vector<Tensor> ts;
      std::vector<const std::string*> names;
      for (const auto& [n, t] : checked) {
        if (t.device() != d) continue;
        ts.push_back(t);
        names.push_back(n);
      }
      if (ts.empty() || !err.empty()) continue;
      Tensor flags = Tensor::zeros({static_cast<int64_t>(ts.size())}, DType::i32, d, MemCategory::workspace);
      mark_nonfinite(ts, flags);
      const std::vector<int32_t> f = flags.to_ints();
      for (size_t k = 0; k < f.size() && err.empty(); ++k)
        if (f[k]) err = "checkpoint: refusing to save step " + std::to_string(step_) + ": " + *names[k] +
                        " holds Inf/NaN values (the last good checkpoint stays the newest)";
    }
  } catch (const std::exception& e) {
    err = e.what();
  }
  agree(world, err, "checking the state for non-finite values");
  if (rank == 0) {
    try {
      make_dirs(root);
      remove_tree(tmp_dir);
      make_dirs(path_join(tmp_dir, "shards"));
      // A directory of the same name: this run's (e.g. a resume from an earlier step) is
      // replaced with a log line; another run's is never touched.
      if (path_exists(final_dir)) {
        std::string owner;
        try {
          owner = read_checkpoint_state(final_dir).value("run_id", std::string());
        } catch (const std::exception&) {
        }
        BB_CHECK(owner == run_id_, "checkpoint: ", final_dir, " exists and belongs to ",
                 owner.empty() ? std::string("no known run (unreadable or from an older build)") : "run " + owner,
                 "; this run (", run_id_, ") does not overwrite it. Move it away or use another checkpoint.dir");
        if (log_)
          std::fprintf(log_, "%s[checkpoint] replacing %s, written earlier by this run\n", log_prefix_.c_str(),
                       final_dir.c_str());
      }
    } catch (const std::exception& e) {
      remove_tree(tmp_dir);
      err = e.what();
    }
  }
  agree(world, err, "creating the checkpoint directory");
  if (to_host) {
    // The snapshot: training changes the state from the next step on, so every tensor is copied
    // to host memory of its own now (what the step waits for; views of a CPU run's state too)
    // and the shard file is written from the copies. A rank that cannot (out of host memory)
    // fails the save on every rank.
    try {
      if (!snapshot_) snapshot_ = std::make_unique<SnapshotBuffers>();
      size_t k = 0;
      auto snap = [&](Tensor& t) {
        bool fresh = false;
        Tensor copy = snapshot_->take(k, t, &fresh);
        if (fresh) job->snapshot_new_bytes += static_cast<int64_t>(copy.nbytes());
        snapshot_->fill(k++, t);
        job->snapshot_bytes += static_cast<int64_t>(copy.nbytes());
        t = copy;
      };
      for (auto& [n, t] : tensors)
        if (t.defined()) snap(t);
      for (SaveJob::Join& j : job->joins) {
        snap(j.hi);
        snap(j.lo);
      }
      snapshot_->trim(k);
    } catch (const std::exception& e) {
      err = e.what();
    }
    try {
      agree(world, err, "copying its shard to host memory");
    } catch (...) {
      if (rank == 0) remove_tree(tmp_dir);
      throw;
    }
  }
  if (rank == 0) {
    nlohmann::json st;
    st["format_version"] = kCheckpointFormat;
    st["step"] = step_;
    st["run_id"] = run_id_;
    st["seed"] = cfg_.seed;
    st["data_position"] = data_ ? data_->position() : DataPosition{};
    st["model_config"] = cfg_.model.to_hf_json();
    st["primitives"] = cfg_.primitives_summary();
    st["optimizer"] = cfg_.prim.optimizer.name;  // the moments' dtype in the shards
    st["backend"] = cfg_.backend;
    const ParallelLayout& l = mesh_->layout();
    st["layout"] = {{"dp", l.dp}, {"cp", l.cp}, {"ep", l.ep}, {"pp", l.pp}, {"world", world.size()},
                    {"state", cfg_.prim.state.name}, {"grad_accum", cfg_.grad_accum}};
    st["units"] = unit_table(model_->units(), cfg_.model.num_experts);
    nlohmann::json files = nlohmann::json::array();
    for (int r = 0; r < world.size(); ++r) files.push_back(shard_name(r));
    st["shards"] = files;
    job->state = st.dump(2);
  }
  return job;
}

// Phase 2 (this rank alone, any thread): the shard file.
void Trainer::write_shard(SaveJob& job) {
  try {
    for (const SaveJob::Join& j : job.joins) {
      Tensor full = Tensor::empty({j.hi.numel()}, DType::f32, Device::cpu(), MemCategory::other);
      join_master(j.hi, j.lo, full);
      BB_CHECK(first_nonfinite(full) < 0, "checkpoint: refusing to save ", job.name, ": ", job.tensors[j.index].first,
               " holds Inf/NaN values (the last good checkpoint stays the newest)");
      job.tensors[j.index].second = full;
    }
    job.joins.clear();
    // Every tensor's checksum goes into the shard's metadata; a load verifies it (a flipped bit
    // or a torn write would otherwise load silently when the values stay finite).
    write_safetensors_with_checksums(path_join(job.tmp_dir, shard_name(mesh_->world()->rank())), job.tensors, job.meta);
  } catch (const std::exception& e) {
    job.err = e.what();
  }
  job.tensors.clear();  // the job's references to the snapshot go as soon as it is written
  job.joins.clear();
  job.done.store(true);
}

// Phase 3 (collective): every rank's shard written, rank 0 renames the directory, moves
// `latest` and prunes.
std::string Trainer::commit_save(SaveJob& job) {
  comm::Group& world = *mesh_->world();
  const int rank = world.rank();
  const std::string& name = job.name;
  const std::string& root = job.root;
  const std::string& final_dir = job.final_dir;
  const std::string& tmp_dir = job.tmp_dir;
  std::string err = job.err;
  try {
    agree(world, err, "writing its shard");
  } catch (...) {
    if (rank == 0) remove_tree(tmp_dir);
    throw;
  }
  if (rank == 0) {
    try {
      atomic_write(path_join(tmp_dir, "state.json"), job.state);
      atomic_write(path_join(tmp_dir, "config.json"), cfg_.model.to_hf_json().dump(2));
      remove_tree(final_dir);  // this run's own directory of the same step (checked above)
      BB_CHECK(::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, "checkpoint: cannot rename ", tmp_dir, " to ",
               final_dir);
      // `latest` moves only now that every rank's shard is in place.
      atomic_write(path_join(root, "latest"), name + "\n");
      if (cfg_.ckpt_keep > 0) {
        // Only this run's complete checkpoints are pruned, oldest first; the one just written
        // (the newest, and finite: checked above) always stays.
        std::vector<std::string> mine;
        for (const CheckpointEntry& c : list_checkpoints(root))
          if (c.complete && c.run_id == run_id_) mine.push_back(c.name);
        for (size_t i = 0; i + static_cast<size_t>(cfg_.ckpt_keep) < mine.size(); ++i)
          if (mine[i] != name && !remove_tree(path_join(root, mine[i])) && log_)
            std::fprintf(log_, "%s[warn] checkpoint.keep = %lld: could not remove the old checkpoint %s (permissions?); "
                         "it stays and takes space until removed by hand\n", log_prefix_.c_str(),
                         static_cast<long long>(cfg_.ckpt_keep), path_join(root, mine[i]).c_str());
      }
    } catch (const std::exception& e) {
      remove_tree(tmp_dir);
      err = e.what();
    }
  }
  agree(world, err, "committing the checkpoint");
  if (log_) {
    std::fprintf(log_, "%s[checkpoint] saved %s in %.2fs%s\n", log_prefix_.c_str(), final_dir.c_str(), now_s() - job.t0,
                 job.background ? " (written beside training)" : "");
    std::fflush(log_);
  }
  return final_dir;
}

std::string Trainer::save_checkpoint(const std::string& root) {
  check_onloaded("save");
  BB_CHECK(!pending_, "save: a forward_backward is waiting for its optim_step; call optim_step first");
  finish_save();  // one save at a time, in order
  std::unique_ptr<SaveJob> job = begin_save(root, false);
  write_shard(*job);
  return commit_save(*job);
}

void Trainer::start_save(const std::string& root) {
  finish_save();  // a save still being written delays the next one, never overlaps it
  const double t0 = now_s();
  save_job_ = begin_save(root, true);
  save_job_->background = true;
  if (log_) {
    const std::string fresh = save_job_->snapshot_new_bytes == 0
                                  ? std::string()
                                  : ", " + format_bytes(save_job_->snapshot_new_bytes) +
                                        " of host buffers allocated (kept for the next saves)";
    std::fprintf(log_, "%s[checkpoint] step %lld snapshot taken in %.2fs (%s%s); its shard is written beside training\n",
                 log_prefix_.c_str(), static_cast<long long>(step_), now_s() - t0,
                 format_bytes(save_job_->snapshot_bytes).c_str(), fresh.c_str());
    std::fflush(log_);
  }
  SaveJob* job = save_job_.get();
  try {
    save_job_->writer = std::thread([this, job] { write_shard(*job); });
  } catch (const std::exception& e) {
    write_shard(*job);  // no thread to be had: written now, committed at the next step end
  }
}

void Trainer::poll_save() {
  if (!save_job_) return;
  // Every rank commits at the same step: once every rank's writer is done.
  int64_t done = save_job_->done.load() ? 1 : 0;
  mesh_->world()->all_reduce_host(&done, 1, comm::ReduceOp::min);
  if (done) finish_save();
}

void Trainer::finish_save() {
  if (!save_job_) return;
  std::unique_ptr<SaveJob> job = std::move(save_job_);
  if (job->writer.joinable()) job->writer.join();
  commit_save(*job);
}

void Trainer::load_checkpoint(const std::string& path) {
  check_onloaded("load");
  BB_CHECK(!pending_, "load: a forward_backward is waiting for its optim_step; call optim_step first");
  const std::string dir = resolve_checkpoint(path);
  BB_CHECK(!dir.empty(), "no checkpoint at '", path, "' (expected a step_* directory or a checkpoint root with a 'latest' file)");
  const nlohmann::json st = read_checkpoint_state(dir);
  const ModelConfig saved_cfg = parse_hf_config(st["model_config"], dir + "/state.json");
  if (!(saved_cfg == cfg_.model)) {
    const nlohmann::json a = saved_cfg.to_hf_json(), b = cfg_.model.to_hf_json();
    std::string diff;
    for (auto it = a.begin(); it != a.end(); ++it)
      if (!b.contains(it.key()) || b[it.key()] != it.value())
        diff += " " + it.key() + " (checkpoint " + it.value().dump() + ", run " + (b.contains(it.key()) ? b[it.key()].dump() : "absent") + ")";
    BB_FAIL("checkpoint ", dir, " was written for a different model:", diff);
  }
  std::vector<ParamUnit*> units = model_->units();
  check_unit_table(st["units"], units, cfg_.model.num_experts, dir);
  check_checkpoint_optimizer(st, cfg_.prim.optimizer.name, dir);
  const int64_t step = st["step"].get<int64_t>();
  const DataPosition pos = st["data_position"].get<DataPosition>();
  const std::string run_id = st.value("run_id", std::string());

  // Stage what this rank holds under its own layout; commit only when all of it was read.
  ShardSet shards(dir, st);
  const char* which[3] = {"master", "exp_avg", "exp_avg_sq"};
  std::vector<std::array<Tensor, 3>> staged(units.size());
  for (size_t i = 0; i < units.size(); ++i) {
    const ModelState::Owned o = state_->owned(i);
    if (o.len == 0) continue;
    // The parameters' elements in global coordinates (an EP rank's experts are runs of the
    // global unit); alignment padding stays zero.
    const std::vector<GlobalUnit::Run> runs = global_runs(global_unit(*units[i], cfg_.model.num_experts), o.lo, o.len);
    for (int k = 0; k < 3; ++k)
      staged[i][static_cast<size_t>(k)] = shards.read_runs(units[i]->name, which[k], runs, o.lo, o.len,
                                                           k == 0 ? DType::f32 : state_->moment_dtype());
  }
  for (size_t i = 0; i < units.size(); ++i) {
    ModelState::Owned o = state_->owned(i);
    if (o.len == 0) continue;
    state_->set_master(i, staged[i][0]);
    o.exp_avg.copy_from(staged[i][1]);
    o.exp_avg_sq.copy_from(staged[i][2]);
  }
  state_->values_from_masters();
  if (data_) data_->restore(pos);
  step_ = step;
  if (!run_id.empty()) run_id_ = run_id;  // the resumed run continues the saved one
  // A different global batch resumes correctly (the data position counts micro-batches of one
  // global stream) but does not continue the same run: say so.
  const nlohmann::json& l = st["layout"];
  if (log_ && l.contains("dp") && l.contains("grad_accum")) {
    const int64_t saved = l["dp"].get<int64_t>() * l["grad_accum"].get<int64_t>();
    const int64_t now = mesh_->layout().dp * cfg_.grad_accum;
    if (saved != now)
      std::fprintf(log_, "%s[startup] note: the checkpoint was written with %lld micro-batches per step (dp x "
                   "grad_accum), this run takes %lld; losses will not continue the saved run's\n",
                   log_prefix_.c_str(), static_cast<long long>(saved), static_cast<long long>(now));
  }
}

}  // namespace bb

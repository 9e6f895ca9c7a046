// logprobs.cpp — the forward-only pass (logprobs.h): weights without gradients or optimizer
// state, whole documents per forward, results gathered on every rank.
//
// NOTES: the weights come in as f32 (an HF directory's ranges, or a checkpoint's masters) for
// every element each rank holds (whole units; an EP rank's experts), rounded to the parameter
// dtype, bound without a gradient. A document's results are written by the one rank that
// computed each of its positions (its data rank's micro-batch, its cp shard), every other rank
// writing zeros there; a sum over the world then gives every rank the whole result (one
// all-reduce per quantity, in f64 for the log-probs: exact for numbers written once).
#include "runtime/logprobs.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/context_shard.h"
#include "core/error.h"
#include "io/fs.h"
#include "models/hf_io.h"
#include "plan/estimate.h"
#include "runtime/checkpoint.h"
#include "runtime/context_shard.h"
#include "runtime/trainer.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {

// The f32 values of every unit, whole (an EP rank's experts), from `weights`.
std::vector<Tensor> read_weights(const RunConfig& cfg, DecoderModel& model, const std::string& weights, Device dev,
                                 FILE* log) {
  std::vector<ParamUnit*> units = model.units();
  std::vector<Tensor> out;
  if (weights == "init") {
    // The model's own seeded initialisation (benchmarks, smoke tests): each unit whole.
    for (ParamUnit* u : units) {
      Tensor t = Tensor::empty({u->numel}, DType::f32, dev, MemCategory::other);
      model.init_unit_range(*u, 0, u->numel, t);
      out.push_back(std::move(t));
    }
    if (log) std::fprintf(log, "[logprobs] weights: the model's initialisation (seed %llu)\n",
                          static_cast<unsigned long long>(cfg.seed));
    return out;
  }
  if (weights.rfind("hf:", 0) == 0) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (ParamUnit* u : units) ranges.push_back({0, u->numel});
    const HfLoadReport rep = load_hf_weight_ranges(model, weights.substr(3), ranges, dev, &out);
    if (log) std::fprintf(log, "[logprobs] loaded %s: %s\n", weights.substr(3).c_str(), rep.summary().c_str());
    return out;
  }
  const std::string dir = resolve_checkpoint(weights);
  BB_CHECK(!dir.empty(), "logprobs: no checkpoint at '", weights,
           "' (expected hf:DIR, a step_* directory, a checkpoint root with a 'latest' file, or init)");
  const nlohmann::json st = read_checkpoint_state(dir);
  const ModelConfig saved = parse_hf_config(st["model_config"], dir + "/state.json");
  BB_CHECK(saved == cfg.model, "logprobs: checkpoint ", dir, " was written for another model than ", cfg.model_config);
  check_unit_table(st["units"], units, cfg.model.num_experts, dir);
  ShardSet shards(dir, st);
  for (ParamUnit* u : units) {
    const std::vector<GlobalUnit::Run> runs = global_runs(global_unit(*u, cfg.model.num_experts), 0, u->numel);
    out.push_back(shards.read_runs(u->name, "master", runs, 0, u->numel, DType::f32));
  }
  if (log) std::fprintf(log, "[logprobs] loaded checkpoint %s (step %lld)\n", dir.c_str(),
                        static_cast<long long>(st["step"].get<int64_t>()));
  return out;
}

}  // namespace

LogprobsRunner::LogprobsRunner(const RunConfig& cfg_in, const std::string& weights, FILE* log, comm::GroupPtr base)
    : cfg_(cfg_in) {
  if (!base) base = default_world(cfg_in);
  if (cfg_in.auto_layout()) cfg_ = plan::choose_auto_layout(cfg_in, base->size(), 0, nullptr);
  const ParallelLayout layout = resolve_layout(cfg_, base->size());
  if (base->rank() != 0) log = nullptr;
  device_ = cfg_.resolved_device();
#ifdef BB_WITH_CUDA
  if (device_.is_cuda()) cuda::set_device(device_.index);
#endif
  mesh_ = std::make_unique<Mesh>(base, layout);
  ModelOptions mo = model_options(cfg_);
  mo.prims.router_replay = false;  // this pass records the routing (R2); it replays none
  mo.ep_group = mesh_->ep();
  mo.cp_group = mesh_->cp();
  model_ = std::make_unique<DecoderModel>(cfg_.model, mo, cfg_.seed);
  schedule_ = std::make_unique<Schedule>(*model_, ScheduleOptions{RecomputePolicy::none, false, {}, 0});
  // Values only: each unit whole, from the f32 weights, without a gradient.
  std::vector<Tensor> f32 = read_weights(cfg_, *model_, weights, device_, log);
  ParamStore& store = model_->param_store();
  std::vector<ParamUnit*> units = model_->units();
  for (size_t i = 0; i < units.size(); ++i) {
    ParamUnit& u = *units[i];
    Tensor value = Tensor::empty({u.numel}, store.value_dtype(u), device_, MemCategory::params);
    const Tensor& m = f32[i];
    const Tensor v = m.dtype() == value.dtype() ? m : m.to_dtype(value.dtype(), MemCategory::other);
    value.copy_from(v.device() == device_ ? v : v.to(device_));
    f32[i] = Tensor();
    store.rebind(u, value, Tensor());
  }
  if (log) {
    std::fprintf(log, "[logprobs] %s: layout %s, %s, weights only (no gradients, no optimizer state)\n",
                 cfg_.model_config.c_str(), layout.str().c_str(), device_.str().c_str());
    std::fflush(log);
  }
}

LogprobsRunner::~LogprobsRunner() = default;

std::vector<DocLogprobs> LogprobsRunner::run(const Corpus& docs, double temperature, bool routing) {
  allocator_for(device_).reset_peak();  // the pass's peak, not the weights' f32 staging
  return score_documents(cfg_, *mesh_, *model_, *schedule_, device_, docs, temperature, routing, &forwards_);
}

std::vector<DocLogprobs> score_documents(const RunConfig& cfg, const Mesh& mesh, DecoderModel& model,
                                         Schedule& schedule, const Device& device, const Corpus& docs,
                                         double temperature, bool routing, int64_t* forwards) {
  int64_t local_forwards = 0;
  int64_t& count = forwards ? *forwards : local_forwards;
  BB_CHECK(temperature > 0 && std::isfinite(temperature), "logprobs: the temperature must be > 0, got ", temperature);
  const int64_t D = docs.num_documents();
  BB_CHECK(D > 0, "logprobs: no document");
  const int64_t L = model.num_moe_layers(), K = cfg.model.top_k;
  BB_CHECK(!routing || L > 0, "logprobs: the routing was asked for, but the model has no MoE layer");
  const int64_t dp = mesh.layout().dp, cp = mesh.layout().cp;
  BB_CHECK(D >= dp, "logprobs: ", D, " document(s) for ", dp, " data ranks; give at least one per data rank");
  for (int64_t d = 0; d < D; ++d)
    BB_CHECK(docs.length(d) <= cfg.micro_batch_tokens, "logprobs: document ", d,
             docs.ids.empty() ? std::string() : " (id " + docs.ids[static_cast<size_t>(d)] + ")", " has ", docs.length(d),
             " tokens, more than a micro-batch holds (train.micro_batch_tokens = ", cfg.micro_batch_tokens,
             "); raise train.micro_batch_tokens (--set train.micro_batch_tokens=N)");
  // Every token scored: targets from the tokens alone (no loss mask, no RL fields).
  Corpus plain;
  for (int64_t d = 0; d < D; ++d) plain.add(std::vector<int32_t>(docs.tokens.begin() + docs.offsets[d],
                                                                   docs.tokens.begin() + docs.offsets[d + 1]));
  const DataLoader loader = whole_loader(cfg, std::move(plain));
  const int64_t budget = cfg.micro_batch_tokens;
  // As few forwards as the budget allows, a multiple of dp (every data rank runs as many: the
  // expert-parallel collectives need every rank in each forward).
  const int64_t total = docs.num_tokens();
  int64_t per_rank = std::max<int64_t>(1, (total + dp * budget - 1) / (dp * budget));
  std::vector<MicroBatch> mbs;
  std::vector<std::vector<int64_t>> docs_of;
  for (;; ++per_rank) {
    BB_CHECK(per_rank * dp <= D, "logprobs: the documents do not fit ", D, " forwards of ", budget,
             " tokens; raise train.micro_batch_tokens");
    try {
      mbs = loader.pack_all(per_rank * dp, &docs_of);
      break;
    } catch (const Error& e) {
      if (std::string(e.what()).find("do not fit") == std::string::npos) throw;
    }
  }
  // Results on every rank, written where this rank computed them.
  std::vector<double> lp(static_cast<size_t>(total), 0.0), ent(static_cast<size_t>(total), 0.0);
  std::vector<int64_t> rt(routing ? static_cast<size_t>(total * L * K) : 0, 0);
  LossHeadConfig head = cfg.prim.loss_chunks;
  head.policy.temperature = temperature;
  count = 0;
  for (size_t i = static_cast<size_t>(mesh.dp_rank()); i < mbs.size(); i += static_cast<size_t>(dp)) {
    const MicroBatch& whole = mbs[i];
    const MicroBatch mb = shard_micro_batch(whole, cp, mesh.cp_rank());
    std::vector<int64_t> rows;  // this shard's positions in the whole micro-batch
    if (cp > 1) {
      rows = cp_layout::global_rows(mb.shard.seqlens, cp, mesh.cp_rank());
    } else {
      rows.resize(static_cast<size_t>(whole.tokens.numel()));
      for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<int64_t>(r);
    }
    // Position p of the whole micro-batch -> its document and offset there.
    std::vector<int64_t> doc_at, off_at;
    for (int64_t d : docs_of[i])
      for (int64_t j = 0; j < docs.length(d); ++j) doc_at.push_back(d), off_at.push_back(j);
    Tensor logp, entropy;
    schedule.forward_token_stats(to_device(mb, device), head, logp, entropy);
    ++count;
    const std::vector<float> l = logp.to_floats(), e = entropy.to_floats();
    const std::vector<int32_t> tg = mb.targets.to_ints();
    for (size_t r = 0; r < rows.size(); ++r) {
      if (tg[r] < 0) continue;  // a document's last token predicts nothing
      const int64_t p = rows[r], d = doc_at[static_cast<size_t>(p)], j = off_at[static_cast<size_t>(p)] + 1;
      const size_t at = static_cast<size_t>(docs.offsets[d] + j);
      lp[at] = l[r];
      ent[at] = e[r];
    }
    if (routing) {
      const std::vector<Tensor>& layers = schedule.last_routing();
      for (int64_t layer = 0; layer < L; ++layer) {
        const std::vector<int32_t> ids = layers[static_cast<size_t>(layer)].to_ints();
        for (size_t r = 0; r < rows.size(); ++r) {
          const int64_t p = rows[r], d = doc_at[static_cast<size_t>(p)], j = off_at[static_cast<size_t>(p)];
          const size_t at = static_cast<size_t>(((docs.offsets[d] + j) * L + layer) * K);
          for (int64_t k = 0; k < K; ++k) rt[at + static_cast<size_t>(k)] = ids[r * static_cast<size_t>(K) + static_cast<size_t>(k)];
        }
      }
    }
  }
  comm::Group& world = *mesh.world();
  world.all_reduce_host(lp.data(), total, comm::ReduceOp::sum);
  world.all_reduce_host(ent.data(), total, comm::ReduceOp::sum);
  if (routing) world.all_reduce_host(rt.data(), static_cast<int64_t>(rt.size()), comm::ReduceOp::sum);
  std::vector<DocLogprobs> out(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) {
    DocLogprobs& o = out[static_cast<size_t>(d)];
    const int64_t b = docs.offsets[d], n = docs.length(d);
    o.logprobs.assign(lp.begin() + b, lp.begin() + b + n);
    o.entropy.assign(ent.begin() + b, ent.begin() + b + n);
    if (routing) o.routing.assign(rt.begin() + b * L * K, rt.begin() + (b + n) * L * K);
  }
  return out;
}

void write_logprobs_jsonl(const std::string& path, const Corpus& docs, const std::vector<DocLogprobs>& out,
                          int64_t layers, int64_t topk) {
  atomic_write(path, [&](FileWriter& f) {
    char buf[32];
    auto num = [&](float v) {
      std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
      return std::string(buf);
    };
    for (int64_t d = 0; d < docs.num_documents(); ++d) {
      const DocLogprobs& o = out[static_cast<size_t>(d)];
      std::string line = "{\"id\": ";
      line += docs.ids.empty() ? std::to_string(d) : nlohmann::json(docs.ids[static_cast<size_t>(d)]).dump();
      line += ", \"logprobs\": [";
      for (size_t j = 0; j < o.logprobs.size(); ++j) line += (j ? ", " : "") + num(o.logprobs[j]);
      line += "], \"entropy\": [";
      for (size_t j = 0; j < o.entropy.size(); ++j) line += (j ? ", " : "") + num(o.entropy[j]);
      line += "]";
      if (!o.routing.empty()) {
        line += ", \"routing\": [";
        const size_t n = o.logprobs.size();
        for (size_t j = 0; j < n; ++j) {
          line += j ? ", [" : "[";
          for (int64_t l = 0; l < layers; ++l) {
            line += l ? ", [" : "[";
            for (int64_t k = 0; k < topk; ++k)
              line += (k ? ", " : "") + std::to_string(o.routing[(j * static_cast<size_t>(layers) + static_cast<size_t>(l)) * static_cast<size_t>(topk) + static_cast<size_t>(k)]);
            line += "]";
          }
          line += "]";
        }
        line += "]";
      }
      line += "}\n";
      f.write(line);
    }
  });
}

}  // namespace bb

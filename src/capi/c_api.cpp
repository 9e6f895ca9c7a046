// c_api.cpp — the C interface (bumblebee_c.h) over runtime::Trainer: documents in, metrics,
// logits, log-probs, checkpoints and weights out; every C++ exception becomes -1 / NULL and a
// message in bb_last_error().
#include "capi/bumblebee_c.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "models/hf_io.h"
#include "runtime/data.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

struct bb_trainer {
  std::unique_ptr<bb::Trainer> t;
  std::vector<bb::HfTensor> weights;  // filled on first use
};

namespace {

thread_local std::string g_error;

template <class F>
int guard(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown error";
  }
  return -1;
}

constexpr const char* kMetricNames =
    "step,loss,grad_norm,lr,tokens,valid_tokens,step_time_s,tokens_per_s,aux_loss,z_loss,skipped,clip_frac,"
    "dual_clip_frac,approx_kl,entropy,ratio_mean,ratio_max,ref_kl,sequences";
constexpr int64_t kNumMetrics = 19;

void write_metrics(const bb::StepMetrics& m, double* out) {
  const double v[kNumMetrics] = {static_cast<double>(m.step), m.loss, m.grad_norm, m.lr, static_cast<double>(m.tokens),
                                 static_cast<double>(m.valid_tokens), m.step_time_s, m.tokens_per_s, m.aux_loss,
                                 m.z_loss, m.skipped.empty() ? 0.0 : 1.0, m.policy.clip_frac, m.policy.dual_clip_frac,
                                 m.policy.approx_kl, m.policy.entropy, m.policy.ratio_mean, m.policy.ratio_max,
                                 m.policy.ref_kl, m.policy.sequences};
  if (out) std::memcpy(out, v, sizeof v);
}

std::vector<float> floats(const float* p, int64_t n) { return p ? std::vector<float>(p, p + n) : std::vector<float>{}; }

// The C documents as a checked corpus (the same checks as a JSONL file's records).
bb::Corpus corpus_of(const bb_document* docs, int64_t n, int64_t vocab) {
  BB_CHECK(docs && n > 0, "the batch has no document");
  std::vector<bb::Document> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const bb_document& d = docs[i];
    BB_CHECK(d.tokens && d.length > 0, "document ", i, " has no tokens");
    bb::Document& o = out[static_cast<size_t>(i)];
    o.tokens.assign(d.tokens, d.tokens + d.length);
    if (d.loss_mask) o.loss_mask.assign(d.loss_mask, d.loss_mask + d.length);
    o.advantages = floats(d.advantages, d.length);
    o.old_logprobs = floats(d.old_logprobs, d.length);
    o.ref_logprobs = floats(d.ref_logprobs, d.length);
    if (d.routing) {
      BB_CHECK(d.routing_layers > 0 && d.routing_topk > 0, "document ", i, ": routing needs routing_layers and routing_topk > 0");
      o.routing.assign(d.routing, d.routing + d.length * d.routing_layers * d.routing_topk);
      o.routing_layers = d.routing_layers;
      o.routing_topk = d.routing_topk;
    }
  }
  return bb::corpus_from_documents(out, vocab, "the batch");
}

// The documents as one evaluation micro-batch, token ids checked; with `targets`, each position's
// next token of its document (-1 at a document's end), else none.
bb::MicroBatch forward_batch(const bb_document* docs, int64_t n, int64_t vocab, bool targets = false) {
  BB_CHECK(docs && n > 0, "no document given");
  std::vector<int32_t> tok, tgt, pos, cu{0};
  for (int64_t i = 0; i < n; ++i) {
    const bb_document& d = docs[i];
    BB_CHECK(d.tokens && d.length > 0, "document ", i, " has no tokens");
    for (int64_t j = 0; j < d.length; ++j) {
      BB_CHECK(d.tokens[j] >= 0 && d.tokens[j] < vocab, "document ", i, ": token ", d.tokens[j], " at index ", j,
               " is outside [0, ", vocab, ")");
      tok.push_back(d.tokens[j]);
      tgt.push_back(targets && j + 1 < d.length ? d.tokens[j + 1] : -1);
      pos.push_back(static_cast<int32_t>(j));
    }
    cu.push_back(static_cast<int32_t>(tok.size()));
  }
  bb::MicroBatch mb;
  const auto T = static_cast<int64_t>(tok.size());
  mb.tokens = bb::Tensor::from_ints(tok, {T});
  mb.targets = bb::Tensor::from_ints(tgt, {T});
  mb.positions = bb::Tensor::from_ints(pos, {T});
  mb.cu_seqlens = bb::Tensor::from_ints(cu, {n + 1});
  return mb;
}

std::vector<bb::HfTensor>& weights_of(bb_trainer* t) {
  BB_CHECK(t->t->mesh().world()->size() == 1, "the weights are read on one rank (this run has ",
           t->t->mesh().world()->size(), "); export a checkpoint with `bumblebee export` instead");
  if (t->weights.empty()) t->weights = t->t->model().hf_tensors();
  return t->weights;
}

}  // namespace

extern "C" {

int bb_api_version(void) { return BB_C_API_VERSION; }
const char* bb_last_error(void) { return g_error.c_str(); }
const char* bb_metric_names(void) { return kMetricNames; }
int64_t bb_num_metrics(void) { return kNumMetrics; }

bb_trainer* bb_trainer_new(const char* config, const char* const* overrides, int64_t num_overrides) {
  bb_trainer* out = nullptr;
  // Under a launcher (mpirun, srun) this process is one rank of the job, as `bumblebee train`
  // is: MPI starts with the first trainer and ends when the process exits (after the language
  // runtime has freed its trainers).
  static const bool joined = [] {
    bb::comm::init(nullptr, nullptr);
    if (bb::comm::world().mpi) std::atexit([] { bb::comm::finalize(); });
    return true;
  }();
  (void)joined;
  guard([&] {
    BB_CHECK(config, "bb_trainer_new: no config");
    BB_CHECK(num_overrides >= 0 && (num_overrides == 0 || overrides), "bb_trainer_new: ", num_overrides,
             " overrides but no array");
    std::vector<std::string> ov;
    for (int64_t i = 0; i < num_overrides; ++i) {
      BB_CHECK(overrides[i], "bb_trainer_new: override ", i, " is NULL");
      ov.emplace_back(overrides[i]);
    }
    const std::string c(config);
    const bb::RunConfig cfg =
        c.find('\n') != std::string::npos ? bb::parse_run_config(c, "the config text", ov) : bb::load_run_config(c, ov);
    auto t = std::make_unique<bb_trainer>();
    t->t = std::make_unique<bb::Trainer>(cfg, stdout);
    out = t.release();
  });
  return out;
}

void bb_trainer_free(bb_trainer* t) { delete t; }

int64_t bb_step(const bb_trainer* t) { return t ? t->t->step() : -1; }
int64_t bb_vocab_size(const bb_trainer* t) { return t ? t->t->config().model.vocab_size : -1; }
int bb_rank(const bb_trainer* t) { return t ? t->t->mesh().world()->rank() : -1; }
int bb_world_size(const bb_trainer* t) { return t ? static_cast<int>(t->t->mesh().world()->size()) : -1; }

int bb_train_batch(bb_trainer* t, const bb_document* docs, int64_t num_docs, double* metrics) {
  return guard([&] {
    BB_CHECK(t, "bb_train_batch: no trainer");
    write_metrics(t->t->train_on(corpus_of(docs, num_docs, t->t->config().model.vocab_size)), metrics);
  });
}

int bb_forward_backward(bb_trainer* t, const bb_document* docs, int64_t num_docs, double* metrics) {
  return guard([&] {
    BB_CHECK(t, "bb_forward_backward: no trainer");
    write_metrics(t->t->forward_backward_on(corpus_of(docs, num_docs, t->t->config().model.vocab_size)), metrics);
  });
}

int bb_optim_step(bb_trainer* t, double* metrics) {
  return guard([&] {
    BB_CHECK(t, "bb_optim_step: no trainer");
    write_metrics(t->t->optim_step(), metrics);
  });
}

int bb_train_step(bb_trainer* t, double* metrics) {
  return guard([&] {
    BB_CHECK(t, "bb_train_step: no trainer");
    write_metrics(t->t->train_step(), metrics);
  });
}

int bb_last_logits(bb_trainer* t, const bb_document* docs, int64_t num_docs, float* out) {
  return guard([&] {
    BB_CHECK(t && out, "bb_last_logits: no trainer or output");
    const int64_t V = t->t->config().model.vocab_size;
    const bb::MicroBatch mb = forward_batch(docs, num_docs, V);
    const bb::Tensor logits = t->t->forward_logits(mb);
    const std::vector<int32_t> cu = mb.cu_seqlens.to_ints();
    const float* l = logits.data<float>();
    for (int64_t i = 0; i < num_docs; ++i) std::memcpy(out + i * V, l + (cu[i + 1] - 1) * V, sizeof(float) * V);
  });
}

int bb_token_logprobs(bb_trainer* t, const bb_document* docs, int64_t num_docs, float temperature, float* logprobs,
                      float* entropy) {
  return guard([&] {
    BB_CHECK(t && logprobs && entropy, "bb_token_logprobs: no trainer or output");
    BB_CHECK(temperature > 0 && std::isfinite(temperature), "bb_token_logprobs: temperature must be > 0, got ", temperature);
    // Token ids only: the scoring needs no rollout field (and ignores any given).
    std::vector<bb_document> plain(static_cast<size_t>(std::max<int64_t>(num_docs, 0)));
    for (int64_t i = 0; i < num_docs; ++i) {
      plain[static_cast<size_t>(i)].tokens = docs[i].tokens;
      plain[static_cast<size_t>(i)].length = docs[i].length;
    }
    const bb::Corpus c = corpus_of(num_docs > 0 ? plain.data() : nullptr, num_docs, t->t->config().model.vocab_size);
    const std::vector<bb::DocLogprobs> out = t->t->score(c, temperature);
    int64_t at = 0;
    for (const bb::DocLogprobs& d : out) {
      std::memcpy(logprobs + at, d.logprobs.data(), d.logprobs.size() * sizeof(float));
      std::memcpy(entropy + at, d.entropy.data(), d.entropy.size() * sizeof(float));
      at += static_cast<int64_t>(d.logprobs.size());
    }
  });
}

int bb_save(bb_trainer* t, const char* dir, char* path, int64_t cap) {
  return guard([&] {
    BB_CHECK(t && dir, "bb_save: no trainer or directory");
    const std::string p = t->t->save_checkpoint(dir);
    if (path && cap > 0) {
      BB_CHECK(static_cast<int64_t>(p.size()) < cap, "bb_save: the path needs ", p.size() + 1, " bytes, got ", cap);
      std::memcpy(path, p.c_str(), p.size() + 1);
    }
  });
}

int bb_load(bb_trainer* t, const char* path) {
  return guard([&] {
    BB_CHECK(t && path, "bb_load: no trainer or path");
    t->t->load_checkpoint(path);
  });
}

namespace {
void write_report(const bb::OffloadReport& r, double* out) {
  if (!out) return;
  out[0] = r.seconds;
  out[1] = static_cast<double>(r.host_bytes);
  out[2] = static_cast<double>(r.allocator_live);
  out[3] = static_cast<double>(r.device_used);
}
}  // namespace

int bb_offload(bb_trainer* t, double* report) {
  return guard([&] {
    BB_CHECK(t, "bb_offload: no trainer");
    t->weights.clear();  // views of the model's buffers, which go
    write_report(t->t->offload(), report);
  });
}

int bb_onload(bb_trainer* t, double* report) {
  return guard([&] {
    BB_CHECK(t, "bb_onload: no trainer");
    write_report(t->t->onload(), report);
  });
}

int bb_export_hf(bb_trainer* t, const char* dir) {
  return guard([&] {
    BB_CHECK(t && dir, "bb_export_hf: no trainer or directory");
    BB_CHECK(t->t->mesh().world()->size() == 1, "bb_export_hf runs on one rank; save a checkpoint and run "
             "`bumblebee export` for a multi-rank run");
    bb::export_hf(t->t->model(), dir);
  });
}

int64_t bb_num_weights(bb_trainer* t) {
  int64_t n = -1;
  guard([&] {
    BB_CHECK(t, "bb_num_weights: no trainer");
    n = static_cast<int64_t>(weights_of(t).size());
  });
  return n;
}

int bb_weight_info(bb_trainer* t, int64_t i, char* name, int64_t name_cap, int64_t* shape, int64_t* ndim) {
  return guard([&] {
    BB_CHECK(t && name && shape && ndim && name_cap > 0, "bb_weight_info: no trainer or output");
    const auto& w = weights_of(t);
    BB_CHECK(i >= 0 && i < static_cast<int64_t>(w.size()), "bb_weight_info: index ", i, " outside [0, ", w.size(), ")");
    const bb::HfTensor& h = w[static_cast<size_t>(i)];
    BB_CHECK(static_cast<int64_t>(h.name.size()) < name_cap, "bb_weight_info: the name needs ", h.name.size() + 1, " bytes");
    BB_CHECK(h.shape.size() <= 8, "bb_weight_info: more than 8 dimensions");
    std::memcpy(name, h.name.c_str(), h.name.size() + 1);
    *ndim = static_cast<int64_t>(h.shape.size());
    for (size_t k = 0; k < h.shape.size(); ++k) shape[k] = h.shape[k];
  });
}

int bb_weight_copy(bb_trainer* t, int64_t i, float* out) {
  return guard([&] {
    BB_CHECK(t && out, "bb_weight_copy: no trainer or output");
    const auto& w = weights_of(t);
    BB_CHECK(i >= 0 && i < static_cast<int64_t>(w.size()), "bb_weight_copy: index ", i, " outside [0, ", w.size(), ")");
    const std::vector<float> v = w[static_cast<size_t>(i)].value().to_floats();
    std::memcpy(out, v.data(), v.size() * sizeof(float));
  });
}

int bb_weight_copy_bf16(bb_trainer* t, int64_t i, uint16_t* out) {
  return guard([&] {
    BB_CHECK(t && out, "bb_weight_copy_bf16: no trainer or output");
    const auto& w = weights_of(t);
    BB_CHECK(i >= 0 && i < static_cast<int64_t>(w.size()), "bb_weight_copy_bf16: index ", i, " outside [0, ", w.size(),
             ")");
    const bb::Tensor v = w[static_cast<size_t>(i)].value();
    const bb::Tensor b = v.dtype() == bb::DType::bf16 ? v : v.to_dtype(bb::DType::bf16, bb::MemCategory::other);
    const bb::Tensor h = b.device().is_cpu() ? b : b.to(bb::Device::cpu(), bb::MemCategory::other);
    std::memcpy(out, h.raw(), static_cast<size_t>(h.numel()) * sizeof(uint16_t));
  });
}

}  // extern "C"

// logprobs.h — the forward-only pass of RL: per-token log-probs and entropies of documents under
// a model's weights (the old / ref log-probs of rollout records), and the routing each token
// took (R2 router replay records it here and replays it in the update). What `bumblebee
// logprobs` runs (skills/rl-logprobs.md).
//
// Memory: the weights (values only: no gradient buffers, no master weights, no optimizer
// moments; every unit whole on the ranks that hold it, experts split by EP) and one micro-batch's
// activations; the head streams [policy_chunk_rows(T), V] blocks (no [T, V] logits). Loading
// stages the rank's weights in f32 once (4 bytes a parameter, freed before the first forward).
// Layouts: dp, cp and ep of the run config (parallel = "auto" too); every rank returns every
// document's results.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/mesh.h"
#include "models/decoder.h"
#include "runtime/data.h"
#include "runtime/run_config.h"
#include "runtime/schedule.h"

namespace bb {

struct DocLogprobs {
  // Entry j: log p(token_j | tokens < j) and the entropy of that distribution, at the
  // temperature; entry 0 is 0 (as a rollout record's old_logprobs).
  std::vector<float> logprobs, entropy;
  // With routing: [length][layers][topk] expert ids, entry j the experts that processed token j.
  std::vector<int32_t> routing;
};

class LogprobsRunner {
 public:
  // `weights`: "hf:DIR" (a Hugging Face model directory), a checkpoint (a step directory or a
  // checkpoint root), or "init" (the model's seeded initialisation: benchmarks, smoke tests). cfg gives the model (which must match the weights), primitives, layout,
  // micro_batch_tokens (the budget of one forward) and [backend]. `log`: rank 0's startup lines
  // (null: none). Collective over `base` (default: the run's world).
  LogprobsRunner(const RunConfig& cfg, const std::string& weights, FILE* log, comm::GroupPtr base = nullptr);
  ~LogprobsRunner();

  // Every document (whole, packed into forwards of at most micro_batch_tokens tokens, balanced
  // over the data ranks) at `temperature`; with `routing`, the routing too (MoE models).
  // Collective; every rank returns all documents' results, in the corpus's order.
  std::vector<DocLogprobs> run(const Corpus& docs, double temperature, bool routing);

  const Mesh& mesh() const { return *mesh_; }
  DecoderModel& model() { return *model_; }
  int64_t forwards() const { return forwards_; }  // forwards this rank ran in the last run()

 private:
  RunConfig cfg_;
  Device device_;
  std::unique_ptr<Mesh> mesh_;
  std::unique_ptr<DecoderModel> model_;
  std::unique_ptr<Schedule> schedule_;
  int64_t forwards_ = 0;
};

// What LogprobsRunner::run computes, with a model already built on `mesh` and its values in
// place: the runner's, or a trainer's under any state family (its layer hooks gather what each
// forward needs: Trainer::score). cfg gives micro_batch_tokens (the budget of one forward) and
// the loss head's chunking. Collective over mesh.world(); every rank returns every document's
// results. `forwards`: the forwards this rank ran.
std::vector<DocLogprobs> score_documents(const RunConfig& cfg, const Mesh& mesh, DecoderModel& model,
                                         Schedule& schedule, const Device& device, const Corpus& docs,
                                         double temperature, bool routing, int64_t* forwards = nullptr);

// Writes the results as JSON lines (one per document: "id" (the record's, else its index),
// "logprobs", "entropy", and "routing" when present) to `path` atomically (a temporary name,
// then a rename).
void write_logprobs_jsonl(const std::string& path, const Corpus& docs, const std::vector<DocLogprobs>& out,
                          int64_t layers, int64_t topk);

}  // namespace bb

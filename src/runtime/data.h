// data.h — training data: sources (flat token files, JSON lines, the built-in demo corpus) and
// packing into fixed-size micro-batches without padding, in THD layout (DESIGN.md sec. 7).
//
// Legend: T tokens per micro-batch, B sequences in a micro-batch.
//
// Packing. Documents are visited in a permutation that depends on (seed, epoch), a new one every
// epoch. A micro-batch takes exactly T tokens from consecutive documents; each document (or piece
// of one) is its own sequence, so attention never crosses a document. A document longer than the
// remaining room is split and its rest opens the next micro-batch as a new sequence whose
// positions restart at 0. A micro-batch may run from the end of one epoch into the next.
//
// Targets. For token j of a document, target = doc[j + 1] (also across a split: the next token is
// known), and -1 ("no loss") for the last token of the document or where loss_mask[j + 1] == 0
// (the loss mask marks which tokens are trained to be *predicted*; loss_mask[0] is never used).
// The loss is averaged over the targets >= 0 (num_valid), never over T.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/batch.h"
#include "core/tensor.h"

namespace bb {

// RL rollouts carry per-token values beside the tokens (skills/rl-data.md). Entry j belongs to
// token j (the value of predicting it from tokens[< j]), like loss_mask: entry 0 is never used.
struct Document {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;  // same length as tokens (0/1), or empty = all 1
  std::vector<float> advantages;    // same length as tokens, or empty = no RL fields
  std::vector<float> old_logprobs;  // same length, or empty (on-policy)
  std::vector<float> ref_logprobs;  // same length, or empty
  std::string id;                   // the record's "id" (may be empty)
  // Router replay: the experts the rollout engine routed token j to, [tokens][layers][topk]
  // flattened (ids >= 0; the model checks < E), or empty.
  std::vector<int32_t> routing;
  int64_t routing_layers = 0, routing_topk = 0;
};

struct DataConfig {
  // A file path, or "demo" for the built-in corpus (make_demo_corpus(demo_documents, seed)).
  std::string path = "demo";
  // "auto" (by extension: .bin/.u32 -> flat, .jsonl -> jsonl; "demo" -> demo), "flat", "jsonl",
  // "demo".
  std::string format = "auto";
  int64_t tokens_per_micro_batch = 2048;
  int64_t vocab_size = 264;
  // Separates documents in flat token files (it stays at the end of its document). JSONL "text"
  // records and the demo corpus always use the byte tokenizer's kEosId.
  int32_t eos_id = 256;
  uint64_t seed = 1234;
  bool shuffle = true;
  int64_t demo_documents = 2000;
  // JSONL: the longest line accepted (a longer one is an error naming the line); parsing holds
  // at most a small multiple of the line in memory (see read_jsonl).
  int64_t max_line_bytes = int64_t{1} << 30;
  // "split": every micro-batch holds exactly tokens_per_micro_batch tokens, a document that does
  // not fit is split (its rest opens the next micro-batch without the earlier context).
  // "whole": documents are never split; each step's micro-batches are filled with whole
  // documents up to the token budget (at most tokens_per_micro_batch each) and balanced by
  // estimated cost (DataLoader::next_step). RL needs it: a split rollout's second piece would
  // be scored without its prompt.
  std::string packing = "split";
};

// All documents back to back; the form the loader keeps in memory (one allocation, not one per
// document, so that files of billions of tokens stay cheap to hold).
struct Corpus {
  std::vector<int32_t> tokens;     // all documents, concatenated
  std::vector<uint8_t> loss_mask;  // same length as tokens, or empty when no document has a mask
  // RL fields: each the same length as tokens, or empty when the documents have none (a field
  // is in every document or in none).
  std::vector<float> advantages, old_logprobs, ref_logprobs;
  std::vector<std::string> ids;  // one per document when the records have "id", else empty
  // Router replay: [num_tokens][routing_layers][routing_topk] expert ids, or empty (every
  // document has routing or none; one shape for all).
  std::vector<int16_t> routing;
  int64_t routing_layers = 0, routing_topk = 0;
  std::vector<int64_t> offsets{
      0};  // [num_documents + 1]: document d is tokens[offsets[d], offsets[d+1])

  int64_t num_documents() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t length(int64_t d) const { return offsets[d + 1] - offsets[d]; }
  Document document(int64_t d) const;
  // Appends one document (non-empty; mask empty or of the same length).
  void add(const std::vector<int32_t>& doc_tokens, const std::vector<uint8_t>& doc_mask = {});
  // Appends a document with its RL fields (each empty or of the tokens' length; the same fields
  // as the documents before it).
  void add(const Document& doc);
  bool has_rl() const { return !advantages.empty(); }
  bool has_routing() const { return !routing.empty(); }
};

// Checks every document (non-empty, tokens in [0, vocab_size), mask 0/1 of the right length) and
// packs them into a Corpus. `what` names the source in error messages.
Corpus corpus_from_documents(const std::vector<Document>& docs, int64_t vocab_size,
                             const std::string& what = "documents");

// Flat token file: little-endian uint32 tokens; a document ends after each `eos_id` (tokens after
// the last EOS form a final document without one). Size must be a multiple of 4; every token
// must be < vocab_size.
Corpus read_flat_tokens(const std::string& path, int64_t vocab_size, int32_t eos_id);

// JSON lines: one object per line with "tokens" (int array, taken as is: no EOS is added) and
// optional "loss_mask" (0/1 array, same length), or "text" (string: byte-tokenized, kEosId
// appended). Blank lines are skipped. RL rollout records (with "tokens") may add "advantages"
// (a number array of the tokens' length, or one number for the whole record), "old_logprobs"
// and "ref_logprobs" (arrays of the tokens' length, finite, <= 0), "id" (string or integer) and
// "routing" ([tokens][MoE layers][top-k] expert ids, one shape for the file); every record then
// has the same RL keys. Anything else is an error naming path:line and the key.
// Records are parsed with a SAX handler straight into the corpus (no JSON tree): memory for a
// line is the line itself plus its tokens (4 bytes each, at most 2 per 2 bytes of text), so a
// huge line costs a small multiple of its size. A line longer than max_line_bytes is an error.
Corpus read_jsonl(const std::string& path, int64_t vocab_size,
                  int64_t max_line_bytes = int64_t{1} << 30);
// The same over text in memory (tests, fuzzing); `what` names it in errors as WHAT:LINE.
Corpus parse_jsonl(std::string_view text, int64_t vocab_size, const std::string& what,
                   int64_t max_line_bytes = int64_t{1} << 30);

// The format `cfg` selects: "flat", "jsonl" or "demo" (resolving "auto" by extension).
std::string resolve_format(const DataConfig& cfg);

// Loads the data `cfg` names (checks the file exists first; prints a progress line to stderr for
// files of more than ~10M tokens).
Corpus load_corpus(const DataConfig& cfg);

// Where the loader stands: the next token it packs is token `token_offset` of the
// `doc_index`-th document visited in epoch `epoch`. Saved in checkpoints.
struct DataPosition {
  uint64_t epoch = 0;
  uint64_t doc_index = 0;
  uint64_t token_offset = 0;
  bool operator==(const DataPosition&) const = default;
};
// {"epoch": e, "doc_index": d, "token_offset": t}; found by nlohmann's ADL
// (json j = pos; pos = j.get<DataPosition>()). from_json names a missing or bad key.
void to_json(nlohmann::json& j, const DataPosition& p);
void from_json(const nlohmann::json& j, DataPosition& p);

// The order in which documents 0..num_docs-1 are visited in `epoch`: a Philox-driven
// Fisher-Yates permutation of (seed, epoch), or the identity when shuffle is false.
std::vector<int64_t> epoch_order(int64_t num_docs, uint64_t seed, uint64_t epoch, bool shuffle);

class DataLoader {
 public:
  // Loads cfg.path (see load_corpus).
  explicit DataLoader(const DataConfig& cfg);
  // Packs an in-memory corpus instead (cfg.path and cfg.format are not used).
  DataLoader(const DataConfig& cfg, Corpus corpus);

  // The next micro-batch of exactly cfg.tokens_per_micro_batch tokens; never ends (epochs wrap).
  // RL data also fills advantages, old / ref log-probs and seq_weight (core/batch.h). Split
  // packing only.
  MicroBatch next();
  // The `n` micro-batches of one step (every rank asks for all of them; data rank r takes
  // [r A, (r + 1) A)). Split packing: n x next(). Whole packing: the next documents in visit
  // order, as many as fit, assigned to n micro-batches of at most tokens_per_micro_batch tokens
  // each by longest-processing-time first (each document, costliest first, to the micro-batch
  // of least cost with room; ties to the lower index) under sequence_cost. A document longer
  // than tokens_per_micro_batch is an error naming it. Within a micro-batch the documents keep
  // their visit order.
  std::vector<MicroBatch> next_step(int64_t n);
  // Every document of the corpus exactly once, whole, in `n` micro-batches of at most
  // tokens_per_micro_batch tokens balanced as next_step's (the batch an API caller gives for one
  // step). An error names what does not fit: a document longer than a micro-batch, fewer
  // documents than micro-batches, or more tokens than the n micro-batches hold. The position
  // does not move. `docs_of`, if given, receives each micro-batch's documents in their order
  // there (indices into the corpus).
  std::vector<MicroBatch> pack_all(int64_t n, std::vector<std::vector<int64_t>>* docs_of = nullptr) const;
  // The cost of one sequence of `len` tokens for whole packing's balance (default: len + len^2 /
  // 4096, attention being quadratic); the trainer sets the model's FLOPs.
  void set_sequence_cost(std::function<double(int64_t)> cost) { cost_ = std::move(cost); }
  DataPosition position() const { return pos_; }
  // After restore(p), next() gives exactly what the loader that reported p gave next.
  // Throws if p does not fit this dataset (document index or offset out of range).
  void restore(const DataPosition& p);

  int64_t num_documents() const { return corpus_.num_documents(); }
  int64_t num_tokens() const { return corpus_.num_tokens(); }
  const Corpus& corpus() const { return corpus_; }
  const DataConfig& config() const { return cfg_; }
  std::vector<int64_t> epoch_order(uint64_t epoch) const;

 private:
  void check_config() const;
  void start_epoch(uint64_t epoch);
  void count_doc_targets();
  // Appends the piece [off, off + take) of corpus document `doc` at position `fill` of `b`.
  struct Builder;
  void append_piece(Builder& b, int64_t doc, int64_t off, int64_t take) const;
  MicroBatch finish(Builder& b) const;
  std::vector<MicroBatch> pack_whole(int64_t n);
  double sequence_cost(int64_t len) const;  // cost_, or the default of set_sequence_cost
  // Micro-batch k of n: documents docs[i] (whole, lens[i] tokens) with bins[i] == k, in order.
  std::vector<MicroBatch> build_bins(int64_t n, const std::vector<int64_t>& docs, const std::vector<int64_t>& lens,
                                     const std::vector<int64_t>& bins, std::vector<std::vector<int64_t>>* docs_of) const;


  DataConfig cfg_;
  Corpus corpus_;
  std::vector<int64_t> order_;  // epoch_order(pos_.epoch)
  std::vector<int64_t> doc_targets_;  // RL data: each document's valid targets (MicroBatch::seq_weight)
  std::function<double(int64_t)> cost_;
  DataPosition pos_;
};

}  // namespace bb

// data.cpp — data sources and THD packing (see data.h).
#include "runtime/data.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "runtime/demo_corpus.h"
#include "runtime/tokenizer.h"

namespace bb {
namespace {

using json = nlohmann::json;

// Above this many tokens a load takes seconds: say so on stderr.
constexpr int64_t kProgressTokens = 10'000'000;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

void check_file(const std::string& path) {
  namespace fs = std::filesystem;
  BB_CHECK(fs::exists(path), "data file '", path, "' not found (set data path = \"demo\" to ",
           "train on the built-in generated corpus, which needs no download)");
  BB_CHECK(fs::is_regular_file(path), "data path '", path, "' is not a regular file");
}

void check_nonempty(const Corpus& c, const std::string& what) {
  BB_CHECK(c.num_tokens() > 0, "dataset ", what, " contains no tokens");
}

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Reads an integer JSON array element-wise into `out`; `lo`..`hi` is the allowed inclusive range.
void read_int_array(const json& arr, const std::string& where, const char* key, int64_t lo,
                    int64_t hi, std::vector<int64_t>& out) {
  BB_CHECK(arr.is_array(), where, ": key '", key, "': expected an array of integers, got ",
           arr.type_name());
  out.clear();
  out.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const json& v = arr[i];
    int64_t x = 0;
    if (v.is_boolean() && std::string_view(key) == "loss_mask") {
      x = v.get<bool>() ? 1 : 0;
    } else if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      x = u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else {
      BB_FAIL(where, ": key '", key, "': element ", i, " is ", v.dump(), ", not an integer");
    }
    BB_CHECK(x >= lo && x <= hi, where, ": key '", key, "': element ", i, " is ", x, ", outside [",
             lo, ", ", hi, "]");
    out.push_back(x);
  }
}

}  // namespace

// ---- Corpus ------------------------------------------------------------------------------------

Document Corpus::document(int64_t d) const {
  BB_CHECK(d >= 0 && d < num_documents(), "Corpus::document: index ", d, " out of range [0, ",
           num_documents(), ")");
  Document doc;
  doc.tokens.assign(tokens.begin() + offsets[d], tokens.begin() + offsets[d + 1]);
  if (!loss_mask.empty())
    doc.loss_mask.assign(loss_mask.begin() + offsets[d], loss_mask.begin() + offsets[d + 1]);
  return doc;
}

void Corpus::add(const std::vector<int32_t>& doc_tokens, const std::vector<uint8_t>& doc_mask) {
  BB_CHECK(!doc_tokens.empty(), "Corpus::add: empty document");
  BB_CHECK(doc_mask.empty() || doc_mask.size() == doc_tokens.size(), "Corpus::add: loss_mask has ",
           doc_mask.size(), " entries for ", doc_tokens.size(), " tokens");
  // The mask array is created only when the first masked document arrives.
  const bool masked = !loss_mask.empty() || !doc_mask.empty();
  if (masked && loss_mask.empty()) loss_mask.assign(tokens.size(), 1);
  tokens.insert(tokens.end(), doc_tokens.begin(), doc_tokens.end());
  if (masked) {
    if (doc_mask.empty())
      loss_mask.insert(loss_mask.end(), doc_tokens.size(), 1);
    else
      loss_mask.insert(loss_mask.end(), doc_mask.begin(), doc_mask.end());
  }
  offsets.push_back(static_cast<int64_t>(tokens.size()));
}

Corpus corpus_from_documents(const std::vector<Document>& docs, int64_t vocab_size,
                             const std::string& what) {
  Corpus c;
  for (size_t d = 0; d < docs.size(); ++d) {
    const Document& doc = docs[d];
    BB_CHECK(!doc.tokens.empty(), what, ": document ", d, " is empty");
    BB_CHECK(doc.loss_mask.empty() || doc.loss_mask.size() == doc.tokens.size(), what,
             ": document ", d, ": loss_mask has ", doc.loss_mask.size(), " entries, expected ",
             doc.tokens.size(), " (one per token) or none");
    for (size_t i = 0; i < doc.tokens.size(); ++i)
      BB_CHECK(doc.tokens[i] >= 0 && doc.tokens[i] < vocab_size, what, ": document ", d, ": token ",
               doc.tokens[i], " at index ", i, " is outside [0, ", vocab_size, ")");
    for (size_t i = 0; i < doc.loss_mask.size(); ++i)
      BB_CHECK(doc.loss_mask[i] <= 1, what, ": document ", d, ": loss_mask[", i, "] is ",
               int(doc.loss_mask[i]), ", expected 0 or 1");
    c.add(doc.tokens, doc.loss_mask);
  }
  check_nonempty(c, what);
  return c;
}

// ---- flat token files --------------------------------------------------------------------------

Corpus read_flat_tokens(const std::string& path, int64_t vocab_size, int32_t eos_id) {
  check_file(path);
  BB_CHECK(eos_id >= 0 && eos_id < vocab_size, "flat token file '", path, "': eos_id ", eos_id,
           " is outside [0, vocab_size = ", vocab_size, ")");
  const auto bytes = static_cast<int64_t>(std::filesystem::file_size(path));
  BB_CHECK(bytes % 4 == 0, "flat token file '", path, "' has ", bytes,
           " bytes, not a multiple of 4 (expected little-endian uint32 tokens)");
  const int64_t n = bytes / 4;
  const bool loud = n > kProgressTokens;
  if (loud)
    std::cerr << "bumblebee: loading " << n << " tokens from " << path << " ..." << std::endl;

  Corpus c;
  c.tokens.resize(static_cast<size_t>(n));
  std::ifstream in(path, std::ios::binary);
  BB_CHECK(in.good(), "cannot open flat token file '", path, "'");
  in.read(reinterpret_cast<char*>(c.tokens.data()), bytes);
  BB_CHECK(in.gcount() == bytes, "flat token file '", path, "': read ", in.gcount(), " of ", bytes,
           " bytes");
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &c.tokens[i], 4);
    if constexpr (std::endian::native == std::endian::big) u = __builtin_bswap32(u);
    BB_CHECK(u < static_cast<uint64_t>(vocab_size), "flat token file '", path, "': token ", u,
             " at index ", i, " is >= vocab_size ", vocab_size);
    c.tokens[i] = static_cast<int32_t>(u);
    if (static_cast<int32_t>(u) == eos_id) c.offsets.push_back(i + 1);
  }
  if (c.offsets.back() != n) c.offsets.push_back(n);
  check_nonempty(c, "'" + path + "'");
  if (loud)
    std::cerr << "bumblebee: loaded " << c.num_documents() << " documents from " << path
              << std::endl;
  return c;
}

// ---- JSON lines --------------------------------------------------------------------------------

Corpus read_jsonl(const std::string& path, int64_t vocab_size) {
  check_file(path);
  const bool loud = static_cast<int64_t>(std::filesystem::file_size(path)) > 4 * kProgressTokens;
  if (loud) std::cerr << "bumblebee: loading JSON lines from " << path << " ..." << std::endl;
  std::ifstream in(path);
  BB_CHECK(in.good(), "cannot open JSON-lines file '", path, "'");

  Corpus c;
  std::string line;
  std::vector<int64_t> ints;
  std::vector<int32_t> doc_tokens;
  std::vector<uint8_t> doc_mask;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (is_blank(line)) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    json rec;
    try {
      rec = json::parse(line);
    } catch (const json::parse_error& e) {
      BB_FAIL(where, ": invalid JSON (", e.what(), ")");
    }
    BB_CHECK(rec.is_object(), where, ": expected a JSON object per line, got ", rec.type_name());
    for (const auto& item : rec.items()) {
      const std::string& key = item.key();
      const bool known = key == "tokens" || key == "text" || key == "loss_mask" ||
                         key == "advantages" || key == "old_logprobs" || key == "ref_logprobs" ||
                         key == "routing";
      BB_CHECK(known, where, ": unknown key '", key, "' (expected \"tokens\" with optional ",
               "\"loss_mask\", or \"text\"; RL keys advantages, old_logprobs, ref_logprobs, ",
               "routing are accepted)");
    }
    const bool has_tokens = rec.contains("tokens"), has_text = rec.contains("text");
    BB_CHECK(has_tokens || has_text, where, ": record has neither key 'tokens' nor key 'text'");
    BB_CHECK(!(has_tokens && has_text), where,
             ": record has both key 'tokens' and key 'text'; give one");
    doc_tokens.clear();
    doc_mask.clear();
    if (has_text) {
      BB_CHECK(!rec.contains("loss_mask"), where, ": key 'loss_mask' needs key 'tokens' ",
               "(a mask cannot be aligned with the bytes of 'text')");
      const json& text = rec["text"];
      BB_CHECK(text.is_string(), where, ": key 'text': expected a string, got ", text.type_name());
      BB_CHECK(vocab_size > kEosId, where, ": key 'text' is byte-tokenized with EOS id ", kEosId,
               ", which needs vocab_size > ", kEosId, " (got ", vocab_size, ")");
      doc_tokens = byte_tokenize(text.get_ref<const std::string&>());
      doc_tokens.push_back(kEosId);
    } else {
      read_int_array(rec["tokens"], where, "tokens", 0, vocab_size - 1, ints);
      BB_CHECK(!ints.empty(), where, ": key 'tokens': empty array (a document needs a token)");
      doc_tokens.assign(ints.begin(), ints.end());
      if (rec.contains("loss_mask")) {
        read_int_array(rec["loss_mask"], where, "loss_mask", 0, 1, ints);
        BB_CHECK(ints.size() == doc_tokens.size(), where, ": key 'loss_mask': length ", ints.size(),
                 " does not match key 'tokens' length ", doc_tokens.size());
        doc_mask.assign(ints.begin(), ints.end());
      }
    }
    c.add(doc_tokens, doc_mask);
  }
  check_nonempty(c, "'" + path + "'");
  if (loud || c.num_tokens() > kProgressTokens)
    std::cerr << "bumblebee: loaded " << c.num_documents() << " documents, " << c.num_tokens()
              << " tokens from " << path << std::endl;
  return c;
}

// ---- selection ---------------------------------------------------------------------------------

std::string resolve_format(const DataConfig& cfg) {
  const std::string fmt = lower(cfg.format);
  if (fmt == "flat" || fmt == "jsonl" || fmt == "demo") return fmt;
  BB_CHECK(fmt == "auto", "data format '", cfg.format, "' is not one of auto, flat, jsonl, demo");
  if (cfg.path == "demo") return "demo";
  const std::string ext = lower(std::filesystem::path(cfg.path).extension().string());
  if (ext == ".bin" || ext == ".u32") return "flat";
  if (ext == ".jsonl") return "jsonl";
  BB_FAIL("cannot tell the format of data file '", cfg.path, "' from its extension '", ext,
          "' (.bin/.u32 = flat uint32 tokens, .jsonl = JSON lines); set format = \"flat\" or ",
          "\"jsonl\", or use path = \"demo\"");
}

Corpus load_corpus(const DataConfig& cfg) {
  const std::string fmt = resolve_format(cfg);
  if (fmt == "flat") return read_flat_tokens(cfg.path, cfg.vocab_size, cfg.eos_id);
  if (fmt == "jsonl") return read_jsonl(cfg.path, cfg.vocab_size);
  BB_CHECK(cfg.vocab_size > kEosId, "the demo corpus is byte-level with EOS id ", kEosId,
           ": it needs vocab_size > ", kEosId, " (", kByteVocabSize, " recommended), got ",
           cfg.vocab_size);
  BB_CHECK(cfg.demo_documents > 0, "data: demo_documents must be positive, got ",
           cfg.demo_documents);
  return corpus_from_documents(make_demo_corpus(cfg.demo_documents, cfg.seed), cfg.vocab_size,
                               "demo corpus");
}

// ---- positions ---------------------------------------------------------------------------------

void to_json(nlohmann::json& j, const DataPosition& p) {
  j = json{{"epoch", p.epoch}, {"doc_index", p.doc_index}, {"token_offset", p.token_offset}};
}

void from_json(const nlohmann::json& j, DataPosition& p) {
  BB_CHECK(j.is_object(), "data position: expected a JSON object, got ", j.type_name());
  auto get = [&](const char* key) -> uint64_t {
    BB_CHECK(j.contains(key), "data position: missing key '", key, "' in ", j.dump());
    const json& v = j.at(key);
    BB_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
             "data position: key '", key, "' must be a non-negative integer, got ", v.dump());
    return v.get<uint64_t>();
  };
  p.epoch = get("epoch");
  p.doc_index = get("doc_index");
  p.token_offset = get("token_offset");
}

std::vector<int64_t> epoch_order(int64_t num_docs, uint64_t seed, uint64_t epoch, bool shuffle) {
  std::vector<int64_t> order(static_cast<size_t>(num_docs));
  for (int64_t i = 0; i < num_docs; ++i) order[i] = i;
  if (!shuffle) return order;
  // Fisher-Yates; draw i uses Philox counter (epoch, i), so each epoch is its own stream.
  for (int64_t i = num_docs - 1; i > 0; --i) {
    const Philox4 r = philox4x32_10(seed, (epoch << 40) + static_cast<uint64_t>(i));
    const uint64_t x = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
    const auto j = static_cast<int64_t>(
        (static_cast<unsigned __int128>(x) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

// ---- loader ------------------------------------------------------------------------------------

DataLoader::DataLoader(const DataConfig& cfg) : cfg_(cfg) {
  check_config();
  corpus_ = load_corpus(cfg_);
  start_epoch(0);
}

DataLoader::DataLoader(const DataConfig& cfg, Corpus corpus)
    : cfg_(cfg), corpus_(std::move(corpus)) {
  check_config();
  check_nonempty(corpus_, "(in memory)");
  start_epoch(0);
}

void DataLoader::check_config() const {
  BB_CHECK(cfg_.tokens_per_micro_batch > 0, "data: tokens_per_micro_batch must be positive, got ",
           cfg_.tokens_per_micro_batch);
  BB_CHECK(cfg_.tokens_per_micro_batch <= INT32_MAX, "data: tokens_per_micro_batch ",
           cfg_.tokens_per_micro_batch, " does not fit the i32 cu_seqlens");
  BB_CHECK(cfg_.vocab_size > 0, "data: vocab_size must be positive, got ", cfg_.vocab_size);
}

std::vector<int64_t> DataLoader::epoch_order(uint64_t epoch) const {
  return bb::epoch_order(num_documents(), cfg_.seed, epoch, cfg_.shuffle);
}

void DataLoader::start_epoch(uint64_t epoch) {
  pos_ = DataPosition{epoch, 0, 0};
  order_ = epoch_order(epoch);
}

void DataLoader::restore(const DataPosition& p) {
  const auto n = static_cast<uint64_t>(num_documents());
  BB_CHECK(p.doc_index < n, "data restore: doc_index ", p.doc_index,
           " is out of range for a dataset of ", n,
           " documents (was the position saved with another dataset?)");
  // Checked before anything changes, so that a failed restore leaves the loader as it was.
  std::vector<int64_t> order = p.epoch == pos_.epoch ? order_ : epoch_order(p.epoch);
  const int64_t len = corpus_.length(order[p.doc_index]);
  BB_CHECK(p.token_offset < static_cast<uint64_t>(len), "data restore: token_offset ",
           p.token_offset, " is out of range for document ", order[p.doc_index], " of ", len,
           " tokens (was the position saved with another dataset or seed?)");
  order_ = std::move(order);
  pos_ = p;
}

MicroBatch DataLoader::next() {
  const int64_t T = cfg_.tokens_per_micro_batch;
  std::vector<int32_t> tokens(T), targets(T), positions(T), cu{0};
  const int32_t* all = corpus_.tokens.data();
  const uint8_t* mask = corpus_.loss_mask.empty() ? nullptr : corpus_.loss_mask.data();
  int64_t fill = 0, num_valid = 0;
  while (fill < T) {
    const int64_t doc = order_[pos_.doc_index];
    const int64_t begin = corpus_.offsets[doc], len = corpus_.length(doc);
    const auto off = static_cast<int64_t>(pos_.token_offset);
    const int64_t take = std::min(len - off, T - fill);
    for (int64_t i = 0; i < take; ++i) {
      const int64_t j = begin + off + i;  // index into the corpus
      tokens[fill + i] = all[j];
      positions[fill + i] = static_cast<int32_t>(i);
      const bool has_next = off + i + 1 < len;
      const bool trained = has_next && (mask == nullptr || mask[j + 1] != 0);
      targets[fill + i] = trained ? all[j + 1] : -1;
      num_valid += trained;
    }
    fill += take;
    cu.push_back(static_cast<int32_t>(fill));
    pos_.token_offset += static_cast<uint64_t>(take);
    if (static_cast<int64_t>(pos_.token_offset) == len) {
      pos_.token_offset = 0;
      if (++pos_.doc_index == static_cast<uint64_t>(num_documents())) start_epoch(pos_.epoch + 1);
    }
  }
  MicroBatch mb;
  const int64_t B = static_cast<int64_t>(cu.size()) - 1;
  mb.tokens = Tensor::from_ints(tokens, {T}, MemCategory::other);
  mb.targets = Tensor::from_ints(targets, {T}, MemCategory::other);
  mb.positions = Tensor::from_ints(positions, {T}, MemCategory::other);
  mb.cu_seqlens = Tensor::from_ints(cu, {B + 1}, MemCategory::other);
  mb.num_valid = num_valid;
  return mb;
}

}  // namespace bb

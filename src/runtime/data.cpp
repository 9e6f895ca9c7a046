// data.cpp — data sources and THD packing (see data.h).
#include "runtime/data.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "io/json_limits.h"
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

// Tokens, and at least one loss target: token j of a document is a target of token j - 1 when
// j >= 1 and its loss_mask entry is 1 (data.h). A dataset without one would skip every step.
void check_nonempty(const Corpus& c, const std::string& what) {
  BB_CHECK(c.num_tokens() > 0, "dataset ", what, " contains no tokens");
  for (int64_t d = 0; d < c.num_documents(); ++d)
    for (int64_t j = c.offsets[static_cast<size_t>(d)] + 1; j < c.offsets[static_cast<size_t>(d) + 1]; ++j)
      if (c.loss_mask.empty() || c.loss_mask[static_cast<size_t>(j)]) return;
  BB_FAIL("dataset ", what, " has nothing to train on: every one of its ", c.num_documents(),
          " documents has fewer than two tokens or a loss_mask of 0 after its first token; every step would be "
          "skipped");
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
  auto slice = [&](const std::vector<float>& v, std::vector<float>& out) {
    if (!v.empty()) out.assign(v.begin() + offsets[d], v.begin() + offsets[d + 1]);
  };
  slice(advantages, doc.advantages);
  slice(old_logprobs, doc.old_logprobs);
  slice(ref_logprobs, doc.ref_logprobs);
  if (!ids.empty()) doc.id = ids[static_cast<size_t>(d)];
  if (!routing.empty()) {
    const int64_t per = routing_layers * routing_topk;
    doc.routing.assign(routing.begin() + offsets[d] * per, routing.begin() + offsets[d + 1] * per);
    doc.routing_layers = routing_layers;
    doc.routing_topk = routing_topk;
  }
  return doc;
}

namespace {

// A corpus's RL fields are in every document or in none: the first document decides.
void check_rl_presence(const Corpus& c, bool adv, bool old, bool ref, bool id, bool routing, const std::string& where) {
  if (c.num_documents() == 0) return;
  auto same = [&](bool now, bool before, const char* key) {
    BB_CHECK(now == before, where, ": key '", key, "' is ", now ? "present" : "missing",
             " here but ", before ? "present" : "missing", " in the records before; every record of a file has the "
             "same RL keys (advantages, old_logprobs, ref_logprobs, id)");
  };
  same(adv, !c.advantages.empty(), "advantages");
  same(old, !c.old_logprobs.empty(), "old_logprobs");
  same(ref, !c.ref_logprobs.empty(), "ref_logprobs");
  same(id, !c.ids.empty(), "id");
  same(routing, c.has_routing(), "routing");
}

// Appends a document's routing ([n][layers][topk] flattened), checking its shape against the
// corpus's (the first document with routing sets it).
void append_routing(Corpus& c, const std::vector<int32_t>& r, int64_t n, int64_t layers, int64_t topk,
                    const std::string& where) {
  if (r.empty()) return;
  BB_CHECK(layers > 0 && topk > 0 && static_cast<int64_t>(r.size()) == n * layers * topk, where,
           ": key 'routing' holds ", r.size(), " expert ids for ", n, " tokens x ", layers, " layers x top-k ", topk);
  if (c.routing.empty()) {
    c.routing_layers = layers;
    c.routing_topk = topk;
  }
  BB_CHECK(layers == c.routing_layers && topk == c.routing_topk, where, ": key 'routing' has ", layers,
           " MoE layers x top-k ", topk, " per token, the records before ", c.routing_layers, " x ", c.routing_topk);
  for (int32_t e : r) {
    BB_CHECK(e >= 0 && e <= 32767, where, ": key 'routing': expert id ", e, " is outside [0, 32767]");
    c.routing.push_back(static_cast<int16_t>(e));
  }
}

// Log-probs are finite and <= 0 (a positive value is a probability or a logit by mistake).
void check_logprobs(const std::vector<float>& v, const char* key, const std::string& where) {
  for (size_t i = 0; i < v.size(); ++i)
    BB_CHECK(std::isfinite(v[i]) && v[i] <= 0.0f, where, ": key '", key, "': element ", i, " is ", v[i],
             "; log-probs are finite and <= 0 (give log p, not p or a logit)");
}

}  // namespace

void Corpus::add(const Document& doc) {
  const size_t n = doc.tokens.size();
  auto field = [&](const std::vector<float>& v, const char* key) {
    BB_CHECK(v.empty() || v.size() == n, "Corpus::add: ", key, " has ", v.size(), " entries for ", n, " tokens");
  };
  field(doc.advantages, "advantages");
  field(doc.old_logprobs, "old_logprobs");
  field(doc.ref_logprobs, "ref_logprobs");
  BB_CHECK(doc.advantages.size() == n || (doc.old_logprobs.empty() && doc.ref_logprobs.empty()),
           "Corpus::add: old_logprobs / ref_logprobs need advantages");
  const std::string where = "document " + std::to_string(num_documents());
  check_rl_presence(*this, !doc.advantages.empty(), !doc.old_logprobs.empty(), !doc.ref_logprobs.empty(),
                    !doc.id.empty(), !doc.routing.empty(), where);
  append_routing(*this, doc.routing, static_cast<int64_t>(n), doc.routing_layers, doc.routing_topk, where);
  add(doc.tokens, doc.loss_mask);
  advantages.insert(advantages.end(), doc.advantages.begin(), doc.advantages.end());
  old_logprobs.insert(old_logprobs.end(), doc.old_logprobs.begin(), doc.old_logprobs.end());
  ref_logprobs.insert(ref_logprobs.end(), doc.ref_logprobs.begin(), doc.ref_logprobs.end());
  if (!doc.id.empty()) ids.push_back(doc.id);
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
    const std::string where = what + ": document " + std::to_string(d);
    for (size_t i = 0; i < doc.advantages.size(); ++i)
      BB_CHECK(std::isfinite(doc.advantages[i]), where, ": advantages[", i, "] is not finite");
    check_logprobs(doc.old_logprobs, "old_logprobs", where);
    check_logprobs(doc.ref_logprobs, "ref_logprobs", where);
    c.add(doc);
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

namespace {

// One JSONL record, parsed by SAX events straight into the corpus's token array (and a 1-byte
// mask vector): no JSON tree and no per-record copy, so a record costs its tokens (4 bytes each,
// at most one per 2 bytes of text) and the lexer's current token, not the ~16-byte-per-element
// tree nlohmann would allocate. Errors name WHERE and the key.
class RecordParser final : public json::json_sax_t {
 public:
  RecordParser(std::string where, int64_t vocab_size, std::vector<int32_t>& tokens, std::vector<uint8_t>& mask)
      : where_(std::move(where)), vocab_(vocab_size), tokens_(tokens), mask_(mask) {}

  bool has_tokens = false, has_text = false, has_mask = false;
  bool has_adv = false, has_old = false, has_ref = false, has_id = false, has_routing = false;
  std::string text, id;
  // "routing": [tokens][MoE layers][top-k] expert ids, flattened; the shape of the file's first
  // routing (routing_layers x routing_topk per token) binds every record.
  std::vector<int32_t> routing;
  int64_t routing_tokens = 0, routing_layers = 0, routing_topk = 0;
  // RL fields of the record: arrays, or (advantages only) one number for every token.
  std::vector<float> adv, old, ref;
  bool adv_scalar = false;
  float adv_value = 0;

  bool null() override { return scalar("null", "null"); }
  bool boolean(bool v) override {
    if (depth_ == 2 && in_ == In::mask) return element(v ? 1 : 0, v ? "true" : "false");
    return scalar(v ? "true" : "false", "boolean");
  }
  bool number_integer(number_integer_t v) override { return integer(v, std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) override {
    return integer(v > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(v), std::to_string(v));
  }
  bool number_float(number_float_t v, const string_t& raw) override {
    if (number(static_cast<double>(v), raw)) return true;
    return scalar(raw, "number");
  }
  bool string(string_t& v) override {
    if (depth_ == 1 && in_ == In::text) {
      text = std::move(v);
      in_ = In::none;
      return true;
    }
    if (depth_ == 1 && in_ == In::id) {
      id = std::move(v);
      in_ = In::none;
      return true;
    }
    return scalar(json(v).dump(), "string");
  }
  bool binary(binary_t&) override { return scalar("binary", "binary"); }
  bool start_object(std::size_t) override { return open("object"); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open("array"); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    if (depth_ != 1) return true;  // inside an ignored value
    if (k == "tokens") in_ = In::tokens, mark(has_tokens, k);
    else if (k == "loss_mask") in_ = In::mask, mark(has_mask, k);
    else if (k == "text") in_ = In::text, mark(has_text, k);
    else if (k == "advantages") in_ = In::adv, mark(has_adv, k);
    else if (k == "old_logprobs") in_ = In::old, mark(has_old, k);
    else if (k == "ref_logprobs") in_ = In::ref, mark(has_ref, k);
    else if (k == "id") in_ = In::id, mark(has_id, k);
    else if (k == "routing") in_ = In::routing, mark(has_routing, k);
    else
      BB_FAIL(where_, ": unknown key '", k, "' (expected \"tokens\" with optional \"loss_mask\", or \"text\"; RL keys ",
              "advantages, old_logprobs, ref_logprobs, routing, id are accepted)");
    index_ = 0;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    BB_FAIL(where_, ": invalid JSON (", e.what(), ")");
  }

 private:
  enum class In { none, tokens, mask, text, adv, old, ref, id, routing, ignored };

  void mark(bool& seen, const std::string& k) {
    BB_CHECK(!seen, where_, ": key '", k, "' appears twice in the record");
    seen = true;
  }
  bool int_array() const { return in_ == In::tokens || in_ == In::mask; }
  bool float_array() const { return in_ == In::adv || in_ == In::old || in_ == In::ref; }
  std::vector<float>* floats() { return in_ == In::adv ? &adv : in_ == In::old ? &old : in_ == In::ref ? &ref : nullptr; }
  const char* key_name() const {
    switch (in_) {
      case In::tokens: return "tokens";
      case In::mask: return "loss_mask";
      case In::adv: return "advantages";
      case In::old: return "old_logprobs";
      case In::ref: return "ref_logprobs";
      case In::id: return "id";
      default: return "text";
    }
  }
  // A number inside (or, for advantages, as) an RL field; false when it is not one.
  bool number(double v, const std::string& shown) {
    if (depth_ == 2 && float_array()) {
      BB_CHECK(std::isfinite(v), where_, ": key '", key_name(), "': element ", index_, " is ", shown, ", not finite");
      floats()->push_back(static_cast<float>(v));
      ++index_;
      return true;
    }
    if (depth_ == 1 && in_ == In::adv) {
      BB_CHECK(std::isfinite(v), where_, ": key 'advantages' is ", shown, ", not finite");
      adv_scalar = true;
      adv_value = static_cast<float>(v);
      in_ = In::none;
      return true;
    }
    return false;
  }
  // Where inside "routing" the parser stands, for messages.
  std::string routing_at() const {
    std::string s = "key 'routing': token " + std::to_string(routing_tokens - 1);
    if (depth_ >= 3) s += " layer " + std::to_string(r_layers_ - 1);
    return s;
  }
  // A value that is not an element of tokens / loss_mask / an RL array.
  bool scalar(const std::string& shown, const char* type) {
    if (depth_ == 0) BB_FAIL(where_, ": expected a JSON object per line, got ", type);
    if (in_ == In::routing) {
      if (depth_ == 1)
        BB_FAIL(where_, ": key 'routing': expected an array (tokens x MoE layers x top-k expert ids), got ", type);
      if (depth_ == 2)
        BB_FAIL(where_, ": key 'routing': token ", routing_tokens, " is ", shown, ", expected an array of MoE layers");
      if (depth_ == 3)
        BB_FAIL(where_, ": key 'routing': token ", routing_tokens - 1, " layer ", r_layers_, " is ", shown,
                ", expected an array of expert ids");
      BB_FAIL(where_, ": ", routing_at(), ": element ", r_k_, " is ", shown, ", not an integer");
    }
    if (depth_ == 2 && int_array())
      BB_FAIL(where_, ": key '", key_name(), "': element ", index_, " is ", shown, ", not an integer");
    if (depth_ == 2 && float_array())
      BB_FAIL(where_, ": key '", key_name(), "': element ", index_, " is ", shown, ", not a number");
    if (depth_ == 1) {
      if (int_array()) BB_FAIL(where_, ": key '", key_name(), "': expected an array of integers, got ", type);
      if (in_ == In::adv) BB_FAIL(where_, ": key 'advantages': expected a number or an array of numbers, got ", type);
      if (float_array()) BB_FAIL(where_, ": key '", key_name(), "': expected an array of numbers, got ", type);
      if (in_ == In::text) BB_FAIL(where_, ": key 'text': expected a string, got ", type);
      if (in_ == In::id) BB_FAIL(where_, ": key 'id': expected a string or an integer, got ", type);
      in_ = In::none;
    }
    return true;
  }
  bool integer(int64_t v, const std::string& shown) {
    if (depth_ == 2 && int_array()) return element(v, shown);
    if (depth_ == 4 && in_ == In::routing) {
      BB_CHECK(v >= 0 && v <= 32767, where_, ": ", routing_at(), ": element ", r_k_, " is ", shown,
               ", outside [0, 32767] (an expert id)");
      routing.push_back(static_cast<int32_t>(v));
      ++r_k_;
      return true;
    }
    if (depth_ == 1 && in_ == In::id) {
      id = shown;
      in_ = In::none;
      return true;
    }
    if (number(static_cast<double>(v), shown)) return true;
    return scalar(shown, "number");
  }
  bool element(int64_t x, const std::string&) {
    const int64_t hi = in_ == In::tokens ? vocab_ - 1 : 1;
    BB_CHECK(x >= 0 && x <= hi, where_, ": key '", key_name(), "': element ", index_, " is ", x, ", outside [0, ", hi,
             "]");
    if (in_ == In::tokens) tokens_.push_back(static_cast<int32_t>(x));
    else mask_.push_back(static_cast<uint8_t>(x));
    ++index_;
    return true;
  }
  bool open(const char* type) {
    const bool array = std::string_view(type) == "array";
    if (depth_ == 0 && std::string_view(type) != "object")
      BB_FAIL(where_, ": expected a JSON object per line, got ", type);
    if (depth_ == 1 && in_ == In::text) BB_FAIL(where_, ": key 'text': expected a string, got ", type);
    if (depth_ == 1 && in_ == In::id) BB_FAIL(where_, ": key 'id': expected a string or an integer, got ", type);
    if (depth_ == 1 && int_array() && !array)
      BB_FAIL(where_, ": key '", key_name(), "': expected an array of integers, got ", type);
    if (depth_ == 1 && float_array() && !array)
      BB_FAIL(where_, ": key '", key_name(), "': expected an array of numbers, got ", type);
    if (depth_ == 2 && int_array())
      BB_FAIL(where_, ": key '", key_name(), "': element ", index_, " is an ", type, ", not an integer");
    if (depth_ == 2 && float_array())
      BB_FAIL(where_, ": key '", key_name(), "': element ", index_, " is an ", type, ", not a number");
    if (in_ == In::routing) {
      if (!array) {
        if (depth_ == 1)
          BB_FAIL(where_, ": key 'routing': expected an array (tokens x MoE layers x top-k expert ids), got ", type);
        return scalar("an object", type);
      }
      if (depth_ == 2) ++routing_tokens, r_layers_ = 0;
      if (depth_ == 3) ++r_layers_, r_k_ = 0;
      if (depth_ == 4) BB_FAIL(where_, ": ", routing_at(), ": element ", r_k_, " is an array, not an integer");
    }
    BB_CHECK(depth_ < kMaxJsonDepth, where_, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
    ++depth_;
    return true;
  }
  bool close() {
    --depth_;
    if (in_ == In::routing && depth_ == 3) {  // a layer's ids closed
      if (routing_topk == 0) routing_topk = r_k_;
      BB_CHECK(r_k_ > 0 && r_k_ == routing_topk, where_, ": ", routing_at(), " has ", r_k_, " expert ids, expected ",
               routing_topk, r_k_ == 0 ? " (top-k > 0)" : " (the top-k of the records before)");
    }
    if (in_ == In::routing && depth_ == 2) {  // a token's layers closed
      if (routing_layers == 0) routing_layers = r_layers_;
      BB_CHECK(r_layers_ > 0 && r_layers_ == routing_layers, where_, ": key 'routing': token ", routing_tokens - 1,
               " has ", r_layers_, " MoE layers, expected ", routing_layers,
               r_layers_ == 0 ? " (one entry per MoE layer)" : " (as the tokens and records before)");
    }
    if (depth_ == 1) in_ = In::none;
    return true;
  }

  std::string where_;
  int64_t vocab_;
  std::vector<int32_t>& tokens_;
  std::vector<uint8_t>& mask_;
  int depth_ = 0;
  In in_ = In::none;
  int64_t index_ = 0;
  int64_t r_layers_ = 0, r_k_ = 0;  // inside "routing": layers of the current token, ids of its current layer
};

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Parses one non-blank line into `c` (on error the load fails as a whole).
void add_jsonl_record(std::string_view line, const std::string& where, int64_t vocab_size, Corpus& c,
                      std::vector<int32_t>& doc_tokens, std::vector<uint8_t>& doc_mask) {
  doc_mask.clear();
  // The JSON reader would stop at a NUL byte and drop the rest of the line (a second record,
  // say) without a word.
  const size_t nul = line.find('\0');
  BB_CHECK(nul == std::string_view::npos, where, ": a NUL byte at byte ", nul + 1,
           " of the line; JSON lines are text (one record per line, no binary data)");
  const size_t start = c.tokens.size();
  RecordParser rec(where, vocab_size, c.tokens, doc_mask);
  rec.routing_layers = c.routing_layers;  // the file's routing shape, once known
  rec.routing_topk = c.routing_topk;
  json::sax_parse(line.begin(), line.end(), &rec);
  // The tokens are in place already; what remains is the bookkeeping of Corpus::add.
  const size_t n = c.tokens.size() - start;
  BB_CHECK(rec.has_tokens || rec.has_text, where, ": record has neither key 'tokens' nor key 'text'");
  BB_CHECK(!(rec.has_tokens && rec.has_text), where, ": record has both key 'tokens' and key 'text'; give one");
  if (rec.has_text) {
    BB_CHECK(!rec.has_adv && !rec.has_old && !rec.has_ref, where,
             ": RL keys (advantages, old_logprobs, ref_logprobs) need key 'tokens' (they cannot be aligned with the "
             "bytes of 'text')");
    BB_CHECK(!rec.has_routing, where, ": key 'routing' needs key 'tokens' (it cannot be aligned with the bytes of 'text')");
    check_rl_presence(c, false, false, false, rec.has_id, false, where);
    if (rec.has_id) c.ids.push_back(rec.id);
    BB_CHECK(!rec.has_mask, where, ": key 'loss_mask' needs key 'tokens' ",
             "(a mask cannot be aligned with the bytes of 'text')");
    BB_CHECK(vocab_size > kEosId, where, ": key 'text' is byte-tokenized with EOS id ", kEosId,
             ", which needs vocab_size > ", kEosId, " (got ", vocab_size, ")");
    doc_tokens = byte_tokenize(rec.text);
    doc_tokens.push_back(kEosId);
    c.add(doc_tokens, doc_mask);
    return;
  }
  BB_CHECK(n > 0, where, ": key 'tokens': empty array (a document needs a token)");
  BB_CHECK(!rec.has_mask || doc_mask.size() == n, where, ": key 'loss_mask': length ", doc_mask.size(),
           " does not match key 'tokens' length ", n);
  // RL fields: checked against the tokens, and the same keys in every record (the first decides).
  if (rec.adv_scalar) rec.adv.assign(n, rec.adv_value);
  auto length = [&](bool has, const std::vector<float>& v, const char* key) {
    BB_CHECK(!has || v.size() == n, where, ": key '", key, "': length ", v.size(), " does not match key 'tokens' length ",
             n, " (one value per token; entry j belongs to token j, entry 0 is not used)");
  };
  length(rec.has_adv, rec.adv, "advantages");
  length(rec.has_old, rec.old, "old_logprobs");
  length(rec.has_ref, rec.ref, "ref_logprobs");
  BB_CHECK(rec.has_adv || (!rec.has_old && !rec.has_ref), where,
           ": keys 'old_logprobs' / 'ref_logprobs' need key 'advantages' (a rollout record)");
  check_logprobs(rec.old, "old_logprobs", where);
  check_logprobs(rec.ref, "ref_logprobs", where);
  // (The tokens are in c.tokens already, but its offsets still count the records before this one.)
  check_rl_presence(c, rec.has_adv, rec.has_old, rec.has_ref, rec.has_id, rec.has_routing, where);
  BB_CHECK(!rec.has_routing || rec.routing_tokens == static_cast<int64_t>(n), where, ": key 'routing': ",
           rec.routing_tokens, " token entries for ", n, " tokens (one per token: [MoE layers][top-k] expert ids)");
  append_routing(c, rec.routing, static_cast<int64_t>(n), rec.routing_layers, rec.routing_topk, where);
  c.advantages.insert(c.advantages.end(), rec.adv.begin(), rec.adv.end());
  c.old_logprobs.insert(c.old_logprobs.end(), rec.old.begin(), rec.old.end());
  c.ref_logprobs.insert(c.ref_logprobs.end(), rec.ref.begin(), rec.ref.end());
  if (rec.has_id) c.ids.push_back(rec.id);
  if (!doc_mask.empty() || !c.loss_mask.empty()) {
    if (c.loss_mask.empty()) c.loss_mask.assign(start, 1);  // the first masked document
    if (doc_mask.empty()) c.loss_mask.insert(c.loss_mask.end(), n, 1);
    else c.loss_mask.insert(c.loss_mask.end(), doc_mask.begin(), doc_mask.end());
  }
  c.offsets.push_back(static_cast<int64_t>(c.tokens.size()));
}

void check_max_line(int64_t max_line_bytes) {
  BB_CHECK(max_line_bytes > 0, "data.max_line_bytes must be positive, got ", max_line_bytes);
}

[[noreturn]] void line_too_long(const std::string& where, int64_t max_line_bytes) {
  BB_FAIL(where, ": line is longer than data.max_line_bytes = ", max_line_bytes,
          " bytes; raise data.max_line_bytes if such records are intended (parsing holds about 3x the line in memory)");
}

}  // namespace

Corpus parse_jsonl(std::string_view text, int64_t vocab_size, const std::string& what, int64_t max_line_bytes) {
  check_max_line(max_line_bytes);
  Corpus c;
  std::vector<int32_t> doc_tokens;
  std::vector<uint8_t> doc_mask;
  size_t at = 0;
  for (int64_t lineno = 1; at < text.size(); ++lineno) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    const std::string where = what + ":" + std::to_string(lineno);
    if (static_cast<int64_t>(line.size()) > max_line_bytes) line_too_long(where, max_line_bytes);
    if (!is_blank(line)) add_jsonl_record(line, where, vocab_size, c, doc_tokens, doc_mask);
  }
  check_nonempty(c, "'" + what + "'");
  return c;
}

Corpus read_jsonl(const std::string& path, int64_t vocab_size, int64_t max_line_bytes) {
  check_file(path);
  check_max_line(max_line_bytes);
  const bool loud = static_cast<int64_t>(std::filesystem::file_size(path)) > 4 * kProgressTokens;
  if (loud) std::cerr << "bumblebee: loading JSON lines from " << path << " ..." << std::endl;
  std::ifstream in(path, std::ios::binary);
  BB_CHECK(in.good(), "cannot open JSON-lines file '", path, "'");

  // Lines are assembled from fixed-size blocks, so a line past the limit is refused before it is
  // held in memory whole.
  Corpus c;
  std::vector<int32_t> doc_tokens;
  std::vector<uint8_t> doc_mask;
  std::string line;
  std::vector<char> block(size_t{1} << 20);
  int64_t lineno = 1;
  auto finish_line = [&] {
    const std::string where = path + ":" + std::to_string(lineno);
    if (!is_blank(line)) add_jsonl_record(line, where, vocab_size, c, doc_tokens, doc_mask);
    line.clear();
    ++lineno;
  };
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto got = static_cast<size_t>(in.gcount());
    size_t at = 0;
    while (at < got) {
      const char* nl = static_cast<const char*>(std::memchr(block.data() + at, '\n', got - at));
      const size_t end = nl ? static_cast<size_t>(nl - block.data()) : got;
      if (static_cast<int64_t>(line.size() + (end - at)) > max_line_bytes)
        line_too_long(path + ":" + std::to_string(lineno), max_line_bytes);
      line.append(block.data() + at, end - at);
      at = end;
      if (nl) {
        finish_line();
        ++at;
      }
    }
  }
  BB_CHECK(in.eof(), "JSON-lines file '", path, "': read error after line ", lineno - 1);
  if (!line.empty()) finish_line();
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
  BB_CHECK(cfg.path != "none", "data.path = \"none\" has no data to load: batches come from the caller "
           "(Trainer::train_on, the Python API)");
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
  if (fmt == "jsonl") return read_jsonl(cfg.path, cfg.vocab_size, cfg.max_line_bytes);
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
  count_doc_targets();
  start_epoch(0);
}

DataLoader::DataLoader(const DataConfig& cfg, Corpus corpus)
    : cfg_(cfg), corpus_(std::move(corpus)) {
  check_config();
  check_nonempty(corpus_, "(in memory)");
  count_doc_targets();
  start_epoch(0);
}

void DataLoader::count_doc_targets() {
  if (!corpus_.has_rl()) return;
  doc_targets_.assign(static_cast<size_t>(num_documents()), 0);
  const uint8_t* mask = corpus_.loss_mask.empty() ? nullptr : corpus_.loss_mask.data();
  for (int64_t d = 0; d < num_documents(); ++d)
    for (int64_t j = corpus_.offsets[d] + 1; j < corpus_.offsets[d + 1]; ++j)
      doc_targets_[static_cast<size_t>(d)] += mask == nullptr || mask[j] != 0;
}

void DataLoader::check_config() const {
  BB_CHECK(cfg_.tokens_per_micro_batch > 0, "data: tokens_per_micro_batch must be positive, got ",
           cfg_.tokens_per_micro_batch);
  BB_CHECK(cfg_.tokens_per_micro_batch <= INT32_MAX, "data: tokens_per_micro_batch ",
           cfg_.tokens_per_micro_batch, " does not fit the i32 cu_seqlens");
  BB_CHECK(cfg_.vocab_size > 0, "data: vocab_size must be positive, got ", cfg_.vocab_size);
  BB_CHECK(cfg_.packing == "split" || cfg_.packing == "whole", "data.packing must be \"split\" or \"whole\", got \"",
           cfg_.packing, "\"");
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

// A micro-batch under construction: vectors grown piece by piece (push_back), then turned into
// tensors by finish().
struct DataLoader::Builder {
  std::vector<int32_t> tokens, targets, positions, cu{0}, routing;
  std::vector<float> adv, old, ref, sw;
  int64_t num_valid = 0;
};

void DataLoader::append_piece(Builder& b, int64_t doc, int64_t off, int64_t take) const {
  const int32_t* all = corpus_.tokens.data();
  const uint8_t* mask = corpus_.loss_mask.empty() ? nullptr : corpus_.loss_mask.data();
  // RL fields: the value of the predicted token (j + 1), 0 at positions without a target.
  const bool rl = corpus_.has_rl();
  const bool has_old = !corpus_.old_logprobs.empty(), has_ref = !corpus_.ref_logprobs.empty();
  const int64_t per = corpus_.routing_layers * corpus_.routing_topk;  // routing ids per token
  const int64_t begin = corpus_.offsets[doc], len = corpus_.length(doc);
  for (int64_t i = 0; i < take; ++i) {
    const int64_t j = begin + off + i;  // index into the corpus
    b.tokens.push_back(all[j]);
    b.positions.push_back(static_cast<int32_t>(i));
    const bool has_next = off + i + 1 < len;
    const bool trained = has_next && (mask == nullptr || mask[j + 1] != 0);
    b.targets.push_back(trained ? all[j + 1] : -1);
    b.num_valid += trained;
    if (per > 0) b.routing.insert(b.routing.end(), corpus_.routing.begin() + j * per, corpus_.routing.begin() + (j + 1) * per);
    if (rl) {
      b.adv.push_back(trained ? corpus_.advantages[j + 1] : 0.0f);
      if (has_old) b.old.push_back(trained ? corpus_.old_logprobs[j + 1] : 0.0f);
      if (has_ref) b.ref.push_back(trained ? corpus_.ref_logprobs[j + 1] : 0.0f);
      b.sw.push_back(trained ? 1.0f / static_cast<float>(doc_targets_[static_cast<size_t>(doc)]) : 0.0f);
    }
  }
  b.cu.push_back(static_cast<int32_t>(b.tokens.size()));
}

MicroBatch DataLoader::finish(Builder& b) const {
  const auto T = static_cast<int64_t>(b.tokens.size());
  MicroBatch mb;
  const int64_t B = static_cast<int64_t>(b.cu.size()) - 1;
  mb.tokens = Tensor::from_ints(b.tokens, {T}, MemCategory::other);
  mb.targets = Tensor::from_ints(b.targets, {T}, MemCategory::other);
  mb.positions = Tensor::from_ints(b.positions, {T}, MemCategory::other);
  mb.cu_seqlens = Tensor::from_ints(b.cu, {B + 1}, MemCategory::other);
  mb.num_valid = b.num_valid;
  if (corpus_.has_rl()) {
    mb.advantages = Tensor::from_floats(b.adv, {T}, DType::f32, MemCategory::other);
    if (!b.old.empty()) mb.old_logprobs = Tensor::from_floats(b.old, {T}, DType::f32, MemCategory::other);
    if (!b.ref.empty()) mb.ref_logprobs = Tensor::from_floats(b.ref, {T}, DType::f32, MemCategory::other);
    mb.seq_weight = Tensor::from_floats(b.sw, {T}, DType::f32, MemCategory::other);
  }
  if (!b.routing.empty())
    mb.routing = Tensor::from_ints(b.routing, {T, corpus_.routing_layers * corpus_.routing_topk}, MemCategory::other);
  return mb;
}

MicroBatch DataLoader::next() {
  BB_CHECK(cfg_.packing == "split", "DataLoader::next: data.packing = \"", cfg_.packing,
           "\" packs whole steps; call next_step");
  const int64_t T = cfg_.tokens_per_micro_batch;
  Builder b;
  int64_t fill = 0;
  while (fill < T) {
    const int64_t doc = order_[pos_.doc_index];
    const int64_t len = corpus_.length(doc);
    const auto off = static_cast<int64_t>(pos_.token_offset);
    const int64_t take = std::min(len - off, T - fill);
    append_piece(b, doc, off, take);
    fill += take;
    pos_.token_offset += static_cast<uint64_t>(take);
    if (static_cast<int64_t>(pos_.token_offset) == len) {
      pos_.token_offset = 0;
      if (++pos_.doc_index == static_cast<uint64_t>(num_documents())) start_epoch(pos_.epoch + 1);
    }
  }
  return finish(b);
}

std::vector<MicroBatch> DataLoader::next_step(int64_t n) {
  BB_CHECK(n >= 1, "DataLoader::next_step: n must be >= 1, got ", n);
  if (cfg_.packing == "whole") return pack_whole(n);
  std::vector<MicroBatch> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(next());
  return out;
}

namespace {

// Longest-processing-time first: documents (their lengths and costs), costliest first (ties by
// position), each to the bin of least cost that has room for it (ties to the lower index).
// Returns each document's bin, or empty when one does not fit anywhere.
std::vector<int64_t> lpt_assign(const std::vector<int64_t>& len, const std::vector<double>& cost, int64_t n,
                                int64_t capacity) {
  std::vector<size_t> order(len.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<int64_t> fill(static_cast<size_t>(n), 0), bin(len.size(), -1);
  std::vector<double> load(static_cast<size_t>(n), 0.0);
  for (size_t i : order) {
    int64_t best = -1;
    for (int64_t k = 0; k < n; ++k)
      if (fill[k] + len[i] <= capacity && (best < 0 || load[k] < load[best])) best = k;
    if (best < 0) return {};
    fill[best] += len[i];
    load[best] += cost[i];
    bin[i] = best;
  }
  return bin;
}

}  // namespace

std::vector<MicroBatch> DataLoader::pack_all(int64_t n, std::vector<std::vector<int64_t>>* docs_of) const {
  const int64_t T = cfg_.tokens_per_micro_batch, D = num_documents();
  BB_CHECK(D >= n, "the batch has ", D, " documents for ", n,
           " micro-batches (data ranks x train.grad_accum); give at least one document per micro-batch");
  std::vector<int64_t> lens(static_cast<size_t>(D));
  std::vector<double> costs(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) {
    lens[d] = corpus_.length(d);
    BB_CHECK(lens[d] <= T, "the batch's document ", d,
             corpus_.ids.empty() ? std::string() : " (id " + corpus_.ids[static_cast<size_t>(d)] + ")", " has ", lens[d],
             " tokens, more than a micro-batch holds (train.micro_batch_tokens = ", T, ")");
    costs[d] = sequence_cost(lens[d]);
  }
  const std::vector<int64_t> bins = lpt_assign(lens, costs, n, T);
  BB_CHECK(!bins.empty(), "the batch's ", corpus_.num_tokens(), " tokens in ", D, " documents do not fit ", n,
           " micro-batches of ", T, " tokens (train.micro_batch_tokens x data ranks x train.grad_accum); raise "
           "train.micro_batch_tokens or train.grad_accum, or give a smaller batch");
  std::vector<int64_t> docs(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) docs[static_cast<size_t>(d)] = d;
  return build_bins(n, docs, lens, bins, docs_of);
}

double DataLoader::sequence_cost(int64_t len) const {
  return cost_ ? cost_(len) : static_cast<double>(len) + static_cast<double>(len) * static_cast<double>(len) / 4096.0;
}

std::vector<MicroBatch> DataLoader::build_bins(int64_t n, const std::vector<int64_t>& docs,
                                               const std::vector<int64_t>& lens, const std::vector<int64_t>& bins,
                                               std::vector<std::vector<int64_t>>* docs_of) const {
  std::vector<Builder> built(static_cast<size_t>(n));
  if (docs_of) docs_of->assign(static_cast<size_t>(n), {});
  for (size_t i = 0; i < docs.size(); ++i) {
    append_piece(built[static_cast<size_t>(bins[i])], docs[i], 0, lens[i]);
    if (docs_of) (*docs_of)[static_cast<size_t>(bins[i])].push_back(docs[i]);
  }
  std::vector<MicroBatch> out;
  for (Builder& b : built) out.push_back(finish(b));
  return out;
}

std::vector<MicroBatch> DataLoader::pack_whole(int64_t n) {
  const int64_t T = cfg_.tokens_per_micro_batch;
  BB_CHECK(pos_.token_offset == 0, "data.packing = \"whole\": the data position is inside a document (token ",
           pos_.token_offset, "); it was saved with data.packing = \"split\"");
  // The candidates: the next documents in visit order while their tokens fit the step's n
  // micro-batches, walked on a copy of the position (committed only when the step is packed).
  DataPosition p = pos_;
  std::vector<int64_t> order = order_;
  std::vector<int64_t> docs, lens;
  std::vector<DataPosition> after;  // the position after each candidate
  int64_t total = 0;
  while (true) {
    const int64_t doc = order[p.doc_index];
    const int64_t len = corpus_.length(doc);
    BB_CHECK(len <= T, "data.packing = \"whole\": document ", doc,
             corpus_.ids.empty() ? std::string() : " (id " + corpus_.ids[static_cast<size_t>(doc)] + ")", " has ", len,
             " tokens, more than a micro-batch holds (train.micro_batch_tokens = ", T,
             "); raise train.micro_batch_tokens, or use data.packing = \"split\" (which cuts documents)");
    if (total + len > n * T) break;
    docs.push_back(doc);
    lens.push_back(len);
    total += len;
    if (++p.doc_index == static_cast<uint64_t>(num_documents())) {
      p = DataPosition{p.epoch + 1, 0, 0};
      order = epoch_order(p.epoch);
    }
    after.push_back(p);
  }
  // LPT once over the candidates; when the bins cannot take them all, the last ones wait for the
  // next step (the taken documents stay a prefix of the visit order, so the position is exact).
  std::vector<double> costs;
  for (int64_t len : lens) costs.push_back(sequence_cost(len));
  std::vector<int64_t> bins = lpt_assign(lens, costs, n, T);
  while (bins.empty()) {
    docs.pop_back();
    lens.pop_back();
    costs.pop_back();
    after.pop_back();
    bins = lpt_assign(lens, costs, n, T);
  }
  BB_CHECK(!docs.empty(), "data.packing = \"whole\": no document fits a micro-batch");  // (len <= T: unreachable)
  if (after.back().epoch != pos_.epoch) order_ = epoch_order(after.back().epoch);
  pos_ = after.back();
  return build_bins(n, docs, lens, bins, nullptr);
}

}  // namespace bb

// Data pipeline: byte tokenizer, demo corpus, flat/JSONL sources, THD packing, resume.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>
#include <set>
#include <unordered_map>

#include "common/testing.h"
#include "core/rng.h"
#include "runtime/context_shard.h"
#include "runtime/data.h"
#include "runtime/demo_corpus.h"
#include "runtime/tokenizer.h"

namespace bb {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("bb_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// Little-endian by construction, whatever the host byte order.
void write_u32(const std::string& path, const std::vector<uint32_t>& tokens) {
  std::vector<uint8_t> bytes;
  for (uint32_t t : tokens)
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<uint8_t>(t >> (8 * b)));
  write_bytes(path, bytes);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// Random documents: lengths in [1, max_len], tokens in [0, vocab), about a third with a mask.
std::vector<Document> random_docs(int n, int max_len, uint64_t seed, int64_t vocab = 264) {
  std::vector<Document> docs(n);
  uint64_t c = 0;
  auto draw = [&](int64_t k) {
    return static_cast<int64_t>(philox4x32_10(seed, c++).v[0] % static_cast<uint64_t>(k));
  };
  for (auto& d : docs) {
    const int64_t len = 1 + draw(max_len);
    for (int64_t i = 0; i < len; ++i) d.tokens.push_back(static_cast<int32_t>(draw(vocab)));
    if (draw(3) == 0)
      for (int64_t i = 0; i < len; ++i) d.loss_mask.push_back(draw(4) == 0 ? 0 : 1);
  }
  return docs;
}

DataConfig mem_config(int64_t tokens, uint64_t seed = 5, bool shuffle = true) {
  DataConfig cfg;
  cfg.tokens_per_micro_batch = tokens;
  cfg.seed = seed;
  cfg.shuffle = shuffle;
  return cfg;
}

DataLoader mem_loader(const std::vector<Document>& docs, const DataConfig& cfg) {
  return DataLoader(cfg, corpus_from_documents(docs, cfg.vocab_size));
}

struct Flat {  // a micro-batch as plain vectors, comparable with ==
  std::vector<int32_t> tokens, targets, positions, cu;
  int64_t num_valid;
  bool operator==(const Flat&) const = default;
};
Flat flat(const MicroBatch& mb) {
  return {mb.tokens.to_ints(), mb.targets.to_ints(), mb.positions.to_ints(),
          mb.cu_seqlens.to_ints(), mb.num_valid};
}

// ---- tokenizer ---------------------------------------------------------------------------------

TEST(Tokenizer, ByteRoundTrip) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto ids = byte_tokenize(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(byte_detokenize(ids), all);

  const std::string utf8 = "h\xc3\xa9llo";  // "héllo": é is two bytes
  EXPECT_EQ(byte_tokenize(utf8), (std::vector<int32_t>{104, 0xc3, 0xa9, 108, 108, 111}));
  EXPECT_EQ(byte_detokenize(byte_tokenize(utf8)), utf8);
  EXPECT_TRUE(byte_tokenize("").empty());
}

TEST(Tokenizer, SpecialIds) {
  EXPECT_EQ(kEosId, 256);
  EXPECT_EQ(kPadId, 257);
  EXPECT_EQ(kByteVocabSize % 8, 0);
  EXPECT_GT(kByteVocabSize, kPadId);
  EXPECT_EQ(byte_detokenize({104, 105, kEosId, kPadId, 260}), "hi<|eos|><|pad|><|id:260|>");
}

// ---- demo corpus -------------------------------------------------------------------------------

uint64_t fnv1a(const std::vector<Document>& docs) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& d : docs)
    for (int32_t t : d.tokens) {
      h ^= static_cast<uint64_t>(t);
      h *= 1099511628211ull;
    }
  return h;
}

TEST(DemoCorpus, DeterministicAndSeeded) {
  const auto a = make_demo_corpus(30, 1234), b = make_demo_corpus(30, 1234);
  EXPECT_EQ(fnv1a(a), fnv1a(b));
  // Pinned bytes: the corpus must be the same on every machine and across refactors (losses
  // reported on it are compared over time). Change these only together with the grammar.
  EXPECT_EQ(demo_document_text(0, 1234).substr(0, 36), "The story of Rosa and the slow boat.");
  EXPECT_EQ(fnv1a(a), 2765080356172208092ull) << "pinned corpus hash changed";
  // Document i depends only on (seed, i): a smaller corpus is a prefix of a bigger one.
  const auto small = make_demo_corpus(5, 1234);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(small[i].tokens, a[i].tokens);
  // Another seed gives other documents.
  const auto c = make_demo_corpus(30, 1235);
  int same = 0;
  for (int i = 0; i < 30; ++i) same += c[i].tokens == a[i].tokens;
  EXPECT_EQ(same, 0);
  for (const auto& d : a) {
    ASSERT_FALSE(d.tokens.empty());
    EXPECT_EQ(d.tokens.back(), kEosId);
    EXPECT_TRUE(d.loss_mask.empty());
  }
}

TEST(DemoCorpus, VariedAndConsistent) {
  const int n = 200;
  std::set<std::string> texts;
  size_t min_len = SIZE_MAX, max_len = 0;
  int sums = 0, lists = 0, counts = 0, days = 0, arithmetic = 0;
  const std::regex arith(R"((\d+) ([-+*]) (\d+) = (\d+)\.)");
  const std::regex bad_a(R"(\b[Aa] [aeiou])"), bad_an(R"(\b[Aa]n [^aeiou])");
  for (int i = 0; i < n; ++i) {
    const std::string text = demo_document_text(i, 99);
    texts.insert(text);
    min_len = std::min(min_len, text.size());
    max_len = std::max(max_len, text.size());
    for (char ch : text) ASSERT_TRUE(ch == '\n' || (ch >= 32 && ch < 127)) << int(ch);
    sums += text.find("practices sums:") != std::string::npos;
    lists += text.find("needs to buy:") != std::string::npos;
    counts += text.find("Count: ") != std::string::npos;
    days += text.find("The days go ") != std::string::npos;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), arith);
         it != std::sregex_iterator(); ++it) {
      const int64_t x = std::stoll((*it)[1]), y = std::stoll((*it)[3]), z = std::stoll((*it)[4]);
      const char op = (*it)[2].str()[0];
      EXPECT_EQ(z, op == '+' ? x + y : op == '-' ? x - y : x * y) << it->str();
      ++arithmetic;
    }
    EXPECT_FALSE(std::regex_search(text, bad_a)) << "'a' before a vowel in document " << i;
    EXPECT_FALSE(std::regex_search(text, bad_an)) << "'an' before a consonant in document " << i;
  }
  EXPECT_EQ(texts.size(), static_cast<size_t>(n));
  EXPECT_GE(min_len, 200u);
  EXPECT_LE(max_len, 3000u);
  EXPECT_LT(min_len, 500u);  // lengths really vary
  EXPECT_GT(max_len, 2500u);
  EXPECT_GT(sums, n / 4);
  EXPECT_GT(lists, n / 8);
  EXPECT_GT(counts, n / 8);
  EXPECT_GT(days, n / 8);
  EXPECT_GT(arithmetic, 500);
}

// A byte model with 3 bytes of context (interpolated counts) fit on some documents must predict
// held-out documents far better than uniform: the structure a small transformer should learn.
TEST(DemoCorpus, LearnableByAByteTrigramModel) {
  const auto docs = make_demo_corpus(160, 7);
  constexpr int kOrder = 3;
  // counts[k][context of k previous tokens] -> (total, next token -> count)
  struct Counts {
    int64_t total = 0;
    std::unordered_map<int32_t, int64_t> next;
  };
  std::vector<std::unordered_map<uint64_t, Counts>> counts(kOrder + 1);
  auto context = [](const std::vector<int32_t>& t, size_t i, int k) {
    uint64_t key = static_cast<uint64_t>(k);
    for (int q = 1; q <= k; ++q)
      key = key * 1000 + (i >= static_cast<size_t>(q) ? t[i - q] + 1 : 0);
    return key;
  };
  for (int d = 0; d < 120; ++d) {
    const auto& t = docs[d].tokens;
    for (size_t i = 0; i < t.size(); ++i)
      for (int k = 0; k <= kOrder; ++k) {
        Counts& c = counts[k][context(t, i, k)];
        ++c.total;
        ++c.next[t[i]];
      }
  }
  double nll = 0;
  int64_t n = 0;
  for (int d = 120; d < 160; ++d) {
    const auto& t = docs[d].tokens;
    for (size_t i = 0; i < t.size(); ++i) {
      double p = 1.0 / kByteVocabSize;
      for (int k = 0; k <= kOrder; ++k) {  // Witten-Bell style interpolation, low to high order
        auto it = counts[k].find(context(t, i, k));
        if (it == counts[k].end()) continue;
        const Counts& c = it->second;
        const double lambda = double(c.total) / double(c.total + c.next.size());
        auto hit = c.next.find(t[i]);
        p = lambda * (hit == c.next.end() ? 0.0 : double(hit->second) / c.total) + (1 - lambda) * p;
      }
      nll -= std::log(p);
      ++n;
    }
  }
  const double nats = nll / n;
  EXPECT_LT(nats, 1.2) << "held-out nats per byte of a trigram model";
  std::cout << "trigram model: " << nats << " nats per byte on held-out documents\n";
  EXPECT_GT(nats, 0.1) << "suspiciously predictable: is the generator still random?";
}

// ---- packing -----------------------------------------------------------------------------------

// Every token of several epochs, with its expected target and sequence start, in visiting order.
struct Expected {
  std::vector<int32_t> tokens, targets;
  std::vector<bool> doc_start;
};
Expected expected_stream(const std::vector<Document>& docs, const DataLoader& loader, int epochs) {
  Expected e;
  for (int ep = 0; ep < epochs; ++ep) {
    for (int64_t d : loader.epoch_order(ep)) {
      const Document& doc = docs[d];
      const size_t len = doc.tokens.size();
      for (size_t j = 0; j < len; ++j) {
        e.tokens.push_back(doc.tokens[j]);
        const bool masked = !doc.loss_mask.empty() && j + 1 < len && doc.loss_mask[j + 1] == 0;
        e.targets.push_back(j + 1 < len && !masked ? doc.tokens[j + 1] : -1);
        e.doc_start.push_back(j == 0);
      }
    }
  }
  return e;
}

TEST(Packing, InvariantsOverManyBatches) {
  const auto docs = random_docs(23, 60, 11);
  for (int64_t T : {1, 7, 37, 256}) {
    const DataConfig cfg = mem_config(T, 3);
    DataLoader loader = mem_loader(docs, cfg);
    // The epoch order is a permutation: every document exactly once.
    auto order = loader.epoch_order(0);
    std::sort(order.begin(), order.end());
    std::vector<int64_t> iota(docs.size());
    std::iota(iota.begin(), iota.end(), 0);
    ASSERT_EQ(order, iota);

    const Expected e = expected_stream(docs, loader, 4);
    const int64_t total = static_cast<int64_t>(e.tokens.size());
    const int64_t num_batches = total / T;
    ASSERT_GT(num_batches * T, loader.num_tokens() * 2) << "the test must cross epoch boundaries";
    for (int64_t b = 0; b < num_batches; ++b) {
      const MicroBatch mb = loader.next();
      ASSERT_EQ(mb.tokens.shape(), (Shape{T}));
      ASSERT_EQ(mb.targets.shape(), (Shape{T}));
      ASSERT_EQ(mb.positions.shape(), (Shape{T}));
      EXPECT_EQ(mb.tokens.dtype(), DType::i32);
      EXPECT_EQ(mb.tokens.category(), MemCategory::other);
      EXPECT_TRUE(mb.cu_seqlens.device().is_cpu());
      const Flat f = flat(mb);
      // cu_seqlens: 0 first, T last, strictly increasing (sequences of length 1 allowed).
      ASSERT_GE(f.cu.size(), 2u);
      EXPECT_EQ(f.cu.front(), 0);
      EXPECT_EQ(f.cu.back(), T);
      for (size_t s = 1; s < f.cu.size(); ++s) ASSERT_LT(f.cu[s - 1], f.cu[s]);
      int64_t valid = 0;
      size_t seq = 0;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t g = b * T + i;  // index into the expected stream
        while (f.cu[seq + 1] <= i) ++seq;
        const bool seq_start = f.cu[seq] == i;
        // Inputs concatenated over the batches are the documents in epoch order.
        ASSERT_EQ(f.tokens[i], e.tokens[g]) << "batch " << b << " token " << i;
        // The next real token, or -1 at document ends and masked predictions.
        ASSERT_EQ(f.targets[i], e.targets[g]) << "batch " << b << " token " << i;
        // A sequence starts exactly at a document start or at the batch start (split rest).
        ASSERT_EQ(seq_start, e.doc_start[g] || i == 0) << "batch " << b << " token " << i;
        ASSERT_EQ(f.positions[i], i - f.cu[seq]);
        valid += f.targets[i] >= 0;
      }
      EXPECT_EQ(f.num_valid, valid);
    }
  }
}

TEST(Packing, LongDocumentSplitAcrossMicroBatches) {
  Document doc;
  for (int i = 0; i < 100; ++i) doc.tokens.push_back((7 * i + 3) % 256);
  DataLoader loader = mem_loader({doc}, mem_config(32, 1, false));
  EXPECT_EQ(loader.num_documents(), 1);
  EXPECT_EQ(loader.num_tokens(), 100);
  for (int b = 0; b < 3; ++b) {
    const Flat f = flat(loader.next());
    EXPECT_EQ(f.cu, (std::vector<int32_t>{0, 32}));
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(f.tokens[i], doc.tokens[32 * b + i]);
      EXPECT_EQ(f.positions[i], i) << "positions restart for the rest of a split document";
      // The last target of a piece is the document's next token: it is known.
      EXPECT_EQ(f.targets[i], doc.tokens[32 * b + i + 1]);
    }
    EXPECT_EQ(f.num_valid, 32);
    EXPECT_EQ(loader.position().token_offset, static_cast<uint64_t>(32 * (b + 1)));
  }
  // Tokens 96..99 end the document; the next epoch starts it again in the same micro-batch.
  const Flat f = flat(loader.next());
  EXPECT_EQ(f.cu, (std::vector<int32_t>{0, 4, 32}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f.tokens[i], doc.tokens[96 + i]);
  EXPECT_EQ(f.targets[3], -1);
  for (int i = 4; i < 32; ++i) {
    EXPECT_EQ(f.tokens[i], doc.tokens[i - 4]);
    EXPECT_EQ(f.positions[i], i - 4);
  }
  EXPECT_EQ(f.num_valid, 31);
  EXPECT_EQ(loader.position(), (DataPosition{1, 0, 28}));
}

TEST(Packing, LossMaskRespected) {
  Document a{{10, 11, 12, 13, 14}, {0, 0, 1, 1, 0}}, b{{20, 21}, {}};
  DataLoader loader = mem_loader({a, b}, mem_config(7, 1, false));
  const Flat f = flat(loader.next());
  EXPECT_EQ(f.tokens, (std::vector<int32_t>{10, 11, 12, 13, 14, 20, 21}));
  // Predicting 11 (mask 0) and 14 (mask 0) is not trained; mask[0] is never used.
  EXPECT_EQ(f.targets, (std::vector<int32_t>{-1, 12, 13, -1, -1, 21, -1}));
  EXPECT_EQ(f.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(f.cu, (std::vector<int32_t>{0, 5, 7}));
  EXPECT_EQ(f.num_valid, 3);
  // Split in the middle of a masked document: the mask of the next micro-batch's first token
  // still decides the last target of this one.
  DataLoader split = mem_loader({a}, mem_config(3, 1, false));
  EXPECT_EQ(flat(split.next()).targets, (std::vector<int32_t>{-1, 12, 13}));
  EXPECT_EQ(flat(split.next()).targets, (std::vector<int32_t>{-1, -1, -1}));
}

TEST(Packing, ShuffleDeterministicBySeedAndNewEachEpoch) {
  const auto docs = random_docs(50, 20, 4);
  DataLoader a = mem_loader(docs, mem_config(64, 10)), b = mem_loader(docs, mem_config(64, 10));
  DataLoader c = mem_loader(docs, mem_config(64, 11));
  EXPECT_EQ(a.epoch_order(0), b.epoch_order(0));
  EXPECT_EQ(a.epoch_order(0), epoch_order(50, 10, 0, true));
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  EXPECT_NE(a.epoch_order(1), a.epoch_order(2));
  EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
  std::vector<int64_t> iota(50);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_NE(a.epoch_order(0), iota);
  for (uint64_t ep = 0; ep < 5; ++ep) {
    auto o = a.epoch_order(ep);
    std::sort(o.begin(), o.end());
    EXPECT_EQ(o, iota);
  }
  bool differs = false;
  for (int i = 0; i < 20; ++i) {
    const Flat fa = flat(a.next()), fb = flat(b.next()), fc = flat(c.next());
    EXPECT_EQ(fa, fb);
    differs |= !(fa == fc);
  }
  EXPECT_TRUE(differs);
  DataLoader plain = mem_loader(docs, mem_config(64, 10, false));
  EXPECT_EQ(plain.epoch_order(0), iota);
  EXPECT_EQ(plain.epoch_order(3), iota);
}

TEST(Packing, RestoreGivesTheSameMicroBatches) {
  const auto docs = random_docs(9, 40, 21);
  const DataConfig cfg = mem_config(16, 8);
  DataLoader ref = mem_loader(docs, cfg);
  std::vector<DataPosition> before;
  std::vector<Flat> batches;
  for (int i = 0; i < 60; ++i) {
    before.push_back(ref.position());
    batches.push_back(flat(ref.next()));
  }
  constexpr int kAhead = 6;
  bool saw_split = false, saw_epoch_cross = false;
  for (size_t k = 0; k + kAhead < batches.size(); ++k) {
    saw_split |= before[k].token_offset > 0;
    saw_epoch_cross |= before[k + kAhead].epoch != before[k].epoch;
    // Through JSON, as in a checkpoint.
    const nlohmann::json j = before[k];
    DataLoader resumed = mem_loader(docs, cfg);
    resumed.restore(j.get<DataPosition>());
    EXPECT_EQ(resumed.position(), before[k]);
    for (int a = 0; a < kAhead; ++a)
      ASSERT_EQ(flat(resumed.next()), batches[k + a]) << "resumed at " << j.dump() << ", +" << a;
  }
  EXPECT_TRUE(saw_split) << "the test must resume inside a split document";
  EXPECT_TRUE(saw_epoch_cross) << "the test must resume across an epoch boundary";
  EXPECT_GE(before.back().epoch, 2u);
}

TEST(Packing, PositionJsonAndRestoreErrors) {
  const DataPosition p{3, 5, 7};
  const nlohmann::json j = p;
  EXPECT_EQ(j.dump(), R"({"doc_index":5,"epoch":3,"token_offset":7})");
  EXPECT_EQ(j.get<DataPosition>(), p);
  test::expect_error_contains(
      [] { nlohmann::json::parse(R"({"epoch":1,"doc_index":2})").get<DataPosition>(); },
      "missing key 'token_offset'");
  test::expect_error_contains(
      [] {
        nlohmann::json::parse(R"({"epoch":-1,"doc_index":2,"token_offset":0})").get<DataPosition>();
      },
      "key 'epoch' must be a non-negative integer");

  Document a{{1, 2, 3}, {}}, b{{4, 5}, {}};
  DataLoader loader = mem_loader({a, b}, mem_config(4, 1, false));
  test::expect_error_contains(
      [&] {
        loader.restore({0, 2, 0});
      },
      "doc_index 2 is out of range for a dataset of 2 documents");
  test::expect_error_contains(
      [&] {
        loader.restore({0, 1, 2});
      },
      "token_offset 2 is out of range for document 1 of 2 tokens");
  EXPECT_EQ(loader.position(), DataPosition{}) << "a failed restore must not move the loader";
  loader.restore({4, 1, 1});
  EXPECT_EQ(flat(loader.next()).tokens, (std::vector<int32_t>{5, 1, 2, 3}));
}

// ---- sources -----------------------------------------------------------------------------------

TEST(Sources, FlatTokenFile) {
  TempDir dir;
  const std::string path = dir.file("train.bin");
  write_u32(path, {5, 6, 256, 7, 256, 8, 9});
  const Corpus c = read_flat_tokens(path, 264, 256);
  ASSERT_EQ(c.num_documents(), 3);
  EXPECT_EQ(c.document(0).tokens, (std::vector<int32_t>{5, 6, 256}));  // EOS ends its document
  EXPECT_EQ(c.document(1).tokens, (std::vector<int32_t>{7, 256}));
  EXPECT_EQ(c.document(2).tokens, (std::vector<int32_t>{8, 9}));  // no EOS at the very end
  EXPECT_TRUE(c.loss_mask.empty());

  DataConfig cfg = mem_config(7, 1, false);
  cfg.path = path;
  DataLoader loader(cfg);
  EXPECT_EQ(loader.num_documents(), 3);
  EXPECT_EQ(loader.num_tokens(), 7);
  const Flat f = flat(loader.next());
  EXPECT_EQ(f.tokens, (std::vector<int32_t>{5, 6, 256, 7, 256, 8, 9}));
  EXPECT_EQ(f.targets, (std::vector<int32_t>{6, 256, -1, 256, -1, 9, -1}));
  EXPECT_EQ(f.cu, (std::vector<int32_t>{0, 3, 5, 7}));

  // Little-endian on disk: bytes 03 02 01 00 are token 0x010203.
  const std::string le = dir.file("le.u32");
  write_bytes(le, {0x03, 0x02, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00});
  const Corpus big = read_flat_tokens(le, 100000, 0);
  EXPECT_EQ(big.tokens, (std::vector<int32_t>{0x010203, 0}));
  EXPECT_EQ(big.num_documents(), 1);
}

TEST(Sources, FlatTokenFileErrors) {
  TempDir dir;
  const std::string odd = dir.file("odd.bin");
  write_bytes(odd, std::vector<uint8_t>(10, 1));
  test::expect_error_contains([&] { read_flat_tokens(odd, 264, 256); },
                              "has 10 bytes, not a multiple of 4");
  const std::string big = dir.file("big.bin");
  write_u32(big, {1, 300, 2});
  test::expect_error_contains([&] { read_flat_tokens(big, 264, 256); },
                              "token 300 at index 1 is >= vocab_size 264");
  const std::string empty = dir.file("empty.bin");
  write_bytes(empty, {});
  test::expect_error_contains([&] { read_flat_tokens(empty, 264, 256); }, "contains no tokens");
  test::expect_error_contains([&] { read_flat_tokens(big, 264, 264); },
                              "eos_id 264 is outside [0, vocab_size = 264)");
  const std::string missing = dir.file("missing.bin");
  test::expect_error_contains([&] { read_flat_tokens(missing, 264, 256); },
                              "data file '" + missing + "' not found");
  DataConfig cfg;
  cfg.path = missing;
  test::expect_error_contains([&] { DataLoader loader(cfg); }, "path = \"demo\"");
}

TEST(Sources, JsonLines) {
  TempDir dir;
  const std::string path = dir.file("sft.jsonl");
  write_text(path,
             "{\"tokens\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}\n"
             "\n"
             "   \r\n"
             "{\"text\": \"hi\"}\n"
             "{\"tokens\": [4, 5]}\n"
             "{\"tokens\": [6, 7], \"loss_mask\": [true, false]}");  // no final newline
  const Corpus c = read_jsonl(path, 264);
  ASSERT_EQ(c.num_documents(), 4);
  EXPECT_EQ(c.document(0).tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(c.document(0).loss_mask, (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ(c.document(1).tokens, (std::vector<int32_t>{'h', 'i', kEosId}));
  EXPECT_EQ(c.document(1).loss_mask, (std::vector<uint8_t>{1, 1, 1}));  // unmasked = all 1
  EXPECT_EQ(c.document(2).tokens, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(c.document(3).loss_mask, (std::vector<uint8_t>{1, 0}));

  DataConfig cfg = mem_config(9, 1, false);
  cfg.path = path;
  DataLoader loader(cfg);
  const Flat f = flat(loader.next());
  EXPECT_EQ(f.tokens, (std::vector<int32_t>{1, 2, 3, 'h', 'i', kEosId, 4, 5, 6}));
  EXPECT_EQ(f.targets, (std::vector<int32_t>{2, 3, -1, 'i', kEosId, -1, 5, -1, -1}));
  EXPECT_EQ(f.num_valid, 5);
}

TEST(Sources, JsonLinesErrorsNameFileLineAndKey) {
  TempDir dir;
  int n = 0;
  // The bad record is on line 2 of each file, after a good one.
  auto check = [&](const std::string& bad, const std::string& needle) {
    const std::string path = dir.file("bad" + std::to_string(n++) + ".jsonl");
    write_text(path, "{\"tokens\": [1, 2]}\n" + bad + "\n");
    test::expect_error_contains([&] { read_jsonl(path, 264); }, path + ":2: " + needle);
  };
  check(R"({"tokens": [1], "foo": 1})", "unknown key 'foo'");
  check(R"({"tokens": "abc"})", "key 'tokens': expected an array of integers, got string");
  check(R"({"tokens": [1, 2.5]})", "key 'tokens': element 1 is 2.5, not an integer");
  check(R"({"tokens": [1, 264]})", "key 'tokens': element 1 is 264, outside [0, 263]");
  check(R"({"tokens": [1, -1]})", "key 'tokens': element 1 is -1, outside [0, 263]");
  check(R"({"tokens": []})", "key 'tokens': empty array");
  check(R"({"tokens": [1, 2], "loss_mask": [1]})",
        "key 'loss_mask': length 1 does not match key 'tokens' length 2");
  check(R"({"tokens": [1, 2], "loss_mask": [1, 2]})", "key 'loss_mask': element 1 is 2");
  check(R"({"text": 5})", "key 'text': expected a string, got number");
  check(R"({"text": "x", "loss_mask": [1]})", "key 'loss_mask' needs key 'tokens'");
  check(R"({"tokens": [1], "text": "x"})", "record has both key 'tokens' and key 'text'");
  check(R"({"advantages": [1]})", "record has neither key 'tokens' nor key 'text'");
  check(R"({"tokens": [1, 2})", "invalid JSON");
  check(R"([1, 2])", "expected a JSON object per line, got array");

  check(std::string("{\"tokens\": [1, 2]}") + '\0' + "{\"tokens\": [3, 4]}", "a NUL byte at byte 19");

  // Nothing to train on: tokens, but no token is anyone's target (one-token documents, masks of
  // 0 after the first token). Refused at load instead of skipping every step.
  const std::string single = dir.file("single.jsonl");
  write_text(single, "{\"tokens\": [5]}\n{\"tokens\": [6]}\n");
  test::expect_error_contains([&] { read_jsonl(single, 264); }, "has nothing to train on");
  const std::string masked = dir.file("masked.jsonl");
  write_text(masked, "{\"tokens\": [5, 6, 7], \"loss_mask\": [1, 0, 0]}\n{\"tokens\": [8]}\n");
  test::expect_error_contains([&] { read_jsonl(masked, 264); }, "has nothing to train on");
  // One target anywhere is enough.
  write_text(masked, "{\"tokens\": [5, 6, 7], \"loss_mask\": [1, 0, 1]}\n{\"tokens\": [8]}\n");
  EXPECT_EQ(read_jsonl(masked, 264).num_documents(), 2);

  const std::string blank = dir.file("blank.jsonl");
  write_text(blank, "\n  \n");
  test::expect_error_contains([&] { read_jsonl(blank, 264); }, "contains no tokens");
  test::expect_error_contains([&] { read_jsonl(dir.file("none.jsonl"), 264); }, "not found");
  const std::string text = dir.file("text.jsonl");
  write_text(text, "{\"text\": \"x\"}\n");
  test::expect_error_contains([&] { read_jsonl(text, 200); }, "needs vocab_size > 256");
}

// ---- whole-document packing --------------------------------------------------------------------

// Whole packing: documents never split, each micro-batch within the budget, documents taken in
// visit order exactly once per epoch, the step balanced by cost (LPT), resumable.
TEST(WholePacking, DocumentsStayWholeAndInOrder) {
  const auto docs = random_docs(60, 70, 17);
  DataConfig cfg = mem_config(100, 9, true);
  cfg.packing = "whole";
  DataLoader loader = mem_loader(docs, cfg);
  std::vector<int64_t> seen;  // documents in the order their steps took them
  std::vector<int64_t> visit = loader.epoch_order(0);  // epochs 0 and 1 (a step may wrap)
  for (int64_t d : loader.epoch_order(1)) visit.push_back(d);
  std::vector<bool> used(visit.size(), false);
  int64_t steps = 0;
  while (loader.position().epoch == 0) {
    const DataPosition before = loader.position();
    const std::vector<MicroBatch> mbs = loader.next_step(3);
    ASSERT_EQ(mbs.size(), 3u);
    std::vector<int64_t> step_docs;
    for (const MicroBatch& mb : mbs) {
      const auto tok = mb.tokens.to_ints(), pos = mb.positions.to_ints(), cu = mb.cu_seqlens.to_ints();
      EXPECT_LE(static_cast<int64_t>(tok.size()), 100);
      EXPECT_GT(tok.size(), 0u) << "an empty micro-batch";
      for (size_t b = 0; b + 1 < cu.size(); ++b) {
        // A whole document: which one is found by its tokens among this step's candidates.
        std::vector<int32_t> seq(tok.begin() + cu[b], tok.begin() + cu[b + 1]);
        for (int32_t i = cu[b]; i < cu[b + 1]; ++i) EXPECT_EQ(pos[i], i - cu[b]);
        int64_t found = -1;
        for (int64_t k = static_cast<int64_t>(before.doc_index); k < static_cast<int64_t>(visit.size()) && found < 0; ++k)
          if (!used[k] && docs[static_cast<size_t>(visit[k])].tokens == seq) found = k;
        ASSERT_GE(found, 0) << "a sequence that is no whole document";
        used[found] = true;
        step_docs.push_back(found);
      }
    }
    std::sort(step_docs.begin(), step_docs.end());
    // The step took the next documents of the visit order, each once.
    for (size_t i = 0; i < step_docs.size(); ++i)
      EXPECT_EQ(step_docs[i], static_cast<int64_t>(before.doc_index + i));
    seen.insert(seen.end(), step_docs.begin(), step_docs.end());
    ++steps;
  }
  EXPECT_GE(static_cast<int64_t>(seen.size()), 60);  // epoch 0 whole, and the last step's wrap
  EXPECT_GT(steps, 3);
}

TEST(WholePacking, BalancedByCostAndResumable) {
  // Lengths 90, 10, 10, 10, 80, 20, 30, 60 (file order), two micro-batches of 160, cost = len.
  // LPT, costliest first: 90 -> mb0; 80 -> mb1; 60 -> mb1 (80 < 90: 140); 30 -> mb0 (120);
  // 20 -> mb0 (140); the 10s: a tie -> mb0 (150), mb1 (150), a tie -> mb0 (160, full).
  std::vector<Document> docs;
  for (int len : {90, 10, 10, 10, 80, 20, 30, 60}) {
    Document d;
    for (int i = 0; i < len; ++i) d.tokens.push_back(len);  // every token names its document's length
    docs.push_back(d);
  }
  DataConfig cfg = mem_config(160, 1, false);
  cfg.packing = "whole";
  DataLoader loader = mem_loader(docs, cfg);
  loader.set_sequence_cost([](int64_t len) { return static_cast<double>(len); });
  const std::vector<MicroBatch> mbs = loader.next_step(2);
  auto lens_of = [](const MicroBatch& mb) {
    std::vector<int32_t> out;
    const auto tok = mb.tokens.to_ints(), cu = mb.cu_seqlens.to_ints();
    for (size_t b = 0; b + 1 < cu.size(); ++b) out.push_back(tok[cu[b]]);
    return out;
  };
  // Within a micro-batch the documents keep their visit order.
  EXPECT_EQ(lens_of(mbs[0]), (std::vector<int32_t>{90, 10, 10, 20, 30}));
  EXPECT_EQ(lens_of(mbs[1]), (std::vector<int32_t>{10, 80, 60}));
  EXPECT_EQ(mbs[0].tokens.numel(), 160);
  EXPECT_EQ(mbs[1].tokens.numel(), 150);
  // The next step starts at the first document again (epoch 1); a restore repeats it exactly.
  const DataPosition p = loader.position();
  EXPECT_EQ(p.token_offset, 0u);
  const std::vector<MicroBatch> a = loader.next_step(2);
  DataLoader again = mem_loader(docs, cfg);
  again.set_sequence_cost([](int64_t len) { return static_cast<double>(len); });
  again.restore(p);
  const std::vector<MicroBatch> b = again.next_step(2);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(flat(a[i]), flat(b[i]));
}

TEST(WholePacking, ErrorsNameTheDocument) {
  std::vector<Document> docs(2);
  docs[0].tokens = {1, 2, 3};
  docs[1].tokens = std::vector<int32_t>(20, 4);
  docs[1].id = "long-one";
  docs[0].id = "short";
  DataConfig cfg = mem_config(16, 1, false);
  cfg.packing = "whole";
  DataLoader loader = mem_loader(docs, cfg);
  test::expect_error_contains([&] { loader.next_step(1); },
                              "document 1 (id long-one) has 20 tokens, more than a micro-batch holds (train.micro_batch_tokens = 16)");
  DataLoader split = mem_loader(docs, mem_config(16, 1, false));
  test::expect_error_contains([&] { DataLoader w = mem_loader(docs, cfg); w.next(); }, "packs whole steps; call next_step");
  split.next();  // ends inside document 1
  DataLoader whole = mem_loader(docs, cfg);
  whole.restore(split.position());
  test::expect_error_contains([&] { whole.next_step(1); }, "it was saved with data.packing = \"split\"");
  cfg.packing = "halves";
  test::expect_error_contains([&] { mem_loader(docs, cfg); }, "data.packing must be \"split\" or \"whole\"");
}

// pack_all: a caller's batch, every document once in n micro-batches, or an error saying why not.
TEST(WholePacking, PackAllTakesEveryDocumentOnce) {
  std::vector<Document> docs;
  for (int len : {5, 9, 3, 7, 6}) docs.push_back(Document{std::vector<int32_t>(static_cast<size_t>(len), len), {}, {}, {}, {}, "", {}, 0, 0});
  DataConfig cfg = mem_config(16, 1, false);
  cfg.packing = "whole";
  const DataLoader loader = mem_loader(docs, cfg);
  const std::vector<MicroBatch> mbs = loader.pack_all(2);
  std::vector<int32_t> seen;
  for (const MicroBatch& mb : mbs) {
    EXPECT_LE(mb.tokens.numel(), 16);
    const auto tok = mb.tokens.to_ints(), cu = mb.cu_seqlens.to_ints();
    for (size_t b = 0; b + 1 < cu.size(); ++b) seen.push_back(cu[b + 1] - cu[b]);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int32_t>{3, 5, 6, 7, 9}));
  EXPECT_EQ(loader.position(), DataPosition{});  // the position does not move
  test::expect_error_contains([&] { loader.pack_all(6); }, "the batch has 5 documents for 6 micro-batches");
  test::expect_error_contains([&] { loader.pack_all(1); }, "the batch's 30 tokens in 5 documents do not fit 1 micro-batches of 16 tokens");
}

// ---- RL rollout records ------------------------------------------------------------------------

TEST(Rollouts, FieldsParsedAndPackedOntoTheirTargets) {
  TempDir dir;
  const std::string path = dir.file("rollouts.jsonl");
  write_text(path,
             "{\"id\": \"a\", \"tokens\": [1, 2, 3, 4], \"loss_mask\": [0, 0, 1, 1], \"advantages\": 0.5,"
             " \"old_logprobs\": [0, 0, -1.5, -2.5], \"ref_logprobs\": [0, 0, -1.25, -2]}\n"
             "{\"id\": 7, \"tokens\": [5, 6, 7], \"advantages\": [9, -1, -2], \"old_logprobs\": [0, -0.5, -0.75],"
             " \"ref_logprobs\": [0, -0.5, -1]}\n");
  const Corpus c = read_jsonl(path, 264);
  ASSERT_EQ(c.num_documents(), 2);
  ASSERT_TRUE(c.has_rl());
  const Document d0 = c.document(0), d1 = c.document(1);
  EXPECT_EQ(d0.id, "a");
  EXPECT_EQ(d1.id, "7");
  EXPECT_EQ(d0.advantages, (std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}));  // one number: every token
  EXPECT_EQ(d1.old_logprobs, (std::vector<float>{0, -0.5f, -0.75f}));
  EXPECT_EQ(d0.ref_logprobs, (std::vector<float>{0, 0, -1.25f, -2}));

  // Packed without shuffling, 4 tokens a micro-batch: document 1 is split over two of them.
  DataConfig cfg = mem_config(4, 1, false);
  cfg.path = path;
  DataLoader loader(cfg);
  const MicroBatch a = loader.next(), b = loader.next();
  // Position t holds the values of the token it predicts (t + 1 of its document).
  EXPECT_EQ(a.targets.to_ints(), (std::vector<int32_t>{-1, 3, 4, -1}));
  EXPECT_EQ(a.advantages.to_floats(), (std::vector<float>{0, 0.5f, 0.5f, 0}));
  EXPECT_EQ(a.old_logprobs.to_floats(), (std::vector<float>{0, -1.5f, -2.5f, 0}));
  EXPECT_EQ(a.ref_logprobs.to_floats(), (std::vector<float>{0, -1.25f, -2, 0}));
  EXPECT_EQ(a.seq_weight.to_floats(), (std::vector<float>{0, 0.5f, 0.5f, 0}));
  // b: tokens 5, 6, 7 of document 1, then document 0 again (the next epoch).
  EXPECT_EQ(b.targets.to_ints(), (std::vector<int32_t>{6, 7, -1, -1}));
  EXPECT_EQ(b.advantages.to_floats(), (std::vector<float>{-1, -2, 0, 0}));
  EXPECT_EQ(b.old_logprobs.to_floats(), (std::vector<float>{-0.5f, -0.75f, 0, 0}));
  EXPECT_EQ(b.seq_weight.to_floats(), (std::vector<float>{0.5f, 0.5f, 0, 0}));

  // A document split across micro-batches: its weights over all pieces still sum to 1.
  DataConfig small = mem_config(3, 1, false);
  small.path = path;
  DataLoader split(small);
  double sum = 0;
  for (int i = 0; i < 7; ++i) {  // 21 tokens = 3 passes over the 7-token corpus
    const MicroBatch mb = split.next();
    for (float w : mb.seq_weight.to_floats()) sum += w;
  }
  EXPECT_NEAR(sum, 6.0, 1e-6);  // 2 documents x 3 epochs
}

TEST(Rollouts, ContextShardsCarryTheFields) {
  std::vector<Document> docs(2);
  docs[0].tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  docs[1].tokens = {9, 10, 11, 12};
  for (Document& d : docs) {
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      d.advantages.push_back(static_cast<float>(d.tokens[i]));
      d.old_logprobs.push_back(-static_cast<float>(d.tokens[i]));
    }
  }
  const DataConfig cfg = mem_config(12, 1, false);
  DataLoader loader(cfg, corpus_from_documents(docs, 264));
  const MicroBatch mb = loader.next();
  double total = 0;
  for (int64_t cp : {2, 3}) {
    double sum = 0;
    for (int64_t r = 0; r < cp; ++r) {
      const MicroBatch s = shard_micro_batch(mb, cp, r);
      const auto tg = s.targets.to_ints();
      const auto adv = s.advantages.to_floats(), old = s.old_logprobs.to_floats(), sw = s.seq_weight.to_floats();
      ASSERT_EQ(adv.size(), tg.size());
      for (size_t i = 0; i < tg.size(); ++i) {
        // The token a position predicts is its target: the fields were built from it.
        EXPECT_EQ(adv[i], tg[i] >= 0 ? static_cast<float>(tg[i]) : 0.0f);
        EXPECT_EQ(old[i], tg[i] >= 0 ? -static_cast<float>(tg[i]) : 0.0f);
        sum += sw[i];
      }
      EXPECT_FALSE(s.ref_logprobs.defined());
    }
    EXPECT_NEAR(sum, 2.0, 1e-6) << "cp " << cp;  // two whole documents over the shards
    total += sum;
  }
  EXPECT_GT(total, 0);
}

// "routing": [tokens][MoE layers][top-k] expert ids, aligned with the TOKENS (the experts that
// processed token j), carried whole through packing and CP shards.
TEST(Rollouts, RoutingAlignedWithTokens) {
  TempDir dir;
  const std::string path = dir.file("routed.jsonl");
  // 2 MoE layers, top-2; expert ids encode (token value, layer, k) so every move is visible.
  auto record = [](const std::vector<int>& toks) {
    std::string r = "{\"tokens\": [";
    for (size_t i = 0; i < toks.size(); ++i) r += (i ? ", " : "") + std::to_string(toks[i]);
    r += "], \"routing\": [";
    for (size_t i = 0; i < toks.size(); ++i) {
      r += i ? ", [" : "[";
      for (int l = 0; l < 2; ++l)
        r += (l ? ", [" : "[") + std::to_string(toks[i] * 10 + l * 2) + ", " + std::to_string(toks[i] * 10 + l * 2 + 1) + "]";
      r += "]";
    }
    return r + "]}";
  };
  write_text(path, record({1, 2, 3, 4, 5}) + "\n" + record({6, 7, 8}) + "\n");
  const Corpus c = read_jsonl(path, 264);
  ASSERT_TRUE(c.has_routing());
  EXPECT_FALSE(c.has_rl());  // routing alone (a logprobs or replay input) needs no advantages
  EXPECT_EQ(c.routing_layers, 2);
  EXPECT_EQ(c.routing_topk, 2);
  EXPECT_EQ(c.document(1).routing, (std::vector<int32_t>{60, 61, 62, 63, 70, 71, 72, 73, 80, 81, 82, 83}));
  DataConfig cfg = mem_config(6, 1, false);
  cfg.path = path;
  DataLoader loader(cfg);
  const MicroBatch mb = loader.next();
  ASSERT_EQ(mb.routing.shape(), (Shape{6, 4}));
  const auto tok = mb.tokens.to_ints();
  const auto r = mb.routing.to_ints();
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(r[t * 4 + i], tok[t] * 10 + i) << "position " << t;
  for (int64_t cp : {2, 3})
    for (int64_t rank = 0; rank < cp; ++rank) {
      const MicroBatch s = shard_micro_batch(mb, cp, rank);
      const auto st = s.tokens.to_ints(), sr = s.routing.to_ints();
      ASSERT_EQ(sr.size(), st.size() * 4);
      for (size_t t = 0; t < st.size(); ++t)
        for (size_t i = 0; i < 4; ++i) EXPECT_EQ(sr[t * 4 + i], st[t] * 10 + static_cast<int>(i));
    }
}

TEST(Rollouts, RoutingErrorsNameTheRecord) {
  TempDir dir;
  int n = 0;
  const std::string good = R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]})";
  auto check = [&](const std::string& bad, const std::string& needle) {
    const std::string path = dir.file("r" + std::to_string(n++) + ".jsonl");
    write_text(path, good + "\n" + bad + "\n");
    test::expect_error_contains([&] { read_jsonl(path, 264); }, path + ":2: " + needle);
  };
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]]]})", "key 'routing': 1 token entries for 2 tokens");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5]]]})", "key 'routing': token 1 has 1 MoE layers, expected 2");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], [6]]]})", "key 'routing': token 1 layer 1 has 1 expert ids, expected 2");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], [6, -7]]]})", "key 'routing': token 1 layer 1: element 1 is -7, outside [0, 32767]");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], [6, 7.5]]]})", "key 'routing': token 1 layer 1: element 1 is 7.5, not an integer");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], 6]]})", "key 'routing': token 1 layer 1 is 6, expected an array of expert ids");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], 4]})", "key 'routing': token 1 is 4, expected an array of MoE layers");
  check(R"({"tokens": [1, 2], "routing": [[[0, 1], [2, 3]], [[4, 5], [6, [7]]]]})",
        "key 'routing': token 1 layer 1: element 1 is an array, not an integer");
  check(R"({"tokens": [1, 2], "routing": {"a": 1}})", "key 'routing': expected an array");
  check(R"({"tokens": [1, 2]})", "key 'routing' is missing here but present");
  check(R"({"text": "hi", "routing": [[[0, 1], [2, 3]]]})", "key 'routing' needs key 'tokens'");
}

TEST(Rollouts, ErrorsNameTheRecordAndTheField) {
  TempDir dir;
  int n = 0;
  const std::string good = R"({"tokens": [1, 2], "advantages": [1, 1], "old_logprobs": [0, -1]})";
  auto check = [&](const std::string& first, const std::string& bad, const std::string& needle) {
    const std::string path = dir.file("bad" + std::to_string(n++) + ".jsonl");
    write_text(path, first + "\n" + bad + "\n");
    test::expect_error_contains([&] { read_jsonl(path, 264); }, path + ":2: " + needle);
  };
  check(good, R"({"tokens": [1, 2], "advantages": [1], "old_logprobs": [0, -1]})",
        "key 'advantages': length 1 does not match key 'tokens' length 2");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1], "old_logprobs": [0, 0.5]})",
        "key 'old_logprobs': element 1 is 0.5; log-probs are finite and <= 0");
  check(good, R"({"tokens": [1, 2], "advantages": [1, "x"], "old_logprobs": [0, -1]})",
        "key 'advantages': element 1 is \"x\", not a number");
  check(good, R"({"tokens": [1, 2], "advantages": [1, [2]], "old_logprobs": [0, -1]})",
        "key 'advantages': element 1 is an array, not a number");
  check(good, R"({"tokens": [1, 2], "advantages": "x", "old_logprobs": [0, -1]})",
        "key 'advantages': expected a number or an array of numbers, got string");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1]})", "key 'old_logprobs' is missing here but present");
  check(good, R"({"tokens": [1, 2]})", "key 'advantages' is missing here but present");
  check(R"({"tokens": [1, 2]})", good, "key 'advantages' is present here but missing");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1], "old_logprobs": [0, -1], "ref_logprobs": [0, -1]})",
        "key 'ref_logprobs' is present here but missing");
  check(good, R"({"tokens": [1, 2], "old_logprobs": [0, -1]})", "keys 'old_logprobs' / 'ref_logprobs' need key 'advantages'");
  check(good, R"({"text": "hi", "advantages": 1})", "RL keys (advantages, old_logprobs, ref_logprobs) need key 'tokens'");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1], "old_logprobs": [0, -1], "id": [1]})",
        "key 'id': expected a string or an integer, got array");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1], "advantages": [1, 1]})", "key 'advantages' appears twice");
  check(good, R"({"tokens": [1, 2], "advantages": [1, 1e999], "old_logprobs": [0, -1]})", "invalid JSON");  // overflow: the reader refuses it
  // In memory: the same rules for documents.
  std::vector<Document> docs(1);
  docs[0].tokens = {1, 2};
  docs[0].advantages = {1, 1};
  docs[0].ref_logprobs = {0, 3};
  test::expect_error_contains([&] { corpus_from_documents(docs, 264); }, "ref_logprobs': element 1 is 3");
  docs[0].ref_logprobs = {0, -1};
  docs.push_back(Document{{3, 4}, {}, {}, {}, {}, ""});
  test::expect_error_contains([&] { corpus_from_documents(docs, 264); }, "key 'advantages' is missing here");
}

TEST(Sources, FormatSelection) {
  DataConfig cfg;
  EXPECT_EQ(resolve_format(cfg), "demo");
  cfg.path = "/data/train.bin";
  EXPECT_EQ(resolve_format(cfg), "flat");
  cfg.path = "/data/train.U32";
  EXPECT_EQ(resolve_format(cfg), "flat");
  cfg.path = "rl.jsonl";
  EXPECT_EQ(resolve_format(cfg), "jsonl");
  cfg.path = "tokens.dat";
  test::expect_error_contains([&] { resolve_format(cfg); },
                              "cannot tell the format of data file 'tokens.dat'");
  cfg.format = "flat";
  EXPECT_EQ(resolve_format(cfg), "flat");
  cfg.format = "csv";
  test::expect_error_contains([&] { resolve_format(cfg); }, "data format 'csv' is not one of");

  // An explicit format overrides the extension.
  TempDir dir;
  const std::string path = dir.file("tokens.dat");
  write_text(path, "{\"text\": \"abc\"}\n");
  DataConfig j = mem_config(4);
  j.path = path;
  j.format = "jsonl";
  EXPECT_EQ(DataLoader(j).num_tokens(), 4);
}

TEST(Sources, DemoLoaderAndConfigErrors) {
  DataConfig cfg = mem_config(512);
  cfg.demo_documents = 40;
  DataLoader loader(cfg);
  const auto docs = make_demo_corpus(40, cfg.seed);
  EXPECT_EQ(loader.num_documents(), 40);
  int64_t total = 0;
  for (const auto& d : docs) total += static_cast<int64_t>(d.tokens.size());
  EXPECT_EQ(loader.num_tokens(), total);
  for (int i = 0; i < 40; ++i) ASSERT_EQ(loader.corpus().document(i).tokens, docs[i].tokens);
  const Flat f = flat(loader.next());
  EXPECT_EQ(static_cast<int64_t>(f.tokens.size()), 512);
  // One target is lost per document end inside the batch (demo documents have no mask).
  int64_t ends = 0;
  for (size_t s = 1; s < f.cu.size(); ++s) ends += f.targets[f.cu[s] - 1] == -1;
  EXPECT_EQ(f.num_valid, 512 - ends);

  DataConfig bad = mem_config(0);
  test::expect_error_contains([&] { DataLoader l(bad); },
                              "tokens_per_micro_batch must be positive, got 0");
  bad = mem_config(-3);
  test::expect_error_contains([&] { mem_loader(docs, bad); }, "must be positive, got -3");
  bad = mem_config(16);
  bad.vocab_size = 256;
  test::expect_error_contains([&] { DataLoader l(bad); }, "needs vocab_size > 256");
  bad = mem_config(16);
  bad.demo_documents = 0;
  test::expect_error_contains([&] { DataLoader l(bad); }, "demo_documents must be positive");
  test::expect_error_contains([&] { DataLoader l(mem_config(16), Corpus{}); },
                              "contains no tokens");
  test::expect_error_contains(
      [&] {
        corpus_from_documents({Document{{1, 300}, {}}}, 264);
      },
      "document 0: token 300 at index 1 is outside [0, 264)");
  test::expect_error_contains([&] { corpus_from_documents({Document{}}, 264); },
                              "document 0 is empty");
  test::expect_error_contains(
      [&] {
        corpus_from_documents({Document{{1, 2}, {1}}}, 264);
      },
      "loss_mask has 1 entries, expected 2");
}

}  // namespace
}  // namespace bb

// fuzz_jsonl.cpp — JSON-lines training data (runtime/data.h: parse_jsonl) on arbitrary text.
//
// Input: the text of a .jsonl file, parsed with the byte tokenizer's vocabulary (264) and a
// 4 KiB line limit (so the limit's own error path is reached too). An accepted corpus must be
// well formed: offsets start at 0, strictly increase (no empty document) and end at the token
// count; every token is in [0, vocab); the loss mask is empty or one 0/1 byte per token.
#include "fuzz_common.h"
#include "runtime/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kVocab = 264, kMaxLine = 4096;
  bb::Corpus c;
  if (!bb::fuzz::accept_or_reject("parse_jsonl", [&] {
        c = bb::parse_jsonl(bb::fuzz::as_text(data, size), kVocab, "fuzz.jsonl", kMaxLine);
      }))
    return 0;
  FUZZ_CHECK(!c.offsets.empty() && c.offsets.front() == 0 && c.offsets.back() == c.num_tokens(),
             "offsets do not span the tokens (%zu offsets, %lld tokens)", c.offsets.size(),
             static_cast<long long>(c.num_tokens()));
  for (size_t d = 1; d < c.offsets.size(); ++d)
    FUZZ_CHECK(c.offsets[d] > c.offsets[d - 1], "document %zu is empty or out of order", d - 1);
  for (int32_t t : c.tokens)
    FUZZ_CHECK(t >= 0 && t < kVocab, "token %d outside [0, %lld)", t,
               static_cast<long long>(kVocab));
  FUZZ_CHECK(c.loss_mask.empty() || c.loss_mask.size() == c.tokens.size(),
             "loss mask of %zu for %zu tokens", c.loss_mask.size(), c.tokens.size());
  for (uint8_t m : c.loss_mask) FUZZ_CHECK(m <= 1, "loss mask value %d", static_cast<int>(m));
  // The line limit is a promise about memory: no line longer than the limit was accepted, so
  // no accepted document can hold more tokens than a line has bytes.
  for (int64_t d = 0; d < c.num_documents(); ++d)
    FUZZ_CHECK(c.length(d) <= kMaxLine,
               "document %lld has %lld tokens, more than a %lld-byte line holds",
               static_cast<long long>(d), static_cast<long long>(c.length(d)),
               static_cast<long long>(kMaxLine));
  return 0;
}

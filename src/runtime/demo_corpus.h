// demo_corpus.h — a built-in, generated corpus so that training needs nothing downloaded.
//
// English-like text from a small grammar (determiners, adjectives, nouns, verbs, names; "a"/"an"
// agreement; a named protagonist per document), arithmetic lines with correct results
// ("12 + 7 = 19."), counting runs, weekday runs and short lists. Documents are 200..~3000 bytes.
// Generation uses only integer Philox draws, so the bytes are the same on every machine, and
// document i depends only on (seed, i): a corpus of n documents is a prefix of one of m > n.
// The structure is learnable: a byte-level model should go from ln(264) = 5.58 nats to well
// below 2 nats per token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/data.h"

namespace bb {

// The text of document `doc_index` (no EOS).
std::string demo_document_text(int64_t doc_index, uint64_t seed);

// num_docs documents: byte tokens of demo_document_text followed by kEosId, no loss mask.
std::vector<Document> make_demo_corpus(int64_t num_docs, uint64_t seed);

}  // namespace bb

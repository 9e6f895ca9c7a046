// tokenizer.h — the byte-level tokenizer of the demo models.
//
// A token is a byte value 0..255; two special ids follow: kEosId ends a document and kPadId is
// reserved (packing never pads). Demo models use kByteVocabSize = 264 so that the vocabulary is
// a multiple of 8 (GEMM-friendly); ids 258..263 are never produced.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bb {

constexpr int32_t kNumByteTokens = 256;
constexpr int32_t kEosId = 256;
constexpr int32_t kPadId = 257;
constexpr int32_t kByteVocabSize = 264;

// One token per byte of `text` (bytes taken as unsigned: UTF-8 becomes several tokens). No EOS.
std::vector<int32_t> byte_tokenize(std::string_view text);

// Inverse of byte_tokenize for ids 0..255. Ids outside the byte range never throw (a sampler may
// produce them): kEosId -> "<|eos|>", kPadId -> "<|pad|>", any other -> "<|id:N|>".
std::string byte_detokenize(const std::vector<int32_t>& ids);

}  // namespace bb

// tokenizer.cpp — byte-level tokenizer (see tokenizer.h).
#include "runtime/tokenizer.h"

namespace bb {

std::vector<int32_t> byte_tokenize(std::string_view text) {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string byte_detokenize(const std::vector<int32_t>& ids) {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < kNumByteTokens) {
      out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (id == kEosId) {
      out += "<|eos|>";
    } else if (id == kPadId) {
      out += "<|pad|>";
    } else {
      out += "<|id:" + std::to_string(id) + "|>";
    }
  }
  return out;
}

}  // namespace bb

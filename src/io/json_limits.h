// json_limits.h — parsing untrusted JSON with bounded nesting.
//
// Every JSON document bumblebee reads (HF config.json, safetensors headers and index files,
// checkpoint state.json, JSONL records) comes from files a user or another program wrote. The
// parser itself is iterative, but a document nested thousands of levels deep is never valid
// input here and costs memory per level, so each reader rejects nesting deeper than
// kMaxJsonDepth with an error naming the file.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"

namespace bb {

// The deepest nesting (objects and arrays) any of bumblebee's JSON inputs needs is 6; the limit
// leaves room for tools that add structure.
inline constexpr int kMaxJsonDepth = 64;

// Parses `text` as one JSON document; `what` names it in errors ("FILE: not valid JSON (...)",
// "FILE: nested deeper than 64 levels"). Throws bb::Error, never a nlohmann exception.
template <class Json = nlohmann::json>
Json parse_json_bounded(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth) {
  bool too_deep = false;
  typename Json::parser_callback_t cb = [&](int depth, typename Json::parse_event_t ev, Json&) {
    if (depth > max_depth && (ev == Json::parse_event_t::object_start || ev == Json::parse_event_t::array_start)) {
      too_deep = true;
      throw std::runtime_error("nesting too deep");
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), cb);
  } catch (const typename Json::exception& e) {
    BB_FAIL(what, ": not valid JSON (", e.what(), ")");
  } catch (const std::runtime_error&) {
    if (too_deep) BB_FAIL(what, ": JSON nested deeper than ", max_depth, " levels (not a file bumblebee reads)");
    throw;
  }
}

}  // namespace bb

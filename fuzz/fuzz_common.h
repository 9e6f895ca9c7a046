// fuzz_common.h — what every libFuzzer harness in fuzz/ shares (docs/reliability.md).
//
// The contract a harness checks: a parser given any bytes either returns a value that
// satisfies its documented invariants or throws bb::Error with a message. bb::Error is the
// expected rejection. Everything else is a finding: another exception type (nlohmann, toml11,
// std::bad_alloc, std::out_of_range: a user would see a raw library message or a crash), a
// broken invariant (fuzz_check), and of course crashes, hangs, leaks and sanitizer reports.
// Findings abort, so libFuzzer saves the input as crash-<sha1> and the run fails.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <typeinfo>

#include "core/error.h"
#include "io/fs.h"

namespace bb::fuzz {

// Aborts with a message when `cond` does not hold: a violated invariant of the code under test.
#define FUZZ_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "\n==FUZZ== invariant violated: %s [%s:%d]\n", #cond, __FILE__, \
                   __LINE__);                                                              \
      std::fprintf(stderr, __VA_ARGS__);                                                   \
      std::fprintf(stderr, "\n");                                                          \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// Runs `body`; bb::Error is an accepted rejection (returns false), any other exception aborts
// with its dynamic type and message. Returns true when `body` completed.
template <class F>
bool accept_or_reject(const char* stage, F&& body) {
  try {
    body();
    return true;
  } catch (const bb::Error& e) {
    // A rejection must say why: an empty message is as useless to a user as a crash.
    FUZZ_CHECK(e.what() != nullptr && e.what()[0] != '\0', "%s: bb::Error without a message",
               stage);
    return false;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\n==FUZZ== %s threw %s, not bb::Error: %s\n", stage, typeid(e).name(),
                 e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "\n==FUZZ== %s threw a non-std exception\n", stage);
    std::abort();
  }
}

// Runs `body`, which must not throw at all (a round trip of a value the code just accepted).
template <class F>
void must_succeed(const char* stage, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\n==FUZZ== %s must not fail but threw %s: %s\n", stage, typeid(e).name(),
                 e.what());
    std::abort();
  }
}

// A private directory for this process's scratch files ($TMPDIR or /tmp), removed at exit.
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      const char* base = std::getenv("TMPDIR");
      path = std::string(base && *base ? base : "/tmp") + "/bb_fuzz_XXXXXX";
      if (::mkdtemp(path.data()) == nullptr) {
        std::perror("mkdtemp");
        std::abort();
      }
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// Writes `bytes` to `path` (plain, not atomic: nothing else reads it concurrently).
inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size())) {
    std::perror(path.c_str());
    std::abort();
  }
  std::fclose(f);
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// The demo-tiny model (configs/models/demo-tiny/config.json): small enough to build once per
// process, and the model the committed state.json seeds were written for.
inline constexpr const char* kDemoTinyConfig = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": null, "decoder_sparse_step": 1, "eos_token_id": 256, "head_dim": 32,
  "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02, "intermediate_size": 256,
  "max_position_embeddings": 8192, "mlp_only_layers": [0], "model_type": "qwen3_moe",
  "moe_intermediate_size": 128, "norm_topk_prob": true, "num_attention_heads": 4,
  "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2,
  "output_router_logits": false, "pad_token_id": 257, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 264
})";

}  // namespace bb::fuzz

// golden.h — reading the Hugging Face reference dumps under tests/golden (made by
// tools/hf_reference.py): the golden root, the packed golden batch, the reference loss curve,
// and the error measures the parity tests use (CPU fp32 in tests/cpu/test_parity.cpp, GPU bf16
// in tests/gpu/test_parity_gpu.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/fs.h"
#include "io/safetensors.h"
#include "runtime/data.h"

namespace bb::test {

// BB_GOLDEN_DIR, else <repo>/tests/golden next to this header, else tests/golden (cwd).
inline std::string golden_root() {
  if (const char* env = std::getenv("BB_GOLDEN_DIR")) return env;
  const std::string here = __FILE__;  // <repo>/tests/common/golden.h
  const size_t at = here.rfind("/common/");
  if (at != std::string::npos && is_directory(here.substr(0, at) + "/golden"))
    return here.substr(0, at) + "/golden";
  return "tests/golden";
}

// ||a - b|| / ||b||; when the reference is exactly zero, ||a|| (so zeros must match zeros).
inline double golden_rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double rel_scalar(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// "model.layers.1.mlp.experts.3.up_proj.weight" -> "layers.*.mlp.experts.*.up_proj.weight"
inline std::string family_of(const std::string& name) {
  static const std::regex num(R"(\.\d+\.)");
  std::string f = std::regex_replace(name, num, ".*.");
  f = std::regex_replace(f, num, ".*.");  // overlapping matches (".1.mlp.experts.3.")
  return f.rfind("model.", 0) == 0 ? f.substr(6) : f;
}

inline double meta_number(const SafetensorsReader& g, const std::string& key) {
  auto it = g.metadata().find(key);
  if (it == g.metadata().end()) {
    ADD_FAILURE() << g.path() << ": metadata has no '" << key << "'";
    return NAN;
  }
  return std::stod(it->second);
}

// The golden sequences packed into one micro-batch (CPU tensors): next-token targets inside
// each sequence, the last token of each sequence without a target, positions restarting at 0.
inline MicroBatch golden_batch(const SafetensorsReader& g) {
  const std::vector<int32_t> ids = g.read("input_ids").to_ints();
  const std::vector<int32_t> lens = g.read("seq_lens").to_ints();
  std::vector<int32_t> tgt, pos, cu = {0};
  size_t at = 0;
  for (int32_t L : lens) {
    for (int32_t j = 0; j < L; ++j) {
      tgt.push_back(j + 1 < L ? ids[at + j + 1] : -1);
      pos.push_back(j);
    }
    at += static_cast<size_t>(L);
    cu.push_back(cu.back() + L);
  }
  EXPECT_EQ(at, ids.size()) << "seq_lens do not add up to input_ids";
  const int64_t T = static_cast<int64_t>(ids.size());
  MicroBatch mb;
  mb.tokens = Tensor::from_ints(ids, {T});
  mb.targets = Tensor::from_ints(tgt, {T});
  mb.positions = Tensor::from_ints(pos, {T});
  mb.cu_seqlens = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  mb.num_valid = 0;
  for (int32_t t : tgt) mb.num_valid += t >= 0;
  return mb;
}

// The golden sequences as documents: a DataLoader over them with micro-batches of exactly
// golden_tokens() tokens and no shuffling yields the golden batch at every step.
inline Corpus golden_corpus(const SafetensorsReader& g) {
  const std::vector<int32_t> ids = g.read("input_ids").to_ints();
  const std::vector<int32_t> lens = g.read("seq_lens").to_ints();
  Corpus c;
  size_t at = 0;
  for (int32_t L : lens) {
    c.add(std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(at),
                               ids.begin() + static_cast<std::ptrdiff_t>(at + L)));
    at += static_cast<size_t>(L);
  }
  return c;
}

// The reference training curve (loss_curve.json): per-step CE before the update, aux loss and
// grad norm before clipping, plus the hyper-parameters it was made with.
struct GoldenCurve {
  std::vector<double> loss, aux_loss, grad_norm;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, grad_clip = 0;
};

inline GoldenCurve read_golden_curve(const std::string& dir) {
  const std::string path = path_join(dir, "loss_curve.json");
  std::ifstream in(path);
  GoldenCurve c;
  if (!in) {
    ADD_FAILURE() << path << " is missing: regenerate with\n"
                  << "  python tools/hf_reference.py --out tests/golden --train-steps 20";
    return c;
  }
  const nlohmann::json j = nlohmann::json::parse(in);
  c.loss = j.at("loss").get<std::vector<double>>();
  c.aux_loss = j.at("aux_loss").get<std::vector<double>>();
  c.grad_norm = j.at("grad_norm").get<std::vector<double>>();
  const nlohmann::json& hp = j.at("hyperparameters");
  c.lr = hp.at("lr");
  c.beta1 = hp.at("betas").at(0);
  c.beta2 = hp.at("betas").at(1);
  c.eps = hp.at("eps");
  c.weight_decay = hp.at("weight_decay");
  c.grad_clip = hp.at("grad_clip");
  return c;
}

// A run config (TOML text) that trains the golden model on the golden batch with the reference
// loop's optimizer: constant lr (no warmup, min_lr = lr), AdamW with decay on matrices only,
// clipping by global norm, one micro-batch of all golden tokens per step, no shuffling.
inline std::string golden_run_toml(const std::string& dir, const GoldenCurve& c, int64_t tokens,
                                   const std::string& device, const std::string& loss) {
  char buf[2048];
  std::snprintf(buf, sizeof buf,
                "[model]\nconfig = \"%s/config.json\"\ninit = \"hf:%s\"\n"
                "[primitives]\nloss = \"%s\"\nloss_chunk_tokens = 7\nloss_chunk_vocab = 24\n"
                "loss_fused_chunk_tokens = 7\n"
                "[parallel]\ndevice = \"%s\"\n"
                "[train]\nsteps = %zu\nmicro_batch_tokens = %lld\nlr = %.17g\nmin_lr = %.17g\n"
                "warmup_steps = 0\nweight_decay = %.17g\nbeta1 = %.17g\nbeta2 = %.17g\n"
                "adam_eps = %.17g\ngrad_clip = %.17g\n"
                "[data]\nshuffle = false\n",
                dir.c_str(), dir.c_str(), loss.c_str(), device.c_str(), c.loss.size(),
                static_cast<long long>(tokens), c.lr, c.lr, c.weight_decay, c.beta1, c.beta2,
                c.eps, c.grad_clip);
  return buf;
}

// The golden's value for `key` (prefix + HF name). A fused expert name the golden lacks is
// assembled from its per-expert tensors: transformers 5.17 writes Qwen3.5 checkpoints (and so
// the golden's gradient names) per expert, while bumblebee exposes Qwen3.5's experts fused, as
// the released checkpoints store them. gate_up_proj [E, 2F, H] = per expert [gate; up],
// down_proj [E, H, F]. Empty when neither form is there.
inline std::vector<float> golden_grad(const SafetensorsReader& g, const std::string& key, const Shape& shape) {
  if (g.has(key)) return g.read(key).to_floats();
  const auto fused = [&](const std::string& suffix) {
    return key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const bool gate_up = fused(".mlp.experts.gate_up_proj"), down = fused(".mlp.experts.down_proj");
  if ((!gate_up && !down) || shape.size() != 3) return {};
  const std::string base = key.substr(0, key.size() - (gate_up ? std::string("gate_up_proj") : std::string("down_proj")).size());
  std::vector<float> out;
  for (int64_t e = 0; e < shape[0]; ++e) {
    const std::string pe = base + std::to_string(e) + ".";
    for (const char* part : gate_up ? std::vector<const char*>{"gate_proj", "up_proj"} : std::vector<const char*>{"down_proj"}) {
      const std::string k = pe + part + ".weight";
      if (!g.has(k)) return {};
      const std::vector<float> v = g.read(k).to_floats();
      out.insert(out.end(), v.begin(), v.end());
    }
  }
  return static_cast<int64_t>(out.size()) == shape[0] * shape[1] * shape[2] ? out : std::vector<float>{};
}

// The per-expert golden names a fused model tensor stands for (so they count as seen).
inline void mark_per_expert(const std::string& key, const Shape& shape, std::set<std::string>& seen) {
  for (const char* fused : {"gate_up_proj", "down_proj"}) {
    const std::string suffix = std::string(".mlp.experts.") + fused;
    if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string base = key.substr(0, key.size() - std::string(fused).size());
    for (int64_t e = 0; e < shape[0]; ++e)
      for (const char* part : std::string(fused) == "gate_up_proj" ? std::vector<const char*>{"gate_proj", "up_proj"}
                                                                    : std::vector<const char*>{"down_proj"})
        seen.insert(base + std::to_string(e) + "." + part + ".weight");
  }
}

}  // namespace bb::test

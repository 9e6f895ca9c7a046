// Model parity against the Hugging Face reference: for each golden directory made by
// tools/hf_reference.py (tests/golden/<name>/: config.json, model.safetensors, golden.safetensors)
// load the checkpoint with load_hf_weights, pack the golden sequences into one micro-batch and
// compare logits, CE loss, aux loss and routing (forward), then every parameter gradient of
// loss = CE/N + coef * aux and of CE/N alone (forward_backward) against the transformers dump.
//
// Tolerances (norm-wise relative error ||ours - ref|| / ||ref||): logits and losses 1e-5, each
// gradient tensor 1e-4. Both sides compute in fp32 with the same formulas; the remaining
// differences are summation order and libm, ~1e-7 relative per op.
//
// A missing golden file is a FAILURE, not a skip: the test must not pass vacuously. Generate
// the goldens with `python tools/hf_reference.py --out tests/golden` (needs torch and
// transformers). BB_GOLDEN_DIR=<dir> points the test at another root.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "common/testing.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "models/config.h"
#include "models/hf_io.h"
#include "models/qwen3_moe.h"

namespace bb {
namespace {

constexpr double kLogitsTol = 1e-5, kLossTol = 1e-5, kGradTol = 1e-4;
const char* const kGoldens[] = {"qwen3_moe_tiny", "qwen2_moe_tiny"};

std::string golden_root() {
  if (const char* env = std::getenv("BB_GOLDEN_DIR")) return env;
  const std::string here = __FILE__;  // <repo>/tests/cpu/test_parity.cpp
  const size_t at = here.rfind("/cpu/");
  if (at != std::string::npos && is_directory(here.substr(0, at) + "/golden"))
    return here.substr(0, at) + "/golden";
  return "tests/golden";  // ctest runs in the source directory
}

// ||a - b|| / ||b||; when the reference is exactly zero, ||a|| (so zeros must match zeros).
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double rel_scalar(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// "model.layers.1.mlp.experts.3.up_proj.weight" -> "layers.*.mlp.experts.*.up_proj.weight"
std::string family_of(const std::string& name) {
  static const std::regex num(R"(\.\d+\.)");
  std::string f = std::regex_replace(name, num, ".*.");
  f = std::regex_replace(f, num, ".*.");  // overlapping matches (".1.mlp.experts.3.")
  return f.rfind("model.", 0) == 0 ? f.substr(6) : f;
}

double meta_number(const SafetensorsReader& g, const std::string& key) {
  auto it = g.metadata().find(key);
  if (it == g.metadata().end()) {
    ADD_FAILURE() << g.path() << ": metadata has no '" << key << "'";
    return NAN;
  }
  return std::stod(it->second);
}

// The golden sequences packed into one micro-batch: next-token targets inside each sequence,
// the last token of each sequence without a target, positions restarting at 0.
MicroBatch golden_batch(const SafetensorsReader& g) {
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

// Compares every HF-named gradient with `prefix` + name in the golden; prints the worst
// relative error per tensor family.
void compare_grads(Qwen3MoeModel& m, const SafetensorsReader& g, const std::string& prefix,
                   const std::string& what) {
  std::map<std::string, double> worst;
  std::set<std::string> seen;
  for (const HfNamedParam& p : hf_named_params(m)) {
    const std::string key = prefix + p.name;
    seen.insert(key);
    if (!g.has(key)) {
      ADD_FAILURE() << what << ": golden has no " << key;
      continue;
    }
    const double e = rel_err(p.grad.to_floats(), g.read(key).to_floats());
    EXPECT_LT(e, kGradTol) << what << ": gradient of " << p.name << " differs (relative error " << e
                           << ")";
    double& w = worst[family_of(p.name)];
    w = std::max(w, e);
  }
  for (const SafetensorsEntry& e : g.entries())
    if (e.name.rfind(prefix, 0) == 0)
      EXPECT_TRUE(seen.count(e.name))
          << what << ": golden has " << e.name << ", the model does not";
  std::printf("  %s: max relative error per tensor family\n", what.c_str());
  for (const auto& [fam, err] : worst) std::printf("    %-48s %.2e\n", fam.c_str(), err);
}

void check_golden(const std::string& dir) {
  const std::string file = path_join(dir, "golden.safetensors");
  if (!path_exists(file)) {
    FAIL() << file << " is missing: generate the goldens with\n"
           << "  python tools/hf_reference.py --out tests/golden\n"
           << "(needs torch and transformers; see tests/golden/README.md)";
  }
  SafetensorsReader g(file);
  const ModelConfig cfg = load_hf_config(dir);
  const double coef = meta_number(g, "router_aux_loss_coef");
  EXPECT_DOUBLE_EQ(coef, cfg.router_aux_loss_coef);
  std::printf("golden %s (transformers %s, torch %s)\n", dir.c_str(),
              g.metadata().count("transformers_version")
                  ? g.metadata().at("transformers_version").c_str()
                  : "?",
              g.metadata().count("torch_version") ? g.metadata().at("torch_version").c_str() : "?");

  for (const char* loss : {"full_ce", "linear_ce"}) {
    SCOPED_TRACE(std::string("loss head ") + loss);
    ModelOptions o;
    o.loss = loss;
    o.loss_chunk_tokens = 7;  // several chunks on the tiny batch
    o.loss_chunk_vocab = 24;
    o.aux_loss_coef = cfg.router_aux_loss_coef;
    Qwen3MoeModel m(cfg, o, 99);
    const HfLoadReport rep = load_hf_weights(m, dir);
    EXPECT_GT(rep.tensors_read, 0);
    const MicroBatch mb = golden_batch(g);
    EXPECT_EQ(mb.num_valid, static_cast<int64_t>(meta_number(g, "num_predicted")));

    // Forward: logits, losses, routing.
    Tensor logits;
    const ForwardStats st = m.forward(mb, &logits);
    const double e_logits = rel_err(logits.to_floats(), g.read("logits").to_floats());
    EXPECT_LT(e_logits, kLogitsTol) << "logits differ";
    const double ce = st.loss_sum / static_cast<double>(st.num_valid);
    EXPECT_LT(rel_scalar(ce, meta_number(g, "ce_loss")), kLossTol)
        << "CE loss " << ce << " vs reference " << meta_number(g, "ce_loss");
    EXPECT_LT(rel_scalar(st.aux_loss, meta_number(g, "aux_loss")), kLossTol)
        << "aux loss " << st.aux_loss << " vs reference " << meta_number(g, "aux_loss")
        << " (HF pools counts and probabilities over all MoE layers before the product)";
    std::printf("  [%s] logits rel err %.2e | CE %.8f (ref %.8f) | aux %.8f (ref %.8f)\n", loss,
                e_logits, ce, meta_number(g, "ce_loss"), st.aux_loss, meta_number(g, "aux_loss"));
    size_t r = 0;
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      ASSERT_LT(r, m.last_routing().size());
      std::vector<int32_t> ours = m.last_routing()[r++].to_ints();
      std::vector<int32_t> ref = g.read("routing." + std::to_string(l)).to_ints();
      ASSERT_EQ(ours.size(), ref.size()) << "routing of layer " << l;
      const size_t K = static_cast<size_t>(cfg.top_k);
      for (size_t t = 0; t < ours.size(); t += K) {  // the set of experts per token
        std::sort(ours.begin() + t, ours.begin() + t + K);
        std::sort(ref.begin() + t, ref.begin() + t + K);
      }
      EXPECT_EQ(ours, ref) << "top-k selection of layer " << l << " differs";
    }

    // Backward: loss = CE / N + coef * aux, then CE / N alone (aux_scale 0).
    const float inv_n = 1.0f / static_cast<float>(mb.num_valid);
    m.zero_grad();
    m.forward_backward(mb, inv_n, 1.0);
    compare_grads(m, g, "grad.", std::string(loss) + " d(CE/N + coef*aux)");
    m.zero_grad();
    m.forward_backward(mb, inv_n, 0.0);
    compare_grads(m, g, "grad_ce.", std::string(loss) + " d(CE/N)");
  }
}

TEST(HfParity, Qwen3MoeTiny) {
  check_golden(path_join(golden_root(), "qwen3_moe_tiny"));
}
TEST(HfParity, Qwen2MoeTinySharedExpertTied) {
  check_golden(path_join(golden_root(), "qwen2_moe_tiny"));
}

// Any further golden directory (a new reference model) is checked the same way.
TEST(HfParity, OtherGoldenDirs) {
  const std::string root = golden_root();
  ASSERT_TRUE(is_directory(root)) << "golden root " << root << " does not exist";
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    if (std::find(std::begin(kGoldens), std::end(kGoldens), name) != std::end(kGoldens)) continue;
    if (!path_exists(path_join(e.path().string(), "golden.safetensors"))) continue;
    SCOPED_TRACE(name);
    check_golden(e.path().string());
  }
}

}  // namespace
}  // namespace bb

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
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>

#include "common/golden.h"
#include "common/run.h"
#include "common/testing.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "models/config.h"
#include "models/hf_io.h"
#include "common/model.h"
#include "models/decoder.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

constexpr double kLogitsTol = 1e-5, kLossTol = 1e-5, kGradTol = 1e-4;
const char* const kGoldens[] = {"qwen3_moe_tiny", "qwen2_moe_tiny", "qwen3_5_moe_tiny"};

using test::family_of;
using test::golden_batch;
using test::golden_root;
using test::meta_number;
using test::rel_scalar;

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  return test::golden_rel_err(a, b);
}

// Compares every HF-named gradient with `prefix` + name in the golden; prints the worst
// relative error per tensor family.
void compare_grads(DecoderModel& m, const SafetensorsReader& g, const std::string& prefix,
                   const std::string& what) {
  std::map<std::string, double> worst;
  std::set<std::string> seen;
  for (const HfNamedParam& p : hf_named_params(m)) {
    const std::string key = prefix + p.name;
    seen.insert(key);
    test::mark_per_expert(key, p.grad.shape(), seen);
    const std::vector<float> ref = test::golden_grad(g, key, p.grad.shape());
    if (ref.empty()) {
      ADD_FAILURE() << what << ": golden has no " << key;
      continue;
    }
    const double e = rel_err(p.grad.to_floats(), ref);
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
    ModelOptions o = test::model_options({{"loss", loss}});
    o.prims.loss_chunks = {7, 24, 7};  // several chunks on the tiny batch
    o.aux_loss_coef = cfg.router_aux_loss_coef;
    test::ModelRun run(cfg, o, 99);
    DecoderModel& m = run.model;
    const HfLoadReport rep = load_hf_weights(m, dir);
    EXPECT_GT(rep.tensors_read, 0);
    const MicroBatch mb = golden_batch(g);
    EXPECT_EQ(mb.num_valid, static_cast<int64_t>(meta_number(g, "num_predicted")));

    // Forward: logits, losses, routing.
    Tensor logits;
    const ForwardStats st = run.forward(mb, &logits);
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
      ASSERT_LT(r, run.last_routing().size());
      std::vector<int32_t> ours = run.last_routing()[r++].to_ints();
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
    run.forward_backward(mb, inv_n, 1.0);
    compare_grads(m, g, "grad.", std::string(loss) + " d(CE/N + coef*aux)");
    m.zero_grad();
    run.forward_backward(mb, inv_n, 0.0);
    compare_grads(m, g, "grad_ce.", std::string(loss) + " d(CE/N)");
  }
}

TEST(HfParity, Qwen3MoeTiny) {
  check_golden(path_join(golden_root(), "qwen3_moe_tiny"));
}
TEST(HfParity, Qwen2MoeTinySharedExpertTied) {
  check_golden(path_join(golden_root(), "qwen2_moe_tiny"));
}

// Qwen3.5 hybrid: 3 Gated DeltaNet layers + 1 gated full-attention layer, zero-centred norms,
// partial RoPE, a shared expert in every MoE layer, fused expert checkpoint names; one sequence
// of 70 tokens crosses the 64-token GDN chunk.
TEST(HfParity, Qwen3_5MoeTinyHybrid) {
  check_golden(path_join(golden_root(), "qwen3_5_moe_tiny"));
}

// The trainer (AdamW with fp32 state, clipping, constant lr) on the golden batch for as many
// steps as the reference loop ran: the per-step CE loss, aux loss and grad norm follow
// transformers + torch.optim.AdamW. Both sides are fp32; the only differences are summation
// order and libm, amplified a little by 20 optimizer steps: relative 1e-4 per step.
void check_curve(const std::string& dir, const std::string& loss, double tol = 1e-4) {
  SafetensorsReader g(path_join(dir, "golden.safetensors"));
  const test::GoldenCurve ref = test::read_golden_curve(dir);
  ASSERT_FALSE(ref.loss.empty());
  const int64_t T = g.read("input_ids").numel();
  Trainer tr(parse_run_config(test::golden_run_toml(dir, ref, T, "cpu", loss), "golden run"),
             nullptr, test::golden_corpus(g));
  double worst = 0;
  for (size_t i = 0; i < ref.loss.size(); ++i) {
    const StepMetrics m = tr.train_step();
    EXPECT_EQ(m.valid_tokens, static_cast<int64_t>(meta_number(g, "num_predicted")));
    const double e = std::max({rel_scalar(m.loss, ref.loss[i]), rel_scalar(m.aux_loss, ref.aux_loss[i]),
                               rel_scalar(m.grad_norm, ref.grad_norm[i])});
    EXPECT_LT(e, tol) << "step " << i + 1 << ": loss " << m.loss << " (ref " << ref.loss[i]
                       << "), aux " << m.aux_loss << " (ref " << ref.aux_loss[i] << "), grad norm "
                       << m.grad_norm << " (ref " << ref.grad_norm[i] << ")";
    worst = std::max(worst, e);
  }
  std::printf("  %s, %s: %zu steps, loss %.4f -> %.4f, max relative difference %.2e\n",
              dir.c_str(), loss.c_str(), ref.loss.size(), ref.loss.front(), ref.loss.back(), worst);
}

TEST(HfParity, Qwen3MoeTinyLossCurve) {
  check_curve(path_join(golden_root(), "qwen3_moe_tiny"), "linear_ce");
}
TEST(HfParity, Qwen2MoeTinyLossCurve) {
  check_curve(path_join(golden_root(), "qwen2_moe_tiny"), "full_ce");
}
// A copy of the checkpoint in `dir` (config.json, model.safetensors) in `out` with every other
// f32 weight moved by one ulp (its lowest mantissa bit flipped): a start that differs from the
// original only at the rounding level.
void write_ulp_perturbed_copy(const std::string& dir, const std::string& out) {
  std::filesystem::copy_file(path_join(dir, "config.json"), path_join(out, "config.json"));
  std::ifstream in(path_join(dir, "model.safetensors"), std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(b.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[static_cast<size_t>(i)]);
  const nlohmann::json h = nlohmann::json::parse(std::string(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n)));
  int64_t flipped = 0;
  for (const auto& [name, e] : h.items()) {
    if (name == "__metadata__" || e.at("dtype") != "F32") continue;
    const uint64_t s = e.at("data_offsets").at(0), t = e.at("data_offsets").at(1);
    for (uint64_t off = 8 + n + s; off < 8 + n + t; off += 8, ++flipped) b[off] ^= 1;  // little endian
  }
  ASSERT_GT(flipped, 0);
  std::ofstream(path_join(out, "model.safetensors"), std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}

// For a model whose training trajectory is chaotic on the golden batch: the Qwen3.5 tiny model
// memorises its 106 tokens, and a start moved by one ulp drifts from the original by ~10x per
// step (measured: 1e-6 after step 1, 7e-4 at step 3, 3e-2 by step 9, at lr 1e-3 and 5e-4 alike;
// transformers' curve stays inside that band of bumblebee's own runs). So the reference is held
// to bumblebee's own rounding-level sensitivity, measured in the test: both runs of the trainer
// (original start, one-ulp start) and, per step, the running maximum `spread` of their relative
// difference; a step is compared, |ours - ref| <= max(1e-4, 5 x spread), only while that bound
// stays at or below kCurveCap = 1e-3: once a one-ulp start moves the run further, the curve past
// it carries no information about the implementation (an uncapped bound passed 0.15 relative by
// step 9). At least two steps must be compared. What this cannot see (a 1 % error in beta2 moves
// steps 3+ by ~1e-3, inside the chaos) the non-chaotic Qwen3 / Qwen2 curves catch (at 2e-3; a
// planted beta2 x 0.99 fails them), and the single-step parity above checks the gradients.
constexpr double kCurveCap = 1e-3;
void check_curve_against_own_spread(const std::string& dir, const std::string& loss) {
  SafetensorsReader g(path_join(dir, "golden.safetensors"));
  const test::GoldenCurve ref = test::read_golden_curve(dir);
  ASSERT_FALSE(ref.loss.empty());
  const int64_t T = g.read("input_ids").numel();
  const std::string pert = make_tmpdir();
  write_ulp_perturbed_copy(dir, pert);
  Trainer a(parse_run_config(test::golden_run_toml(dir, ref, T, "cpu", loss), "golden run"), nullptr,
            test::golden_corpus(g));
  Trainer b(parse_run_config(test::golden_run_toml(pert, ref, T, "cpu", loss), "golden run, one-ulp start"),
            nullptr, test::golden_corpus(g));
  double spread = 0, worst_ratio = 0;
  size_t compared = 0;
  bool informative = true;
  std::printf("  step  rel(ours, ref)  rel(ours, ours one ulp)  bound\n");
  for (size_t i = 0; i < ref.loss.size(); ++i) {
    const StepMetrics ma = a.train_step(), mb = b.train_step();
    spread = std::max({spread, rel_scalar(ma.loss, mb.loss), rel_scalar(ma.aux_loss, mb.aux_loss),
                       rel_scalar(ma.grad_norm, mb.grad_norm)});
    const double e = std::max({rel_scalar(ma.loss, ref.loss[i]), rel_scalar(ma.aux_loss, ref.aux_loss[i]),
                               rel_scalar(ma.grad_norm, ref.grad_norm[i])});
    const double bound = std::max(1e-4, 5 * spread);
    informative = informative && bound <= kCurveCap;
    std::printf("  %4zu  %14.2e  %23.2e  %.2e%s\n", i + 1, e, spread, bound, informative ? "" : "  (not compared: chaotic)");
    if (!informative) continue;
    ++compared;
    EXPECT_LT(e, bound) << "step " << i + 1 << ": loss " << ma.loss << " (ref " << ref.loss[i] << "), grad norm "
                        << ma.grad_norm << " (ref " << ref.grad_norm[i] << "), own one-ulp spread " << spread;
    worst_ratio = std::max(worst_ratio, e / bound);
  }
  std::filesystem::remove_all(pert);
  EXPECT_GE(compared, 2u) << "the run is chaotic from its first steps: nothing of the curve can be compared";
  std::printf("  %s, %s: %zu steps (%zu compared), loss %.4f -> %.4f, worst |ours - ref| / bound %.2f\n", dir.c_str(),
              loss.c_str(), ref.loss.size(), compared, ref.loss.front(), ref.loss.back(), worst_ratio);
}

TEST(HfParity, Qwen3_5MoeTinyLossCurve) {
  check_curve_against_own_spread(path_join(golden_root(), "qwen3_5_moe_tiny"), "linear_ce");
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
    if (!path_exists(path_join(e.path().string(), "loss_curve.json"))) continue;
    if (load_hf_config(e.path().string()).model_type == "qwen3_5_moe_text")
      // The Qwen3.5 tiny models' curves are chaotic (check_curve_against_own_spread).
      check_curve_against_own_spread(e.path().string(), "linear_ce");
    else
      // 2e-3: the qwen3 d128 curve turns sensitive near the end (at steps 15-17 a single token
      // swings the grad norm); the BLAS summation order alone (1 vs 2 OpenBLAS threads) moves
      // it by 7e-4 to 9e-4 relative there.
      check_curve(e.path().string(), "linear_ce", 2e-3);
  }
}

}  // namespace
}  // namespace bb

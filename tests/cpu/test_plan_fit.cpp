// The memory check before a run allocates (plan/estimate.h check_fit) and the estimator on the
// full models, on this machine (a GPU run is predicted anywhere; nothing is allocated).
#include <gtest/gtest.h>

#include <sstream>

#include "plan/estimate.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

using C = MemCategory;
constexpr int64_t GiB = int64_t{1} << 30;

RunConfig load(const std::string& path, const std::vector<std::string>& set = {}) { return load_run_config(path, set); }

// The --set pairs of a check_fit message.
std::vector<std::string> suggested(const std::string& msg) {
  std::vector<std::string> out;
  std::istringstream in(msg.substr(msg.find("that fits")));
  std::string w;
  while (in >> w)
    if (w == "--set" && in >> w) out.push_back(w);
  return out;
}

TEST(PlanFit, AMillionTokensWithoutRecomputeIsRefusedWithASettingThatFits) {
  // The Qwen3-30B-A3B slice at 1M tokens per micro-batch without recompute: the run that used to
  // fail at its first step (out of memory allocating 24 GiB).
  const RunConfig cfg = load("configs/qwen3-30b-a3b-4layer-gpu.toml",
                             {"train.micro_batch_tokens=1048576", "primitives.recompute=\"none\""});
  const plan::FitCheck fc = plan::check_fit(cfg, 1, 0, 140 * GiB);
  ASSERT_FALSE(fc.fits);
  EXPECT_GT(fc.estimate.peak_total, 140 * GiB);
  EXPECT_NE(fc.message.find("out of memory predicted"), std::string::npos) << fc.message;
  EXPECT_NE(fc.message.find("activations"), std::string::npos) << fc.message;  // the largest category
  EXPECT_NE(fc.message.find("--force"), std::string::npos);
  const std::vector<std::string> fix = suggested(fc.message);
  ASSERT_FALSE(fix.empty()) << fc.message;
  std::vector<std::string> set = {"train.micro_batch_tokens=1048576", "primitives.recompute=\"none\""};
  set.insert(set.end(), fix.begin(), fix.end());
  const plan::FitCheck again = plan::check_fit(load("configs/qwen3-30b-a3b-4layer-gpu.toml", set), 1, 0, 140 * GiB);
  EXPECT_TRUE(again.fits) << again.message;
}

TEST(PlanFit, TheShippedSliceFitsAndTheCheckIsMonotone) {
  const RunConfig cfg = load("configs/qwen3-30b-a3b-4layer-gpu.toml");
  const plan::FitCheck fc = plan::check_fit(cfg, 1, 0, 140 * GiB);
  EXPECT_TRUE(fc.fits) << fc.message;
  EXPECT_TRUE(fc.message.empty());
  // One byte less than the prediction is refused.
  EXPECT_FALSE(plan::check_fit(cfg, 1, 0, fc.estimate.peak_total - 1).fits);
  EXPECT_TRUE(plan::check_fit(cfg, 1, 0, fc.estimate.peak_total).fits);
}

// One rank of the full Qwen3-30B-A3B on 8 GPUs with the recipe: its state at startup as measured
// on an H200 (bench/results/2026-12-04-h200-emulated.md, sec. 3: params 7.11, grads 14.22,
// optimizer 35.54 GiB, live 56.87 GiB).
TEST(PlanFit, TheFullQwen3StateMatchesTheMeasuredStartup) {
  const RunConfig cfg = load("configs/qwen3-30b-a3b-8gpu.toml");
  const plan::MemoryEstimate e = plan::estimate_memory(cfg, 8);
  auto gib = [](int64_t b) { return static_cast<double>(b) / double(GiB); };
  EXPECT_NEAR(gib(e.persistent[C::params]), 7.11, 0.005);
  EXPECT_NEAR(gib(e.persistent[C::grads]), 14.22, 0.005);
  EXPECT_NEAR(gib(e.persistent[C::optimizer]), 35.54, 0.005);
  EXPECT_NEAR(gib(e.persistent.total()), 56.87, 0.01);
}

}  // namespace
}  // namespace bb

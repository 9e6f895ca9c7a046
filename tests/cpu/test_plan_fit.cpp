// The memory check before a run allocates (plan/estimate.h check_fit) and the estimator on the
// full models, on this machine (a GPU run is predicted anywhere; nothing is allocated).
#include <gtest/gtest.h>

#include <sstream>
#include <tuple>

#include "common/testing.h"
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

// The Qwen3-30B-A3B slice at 512K tokens under full recompute: the routed rows of the whole
// micro-batch (48 GiB of moe buffers predicted) do not fit 140 GiB; the check names token-chunked
// MoE as the nearest setting, which fits with the moe category bounded by one 32K-token chunk.
TEST(PlanFit, HalfAMillionTokensFitWithMoeTokenChunks) {
  const std::vector<std::string> set = {"train.micro_batch_tokens=524288", "primitives.permute=\"memory_efficient\"",
                                        "primitives.optimizer=\"adamw_bf16_moments\""};
  const plan::FitCheck fc = plan::check_fit(load("configs/qwen3-30b-a3b-4layer-gpu.toml", set), 1, 0, 140 * GiB);
  ASSERT_FALSE(fc.fits);
  const std::vector<std::string> fix = suggested(fc.message);
  ASSERT_EQ(fix, std::vector<std::string>{"backend.moe_chunk_tokens=32768"}) << fc.message;
  std::vector<std::string> with = set;
  with.insert(with.end(), fix.begin(), fix.end());
  const plan::FitCheck again = plan::check_fit(load("configs/qwen3-30b-a3b-4layer-gpu.toml", with), 1, 0, 140 * GiB);
  EXPECT_TRUE(again.fits) << again.message;
  EXPECT_GT(fc.estimate.peak[MemCategory::moe], 40 * GiB);
  EXPECT_LT(again.estimate.peak[MemCategory::moe], 4 * GiB);
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

namespace bb {
namespace {

// The layout search for the seed's case, Qwen3.5-35B-A3B on 32 GPUs of 80 GB at 128K: every
// candidate is a valid layout of 32 GPUs, the fit flag is the prediction against the usable
// memory, 128K on one GPU (cp 1) mostly does not fit, and the choice brings the sequence to 32K
// per GPU.
TEST(PlanFit, TheLayoutSearchForTheSeedsCase) {
  const RunConfig base = parse_run_config(
      "[model]\nconfig = \"configs/models/qwen3.5-35b-a3b/config.json\"\n[parallel]\ndevice = \"cuda\"\n", "test");
  plan::PlanRequest req;
  req.gpus = 32;
  req.seq = 131072;
  req.gpu_memory_gib = 79.6;
  int64_t calls = 0;
  const plan::PlanResult r = plan::plan_layouts(base, req, [&](int64_t done, int64_t total) {
    ++calls;
    EXPECT_LE(done, total);
  });
  ASSERT_FALSE(r.candidates.empty());
  EXPECT_GT(calls, 0);
  int chosen = 0, cp1_refused = 0;
  double fastest = 0, chosen_tps = 0;
  for (const plan::PlanCandidate& c : r.candidates) {
    EXPECT_EQ(c.layout.world(), 32);
    EXPECT_EQ(256 % c.layout.ep, 0);
    EXPECT_EQ(c.fits, c.estimate.peak_total <= r.usable) << c.layout.str();
    if (c.layout.cp == 1 && !c.fits) ++cp1_refused;
    // The timing is the one estimate_time gives the candidate's config.
    EXPECT_GT(c.time.step_s, 0) << c.layout.str();
    if (c.fits) fastest = std::max(fastest, c.time.tokens_per_s());
    if (c.chosen) {
      ++chosen;
      EXPECT_TRUE(c.fits);
      chosen_tps = c.time.tokens_per_s();
      EXPECT_NE(r.why.find("CP " + std::to_string(c.layout.cp)), std::string::npos) << r.why;
      EXPECT_NE(r.why.find("EP " + std::to_string(c.layout.ep)), std::string::npos) << r.why;
    }
  }
  EXPECT_EQ(chosen, 1);
  EXPECT_EQ(chosen_tps, fastest);  // the most predicted tokens/s per GPU among what fits
  EXPECT_GT(cp1_refused, 0);  // 128K tokens on one GPU do not fit with most EPs
  EXPECT_NE(r.why.find("PREDICTED"), std::string::npos) << r.why;
  // Nothing fits on 8 GB GPUs: no choice, and the reason says so.
  req.gpu_memory_gib = 8;
  const plan::PlanResult none = plan::plan_layouts(base, req);
  for (const plan::PlanCandidate& c : none.candidates) EXPECT_FALSE(c.chosen);
  EXPECT_NE(none.why.find("no layout"), std::string::npos) << none.why;
}

// ---- parallel = "auto" -----------------------------------------------------------------------

namespace auto_layout {

RunConfig config(const std::string& parallel, const std::vector<std::string>& set = {}, const std::string& device = "cuda") {
  std::string toml = "[model]\nconfig = \"configs/models/qwen3-30b-a3b-4layer/config.json\"\n[parallel]\ndevice = \"" + device +
                     "\"\n" + parallel + "[primitives]\nstate = \"fsdp\"\nrecompute = \"full\"\n";
  return parse_run_config(toml, "test", set);
}

// The layout (cp, ep) of 8 ranks given by hand, as the planner would set it.
RunConfig candidate(const RunConfig& cfg, int64_t cp, int64_t ep) {
  RunConfig c = cfg;
  c.auto_dp = c.auto_cp = c.auto_ep = false;
  c.cp = cp, c.ep = ep, c.dp = 8 / cp;
  if (cp > 1) c.prim.set("attention", "cp_ring", "test");
  return c;
}

}  // namespace auto_layout

TEST(AutoLayout, ParsedFromEveryForm) {
  using auto_layout::config;
  EXPECT_FALSE(config("").auto_layout());
  const RunConfig all = config("layout = \"auto\"\n");
  EXPECT_TRUE(all.auto_dp && all.auto_cp && all.auto_ep);
  const RunConfig one = config("ep = \"auto\"\ncp = 2\n");
  EXPECT_TRUE(one.auto_ep && !one.auto_cp && !one.auto_dp);
  EXPECT_EQ(one.cp, 2);
  const RunConfig fixed = config("layout = \"auto\"\ncp = 1\n");  // layout auto leaves a given degree alone
  EXPECT_TRUE(fixed.auto_ep && fixed.auto_dp && !fixed.auto_cp);
  const RunConfig top = parse_run_config("parallel = \"auto\"\n[model]\nconfig = \"configs/models/qwen3-30b-a3b-4layer/config.json\"\n", "t");
  EXPECT_TRUE(top.auto_dp && top.auto_cp && top.auto_ep);
  EXPECT_TRUE(config("", {"parallel.layout=auto"}).auto_layout());
  test::expect_error_contains([&] { config("ep = \"four\"\n"); }, "parallel.ep (in test) must be an integer or \"auto\", got \"four\"");
  test::expect_error_contains([&] { parse_run_config("parallel = \"manual\"\n[model]\nconfig = \"x\"\n", "t"); },
             "'parallel' in t must be a table ([parallel]) or \"auto\", got \"manual\"");
}

// CPU ranks (no time model): the choice is the recipe's order over every candidate the config
// leaves open, checked here by predicting each candidate independently.
TEST(AutoLayout, ChoosesTheRecipesLayoutAmongWhatFitsOnCpuRanks) {
  using auto_layout::candidate;
  using auto_layout::config;
  for (int64_t tokens : {int64_t{8192}, int64_t{65536}}) {
    SCOPED_TRACE(tokens);
    const RunConfig cfg = config("layout = \"auto\"\n", {"train.micro_batch_tokens=" + std::to_string(tokens)}, "cpu");
    std::string why;
    const RunConfig got = plan::choose_auto_layout(cfg, 8, 140 * GiB, &why);
    EXPECT_FALSE(got.auto_layout());
    EXPECT_NE(why.find("parallel = auto chose"), std::string::npos) << why;
    // Independently: every (cp, ep) of 8 ranks, the smallest cp bringing the tokens to 32K per
    // rank, then the least wire time, then the smaller ep.
    std::tuple<int, int64_t, double, int64_t> best{2, 0, 0.0, 0};
    int64_t best_cp = 0, best_ep = 0;
    for (int64_t cp : {1, 2, 4, 8})
      for (int64_t ep : {1, 2, 4, 8}) {
        const RunConfig c = candidate(cfg, cp, ep);
        const plan::MemoryEstimate e = plan::estimate_memory(c, 8);
        if (e.peak_total > 140 * GiB) continue;
        const bool over = (tokens + cp - 1) / cp > 32768;
        const auto key = std::make_tuple(over ? 1 : 0, over ? -cp : cp, e.comm.total_s(), ep);
        if (best_cp == 0 || key < best) best = key, best_cp = cp, best_ep = ep;
      }
    EXPECT_EQ(got.cp, best_cp);
    EXPECT_EQ(got.ep, best_ep);
    EXPECT_EQ(got.dp, 8 / best_cp);
    EXPECT_EQ(got.cp, tokens <= 32768 ? 1 : 2);  // the smallest cp that brings 64K to 32K per rank
    if (got.cp > 1) EXPECT_EQ(got.prim.name_of("attention"), "cp_ring");
  }
}

// GPU runs: the most predicted tokens/s per GPU among the candidates that fit, checked by timing
// every candidate independently.
TEST(AutoLayout, ChoosesTheFastestPredictedLayoutOnGpus) {
  using auto_layout::candidate;
  using auto_layout::config;
  for (int64_t tokens : {int64_t{8192}, int64_t{65536}}) {
    SCOPED_TRACE(tokens);
    const RunConfig cfg = config("layout = \"auto\"\n", {"train.micro_batch_tokens=" + std::to_string(tokens)});
    const int64_t avail = 60 * GiB;
    std::string why;
    const RunConfig got = plan::choose_auto_layout(cfg, 8, avail, &why);
    EXPECT_NE(why.find("tokens/s/GPU"), std::string::npos) << why;
    double best = -1;
    int64_t best_cp = 0, best_ep = 0, fitting = 0;
    for (int64_t cp : {1, 2, 4, 8})
      for (int64_t ep : {1, 2, 4, 8}) {
        const RunConfig c = candidate(cfg, cp, ep);
        const plan::MemoryEstimate e = plan::estimate_memory(c, 8);
        if (e.peak_total > avail) continue;
        ++fitting;
        const double tps = plan::estimate_time(c, e, plan::Calibration::builtin()).tokens_per_s();
        if (tps > best) best = tps, best_cp = cp, best_ep = ep;
      }
    ASSERT_GT(fitting, 1);
    EXPECT_EQ(got.cp, best_cp);
    EXPECT_EQ(got.ep, best_ep);
    EXPECT_EQ(got.dp, 8 / best_cp);
  }
  // GSPO (the policy loss's sequence ratio) needs whole sequences on a rank: cp stays 1 even where
  // the recipe would split 64K tokens.
  const RunConfig gspo = plan::choose_auto_layout(
      config("layout = \"auto\"\n", {"train.micro_batch_tokens=65536", "primitives.loss=\"policy\"", "policy.ratio=\"sequence\""}),
      8, 140 * GiB, nullptr);
  EXPECT_EQ(gspo.cp, 1);
  // A fixed degree stays; nothing fits -> an error naming the closest candidate.
  const RunConfig fixed = plan::choose_auto_layout(config("ep = \"auto\"\ncp = 2\n"), 8, 140 * GiB, nullptr);
  EXPECT_EQ(fixed.cp, 2);
  test::expect_error_contains([&] { plan::choose_auto_layout(config("layout = \"auto\"\n"), 8, GiB, nullptr); },
             "parallel = auto: no layout of 8 rank(s) fits 1.00 GiB per rank; the smallest predicted peak is");
}

}  // namespace
}  // namespace bb

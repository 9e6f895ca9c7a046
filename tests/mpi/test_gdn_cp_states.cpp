// Multi-rank: Gated DeltaNet layers under context parallelism by state summaries
// (primitives.gdn_cp = "states"; skills/gdn-cp-states.md) in the trainer, against the single-rank
// run on the same data. The Qwen3.5 hybrid at test sizes (3 GDN layers, 1 gated attention layer
// on cp_ring); documents of mixed lengths packed into 96-token micro-batches: many shorter than
// 2 x cp (empty pieces, pieces shorter than the conv's 3-token halo, whose halo then spans
// several ranks), some longer than a micro-batch. For every layout 5 steps give the single-rank
// losses and grad norms to 1e-6 relative, the same routing and token counts, and the final
// weights to 1e-4 (as tests/mpi/test_context_parallel.cpp, which says why). Layouts: cp 2, 3
// (uneven head-tail chunks, heads not divisible) and 4; recompute none / full / selective:gdn;
// state families replicated, zero1, fsdp; folded with dp and ep; odd head counts (3 key / 6
// value heads) under cp 2, where the head all-to-all cannot run. Bad choices are clear errors.
// mpi-ranks: 2 3 4
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "common/trainer_equivalence.h"
#include "models/config.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

using test::world;

constexpr int kSteps = 5;

ModelConfig small_qwen35(int64_t key_heads, int64_t value_heads) {
  ModelConfig c = test::qwen35_config(
      {.vocab = 264, .hidden = 32, .layers = 4, .lin_key_heads = key_heads, .lin_value_heads = value_heads});
  c.eos_token_id = 256;
  return c;
}

struct TestRun {
  std::string dir, toml;
};

// A run directory holding the model config with these GDN head counts.
TestRun make_run(const char* tag, int64_t key_heads, int64_t value_heads) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0) std::ofstream(r.dir + "/config.json") << small_qwen35(key_heads, value_heads).to_hf_json().dump(2);
  world()->barrier();
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[train]\nsteps = 10\nmicro_batch_tokens = 96\nlr = 2e-3\nmin_lr = 2e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\nz_loss_coef = 1e-3\n"
           "[data]\nshuffle = false\n"
           "[checkpoint]\nevery = 0\nsave_final = false\n"
           "[primitives]\nattention = \"cp_ring\"\n";
  return r;
}

struct Layout {
  int64_t cp, ep;
  std::vector<std::string> extra;  // recompute, state, gdn_cp, dispatch
};

std::string name(const Layout& l) {
  std::string s = "cp" + std::to_string(l.cp) + " ep" + std::to_string(l.ep);
  for (const std::string& e : l.extra) s += " " + e;
  return s;
}

void check_layouts(const TestRun& run, const std::vector<Layout>& layouts) {
  const Corpus corpus = test::mixed_length_corpus(7);
  std::map<std::string, test::Reference> refs;  // by dp and recompute
  for (const Layout& l : layouts) {
    SCOPED_TRACE(name(l));
    const int64_t dp = world()->size() / l.cp;
    std::vector<std::string> ref_ov = {"train.grad_accum=" + std::to_string(dp)};
    for (const std::string& e : l.extra)
      if (e.rfind("primitives.recompute", 0) == 0) ref_ov.push_back(e);
    std::string key;
    for (const std::string& e : ref_ov) key += e + ";";
    if (!refs.count(key)) refs[key] = test::reference_run(parse_run_config(run.toml, "test run", ref_ov), corpus, kSteps);
    std::vector<std::string> ov = {"parallel.cp=" + std::to_string(l.cp), "parallel.ep=" + std::to_string(l.ep)};
    ov.insert(ov.end(), l.extra.begin(), l.extra.end());
    Trainer t(parse_run_config(run.toml, "test run", ov), nullptr, corpus, world());
    ASSERT_EQ(t.mesh().layout().cp, l.cp);
    test::expect_matches(t, refs[key], test::train_steps(t, kSteps), "gdn cp states", 1e-6, 1e-4);
  }
}

const std::string kStates = "primitives.gdn_cp=\"states\"";

TEST(GdnCpStates, LayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  TestRun run = make_run("gdn_cp_states", 4, 8);
  if (R == 2) {
    check_layouts(run, {{2, 1, {kStates}},
                        {2, 1, {kStates, "primitives.recompute=\"full\""}},
                        {2, 1, {kStates, "primitives.recompute=\"selective:gdn,norms\""}},
                        {2, 2, {kStates, "primitives.state=\"fsdp\""}},
                        {2, 1, {kStates, "primitives.state=\"zero1\""}}});
  } else if (R == 3) {
    // 4 key / 8 value heads do not split over 3 ranks: auto takes states.
    check_layouts(run, {{3, 1, {}},
                        {3, 1, {kStates, "primitives.recompute=\"full\"", "primitives.state=\"fsdp\""}},
                        {3, 1, {kStates, "primitives.state=\"zero1\""}}});
  } else if (R == 4) {
    check_layouts(run, {{4, 1, {kStates}},
                        {4, 4, {kStates, "primitives.recompute=\"full\"", "primitives.moe_dispatch=\"chunked_alltoall:2\""}},
                        {2, 2, {kStates, "primitives.state=\"zero1\"", "primitives.moe_dispatch=\"alltoall\""}},
                        {2, 1, {kStates, "primitives.state=\"fsdp\"", "primitives.recompute=\"selective:gdn\""}}});
  } else {
    GTEST_SKIP() << "needs 2, 3 or 4 ranks";
  }
}

// 3 key / 6 value heads: cp 2 cannot split them, so auto takes states and heads is refused.
TEST(GdnCpStates, OddHeadCountsTrainUnderCp2) {
  const int64_t R = world()->size();
  if (R != 2 && R != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("gdn_cp_odd", 3, 6);
  check_layouts(run, {{2, 1, {}}, {2, 1, {"primitives.recompute=\"full\""}}});
  test::expect_error_contains(
      [&] {
        Trainer t(parse_run_config(run.toml, "test run", {"parallel.cp=2", "primitives.gdn_cp=\"heads\""}), nullptr,
                  Corpus{}, world());
      },
      "primitives.gdn_cp = \"states\"");
}

}  // namespace
}  // namespace bb

// Multi-rank: context parallelism in the trainer (parallel.cp, primitives.attention = cp_ring |
// cp_a2a) against the single-rank run on the same data, alone and folded with data and expert
// parallelism. The documents have mixed lengths, several shorter than 2 x cp (so some head-tail
// chunks are empty) and some longer than a micro-batch (split across micro-batches). For every
// layout 5 steps give the single-rank losses, aux and z losses and grad norms to 1e-6 relative,
// the same token counts and the same routing (a hash over every token's row in the whole
// micro-batch and its top-k ids), and the same final weights. On 4 ranks: CP4 (ring and a2a with
// KV heads replicated), CP2 x DP2, CP2 x DP2 with EP2 and with EP4 folded over cp x dp, CP4 x EP4
// with chunked_alltoall:3, and full / selective recompute; on 2 ranks CP2 (ring, a2a) and
// CP2 x EP2; the Qwen3.5 hybrid (Gated DeltaNet layers all-to-all to heads) at CP2 / CP4. The head-tail layout itself and the data movements of the members are tested in
// test_cp_layout (CPU). Bad layouts are clear errors.
// mpi-ranks: 2 4   (every test needs 2 or 4 ranks (cp divides the ranks and the heads))
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/trainer_equivalence.h"
#include "common/tiny_models.h"
#include "models/config.h"
#include "primitives/gdn/gdn_context_parallel.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

using test::world;

constexpr int kSteps = 5;

ModelConfig small_model() { return test::small_moe({.heads = 4, .kv_heads = 2, .head_dim = 8}); }

struct TestRun {
  std::string dir, toml;
};

TestRun make_run(const char* tag) {
  TestRun r;
  r.dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0) std::ofstream(r.dir + "/config.json") << small_model().to_hf_json().dump(2);
  world()->barrier();
  // As in test_expert_parallel: lr 2e-3 keeps AdamW from amplifying legitimate ulp differences;
  // z-loss on so that both router losses are exercised; no shuffle so the short documents
  // land where the list puts them.
  r.toml = "[model]\nconfig = \"" + r.dir + "/config.json\"\n" +
           "[train]\nsteps = 10\nmicro_batch_tokens = 96\nlr = 2e-3\nmin_lr = 2e-4\nwarmup_steps = 2\nseed = 11\n"
           "grad_clip = 0.5\nz_loss_coef = 1e-3\n"
           "[data]\nshuffle = false\n"
           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return r;
}

RunConfig config(const TestRun& r, const std::vector<std::string>& ov) {
  return parse_run_config(r.toml, "test run", ov);
}

struct Layout {
  int64_t cp, ep;
  const char* attention;
  const char* dispatch;
  std::vector<std::string> extra;
};

std::string name(const Layout& l) {
  std::string s = "cp" + std::to_string(l.cp) + " ep" + std::to_string(l.ep) + " " + l.attention + " " + l.dispatch;
  for (const std::string& e : l.extra) s += " " + e;
  return s;
}

std::vector<std::string> overrides(const Layout& l) {
  std::vector<std::string> ov = {"parallel.cp=" + std::to_string(l.cp), "parallel.ep=" + std::to_string(l.ep),
                                 std::string("primitives.attention=\"") + l.attention + "\"",
                                 std::string("primitives.moe_dispatch=\"") + l.dispatch + "\""};
  ov.insert(ov.end(), l.extra.begin(), l.extra.end());
  return ov;
}

void check_layouts(const char* tag, const std::vector<Layout>& layouts, const std::vector<std::string>& common = {}) {
  TestRun run = make_run(tag);
  const Corpus corpus = test::mixed_length_corpus(42);
  // One reference per data-parallel degree (the reference reads dp micro-batches per step).
  std::map<int64_t, test::Reference> refs;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(name(l));
    const int64_t dp = world()->size() / l.cp;
    if (!refs.count(dp)) {
      std::vector<std::string> ov = common;
      ov.push_back("train.grad_accum=" + std::to_string(dp));
      for (const std::string& e : l.extra)
        if (e.rfind("primitives.recompute", 0) == 0) ov.push_back(e);
      refs[dp] = test::reference_run(config(run, ov), corpus, kSteps);
    }
    std::vector<std::string> ov = common;
    const std::vector<std::string> lo = overrides(l);
    ov.insert(ov.end(), lo.begin(), lo.end());
    Trainer t(config(run, ov), nullptr, corpus, world());
    ASSERT_EQ(t.mesh().layout().cp, l.cp);
    ASSERT_EQ(t.mesh().layout().dp, dp);
    // Final weights to 1e-4: the embedding rows of tokens that are last in their document get
    // only the router losses' tiny gradients, whose ulp-level differences (another order of
    // summation over the shards) AdamW turns into full-size updates; measured 1.9e-5 on the
    // embedding with cp 2 x dp 2, 1e-7 on every other unit. Losses and grad norms stay at 1e-6.
    test::expect_matches(t, refs[dp], test::train_steps(t, kSteps), "cp", 1e-6, 1e-4);
  }
}

TEST(ContextParallel, LayoutsEqualTheSingleRankRun) {
  const int64_t R = world()->size();
  if (R == 4) {
    check_layouts("cp_np4", {
                                {4, 1, "cp_ring", "alltoall", {}},
                                {4, 1, "cp_a2a", "alltoall", {}},  // 2 KV heads over 4 ranks: replicated
                                {2, 1, "cp_ring", "alltoall", {}},
                                {2, 2, "cp_ring", "alltoall", {}},
                                {2, 4, "cp_ring", "alltoall", {}},  // EP4 folded over cp x dp
                                {2, 2, "cp_a2a", "alltoall", {}},
                                {4, 4, "cp_ring", "chunked_alltoall:3", {}},
                            });
  } else if (R == 2) {
    check_layouts("cp_np2", {
                                {2, 1, "cp_ring", "allgather", {}},
                                {2, 1, "cp_a2a", "allgather", {}},  // 2 KV heads over 2 ranks: split
                                {2, 2, "cp_ring", "alltoall", {}},
                            });
  } else {
    GTEST_SKIP() << "needs 2 or 4 ranks (runs in the np2 and np4 variants)";
  }
}

// Full recompute reruns the attention forward in backward (the ring / all-to-all again), selective
// drops the core attention's output and rebuilds it; the state families shard over all ranks.
TEST(ContextParallel, RecomputeAndStateFamilies) {
  const int64_t R = world()->size();
  if (R != 2 && R != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  check_layouts("cp_recompute",
                {
                    {R, 1, "cp_ring", "alltoall", {"primitives.recompute=\"full\""}},
                    {R, 1, "cp_a2a", "alltoall", {"primitives.recompute=\"selective:core_attention,norms\""}},
                    {2, 2, "cp_ring", "alltoall", {"primitives.state=\"fsdp\""}},
                    {2, 2, "cp_a2a", "chunked_alltoall:2", {"primitives.state=\"zero1\"", "primitives.recompute=\"full\""}},
                });
}

// The Qwen3.5 hybrid: Gated DeltaNet layers go to heads over the whole sequences (HeadExchange)
// while the gated full-attention layer runs cp_ring or cp_a2a. 3 GDN layers + 1 attention layer,
// 4 key / 8 value heads so that cp 2 and cp 4 both split them.
ModelConfig small_qwen35() {
  ModelConfig c = test::qwen35_config({.vocab = 264, .hidden = 32, .layers = 4, .lin_key_heads = 4, .lin_value_heads = 8});
  c.eos_token_id = 256;
  return c;
}

TEST(ContextParallel, GatedDeltaNetLayersGoToHeads) {
  const int64_t R = world()->size();
  if (R != 2 && R != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  TestRun run = make_run("cp_qwen35");
  if (world()->rank() == 0) std::ofstream(run.dir + "/q35.json") << small_qwen35().to_hf_json().dump(2);
  world()->barrier();
  const std::vector<std::string> model = {"model.config=\"" + run.dir + "/q35.json\""};
  std::vector<Layout> layouts = {{R, 1, "cp_ring", "alltoall", {}},
                                 {R, 1, "cp_a2a", "alltoall", {"primitives.recompute=\"selective\""}},
                                 {2, 2, "cp_ring", "chunked_alltoall:2", {"primitives.recompute=\"full\""}}};
  check_layouts("cp_qwen35_run", layouts, model);
}

TEST(ContextParallel, BadLayoutsAreClearErrors) {
  const int64_t R = world()->size();
  if (R < 2) GTEST_SKIP() << "needs 2 or more ranks";
  TestRun run = make_run("cp_bad");
  const std::string cp = "parallel.cp=" + std::to_string(R);
  // sdpa cannot attend across ranks.
  test::expect_error_contains([&] { Trainer t(config(run, {cp}), nullptr, Corpus{}, world()); },
                                  "primitives.attention = \"cp_ring\"");
  // cp_a2a needs the query heads divisible by cp: R + 1 heads over R ranks.
  {
    ModelConfig m = small_model();
    m.num_heads = R + 1;
    m.num_kv_heads = 1;
    if (world()->rank() == 0) std::ofstream(run.dir + "/odd.json") << m.to_hf_json().dump(2);
    world()->barrier();
    test::expect_error_contains(
        [&] {
          Trainer t(config(run, {cp, "primitives.attention=\"cp_a2a\"", "model.config=\"" + run.dir + "/odd.json\""}),
                    nullptr, Corpus{}, world());
        },
        "cp_a2a");
  }
  // Gated DeltaNet layers by heads split their key and value heads over cp: 16 / 32 heads, cp 3
  // (on 3 ranks a layout cannot be built, so the check itself is called); auto takes states.
  test::expect_error_contains([] { gdn_cp_by_states(GdnCpMode::heads, 16, 32, 3); }, "common divisors of 16 and 32");
  EXPECT_TRUE(gdn_cp_by_states(GdnCpMode::automatic, 16, 32, 3));
  EXPECT_FALSE(gdn_cp_by_states(GdnCpMode::automatic, 16, 32, 4));
}

}  // namespace
}  // namespace bb

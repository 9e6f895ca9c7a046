// The memory estimator (plan/estimate.h) against what the allocator measures on CPU ranks.
//
// Exact categories: on R real ranks (mpirun 1 / 2 / 3 / 4; 3 divides no unit evenly), every state
// family with the layouts R allows (dp, dp x ep, cp x ep), f32 and bf16 reductions, fsdp's
// per-step reduction with two micro-batches: the predicted params, grads, optimizer and comm
// peaks equal the measured maxima over ranks to the byte.
// Activations, logits and moe depend on routing, which real ranks leave to the data: they are
// checked within 2 % on one process playing a rank of a larger job (parallel.comm = "emulated",
// balanced routing), and on real ranks for a dense model (no routing).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "plan/estimate.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

using test::world;
using C = MemCategory;

struct Case {
  std::string name;
  std::vector<std::string> set;
};

std::string write_model(const char* tag, const ModelConfig& m) {
  const std::string dir = test::shared_tmpdir(tag);
  if (world()->rank() == 0) std::ofstream(dir + "/config.json") << m.to_hf_json().dump(2);
  world()->barrier();
  return dir + "/config.json";
}

RunConfig config(const std::string& model, const std::vector<std::string>& set) {
  const std::string toml = "[model]\nconfig = \"" + model + "\"\n" +
                           "[train]\nsteps = 2\nmicro_batch_tokens = 96\nwarmup_steps = 1\nseed = 5\n"
                           "[data]\npath = \"demo\"\ndemo_documents = 60\n"
                           "[checkpoint]\nevery = 0\nsave_final = false\n";
  return parse_run_config(toml, "test run", set);
}

// Runs two steps and returns the second step's peaks (maximum over ranks).
MemoryStats measure(const RunConfig& cfg, comm::GroupPtr base = nullptr) {
  Trainer t(cfg, nullptr, Corpus{}, base);
  t.train_step();
  return t.train_step().mem_max;
}

double rel(int64_t got, int64_t want) {
  return std::abs(static_cast<double>(got - want)) / std::max<double>(1.0, static_cast<double>(want));
}

const C kExact[] = {C::params, C::grads, C::optimizer, C::comm};
const C kModelled[] = {C::activations, C::logits, C::moe};

TEST(Plan, StateAndCommBytesAreExactOnEveryLayout) {
  const int64_t R = world()->size();
  const std::string model = write_model("plan_exact", test::small_moe({.layers = 3, .experts = 4}));
  std::vector<Case> cases;
  for (const char* state : {"replicated", "zero1", "fsdp"}) {
    const std::string s = std::string("primitives.state=\"") + state + "\"";
    cases.push_back({std::string(state) + " dp", {s}});
    cases.push_back({std::string(state) + " dp bf16 reduce", {s, "backend.grad_reduce_dtype=\"bf16\""}});
    if (4 % R == 0 && R > 1) cases.push_back({std::string(state) + " ep", {s, "parallel.ep=" + std::to_string(R)}});
    // The offloaded optimizer's host state (here the device's memory): 12 bytes optimizer and the
    // gradient's 4-byte copy per element of each master.
    cases.push_back({std::string(state) + " dp adamw_offload", {s, "primitives.optimizer=\"adamw_offload\""}});
  }
  cases.push_back({"fsdp skip_step adamw_offload",
                   {"primitives.state=\"fsdp\"", "train.on_nonfinite=\"skip_step\"",
                    "primitives.optimizer=\"adamw_offload\""}});
  cases.push_back({"fsdp per-step reduce, 2 micro-batches",
                   {"primitives.state=\"fsdp\"", "backend.fsdp_reduce=\"step\"", "train.grad_accum=2"}});
  cases.push_back({"fsdp full recompute", {"primitives.state=\"fsdp\"", "primitives.recompute=\"full\""}});
  cases.push_back({"fsdp skip_step split master",
                   {"primitives.state=\"fsdp\"", "train.on_nonfinite=\"skip_step\"", "model.dtype=\"bf16\"",
                    "backend.master_storage=\"split\""}});
  if (R % 2 == 0)
    cases.push_back({"fsdp cp 2", {"primitives.state=\"fsdp\"", "parallel.cp=2", "primitives.attention=\"cp_ring\""}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const RunConfig cfg = config(model, c.set);
    const plan::MemoryEstimate e = plan::estimate_memory(cfg, R);
    const MemoryStats m = measure(cfg);
    for (C cat : kExact) EXPECT_EQ(e.peak[cat], m.peak_of(cat)) << category_name(cat);
  }
}

TEST(Plan, ActivationsOfADenseModelWithin2Percent) {
  const int64_t R = world()->size();
  ModelConfig m = test::small_moe({.layers = 3, .experts = 0});
  m.num_experts = 0;
  m.top_k = 0;
  const std::string model = write_model("plan_dense", m);
  std::vector<Case> cases = {{"none", {}},
                             {"full", {"primitives.recompute=\"full\""}},
                             {"selective", {"primitives.recompute=\"selective\""}},
                             {"full_ce", {"primitives.loss=\"full_ce\""}},
                             {"fsdp", {"primitives.state=\"fsdp\""}}};
  if (R % 2 == 0) cases.push_back({"cp 2", {"parallel.cp=2", "primitives.attention=\"cp_ring\""}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const RunConfig cfg = config(model, c.set);
    const plan::MemoryEstimate e = plan::estimate_memory(cfg, R);
    const MemoryStats s = measure(cfg);
    for (C cat : kModelled) EXPECT_LE(rel(e.peak[cat], s.peak_of(cat)), 0.02) << category_name(cat) << " predicted " << e.peak[cat] << " measured " << s.peak_of(cat);
    for (C cat : kExact) EXPECT_EQ(e.peak[cat], s.peak_of(cat)) << category_name(cat);
  }
}

// One process playing rank 0 of an R-rank job: balanced routing, so the experts' rows are known.
TEST(Plan, MoeActivationsOfAnEmulatedRankWithin2Percent) {
  if (world()->size() != 1) GTEST_SKIP() << "an emulated rank is the only process of its job (runs at np 1)";
  const std::string model = write_model("plan_moe", test::small_moe({.layers = 3, .experts = 4}));
  test::Qwen35Dims qd;
  qd.vocab = 300;  // the demo corpus' ids are below 264
  ModelConfig q = test::qwen35_config(qd);
  const std::string q35 = write_model("plan_q35", q);
  struct E {
    std::string name, model;
    int64_t ranks;
    std::vector<std::string> set;
  };
  std::vector<E> cases;
  for (int64_t ranks : {1, 2, 4})
    for (const char* disp : {"alltoall", "chunked_alltoall:2", "allgather"})
      for (const char* perm : {"standard", "memory_efficient"})
        for (const char* rc : {"none", "full", "selective"}) {
          if (ranks == 1 && std::string(disp) != "alltoall") continue;
          cases.push_back({std::to_string(ranks) + " ranks " + disp + " " + perm + " " + rc, model, ranks,
                           {"primitives.moe_dispatch=\"" + std::string(disp) + "\"",
                            "primitives.permute=\"" + std::string(perm) + "\"",
                            "primitives.recompute=\"" + std::string(rc) + "\"", "parallel.ep=" + std::to_string(ranks),
                            "primitives.state=\"fsdp\""}});
        }
  // Token-chunked MoE ([backend] moe_chunk_tokens): 96 tokens in 3 or 5 chunks.
  for (int64_t ranks : {1, 2})
    for (const char* disp : {"alltoall", "chunked_alltoall:2"})
      for (const char* perm : {"standard", "memory_efficient"})
        for (const char* rc : {"none", "full", "selective:moe_experts"})
          for (const char* chunk : {"32", "20"}) {
            if (ranks == 1 && std::string(disp) != "alltoall") continue;
            cases.push_back({std::to_string(ranks) + " ranks " + disp + " " + perm + " " + rc + ", moe chunks of " + chunk,
                             model, ranks,
                             {"primitives.moe_dispatch=\"" + std::string(disp) + "\"",
                              "primitives.permute=\"" + std::string(perm) + "\"",
                              "primitives.recompute=\"" + std::string(rc) + "\"", "parallel.ep=" + std::to_string(ranks),
                              "primitives.state=\"fsdp\"", std::string("backend.moe_chunk_tokens=") + chunk}});
          }
  for (const char* rc : {"none", "full"})
    cases.push_back({std::string("qwen3.5 2 ranks ") + rc + ", moe chunks of 40", q35, 2,
                     {"primitives.recompute=\"" + std::string(rc) + "\"", "parallel.ep=2", "primitives.state=\"fsdp\"",
                      "backend.moe_chunk_tokens=40"}});
  for (const char* rc : {"none", "full"})
    cases.push_back({std::string("qwen3.5 2 ranks ") + rc, q35, 2,
                     {"primitives.recompute=\"" + std::string(rc) + "\"", "parallel.ep=2", "primitives.state=\"fsdp\""}});
  for (const E& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> set = c.set;
    set.push_back("parallel.comm=\"emulated\"");
    set.push_back("emulate.ranks=" + std::to_string(c.ranks));
    const RunConfig cfg = config(c.model, set);
    const plan::MemoryEstimate e = plan::estimate_memory(cfg, c.ranks);
    const MemoryStats s = measure(cfg);
    for (C cat : kModelled)
      EXPECT_LE(rel(e.peak[cat], s.peak_of(cat)), 0.02)
          << category_name(cat) << " predicted " << e.peak[cat] << " measured " << s.peak_of(cat);
    for (C cat : kExact) EXPECT_EQ(e.peak[cat], s.peak_of(cat)) << category_name(cat);
  }
}

// parallel = "auto" in a real job: the trainer takes the planner's layout for the job's ranks
// (CPU ranks: no memory limit), logs it, and trains exactly as the same layout given by hand.
TEST(Plan, AutoLayoutTrainsAsTheChosenLayout) {
  const int64_t R = world()->size();
  if (R == 1) GTEST_SKIP() << "one rank has one layout";
  const std::string model = write_model("plan_auto", test::small_moe({.heads = 4, .kv_heads = 2, .head_dim = 8}));
  const RunConfig cfg = config(model, {"parallel.layout=auto", "primitives.state=\"fsdp\""});
  ASSERT_TRUE(cfg.auto_layout());
  std::string why;
  const RunConfig want = plan::choose_auto_layout(cfg, R, 0, &why);
  EXPECT_NE(why.find("parallel = auto chose"), std::string::npos);
  char* buf = nullptr;
  size_t len = 0;
  FILE* log = open_memstream(&buf, &len);
  StepMetrics a;
  {
    Trainer t(cfg, log, Corpus{}, world());
    EXPECT_EQ(t.mesh().layout().cp, want.cp);
    EXPECT_EQ(t.mesh().layout().ep, want.ep);
    EXPECT_EQ(t.mesh().layout().dp, want.dp);
    a = t.train_step();
  }
  std::fclose(log);
  const std::string text(buf, len);
  std::free(buf);
  if (world()->rank() == 0) EXPECT_NE(text.find("[startup] parallel = auto chose"), std::string::npos) << text;
  // The same layout by hand: the same step.
  RunConfig by_hand = config(model, {"primitives.state=\"fsdp\"", "parallel.cp=" + std::to_string(want.cp),
                                     "parallel.ep=" + std::to_string(want.ep),
                                     "primitives.attention=\"" + want.prim.name_of("attention") + "\""});
  Trainer h(by_hand, nullptr, Corpus{}, world());
  const StepMetrics b = h.train_step();
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.grad_norm, b.grad_norm);
}

}  // namespace
}  // namespace bb

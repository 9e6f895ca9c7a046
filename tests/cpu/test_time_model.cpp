// The planner's time model (plan/time_model.h): the calibration table, the FLOPs it prices
// against the model's own FLOP count, the overlap formulas, and the calibration command's code
// path on the CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/testing.h"
#include "models/config.h"
#include "plan/calibrate.h"
#include "plan/estimate.h"
#include "plan/time_model.h"
#include "runtime/run_config.h"

namespace bb {
namespace {

RunConfig gpu_run(const std::string& model, int64_t tokens, const std::vector<std::string>& set = {}) {
  std::vector<std::string> s = set;
  s.push_back("train.micro_batch_tokens=" + std::to_string(tokens));
  return parse_run_config("[model]\nconfig = \"" + model + "\"\n[parallel]\ndevice = \"cuda\"\n", "test", s);
}

plan::TimeEstimate timed(const RunConfig& c, int64_t world = 1) {
  const plan::MemoryEstimate m = plan::estimate_memory(c, world);
  return plan::estimate_time(c, m, plan::Calibration::builtin());
}

TEST(TimeModel, CurvesAreLogLinearAndClamped) {
  plan::Curve c;
  c.pts = {{100, 10}, {10000, 30}};
  EXPECT_DOUBLE_EQ(c.at(50), 10);      // below the first point: its value
  EXPECT_DOUBLE_EQ(c.at(1e6), 30);     // beyond the last
  EXPECT_NEAR(c.at(1000), 20, 1e-12);  // halfway in log x
  EXPECT_DOUBLE_EQ(c.at(100), 10);
  test::expect_error_contains([] { (void)plan::Curve{}.at(1); }, "empty calibration curve");
}

TEST(TimeModel, ChunkPipeline) {
  // One chunk is serial; equal stages in 2 chunks take 2 of 3 stages (send 1, experts 1 beside
  // send 2, return 1 beside experts 2, return 2); more chunks cannot beat the link's send + return.
  EXPECT_DOUBLE_EQ(plan::chunk_pipeline_s(1, 2, 3, 1), 6);
  EXPECT_NEAR(plan::chunk_pipeline_s(2, 2, 2, 2), 4, 1e-12);
  EXPECT_NEAR(plan::chunk_pipeline_s(2, 2, 2, 4), 4, 1e-12);
  // Experts longer than the wire: the flow bound, (a + b + c) / C + (C - 1) / C x b.
  EXPECT_NEAR(plan::chunk_pipeline_s(1, 4, 1, 2), 3 + 2, 1e-12);
  // The link carries both directions: never less than send + return.
  EXPECT_GE(plan::chunk_pipeline_s(3, 0.1, 3, 8), 6);
  // Bounded by the serial time and by the longest stage.
  for (int64_t C : {1, 2, 3, 4, 8})
    for (double b : {0.0, 0.5, 1.0, 4.0}) {
      const double t = plan::chunk_pipeline_s(1, b, 1, C);
      EXPECT_LE(t, 2 + b + 1e-12);
      EXPECT_GE(t, std::max(2.0, b) - 1e-12);
    }
  test::expect_error_contains([] { (void)plan::chunk_pipeline_s(1, 1, 1, 0); }, "chunks must be >= 1");
}

TEST(TimeModel, CalibrationRoundTripsAndRejectsBadFiles) {
  const plan::Calibration& b = plan::Calibration::builtin();
  const plan::Calibration r = plan::Calibration::from_json(b.to_json(), "test");
  EXPECT_EQ(r.to_json().dump(), b.to_json().dump());
  const std::string dir = testing::TempDir() + "bb_time_model";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/cal.json";
  b.save(path);
  EXPECT_EQ(plan::Calibration::load(path).to_json().dump(), b.to_json().dump());

  nlohmann::json j = b.to_json();
  j["gemm_tflops"] = nlohmann::json::array({{1e9, 100}, {1e8, 200}});
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "'gemm_tflops' must have x ascending");
  j = b.to_json();
  j["copy_gbps"] = -1;
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "copy_gbps must be > 0");
  j = b.to_json();
  j.erase("attn_bwd_tflops");
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "no 'attn_bwd_tflops' list");
  j = b.to_json();
  j["format"] = "something else";
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "not a bumblebee calibration");
  {
    std::ofstream f(dir + "/bad.json");
    f << "{ not json";
  }
  test::expect_error_contains([&] { plan::Calibration::load(dir + "/bad.json"); }, "is not valid JSON");
  test::expect_error_contains([&] { plan::Calibration::load(dir + "/missing.json"); }, "cannot read");
  std::filesystem::remove_all(dir);
}

// A calibration with attention curves at head dim 256 prices a head-dim-256 model's attention at
// them (here half the head-dim-128 rate: twice the attention time, nothing else changes) and says
// nothing about the head dim; without them it uses the 128 curves and says so. The entries round
// trip through JSON; a bad entry is an error naming it.
TEST(TimeModel, AttentionIsPricedAtTheModelsHeadDimWhenCalibrated) {
  const RunConfig q35 = gpu_run("configs/models/qwen3.5-35b-a3b-4layer/config.json", 32768);
  ASSERT_EQ(q35.model.head_dim, 256);
  plan::Calibration base = plan::Calibration::builtin();
  base.attn_by_head_dim.clear();
  plan::Calibration with = base;
  plan::Calibration::AttentionRates r;
  r.head_dim = 256;
  r.heads = 16;
  r.fwd_tflops = base.attn_fwd_tflops;
  r.bwd_tflops = base.attn_bwd_tflops;
  for (auto& p : r.fwd_tflops.pts) p.second /= 2;
  for (auto& p : r.bwd_tflops.pts) p.second /= 2;
  with.attn_by_head_dim.push_back(r);
  const plan::MemoryEstimate m = plan::estimate_memory(q35, 1);
  const plan::TimeEstimate a = plan::estimate_time(q35, m, base), b = plan::estimate_time(q35, m, with);
  EXPECT_GT(a.attention, 0);
  EXPECT_NEAR(b.attention / a.attention, 2.0, 1e-9);
  EXPECT_NEAR(b.dense_gemm, a.dense_gemm, 1e-12);
  auto mentions_head_dim = [](const plan::TimeEstimate& t) {
    for (const std::string& s : t.assumptions)
      if (s.find("calibrated head dim") != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(mentions_head_dim(a));
  EXPECT_FALSE(mentions_head_dim(b));
  // A head-dim-128 model is priced as before.
  const RunConfig q3 = gpu_run("configs/models/qwen3-30b-a3b-4layer/config.json", 32768);
  const plan::MemoryEstimate m3 = plan::estimate_memory(q3, 1);
  EXPECT_EQ(plan::estimate_time(q3, m3, base).attention, plan::estimate_time(q3, m3, with).attention);
  // JSON.
  const plan::Calibration back = plan::Calibration::from_json(with.to_json(), "test");
  EXPECT_EQ(back.to_json().dump(), with.to_json().dump());
  ASSERT_EQ(back.attn_by_head_dim.size(), 1u);
  nlohmann::json j = with.to_json();
  j["attention_head_dims"][0]["bwd_tflops"] = nlohmann::json::array({{8192, 1.0}, {4096, 2.0}});
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "attention_head_dims[head_dim 256]");
  j = with.to_json();
  j["attention_head_dims"][0].erase("heads");
  test::expect_error_contains([&] { plan::Calibration::from_json(j, "f"); }, "needs integers head_dim and heads");
}

// Every FLOP the model prices, without recompute, equals the model's FLOP count (models/config.cpp
// model_flops, written independently for the TFLOP/s column): no GEMM left out or counted twice.
// Under full recompute the extra is one forward of the layers less the experts' fc2.
TEST(TimeModel, PricesExactlyTheModelsFlops) {
  for (const std::string& model : {std::string("configs/models/qwen3-30b-a3b-4layer/config.json"),
                                   std::string("configs/models/qwen3.5-35b-a3b-4layer/config.json"),
                                   std::string("configs/models/qwen3-30b-a3b/config.json")}) {
    for (int64_t tokens : {int64_t{4096}, int64_t{32768}}) {
      SCOPED_TRACE(model + " " + std::to_string(tokens));
      const RunConfig none = gpu_run(model, tokens, {"primitives.recompute=\"none\""});
      const plan::TimeEstimate t = timed(none);
      const double mf = model_flops(none.model, {tokens});
      EXPECT_NEAR(t.flops_counted / mf, 1.0, 1e-12);
      EXPECT_NEAR(t.model_flops / mf, 1.0, 1e-12);
      const RunConfig full = gpu_run(model, tokens, {"primitives.recompute=\"full\""});
      const plan::TimeEstimate f = timed(full);
      const ModelConfig& m = full.model;
      const double head_fwd = 2.0 * tokens * m.hidden_size * m.vocab_size;
      const double fc2 = 2.0 * tokens * m.top_k * m.hidden_size * m.moe_intermediate_size * m.num_moe_layers();
      EXPECT_NEAR(f.flops_counted / (mf + mf / 3 - head_fwd - fc2), 1.0, 1e-12);
      EXPECT_GT(f.step_s, t.step_s);
    }
  }
}

TEST(TimeModel, OneRankHasNoCommunicationAndCostsGrowWithTokens) {
  const std::string m = "configs/models/qwen3-30b-a3b-4layer/config.json";
  double last = 0;
  for (int64_t tokens : {int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    const plan::TimeEstimate t = timed(gpu_run(m, tokens));
    EXPECT_EQ(t.wire_s, 0);
    EXPECT_EQ(t.exposed_gather + t.exposed_reduce + t.exposed_ep + t.exposed_cp, 0);
    EXPECT_GT(t.step_s, last);
    last = t.step_s;
    const double sum = t.dense_gemm + t.expert_gemm + t.attention + t.gdn + t.head + t.elementwise + t.optimizer;
    EXPECT_NEAR(sum, t.step_s, 1e-12);
  }
  // bf16 moments move fewer optimizer bytes.
  EXPECT_LT(timed(gpu_run(m, 8192, {"primitives.optimizer=\"adamw_bf16_moments\""})).optimizer,
            timed(gpu_run(m, 8192)).optimizer);
  // The update in the backward (no clipping) hides part of it.
  EXPECT_LT(timed(gpu_run(m, 8192, {"train.grad_clip=0"})).optimizer, timed(gpu_run(m, 8192)).optimizer);
}

// adamw_offload: the exposed host time is at least the embedding's and layer 0's updates (the
// next forward cannot start layer 0 before both), at most the whole host update plus its copies
// and the device's own passes, and it grows when the host is slower.
TEST(TimeModel, OptimizerOffloadPricesTheHostLeadOverTheForward) {
  const std::string m = "configs/models/qwen3-30b-a3b-4layer/config.json";
  const std::string off = "primitives.optimizer=\"adamw_offload\"";
  const RunConfig c = gpu_run(m, 131072, {off});
  const plan::MemoryEstimate e = plan::estimate_memory(c, 1);
  const double E = static_cast<double>(e.host_optimizer) / 16.0;
  ASSERT_GT(E, 3e9);  // 3.1 B parameters
  EXPECT_EQ(e.peak[MemCategory::optimizer], 0);
  plan::Calibration cal = plan::Calibration::builtin();
  const double VH = 151936.0 * 2048.0;
  const double layer = (E - 2 * VH) / 4;
  auto host = [&](double elems) { return elems / (cal.host_adamw_geps * 1e9) + 2 * elems / (cal.pcie_gbps * 1e9); };
  const plan::TimeEstimate t = plan::estimate_time(c, e, cal);
  EXPECT_GE(t.optimizer, host(VH) + host(layer));
  EXPECT_LE(t.optimizer, host(E) + E * 8 / (cal.copy_gbps * 1e9));
  cal.host_adamw_geps /= 4;
  EXPECT_GT(plan::estimate_time(c, e, cal).optimizer, t.optimizer);
}

// On an emulated 8-GPU job the exposed communication of each class is at most its wire time, and
// chunking the all-to-all hides some of it.
TEST(TimeModel, ExposedCommunicationIsBoundedByTheWire) {
  const std::string m = "configs/models/qwen3-30b-a3b/config.json";
  const std::vector<std::string> base = {"parallel.comm=\"emulated\"", "emulate.ranks=8", "parallel.ep=8",
                                         "primitives.state=\"fsdp\"", "primitives.recompute=\"full\""};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> s = base;
    s.insert(s.end(), extra.begin(), extra.end());
    return gpu_run(m, 16384, s);
  };
  const RunConfig plain = with({"primitives.moe_dispatch=\"alltoall\""});
  const RunConfig chunked = with({"primitives.moe_dispatch=\"chunked_alltoall:2\""});
  const plan::MemoryEstimate pm = plan::estimate_memory(plain, 8);
  const plan::TimeEstimate p = plan::estimate_time(plain, pm, plan::Calibration::builtin());
  const plan::TimeEstimate c = timed(chunked, 8);
  EXPECT_GT(pm.comm.ep_s, 0);
  EXPECT_LE(p.exposed_ep, pm.comm.ep_s + 1e-12);
  EXPECT_LE(p.exposed_gather, pm.comm.param_gather_s + 1e-12);
  EXPECT_LE(p.exposed_reduce, pm.comm.grad_reduce_s + 1e-12);
  EXPECT_GE(p.exposed_ep, 0);
  EXPECT_LT(c.exposed_ep, p.exposed_ep);
  EXPECT_NE(c.assumptions.back().find("emulate"), std::string::npos);
  // A slower network is never faster.
  RunConfig slow = plain;
  slow.emulate.link.intra_gbps /= 10;
  EXPECT_GT(timed(slow, 8).step_s, p.step_s);
}

// `bumblebee plan --calibrate --quick` runs the same code on the CPU: every curve is filled with
// positive rates, and the file loads back.
TEST(TimeModel, CalibrateRunsOnTheCpu) {
  int lines = 0;
  const plan::Calibration c = plan::calibrate(Device::cpu(), true, [&](const std::string&) { ++lines; });
  EXPECT_EQ(c.device, "cpu");
  EXPECT_GE(c.gemm_tflops.pts.size(), 2u);
  EXPECT_EQ(c.grouped_tflops.pts.size(), 2u);
  EXPECT_EQ(c.attn_fwd_tflops.pts.size(), 2u);
  ASSERT_EQ(c.attn_by_head_dim.size(), 1u);  // a second head dim (256 on a GPU)
  EXPECT_NE(c.attn_by_head_dim[0].head_dim, c.attn_head_dim);
  EXPECT_EQ(c.attn_by_head_dim[0].fwd_tflops.pts.size(), 2u);
  EXPECT_EQ(c.gdn_bwd_ns.pts.size(), 2u);
  EXPECT_GT(c.elementwise_gbps, 0);
  EXPECT_GT(c.copy_gbps, 0);
  EXPECT_GE(lines, 6);
  const plan::TimeEstimate t = plan::estimate_time(gpu_run("configs/models/demo-tiny/config.json", 512),
                                                   plan::estimate_memory(gpu_run("configs/models/demo-tiny/config.json", 512), 1), c);
  EXPECT_GT(t.step_s, 0);
}

}  // namespace
}  // namespace bb

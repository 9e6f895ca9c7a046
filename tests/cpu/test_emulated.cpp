// Emulated communication (comm/emulated.h, comm/link_model.h) on CPU tensors: the link model's
// times against the formulas worked by hand, what every collective writes (the clone
// semantics), the groups a mesh builds from the emulated world, balanced routing, and the
// trainer in emulated mode (labelled, refusing checkpoints, balanced expert load). The same
// collectives against a real MPI job whose ranks all hold the same data: tests/mpi/test_comm.cpp;
// the wire kernel's timing and the slowed-communication runs on a GPU: tests/gpu/test_emulated_gpu.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "comm/emulated.h"
#include "comm/mesh.h"
#include "common/run.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "primitives/moe/router.h"
#include "runtime/paired.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

using comm::EmulateConfig;
using comm::LinkModel;

std::vector<int> iota(int n, int from = 0) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

// ---- the link model ---------------------------------------------------------------------

TEST(LinkModel, RingCollectivesInsideANode) {
  LinkModel m;  // 8 GPUs per node, 370 GB/s + 10 us inside, 45 GB/s + 20 us between nodes
  const int64_t S = int64_t{1} << 30;
  const std::vector<int> node = iota(8);
  EXPECT_DOUBLE_EQ(m.all_gather_s(node, S), 10e-6 + 7.0 / 8.0 * S / 370e9);
  EXPECT_DOUBLE_EQ(m.reduce_scatter_s(node, S), 10e-6 + 7.0 / 8.0 * S / 370e9);
  EXPECT_DOUBLE_EQ(m.all_reduce_s(node, S), 10e-6 + 2 * 7.0 / 8.0 * S / 370e9);
  EXPECT_DOUBLE_EQ(m.broadcast_s(node, S), 10e-6 + double(S) / 370e9);
  // A group of one moves nothing, and nothing moves in no time.
  EXPECT_EQ(m.all_gather_s({3}, S), 0.0);
  EXPECT_EQ(m.all_reduce_s(node, 0), 0.0);
}

TEST(LinkModel, RingsAcrossNodesShareTheNodesNics) {
  LinkModel m;
  const int64_t S = int64_t{1} << 28;
  // 32 ranks on 4 nodes: 8 NICs a node carry the rings, min(370, 8 x 45) = 360 GB/s.
  EXPECT_DOUBLE_EQ(m.all_gather_s(iota(32), S), 20e-6 + 31.0 / 32.0 * S / 360e9);
  // One member per node (an expert-data group of the seed's 32-GPU recipe): one NIC, 45 GB/s.
  EXPECT_DOUBLE_EQ(m.reduce_scatter_s({0, 8, 16, 24}, S), 20e-6 + 3.0 / 4.0 * S / 45e9);
  // Two members on the busiest node: 90 GB/s.
  EXPECT_DOUBLE_EQ(m.all_gather_s({0, 1, 8}, S), 20e-6 + 2.0 / 3.0 * S / 90e9);
  // Fewer GPUs per node move the same group across nodes.
  LinkModel two = m;
  two.gpus_per_node = 2;
  EXPECT_DOUBLE_EQ(two.all_gather_s(iota(4), S), 20e-6 + 3.0 / 4.0 * S / 90e9);
}

TEST(LinkModel, AllToAllMovesSameNodeAndOtherNodeBytesAtOnce) {
  LinkModel m;
  m.gpus_per_node = 2;
  // Member 1 (world rank 1, node 0) of {0, 1, 2, 3}: peer 0 on its node, peers 2 and 3 beyond.
  const std::vector<int64_t> send = {100, 7, 200, 300}, recv = {400, 7, 50, 50};
  const double t_in = 400 / 370e9, t_out = 500 / 45e9;  // max(sent, received) per class
  EXPECT_DOUBLE_EQ(m.all_to_all_s(iota(4), 1, send, recv), 20e-6 + std::max(t_in, t_out));
  // Inside one node only the intra-node latency and bandwidth count; own rows are free.
  EXPECT_DOUBLE_EQ(m.all_to_all_s(iota(2), 0, {5, 1000}, {5, 10}), 10e-6 + 1000 / 370e9);
  EXPECT_EQ(m.all_to_all_s(iota(2), 0, {5, 0}, {5, 0}), 0.0);
  EXPECT_DOUBLE_EQ(m.send_recv_s(1, 2, 1000), 20e-6 + 1000 / 45e9);
  EXPECT_DOUBLE_EQ(m.send_recv_s(0, 1, 1000), 10e-6 + 1000 / 370e9);
}

TEST(LinkModel, BadValuesNameTheKey) {
  LinkModel m;
  m.inter_gbps = 0;
  try {
    m.validate();
    FAIL() << "accepted a zero bandwidth";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("emulate.inter_gbps"), std::string::npos) << e.what();
  }
  EmulateConfig c;
  c.rank = 8;
  EXPECT_THROW(c.validate(), Error);  // rank outside [0, ranks)
  c = EmulateConfig{};
  c.wire_scale = -1;
  EXPECT_THROW(c.validate(), Error);
}

// ---- what the collectives write ---------------------------------------------------------

EmulateConfig four(int rank) {
  EmulateConfig c;
  c.ranks = 4;
  c.rank = rank;
  return c;
}

Tensor floats(std::vector<float> v) { return Tensor::from_floats(v, {static_cast<int64_t>(v.size())}); }

TEST(EmulatedGroup, ReductionsAreThoseOfIdenticalRanks) {
  comm::GroupPtr g = comm::make_emulated_world(four(1));
  ASSERT_EQ(g->size(), 4);
  ASSERT_EQ(g->rank(), 1);
  EXPECT_EQ(g->backend(), comm::Backend::emulated);
  Tensor t = floats({1, -2, 3.5f});
  g->all_reduce(t)->wait();
  EXPECT_EQ(t.to_floats(), (std::vector<float>{4, -8, 14}));
  g->all_reduce(t, comm::ReduceOp::max)->wait();
  EXPECT_EQ(t.to_floats(), (std::vector<float>{4, -8, 14}));
  // reduce_scatter: 4 x this rank's block (rank 1: elements [2, 4)).
  Tensor in = floats({1, 2, 3, 4, 5, 6, 7, 8}), out = Tensor::zeros({2}, DType::f32, Device::cpu(), MemCategory::other);
  g->reduce_scatter(in, out)->wait();
  EXPECT_EQ(out.to_floats(), (std::vector<float>{12, 16}));
  Tensor b = Tensor::from_floats({1.5f, -3}, {2}, DType::bf16);
  g->all_reduce(b)->wait();
  EXPECT_EQ(b.to_floats(), (std::vector<float>{6, -12}));
  double h[2] = {1.5, -2};
  g->all_reduce_host(h, 2, comm::ReduceOp::sum);
  EXPECT_EQ(h[0], 6.0);
  EXPECT_EQ(h[1], -8.0);
  int64_t k[1] = {7};
  g->all_reduce_host(k, 1, comm::ReduceOp::max);
  EXPECT_EQ(k[0], 7);
}

TEST(EmulatedGroup, GathersRepeatThisRanksBlock) {
  comm::GroupPtr g = comm::make_emulated_world(four(2));
  Tensor in = floats({1, 2}), out = Tensor::zeros({8}, DType::f32, Device::cpu(), MemCategory::other);
  g->all_gather(in, out)->wait();
  EXPECT_EQ(out.to_floats(), (std::vector<float>{1, 2, 1, 2, 1, 2, 1, 2}));
  // In place: this rank's block of out is the input.
  Tensor buf = floats({0, 0, 0, 0, 5, 6, 0, 0});
  g->all_gather(buf.narrow(4, 2), buf)->wait();
  EXPECT_EQ(buf.to_floats(), (std::vector<float>{5, 6, 5, 6, 5, 6, 5, 6}));
  // Uneven counts: the clone's rows where they fit, zeros past them.
  Tensor rows = Tensor::from_floats({1, 2, 3, 4}, {2, 2});
  Tensor all = Tensor::from_floats(std::vector<float>(14, -1.f), {7, 2});
  g->all_gather_v(rows, all, {1, 3, 2, 1})->wait();
  EXPECT_EQ(all.to_floats(), (std::vector<float>{1, 2, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 1, 2}));
  int64_t mine[2] = {4, 5}, got[8] = {};
  g->all_gather_host(mine, got, 2);
  EXPECT_EQ(std::vector<int64_t>(got, got + 8), (std::vector<int64_t>{4, 5, 4, 5, 4, 5, 4, 5}));
}

TEST(EmulatedGroup, AllToAllReceivesWhatThisRankSendsToTheMirroredPeer) {
  // Rank 1 of 4: the block from peer q is what this rank sends to (2 - q) mod 4, i.e. from q = 0,
  // 1, 2, 3 the rows for 2, 1, 0, 3 (a ring shift to the next rank arrives from the previous).
  comm::GroupPtr g = comm::make_emulated_world(four(1));
  std::vector<float> send;
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 2 * (p + 1); ++i) send.push_back(static_cast<float>(10 * p + i));  // p + 1 rows of 2
  Tensor in = Tensor::from_floats(send, {10, 2});
  Tensor out = Tensor::from_floats(std::vector<float>(20, -1.f), {10, 2});
  g->all_to_all_v(in, {1, 2, 3, 4}, out, {3, 2, 1, 4})->wait();
  std::vector<float> want;
  for (int q : {2, 1, 0, 3})
    for (int i = 0; i < 2 * (q + 1); ++i) want.push_back(static_cast<float>(10 * q + i));
  EXPECT_EQ(out.to_floats(), want);
  // Where the clone's rows do not fit the counts: the first ones, then zeros.
  Tensor out2 = Tensor::from_floats(std::vector<float>(8, -1.f), {4, 2});
  g->all_to_all_v(Tensor::from_floats({1, 2, 3, 4, 5, 6}, {3, 2}), {1, 0, 2, 0}, out2, {0, 0, 1, 3})->wait();
  // from peer 2 (x = 0: one row {1, 2}) one row; from peer 3 (x = 3: no rows) three rows of zeros.
  EXPECT_EQ(out2.to_floats(), (std::vector<float>{1, 2, 0, 0, 0, 0, 0, 0}));
  const int64_t counts[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t recv[8] = {};
  g->all_to_all_host(counts, recv, 2);
  EXPECT_EQ(std::vector<int64_t>(recv, recv + 8), (std::vector<int64_t>{5, 6, 3, 4, 1, 2, 7, 8}));
  EXPECT_THROW(g->all_to_all_v(in, {1, 2, 3, 4}, out, {3, 1, 2, 4}), Error);  // own rows disagree
}

TEST(EmulatedGroup, RecvGetsWhatThisRankSentToTheMirroredPeer) {
  comm::GroupPtr g = comm::make_emulated_world(four(1));
  Tensor a = floats({1, 2, 3}), r = floats({-1, -1, -1});
  g->send(a, 2)->wait();   // to the next rank
  g->recv(r, 0)->wait();   // from the previous one, who sent its own next rank the same
  EXPECT_EQ(r.to_floats(), (std::vector<float>{1, 2, 3}));
  g->recv(r, 3)->wait();  // nothing was sent to the mirrored peer (3): zeros
  EXPECT_EQ(r.to_floats(), (std::vector<float>{0, 0, 0}));
  EXPECT_THROW(g->send(a, 1), Error);
}

TEST(EmulatedGroup, TotalsCountTheModelledWireTime) {
  comm::reset_emulated_totals();
  EmulateConfig c = four(0);
  c.wire_scale = 2;
  comm::GroupPtr g = comm::make_emulated_world(c);
  Tensor in = Tensor::zeros({256}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor out = Tensor::zeros({1024}, DType::f32, Device::cpu(), MemCategory::other);
  g->all_gather(in, out)->wait();
  const comm::EmulatedTotals t = comm::emulated_totals();
  const int gather = 2;  // param_gather
  EXPECT_EQ(std::string(comm::EmulatedTotals::class_name(gather)), "param_gather");
  EXPECT_EQ(t.ops[gather], 1);
  EXPECT_DOUBLE_EQ(t.seconds[gather], 2 * c.link.all_gather_s(iota(4), 4096));
  EXPECT_EQ(t.bytes[gather], 2 * 3 * 1024);
}

// ---- groups of a mesh over the emulated world -------------------------------------------

TEST(EmulatedGroup, MeshGroupsHaveTheRealMembers) {
  // 16 ranks on nodes of 8, dp 4 x cp 4, ep 8 folded over them; this process is rank 13.
  EmulateConfig c;
  c.ranks = 16;
  c.rank = 13;
  ParallelLayout l;
  l.dp = 4;
  l.cp = 4;
  l.ep = 8;
  Mesh mesh(comm::make_emulated_world(c), l);
  // rank = dp_i * cp + cp_i: 13 = 3 * 4 + 1; ep_i = 13 % 8 = 5, edp_i = 1.
  EXPECT_EQ(mesh.dp_rank(), 3);
  EXPECT_EQ(mesh.cp_rank(), 1);
  EXPECT_EQ(mesh.ep_rank(), 5);
  EXPECT_EQ(mesh.edp_rank(), 1);
  EXPECT_EQ(mesh.cp()->world_ranks(), (std::vector<int>{12, 13, 14, 15}));
  EXPECT_EQ(mesh.dp()->world_ranks(), (std::vector<int>{1, 5, 9, 13}));
  EXPECT_EQ(mesh.ep()->world_ranks(), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(mesh.edp()->world_ranks(), (std::vector<int>{5, 13}));
  EXPECT_EQ(mesh.dense()->size(), 16);
  EXPECT_EQ(mesh.ep()->rank(), 5);
  EXPECT_EQ(mesh.edp()->rank(), 1);
  EXPECT_EQ(mesh.cp()->backend(), comm::Backend::emulated);
  // Its peers cannot tell their colors: a split by color alone is refused.
  EXPECT_THROW(mesh.world()->split(0, 0, "x"), Error);
}

// ---- balanced routing --------------------------------------------------------------------

TEST(BalancedRouting, EveryExpertGetsItsShareAndEveryTokenDistinctExperts) {
  for (auto [T, E, K] : {std::tuple<int64_t, int64_t, int64_t>{1000, 128, 8}, {777, 256, 8}, {5, 8, 3}, {64, 6, 6}}) {
    const RouterReplay r = balanced_routing(T, E, K, Device::cpu());
    ASSERT_EQ(r.topk_idx.shape(), (Shape{T, K}));
    const std::vector<int32_t> idx = r.topk_idx.to_ints();
    std::vector<int64_t> count(static_cast<size_t>(E), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> seen;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[static_cast<size_t>(t * K + k)];
        ASSERT_GE(e, 0);
        ASSERT_LT(e, E);
        seen.insert(e);
        ++count[static_cast<size_t>(e)];
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), K) << "token " << t << " repeats an expert";
    }
    EXPECT_EQ(count, r.tokens_per_expert);
    const double share = static_cast<double>(T * K) / static_cast<double>(E);
    for (int64_t c : count) EXPECT_LE(std::fabs(static_cast<double>(c) - share), static_cast<double>(K)) << T << " " << E;
  }
}

// ---- the trainer ---------------------------------------------------------------------------

TEST(EmulatedTrainer, RunsOneRankOfTheJobLabelledAndBalanced) {
  const std::string dir = make_tmpdir();
  ModelConfig m = small_model();
  m.num_layers = 3;
  m.num_experts = 8;
  const std::string run = write_run(dir, m, "");
  const std::vector<std::string> ov = {
      "parallel.comm=\"emulated\"", "emulate.ranks=8", "emulate.rank=3", "parallel.cp=2", "parallel.ep=8",
      "primitives.attention=\"cp_ring\"", "primitives.state=\"fsdp\"", "primitives.moe_dispatch=\"chunked_alltoall:2\"",
      "primitives.recompute=\"full\"", "checkpoint.dir=\"\"", "train.steps=2", "log.metrics=\"" + dir + "/m.jsonl\""};
  const RunConfig cfg = load_run_config(run, ov);
  const std::string log_path = dir + "/log.txt";
  FILE* log = std::fopen(log_path.c_str(), "w");
  std::vector<StepMetrics> steps;
  int64_t layers_moe = 0, tokens = 0;
  {
    Trainer t(cfg, log);
    EXPECT_EQ(t.mesh().layout().dp, 4);
    EXPECT_EQ(t.mesh().world()->size(), 8);
    EXPECT_EQ(t.mesh().ep_rank(), 3);
    layers_moe = t.model().num_moe_layers();
    steps = t.run();
    tokens = cfg.micro_batch_tokens / 2;  // this rank's half of each micro-batch
  }
  std::fclose(log);
  ASSERT_EQ(steps.size(), 2u);
  for (const StepMetrics& s : steps) {
    EXPECT_TRUE(std::isfinite(s.loss));
    // Balanced routing: the rank's experts get tokens x top-k rows per MoE layer (within a row of
    // rounding of the shard), the same as every other rank.
    EXPECT_NEAR(static_cast<double>(s.moe_rows_max), static_cast<double>(layers_moe * tokens * m.top_k),
                static_cast<double>(layers_moe * m.top_k));
    EXPECT_EQ(static_cast<double>(s.moe_rows_max), s.moe_rows_mean);
    EXPECT_EQ(s.tokens, 4 * cfg.micro_batch_tokens);  // the job's: dp 4 micro-batches
  }
  std::ifstream in(log_path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    EXPECT_EQ(line.rfind("[EMULATED 3/8, 370+45 GB/s] ", 0), 0u) << line;
  }
  EXPECT_GT(lines, 5);
  std::ifstream mf(dir + "/m.jsonl");
  ASSERT_TRUE(std::getline(mf, line));
  const nlohmann::json j = nlohmann::json::parse(line);
  ASSERT_TRUE(j.contains("emulated"));
  EXPECT_NE(j["emulated"].get<std::string>().find("EMULATED rank 3 of 8"), std::string::npos);
}

TEST(EmulatedTrainer, IdenticalDataOnEveryRankTrainsLikeOneRank) {
  // With the same document everywhere, replicated state and no expert parallelism, each peer
  // really is a copy of this rank: the emulated data-parallel job's losses are the single rank's
  // (gradients summed over 4 copies, scaled by 4 times the tokens).
  const std::string dir = make_tmpdir();
  ModelConfig m = small_model();
  const std::string run = write_run(dir, m, "");
  Corpus c;
  std::vector<int32_t> doc;
  for (int i = 0; i < 400; ++i) doc.push_back((i * 37 + 11) % 200);
  for (int i = 0; i < 8; ++i) c.add(doc);
  // (No clipping: an emulated rank's gradient norm sums the parts it owns, its peers' parts
  // taken to be the same; with replicated state it owns 1/4 of each unit.)
  const std::vector<std::string> common = {"checkpoint.dir=\"\"", "train.steps=4", "data.shuffle=false",
                                           "train.micro_batch_tokens=400", "train.grad_clip=0"};
  struct Run {
    std::vector<double> loss;
    std::vector<std::vector<float>> grads;  // every parameter's after step 1
  };
  auto run_of = [&](std::vector<std::string> ov) {
    ov.insert(ov.end(), common.begin(), common.end());
    Trainer t(load_run_config(run, ov), nullptr, c);
    Run r;
    for (int i = 0; i < 4; ++i) {
      r.loss.push_back(t.train_step().loss);
      if (i == 0)
        for (Param* p : t.model().params()) r.grads.push_back(p->grad.to_floats());
    }
    return r;
  };
  // Routing is balanced in an emulated run; the single rank is an emulated job of one, so that it
  // routes the same way and the two differ only by the communication.
  const Run emu = run_of({"parallel.comm=\"emulated\"", "emulate.ranks=4"});
  const Run one = run_of({"parallel.comm=\"emulated\"", "emulate.ranks=1"});
  ASSERT_EQ(emu.loss.size(), one.loss.size());
  for (size_t i = 0; i < emu.loss.size(); ++i)
    EXPECT_NEAR(emu.loss[i], one.loss[i], 1e-5 * std::fabs(one.loss[i])) << "step " << i + 1;
  EXPECT_LT(one.loss.back(), one.loss.front());
  // The all-reduced gradient (4 copies, each scaled by 1 / (4 x tokens)) is the single rank's.
  ASSERT_EQ(emu.grads.size(), one.grads.size());
  for (size_t i = 0; i < emu.grads.size(); ++i) EXPECT_LT(test::rel_error(emu.grads[i], one.grads[i]), 1e-6) << i;
}

// The reduction settings change what goes on the wire as documented: fsdp_reduce = "step"
// reduce-scatters every unit once per step instead of once per micro-batch (grad_accum 2: one
// reduce-scatter less per unit), grad_reduce_dtype = "bf16" halves the bytes of the gradient
// reduce-scatters.
TEST(EmulatedTrainer, ReductionSettingsChangeWhatTheWireCarries) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  struct Wire {
    int64_t ops = 0, bytes = 0;
    size_t units = 0;
  };
  auto wire_of = [&](const std::string& setting) {
    Trainer t(load_run_config(run, {"parallel.comm=\"emulated\"", "emulate.ranks=4", "primitives.state=\"fsdp\"",
                                    "train.grad_accum=2", "checkpoint.dir=\"\"", "train.grad_clip=0", setting}),
              nullptr);
    comm::reset_emulated_totals();
    t.train_step();
    const comm::EmulatedTotals e = comm::emulated_totals();
    Wire w;
    for (int c = 0; c < comm::EmulatedTotals::kClasses; ++c)
      if (std::string(comm::EmulatedTotals::class_name(c)) == "grad_reduce") {
        w.ops = e.ops[c];
        w.bytes = e.bytes[c];
      }
    w.units = t.model().units().size();
    return w;
  };
  const Wire micro = wire_of("backend.fsdp_reduce=\"micro_batch\""), step = wire_of("backend.fsdp_reduce=\"step\"");
  const Wire bf16 = wire_of("backend.grad_reduce_dtype=\"bf16\"");
  ASSERT_GT(micro.units, 0u);
  EXPECT_EQ(micro.ops - step.ops, static_cast<int64_t>(micro.units));
  EXPECT_EQ(bf16.ops, micro.ops);
  // The f32 reduce-scatters' bytes are halved; the step's few small f32 all-reduces (loss, norm)
  // stay, so the ratio is a little above 1/2.
  EXPECT_GT(static_cast<double>(bf16.bytes), 0.49 * static_cast<double>(micro.bytes));
  EXPECT_LT(static_cast<double>(bf16.bytes), 0.52 * static_cast<double>(micro.bytes));
}

// Gated DeltaNet layers under cp (skills/gdn-cp-states.md): what each member puts on the cp wire
// in one step of one emulated rank (rank 0 of cp 4), one 512-token sequence per micro-batch,
// recompute none. Per GDN layer, P = 4, f32 projections on the CPU (4 bytes):
//   heads   14 all-to-alls, each moving (P-1)/P of T_local rows each way: 2 x 2 (P-1)/P T (2 Hk Dk
//           + 3 Hv Dv + 2 Hv) 4 bytes (sent + received) over the forward and backward;
//   states  2 all-gathers of the pieces' summaries, 2 (P-1) x 2 Hv K (K + V) 4 bytes each, and 6 of
//           the conv halo (3 forward, 3 backward), 2 x 2 (P-1)(W-1) C_i 4 bytes each for rank 0
//           (C = Hk Dk, Hk Dk, Hv Dv).
// The attention layer's ring is the same under both, so the difference is the GDN layers' alone.
TEST(EmulatedTrainer, GdnCpStatesMovesSummariesNotActivations) {
  const std::string dir = make_tmpdir();
  ModelConfig m = test::qwen35_config({.vocab = 264, .hidden = 32, .layers = 4, .lin_key_heads = 4, .lin_value_heads = 8});
  m.eos_token_id = 256;
  const std::string run = write_run(dir, m, "");
  Corpus c;
  std::vector<int32_t> doc;
  for (int i = 0; i < 512; ++i) doc.push_back((i * 37 + 11) % 200);
  for (int i = 0; i < 4; ++i) c.add(doc);
  struct Wire {
    int64_t ops = 0, bytes = 0;
  };
  auto wire_of = [&](const char* member) {
    Trainer t(load_run_config(run, {"parallel.comm=\"emulated\"", "emulate.ranks=4", "parallel.cp=4",
                                    "primitives.attention=\"cp_ring\"", std::string("primitives.gdn_cp=\"") + member + "\"",
                                    "checkpoint.dir=\"\"", "train.micro_batch_tokens=512", "data.shuffle=false",
                                    "train.grad_clip=0"}),
              nullptr, c);
    comm::reset_emulated_totals();
    t.train_step();
    const comm::EmulatedTotals e = comm::emulated_totals();
    Wire w;
    for (int k = 0; k < comm::EmulatedTotals::kClasses; ++k)
      if (std::string(comm::EmulatedTotals::class_name(k)) == "cp") w = {e.ops[k], e.bytes[k]};
    return w;
  };
  const Wire heads = wire_of("heads"), states = wire_of("states");
  const int64_t P = 4, T = 512 / P, W = m.linear_conv_kernel_dim, L = 3;
  const int64_t Hk = m.linear_num_key_heads, Hv = m.linear_num_value_heads, Dk = m.linear_key_head_dim,
                Dv = m.linear_value_head_dim;
  const int64_t heads_b = L * 2 * 2 * (P - 1) * T / P * (2 * Hk * Dk + 3 * Hv * Dv + 2 * Hv) * 4;
  const int64_t states_b = L * (2 * 2 * (P - 1) * 2 * Hv * Dk * (Dk + Dv) * 4 +
                                2 * 2 * 2 * (P - 1) * (W - 1) * (2 * Hk * Dk + Hv * Dv) * 4);
  EXPECT_EQ(heads.ops - states.ops, L * (14 - 8));
  EXPECT_EQ(heads.bytes - states.bytes, heads_b - states_b);
}

// Every shipped run config parses, and the 8-GPU recipe's layout fits an emulated job of 8 as it
// fits 8 processes (what bench/emulated.sh and skills/emulated-comm.md run).
TEST(EmulatedTrainer, ShippedConfigsParseAndTheRecipeFitsEightEmulatedRanks) {
  for (const char* path : {"configs/demo.toml", "configs/qwen3-30b-a3b-4layer-gpu.toml", "configs/qwen3-30b-a3b-8gpu.toml",
                           "configs/qwen3.5-35b-a3b-4layer-gpu.toml"}) {
    SCOPED_TRACE(path);
    const RunConfig c = load_run_config(path, {"parallel.comm=\"emulated\"", "emulate.ranks=8", "checkpoint.dir=\"\"",
                                               "checkpoint.resume=\"\"", "parallel.device=\"cpu\""});
    EXPECT_EQ(c.comm, "emulated");
  }
  const RunConfig r = load_run_config("configs/qwen3-30b-a3b-8gpu.toml",
                                      {"parallel.comm=\"emulated\"", "emulate.ranks=8", "parallel.device=\"cpu\""});
  const ParallelLayout l = resolve_layout(r, 8);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.cp, 2);
  EXPECT_EQ(l.ep, 8);
  EXPECT_EQ(r.backend.max_layers_ahead, 2);
  EXPECT_THROW(resolve_layout(r, 6), Error);
}

TEST(EmulatedTrainer, RefusesCheckpointsAndLayoutsThatDoNotFit) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  try {
    load_run_config(run, {"parallel.comm=\"emulated\""});  // write_run sets checkpoint.dir
    FAIL() << "an emulated run accepted checkpoint.dir";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.dir"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_run_config(run, {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\"", "checkpoint.resume=\"x\""}),
               Error);
  EXPECT_THROW(load_run_config(run, {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\"", "emulate.ranks=0"}), Error);
  EXPECT_THROW(load_run_config(run, {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\"", "emulate.bogus=1"}), Error);
  // The layout must fit the emulated job.
  const RunConfig cfg = load_run_config(run, {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\"", "emulate.ranks=6",
                                              "parallel.ep=4"});
  EXPECT_THROW(Trainer(cfg, nullptr), Error);
  // paired compares numerics, which an emulated rank does not have.
  PairedOptions po;
  po.config_path = run;
  po.common = {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\""};
  po.b = {"primitives.loss=\"full_ce\""};
  po.steps = 1;
  try {
    run_paired(po, nullptr);
    FAIL() << "paired accepted an emulated run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("emulated"), std::string::npos) << e.what();
  }
  // A device-memory cap is for GPU runs.
  EXPECT_THROW(Trainer(load_run_config(run, {"parallel.comm=\"emulated\"", "checkpoint.dir=\"\"",
                                             "emulate.device_memory_gib=80"}),
                       nullptr),
               Error);
}

}  // namespace
}  // namespace bb

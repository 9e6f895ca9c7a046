// Trainer: determinism, resume equivalence, checkpoint safety, LR schedule, metrics, configs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/run.h"
#include "common/testing.h"
#include "common/tiny_models.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "models/hf_io.h"
#include "runtime/checkpoint.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

const std::string kSplitMaster = "backend.master_storage=\"split\"";
const std::string kF32Master = "backend.master_storage=\"f32\"";
const std::string kBf16Params = "model.dtype=\"bf16\"";

std::vector<double> losses(const std::vector<StepMetrics>& v) {
  std::vector<double> out;
  for (const auto& m : v) out.push_back(m.loss);
  return out;
}

TEST(Trainer, DeterministicAndLossFalls) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  // One after the other: a checkpoint root is held by one run at a time.
  auto la = losses(Trainer(load_run_config(run), nullptr).run());
  auto lb = losses(Trainer(load_run_config(run), nullptr).run());
  EXPECT_EQ(la, lb);  // bit-identical given the seed
  ASSERT_EQ(la.size(), 20u);
  EXPECT_NEAR(la.front(), std::log(264.0), 0.3);  // starts near ln(vocab)
  EXPECT_LT(la.back(), la.front() - 1.0);           // and learns
}

TEST(Trainer, ResumeContinuesTheSameRun) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  auto l_straight = losses(Trainer(load_run_config(run), nullptr).run());

  std::vector<double> l_split;
  {
    Trainer first(load_run_config(run, {"train.steps=20"}), nullptr);
    for (int i = 0; i < 10; ++i) l_split.push_back(first.train_step().loss);
    const std::string ck = first.save_checkpoint(dir + "/ckpt");
    EXPECT_TRUE(path_exists(ck + "/shards/rank_00000.safetensors"));
    EXPECT_TRUE(path_exists(ck + "/state.json"));
    EXPECT_EQ(read_file(dir + "/ckpt/latest"), "step_00000010\n");
    // `latest` may only name a directory of its root: a path out of it is refused, not followed.
    for (const char* bad : {"..\n", "../other/step_00000010\n", "step_00000010/..\n", "\n"}) {
      const std::string root = dir + "/bad_root";
      make_dirs(root);
      atomic_write(root + "/latest", bad);
      test::expect_error_contains([&] { resolve_checkpoint(root); }, "not a step directory of this root");
    }
  }

  Trainer second(load_run_config(run, {"checkpoint.resume=\"auto\""}), nullptr);
  EXPECT_EQ(second.step(), 10);
  for (const auto& m : second.run()) l_split.push_back(m.loss);
  EXPECT_EQ(l_split, l_straight);  // 10 + resume + 10 == 20 straight, bit for bit
}

TEST(Trainer, BadCheckpointIsAClearErrorAndChangesNothing) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  std::string good, bad;
  {
    Trainer t(load_run_config(run), nullptr);
    for (int i = 0; i < 3; ++i) t.train_step();
    good = t.save_checkpoint(dir + "/ckpt");
    for (int i = 0; i < 2; ++i) t.train_step();
    bad = t.save_checkpoint(dir + "/ckpt");
  }
  // Truncate the newest checkpoint's shard (weights and optimizer state).
  const std::string f = bad + "/shards/rank_00000.safetensors";
  std::string bytes = read_file(f);
  std::ofstream(f, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));

  Trainer u(load_run_config(run), nullptr);
  auto before = u.model().params()[0]->value.to_floats();
  test::expect_error_contains([&] { u.load_checkpoint(bad); }, "rank_00000.safetensors");
  EXPECT_EQ(u.step(), 0);
  EXPECT_EQ(u.model().params()[0]->value.to_floats(), before);  // nothing half-loaded
  // The previous checkpoint is intact and loads.
  u.load_checkpoint(good);
  EXPECT_EQ(u.step(), 3);

  // A checkpoint of another model shape names the differing key.
  const std::string dir2 = make_tmpdir();
  Trainer other(load_run_config(write_run(dir2, small_model(48))), nullptr);
  test::expect_error_contains([&] { other.load_checkpoint(good); }, "hidden_size (checkpoint 32, run 48)");
}

TEST(Trainer, CheckpointsKeepTheNewest) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  Trainer t(load_run_config(run, {"train.steps=6", "checkpoint.every=2", "checkpoint.keep=2"}), nullptr);
  t.run();
  EXPECT_FALSE(path_exists(dir + "/ckpt/step_00000002"));
  EXPECT_TRUE(path_exists(dir + "/ckpt/step_00000004"));
  EXPECT_TRUE(path_exists(dir + "/ckpt/step_00000006"));
  EXPECT_EQ(resolve_checkpoint(dir + "/ckpt"), dir + "/ckpt/step_00000006");
}

// checkpoint.async: periodic saves written by a thread beside the next steps hold the same
// bytes as saves written in the step (every shard, and state.json but for the run id), every
// one is committed by the end of run(), the losses are those of the run without checkpoints,
// and a resume from the last asynchronous one continues it exactly.
TEST(Trainer, AsyncCheckpointsEqualSyncOnes) {
  // f32 values and master; bf16 values with a split master (the snapshot copies its halves and
  // the writer joins them).
  for (const std::vector<std::string>& variant : std::vector<std::vector<std::string>>{{}, {kSplitMaster, kBf16Params}}) {
    SCOPED_TRACE(variant.empty() ? "f32" : "split master");
    const std::string dir = make_tmpdir();
    const std::string run = write_run(dir, small_model(), "");
    std::vector<std::string> base = {"train.steps=9", "checkpoint.every=2", "checkpoint.keep=0",
                                     "checkpoint.save_final=false"};
    base.insert(base.end(), variant.begin(), variant.end());
    std::vector<std::string> sync_ov = base, async_ov = base;
    sync_ov.push_back("checkpoint.dir=\"" + dir + "/sync\"");
    async_ov.push_back("checkpoint.dir=\"" + dir + "/async\"");
    async_ov.push_back("checkpoint.async=true");
    const std::vector<double> l_sync = losses(Trainer(load_run_config(run, sync_ov), nullptr).run());
    const std::string log_path = dir + "/async.log";
    FILE* log = std::fopen(log_path.c_str(), "w");
    ASSERT_NE(log, nullptr);
    const std::vector<double> l_async = losses(Trainer(load_run_config(run, async_ov), log).run());
    std::fclose(log);
    EXPECT_EQ(l_async, l_sync);
    // The saves took the background path: a snapshot, then a commit noting the written shard;
    // the host buffers were made before the first step, shaped as every snapshot needs them (a
    // snapshot allocating any buffer would say so).
    const std::string text = read_file(log_path);
    auto count = [&](const char* what) {
      size_t n = 0;
      for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; ++at) ++n;
      return n;
    };
    EXPECT_EQ(count("snapshot taken"), 4u);
    EXPECT_EQ(count("(written beside training)"), 4u);
    EXPECT_EQ(count("async-save host buffers ready before the first step"), 1u);
    EXPECT_EQ(count("of host buffers allocated"), 0u);
    auto without_run_id = [](const std::string& path) {
      nlohmann::json j = nlohmann::json::parse(read_file(path));
      j.erase("run_id");
      return j.dump();
    };
    for (const char* step : {"step_00000002", "step_00000004", "step_00000006", "step_00000008"}) {
      SCOPED_TRACE(step);
      const std::string a = dir + "/async/" + step, b = dir + "/sync/" + step;
      ASSERT_TRUE(path_exists(a + "/state.json"));
      EXPECT_EQ(read_file(a + "/shards/rank_00000.safetensors"), read_file(b + "/shards/rank_00000.safetensors"));
      EXPECT_EQ(without_run_id(a + "/state.json"), without_run_id(b + "/state.json"));
    }
    EXPECT_EQ(resolve_checkpoint(dir + "/async"), dir + "/async/step_00000008");
    std::vector<std::string> resume = {"train.steps=9", "checkpoint.dir=\"\"",
                                       "checkpoint.resume=\"" + dir + "/async/step_00000008\""};
    resume.insert(resume.end(), variant.begin(), variant.end());
    Trainer resumed(load_run_config(run, resume), nullptr);
    EXPECT_EQ(resumed.train_step().loss, l_sync.back());
  }
}

// A step that fails while an asynchronous save is being written (a non-finite update aborts
// the run) does not lose that save: in one process it is committed before the error leaves
// run(), and `latest` names it, as it would the same save written in the step.
TEST(Trainer, AsyncCheckpointBeforeAFailedStepIsCommitted) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  std::string latest[2];
  for (int async = 0; async < 2; ++async) {
    const std::string root = dir + (async ? "/async" : "/sync");
    Trainer t(load_run_config(run, {"train.steps=40", "checkpoint.every=1", "checkpoint.save_final=false",
                                    "checkpoint.dir=\"" + root + "\"", std::string("checkpoint.async=") + (async ? "true" : "false"),
                                    "train.lr=1e5"}),
              nullptr);
    EXPECT_THROW(t.run(), Error);
    latest[async] = resolve_checkpoint(root);
    ASSERT_FALSE(latest[async].empty()) << root;
  }
  EXPECT_EQ(latest[1].substr(latest[1].size() - 13), latest[0].substr(latest[0].size() - 13));
}

// A checkpoint that pruning cannot remove stays, with a warning (it used to stay silently).
// Needs a directory this process cannot change: not as root, who may remove anything.
TEST(Trainer, PruningThatCannotRemoveACheckpointWarns) {
  if (::geteuid() == 0) GTEST_SKIP() << "as root every directory can be changed";
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  const std::string log_path = dir + "/log.txt";
  FILE* log = std::fopen(log_path.c_str(), "w");
  {
    Trainer t(load_run_config(run, {"train.steps=4", "checkpoint.every=2", "checkpoint.keep=1"}), log);
    t.train_step();
    t.train_step();
    t.save_checkpoint(dir + "/ckpt");
    ASSERT_EQ(::chmod((dir + "/ckpt/step_00000002/shards").c_str(), 0555), 0);  // its files cannot be unlinked
    t.train_step();
    t.train_step();
    t.save_checkpoint(dir + "/ckpt");
    ::chmod((dir + "/ckpt/step_00000002/shards").c_str(), 0755);
  }
  std::fclose(log);
  EXPECT_TRUE(path_exists(dir + "/ckpt/step_00000002/shards"));
  EXPECT_NE(read_file(log_path).find("could not remove the old checkpoint"), std::string::npos) << read_file(log_path);
}

// A micro-batch of one token (and a context shard of one token) trains: the MoE aux-loss pool
// used to take an undefined tensor for its column of ones then ("matmul: argument 'a' is
// undefined").
TEST(Trainer, OneTokenMicroBatchesTrain) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  Trainer t(load_run_config(run, {"checkpoint.dir=\"\"", "train.micro_batch_tokens=1", "train.steps=3"}), nullptr);
  for (int i = 0; i < 3; ++i) {
    const StepMetrics m = t.train_step();
    EXPECT_EQ(m.tokens, 1);
    EXPECT_TRUE(m.skipped.empty() || m.skipped == "no_targets") << m.skipped;
    if (m.skipped.empty()) EXPECT_TRUE(std::isfinite(m.loss));
  }
}

TEST(Trainer, LrScheduleWarmupThenCosine) {
  const std::string dir = make_tmpdir();
  RunConfig c = load_run_config(write_run(dir, small_model()), {"train.steps=110", "train.warmup_steps=10",
                                                                "train.lr=1.0", "train.min_lr=0.1"});
  Trainer t(c, nullptr);
  EXPECT_DOUBLE_EQ(t.lr_at(1), 0.1);
  EXPECT_DOUBLE_EQ(t.lr_at(10), 1.0);
  EXPECT_NEAR(t.lr_at(60), 0.55, 1e-12);  // half-way through the decay
  EXPECT_NEAR(t.lr_at(110), 0.1, 1e-12);
}

TEST(Trainer, MetricsFileHasOneObjectPerStep) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()), {"train.steps=3", "log.metrics=\"" + dir + "/m/metrics.jsonl\""}), nullptr);
  t.run();
  std::ifstream in(dir + "/m/metrics.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    for (const char* k : {"step", "loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "tflops", "peak_bytes"})
      EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j["peak_bytes"]["activations"].get<int64_t>(), 0);
    EXPECT_GT(j["tflops"].get<double>(), 0.0);
    EXPECT_EQ(j["step"].get<int>(), ++n);
    EXPECT_EQ(j["run_id"].get<std::string>(), t.run_id());
  }
  EXPECT_EQ(n, 3);
}

// One writer per metrics file: a second run given the same log.metrics is refused (it used to
// truncate the first run's file and interleave rows with it).
TEST(Trainer, MetricsFileHasOneWriter) {
  const std::string dir = make_tmpdir();
  const std::string path = dir + "/metrics.jsonl";
  const int fd = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);  // another run holds it
  Trainer t(load_run_config(write_run(dir, small_model()), {"train.steps=1", "checkpoint.dir=\"\"",
                                                            "log.metrics=\"" + path + "\""}),
            nullptr);
  test::expect_error_contains([&] { t.run(); }, "is being written by another run");
  EXPECT_FALSE(path_exists(path));  // nothing written, nothing truncated
  ::close(fd);
  t.run();  // free again
  EXPECT_TRUE(path_exists(path));
}

TEST(RunConfig, BadConfigsAreClearErrors) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  test::expect_error_contains([&] { load_run_config(run, {"train.stepz=3"}); }, "unknown key 'train.stepz'");
  test::expect_error_contains([&] { load_run_config(run, {"primitives.loss=\"fast_ce\""}); },
                              "primitives.loss = 'fast_ce' in " + run +
                                  " with overrides 'primitives.loss=\"fast_ce\"' is not registered; "
                                  "registered members: full_ce, linear_ce");
  test::expect_error_contains([&] { load_run_config(run, {"train.steps=\"ten\""}); }, "train.steps (in");
  test::expect_error_contains([&] { load_run_config(run, {"parallel.tp=2"}); }, "tensor parallelism is not implemented");
  test::expect_error_contains([&] { load_run_config(run, {"parallel.comm=\"gloo\""}); }, "parallel.comm");
  test::expect_error_contains([&] { load_run_config(run, {"parallel.timeout_s=0"}); }, "parallel.timeout_s");
  // Layouts that cannot run on this one process are refused before anything is allocated.
  test::expect_error_contains([&] { Trainer(load_run_config(run, {"parallel.dp=2"}), nullptr); },
                              "dp x cp x pp = 2 but 1 rank(s) were launched");
  test::expect_error_contains([&] { Trainer(load_run_config(run, {"parallel.ep=3"}), nullptr); },
                              "does not divide the model's 4 routed experts");
  test::expect_error_contains([&] { load_run_config(run, {"train.lr=-1"}); }, "train.lr must be > 0");
  test::expect_error_contains([&] { load_run_config(run, {"optim.lr=1"}); }, "unknown table '[optim]'");
  test::expect_error_contains([&] { load_run_config(run, {"steps=1"}); }, "expected table.key");
  test::expect_error_contains([&] { load_run_config(dir + "/nope.toml"); }, "cannot open run config");
  test::expect_error_contains([&] { parse_run_config("[model\n", "x.toml"); }, "cannot parse x.toml as TOML");
  test::expect_error_contains([&] { parse_run_config("[train]\nsteps = 1\n", "x.toml"); }, "model.config is required");
  // Overrides parse as TOML; a bare word is a string; an unbalanced quote or bracket is an error
  // (it used to become a string holding the quote: checkpoints in a directory named `"`).
  for (const char* bad : {"checkpoint.dir=\"runs/x", "checkpoint.dir='runs/x", "data.path=runs/\"x", "log.every=[1"})
    test::expect_error_contains([&] { load_run_config(run, {bad}); }, "not a TOML value");
  RunConfig c = load_run_config(run, {"primitives.loss=full_ce", "train.lr=0.5", "data.shuffle=false"});
  EXPECT_EQ(c.prim.loss.name, "full_ce");
  EXPECT_DOUBLE_EQ(c.lr, 0.5);
  EXPECT_FALSE(c.data.shuffle);
}

TEST(RunConfig, BackendTableIsParsedCheckedAndSavedInStateJson) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(),
                                    "[backend]\ngrouped_gemm_streams = 2\ngemm_heuristics = \"exact\"\n");
  RunConfig c = load_run_config(run, {"backend.grouped_gemm_same_dtype=multi_stream",
                                      "backend.grouped_gemm_multi_stream_min_flops=5e8",
                                      "backend.grouped_gemm_threaded_enqueue=false",
                                      "backend.grouped_gemm_tma=false", "backend.optimizer_in_backward=false",
                                      "backend.master_storage=\"f32\"", "backend.expert_wgrad_stream=true",
                                      "backend.moe_chunk_tokens=40", "backend.offload_threads=3", "train.steps=1"});
  EXPECT_EQ(c.backend.grouped_gemm_streams, 2);
  EXPECT_EQ(c.backend.moe_chunk_tokens, 40);
  EXPECT_EQ(c.backend.offload_threads, 3);
  EXPECT_NE(c.backend.summary().find("offload_threads=3"), std::string::npos);
  EXPECT_NE(c.backend.summary().find("moe_chunk_tokens=40"), std::string::npos);
  EXPECT_EQ(c.backend.gemm_heuristics, "exact");
  EXPECT_EQ(c.backend.grouped_gemm_same_dtype, "multi_stream");
  EXPECT_DOUBLE_EQ(c.backend.grouped_gemm_multi_stream_min_flops, 5e8);
  EXPECT_FALSE(c.backend.grouped_gemm_threaded_enqueue);
  EXPECT_FALSE(c.backend.grouped_gemm_tma);
  EXPECT_FALSE(c.backend.optimizer_in_backward);
  EXPECT_EQ(c.backend.master_storage, "f32");
  EXPECT_TRUE(c.backend.expert_wgrad_stream);
  EXPECT_NE(c.backend.summary().find("expert_wgrad_stream=true"), std::string::npos);
  EXPECT_NE(c.backend.summary().find("master_storage=f32"), std::string::npos);
  EXPECT_NE(c.backend.summary().find("grouped_gemm_tma=false"), std::string::npos);
  EXPECT_NE(c.backend.summary().find("optimizer_in_backward=false"), std::string::npos);
  EXPECT_NE(c.backend.summary().find("grouped_gemm_streams=2"), std::string::npos);
  // Saved with the checkpoint, read back equal.
  Trainer t(c, nullptr);
  t.train_step();
  const std::string step = t.save_checkpoint(dir + "/ckpt");
  const auto st = nlohmann::json::parse(read_file(path_join(step, "state.json")));
  ASSERT_TRUE(st.contains("backend"));
  EXPECT_EQ(st["backend"].get<BackendConfig>(), c.backend);
  EXPECT_FALSE(st["backend"].get<BackendConfig>() == BackendConfig{});
  // Bad values name the key.
  test::expect_error_contains([&] { load_run_config(run, {"backend.grouped_gemm_streams=17"}); },
                              "backend.grouped_gemm_streams = 17");
  test::expect_error_contains([&] { load_run_config(run, {"backend.gemm_heuristics=fast"}); },
                              "backend.gemm_heuristics = 'fast'");
  test::expect_error_contains([&] { load_run_config(run, {"backend.grouped_gemm_widening=cublas"}); },
                              "is not one of: multi_stream, wmma");
  test::expect_error_contains([&] { load_run_config(run, {"backend.master_storage=\"bf16\""}); },
                              "is not one of: split, f32");
  test::expect_error_contains([&] { load_run_config(run, {"backend.moe_chunk_tokens=-1"}); }, "moe_chunk_tokens");
  test::expect_error_contains([&] { load_run_config(run, {"backend.offload_threads=-2"}); }, "offload_threads");
  test::expect_error_contains(
      [&] { Trainer(load_run_config(run, {"backend.moe_chunk_tokens=1", "train.micro_batch_tokens=8193", "checkpoint.dir=\"\""}), nullptr); },
      "raise backend.moe_chunk_tokens to at least 3");
  test::expect_error_contains([&] { load_run_config(run, {"backend.streams=2"}); },
                              "unknown key 'backend.streams'");
  nlohmann::json bad = nlohmann::json{{"grouped_gemm_streams", 0}};
  test::expect_error_contains([&] { bad.get<BackendConfig>(); }, "backend.grouped_gemm_streams = 0");
}

TEST(RunConfig, LossChunksAreSetSeparatelyAndDefaultToTheLossHeadDefaults) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const LossHeadConfig defaults;
  RunConfig c = load_run_config(run);
  EXPECT_EQ(c.prim.loss_chunks.chunk_tokens, defaults.chunk_tokens);
  EXPECT_EQ(c.prim.loss_chunks.chunk_vocab, defaults.chunk_vocab);
  EXPECT_EQ(c.prim.loss_chunks.fused_chunk_tokens, defaults.fused_chunk_tokens);
  c = load_run_config(run, {"primitives.loss_chunk_tokens=100", "primitives.loss_fused_chunk_tokens=64"});
  EXPECT_EQ(c.prim.loss_chunks.chunk_tokens, 100);
  EXPECT_EQ(c.prim.loss_chunks.fused_chunk_tokens, 64);
  EXPECT_EQ(c.prim.loss_chunks.chunk_vocab, defaults.chunk_vocab);
  test::expect_error_contains([&] { load_run_config(run, {"primitives.loss_fused_chunk_tokens=0"}); },
                              "primitives.loss_fused_chunk_tokens (in");
  // "auto" (the default): linear_ce's 2048 rows, the policy head's rows by its tokens; an integer
  // sets both heads.
  EXPECT_EQ(load_run_config(run).prim.loss_chunks.policy.chunk_tokens, 0);
  EXPECT_EQ(c.prim.loss_chunks.policy.chunk_tokens, 64);
  c = load_run_config(run, {"primitives.loss_fused_chunk_tokens=\"auto\"", "primitives.loss=\"policy\""});
  EXPECT_EQ(c.prim.loss_chunks.fused_chunk_tokens, 2048);
  EXPECT_EQ(c.prim.loss_chunks.policy.chunk_tokens, 0);
  EXPECT_NE(c.primitives_summary().find(" chunk_tokens=auto blocks=auto)"), std::string::npos);
  // primitives.policy_blocks: auto (the default), rows or vocab (policy_config.h PolicyBlocks).
  EXPECT_EQ(c.prim.loss_chunks.policy.blocks, PolicyBlocks::auto_);
  c = load_run_config(run, {"primitives.policy_blocks=\"vocab\"", "primitives.loss=\"policy\""});
  EXPECT_EQ(c.prim.loss_chunks.policy.blocks, PolicyBlocks::vocab);
  EXPECT_NE(c.primitives_summary().find(" blocks=vocab)"), std::string::npos);
  EXPECT_EQ(load_run_config(run, {"primitives.policy_blocks=\"rows\""}).prim.loss_chunks.policy.blocks,
            PolicyBlocks::rows);
  test::expect_error_contains([&] { load_run_config(run, {"primitives.policy_blocks=\"cols\""}); },
                              "primitives.policy_blocks");
  test::expect_error_contains([&] { load_run_config(run, {"primitives.loss_fused_chunk_tokens=\"big\""}); },
                              "must be an integer or \"auto\"");
  c = load_run_config(run, {"primitives.loss_chunk_tokens=100", "primitives.loss_fused_chunk_tokens=64"});
  // primitives.loss_logits: f32 by default; "bf16" for linear_ce only; other names refused.
  EXPECT_FALSE(c.prim.loss_chunks.bf16_logits);
  c = load_run_config(run, {"primitives.loss=\"linear_ce\"", "primitives.loss_logits=\"bf16\""});
  EXPECT_TRUE(c.prim.loss_chunks.bf16_logits);
  EXPECT_NE(c.primitives_summary().find("loss_logits=bf16"), std::string::npos);
  test::expect_error_contains([&] { load_run_config(run, {"primitives.loss_logits=\"fp8\""}); },
                              "primitives.loss_logits must be \"f32\" or \"bf16\"");
  test::expect_error_contains(
      [&] { load_run_config(run, {"primitives.loss=\"full_ce\"", "primitives.loss_logits=\"bf16\""}); },
      "needs loss = \"linear_ce\"");
}

// bf16 logits train like f32 logits: the same run's losses within 1 % at every step, and not
// bit-identical (the option takes effect in training, not only in evaluation).
TEST(RunConfig, Bf16LogitsTrainLikeF32Logits) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const std::string lin = "primitives.loss=\"linear_ce\"";
  auto a = losses(Trainer(load_run_config(run, {lin}), nullptr).run());
  auto b = losses(Trainer(load_run_config(run, {lin, "primitives.loss_logits=\"bf16\""}), nullptr).run());
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-2 * std::fabs(a[i])) << "step " << i;
  EXPECT_NE(a, b);
}

// ---- primitives.optimizer = "adamw_bf16_moments" ----------------------------------------------

const std::string kBf16Moments = "primitives.optimizer=\"adamw_bf16_moments\"";

// 10 steps, save, resume, 10 steps == 20 straight, bit for bit, with bf16 moments; the shards
// hold the moments as bf16 and state.json names the optimizer; the run is not the adamw one.
TEST(Optimizer, Bf16MomentsResumeContinuesTheSameRunBitForBit) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  auto l_straight = losses(Trainer(load_run_config(run, {kBf16Moments}), nullptr).run());
  auto l_adamw = losses(Trainer(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr).run());
  ASSERT_EQ(l_straight.size(), 20u);
  EXPECT_NE(l_straight, l_adamw) << "the optimizer setting had no effect";
  EXPECT_LT(l_straight.back(), l_straight.front() - 1.0);  // it learns

  std::vector<double> l_split;
  {
    Trainer first(load_run_config(run, {kBf16Moments}), nullptr);
    ASSERT_EQ(first.state().moment_dtype(), DType::bf16);
    for (int i = 0; i < 10; ++i) l_split.push_back(first.train_step().loss);
    const std::string ck = first.save_checkpoint(dir + "/ckpt");
    const auto st = nlohmann::json::parse(read_file(path_join(ck, "state.json")));
    EXPECT_EQ(st["optimizer"], "adamw_bf16_moments");
    SafetensorsReader shard(ck + "/shards/rank_00000.safetensors");
    int64_t moments = 0;
    for (const SafetensorsEntry& e : shard.entries()) {
      const bool moment = e.name.find(".exp_avg") != std::string::npos;  // .exp_avg, .exp_avg_sq
      EXPECT_EQ(e.dtype, moment ? DType::bf16 : DType::f32) << e.name;
      moments += moment;
    }
    EXPECT_EQ(moments, 2 * static_cast<int64_t>(first.model().units().size()));
  }
  Trainer second(load_run_config(run, {kBf16Moments, "checkpoint.resume=\"auto\""}), nullptr);
  EXPECT_EQ(second.step(), 10);
  for (const auto& m : second.run()) l_split.push_back(m.loss);
  EXPECT_EQ(l_split, l_straight);
}

// A checkpoint is resumed only by a run of the same optimizer: anything else is an error that
// names both (and the way out), before any state changes. A checkpoint without the field (written
// before it existed) is adamw's; a shard whose moments are not in the dtype state.json promises is
// an error naming the tensor.
TEST(Optimizer, CheckpointOfAnotherOptimizerIsAClearErrorAndChangesNothing) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model(), "");
  std::string f32_ck, bf16_ck;
  {
    Trainer a(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
    for (int i = 0; i < 2; ++i) a.train_step();
    f32_ck = a.save_checkpoint(dir + "/ck_f32");
  }
  {
    Trainer b(load_run_config(run, {kBf16Moments, "checkpoint.dir=\"\""}), nullptr);
    for (int i = 0; i < 2; ++i) b.train_step();
    bf16_ck = b.save_checkpoint(dir + "/ck_bf16");
  }
  Trainer u(load_run_config(run, {kBf16Moments, "checkpoint.dir=\"\""}), nullptr);
  const auto before = u.model().params()[0]->value.to_floats();
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); },
                              "was written with primitives.optimizer = 'adamw' (f32 moments) but this run uses "
                              "'adamw_bf16_moments' (bf16 moments)");
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); }, "Resume with primitives.optimizer = \"adamw\"");
  EXPECT_EQ(u.step(), 0);
  EXPECT_EQ(u.model().params()[0]->value.to_floats(), before);
  Trainer w(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
  test::expect_error_contains([&] { w.load_checkpoint(bf16_ck); },
                              "was written with primitives.optimizer = 'adamw_bf16_moments' (bf16 moments) but this "
                              "run uses 'adamw' (f32 moments)");
  EXPECT_EQ(w.step(), 0);
  // Without the field: adamw. Loads into adamw, refused by bf16 moments.
  const std::string sj = path_join(f32_ck, "state.json");
  auto st = nlohmann::json::parse(read_file(sj));
  st.erase("optimizer");
  std::ofstream(sj) << st.dump(2);
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); }, "primitives.optimizer = 'adamw' (f32 moments)");
  w.load_checkpoint(f32_ck);
  EXPECT_EQ(w.step(), 2);
  // state.json claims bf16 moments, the shard holds f32 ones.
  st["optimizer"] = "adamw_bf16_moments";
  std::ofstream(sj) << st.dump(2);
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); }, ".exp_avg is f32[");
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); }, "expected bf16[");
  EXPECT_EQ(u.step(), 0);
  EXPECT_EQ(u.model().params()[0]->value.to_floats(), before);
  st["optimizer"] = 3;
  std::ofstream(sj) << st.dump(2);
  test::expect_error_contains([&] { u.load_checkpoint(f32_ck); }, "field 'optimizer' must be a string");
}

// [backend] optimizer_in_backward: with clipping off every unit is updated as soon as its
// gradient is final (during the backward), with the bits of the update after the backward: the
// same losses and masters over steps, for both optimizers. With clipping on nothing moves early.
TEST(Optimizer, UpdateDuringTheBackwardIsBitwiseTheUpdateAfterIt) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  for (const std::string& opt : {std::string("primitives.optimizer=\"adamw\""), kBf16Moments}) {
    size_t units = 0, split = 0;
    auto go = [&](const char* in_backward, const char* clip, size_t* early) {
      Trainer t(load_run_config(run, {opt, in_backward, clip, "checkpoint.dir=\"\"", "train.steps=6"}), nullptr);
      std::vector<double> l;
      for (int i = 0; i < 6; ++i) {
        l.push_back(t.train_step().loss);
        if (i == 0) *early = t.state().early_updates();
      }
      units = t.model().units().size();
      split = t.state().embedding_split_updates();
      std::vector<std::vector<float>> ms;
      for (size_t i = 0; i < t.model().units().size(); ++i) {
        ms.push_back(t.state().owned(i).master.to_floats());
        ms.push_back(t.state().owned(i).exp_avg_sq.to_floats());
      }
      for (Param* p : t.model().params()) ms.push_back(p->value.to_floats());
      return std::make_pair(l, ms);
    };
    size_t e_on = 0, e_off = 0, e_clip = 0;
    const auto on = go("backend.optimizer_in_backward=true", "train.grad_clip=0", &e_on);
    // The untied embedding's update was split by rows in every step (untouched rows first).
    EXPECT_EQ(split, 6u) << opt;
    const auto off = go("backend.optimizer_in_backward=false", "train.grad_clip=0", &e_off);
    const auto clip = go("backend.optimizer_in_backward=true", "train.grad_clip=1.0", &e_clip);
    EXPECT_EQ(e_on, units) << opt;  // every unit: one rank holds them all whole
    EXPECT_EQ(e_off, 0u) << opt;
    EXPECT_EQ(e_clip, 0u) << opt;
    EXPECT_EQ(on.first, off.first) << opt;
    EXPECT_EQ(on.second, off.second) << opt;
    EXPECT_NE(on.first, clip.first) << opt << ": the clip setting had no effect";
    EXPECT_LT(on.first.back(), on.first.front()) << opt;
  }
}

// skip_step with updates during the backward: the backup is taken before the first one, so a
// step whose update goes non-finite is undone bit for bit as without them.
TEST(Optimizer, SkipStepUndoesUpdatesMadeDuringTheBackward) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()),
                            {"checkpoint.dir=\"\"", "train.on_nonfinite=\"skip_step\"", "train.lr=1e39",
                             "train.min_lr=1e39", "train.warmup_steps=0", "train.steps=2", "train.grad_clip=0"}),
            nullptr);
  std::vector<std::vector<float>> before;
  for (size_t i = 0; i < t.model().units().size(); ++i) before.push_back(t.state().owned(i).master.to_floats());
  const std::vector<StepMetrics> ms = t.run();
  ASSERT_EQ(ms.size(), 2u);
  for (const StepMetrics& m : ms) EXPECT_EQ(m.skipped, "nonfinite") << "step " << m.step;
  EXPECT_GT(t.state().early_updates(), 0u);
  for (size_t i = 0; i < t.model().units().size(); ++i) EXPECT_EQ(t.state().owned(i).master.to_floats(), before[i]);
  for (Param* p : t.model().params())
    for (float v : p->value.to_floats()) ASSERT_TRUE(std::isfinite(v)) << p->name;
}

// Masters, moments and parameter values of a trainer's state: what skip_step's backup restores.
std::vector<std::vector<float>> state_snapshot(Trainer& t) {
  std::vector<std::vector<float>> v;
  for (size_t i = 0; i < t.model().units().size(); ++i) {
    const ModelState::Owned ow = t.state().owned(i);
    v.push_back(t.state().master_f32(i, 0, ow.len).to_floats());
    v.push_back(ow.exp_avg.to_floats());
    v.push_back(ow.exp_avg_sq.to_floats());
  }
  for (Param* p : t.model().params()) v.push_back(p->value.to_floats());
  return v;
}

// offload() / onload() (sharing the GPU with a rollout engine): the state goes to host memory
// and the model with its device buffers is destroyed; onload() rebuilds it and copies the state
// back. Training then continues bit for bit as if nothing happened: losses, gradient norms,
// masters, moments and values, with an f32 master, a split master on bf16 values (its i16
// remainder and bf16 upper half), bf16 moments with skip_step (its backup rebuilt), and across
// two offload cycles (the host copy reused). Between the two, the model is gone: every call that
// needs it is a clear error.
TEST(Trainer, OffloadOnloadContinuesBitForBit) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const std::vector<std::vector<std::string>> variants = {
      {"checkpoint.dir=\"\""},
      {"checkpoint.dir=\"\"", kSplitMaster, kBf16Params},
      {"checkpoint.dir=\"\"", "primitives.optimizer=\"adamw_bf16_moments\"", "train.on_nonfinite=\"skip_step\""}};
  for (const std::vector<std::string>& ov : variants) {
    SCOPED_TRACE(ov.back());
    Trainer straight(load_run_config(run, ov), nullptr);
    std::vector<StepMetrics> want;
    for (int i = 0; i < 6; ++i) want.push_back(straight.train_step());

    Trainer t(load_run_config(run, ov), nullptr);
    std::vector<StepMetrics> got;
    for (int cycle = 0; cycle < 2; ++cycle) {
      for (int i = 0; i < 3 - cycle; ++i) got.push_back(t.train_step());
      const int64_t live_before = allocator_for(Device::cpu()).stats().live_total;
      const OffloadReport off = t.offload();
      EXPECT_TRUE(t.offloaded());
      // Values, masters and moments: at least the optimizer's 12 (8 with bf16 moments) bytes a
      // parameter less the split master's 2.
      EXPECT_GE(off.host_bytes, 6 * t.config().model.num_params());
      // The allocator lost at least what was stashed (the gradients went too).
      EXPECT_LE(off.allocator_live, live_before - off.host_bytes);
      EXPECT_EQ(off.device_used, -1);
      test::expect_error_contains([&] { t.train_step(); }, "call onload() first");
      test::expect_error_contains([&] { t.model(); }, "call onload() first");
      test::expect_error_contains([&] { t.save_checkpoint(dir + "/nope"); }, "call onload() first");
      test::expect_error_contains([&] { t.offload(); }, "call onload() first");
      const OffloadReport on = t.onload();
      EXPECT_FALSE(t.offloaded());
      EXPECT_EQ(on.host_bytes, off.host_bytes);
      test::expect_error_contains([&] { t.onload(); }, "not offloaded");
    }
    got.push_back(t.train_step());  // 3 + 2 + 1 steps around two cycles
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].loss, want[i].loss) << "step " << i + 1;
      EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << "step " << i + 1;
    }
    EXPECT_EQ(state_snapshot(t), state_snapshot(straight));
  }
}

TEST(Trainer, OffloadWaitsForAPendingStep) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()), {"checkpoint.dir=\"\""}), nullptr);
  Corpus batch;
  batch.add(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8});
  t.forward_backward_on(batch);
  test::expect_error_contains([&] { t.offload(); }, "call optim_step first");
  t.optim_step();
  t.offload();
  t.onload();
  EXPECT_TRUE(std::isfinite(t.train_step().loss));
}

// [backend] expert_wgrad_stream moves the experts' weight gradient onto the wgrad stream and
// nothing else: the same losses, masters, moments and values over steps, with grad_accum 2 (the
// second micro-batch adds to the first one's expert gradients) and full recompute. On the CPU
// every stream's work is done when issued, so this checks the plumbing and that the gradient is
// still computed once per micro-batch; tests/gpu/test_emulated_gpu.cpp checks the streams.
TEST(Trainer, ExpertWgradStreamIsBitIdentical) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  auto go = [&](const char* on, const char* recompute) {
    Trainer t(load_run_config(run, {on, recompute, "train.grad_accum=2", "checkpoint.dir=\"\"", "train.steps=4"}),
              nullptr);
    std::vector<double> l;
    for (int i = 0; i < 4; ++i) l.push_back(t.train_step().loss);
    return std::make_pair(l, state_snapshot(t));
  };
  for (const char* recompute : {"primitives.recompute=\"none\"", "primitives.recompute=\"full\""}) {
    const auto off = go("backend.expert_wgrad_stream=false", recompute);
    const auto on = go("backend.expert_wgrad_stream=true", recompute);
    EXPECT_EQ(on.first, off.first) << recompute;
    EXPECT_EQ(on.second, off.second) << recompute;
    EXPECT_LT(on.first.back(), on.first.front()) << recompute;
  }
}

// An overflowing step after save_backup flags a unit and changes the state; restore_backup puts
// every bit of it back.
void expect_backup_restores_the_state(Trainer& t) {
  const auto before = state_snapshot(t);
  t.state().save_backup();
  Tensor flags = Tensor::zeros({static_cast<int64_t>(t.state().num_units())}, DType::i32, Device::cpu(),
                               MemCategory::workspace);
  t.state().step(3, 1e39, 0.1, AdamWConfig{}, &flags);
  EXPECT_EQ(flags.to_ints()[0], 1);
  EXPECT_NE(state_snapshot(t), before);
  t.state().restore_backup();
  EXPECT_EQ(state_snapshot(t), before);
}

// ---- [backend] master_storage = "split" (bf16 parameters) ------------------------------------------


// On bf16 parameters the split master trains as the separate f32 master does (its values differ
// only where a master sits exactly on a bf16 tie); 10 steps, save, resume, 10 steps == 20
// straight bit for bit; the shards hold the f32 masters (joined), so either storage resumes the
// other's checkpoints, the masters bit for bit; the backup restores both halves; 10 optimizer
// bytes per element; split is the default for bf16 parameters and f32 parameters keep an f32
// master whatever the setting; an unknown storage is an error.
TEST(Optimizer, SplitMasterTrainsAsTheF32MasterResumesAndSharesItsCheckpoints) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  auto l_split = losses(Trainer(load_run_config(run, {kSplitMaster, kBf16Params}), nullptr).run());
  auto l_adamw = losses(Trainer(load_run_config(run, {kBf16Params, kF32Master, "checkpoint.dir=\"\""}), nullptr).run());
  ASSERT_EQ(l_split.size(), 20u);
  for (size_t i = 0; i < l_split.size(); ++i) EXPECT_NEAR(l_split[i], l_adamw[i], 2e-3 * l_adamw[i]) << "step " << i;
  EXPECT_LT(l_split.back(), l_split.front() - 1.0);

  std::vector<double> l_resumed;
  std::string ck;
  std::vector<std::vector<float>> masters;
  {
    Trainer first(load_run_config(run, {kSplitMaster, kBf16Params, "checkpoint.dir=\"\""}), nullptr);
    for (int i = 0; i < 10; ++i) l_resumed.push_back(first.train_step().loss);
    ck = first.save_checkpoint(dir + "/ck_split");
    for (size_t i = 0; i < first.model().units().size(); ++i)
      masters.push_back(first.state().gather_master(i).to_floats());
    SafetensorsReader shard(ck + "/shards/rank_00000.safetensors");
    for (const SafetensorsEntry& e : shard.entries()) EXPECT_EQ(e.dtype, DType::f32) << e.name;
    // The values are the masters' upper halves: the masters round to them ties away.
    for (Param* p : first.model().params()) {
      const std::vector<float> v = p->value.to_floats(),
                               m = unit_slice(first.state().gather_master(static_cast<size_t>(p->unit->index)), *p)
                                       .to_floats();
      for (size_t k = 0; k < v.size(); ++k) {
        uint32_t b;
        std::memcpy(&b, &m[k], 4);
        ASSERT_EQ(f32_to_bf16(v[k]), split_master_hi(b)) << p->name << " " << k;
      }
    }
  }
  {
    Trainer second(load_run_config(run, {kSplitMaster, kBf16Params, "checkpoint.dir=\"\""}), nullptr);
    second.load_checkpoint(ck);
    EXPECT_EQ(second.step(), 10);
    for (int i = 0; i < 10; ++i) l_resumed.push_back(second.train_step().loss);
    EXPECT_EQ(l_resumed, l_split);
  }
  {  // the f32 master resumes it with the same masters (its values the masters rounded to nearest even)
    Trainer a(load_run_config(run, {kBf16Params, kF32Master, "checkpoint.dir=\"\""}), nullptr);
    a.load_checkpoint(ck);
    for (size_t i = 0; i < a.model().units().size(); ++i) EXPECT_EQ(a.state().gather_master(i).to_floats(), masters[i]);
    const std::string ck_adamw = a.save_checkpoint(dir + "/ck_adamw");
    Trainer b(load_run_config(run, {kSplitMaster, kBf16Params, "checkpoint.dir=\"\""}), nullptr);
    b.load_checkpoint(ck_adamw);
    for (size_t i = 0; i < b.model().units().size(); ++i) EXPECT_EQ(b.state().gather_master(i).to_floats(), masters[i]);
  }

  // Memory and the skip_step backup.
  Allocator& alloc = allocator_for(Device::cpu());
  Trainer t(load_run_config(run, {kSplitMaster, kBf16Params, "checkpoint.dir=\"\"", "train.on_nonfinite=\"skip_step\""}),
            nullptr);
  int64_t n = 0;
  for (ParamUnit* u : t.model().units()) n += u->numel;
  EXPECT_EQ(optimizer_bytes_per_element(OptimizerKind::adamw, true), 10);
  EXPECT_EQ(optimizer_bytes_per_element(OptimizerKind::adamw_bf16_moments, true), 6);
  EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer), 10 * n);
  for (int i = 0; i < 2; ++i) t.train_step();
  EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer), 2 * 10 * n + 2 * n);  // + the backup and its upper half
  expect_backup_restores_the_state(t);

  // The default for bf16 parameters; f32 parameters keep their f32 masters (12 bytes).
  EXPECT_EQ(load_run_config(run).backend.master_storage, "split");
  {
    const MemoryStats before = alloc.stats();
    Trainer d(load_run_config(run, {kBf16Params, "checkpoint.dir=\"\""}), nullptr);
    EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer) - before.live_of(MemCategory::optimizer), 10 * n);
  }
  {
    const MemoryStats before = alloc.stats();
    Trainer f(load_run_config(run, {kSplitMaster, "checkpoint.dir=\"\""}), nullptr);
    EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer) - before.live_of(MemCategory::optimizer), 12 * n);
  }
  test::expect_error_contains([&] { load_run_config(run, {"backend.master_storage=\"bf16\""}); },
                              "master_storage");
}

// A model with units whose values stay f32 (Qwen3.5's A_log and dt_bias) and bf16 parameters:
// the bf16 units split their masters (10 bytes an element), the f32 ones keep an f32 master
// (12), the closed form says so, and it trains.
TEST(Optimizer, SplitMasterLeavesF32ValueUnitsWithAnF32Master) {
  const std::string dir = make_tmpdir();
  test::Qwen35Dims d;
  d.vocab = 264;  // the demo corpus's byte tokenizer
  const std::string run = write_run(dir, test::qwen35_config(d));
  Allocator& alloc = allocator_for(Device::cpu());
  const MemoryStats before = alloc.stats();
  Trainer t(load_run_config(run, {kBf16Params, "checkpoint.dir=\"\"", "train.steps=3"}), nullptr);
  int64_t want = 0, f32_units = 0;
  std::vector<int64_t> sizes;
  for (ParamUnit* u : t.model().units()) {
    want += (u->f32_values ? 12 : 10) * u->numel;
    f32_units += u->f32_values;
    sizes.push_back(1);
  }
  ASSERT_GT(f32_units, 0);
  EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer) - before.live_of(MemCategory::optimizer), want);
  EXPECT_EQ(state_bytes(StateKind::replicated, t.model().units(), sizes, 2, OptimizerKind::adamw, true).optimizer, want);
  const auto l = losses(t.run());
  ASSERT_EQ(l.size(), 3u);
  for (double x : l) EXPECT_TRUE(std::isfinite(x));
}

TEST(Optimizer, RunConfigNamesTheValidOptimizers) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  EXPECT_EQ(load_run_config(run).prim.optimizer.value, OptimizerKind::adamw);
  EXPECT_EQ(load_run_config(run, {kBf16Moments}).prim.optimizer.value, OptimizerKind::adamw_bf16_moments);
  test::expect_error_contains([&] { load_run_config(run, {"primitives.optimizer=\"adam_bf16\""}); },
                              "primitives.optimizer = 'adam_bf16' in " + run +
                                  " with overrides 'primitives.optimizer=\"adam_bf16\"' is not registered; "
                                  "registered members: adamw, adamw_bf16_moments");
}

// Optimizer bytes are 12 (adamw) or 8 (bf16 moments) per element, and skip_step's backup doubles
// them; the backup restores masters and both moments bit for bit, and the values from the masters.
TEST(Optimizer, OptimizerBytesAndSkipStepBackupCoverTheMoments) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  Allocator& alloc = allocator_for(Device::cpu());
  for (const char* opt : {"adamw", "adamw_bf16_moments"}) {
    SCOPED_TRACE(opt);
    const int64_t o = std::string(opt) == "adamw" ? 12 : 8;
    Trainer t(load_run_config(run, {std::string("primitives.optimizer=\"") + opt + "\"", "checkpoint.dir=\"\"",
                                    "train.on_nonfinite=\"skip_step\""}),
              nullptr);
    int64_t n = 0;
    for (ParamUnit* u : t.model().units()) n += u->numel;
    EXPECT_EQ(optimizer_bytes_per_element(t.config().prim.optimizer.value), o);
    EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer), o * n);
    for (int i = 0; i < 2; ++i) t.train_step();
    EXPECT_EQ(alloc.stats().live_of(MemCategory::optimizer), 2 * o * n);  // + the backup
    expect_backup_restores_the_state(t);
    for (Param* p : t.model().params())
      EXPECT_EQ(p->value.to_floats(),
                unit_slice(t.state().gather_master(static_cast<size_t>(p->unit->index)), *p).to_floats());
  }
}

// An fp32 Hugging Face checkpoint loaded into bf16 parameters: the fp32 master weights take the
// checkpoint's values, not the bf16-rounded parameters; `export --dtype f32` writes the masters.
// `bumblebee export` streams: each weight is read from the checkpoint's shards when its file
// gets to it (the model holds no values). Its files are byte for byte what export_hf writes
// from a model holding the same weights, in one file and across several shard files (index
// included), in f32 and bf16.
TEST(Trainer, StreamedExportWritesExportHfsBytes) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()), {"checkpoint.dir=\"\""}), nullptr);
  for (int i = 0; i < 3; ++i) t.train_step();
  const std::string step = t.save_checkpoint(dir + "/ckpt");
  for (DType dt : {DType::f32, DType::bf16})
    for (uint64_t shard : {uint64_t{5'000'000'000}, uint64_t{40'000}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " shards of " + std::to_string(shard));
      HfExportOptions o;
      o.dtype = dt;
      o.max_shard_bytes = shard;
      const std::string a = dir + "/from_model", b = dir + "/streamed";
      std::filesystem::remove_all(a);
      std::filesystem::remove_all(b);
      export_hf(t.model(), a, o);
      export_distributed_checkpoint(step, b, o);
      std::vector<std::string> files;
      for (const auto& e : std::filesystem::directory_iterator(a)) files.push_back(e.path().filename().string());
      // model.safetensors + config.json + generation_config.json, or several shards and the index.
      if (shard > 1'000'000) EXPECT_EQ(files.size(), 3u);
      else EXPECT_GE(files.size(), 5u);
      for (const std::string& f : files) EXPECT_EQ(read_file(b + "/" + f), read_file(a + "/" + f)) << f;
    }
}

TEST(Trainer, HfInitKeepsFp32MastersAndExportWritesThem) {
  const std::string dir = make_tmpdir();
  const ModelConfig mc = small_model();
  DecoderModel src(mc, ModelOptions{}, 21);  // f32
  HfExportOptions f32;
  f32.dtype = DType::f32;
  export_hf(src, dir + "/hf", f32);
  const std::string run = write_run(dir, mc);
  auto t_owner = std::make_unique<Trainer>(
      load_run_config(run, {"model.dtype=bf16", "model.init=\"hf:" + dir + "/hf\"", "train.steps=0"}), nullptr);
  Trainer& t = *t_owner;
  const std::string step = t.save_checkpoint(dir + "/ckpt");
  int64_t rounded = 0;
  for (Param* p : src.params()) {
    const std::vector<float> want = p->value.to_floats();
    const Tensor master = unit_slice(t.state().gather_master(static_cast<size_t>(t.model().find_param(p->name)->unit->index)),
                                     *t.model().find_param(p->name));
    EXPECT_EQ(master.to_floats(), want) << p->name << ": master not fp32";
    const std::vector<float> param = t.model().find_param(p->name)->value.to_floats();
    for (size_t i = 0; i < want.size(); ++i) rounded += param[i] != want[i];
  }
  EXPECT_GT(rounded, 0) << "the parameters should be bf16-rounded (else the test proves nothing)";
  // Export in f32 from the checkpoint: the masters, exactly.
  export_distributed_checkpoint(step, dir + "/out", f32);
  DecoderModel back(mc, ModelOptions{}, 0);
  load_hf_weights(back, dir + "/out");
  for (Param* p : src.params())
    EXPECT_EQ(back.find_param(p->name)->value.to_floats(), p->value.to_floats()) << p->name;
  // The alignment padding of every unit stays zero through optimizer steps from an hf: start
  // (AdamW steps whole buckets; the loader writes only the parameters' slices).
  t_owner.reset();  // the checkpoint root is held by one run at a time
  Trainer stepped(load_run_config(run, {"model.init=\"hf:" + dir + "/hf\"", "train.steps=2"}),
                  nullptr);
  stepped.run();
  int64_t padding = 0;
  for (ParamUnit* u : stepped.model().units()) {
    std::vector<bool> used(static_cast<size_t>(u->numel), false);
    for (Param* p : u->params)
      for (int64_t i = 0; i < p->numel(); ++i) used[static_cast<size_t>(p->offset + i)] = true;
    const std::vector<float> v = u->value.to_floats();
    for (size_t i = 0; i < v.size(); ++i)
      if (!used[i]) {
        ++padding;
        EXPECT_EQ(v[i], 0.0f) << u->name << " padding element " << i;
      }
  }
  EXPECT_GT(padding, 0) << "the small model should have padding (else the check proves nothing)";
}

}  // namespace
}  // namespace bb

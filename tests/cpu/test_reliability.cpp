// Reliability: one test per defect of the reliability review (non-finite state, checkpoint roots
// shared or locked, metrics, masked data, hostile configs and data). Each failed before the fix.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/watchdog.h"
#include "common/run.h"
#include "common/testing.h"
#include "io/fs.h"
#include "io/safetensors.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/run_config.h"
#include "runtime/trainer.h"

namespace bb {
namespace {

std::string ck(const std::string& dir) { return dir + "/ckpt"; }

// Everything a FILE* log received, as text.
struct CapturedLog {
  FILE* f = std::tmpfile();
  ~CapturedLog() { std::fclose(f); }
  std::string text() const {
    std::fflush(f);
    std::string out;
    std::rewind(f);
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof buf, f)) out.append(buf, n);
    return out;
  }
};

std::vector<std::vector<float>> masters(Trainer& t) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < t.model().units().size(); ++i) out.push_back(t.state().gather_master(i).to_floats());
  return out;
}

// ---- 1. non-finite state ---------------------------------------------------------------------

// A learning rate that overflows the weights stops the run at that step; `latest` still names the
// last good checkpoint (keep = 1 did not prune it) and it resumes.
// ---- the collective watchdog (comm/watchdog.h) ---------------------------------------------------

// What the watchdog would end the job with, captured (its action replaced for the test).
struct WatchdogCapture {
  std::mutex mu;
  std::vector<std::string> messages;
  double old_timeout = comm::timeout();
  WatchdogCapture() {
    comm::set_watchdog_action_for_tests([this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mu);
      messages.push_back(m);
    });
  }
  ~WatchdogCapture() {
    comm::set_watchdog_action_for_tests({});
    comm::set_timeout(old_timeout);
  }
  // Waits up to 10 s for a first message.
  std::string first() {
    for (int i = 0; i < 1000; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!messages.empty()) return messages.front();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "";
  }
};

// A collective that never completes ends the job after parallel.timeout_s with a message naming
// it; one that completes is dropped and never reported.
TEST(Watchdog, AnOverdueCollectiveEndsTheJobNamingTheOperationAndGroup) {
  WatchdogCapture cap;
  comm::set_timeout(0.3);
  std::atomic<bool> second_done{false};
  comm::watch([&] { return second_done.load(); }, "reduce_scatter on group 'dense' (operation #3)");
  const auto t0 = std::chrono::steady_clock::now();
  comm::watch([] { return false; }, "all_to_all_v on group 'ep' (operation #7)");
  second_done = true;
  const std::string m = cap.first();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(m.find("communication timeout: all_to_all_v on group 'ep' (operation #7)"), std::string::npos) << m;
  EXPECT_NE(m.find("parallel.timeout_s = 0.3 s"), std::string::npos) << m;
  EXPECT_EQ(m.find("reduce_scatter"), std::string::npos) << m;
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 5.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(comm::watched_count(), 0);  // the fired one is dropped, the completed one too
}

// A health check that reports an error (NCCL's asynchronous error state) ends the job with that
// error, after the abort hooks ran (ncclCommAbort frees the stuck kernels).
TEST(Watchdog, AFailedHealthCheckRunsTheAbortHooksAndEndsTheJob) {
  WatchdogCapture cap;
  std::atomic<bool> broken{false}, aborted{false};
  const int64_t id = comm::add_health_check(
      [&] { return broken ? std::string("NCCL error on group 'ep': remote process exited") : std::string(); },
      [&] { aborted = true; });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> lock(cap.mu);
    EXPECT_TRUE(cap.messages.empty()) << "a healthy check fired";
  }
  broken = true;
  const std::string m = cap.first();
  comm::remove_health_check(id);
  EXPECT_NE(m.find("NCCL error on group 'ep': remote process exited. Aborting the job."), std::string::npos) << m;
  EXPECT_TRUE(aborted);
}

TEST(NonFinite, OverflowingUpdateAbortsAndKeepsTheLastGoodCheckpoint) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const std::vector<std::string> save = {"checkpoint.every=1", "checkpoint.keep=1", "checkpoint.resume=\"auto\""};
  {
    std::vector<std::string> ov = save;
    ov.push_back("train.steps=3");
    Trainer(load_run_config(run, ov), nullptr).run();
  }
  {
    std::vector<std::string> ov = save;
    for (const char* s : {"train.steps=6", "train.lr=1e39", "train.min_lr=1e39", "train.warmup_steps=0"}) ov.push_back(s);
    Trainer t(load_run_config(run, ov), nullptr);
    ASSERT_EQ(t.step(), 3);
    test::expect_error_contains([&] { t.run(); }, "step 4: the update made the weights or optimizer moments of unit");
  }
  EXPECT_EQ(read_file(ck(dir) + "/latest"), "step_00000003\n");
  EXPECT_TRUE(path_exists(ck(dir) + "/step_00000003/state.json"));
  EXPECT_FALSE(path_exists(ck(dir) + "/step_00000004"));
  std::vector<std::string> ov = save;
  ov.push_back("train.steps=4");
  Trainer r(load_run_config(run, ov), nullptr);
  EXPECT_EQ(r.step(), 3);
  EXPECT_TRUE(std::isfinite(r.run().back().loss));
}

// A non-finite loss (here from a poisoned weight) stops the run before any update, naming the step
// and the quantity.
TEST(NonFinite, NonFiniteLossAbortsBeforeTheUpdate) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()), {"checkpoint.dir=\"\""}), nullptr);
  const auto before = masters(t);
  t.model().params()[0]->value.fill_(NAN);
  test::expect_error_contains([&] { t.train_step(); }, "step 1: the loss is not finite");
  EXPECT_EQ(masters(t), before);
}

// skip_step: a step whose update goes non-finite is undone (masters and moments bit for bit as
// before), counted, and the run moves on.
TEST(NonFinite, SkipStepRestoresThePreStepStateAndCountsIt) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()),
                            {"checkpoint.dir=\"\"", "train.on_nonfinite=\"skip_step\"", "train.lr=1e39",
                             "train.min_lr=1e39", "train.warmup_steps=0", "train.steps=3"}),
            nullptr);
  const auto before = masters(t);
  const DataPosition p0 = t.data().position();
  const std::vector<StepMetrics> ms = t.run();
  ASSERT_EQ(ms.size(), 3u);
  for (const StepMetrics& m : ms) EXPECT_EQ(m.skipped, "nonfinite") << "step " << m.step;
  EXPECT_EQ(t.skipped_nonfinite(), 3);
  EXPECT_EQ(t.step(), 3);
  EXPECT_EQ(masters(t), before);
  for (size_t i = 0; i < t.model().units().size(); ++i) {
    const ModelState::Owned o = t.state().owned(i);
    for (float v : o.exp_avg.to_floats()) ASSERT_EQ(v, 0.0f);
  }
  EXPECT_FALSE(t.data().position() == p0);  // the data moved on
  for (Param* p : t.model().params())
    for (float v : p->value.to_floats()) ASSERT_TRUE(std::isfinite(v)) << p->name;
}

// A checkpoint is never written with Inf/NaN, and loading one that holds them names the tensor.
TEST(NonFinite, NoCheckpointHoldsNonFiniteValuesAndLoadingOneNamesTheTensor) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  std::string step;
  std::string unit0;
  {
    Trainer t(load_run_config(run), nullptr);
    t.train_step();
    unit0 = t.model().units()[0]->name;
    Tensor m = t.state().owned(0).master;
    const float keep = m.data<float>()[5];
    m.data<float>()[5] = INFINITY;
    test::expect_error_contains([&] { t.save_checkpoint(ck(dir)); },
                                "refusing to save step 1: " + unit0 + ".master holds Inf/NaN");
    EXPECT_FALSE(path_exists(ck(dir) + "/latest"));
    EXPECT_FALSE(path_exists(ck(dir) + "/step_00000001"));
    m.data<float>()[5] = keep;
    step = t.save_checkpoint(ck(dir));
  }
  // Poison the file itself: one moment element becomes NaN.
  const std::string shard = step + "/shards/rank_00000.safetensors";
  std::vector<std::pair<std::string, Tensor>> ts;
  std::map<std::string, std::string> meta;
  {
    SafetensorsReader r(shard);
    meta = r.metadata();
    for (const SafetensorsEntry& e : r.entries()) ts.emplace_back(e.name, r.read(e.name));
  }
  // The checks below are those of a shard without checksums (written before they existed): the
  // checksums would name the change first (ChecksumsFindAChangedByte covers them).
  for (auto it = meta.begin(); it != meta.end();) it = it->first.rfind(kChecksumKeyPrefix, 0) == 0 ? meta.erase(it) : ++it;
  bool poisoned = false;
  for (auto& [name, t] : ts)
    if (name == unit0 + ".exp_avg") {
      t.data<float>()[3] = NAN;
      poisoned = true;
    }
  ASSERT_TRUE(poisoned);
  write_safetensors(shard, ts, meta);
  Trainer u(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
  test::expect_error_contains([&] { u.load_checkpoint(step); }, unit0 + ".exp_avg holds a non-finite value");
  EXPECT_EQ(u.step(), 0);
  // A negative second moment (finite, but no mean of squares) is refused too.
  for (auto& [name, t] : ts) {
    if (name == unit0 + ".exp_avg") t.data<float>()[3] = 0.0f;
    if (name == unit0 + ".exp_avg_sq") t.data<float>()[7] = -1e-12f;
  }
  write_safetensors(shard, ts, meta);
  test::expect_error_contains([&] { u.load_checkpoint(step); }, unit0 + ".exp_avg_sq holds a negative value");
  EXPECT_EQ(u.step(), 0);
  // A unit name in the shard's metadata that the unit table does not list: the shard is named as
  // corrupt (the name used to be skipped, and the load blamed a missing shard file).
  for (auto& [name, t] : ts)
    if (name == unit0 + ".exp_avg_sq") t.data<float>()[7] = 0.0f;
  std::map<std::string, std::string> bad_meta = meta;
  ASSERT_TRUE(bad_meta.count(unit0));
  bad_meta["x" + unit0] = bad_meta[unit0];
  bad_meta.erase(unit0);
  write_safetensors(shard, ts, bad_meta);
  test::expect_error_contains([&] { u.load_checkpoint(step); }, "shards/rank_00000.safetensors holds a range for unit 'x" +
                                                                      unit0 + "', which state.json's unit table does not list");
  EXPECT_EQ(u.step(), 0);
}

// A loss far above the running mean is flagged (warning line, metrics field).
// Probe defect 3: a changed byte in a shard (a flipped bit, or a master set to 1e30, which stays
// finite) loaded silently. Every tensor of a shard now carries a checksum; a load names the
// file and the tensor whose bytes changed, and changes nothing.
TEST(Checkpoint, ChecksumsFindAChangedByte) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  std::string step, unit1;
  {
    Trainer t(load_run_config(run), nullptr);
    t.train_step();
    unit1 = t.model().units()[1]->name;
    step = t.save_checkpoint(ck(dir));
  }
  const std::string shard = step + "/shards/rank_00000.safetensors";
  uint64_t at = 0;
  std::string original;
  {
    SafetensorsReader r(shard);
    ASSERT_TRUE(r.metadata().count(checksum_key(unit1 + ".master")));
    const SafetensorsEntry* e = r.find(unit1 + ".master");
    ASSERT_NE(e, nullptr);
    at = r.data_start() + e->begin + 4 * 3;  // element 3 of the master
    original = read_file(shard);
  }
  auto poke = [&](const void* bytes, size_t n) {
    std::string s = original;
    std::memcpy(&s[at], bytes, n);
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << s;
  };
  for (int bit : {0, 13, 31}) {  // one flipped bit: low mantissa, mantissa, sign
    SCOPED_TRACE("bit " + std::to_string(bit));
    uint32_t w;
    std::memcpy(&w, original.data() + at, 4);
    w ^= uint32_t{1} << bit;
    poke(&w, 4);
    Trainer u(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
    test::expect_error_contains([&] { u.load_checkpoint(step); },
                                "rank_00000.safetensors: tensor '" + unit1 + ".master' fails its checksum");
    EXPECT_EQ(u.step(), 0);
  }
  const float huge = 1e30f;  // finite: the finiteness check alone let it through
  poke(&huge, 4);
  {
    Trainer u(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
    test::expect_error_contains([&] { u.load_checkpoint(step); }, "fails its checksum");
  }
  // The untouched file loads.
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << original;
  Trainer u(load_run_config(run, {"checkpoint.dir=\"\""}), nullptr);
  u.load_checkpoint(step);
  EXPECT_EQ(u.step(), 1);
}

// checksum64 changes with any single flipped bit of a buffer, at every length around the 8- and
// 32-byte strides (the lanes, the word tail, the byte tail), and with the length alone.
TEST(Checkpoint, Checksum64SeesEverySingleBitFlip) {
  std::vector<unsigned char> buf(80);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 37 + 11);
  for (size_t n : {0, 1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 65, 80}) {
    const uint64_t h = checksum64(buf.data(), n);
    if (n > 0) {
      EXPECT_NE(checksum64(buf.data(), n - 1), h) << n;
    }
    for (size_t b = 0; b < 8 * n; ++b) {
      buf[b / 8] ^= static_cast<unsigned char>(1u << (b % 8));
      EXPECT_NE(checksum64(buf.data(), n), h) << "length " << n << ", bit " << b;
      buf[b / 8] ^= static_cast<unsigned char>(1u << (b % 8));
    }
    EXPECT_EQ(checksum64(buf.data(), n), h);
  }
}

TEST(NonFinite, LossSpikeIsWarned) {
  const std::string dir = make_tmpdir();
  CapturedLog log;
  // A learning rate this large makes the loss jump after a few steps of a normal start.
  Trainer t(load_run_config(write_run(dir, small_model()), {"checkpoint.dir=\"\"", "train.steps=12", "train.lr=3",
                                                             "train.min_lr=3", "train.warmup_steps=4",
                                                             "train.grad_clip=0", "train.loss_spike_factor=1.5"}),
            log.f);
  const std::vector<StepMetrics> ms = t.run();
  int spikes = 0;
  for (const StepMetrics& m : ms) spikes += m.loss_spike;
  EXPECT_GT(spikes, 0) << log.text();
  EXPECT_NE(log.text().find("the running mean"), std::string::npos) << log.text();
}

// ---- 2./3./4. checkpoint roots ------------------------------------------------------------------

// Another run's checkpoints in the same root are neither pruned nor overwritten; a run that would
// overwrite one is refused before it trains.
TEST(CheckpointRoot, AnotherRunsCheckpointsAreKeptAndNeverOverwritten) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  Trainer(load_run_config(run, {"train.steps=4", "checkpoint.every=2", "checkpoint.keep=1"}), nullptr).run();
  ASSERT_TRUE(path_exists(ck(dir) + "/step_00000004"));
  const std::string a_id = read_checkpoint_state(ck(dir) + "/step_00000004")["run_id"].get<std::string>();
  // A fresh run (no resume) with keep = 1 prunes only its own steps.
  Trainer(load_run_config(run, {"train.steps=5", "checkpoint.every=5", "checkpoint.keep=1"}), nullptr).run();
  EXPECT_TRUE(path_exists(ck(dir) + "/step_00000004/state.json"));
  EXPECT_TRUE(path_exists(ck(dir) + "/step_00000005/state.json"));
  EXPECT_EQ(read_checkpoint_state(ck(dir) + "/step_00000004")["run_id"].get<std::string>(), a_id);
  // A fresh run that would write step 4 again is refused at startup.
  test::expect_error_contains(
      [&] { Trainer(load_run_config(run, {"train.steps=4", "checkpoint.every=2"}), nullptr); },
      "holds checkpoints of another run that this run would overwrite: step_00000004");
  EXPECT_EQ(read_checkpoint_state(ck(dir) + "/step_00000004")["run_id"].get<std::string>(), a_id);
}

// resume = "auto" without `latest` takes the newest complete checkpoint; with none complete it
// refuses, listing what it found, instead of starting over and overwriting them.
TEST(CheckpointRoot, ResumeAutoWithoutLatestTakesTheNewestCompleteCheckpoint) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  Trainer(load_run_config(run, {"train.steps=4", "checkpoint.every=2", "checkpoint.keep=0"}), nullptr).run();
  ASSERT_EQ(::unlink((ck(dir) + "/latest").c_str()), 0);
  ASSERT_EQ(::unlink((ck(dir) + "/step_00000004/shards/rank_00000.safetensors").c_str()), 0);
  {
    Trainer t(load_run_config(run, {"train.steps=6", "checkpoint.resume=\"auto\""}), nullptr);
    EXPECT_EQ(t.step(), 2);
  }
  ASSERT_EQ(::unlink((ck(dir) + "/step_00000002/state.json").c_str()), 0);
  test::expect_error_contains(
      [&] { Trainer(load_run_config(run, {"train.steps=6", "checkpoint.resume=\"auto\""}), nullptr); },
      "has no 'latest' file and no complete checkpoint:\n  step_00000002: ");
}

// An unusable checkpoint.dir fails when the trainer starts, not at the first save.
TEST(CheckpointRoot, UnusableRootFailsAtStartup) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  std::ofstream(dir + "/file") << "x";
  test::expect_error_contains([&] { Trainer(load_run_config(run, {"checkpoint.dir=\"" + dir + "/file\""}), nullptr); },
                              "exists and is not a directory");
  test::expect_error_contains(
      [&] { Trainer(load_run_config(run, {"checkpoint.dir=\"" + dir + "/file/sub\""}), nullptr); }, "cannot be created");
}

// A second run on a locked root is refused with the holder's pid; the lock goes with the run.
TEST(CheckpointRoot, SecondRunOnALockedRootNamesTheHolder) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  {
    Trainer a(load_run_config(run), nullptr);
    test::expect_error_contains([&] { Trainer(load_run_config(run), nullptr); },
                                "is in use by another run (pid " + std::to_string(::getpid()) + " on host");
  }
  Trainer b(load_run_config(run), nullptr);  // released with `a`
}

// Temporaries of interrupted saves are removed when the next run starts, with a log line.
TEST(CheckpointRoot, StaleTemporariesAreRemovedAtStartup) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  make_dirs(ck(dir) + "/.step_00000007.tmp.4242/shards");
  std::ofstream(ck(dir) + "/.step_00000007.tmp.4242/shards/rank_00000.safetensors") << std::string(4096, 'x');
  std::ofstream(ck(dir) + "/latest.tmp.4242") << "step_00000007\n";
  CapturedLog log;
  Trainer t(load_run_config(run), log.f);
  EXPECT_FALSE(path_exists(ck(dir) + "/.step_00000007.tmp.4242"));
  EXPECT_FALSE(path_exists(ck(dir) + "/latest.tmp.4242"));
  EXPECT_NE(log.text().find("removed 2 temporary"), std::string::npos) << log.text();
}

// ---- 5. metrics -----------------------------------------------------------------------------------

TEST(Metrics, WriteErrorsStopTheRun) {
  const std::string dir = make_tmpdir();
  Trainer t(load_run_config(write_run(dir, small_model()), {"log.metrics=\"/dev/full\"", "train.steps=2"}), nullptr);
  test::expect_error_contains([&] { t.run(); }, "cannot write log.metrics file '/dev/full' at step 1");
}

// After a crash past the last checkpoint, the resumed run rewrites the metrics file from its
// step: every step appears once.
TEST(Metrics, AResumedRunTruncatesTheFileToItsStep) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const std::string mpath = dir + "/metrics.jsonl";
  const std::vector<std::string> ov = {"log.metrics=\"" + mpath + "\"", "checkpoint.every=3",
                                       "checkpoint.resume=\"auto\""};
  auto with = [&](const char* steps) {
    std::vector<std::string> v = ov;
    v.push_back(steps);
    return v;
  };
  Trainer(load_run_config(run, with("train.steps=5")), nullptr).run();  // "crashes" after step 5
  std::ofstream(mpath, std::ios::app) << "{\"step\": 6, \"loss\"";        // and a torn line
  Trainer(load_run_config(run, with("train.steps=7")), nullptr).run();  // resumes at 3
  std::vector<int64_t> steps;
  std::ifstream in(mpath);
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
}

// ---- 6. data ------------------------------------------------------------------------------------

// Micro-batches whose every target is masked are skipped with a count, not fatal; the run resumes
// past them.
TEST(Data, AStepWithNoLossTargetIsSkippedAndCounted) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  std::ofstream data(dir + "/masked.jsonl");
  std::string toks, zeros;
  for (int i = 0; i < 40; ++i) {
    toks += (i ? "," : "") + std::to_string(1 + i % 200);
    zeros += i ? ",0" : "0";
  }
  data << "{\"tokens\": [" << toks << "], \"loss_mask\": [" << zeros << "]}\n";  // 40 masked tokens
  for (int d = 0; d < 30; ++d) data << "{\"text\": \"document " << d << " has targets\"}\n";
  data.close();
  const std::vector<std::string> ov = {"data.path=\"" + dir + "/masked.jsonl\"", "data.shuffle=false",
                                       "train.micro_batch_tokens=16", "train.steps=5", "checkpoint.every=2",
                                       "checkpoint.resume=\"auto\""};
  CapturedLog log;
  std::vector<StepMetrics> ms;
  {
    Trainer t(load_run_config(run, ov), log.f);
    ms = t.run();
    EXPECT_EQ(t.skipped_no_targets(), 2);  // tokens 0-31 have no target; 32-47 start the text
  }
  ASSERT_EQ(ms.size(), 5u);
  EXPECT_EQ(ms[0].skipped, "no_targets");
  EXPECT_EQ(ms[1].skipped, "no_targets");
  for (size_t i = 2; i < 5; ++i) EXPECT_TRUE(ms[i].skipped.empty() && std::isfinite(ms[i].loss)) << i;
  EXPECT_NE(log.text().find("no token of the step has a loss target"), std::string::npos);
  std::vector<std::string> ov2 = ov;
  ov2.push_back("train.steps=6");
  Trainer r(load_run_config(run, ov2), nullptr);
  EXPECT_EQ(r.step(), 4);
  EXPECT_TRUE(r.run().back().skipped.empty());
}

// ---- 7./8. hostile configs and data --------------------------------------------------------------

TEST(HostileConfig, DeeplyNestedTomlIsRefusedBeforeParsing) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  const std::string deep = "[log]\nx = " + std::string(200000, '[') + "\n";
  test::expect_error_contains([&] { parse_run_config(deep, "deep.toml"); }, "nested deeper than 32 levels");
  test::expect_error_contains([&] { load_run_config(run, {"log.x=" + std::string(100000, '{')}); },
                              "nested deeper than 32 levels");
  // Brackets inside strings and comments do not count.
  const std::string ok = "# [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n[log]\nmetrics = \"" + std::string(40, '[') + "\"\n";
  test::expect_error_contains([&] { parse_run_config(ok, "ok.toml"); }, "model.config is required");
}

// toml11 reads out of bounds on invalid UTF-8 inside a string (found by fuzz/fuzz_run_config):
// such text is refused before parsing, in files and in --set values.
TEST(HostileConfig, InvalidUtf8IsRefusedBeforeParsing) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  test::expect_error_contains([&] { parse_run_config("'\xb3/'", "bad.toml"); }, "invalid UTF-8 at byte 1");
  test::expect_error_contains([&] { load_run_config(run, {"log.metrics=\"\xc0\xaf\""}); }, "invalid UTF-8");
  EXPECT_EQ(load_run_config(run, {"log.metrics=\"m\xc3\xa9trics.jsonl\""}).metrics_path, "m\xc3\xa9trics.jsonl");
}

TEST(HostileConfig, NonFiniteAndOutOfRangeValuesAreRefused) {
  const std::string dir = make_tmpdir();
  const std::string run = write_run(dir, small_model());
  for (const char* ov : {"train.lr=inf", "train.lr=nan", "train.adam_eps=inf", "train.weight_decay=nan",
                         "train.z_loss_coef=inf", "train.aux_loss_coef=-inf", "train.grad_clip=inf",
                         "train.loss_spike_factor=inf"})
    test::expect_error_contains([&] { load_run_config(run, {ov}); }, "must be a finite number");
  for (const char* ov : {"train.steps=-1", "train.steps=2000000000000", "train.micro_batch_tokens=4294967296",
                         "data.eos_id=4294967296", "train.grad_accum=0", "checkpoint.keep=-1", "log.every=0",
                         "parallel.cp=0", "data.max_line_bytes=0"})
    test::expect_error_contains([&] { load_run_config(run, {ov}); }, "is outside [");
  test::expect_error_contains([&] { load_run_config(run, {"train.on_nonfinite=\"ignore\""}); },
                              "is not one of: abort, skip_step");
}

// Everything train accepts resumes from its own checkpoint: a model config spelled with every
// optional key (layer_types included) is the same model after the round trip through state.json.
TEST(HostileConfig, AConfigThatTrainsResumesFromItsCheckpoint) {
  const std::string dir = make_tmpdir();
  ModelConfig m = small_model();
  m.layer_types.assign(static_cast<size_t>(m.num_layers), LayerType::full_attention);
  const std::string run = write_run(dir, m);
  Trainer(load_run_config(run, {"train.steps=2", "checkpoint.every=1"}), nullptr).run();
  Trainer r(load_run_config(run, {"train.steps=3", "checkpoint.resume=\"auto\""}), nullptr);
  EXPECT_EQ(r.step(), 2);
}

TEST(HostileData, JsonlLinesAreBoundedInLengthAndMemory) {
  const std::string dir = make_tmpdir();
  const std::string path = dir + "/long.jsonl";
  std::ofstream(path) << "{\"tokens\": [1, 2]}\n{\"tokens\": [" << std::string(300, ' ') << "1]}\n";
  test::expect_error_contains([&] { read_jsonl(path, 264, 100); }, path + ":2: line is longer than data.max_line_bytes = 100");
  test::expect_error_contains([&] { parse_jsonl(read_file(path), 264, "mem", 100); }, "mem:2: line is longer");
  // One 16 MB line of 8M tokens: the load's peak memory is a small multiple of the line (a JSON
  // tree of it took ~18x). Measured in a child process so the test's own memory does not count.
  const int64_t n = 8'000'000;
  {
    std::ofstream big(dir + "/big.jsonl");
    big << "{\"tokens\": [";
    std::string chunk;
    for (int i = 0; i < 1000; ++i) chunk += "7,";
    for (int64_t i = 0; i < n / 1000; ++i) big << chunk;
    big << "7]}\n";
  }
  const double line_mb = static_cast<double>(file_size(dir + "/big.jsonl")) / 1e6;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    rusage r0{}, r1{};
    getrusage(RUSAGE_SELF, &r0);
    const Corpus c = read_jsonl(dir + "/big.jsonl", 264);
    getrusage(RUSAGE_SELF, &r1);
    const double grew_mb = static_cast<double>(r1.ru_maxrss - r0.ru_maxrss) / 1e3;  // KiB -> ~MB
    const double tokens = static_cast<double>(c.num_tokens());
    const double msg[2] = {grew_mb, tokens};
    (void)!write(fds[1], msg, sizeof msg);
    _exit(0);
  }
  double msg[2] = {0, 0};
  ASSERT_EQ(read(fds[0], msg, sizeof msg), static_cast<ssize_t>(sizeof msg));
  int status = 0;
  waitpid(pid, &status, 0);
  close(fds[0]);
  close(fds[1]);
  std::printf("JSONL load of a %.1f MB line: peak RSS +%.1f MB (%.2fx the line)\n", line_mb, msg[0], msg[0] / line_mb);
  EXPECT_EQ(msg[1], static_cast<double>(n + 1));
  // AddressSanitizer's allocator adds its own overhead per allocation: the bound is for the
  // plain build.
#if defined(__SANITIZE_ADDRESS__)
  constexpr double kBound = 10.0;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  constexpr double kBound = 10.0;
#else
  constexpr double kBound = 6.0;
#endif
#else
  constexpr double kBound = 6.0;
#endif
  EXPECT_LT(msg[0], kBound * line_mb) << "peak growth " << msg[0] << " MB for a " << line_mb << " MB line";
}

}  // namespace
}  // namespace bb

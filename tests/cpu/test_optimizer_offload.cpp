// The optimizer offload's host side (runtime/optimizer_offload.h) against the CPU AdamW
// reference (adamw_step): buckets that cut units and their weight-decay boundary, several pool
// threads, f32 and bf16 values (rounded to nearest even, or ties away as the split master
// storage rounds), clipping through grad_scale, the step arguments arriving before or after the
// gradients, a step that applied no update, and the non-finite report. Bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "core/rng.h"
#include "primitives/optim/adamw.h"
#include "runtime/optimizer_offload.h"

namespace bb {
namespace {

struct Unit {
  int64_t n = 0, first = 0, decay_end = 0;
  DType vdt = DType::f32;
  bool ties_away = false;
  // The offload's side: host master, moments, gradient copy; "device" gradient and values.
  Tensor master, m, v, grad_host, grad_dev, value_dev;
  // The reference: the same state updated by adamw_step.
  Tensor rmaster, rm, rv;
};

std::vector<float> randoms(int64_t n, uint64_t seed, float scale) {
  std::vector<float> x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = scale * (2.0f * philox_uniform(seed, i) - 1.0f);
  return x;
}

Unit make_unit(int64_t n, int64_t first, int64_t decay_end, DType vdt, bool ties_away, uint64_t seed) {
  Unit u;
  u.n = n;
  u.first = first;
  u.decay_end = decay_end;
  u.vdt = vdt;
  u.ties_away = ties_away;
  u.master = Tensor::from_floats(randoms(n, seed, 1.0f), {n});
  u.m = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  u.v = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::optimizer);
  u.grad_host = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::grads);
  u.grad_dev = Tensor::zeros({n}, DType::f32, Device::cpu(), MemCategory::grads);
  u.value_dev = Tensor::zeros({n}, vdt, Device::cpu(), MemCategory::params);
  u.rmaster = u.master.clone();
  u.rm = u.m.clone();
  u.rv = u.v.clone();
  return u;
}

OffloadTarget target_of(Unit& u, int64_t order) {
  OffloadTarget t;
  t.name = "unit" + std::to_string(order);
  t.master = u.master.data<float>();
  t.exp_avg = u.m.data<float>();
  t.exp_avg_sq = u.v.data<float>();
  t.grad_host = u.grad_host.data<float>();
  t.grad_dev = u.grad_dev;
  t.value_dev = u.value_dev;
  t.first = u.first;
  t.decay_end = u.decay_end;
  t.order = order;
  t.ties_away = u.ties_away;
  return t;
}

// adamw_step over the unit's decayed and undecayed elements, then the values as the device path
// makes them: f32 copied, bf16 to nearest even (Tensor::to_dtype), or the split master's upper
// half (split_master).
void reference_step(Unit& u, const OffloadArgs& a) {
  const int64_t cut = std::clamp<int64_t>(u.decay_end - u.first, 0, u.n);
  const int64_t cuts[3] = {0, cut, u.n};
  for (int k = 0; k < 2; ++k) {
    const int64_t len = cuts[k + 1] - cuts[k];
    if (len == 0) continue;
    Tensor p = u.rmaster.narrow(cuts[k], len), m = u.rm.narrow(cuts[k], len), v = u.rv.narrow(cuts[k], len);
    adamw_step(p, u.grad_dev.narrow(cuts[k], len), m, v, a.step, a.lr, k == 0 ? a.weight_decay : 0.0, a.cfg, nullptr);
  }
}

Tensor reference_values(const Unit& u) {
  if (u.vdt == DType::f32) return u.rmaster.clone();
  if (!u.ties_away) return u.rmaster.to_dtype(DType::bf16);
  Tensor hi = Tensor::empty({u.n}, DType::bf16, Device::cpu(), MemCategory::other);
  Tensor lo = Tensor::empty({u.n}, DType::i16, Device::cpu(), MemCategory::other);
  split_master(u.rmaster, hi, lo);
  return hi;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

void expect_unit_matches(const Unit& u, const std::string& what) {
  EXPECT_TRUE(same_bits(u.master, u.rmaster)) << what << ": master";
  EXPECT_TRUE(same_bits(u.m, u.rm)) << what << ": exp_avg";
  EXPECT_TRUE(same_bits(u.v, u.rv)) << what << ": exp_avg_sq";
  EXPECT_TRUE(same_bits(u.value_dev, reference_values(u))) << what << ": values";
}

void new_gradients(std::vector<Unit>& units, uint64_t seed) {
  for (size_t i = 0; i < units.size(); ++i) {
    const std::vector<float> g = randoms(units[i].n, seed * 100 + i, 0.01f);
    std::memcpy(units[i].grad_dev.raw(), g.data(), g.size() * sizeof(float));
  }
}

// Buckets of 7 elements over units of 37, 1, 100 and 16 elements (a bucket cuts the decay
// boundary of the first and third), on 3 threads, 4 steps: arguments before the gradients
// (the update during the backward) and after them (clipping: grad_scale 0.37 at step 2).
TEST(OptimizerOffload, BucketsAndThreadsGiveTheAdamWReferenceBits) {
  for (const int threads : {1, 3}) {
    std::vector<Unit> units;
    units.push_back(make_unit(37, 0, 20, DType::f32, false, 1));       // decay cut inside a bucket
    units.push_back(make_unit(1, 5, 0, DType::bf16, false, 2));         // no decay at all
    units.push_back(make_unit(100, 300, 350, DType::bf16, true, 3));    // a shard: cut at owned 50
    units.push_back(make_unit(16, 0, 1 << 20, DType::bf16, false, 4));  // all decayed
    std::vector<OffloadTarget> targets;
    for (size_t i = 0; i < units.size(); ++i) targets.push_back(target_of(units[i], static_cast<int64_t>(3 - i)));
    OptimizerOffload off(Device::cpu(), std::move(targets), threads, 7);
    EXPECT_EQ(off.threads(), threads);
    for (int64_t step = 1; step <= 4; ++step) {
      SCOPED_TRACE("threads " + std::to_string(threads) + " step " + std::to_string(step));
      new_gradients(units, static_cast<uint64_t>(step));
      OffloadArgs a;
      a.step = step;
      a.lr = 1e-2 * static_cast<double>(step);
      a.weight_decay = 0.1;
      a.cfg.grad_scale = step == 2 ? 0.37 : 1.0;
      off.begin_step();
      const bool early = step % 2 == 1;
      if (early) off.open(a);
      for (size_t i = 0; i < units.size(); ++i) off.submit(i);
      if (!early) off.open(a);
      for (size_t i = 0; i < units.size(); ++i) {
        reference_step(units[i], a);
        off.wait(i, {Stream::compute});
        expect_unit_matches(units[i], units[i].vdt == DType::f32 ? "f32 values" : "bf16 values");
      }
    }
    EXPECT_GE(off.take_busy_seconds(), 0.0);
    EXPECT_FALSE(off.take_nonfinite().has_value());
  }
}

// A step whose arguments never came (its loss was not finite, say) leaves every target as it
// was, and the next step's gradients replace the dropped ones.
TEST(OptimizerOffload, AStepThatAppliesNoUpdateChangesNothing) {
  std::vector<Unit> units;
  units.push_back(make_unit(50, 0, 25, DType::f32, false, 7));
  std::vector<OffloadTarget> targets{target_of(units[0], 0)};
  OptimizerOffload off(Device::cpu(), std::move(targets), 2, 8);
  new_gradients(units, 1);
  off.begin_step();
  off.submit(0);  // no open(): the step is dropped at the next begin_step
  off.begin_step();
  off.wait(0, {Stream::compute});
  // Still the initial state, and no values were written (they start at zero here).
  EXPECT_TRUE(same_bits(units[0].master, units[0].rmaster));
  EXPECT_TRUE(same_bits(units[0].m, units[0].rm));
  EXPECT_TRUE(same_bits(units[0].v, units[0].rv));
  EXPECT_EQ(units[0].value_dev.to_floats(), std::vector<float>(50, 0.0f));
  new_gradients(units, 2);
  off.submit(0);
  OffloadArgs a;
  a.step = 1;
  a.lr = 3e-3;
  off.open(a);
  reference_step(units[0], a);
  off.wait(0, {Stream::compute});
  expect_unit_matches(units[0], "next step");
}

// A gradient holding Inf makes the update's master and moments non-finite: the report names the
// target and the step, once.
TEST(OptimizerOffload, ReportsTheTargetAndStepOfANonfiniteUpdate) {
  std::vector<Unit> units;
  units.push_back(make_unit(20, 0, 20, DType::f32, false, 8));
  units.push_back(make_unit(30, 0, 30, DType::f32, false, 9));
  std::vector<OffloadTarget> targets{target_of(units[0], 0), target_of(units[1], 1)};
  OptimizerOffload off(Device::cpu(), std::move(targets), 2, 8);
  new_gradients(units, 1);
  units[1].grad_dev.data<float>()[17] = std::numeric_limits<float>::infinity();
  OffloadArgs a;
  a.step = 4;
  a.lr = 1e-3;
  off.begin_step();
  off.open(a);
  off.submit(0);
  off.submit(1);
  off.settle();
  const auto bad = off.take_nonfinite();
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->target, 1u);
  EXPECT_EQ(bad->step, 4);
  EXPECT_FALSE(off.take_nonfinite().has_value());
  EXPECT_TRUE(std::isnan(units[1].master.data<float>()[17]) || std::isinf(units[1].master.data<float>()[17]));
}

TEST(OptimizerOffload, HostPoolCoversEveryElementOnce) {
  for (const int ranges : {1, 2, 5}) {
    HostPool pool(ranges);
    for (const int64_t n : {int64_t{1}, int64_t{4}, int64_t{1000}}) {
      std::vector<int> hits(static_cast<size_t>(n), 0);
      pool.run(n, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) ++hits[static_cast<size_t>(i)];
      });
      for (int h : hits) ASSERT_EQ(h, 1);
    }
  }
  EXPECT_GE(HostPool::auto_ranges(0), 1);
  EXPECT_EQ(HostPool::auto_ranges(6), 6);
}

}  // namespace
}  // namespace bb

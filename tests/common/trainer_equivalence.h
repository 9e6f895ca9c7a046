// trainer_equivalence.h — multi-rank trainer runs against the single-rank run on the same data
// (tests/mpi): the reference trainer (the whole global batch on one rank, one micro-batch per
// data rank by gradient accumulation), and the check that a layout gives its losses, grad norms,
// token counts, routing and final weights.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/mpi_main.h"
#include "runtime/trainer.h"

namespace bb::test {

inline double rel(double a, double b) { return std::abs(a - b) / std::max(1e-30, std::abs(b)); }

inline double rel_norm(const std::vector<float>& x, const std::vector<float>& y) {
  EXPECT_EQ(x.size(), y.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    num += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
    den += static_cast<double>(y[i]) * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct Reference {
  std::unique_ptr<Trainer> t;
  std::vector<StepMetrics> steps;
};

// `steps` steps of `cfg` on this rank alone, with routing recorded. The caller sets
// train.grad_accum to the number of micro-batches the compared layout reads per step.
inline Reference reference_run(const RunConfig& cfg, const Corpus& corpus, int steps) {
  Reference ref;
  ref.t = std::make_unique<Trainer>(cfg, nullptr, corpus, comm::self_group());
  ref.t->set_record_routing(true);
  for (int s = 0; s < steps; ++s) ref.steps.push_back(ref.t->train_step());
  return ref;
}

// Documents of lengths 1..7 (shorter than 2 x cp for cp 4), mid-size and longer than a 96-token
// micro-batch, three times over, random ids below 250 (the test models' EOS is above).
inline Corpus mixed_length_corpus(uint64_t seed) {
  const std::vector<int64_t> lens = {1, 70, 3, 5, 140, 2, 7, 33, 1, 6, 90, 4, 25, 200, 3, 12, 60, 2, 45, 9, 130, 1, 17};
  Corpus c;
  uint64_t state = seed;
  for (int rep = 0; rep < 3; ++rep)
    for (int64_t len : lens) {
      for (int64_t i = 0; i < len; ++i) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        c.tokens.push_back(static_cast<int32_t>((state >> 33) % 250));
      }
      c.offsets.push_back(static_cast<int64_t>(c.tokens.size()));
    }
  return c;
}

inline std::vector<StepMetrics> train_steps(Trainer& t, int steps) {
  t.set_record_routing(true);
  std::vector<StepMetrics> out;
  for (int s = 0; s < steps; ++s) out.push_back(t.train_step());
  return out;
}

// The local experts' elements of a unit of the reference (which holds every expert): the
// parameters' rows [first, first + n) in the local unit's layout.
inline std::vector<float> local_slice_of(Trainer& local_t, Trainer& ref, size_t unit, const Tensor& whole_ref) {
  ParamUnit* lu = local_t.model().units()[unit];
  Tensor out = Tensor::zeros({lu->numel}, DType::f32, Device::cpu(), MemCategory::other);
  for (Param* p : lu->params) {
    Param* rp = ref.model().find_param(p->name);
    const int64_t per = p->numel() / p->shape[0];
    out.narrow(p->offset, p->numel()).copy_from(whole_ref.narrow(rp->offset + lu->first_expert * per, p->numel()));
  }
  return out.to_floats();
}

// Steps, routing, token counts and the expert placement of `t` against the reference; the final
// masters of every unit (the local experts' rows for expert units) to `master_tol` (relative L2
// over the unit). Prints the worst relative difference under `tag`.
inline void expect_matches(Trainer& t, Reference& ref, const std::vector<StepMetrics>& got, const char* tag,
                           double tol = 1e-6, double master_tol = 1e-5) {
  const ParallelLayout& l = t.mesh().layout();
  const ModelConfig& mc = t.config().model;
  const int64_t R = world()->size();
  double worst = 0;
  for (size_t s = 0; s < got.size(); ++s) {
    const StepMetrics &m = got[s], &w = ref.steps[s];
    EXPECT_LE(rel(m.loss, w.loss), tol) << "step " << s + 1;
    EXPECT_LE(rel(m.grad_norm, w.grad_norm), tol) << "step " << s + 1;
    EXPECT_LE(rel(m.aux_loss, w.aux_loss), tol) << "step " << s + 1;
    EXPECT_LE(rel(m.z_loss, w.z_loss), tol) << "step " << s + 1;
    worst = std::max({worst, rel(m.loss, w.loss), rel(m.grad_norm, w.grad_norm), rel(m.aux_loss, w.aux_loss),
                      rel(m.z_loss, w.z_loss)});
    EXPECT_EQ(m.tokens, w.tokens);
    EXPECT_EQ(m.valid_tokens, w.valid_tokens);
    EXPECT_EQ(w.routing.size(), static_cast<size_t>(l.dp * t.config().grad_accum));  // one hash per micro-batch
    EXPECT_EQ(m.routing, w.routing) << "step " << s + 1 << ": the routing differs from the single-rank run";
    // Every routed row is received by exactly one rank.
    const double rows = static_cast<double>(m.tokens * mc.top_k * mc.num_moe_layers());
    EXPECT_DOUBLE_EQ(m.moe_rows_mean * static_cast<double>(R), rows);
    EXPECT_GE(static_cast<double>(m.moe_rows_max), m.moe_rows_mean);
  }
  std::vector<ParamUnit*> units = t.model().units();
  for (size_t i = 0; i < units.size(); ++i) {
    ParamUnit* u = units[i];
    const Tensor mine = t.state().gather_master(i), whole = ref.t->state().gather_master(i);
    if (u->kind == UnitKind::experts) {
      EXPECT_EQ(u->num_experts, mc.num_experts / l.ep) << u->name;
      EXPECT_EQ(u->first_expert, t.mesh().ep_rank() * (mc.num_experts / l.ep)) << u->name;
      EXPECT_LE(rel_norm(mine.to_floats(), local_slice_of(t, *ref.t, i, whole)), master_tol) << u->name;
    } else {
      EXPECT_LE(rel_norm(mine.to_floats(), whole.to_floats()), master_tol) << u->name;
    }
  }
  if (world()->rank() == 0)
    std::printf("[%s] %s attention %s dispatch %s state %s: max rel diff vs 1 rank over %zu steps: %.1e\n", tag,
                l.str().c_str(), t.config().prim.attention.name.c_str(), t.config().prim.moe_dispatch.name.c_str(),
                t.config().prim.state.name.c_str(), got.size(), worst);
}

}  // namespace bb::test

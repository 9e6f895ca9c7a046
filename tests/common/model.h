// model.h — test helpers for whole models: options from primitive names, and a model together
// with the schedule that runs its layer loop.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "runtime/schedule.h"

namespace bb::test {

// ModelOptions with the named primitive choices, e.g. {{"loss", "full_ce"}}.
inline ModelOptions model_options(const std::vector<std::pair<std::string, std::string>>& prims = {}) {
  ModelOptions o;
  for (const auto& [key, name] : prims) o.prims.set(key, name, "test");
  return o;
}

// A model and its schedule (recompute from the options' choice).
struct ModelRun {
  DecoderModel model;
  Schedule schedule;
  ModelRun(const ModelConfig& c, const ModelOptions& o, uint64_t seed, bool delay_wgrad = false)
      : model(c, o, seed),
        schedule(model, ScheduleOptions{o.prims.recompute.value, delay_wgrad,
                                        recompute_parts(o.prims.recompute)}) {}
  ForwardStats forward_backward(const MicroBatch& mb, float loss_scale, double aux_scale) {
    return schedule.forward_backward(mb, loss_scale, aux_scale);
  }
  ForwardStats forward(const MicroBatch& mb, Tensor* logits) { return schedule.forward(mb, logits); }
  const std::vector<Tensor>& last_routing() const { return schedule.last_routing(); }
};

}  // namespace bb::test

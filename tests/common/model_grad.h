// model_grad.h — the whole-model gradient check shared by the model tests: every parameter's
// gradient against a central finite difference along a random direction.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/model.h"
#include "common/testing.h"

namespace bb::test {

// The objective whose gradient forward_backward(mb, 1, 1) computes: loss sum + aux + z terms.
inline double model_objective(const ForwardStats& s, const ModelOptions& o) {
  return s.loss_sum + o.aux_loss_coef * s.aux_loss + o.z_loss_coef * s.z_loss;
}

// Runs forward_backward on `mb`, then for every parameter compares <grad, u> with
// (L(w + h u) - L(w - h u)) / 2h, u a random direction, h 1e-3 (relative error against
// max(|fd|, 1e-2) below `tol`); the routing must not change under the perturbation (finite
// differences are only valid while the top-k selection stays put). BB_VERBOSE prints each
// parameter. Returns the number of parameters checked.
inline int check_directional_gradients(ModelRun& run, const MicroBatch& mb, const ModelOptions& o,
                                       double tol = 2e-2) {
  DecoderModel& m = run.model;
  m.zero_grad();
  run.forward_backward(mb, 1.0f, 1.0);
  const std::vector<Tensor> routing0 = run.last_routing();
  EXPECT_FALSE(routing0.empty());
  int checked = 0;
  uint64_t dir_seed = 100;
  for (Param* p : m.params()) {
    const int64_t n = p->value.numel();
    const auto u = randn(static_cast<size_t>(n), dir_seed++);
    const auto w0 = p->value.to_floats();
    const auto g = p->grad.to_floats();
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += static_cast<double>(g[i]) * u[i];
    const double h = 1e-3;
    auto eval = [&](double sgn) {
      std::vector<float> w(w0);
      for (int64_t i = 0; i < n; ++i) w[i] += static_cast<float>(sgn * h * u[i]);
      p->value.copy_from(Tensor::from_floats(w, p->value.shape()));
      const double L = model_objective(run.forward(mb, nullptr), o);
      for (size_t l = 0; l < routing0.size(); ++l)
        EXPECT_EQ(run.last_routing()[l].to_ints(), routing0[l].to_ints())
            << p->name << ": routing changed under perturbation";
      return L;
    };
    const double fd = (eval(+1) - eval(-1)) / (2 * h);
    p->value.copy_from(Tensor::from_floats(w0, p->value.shape()));
    const double err = std::fabs(fd - analytic) / std::max(std::fabs(fd), 1e-2);
    if (std::getenv("BB_VERBOSE"))
      std::printf("%-55s fd %+.6e an %+.6e err %.1e\n", p->name.c_str(), fd, analytic, err);
    EXPECT_LT(err, tol) << p->name << ": finite difference " << fd << " vs analytic " << analytic;
    ++checked;
  }
  return checked;
}

}  // namespace bb::test

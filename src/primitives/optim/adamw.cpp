#include "primitives/optim/adamw.h"

#include <cmath>

#include "backend/cpu/util.h"

namespace bb {

void adamw_step(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                Tensor* model) {
  const char* op = "adamw_step";
  check_dtype(master, DType::f32, op, "master");
  check_dtype(grad, DType::f32, op, "grad");
  check_dtype(exp_avg, DType::f32, op, "exp_avg");
  check_dtype(exp_avg_sq, DType::f32, op, "exp_avg_sq");
  const int64_t n = master.numel();
  BB_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n, op,
           ": sizes differ: master ", n, ", grad ", grad.numel(), ", exp_avg ", exp_avg.numel(),
           ", exp_avg_sq ", exp_avg_sq.numel());
  BB_CHECK(step >= 1, op, ": step is 1-based, got ", step);
  BB_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, op,
           ": betas must be in [0, 1), got ", cfg.beta1, ", ", cfg.beta2);
  BB_CHECK(master.device().is_cpu(), op, ": not implemented on ", master.device().str(), " yet");
  if (model) {
    check_float(*model, op, "model");
    BB_CHECK(model->numel() == n, op, ": model has ", model->numel(), " elements, master ", n);
  }
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
  const float eps = static_cast<float>(cfg.eps);
  float* p = master.data<float>();
  const float* g = grad.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    p[i] *= decay;
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
  if (model) cpu::store_f32(*model, master);
}

double sum_of_squares(const Tensor& g) {
  check_float(g, "sum_of_squares", "g");
  std::vector<float> v;
  const float* p;
  Tensor gf;
  if (g.dtype() == DType::f32 && g.device().is_cpu()) {
    p = g.data<float>();
  } else {
    v = g.to_floats();
    p = v.data();
  }
  double s = 0;
  for (int64_t i = 0; i < g.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

double global_grad_norm(const std::vector<Tensor>& grads) {
  double s = 0;
  for (const Tensor& g : grads) s += sum_of_squares(g);
  return std::sqrt(s);
}

void scale_inplace(Tensor& g, float s) {
  check_dtype(g, DType::f32, "scale_inplace", "g");
  BB_CHECK(g.device().is_cpu(), "scale_inplace: not implemented on ", g.device().str(), " yet");
  float* p = g.data<float>();
  for (int64_t i = 0; i < g.numel(); ++i) p[i] *= s;
}

}  // namespace bb

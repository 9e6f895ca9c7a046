// aux_loss.cpp — the pooled load-balancing loss (aux_loss.h). The probability sums stay on the
// device as a [1, T] x [T, E] product per layer; the gradient's per-expert weights travel to the
// device in one upload per layer (staged, no host sync).
#include "primitives/moe/aux_loss.h"

#include <algorithm>

#include "primitives/elementwise/elementwise.h"
#include "primitives/linear/linear.h"

namespace bb {

namespace {
// A host-built tensor on `dev` (no copy on the CPU).
Tensor on_device(const Tensor& host, Device dev) { return dev.is_cpu() ? host : host.to(dev); }
}  // namespace

void AuxLossPool::begin(int64_t num_experts, RouterScore score, Device dev) {
  num_experts_ = num_experts;
  score_ = score;
  counts_.assign(static_cast<size_t>(num_experts), 0.0);
  rows_ = 0;
  prob_sum_ = num_experts > 0
                  ? Tensor::zeros({1, num_experts}, DType::f32, dev, MemCategory::other)
                  : Tensor();
}

void AuxLossPool::add(const Tensor& scores, const std::vector<int64_t>& counts) {
  const int64_t T = scores.size(0), E = scores.size(1);
  BB_CHECK(E == num_experts_ && static_cast<int64_t>(counts.size()) == E,
           "AuxLossPool::add: ", E, " experts, the pool was begun for ", num_experts_);
  for (int64_t e = 0; e < E; ++e) counts_[e] += static_cast<double>(counts[e]);
  rows_ += T;
  Tensor p = scores;
  if (score_ == RouterScore::sigmoid) {  // p = s / sum_e s, per token (host; sigmoid is rare here)
    std::vector<float> s = scores.to_floats();
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += s[t * E + e];
      for (int64_t e = 0; e < E; ++e) s[t * E + e] = static_cast<float>(s[t * E + e] / sum);
    }
    p = on_device(Tensor::from_floats(s, {T, E}, DType::f32, MemCategory::workspace),
                  scores.device());
  }
  // prob_sum[e] += sum_t p[t, e] as a [1, T] x [T, E] product (stays on the device). The
  // column of ones is made once per micro-batch size, not per layer.
  // (An undefined tensor counts one element: a first call with T = 1 must still make the column.)
  if (!ones_.defined() || ones_.numel() != T || ones_.device() != scores.device()) {
    const std::vector<float> one(static_cast<size_t>(T), 1.0f);
    ones_ = on_device(Tensor::from_floats(one, {T, 1}, DType::f32, MemCategory::other),
                      scores.device());
  }
  matmul(ones_, true, p, false, prob_sum_, 1.0f, 1.0f);
}

void AuxLossPool::finish() {
  if (reduce_hook && prob_sum_.defined()) reduce_hook(counts_, prob_sum_, rows_);
}

double AuxLossPool::value() const {
  if (rows_ == 0) return 0.0;
  const std::vector<float> prob_sum = prob_sum_.to_floats();
  const double R = static_cast<double>(rows_);
  double aux = 0;
  for (int64_t e = 0; e < num_experts_; ++e) aux += (counts_[e] / R) * (prob_sum[e] / R);
  return aux * static_cast<double>(num_experts_);
}

void AuxLossPool::add_grad(Tensor& d_logits, const Tensor& scores, double d_aux) const {
  if (d_aux == 0 || rows_ == 0) return;
  const int64_t T = scores.size(0), E = scores.size(1);
  const Device dev = scores.device();
  // d aux / d p_te = E * c_e / R^2 for every layer and token (the counts are constants).
  const double R = static_cast<double>(rows_);
  std::vector<float> g(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) g[e] = static_cast<float>(d_aux * E * counts_[e] / (R * R));
  if (score_ == RouterScore::softmax) {
    // Through p = softmax(l): d l_te = s_te * (g_e - sum_j g_j s_tj).
    // diag(g) [E, E] and g [E, 1] travel in one upload.
    std::vector<float> both(static_cast<size_t>((E + 1) * E), 0.0f);
    for (int64_t e = 0; e < E; ++e) both[e * E + e] = g[e];
    std::copy(g.begin(), g.end(), both.begin() + E * E);
    const Tensor up =
        on_device(Tensor::from_floats(both, {E + 1, E}, DType::f32, MemCategory::workspace), dev);
    const Tensor G = up.narrow(0, E);
    const Tensor gcol = up.narrow(E, 1).view({E, 1});
    matmul(scores, false, G, false, d_logits, 1.0f, 1.0f);
    Tensor u = Tensor::empty({T, 1}, DType::f32, dev, MemCategory::workspace);
    matmul(scores, false, gcol, false, u);
    axpy_inplace(d_logits, -1.0f, scale_rows(scores, u.view({T}), MemCategory::workspace));
    return;
  }
  // Sigmoid: p = s / S (S = sum_e s), s = sigmoid(l): d s_j = (g_j - sum_e g_e p_e) / S,
  // d l_j = d s_j * s_j * (1 - s_j). Host loop (sigmoid routing with an aux loss is rare).
  const std::vector<float> s = scores.to_floats();
  std::vector<float> dl(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const float* st = s.data() + t * E;
    double S = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e) S += st[e];
    for (int64_t e = 0; e < E; ++e) dot += g[e] * st[e] / S;
    for (int64_t e = 0; e < E; ++e)
      dl[t * E + e] = static_cast<float>((g[e] - dot) / S * st[e] * (1.0 - st[e]));
  }
  add_inplace(d_logits,
              on_device(Tensor::from_floats(dl, {T, E}, DType::f32, MemCategory::workspace), dev));
}

}  // namespace bb

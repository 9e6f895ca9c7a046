// calibrate.cpp — see calibrate.h.
#include "plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "primitives/activation/swiglu.h"
#include "primitives/attention/attention.h"
#include "primitives/gdn/gated_delta_rule.h"
#include "primitives/linear/linear.h"
#include "primitives/moe/experts.h"
#include "primitives/norm/rmsnorm.h"
#include "primitives/optim/adamw.h"
#include "runtime/optimizer_offload.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb::plan {

namespace {

// Median seconds of fn() over `reps` calls after one warm-up, the device drained around each.
double median_s(Device dev, const std::function<void()>& fn, int reps) {
  fn();
  synchronize_device(dev);
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    synchronize_device(dev);
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

Tensor randn(const Shape& shape, DType dt, Device dev, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(shape, dt, dev, MemCategory::other);
  fill_normal(t, seed, 0, 0.0f, std);
  return t;
}

// Points sorted by x, equal x merged (the mean of their values).
Curve curve_of(std::vector<std::pair<double, double>> pts) {
  std::sort(pts.begin(), pts.end());
  Curve c;
  for (size_t i = 0; i < pts.size();) {
    size_t j = i;
    double sum = 0;
    while (j < pts.size() && pts[j].first == pts[i].first) sum += pts[j++].second;
    c.pts.push_back({pts[i].first, sum / static_cast<double>(j - i)});
    i = j;
  }
  return c;
}

}  // namespace

Calibration calibrate(Device dev, bool quick, const std::function<void(const std::string&)>& log) {
  auto say = [&](const std::string& s) {
    if (log) log(s);
  };
  const bool cuda = dev.is_cuda();
  const DType dt = cuda ? DType::bf16 : DType::f32;
  const int reps = quick ? 2 : 5;
  char buf[256];
  Calibration c;
#ifdef BB_WITH_CUDA
  c.device = cuda ? cuda::device_name(dev.index) : "cpu";
#else
  BB_CHECK(!cuda, "plan --calibrate: this build has no CUDA backend");
  c.device = "cpu";
#endif
  c.source = std::string("bumblebee plan --calibrate") + (quick ? " --quick (small shapes: a smoke test, not a GPU's rates)" : "");

  // Dense GEMMs: token counts x the layer shapes of the supported models (K = the input width).
  {
    std::vector<int64_t> Ms = quick ? std::vector<int64_t>{64, 256} : std::vector<int64_t>{1024, 4096, 16384, 32768};
    std::vector<std::pair<int64_t, int64_t>> NK =
        quick ? std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {256, 128}}
              : std::vector<std::pair<int64_t, int64_t>>{{128, 2048},  {512, 2048},  {2048, 2048}, {2048, 4096},
                                                         {4096, 2048}, {8192, 2048}, {12288, 2048}, {2048, 8192}};
    std::vector<std::pair<double, double>> pts;
    for (int64_t M : Ms)
      for (const auto& [Nn, K] : NK) {
        Tensor x = randn({M, K}, dt, dev, 1), w = randn({Nn, K}, dt, dev, 2, 0.02f);
        const double s = median_s(dev, [&] { (void)linear_forward(x, w, Tensor()); }, reps);
        const double fl = 2.0 * static_cast<double>(M) * static_cast<double>(Nn) * static_cast<double>(K);
        pts.push_back({fl, fl / s / 1e12});
      }
    c.gemm_tflops = curve_of(pts);
    std::snprintf(buf, sizeof buf, "dense GEMM: %zu shapes, %.1f .. %.1f TFLOP/s", pts.size(),
                  c.gemm_tflops.pts.front().second, c.gemm_tflops.pts.back().second);
    say(buf);
  }

  // Grouped GEMMs: the experts' forward and both gradients at uniform rows per expert.
  {
    const int64_t E = quick ? 4 : 128, H = quick ? 64 : 2048, F = quick ? 32 : 768;
    c.grouped_hidden = H;
    c.grouped_ffn = F;
    const std::vector<int64_t> rows = quick ? std::vector<int64_t>{8, 64} : std::vector<int64_t>{32, 128, 512, 2048, 8192};
    Tensor wgu = randn({E, 2 * F, H}, dt, dev, 3, 0.02f), wd = randn({E, H, F}, dt, dev, 4, 0.02f);
    Tensor dwgu = Tensor::zeros({E, 2 * F, H}, DType::f32, dev, MemCategory::other);
    Tensor dwd = Tensor::zeros({E, H, F}, DType::f32, dev, MemCategory::other);
    std::vector<std::pair<double, double>> pts;
    for (int64_t r : rows) {
      const int64_t Nr = r * E;
      Tensor x = randn({Nr, H}, dt, dev, 5), dy = randn({Nr, H}, dt, dev, 6);
      const std::vector<int64_t> counts(static_cast<size_t>(E), r);
      const double s = median_s(
          dev,
          [&] {
            ExpertsSaved sv;
            (void)experts_forward(ExpertsImpl::grouped, x, counts, wgu, wd, Tensor(), &sv);
            const ExpertsDgrad dg = experts_backward_data(ExpertsImpl::grouped, dy, counts, wgu, wd, Tensor(), sv);
            experts_backward_weight(ExpertsImpl::grouped, dy, x, counts, Tensor(), sv, dg, dwgu, dwd);
          },
          reps);
      const double fl = 18.0 * static_cast<double>(Nr) * static_cast<double>(H) * static_cast<double>(F);
      pts.push_back({static_cast<double>(r), fl / s / 1e12});
      std::snprintf(buf, sizeof buf, "grouped GEMM: %lld rows per expert, %.1f TFLOP/s", static_cast<long long>(r),
                    fl / s / 1e12);
      say(buf);
    }
    c.grouped_tflops = curve_of(pts);
  }

  // Causal attention, one sequence, at head dim 128 (32 q / 4 kv heads) and at Qwen3.5's 256
  // (16 q / 2 kv heads): cuDNN's rate differs by head dim.
  auto attention_rates = [&](int64_t Hq, int64_t Hkv, int64_t D, Curve& fwd_curve, Curve& bwd_curve) {
    const std::vector<int64_t> seqs =
        quick ? std::vector<int64_t>{64, 256} : std::vector<int64_t>{4096, 8192, 16384, 32768, 65536, 131072};
    std::vector<std::pair<double, double>> fwd, bwd;
    for (int64_t S : seqs) {
      Tensor q = randn({S, Hq, D}, dt, dev, 7), k = randn({S, Hkv, D}, dt, dev, 8);
      Tensor v = randn({S, Hkv, D}, dt, dev, 9), d_o = randn({S, Hq, D}, dt, dev, 10);
      Tensor cu = Tensor::from_ints({0, static_cast<int32_t>(S)}, {2});
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      const AttentionArgs args = AttentionArgs::causal_self(cu, scale);
      const int r = S >= 65536 ? std::min(reps, 3) : reps;
      const double f = median_s(dev, [&] {
        AttentionSaved sv;
        (void)attention_forward(q, k, v, args, &sv);
      }, r);
      const double both = median_s(dev, [&] {
        AttentionSaved sv;
        Tensor o = attention_forward(q, k, v, args, &sv);
        (void)attention_backward(d_o, q, k, v, o, args, sv);
      }, r);
      const double fl = 4.0 * (static_cast<double>(S) * static_cast<double>(S) / 2) * static_cast<double>(Hq) * static_cast<double>(D);
      const double b = std::max(both - f, 1e-9);
      fwd.push_back({static_cast<double>(S), fl / f / 1e12});
      bwd.push_back({static_cast<double>(S), 2.5 * fl / b / 1e12});
      std::snprintf(buf, sizeof buf, "attention (head dim %lld): %lld tokens, forward %.1f, backward %.1f TFLOP/s",
                    static_cast<long long>(D), static_cast<long long>(S), fl / f / 1e12, 2.5 * fl / b / 1e12);
      say(buf);
    }
    fwd_curve = curve_of(fwd);
    bwd_curve = curve_of(bwd);
  };
  {
    const int64_t Hq = quick ? 4 : 32, Hkv = quick ? 2 : 4, D = quick ? 32 : 128;
    c.attn_heads = Hq;
    c.attn_head_dim = D;
    attention_rates(Hq, Hkv, D, c.attn_fwd_tflops, c.attn_bwd_tflops);
    Calibration::AttentionRates r;
    r.heads = quick ? 2 : 16;
    r.head_dim = quick ? 64 : 256;
    attention_rates(r.heads, quick ? 1 : 2, r.head_dim, r.fwd_tflops, r.bwd_tflops);
    c.attn_by_head_dim.push_back(r);
  }

  // The Gated DeltaNet rule (CUDA; on the CPU only a smoke size).
  {
    const int64_t Hk = quick ? 2 : 16, Hv = quick ? 4 : 32, Kd = quick ? 16 : 128, Vd = quick ? 16 : 128;
    c.gdn_key_dim = Kd;
    c.gdn_value_dim = Vd;
    const std::vector<int64_t> seqs = quick || !cuda ? std::vector<int64_t>{64, 128}
                                                     : std::vector<int64_t>{4096, 16384, 65536, 131072};
    std::vector<std::pair<double, double>> fwd, bwd;
    for (int64_t S : seqs) {
      Tensor q = randn({S, Hk, Kd}, dt, dev, 11), k = randn({S, Hk, Kd}, dt, dev, 12);
      Tensor v = randn({S, Hv, Vd}, dt, dev, 13), d_o = randn({S, Hv, Vd}, dt, dev, 14);
      Tensor g = randn({S, Hv}, DType::f32, dev, 15, 0.1f), beta = randn({S, Hv}, DType::f32, dev, 16, 0.1f);
      // Decays <= 0 and write strengths in (0, 1), as the model gives them.
      {
        Tensor gh = g.to(Device::cpu()), bh = beta.to(Device::cpu());
        float* gp = gh.data<float>();
        float* bp = bh.data<float>();
        for (int64_t i = 0; i < gh.numel(); ++i) {
          gp[i] = -std::fabs(gp[i]);
          bp[i] = 1.0f / (1.0f + std::exp(-bp[i]));
        }
        g = gh.to(dev);
        beta = bh.to(dev);
      }
      Tensor cu = Tensor::from_ints({0, static_cast<int32_t>(S)}, {2});
      const int r = S >= 65536 ? std::min(reps, 3) : reps;
      const double f = median_s(dev, [&] { (void)gated_delta_rule_forward(q, k, v, g, beta, cu); }, r);
      const double both = median_s(dev, [&] {
        (void)gated_delta_rule_forward(q, k, v, g, beta, cu);
        (void)gated_delta_rule_backward(d_o, q, k, v, g, beta, cu);
      }, r);
      const double th = static_cast<double>(S) * static_cast<double>(Hv);
      fwd.push_back({static_cast<double>(S), f / th * 1e9});
      bwd.push_back({static_cast<double>(S), std::max(both - f, 1e-12) / th * 1e9});
      std::snprintf(buf, sizeof buf, "Gated DeltaNet: %lld tokens, forward %.3f, backward %.3f ns per token and value head",
                    static_cast<long long>(S), f / th * 1e9, std::max(both - f, 1e-12) / th * 1e9);
      say(buf);
    }
    c.gdn_fwd_ns = curve_of(fwd);
    c.gdn_bwd_ns = curve_of(bwd);
  }

  // Elementwise: rmsnorm and swiglu, forward (2 a T H and 3 a N F bytes as the time model counts
  // them) and backward (twice as many).
  {
    const double a = static_cast<double>(dtype_size(dt));
    const int64_t T = quick ? 512 : 32768, H = quick ? 64 : 2048, Nr = quick ? 2048 : 262144, F = quick ? 32 : 768;
    Tensor x = randn({T, H}, dt, dev, 17), w = randn({H}, dt, dev, 18), dy = randn({T, H}, dt, dev, 19);
    Tensor dw = Tensor::zeros({H}, DType::f32, dev, MemCategory::other);
    Tensor gu = randn({Nr, 2 * F}, dt, dev, 20), dh = randn({Nr, F}, dt, dev, 21);
    const double s = median_s(dev, [&] {
      RMSNormSaved sv;
      (void)rmsnorm_forward(x, w, 1e-6, &sv);
      (void)rmsnorm_backward(dy, x, w, sv, dw, false, nullptr, dt);
      (void)swiglu_forward(gu);
      (void)swiglu_backward(dh, gu);
    }, reps);
    const double bytes = 3 * (2 * a * T * H) + 3 * (3 * a * static_cast<double>(Nr) * F);
    c.elementwise_gbps = bytes / s / 1e9;
    std::snprintf(buf, sizeof buf, "elementwise: %.0f GB/s", c.elementwise_gbps);
    say(buf);
  }

  // A device copy.
  {
    const int64_t n = quick ? (int64_t{1} << 20) : (int64_t{1} << 29);  // bf16 elements: 1 GiB
    Tensor src = Tensor::zeros({n}, DType::bf16, dev, MemCategory::other);
    Tensor dst = Tensor::empty({n}, DType::bf16, dev, MemCategory::other);
    const double s = median_s(dev, [&] { dst.copy_from(src); }, reps);
    c.copy_gbps = 2.0 * 2.0 * static_cast<double>(n) / s / 1e9;
    std::snprintf(buf, sizeof buf, "copy: %.0f GB/s", c.copy_gbps);
    say(buf);
  }
  // The optimizer offload's host side (runtime/optimizer_offload.h): the host pool's AdamW over
  // 64 Mi elements with the values rounded to bf16, and page-locked copies each way.
  {
    const int64_t n = quick ? (int64_t{1} << 20) : (int64_t{1} << 26);
    std::vector<float> p(static_cast<size_t>(n), 0.5f), g(static_cast<size_t>(n), 1e-3f), m(static_cast<size_t>(n)),
        v(static_cast<size_t>(n));
    std::vector<uint16_t> vals(static_cast<size_t>(n));
    HostPool pool(HostPool::auto_ranges(0));
    const AdamWScalars sc = adamw_scalars(1, 1e-4, 0.1, AdamWConfig{});
    const double s = median_s(Device::cpu(), [&] {
      pool.run(n, [&](int64_t lo, int64_t hi) {
        adamw_update_f32_host(p.data() + lo, g.data() + lo, m.data() + lo, v.data() + lo, hi - lo, sc);
        host_values_from_master(p.data() + lo, vals.data() + lo, DType::bf16, hi - lo, false);
      });
    }, reps);
    c.host_adamw_geps = static_cast<double>(n) / s / 1e9;
    std::snprintf(buf, sizeof buf, "host AdamW (%d threads): %.2f G elements/s", pool.ranges(), c.host_adamw_geps);
    say(buf);
  }
#ifdef BB_WITH_CUDA
  if (dev.is_cuda()) {
    const size_t bytes = quick ? (size_t{1} << 20) : (size_t{1} << 28);
    void* host = cuda::pinned_alloc(bytes);
    Tensor d = Tensor::zeros({static_cast<int64_t>(bytes)}, DType::u8, dev, MemCategory::other);
    const double up = median_s(dev, [&] { cuda::copy_pinned_async(d.raw(), host, bytes); }, reps);
    const double down = median_s(dev, [&] { cuda::copy_pinned_async(host, d.raw(), bytes); }, reps);
    cuda::synchronize_device(dev.index);
    cuda::pinned_free(host);
    c.pcie_gbps = static_cast<double>(bytes) / std::max(up, down) / 1e9;
    std::snprintf(buf, sizeof buf, "page-locked copies: %.1f GB/s up, %.1f GB/s down", bytes / up / 1e9,
                  bytes / down / 1e9);
    say(buf);
  }
#endif
  c.validate("plan --calibrate");
  return c;
}

}  // namespace bb::plan

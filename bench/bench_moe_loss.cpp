// bench_moe_loss — the loss heads (linear_ce, linear_ce fused, full_ce) and MoE token
// permutation on the GPU at realistic sizes; prints two tables.
//
//   loss heads: T = 32768 tokens, V = 151936 (Qwen vocab), H = 2048, bf16 h and w. Forward and
//     backward time (median of 5 after 1 warm-up; wall clock around a synchronised call, since
//     the forward reads its loss back anyway), achieved TFLOP/s (forward 2TVH; backward 4TVH
//     for full_ce, 6TVH for linear_ce whose recompute is counted), and the peak of the `logits`
//     memory category over forward + backward. `linear_ce fused` is one pass (loss and
//     gradients, 6TVH): its time goes in the fwd+bwd column. Below the table: fused and two-pass
//     linear_ce against full_ce (time ratio, goal <= 1.2; logits peak ratio, goal <= 1/8).
//   permute: T = 32768, H = 2048, K = 8, E = 128, bf16. make_permute_map (includes its host
//     read), permute / unpermute forward and backward; GB/s counts each tensor's bytes once.
//
//   build/bench/bench_moe_loss [--tokens N] [--vocab N] [--hidden N] [--skip-full]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "core/tensor.h"
#include "primitives/loss/linear_ce.h"
#include "primitives/moe/permute.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/rng_cuda.h"
#include "backend/cuda/runtime.h"
#endif

namespace bb {
namespace {

#ifdef BB_WITH_CUDA
const Device kGpu = Device::cuda(0);

using bench::median_ms;
using bench::randn_dev;

void bench_loss(int64_t T, int64_t V, int64_t H, bool skip_full) {
  std::printf("\nloss heads: T = %lld, V = %lld, H = %lld, bf16 h and w, f32 d_w\n",
              static_cast<long long>(T), static_cast<long long>(V), static_cast<long long>(H));
  Tensor h = randn_dev({T, H}, DType::bf16, 1.0f, 1, MemCategory::activations);
  Tensor w = randn_dev({V, H}, DType::bf16, 0.02f, 2, MemCategory::params);
  std::vector<int32_t> tv(T);
  for (int64_t t = 0; t < T; ++t) tv[t] = static_cast<int32_t>((t * 7919) % V);
  Tensor targets = Tensor::from_ints(tv, {T}).to(kGpu);
  Tensor d_w = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
  Tensor d_h = Tensor::empty({T, H}, DType::bf16, kGpu, MemCategory::activations);
  const double flop_fwd = 2.0 * T * V * H;
  Allocator& alloc = allocator_for(kGpu);

  std::printf("%-26s %10s %10s %12s %12s %12s %14s %12s\n", "head", "fwd ms", "bwd ms",
              "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "logits peak", "loss/token");
  struct Row {
    const char* name;
    std::function<LossResult(LossHeadSaved*)> fwd;
    std::function<void(const LossHeadSaved&)> bwd;
    double bwd_flop;
  };
  LossHeadConfig cfg;  // defaults: 4096 x 32768 chunks; fused: 2048-token chunks
  char lin_name[64];
  std::snprintf(lin_name, sizeof lin_name, "linear_ce (%lldx%lld)",
                static_cast<long long>(cfg.chunk_tokens), static_cast<long long>(cfg.chunk_vocab));
  std::vector<Row> rows;
  rows.push_back({lin_name,
                  [&](LossHeadSaved* s) { return linear_ce_forward(h, w, targets, cfg, s); },
                  [&](const LossHeadSaved& s) { linear_ce_backward(1.0f / T, h, w, targets, cfg, s, d_h, d_w); },
                  3.0 * flop_fwd});
  if (!skip_full)
    rows.push_back({"full_ce",
                    [&](LossHeadSaved* s) { return full_ce_forward(h, w, targets, s); },
                    [&](const LossHeadSaved& s) { full_ce_backward(1.0f / T, h, w, targets, s, d_h, d_w); },
                    2.0 * flop_fwd});
  struct Measured {
    double total_ms = 0;  // 0 = not measured
    int64_t peak = 0;
    double flop = 0;  // fwd + bwd, recompute included
  };
  Measured full_m, lin_m, fused_m;
  for (const Row& r : rows) {
    try {
      LossResult res;
      const double fwd = median_ms([&] { res = r.fwd(nullptr); }, 1, 5);
      LossHeadSaved saved;
      double bwd = 0;
      {
        std::vector<double> ms;
        for (int i = 0; i < 6; ++i) {  // first is a warm-up
          saved = LossHeadSaved();
          r.fwd(&saved);
          cuda::synchronize();
          const auto t0 = std::chrono::steady_clock::now();
          r.bwd(saved);
          cuda::synchronize();
          if (i) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        bwd = ms[ms.size() / 2];
      }
      saved = LossHeadSaved();
      cuda::synchronize();
      alloc.reset_peak();
      r.fwd(&saved);
      r.bwd(saved);
      saved = LossHeadSaved();
      cuda::synchronize();
      const int64_t peak = alloc.stats().peak_of(MemCategory::logits);
      std::printf("%-26s %10.2f %10.2f %12.2f %12.1f %12.1f %14s %12.4f\n", r.name, fwd, bwd,
                  fwd + bwd, flop_fwd / fwd * 1e-9, r.bwd_flop / bwd * 1e-9,
                  format_bytes(peak).c_str(), res.loss_sum / std::max<int64_t>(1, res.num_valid));
      Measured& m = r.name == lin_name ? lin_m : full_m;
      m = Measured{fwd + bwd, peak, flop_fwd + r.bwd_flop};
    } catch (const Error& e) {
      std::printf("%-26s failed: %s\n", r.name, e.what());
    }
  }

  // linear_ce fused: one pass with the scale known up front (what training does).
  char fused_name[64];
  std::snprintf(fused_name, sizeof fused_name, "linear_ce fused (%lld)",
                static_cast<long long>(cfg.fused_chunk_tokens));
  try {
    LossResult res;
    const double ms =
        median_ms([&] { res = linear_ce_fused(1.0f / T, h, w, targets, cfg, d_h, d_w); }, 1, 5);
    cuda::synchronize();
    alloc.reset_peak();
    linear_ce_fused(1.0f / T, h, w, targets, cfg, d_h, d_w);
    cuda::synchronize();
    const int64_t peak = alloc.stats().peak_of(MemCategory::logits);
    std::printf("%-26s %10s %10s %12.2f %12s %12s %14s %12.4f\n", fused_name, "-", "-", ms, "-",
                "-", format_bytes(peak).c_str(),
                res.loss_sum / std::max<int64_t>(1, res.num_valid));
    fused_m = Measured{ms, peak, 3.0 * flop_fwd};
  } catch (const Error& e) {
    std::printf("%-26s failed: %s\n", fused_name, e.what());
  }

  if (full_m.total_ms > 0) {
    std::printf("\nagainst full_ce (fwd+bwd %.2f ms, logits peak %s); goal: time <= 1.20x, "
                "peak <= 1/8 = 0.125x\n",
                full_m.total_ms, format_bytes(full_m.peak).c_str());
    for (const auto& [name, m] : {std::pair<const char*, Measured>{fused_name, fused_m},
                                  std::pair<const char*, Measured>{lin_name, lin_m}}) {
      if (m.total_ms <= 0) continue;
      const double tr = m.total_ms / full_m.total_ms;
      const double pr = static_cast<double>(m.peak) / std::max<int64_t>(1, full_m.peak);
      std::printf("  %-26s time %.3fx (%s, %.0f TFLOP/s fwd+bwd)   logits peak %.4fx = 1/%.1f "
                  "(%s)\n",
                  name, tr, tr <= 1.2 ? "met" : "missed", m.flop / m.total_ms * 1e-9, pr,
                  1.0 / std::max(pr, 1e-12), pr <= 0.125 ? "met" : "missed");
    }
  }
}

void bench_permute(int64_t T, int64_t H, int64_t K, int64_t E) {
  const int64_t N = T * K;
  std::printf("\npermute: T = %lld, H = %lld, K = %lld, E = %lld, bf16 (N = %lld rows)\n",
              static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(K),
              static_cast<long long>(E), static_cast<long long>(N));
  // K distinct experts per token, spread unevenly (a skewed but deterministic routing).
  std::vector<int32_t> idx(N);
  uint32_t x = 2463534242u;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<char> taken(E, 0);
    for (int64_t k = 0; k < K; ++k) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      int64_t e = static_cast<int64_t>((static_cast<uint64_t>(x % 1000) * (x % 1000)) * E / 1000000);
      while (taken[e]) e = (e + 1) % E;
      taken[e] = 1;
      idx[t * K + k] = static_cast<int32_t>(e);
    }
  }
  Tensor topk = Tensor::from_ints(idx, {T, K}).to(kGpu);
  Tensor xt = randn_dev({T, H}, DType::bf16, 1.0f, 3, MemCategory::activations);
  Tensor yp = randn_dev({N, H}, DType::bf16, 1.0f, 4, MemCategory::moe);
  Tensor dy = randn_dev({T, H}, DType::bf16, 1.0f, 5, MemCategory::activations);
  Tensor prob = randn_dev({T, K}, DType::f32, 0.1f, 6, MemCategory::activations);
  PermuteMap map = make_permute_map(topk, E);
  const double row = static_cast<double>(H) * 2, tok = static_cast<double>(T) * row,
               perm = static_cast<double>(N) * row;
  struct Op {
    const char* name;
    std::function<void()> fn;
    double bytes;
  };
  const std::vector<Op> ops = {
      {"make_permute_map", [&] { map = make_permute_map(topk, E); }, 3.0 * N * 4},
      {"permute_forward", [&] { permute_forward(xt, map); }, tok + perm},
      {"permute_backward", [&] { permute_backward(yp, map); }, perm + tok},
      {"unpermute_forward (prob)", [&] { unpermute_forward(yp, map, prob); }, perm + tok},
      {"unpermute_forward (unit)", [&] { unpermute_forward(yp, map, Tensor()); }, perm + tok},
      {"unpermute_backward (prob)", [&] { unpermute_backward(dy, yp, map, prob); }, tok + 2 * perm},
      {"unpermute_backward (unit)", [&] { unpermute_backward(dy, Tensor(), map, Tensor()); }, tok + perm},
  };
  std::printf("%-28s %10s %10s\n", "op", "ms", "GB/s");
  for (const Op& o : ops) {
    const double ms = median_ms(o.fn, 3, 20);
    std::printf("%-28s %10.3f %10.1f\n", o.name, ms, o.bytes / ms * 1e-6);
  }
}
#endif

}  // namespace
}  // namespace bb

int main(int argc, char** argv) {
#ifndef BB_WITH_CUDA
  (void)argc;
  (void)argv;
  std::printf("bench_moe_loss: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF); nothing to measure\n");
  return 0;
#else
  int64_t T = 32768, V = 151936, H = 2048;
  bool skip_full = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_moe_loss: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::stoll(argv[++i]);
    };
    if (a == "--tokens") T = next();
    else if (a == "--vocab") V = next();
    else if (a == "--hidden") H = next();
    else if (a == "--skip-full") skip_full = true;
    else {
      std::fprintf(stderr, "usage: bench_moe_loss [--tokens N] [--vocab N] [--hidden N] [--skip-full]\n");
      return 2;
    }
  }
  if (bb::cuda::device_count() == 0) {
    std::printf("bench_moe_loss: no usable CUDA device (%s); nothing to measure\n",
                bb::cuda::unavailable_reason());
    return 0;
  }
  try {
    bb::bench_loss(T, V, H, skip_full);
    bb::bench_permute(T, H, 8, 128);
  } catch (const bb::Error& e) {
    std::fprintf(stderr, "bench_moe_loss: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}

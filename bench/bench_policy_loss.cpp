// bench_policy_loss — the policy loss head (primitives.loss = "policy") on the GPU at the RL
// issue's sizes, beside linear_ce_fused (its family baseline, the same blocks and GEMMs).
//
//   V = 248320 (Qwen3.5 vocab), H = 2048, bf16 h and w, T = 16K / 64K / 128K tokens by default.
//   One call = loss + d_h + d_w (training), median of --iters after one warm-up, wall clock
//   around a synchronised call (the loss head reads its statistics back anyway). Achieved
//   TFLOP/s counts the GEMMs run: 6TVH, 8TVH where the logits GEMM runs twice (the vocab sweep;
//   --ratio sequence on the row sweep). Memory: the peak of the `logits` category over the call against the full f32 logits
//   T x V x 4 (the goal: <= 1/16), and the peak of all device memory the call added.
//   The objective: clip 0.2 / 0.28, k3 KL 0.01, entropy 0.001, token mean (GRPO / DAPO style).
//
//   build/bench/bench_policy_loss [--tokens 16384,65536,131072] [--vocab N] [--hidden N]
//                                 [--chunk N|auto] [--blocks auto|rows|vocab] [--iters N]
//                                 [--ratio token|sequence] [--dump DIR]
//   --chunk: rows of the [rows, V] logits block for both heads; auto (the default) is what a run
//   uses: linear_ce 2048, policy policy_chunk_rows (T / 64 as a power of two in [256, 2048]).
//   --blocks: the policy head's block order (primitives.policy_blocks): auto (the default) as a
//   run, rows ([rows, V] blocks, one sweep) or vocab ([T, cols] blocks, two sweeps); the table's
//   block column names the one taken.
//   --dump DIR: after the table, one call at the first T written to DIR (h, w as f32 of their
//   bf16 values, targets, advantages, old / ref log-probs, the loss, d_h, d_w; raw little-endian
//   .bin files and meta.json) for bench/policy_loss_ref.py --check DIR (PyTorch parity).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "primitives/loss/linear_ce.h"
#include "primitives/loss/policy.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {
namespace {

#ifdef BB_WITH_CUDA
const Device kGpu = Device::cuda(0);

using bench::median_ms;
using bench::randn_dev;

struct Args {
  std::vector<int64_t> tokens{16384, 65536, 131072};
  int64_t vocab = 248320, hidden = 2048, chunk = 0;  // chunk 0: auto
  int iters = 5;
  std::string ratio = "token";
  std::string blocks = "auto";
  std::string dump;
};

void write_bin(const std::string& path, const void* p, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  BB_CHECK(f, "bench_policy_loss: cannot write ", path);
  const size_t n = std::fwrite(p, 1, bytes, f);
  std::fclose(f);
  BB_CHECK(n == bytes, "bench_policy_loss: short write to ", path);
}

void run(const Args& a) {
  const int64_t V = a.vocab, H = a.hidden;
  std::printf("bench_policy_loss: V %lld, H %lld, bf16 h / w, chunk %s, policy blocks %s, ratio %s, median of %d\n",
              static_cast<long long>(V), static_cast<long long>(H),
              a.chunk > 0 ? (std::to_string(a.chunk) + " tokens").c_str() : "auto", a.blocks.c_str(), a.ratio.c_str(),
              a.iters);
  std::printf("| T | head | block | ms | TFLOP/s | logits peak GiB | full f32 logits GiB | ratio | call's device peak GiB |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  Allocator& alloc = allocator_for(kGpu);
  const Tensor w = randn_dev({V, H}, DType::bf16, 0.02f, 2, MemCategory::params);
  Tensor d_w = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
  auto gib = [](double b) { return b / double(int64_t{1} << 30); };
  for (int64_t T : a.tokens) {
    const Tensor h = randn_dev({T, H}, DType::bf16, 1.0f, 1, MemCategory::activations);
    std::vector<int32_t> tg(static_cast<size_t>(T));
    std::vector<float> adv(static_cast<size_t>(T)), old(static_cast<size_t>(T)), ref(static_cast<size_t>(T)),
        sw(static_cast<size_t>(T));
    const int64_t seq = std::min<int64_t>(T, 4096);  // rollouts of 4K tokens
    for (int64_t t = 0; t < T; ++t) {
      tg[t] = static_cast<int32_t>((t * 7919) % V);
      adv[t] = static_cast<float>(((t / seq) % 3) - 1);
      old[t] = -12.4f + 0.1f * static_cast<float>((t * 31) % 7 - 3);
      ref[t] = -12.4f + 0.05f * static_cast<float>((t * 17) % 5 - 2);
      // 1 / the length of the token's sequence (the last one may be shorter).
      const int64_t s0 = t / seq * seq;
      sw[t] = 1.0f / static_cast<float>(std::min(seq, T - s0));
    }
    std::vector<int32_t> cu{0};
    for (int64_t s = seq; s <= T; s += seq) cu.push_back(static_cast<int32_t>(s));
    if (cu.back() != T) cu.push_back(static_cast<int32_t>(T));
    const Tensor targets = Tensor::from_ints(tg, {T}).to(kGpu, MemCategory::activations);
    const PolicyTokens in{Tensor::from_floats(adv, {T}), Tensor::from_floats(old, {T}), Tensor::from_floats(ref, {T}),
                          Tensor::from_floats(sw, {T}),
                          Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())})};
    LossHeadConfig cfg;
    if (a.chunk > 0) cfg.fused_chunk_tokens = cfg.policy.chunk_tokens = a.chunk;
    cfg.policy.clip_high = 0.28;
    cfg.policy.kl_coef = 0.01;
    cfg.policy.entropy_coef = 0.001;
    cfg.policy.ratio = a.ratio == "sequence" ? PolicyRatio::sequence : PolicyRatio::token;
    cfg.policy.blocks = a.blocks == "rows" ? PolicyBlocks::rows : a.blocks == "vocab" ? PolicyBlocks::vocab
                                                                                      : PolicyBlocks::auto_;
    const int64_t cols = policy_vocab_cols(cfg.policy, true, T, V, H);
    const double full = static_cast<double>(T) * static_cast<double>(V) * 4.0;
    const float scale = 1.0f / static_cast<float>(T);
    for (const char* head : {"policy", "linear_ce_fused"}) {
      const bool policy = std::strcmp(head, "policy") == 0;
      Tensor d_h = Tensor::empty({T, H}, DType::bf16, kGpu, MemCategory::activations);
      auto call = [&] {
        if (policy) policy_loss_train(scale, h, w, targets, in, cfg, d_h, d_w);
        else linear_ce_fused(scale, h, w, targets, cfg, d_h, d_w);
      };
      call();  // warm-up (cuBLASLt plans, the pool)
      cuda::synchronize();
      const int64_t base = alloc.stats().live_total;
      alloc.reset_peak();
      const double ms = median_ms(call, 0, a.iters);
      const bool twice = policy && (cols > 0 || cfg.policy.ratio == PolicyRatio::sequence);
      const double flops = (twice ? 8.0 : 6.0) * T * V * H;
      const int64_t lp = alloc.stats().peak_of(MemCategory::logits);
      const int64_t rows = policy ? policy_chunk_rows(cfg.policy, T) : std::min(cfg.fused_chunk_tokens, T);
      const std::string block = policy && cols > 0 ? "vocab: T x " + std::to_string(cols)
                                                   : "rows: " + std::to_string(rows) + " x V";
      std::printf("| %lldK | %s | %s | %.2f | %.1f | %.3f | %.2f | 1/%.0f | %.2f |\n", static_cast<long long>(T / 1024),
                  head, block.c_str(), ms, flops / (ms * 1e-3) / 1e12, gib(static_cast<double>(lp)), gib(full), full / std::max<double>(1, lp),
                  gib(static_cast<double>(alloc.stats().peak_total - base)));
      std::fflush(stdout);
    }
    if (!a.dump.empty() && T == a.tokens.front()) {
      BB_CHECK(cfg.policy.ratio == PolicyRatio::token, "bench_policy_loss: --dump covers the token ratio "
               "(policy_loss_ref.py --check writes that objective); drop --ratio sequence");
      // One call from zero gradients, written for the PyTorch parity check.
      Tensor d_h = Tensor::empty({T, H}, DType::f32, kGpu, MemCategory::activations);
      Tensor dw = Tensor::zeros({V, H}, DType::f32, kGpu, MemCategory::grads);
      const LossResult r = policy_loss_train(scale, h, w, targets, in, cfg, d_h, dw);
      std::filesystem::create_directories(a.dump);
      const std::vector<float> hf = h.to_floats(), wf = w.to_floats(), dh = d_h.to_floats(), dwf = dw.to_floats();
      write_bin(a.dump + "/h.bin", hf.data(), hf.size() * 4);
      write_bin(a.dump + "/w.bin", wf.data(), wf.size() * 4);
      write_bin(a.dump + "/targets.bin", tg.data(), tg.size() * 4);
      write_bin(a.dump + "/adv.bin", adv.data(), adv.size() * 4);
      write_bin(a.dump + "/old.bin", old.data(), old.size() * 4);
      write_bin(a.dump + "/ref.bin", ref.data(), ref.size() * 4);
      write_bin(a.dump + "/d_h.bin", dh.data(), dh.size() * 4);
      write_bin(a.dump + "/d_w.bin", dwf.data(), dwf.size() * 4);
      char meta[256];
      std::snprintf(meta, sizeof meta, "{\"T\": %lld, \"V\": %lld, \"H\": %lld, \"dtype\": \"bf16\", \"loss\": %.17g}",
                    static_cast<long long>(T), static_cast<long long>(V), static_cast<long long>(H),
                    r.loss_sum * static_cast<double>(scale));
      write_bin(a.dump + "/meta.json", meta, std::strlen(meta));
      std::printf("bench_policy_loss: dumped one call at T %lld to %s (bench/policy_loss_ref.py --check %s)\n",
                  static_cast<long long>(T), a.dump.c_str(), a.dump.c_str());
    }
  }
}
#endif

}  // namespace
}  // namespace bb

int main(int argc, char** argv) {
#ifndef BB_WITH_CUDA
  (void)argc;
  (void)argv;
  std::printf("bench_policy_loss: this build has no CUDA backend (BUMBLEBEE_CUDA=OFF); nothing to measure\n");
  return 0;
#else
  bb::Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_policy_loss: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--tokens") {
      a.tokens.clear();
      std::stringstream ss(val());
      for (std::string p; std::getline(ss, p, ',');) a.tokens.push_back(std::atoll(p.c_str()));
    } else if (k == "--vocab") a.vocab = std::atoll(val().c_str());
    else if (k == "--hidden") a.hidden = std::atoll(val().c_str());
    else if (k == "--chunk") {
      const std::string v = val();
      a.chunk = v == "auto" ? 0 : std::atoll(v.c_str());
      if (v != "auto" && a.chunk <= 0) {
        std::fprintf(stderr, "bench_policy_loss: --chunk must be a positive integer or auto, got %s\n", v.c_str());
        return 2;
      }
    }
    else if (k == "--iters") a.iters = std::atoi(val().c_str());
    else if (k == "--ratio") a.ratio = val();
    else if (k == "--blocks") {
      a.blocks = val();
      if (a.blocks != "auto" && a.blocks != "rows" && a.blocks != "vocab") {
        std::fprintf(stderr, "bench_policy_loss: --blocks must be auto, rows or vocab, got %s\n", a.blocks.c_str());
        return 2;
      }
    }
    else if (k == "--dump") a.dump = val();
    else {
      std::fprintf(stderr, "usage: bench_policy_loss [--tokens N,N,...] [--vocab N] [--hidden N] [--chunk N|auto] "
                           "[--blocks auto|rows|vocab] [--iters N] [--ratio token|sequence] [--dump DIR]\n");
      return 2;
    }
  }
  if (bb::cuda::device_count() == 0) {
    std::printf("bench_policy_loss: no usable CUDA device (%s); nothing to measure\n",
                bb::cuda::unavailable_reason());
    return 0;
  }
  try {
    bb::run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_policy_loss: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}

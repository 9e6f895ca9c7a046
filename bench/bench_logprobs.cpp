// bench_logprobs — the forward-only log-prob pass of RL (runtime/logprobs.h, what `bumblebee
// logprobs` runs) at long sequences: tokens/s, model TFLOP/s and peak memory per category.
//
//   bench_logprobs [--config RUN.toml] [--tokens 32768,131072] [--doc-len N] [--reps 3]
//                  [--routing] [--set table.key=value ...]
//
// Each size S is one forward of S tokens (documents of --doc-len tokens, default one document
// of S), scored at temperature 1: per-token log-prob and entropy from the streamed head (no
// [T, V] logits), and with --routing the top-k experts of every MoE layer copied back too. The
// weights are the model's seeded initialisation (the pass's cost does not depend on their
// values). One runner is built for the largest S (train.micro_batch_tokens = max S) and holds
// the weights only: no gradients, no master weights, no optimizer state. Timing: the median of
// --reps calls of LogprobsRunner::run after one warm-up, wall clock (the results come back to the
// host, which that includes). Model FLOPs: the forward third of model_flops (DESIGN.md sec. 6).
// Memory: the peak per category over the last call (the runner resets the window per call) and
// the pool's reserved high-water mark since the process started.
//
// Default config: configs/qwen3.5-35b-a3b-4layer-gpu.toml (the Qwen3.5 slice on cuda:0; a tiny
// CPU run is what --config configs/demo.toml gives without a GPU).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/memory.h"
#include "core/rng.h"
#include "runtime/logprobs.h"
#include "runtime/trainer.h"

using namespace bb;

namespace {

Corpus documents(int64_t total, int64_t doc_len, int64_t vocab) {
  Corpus c;
  for (int64_t start = 0, d = 0; start < total; start += doc_len, ++d) {
    const int64_t len = std::min(doc_len, total - start);
    std::vector<int32_t> doc(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i)
      doc[static_cast<size_t>(i)] = static_cast<int32_t>(philox4x32_10(7 + d, static_cast<uint64_t>(i)).v[0] % vocab);
    c.add(doc);
  }
  return c;
}

double gib(int64_t b) { return static_cast<double>(b) / double(1 << 30); }

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/qwen3.5-35b-a3b-4layer-gpu.toml";
  std::vector<int64_t> sizes = {32768, 131072};
  std::vector<std::string> sets;
  int64_t doc_len = 0;
  int reps = 3;
  bool routing = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_logprobs: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config") config = next();
    else if (a == "--tokens") sizes = bench::parse_list(next());
    else if (a == "--doc-len") doc_len = std::stoll(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--routing") routing = true;
    else if (a == "--set") sets.push_back(next());
    else {
      std::fprintf(stderr, "usage: bench_logprobs [--config RUN.toml] [--tokens 32768,131072] [--doc-len N] "
                           "[--reps 3] [--routing] [--set table.key=value ...]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (sizes.empty() || reps < 1 || doc_len < 0) {
    std::fprintf(stderr, "bench_logprobs: --tokens needs sizes, --reps >= 1, --doc-len >= 0\n");
    return 2;
  }
  try {
    const int64_t max_s = *std::max_element(sizes.begin(), sizes.end());
    sets.push_back("train.micro_batch_tokens=" + std::to_string(max_s));
    const RunConfig cfg = load_run_config(config, sets);
    LogprobsRunner runner(cfg, "init", stderr);
    const ModelConfig& m = cfg.model;
    std::printf("bench_logprobs: %s on %s, weights only (%s values), temperature 1%s\n", config.c_str(),
                cfg.resolved_device().str().c_str(), dtype_name(cfg.resolved_param_dtype()),
                routing ? ", routing returned" : "");
    std::printf("%9s | %5s | %9s | %10s | %8s | %8s | %8s | %8s | %8s | %9s\n", "tokens", "docs", "ms", "tokens/s",
                "TFLOP/s", "params", "activ.", "logits", "peak", "reserved");
    for (int64_t S : sizes) {
      const Corpus docs = documents(S, doc_len > 0 ? doc_len : S, m.vocab_size);
      std::vector<int64_t> lens;
      for (int64_t d = 0; d < docs.num_documents(); ++d) lens.push_back(docs.length(d));
      const double flops = model_flops(m, lens) / 3.0;
      std::vector<double> ms;
      for (int r = 0; r <= reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<DocLogprobs> out = runner.run(docs, 1.0, routing);
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (out.size() != static_cast<size_t>(docs.num_documents())) {
          std::fprintf(stderr, "bench_logprobs: %zu results for %lld documents\n", out.size(),
                       static_cast<long long>(docs.num_documents()));
          return 1;
        }
        if (r > 0) ms.push_back(t);  // the first call is the warm-up
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const MemoryStats st = allocator_for(cfg.resolved_device()).stats();
      std::printf("%9lld | %5lld | %9.1f | %10.0f | %8.1f | %8.2f | %8.2f | %8.2f | %8.2f | %9.2f\n",
                  static_cast<long long>(S), static_cast<long long>(docs.num_documents()), med, S / (med / 1e3),
                  flops / (med / 1e3) / 1e12, gib(st.peak_of(MemCategory::params)),
                  gib(st.peak_of(MemCategory::activations)), gib(st.peak_of(MemCategory::logits)),
                  gib(st.peak_total), gib(st.reserved_peak));
      std::fflush(stdout);
    }
    std::printf("(memory in GiB: peaks over the last call per category, `reserved` the pool's high-water mark; "
                "TFLOP/s: forward model FLOPs, DESIGN.md sec. 6)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_logprobs: %s\n", e.what());
    return 1;
  }
  return 0;
}

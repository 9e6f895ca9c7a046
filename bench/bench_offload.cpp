// bench_offload — Trainer::offload() / onload() (sharing the GPU with a rollout engine): the
// seconds each takes, the state it moves, and the card's memory in use before, between and
// after, on a training run of the given config.
//
//   bench_offload [--config RUN.toml] [--cycles 2] [--set table.key=value ...]
//
// The run trains --warmup steps (so that the optimizer state exists and the pool holds a step's
// peak), then per cycle: offload, onload, one step. "card used" is cudaMemGetInfo's total - free
// (every process on the card, this one's CUDA context, library handles and cached workspaces
// included: what nvidia-smi shows); "allocator live" the bytes the trainer's allocator still has
// handed out. The step after an onload is timed beside the steps before (the rebuilt model
// re-creates its lazily made buffers). Bit-identity of the restored state is a test
// (tests/cpu/test_trainer.cpp, tests/mpi/test_state.cpp), not measured here.
//
// Default config: configs/qwen3-30b-a3b-4layer-gpu.toml (the Qwen3-30B-A3B 4-layer slice on
// cuda:0, 32K tokens a step).
#include <cstdio>
#include <string>
#include <vector>

#include "core/memory.h"
#include "runtime/trainer.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

using namespace bb;

namespace {
double gib(int64_t b) { return static_cast<double>(b) / double(1 << 30); }
// The card's memory column: "-" on the CPU.
std::string card(int64_t b) {
  if (b < 0) return "-";
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", gib(b));
  return s;
}

int64_t card_used(const Device& d) {
#ifdef BB_WITH_CUDA
  if (d.is_cuda()) return cuda::device_memory_used(d.index);
#endif
  (void)d;
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/qwen3-30b-a3b-4layer-gpu.toml";
  std::vector<std::string> sets = {"log.every=1000000", "checkpoint.dir=\"\"", "log.metrics=\"\""};
  int cycles = 2, warmup = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_offload: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config") config = next();
    else if (a == "--cycles") cycles = std::stoi(next());
    else if (a == "--warmup") warmup = std::stoi(next());
    else if (a == "--set") sets.push_back(next());
    else {
      std::fprintf(stderr, "usage: bench_offload [--config RUN.toml] [--cycles 2] [--warmup 2] [--set k=v ...]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (cycles < 1 || warmup < 1) {
    std::fprintf(stderr, "bench_offload: --cycles and --warmup must be >= 1\n");
    return 2;
  }
  try {
    const RunConfig cfg = load_run_config(config, sets);
    Trainer t(cfg, stderr);
    const Device dev = cfg.resolved_device();
    double step_s = 0;
    for (int i = 0; i < warmup; ++i) step_s = t.train_step().step_time_s;
    std::printf("bench_offload: %s on %s, %s parameters, state %s, optimizer %s\n", config.c_str(), dev.str().c_str(),
                human_count(static_cast<double>(cfg.model.num_params())).c_str(), cfg.prim.state.name.c_str(),
                cfg.prim.optimizer.name.c_str());
    std::printf("%5s | %-7s | %8s | %9s | %14s | %9s | %9s\n", "cycle", "call", "seconds", "moved GiB", "allocator live",
                "card used", "step s");
    std::printf("%5s | %-7s | %8s | %9s | %14.2f | %9s | %9.3f\n", "-", "trained", "-", "-",
                gib(allocator_for(dev).stats().live_total), card(card_used(dev)).c_str(), step_s);
    for (int c = 1; c <= cycles; ++c) {
      const OffloadReport off = t.offload();
      std::printf("%5d | %-7s | %8.3f | %9.2f | %14.2f | %9s | %9s\n", c, "offload", off.seconds, gib(off.host_bytes),
                  gib(off.allocator_live), card(off.device_used).c_str(), "-");
      const OffloadReport on = t.onload();
      std::printf("%5d | %-7s | %8.3f | %9.2f | %14.2f | %9s | %9s\n", c, "onload", on.seconds, gib(on.host_bytes),
                  gib(on.allocator_live), card(on.device_used).c_str(), "-");
      const StepMetrics m = t.train_step();
      std::printf("%5d | %-7s | %8s | %9s | %14.2f | %9s | %9.3f\n", c, "step", "-", "-",
                  gib(allocator_for(dev).stats().live_total), card(card_used(dev)).c_str(), m.step_time_s);
      std::fflush(stdout);
    }
    std::printf("(GiB; card used: the whole card's memory in use, every process, as nvidia-smi shows it; the first "
                "offload also allocates its pinned host buffer, later ones reuse it)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_offload: %s\n", e.what());
    return 1;
  }
  return 0;
}

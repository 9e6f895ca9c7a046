// bench_util.h — helpers the benchmarks share: a comma-separated size list from the command
// line; on a GPU, random device tensors and a median wall time around synchronised calls.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace bb::bench {

// "8192,32768" -> {8192, 32768} (std::stoll's errors for a bad item).
inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

}  // namespace bb::bench

#ifdef BB_WITH_CUDA

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "backend/cuda/rng_cuda.h"
#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace bb::bench {

// A [s] tensor of `dt` on cuda:0 filled with normal(0, std) draws of (seed).
inline Tensor randn_dev(const Shape& s, DType dt, float std, uint64_t seed, MemCategory cat) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0), cat);
  cuda::fill_random(t.raw(), dt, t.numel(), seed, 0, 0.0f, std, true);
  return t;
}

// Median wall time in ms of fn() over `reps` calls after `warmup`, with the device drained
// before and after each call.
inline double median_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda::synchronize();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace bb::bench

#endif  // BB_WITH_CUDA

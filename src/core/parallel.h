// parallel.h — a host loop over [0, n) split into contiguous ranges on a few threads, for
// long memory-bound passes (converting a model's weights, faulting in page-locked buffers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace bb {

// Calls fn(lo, hi) on contiguous ranges covering [0, n): one range per min_per_thread items, at
// most 8 and at most the host's hardware threads; the caller's thread takes the first range.
// When a thread cannot be started, the caller runs its range too (never fewer items). fn must
// not throw.
template <class Fn>
void parallel_ranges(int64_t n, int64_t min_per_thread, Fn&& fn) {
  if (n <= 0) return;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::min<int64_t>({8, hw, n / std::max<int64_t>(1, min_per_thread) + 1});
  const int64_t per = (n + threads - 1) / threads;
  auto range = [&](int64_t k) { fn(std::min(n, k * per), std::min(n, (k + 1) * per)); };
  std::vector<std::thread> pool;
  try {
    for (int64_t k = 1; k < threads; ++k) pool.emplace_back(range, k);
  } catch (const std::exception&) {
    // fewer threads: this one runs what is left
  }
  range(0);
  for (int64_t k = static_cast<int64_t>(pool.size()) + 1; k < threads; ++k) range(k);
  for (std::thread& th : pool) th.join();
}

}  // namespace bb

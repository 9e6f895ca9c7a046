// gpu_activity.h — how busy the GPU was over a stretch of host time, from CUPTI's activity
// records (kernels, copies and memsets on every stream), for the benches. CUPTI is loaded at
// run time (libcupti.so.13 from the library path): without it, nothing is measured and
// `error` says why. One tracer at a time in a process.
//
//   GpuActivity a;            // loads CUPTI
//   a.begin(); ...work that ends with a device sync...; GpuActivity::Result r = a.end();
// The first begin() turns the records on, which costs the launches right after it a few
// milliseconds of setup (measured 1-5 ms on an H200): measure a second stretch, not the first.
//   r.busy_ms  union of the intervals in which any kernel, copy or memset ran, within the window
//   r.idle_ms  window - busy: the GPU had nothing to run (waiting for the host: launches, syncs)
//   r.gaps     idle stretches >= 10 us, longest first: start (ms after begin()), length ms, and
//              what ran last before it and first after it (a kernel's short name, "memcpy",
//              "memset"; "-" at the window's ends): which launch or host sync it waited for
//   r.kernels  per kernel name (demangled, without its arguments): launches and summed GPU
//              time within the window, most time first; kernels on different streams overlap,
//              so the sums add up to more than busy_ms when streams run side by side
//   r.spans    every activity of the window with its stream (the raw timeline; timeline.h)
// begin(/*host_calls=*/true) also records the CUDA runtime and driver calls of the host (each
// call then costs ~1 us more): every gap gets `host`, what the host did while the GPU waited:
// the calls that overlap the gap (name, ms into the gap, length) and the longest stretch of
// the gap in which the host made no CUDA call at all (host code between two named calls).
#pragma once

#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cupti_activity.h>
#include <cupti_callbacks.h>

namespace bb::bench {

class GpuActivity {
 public:
  struct Result {
    double window_ms = 0, busy_ms = 0, idle_ms = 0;
    int64_t records = 0;
    struct Gap {
      double start = 0, ms = 0;  // ms after begin(), length
      std::string before, after;
      std::string host;  // begin(true) only: the host's CUDA calls during the gap (see above)
    };
    std::vector<Gap> gaps;  // >= 10 us, longest first
    struct Kernel {
      std::string name;
      int64_t launches = 0;
      double ms = 0;
    };
    std::vector<Kernel> kernels;  // most GPU time first
    // Every kernel, copy and memset of the window in start order, clipped to it (ms after
    // begin()), with CUPTI's id of its stream: what a timeline draws (bench/timeline.h).
    struct Span {
      double start = 0, end = 0;
      uint32_t stream = 0;
      std::string name;  // kernels: the short name; "memcpy", "memset"
      uint64_t bytes = 0;  // copies and memsets
    };
    std::vector<Span> spans;
  };

  GpuActivity() {
    for (const char* name : {"libcupti.so.13", "libcupti.so"}) {
      lib_ = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib_) break;
    }
    if (!lib_) {
      error = "CUPTI not found (libcupti.so.13 on the library path)";
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib_, name));
      if (!fn && error.empty()) error = std::string("CUPTI has no ") + name;
    };
    sym(enable_, "cuptiActivityEnable");
    sym(disable_, "cuptiActivityDisable");
    sym(register_, "cuptiActivityRegisterCallbacks");
    sym(next_, "cuptiActivityGetNextRecord");
    sym(flush_, "cuptiActivityFlushAll");
    sym(timestamp_, "cuptiGetTimestamp");
    callback_name_ = reinterpret_cast<decltype(callback_name_)>(dlsym(lib_, "cuptiGetCallbackName"));  // optional
    if (!error.empty()) return;
    self() = this;
    if (register_(&requested, &completed) != CUPTI_SUCCESS) error = "cuptiActivityRegisterCallbacks failed";
  }
  ~GpuActivity() {
    if (enabled_)
      for (CUpti_ActivityKind k : kKinds) disable_(k);
    if (api_enabled_)
      for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER}) disable_(k);
    if (self() == this) self() = nullptr;
  }
  GpuActivity(const GpuActivity&) = delete;
  GpuActivity& operator=(const GpuActivity&) = delete;

  bool usable() const { return error.empty(); }

  void begin(bool host_calls = false) {
    if (!usable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      intervals_.clear();
    }
    if (host_calls != api_enabled_) {
      for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER})
        if ((host_calls ? enable_(k) : disable_(k)) != CUPTI_SUCCESS)
          error = "cuptiActivity" + std::string(host_calls ? "Enable" : "Disable") + " failed (kind " +
                  std::to_string(k) + ")";
      api_enabled_ = host_calls;
    }
    // Records stay on from the first begin() (enabling them costs the next launches some
    // milliseconds: trace a step before the one that counts).
    if (!enabled_) {
      for (CUpti_ActivityKind k : kKinds)
        if (enable_(k) != CUPTI_SUCCESS) error = "cuptiActivityEnable failed (kind " + std::to_string(k) + ")";
      enabled_ = true;
    }
    timestamp_(&t0_);
  }

  // Call after the work ended with a device sync.
  Result end() {
    Result r;
    if (!usable()) return r;
    uint64_t t1 = 0;
    timestamp_(&t1);
    flush_(1);  // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
    std::vector<Record> iv;
    {
      std::lock_guard<std::mutex> lock(mu_);
      iv.swap(intervals_);
    }
    std::vector<Record> api;  // host calls, kept apart from the device's activities
    {
      auto it = std::stable_partition(iv.begin(), iv.end(), [](const Record& a) { return !is_api(a.kind); });
      api.assign(it, iv.end());
      iv.erase(it, iv.end());
      std::sort(api.begin(), api.end(), [](const Record& a, const Record& b) { return a.start < b.start; });
    }
    std::map<const char*, std::string> short_names;
    std::map<std::string, Result::Kernel> by_name;
    for (const Record& k : iv) {
      if (k.kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
      const uint64_t s = std::max(k.start, t0_), e = std::min(k.end, t1);
      if (e <= s) continue;
      auto it = short_names.find(k.name);
      if (it == short_names.end()) it = short_names.emplace(k.name, short_name(k.name)).first;
      Result::Kernel& acc = by_name[it->second];
      acc.name = it->second;
      acc.launches += 1;
      acc.ms += static_cast<double>(e - s) * 1e-6;
    }
    for (auto& [name, k] : by_name) r.kernels.push_back(std::move(k));
    std::sort(r.kernels.begin(), r.kernels.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
    r.records = static_cast<int64_t>(iv.size());
    std::sort(iv.begin(), iv.end(), [](const Record& a, const Record& b) { return a.start < b.start; });
    auto label = [&](const Record* a) -> std::string {
      if (!a) return "-";
      if (a->kind == CUPTI_ACTIVITY_KIND_MEMCPY) return "memcpy";
      if (a->kind == CUPTI_ACTIVITY_KIND_MEMSET) return "memset";
      auto it = short_names.find(a->name);
      if (it == short_names.end()) it = short_names.emplace(a->name, short_name(a->name)).first;
      return it->second;
    };
    uint64_t busy = 0, cur = t0_;  // cur: the end of the busy time merged so far
    const Record* last = nullptr;  // the activity that ends at cur
    auto gap = [&](uint64_t from, uint64_t to, const Record* next) {
      if (to > from && to - from >= 10000)
        r.gaps.push_back({static_cast<double>(from - t0_) * 1e-6, static_cast<double>(to - from) * 1e-6, label(last),
                          label(next), host_calls(api, from, to)});
    };
    for (const Record& a : iv) {
      const uint64_t s = std::max(a.start, t0_), e = std::min(a.end, t1);
      if (e > s)
        r.spans.push_back({static_cast<double>(s - t0_) * 1e-6, static_cast<double>(e - t0_) * 1e-6, a.stream, label(&a),
                           a.bytes});
      if (e <= s || e <= cur) continue;
      if (s > cur) gap(cur, s, &a);
      busy += e - std::max(s, cur);
      cur = e;
      last = &a;
    }
    gap(cur, t1, nullptr);
    std::sort(r.gaps.begin(), r.gaps.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
    r.window_ms = static_cast<double>(t1 - t0_) * 1e-6;
    r.busy_ms = static_cast<double>(busy) * 1e-6;
    r.idle_ms = r.window_ms - r.busy_ms;
    return r;
  }

  std::string error;

 private:

  static constexpr CUpti_ActivityKind kKinds[3] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                                    CUPTI_ACTIVITY_KIND_MEMSET};
  static constexpr size_t kBufferBytes = 8u << 20;

  struct Record {
    uint64_t start = 0, end = 0;
    CUpti_ActivityKind kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    const char* name = nullptr;  // kernels: shared by every record of the kernel, owned by CUPTI
    uint32_t cbid = 0;           // host calls: the runtime or driver callback id
    uint32_t thread = 0;         // host calls: CUPTI's id of the calling thread
    uint32_t stream = 0;         // device activities: CUPTI's stream id
    uint64_t bytes = 0;          // copies and memsets
  };

  static bool is_api(CUpti_ActivityKind k) {
    return k == CUPTI_ACTIVITY_KIND_RUNTIME || k == CUPTI_ACTIVITY_KIND_DRIVER;
  }

  // The host calls (sorted by start) overlapping [from, to): at most 8, longest first, as
  // "name +start/length us" ("[other thread]" for calls of a thread other than the one that made
  // most calls in the window), then the longest stretch of the gap without a call of that main
  // thread, with its calls around it.
  std::string host_calls(const std::vector<Record>& api, uint64_t from, uint64_t to) const {
    if (api.empty()) return "";
    std::map<uint32_t, int64_t> per_thread;
    for (const Record& a : api) ++per_thread[a.thread];
    uint32_t main_thread = per_thread.begin()->first;
    for (const auto& [t, n] : per_thread)
      if (n > per_thread[main_thread]) main_thread = t;
    struct Hit {
      const Record* r;
      uint64_t len;
    };
    std::vector<Hit> hits;
    uint64_t cur = from, quiet = 0, quiet_at = from;
    const Record *before = nullptr, *quiet_before = nullptr, *quiet_after = nullptr;
    auto quiet_to = [&](uint64_t t, const Record* after) {
      if (t > cur && t - cur > quiet) quiet = t - cur, quiet_at = cur, quiet_before = before, quiet_after = after;
    };
    for (const Record& a : api) {
      if (a.start < to && a.end > from) hits.push_back({&a, std::min(a.end, to) - std::max(a.start, from)});
      if (a.thread != main_thread) continue;
      if (a.end <= from) {
        before = &a;
        continue;
      }
      if (a.start >= to) {
        quiet_to(to, &a);
        cur = to;
        break;
      }
      quiet_to(a.start, &a);
      cur = std::max(cur, a.end);
      before = &a;
    }
    quiet_to(to, nullptr);
    std::sort(hits.begin(), hits.end(), [](const Hit& a, const Hit& b) { return a.len > b.len; });
    std::string out;
    char buf[200];
    for (size_t i = 0; i < hits.size() && i < 8; ++i) {
      std::snprintf(buf, sizeof buf, "%s%s%s +%.0f/%.0f us", i ? ", " : "", api_name(*hits[i].r),
                    hits[i].r->thread == main_thread ? "" : " [other thread]",
                    (static_cast<double>(hits[i].r->start) - static_cast<double>(from)) * 1e-3,
                    static_cast<double>(hits[i].len) * 1e-3);
      out += buf;
    }
    if (hits.size() > 8) out += ", " + std::to_string(hits.size() - 8) + " more";
    std::snprintf(buf, sizeof buf, "%sno CUDA call for %.0f us from +%.0f (after %s, before %s)", out.empty() ? "" : "; ",
                  static_cast<double>(quiet) * 1e-3, static_cast<double>(quiet_at - from) * 1e-3,
                  quiet_before ? api_name(*quiet_before) : "-", quiet_after ? api_name(*quiet_after) : "-");
    return out + buf;
  }

  const char* api_name(const Record& a) const {
    const char* n = nullptr;
    if (callback_name_)
      callback_name_(a.kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                     a.cbid, &n);
    return n ? n : "?";
  }

  // "void ns::kernel<T>(args)" -> "ns::kernel<T>", at most 100 characters.
  static std::string short_name(const char* mangled) {
    if (!mangled) return "?";
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string n = (status == 0 && d) ? std::string(d) : std::string(mangled);
    std::free(d);
    if (n.rfind("void ", 0) == 0) n.erase(0, 5);
    int depth = 0;  // cut at the argument list: the first '(' outside template brackets
    for (size_t i = 0; i < n.size(); ++i) {
      if (n[i] == '<') ++depth;
      else if (n[i] == '>') --depth;
      else if (n[i] == '(' && depth == 0 && i > 0 && n.compare(i, 20, "(anonymous namespace") != 0) {
        n.resize(i);
        break;
      }
    }
    for (const char* drop : {"(anonymous namespace)::", "bb::cuda::"})
      for (size_t p; (p = n.find(drop)) != std::string::npos;) n.erase(p, std::strlen(drop));
    if (n.size() > 100) n = n.substr(0, 97) + "...";
    return n;
  }

  static GpuActivity*& self() {
    static GpuActivity* s = nullptr;
    return s;
  }
  static void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
    *size = kBufferBytes;
    *max_records = 0;
  }
  static void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    GpuActivity* a = self();
    if (a && valid > 0) {
      std::vector<Record> got;
      CUpti_Activity* rec = nullptr;
      while (a->next_(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
          case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
          case CUPTI_ACTIVITY_KIND_KERNEL: {
            const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
            got.push_back({k->start, k->end, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, k->name, 0, 0,  // CUPTI keeps the name
                           k->streamId, 0});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
            got.push_back({m->start, m->end, CUPTI_ACTIVITY_KIND_MEMCPY, nullptr, 0, 0, m->streamId, m->bytes});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMSET: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
            got.push_back({m->start, m->end, CUPTI_ACTIVITY_KIND_MEMSET, nullptr, 0, 0, m->streamId, m->bytes});
            break;
          }
          case CUPTI_ACTIVITY_KIND_RUNTIME:
          case CUPTI_ACTIVITY_KIND_DRIVER: {
            const auto* c = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
            got.push_back({c->start, c->end, rec->kind, nullptr, c->cbid, c->threadId});
            break;
          }
          default: break;
        }
      }
      std::lock_guard<std::mutex> lock(a->mu_);
      a->intervals_.insert(a->intervals_.end(), got.begin(), got.end());
    }
    std::free(buffer);
  }

  void* lib_ = nullptr;
  CUptiResult(CUPTIAPI* enable_)(CUpti_ActivityKind) = nullptr;
  CUptiResult(CUPTIAPI* disable_)(CUpti_ActivityKind) = nullptr;
  CUptiResult(CUPTIAPI* register_)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult(CUPTIAPI* next_)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult(CUPTIAPI* flush_)(uint32_t) = nullptr;
  CUptiResult(CUPTIAPI* timestamp_)(uint64_t*) = nullptr;
  CUptiResult(CUPTIAPI* callback_name_)(CUpti_CallbackDomain, uint32_t, const char**) = nullptr;
  bool api_enabled_ = false;
  uint64_t t0_ = 0;
  bool enabled_ = false;
  std::mutex mu_;
  std::vector<Record> intervals_;  // every activity (kernels with their names)
};

}  // namespace bb::bench

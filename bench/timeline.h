// timeline.h — a traced stretch of GPU work as a timeline, for the benches: which of the named
// streams (core/stream.h) every kernel, copy and memset ran on, a Chrome trace file of them
// (chrome://tracing or ui.perfetto.dev: one row per stream), and how much of each emulated
// communication class's wire time other GPU work covered (comm/emulated.h).
//
//   GpuActivity a; a.begin(); StreamMarker marks(dev); ...work...; sync;
//   GpuActivity::Result r = a.end();
//   write_chrome_trace("step.json", r, marks.names(r), "title");  comm_overlap(r)
//
// StreamMarker issues, on every named stream, a memset of (kMarkBytes + stream index) bytes;
// CUPTI's record of it carries the stream's id, which names the stream for every other record.
//
// An emulated collective is one kernel, emulated_wire_kernel<c> (c: the class of
// EmulatedTotals: 0 ep, 1 cp, 2 param_gather, 3 grad_reduce, 4 other), that holds its stream for
// the wire time. Its "hidden" part is the time during which any other kernel, copy or memset
// ran (on any stream): the wire time the rank spent computing anyway. The rest is exposed: the
// GPU did nothing but wait for the wire.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backend/cuda/check.cuh"
#include "comm/emulated.h"
#include "gpu_activity.h"

namespace bb::bench {

// CUPTI stream id -> our stream's name ("compute", "comm", ...); unknown ids print as numbers.
using StreamNames = std::map<uint32_t, std::string>;

class StreamMarker {
 public:
  // Issues the marks (after GpuActivity::begin()); names() reads them from a Result.
  static constexpr uint64_t kMarkBytes = 997;  // an odd size no real memset is likely to have
  explicit StreamMarker(Device dev) : dev_(dev) {
    BB_CHECK_CUDA(cudaMalloc(&buf_, 1024));
    for (int i = 0; i < kNumStreams; ++i)
      BB_CHECK_CUDA(cudaMemsetAsync(buf_, 0, static_cast<size_t>(kMarkBytes + i),
                                    cuda::stream_of(dev.index, static_cast<Stream>(i))));
  }
  ~StreamMarker() { cudaFree(buf_); }
  StreamMarker(const StreamMarker&) = delete;
  StreamMarker& operator=(const StreamMarker&) = delete;
  StreamNames names(const GpuActivity::Result& r) const {
    StreamNames n;
    for (const auto& s : r.spans)
      if (s.name == "memset" && s.bytes >= kMarkBytes && s.bytes < kMarkBytes + kNumStreams && !n.count(s.stream))
        n[s.stream] = stream_name(static_cast<Stream>(s.bytes - kMarkBytes));
    return n;
  }

 private:
  Device dev_;
  void* buf_ = nullptr;
};

// The class of an emulated collective's kernel (-1: not one).
inline int wire_class(const std::string& name) {
  const std::string key = "emulated_wire_kernel<";
  const size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  const char c = name.size() > at + key.size() ? name[at + key.size()] : '?';
  return c >= '0' && c < '0' + comm::EmulatedTotals::kClasses ? c - '0' : -1;
}

struct CommOverlap {
  std::string cls;
  int64_t ops = 0;
  double wire_ms = 0, hidden_ms = 0;
};

// Per class (those with any collective), then a last row "all".
inline std::vector<CommOverlap> comm_overlap(const GpuActivity::Result& r) {
  // The union of every other activity, as sorted disjoint intervals.
  std::vector<std::pair<double, double>> busy;
  for (const auto& s : r.spans)
    if (wire_class(s.name) < 0) busy.emplace_back(s.start, s.end);
  std::sort(busy.begin(), busy.end());
  std::vector<std::pair<double, double>> merged;
  for (const auto& b : busy) {
    if (!merged.empty() && b.first <= merged.back().second) merged.back().second = std::max(merged.back().second, b.second);
    else merged.push_back(b);
  }
  auto covered = [&](double a, double b) {
    double c = 0;
    auto it = std::lower_bound(merged.begin(), merged.end(), std::make_pair(a, a),
                               [](const auto& x, const auto& y) { return x.second < y.first; });
    for (; it != merged.end() && it->first < b; ++it) c += std::max(0.0, std::min(b, it->second) - std::max(a, it->first));
    return c;
  };
  std::vector<CommOverlap> out(comm::EmulatedTotals::kClasses + 1);
  for (int c = 0; c < comm::EmulatedTotals::kClasses; ++c) out[static_cast<size_t>(c)].cls = comm::EmulatedTotals::class_name(c);
  out.back().cls = "all";
  for (const auto& s : r.spans) {
    const int c = wire_class(s.name);
    if (c < 0) continue;
    for (CommOverlap* o : {&out[static_cast<size_t>(c)], &out.back()}) {
      o->ops += 1;
      o->wire_ms += s.end - s.start;
      o->hidden_ms += covered(s.start, s.end);
    }
  }
  std::vector<CommOverlap> kept;
  for (const CommOverlap& o : out)
    if (o.ops > 0) kept.push_back(o);
  return kept;
}

// A markdown table of comm_overlap (one row per class).
inline std::string overlap_table(const std::vector<CommOverlap>& rows) {
  std::string t = "| communication class | collectives | wire ms | hidden ms | exposed ms | hidden |\n|---|---:|---:|---:|---:|---:|\n";
  char line[256];
  for (const CommOverlap& o : rows) {
    std::snprintf(line, sizeof line, "| %s | %lld | %.3f | %.3f | %.3f | %.0f %% |\n", o.cls.c_str(),
                  static_cast<long long>(o.ops), o.wire_ms, o.hidden_ms, o.wire_ms - o.hidden_ms,
                  o.wire_ms > 0 ? 100 * o.hidden_ms / o.wire_ms : 0.0);
    t += line;
  }
  return t;
}

// Chrome trace-event JSON: one process, one thread row per stream (named when known), one
// complete event per activity (microseconds). Returns false when the file cannot be written.
inline bool write_chrome_trace(const std::string& path, const GpuActivity::Result& r, const StreamNames& names,
                               const std::string& title) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  auto esc = [](const std::string& s) {
    std::string o;
    for (char c : s) {
      if (c == '"' || c == '\\') o += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) o += c;
    }
    return o;
  };
  std::fprintf(f, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"title\": \"%s\"}, \"traceEvents\": [\n", esc(title).c_str());
  std::fprintf(f, "{\"ph\": \"M\", \"pid\": 0, \"name\": \"process_name\", \"args\": {\"name\": \"%s\"}}", esc(title).c_str());
  std::map<uint32_t, bool> seen;
  for (const auto& s : r.spans) seen[s.stream] = true;
  for (const auto& [id, _] : seen) {
    auto it = names.find(id);
    const std::string n = it != names.end() ? it->second : "stream " + std::to_string(id);
    // Our named streams first, in their order; others after.
    int sort = 100 + static_cast<int>(id % 1000);
    for (int i = 0; i < kNumStreams; ++i)
      if (n == stream_name(static_cast<Stream>(i))) sort = i;
    std::fprintf(f, ",\n{\"ph\": \"M\", \"pid\": 0, \"tid\": %u, \"name\": \"thread_name\", \"args\": {\"name\": \"%s\"}}", id,
                 esc(n).c_str());
    std::fprintf(f, ",\n{\"ph\": \"M\", \"pid\": 0, \"tid\": %u, \"name\": \"thread_sort_index\", \"args\": {\"sort_index\": %d}}",
                 id, sort);
  }
  for (const auto& s : r.spans) {
    const int c = wire_class(s.name);
    const std::string n = c >= 0 ? std::string("wire: ") + comm::EmulatedTotals::class_name(c) : s.name;
    std::fprintf(f, ",\n{\"ph\": \"X\", \"pid\": 0, \"tid\": %u, \"name\": \"%s\", \"ts\": %.3f, \"dur\": %.3f}", s.stream,
                 esc(n).c_str(), s.start * 1e3, (s.end - s.start) * 1e3);
  }
  std::fprintf(f, "\n]}\n");
  const bool ok = std::ferror(f) == 0;
  return std::fclose(f) == 0 && ok;
}

}  // namespace bb::bench

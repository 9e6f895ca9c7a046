// emulated.cpp — the emulated communication backend (emulated.h): groups of an N-rank job of
// which this process is one rank; every collective computes its clone-semantics pieces (what
// lands where), its wire time from the link model, and runs both on the operation's stream
// (emulated_wire.h).
#include "comm/emulated.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>

#include "comm/emulated_wire.h"
#include "comm/watchdog.h"

namespace bb::comm {

namespace {

using emu::Segment;
using emu::SegOp;
using emu::WireClass;

EmulatedTotals g_totals;
int64_t g_device_ops = 0;  // collectives issued on a GPU stream (EmulateConfig::hang_at_op)

// What every group of one emulated job shares.
struct Job {
  EmulateConfig cfg;
};

WireClass class_of(const std::string& group, const char* op) {
  if (group == "ep") return WireClass::ep;
  if (group == "cp") return WireClass::cp;
  const std::string o = op;
  if (o == "all_gather" || o == "all_gather_v" || o == "broadcast") return WireClass::param_gather;
  if (o == "reduce_scatter" || o == "all_reduce") return WireClass::grad_reduce;
  return WireClass::other;
}

char* bytes_at(const Tensor& t, int64_t offset) { return static_cast<char*>(t.raw()) + offset; }
int64_t nbytes(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }

// dst[0, dst_bytes) from src[0, src_bytes): the first min(...) bytes copied, the rest zero.
void fill_from(std::vector<Segment>& segs, char* dst, int64_t dst_bytes, const char* src, int64_t src_bytes) {
  const int64_t n = std::min(dst_bytes, src_bytes);
  if (n > 0 && dst != src) segs.push_back({src, dst, n, SegOp::copy});
  if (dst_bytes > n) segs.push_back({nullptr, dst + n, dst_bytes - n, SegOp::zero});
}

class EventWork final : public Work {
 public:
  EventWork(Event done, std::vector<Tensor> keep) : done_(std::move(done)), keep_(std::move(keep)) {}
  void wait() override { done_.wait(current_stream()); }

 private:
  Event done_;
  std::vector<Tensor> keep_;  // alive until the Work goes (comm.h)
};

class EmulatedGroup final : public Group {
 public:
  EmulatedGroup(std::shared_ptr<const Job> job, const std::string& name, int rank, int size, std::vector<int> wr)
      : Group(name, rank, size, std::move(wr)), job_(std::move(job)), self_(self_group(name)) {}
  Backend backend() const override { return Backend::emulated; }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op, Stream s) override {
    if (size() == 1) return self_->all_reduce(t, op, s);
    BB_CHECK(t.defined(), "all_reduce on group ", name(), ": the tensor is undefined");
    std::vector<Segment> segs;
    if (op == ReduceOp::sum && t.numel() > 0)
      segs.push_back({t.raw(), t.raw(), nbytes(t), SegOp::scale, t.dtype(), static_cast<double>(size())});
    // A ring all-reduce sends and receives 2 (n-1)/n of the tensor each.
    return issue("all_reduce", s, t, std::move(segs), link().all_reduce_s(world_ranks(), nbytes(t)),
                 4 * nbytes(t) * (size() - 1) / size(), {t});
  }

  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op, Stream s) override {
    if (size() == 1) return self_->reduce_scatter(in, out, op, s);
    check_reduce_scatter(in, out);
    const int64_t b = nbytes(out);
    const char* mine = bytes_at(in, rank() * b);
    std::vector<Segment> segs;
    if (b > 0) {
      if (op == ReduceOp::sum)
        segs.push_back({mine, out.raw(), b, SegOp::scale, out.dtype(), static_cast<double>(size())});
      else
        segs.push_back({mine, out.raw(), b, SegOp::copy});
    }
    return issue("reduce_scatter", s, out, std::move(segs), link().reduce_scatter_s(world_ranks(), nbytes(in)),
                 2 * (nbytes(in) - b), {in, out});
  }

  WorkPtr all_gather(const Tensor& in, const Tensor& out, Stream s) override {
    if (size() == 1) return self_->all_gather(in, out, s);
    check_all_gather(in, out);
    const int64_t b = nbytes(in);
    std::vector<Segment> segs;
    for (int p = 0; p < size() && b > 0; ++p)
      fill_from(segs, bytes_at(out, p * b), b, static_cast<const char*>(in.raw()), b);
    return issue("all_gather", s, out, std::move(segs), link().all_gather_s(world_ranks(), nbytes(out)),
                 2 * (nbytes(out) - b), {in, out});
  }

  WorkPtr all_gather_v(const Tensor& in, const Tensor& out, const std::vector<int64_t>& counts, Stream s) override {
    if (size() == 1) return self_->all_gather_v(in, out, counts, s);
    check_counts("all_gather_v", counts);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    const int64_t mine = counts[static_cast<size_t>(rank())];
    BB_CHECK(in.defined() && out.defined() && rows_of(in) == mine && rows_of(out) == total &&
                 in.dtype() == out.dtype() && row_elems(in) == row_elems(out) && in.device() == out.device(),
             "all_gather_v on group ", name(), ": in ", in.defined() ? in.str() : "undefined", " (", mine,
             " rows expected) and out ", out.defined() ? out.str() : "undefined", " (", total,
             " rows expected) do not match the counts");
    const int64_t w = row_elems(out) * static_cast<int64_t>(dtype_size(out.dtype()));
    std::vector<Segment> segs;
    int64_t at = 0;
    for (int p = 0; p < size(); ++p) {
      const int64_t c = counts[static_cast<size_t>(p)];
      fill_from(segs, bytes_at(out, at * w), c * w, static_cast<const char*>(in.raw()), mine * w);
      at += c;
    }
    return issue("all_gather_v", s, out, std::move(segs), link().all_gather_s(world_ranks(), total * w),
                 2 * (total - mine) * w, {in, out});
  }

  WorkPtr all_to_all_v(const Tensor& in, const std::vector<int64_t>& sc, const Tensor& out,
                       const std::vector<int64_t>& rc, Stream s) override {
    if (size() == 1) return self_->all_to_all_v(in, sc, out, rc, s);
    check_counts("all_to_all_v", sc);
    check_counts("all_to_all_v", rc);
    const size_t n = static_cast<size_t>(size()), me = static_cast<size_t>(rank());
    std::vector<int64_t> os(n + 1, 0), orr(n + 1, 0);
    for (size_t p = 0; p < n; ++p) {
      os[p + 1] = os[p] + sc[p];
      orr[p + 1] = orr[p] + rc[p];
    }
    BB_CHECK(in.defined() && out.defined() && rows_of(in) == os[n] && rows_of(out) == orr[n] &&
                 in.dtype() == out.dtype() && row_elems(in) == row_elems(out) && in.device() == out.device(),
             "all_to_all_v on group ", name(), ": in ", in.defined() ? in.str() : "undefined", " must have ", os[n],
             " rows and out ", out.defined() ? out.str() : "undefined", " ", orr[n],
             " rows of the same width, dtype and device");
    BB_CHECK(sc[me] == rc[me], "all_to_all_v on group ", name(), ": rank ", rank(), " sends ", sc[me],
             " rows to itself but expects ", rc[me]);
    const int64_t w = row_elems(in) * static_cast<int64_t>(dtype_size(in.dtype()));
    std::vector<Segment> segs;
    std::vector<int64_t> send_b(n), recv_b(n);
    for (size_t q = 0; q < n; ++q) {
      const size_t x = (2 * me + n - q) % n;  // clone q sends me what this rank sends to x
      fill_from(segs, bytes_at(out, orr[q] * w), rc[q] * w, bytes_at(in, os[x] * w), sc[x] * w);
      send_b[q] = sc[q] * w;
      recv_b[q] = rc[q] * w;
    }
    int64_t wire = 0;
    for (size_t q = 0; q < n; ++q)
      if (q != me) wire += send_b[q] + recv_b[q];
    return issue("all_to_all_v", s, out, std::move(segs),
                 link().all_to_all_s(world_ranks(), rank(), send_b, recv_b), wire, {in, out});
  }

  WorkPtr send(const Tensor& t, int peer, Stream s) override {
    check_peer("send", peer);
    BB_CHECK(t.defined(), "send on group ", name(), ": the tensor is undefined");
    sent_[peer] = t;
    return issue("send", s, t, {}, link().send_recv_s(wr(rank()), wr(peer), nbytes(t)), nbytes(t), {t});
  }

  WorkPtr recv(const Tensor& t, int peer, Stream s) override {
    check_peer("recv", peer);
    BB_CHECK(t.defined(), "recv on group ", name(), ": the tensor is undefined");
    const int x = (2 * rank() + size() - peer) % size();  // the peer sends what this rank sent to x
    std::vector<Segment> segs;
    auto it = sent_.find(x);
    const Tensor src = it == sent_.end() ? Tensor() : it->second;
    fill_from(segs, static_cast<char*>(t.raw()), nbytes(t), src.defined() ? static_cast<const char*>(src.raw()) : nullptr,
              src.defined() && src.device() == t.device() ? nbytes(src) : 0);
    std::vector<Tensor> keep{t};
    if (src.defined()) keep.push_back(src);
    return issue("recv", s, t, std::move(segs), link().send_recv_s(wr(rank()), wr(peer), nbytes(t)), nbytes(t),
                 std::move(keep));
  }

  WorkPtr broadcast(const Tensor& t, int root, Stream s) override {
    BB_CHECK(root >= 0 && root < size(), "broadcast on group ", name(), ": root ", root, " is not in [0, ", size(), ")");
    if (size() == 1) return self_->broadcast(t, root, s);
    BB_CHECK(t.defined(), "broadcast on group ", name(), ": the tensor is undefined");
    // A pipelined ring: the root sends the tensor once, the others receive and pass it on.
    return issue("broadcast", s, t, {}, link().broadcast_s(world_ranks(), nbytes(t)),
                 root == rank() ? nbytes(t) : 2 * nbytes(t), {t});
  }

  // Host values: the peers are copies of this rank and answer at once.
  void barrier() override {}
  void all_reduce_host(double* v, int64_t n, ReduceOp op) override {
    if (op == ReduceOp::sum)
      for (int64_t i = 0; i < n; ++i) v[i] *= size();
  }
  void all_reduce_host(int64_t* v, int64_t n, ReduceOp op) override {
    if (op == ReduceOp::sum)
      for (int64_t i = 0; i < n; ++i) v[i] *= size();
  }
  void broadcast_host(std::string&, int root) override {
    BB_CHECK(root >= 0 && root < size(), "broadcast_host on group ", name(), ": root ", root, " is not in [0, ",
             size(), ")");
  }
  void all_to_all_host(const int64_t* send, int64_t* recv, int64_t n) override {
    BB_CHECK(n >= 0, "all_to_all_host on group ", name(), ": negative count ", n);
    const int64_t P = size(), me = rank();
    const std::vector<int64_t> sent(send, send + n * P);
    for (int64_t q = 0; q < P; ++q) {
      const int64_t x = (2 * me + P - q) % P;
      std::copy_n(sent.begin() + x * n, n, recv + q * n);
    }
  }

  void all_gather_host(const int64_t* mine, int64_t* all, int64_t n) override {
    BB_CHECK(n >= 0, "all_gather_host on group ", name(), ": negative count ", n);
    const std::vector<int64_t> v(mine, mine + n);
    for (int q = 0; q < size(); ++q) std::copy(v.begin(), v.end(), all + static_cast<int64_t>(q) * n);
  }

  GroupPtr split(int, int, const std::string& n) override {
    BB_FAIL("split of group ", name(), " into '", n, "' by color: the emulated backend has no peers to tell their ",
            "colors; build the groups with split_known (as the mesh does)");
  }
  GroupPtr split_known(const std::vector<int>& colors, const std::vector<int>& keys, const std::string& n) override {
    BB_CHECK(static_cast<int>(colors.size()) == size() && static_cast<int>(keys.size()) == size(), "split_known of group ",
             name(), " into '", n, "': ", colors.size(), " colors and ", keys.size(), " keys for ", size(), " ranks");
    std::vector<int> members;
    for (int p = 0; p < size(); ++p)
      if (colors[static_cast<size_t>(p)] == colors[static_cast<size_t>(rank())]) members.push_back(p);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return keys[static_cast<size_t>(a)] < keys[static_cast<size_t>(b)]; });
    std::vector<int> wr;
    int my = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank()) my = static_cast<int>(i);
      wr.push_back(world_ranks()[static_cast<size_t>(members[i])]);
    }
    return std::make_shared<EmulatedGroup>(job_, n, my, static_cast<int>(members.size()), std::move(wr));
  }

 private:
  const LinkModel& link() const { return job_->cfg.link; }
  int wr(int member) const { return world_ranks()[static_cast<size_t>(member)]; }
  void check_peer(const char* op, int peer) const {
    BB_CHECK(peer >= 0 && peer < size(), op, " on group ", name(), ": rank ", peer, " is not in [0, ", size(), ")");
    BB_CHECK(peer != rank(), op, " on group ", name(), ": rank ", peer, " is this rank");
  }

  // Runs the pieces and the wire time of one operation on stream `s` (a GPU tensor) or at once
  // (a CPU tensor), and counts them.
  WorkPtr issue(const char* op, Stream s, const Tensor& any, std::vector<Segment> segs, double seconds,
                int64_t wire_bytes, std::vector<Tensor> keep) {
    const WireClass c = class_of(name(), op);
    const double t = seconds * job_->cfg.wire_scale;
    const int ci = static_cast<int>(c);
    g_totals.seconds[ci] += t;
    g_totals.ops[ci] += 1;
    g_totals.bytes[ci] += wire_bytes;
    if (any.device().is_cpu()) {
      emu::run_on_host(segs);
      return done_work();
    }
#ifdef BB_WITH_CUDA
    for (const Tensor& k : keep)
      BB_CHECK(k.device() == any.device(), op, " on group ", name(), ": tensors on ", k.device().str(), " and ",
               any.device().str());
    const Device d = any.device();
    const Stream cur = current_stream();
    if (cur != s) Event::record(d, cur).wait(s);
    const int64_t n = ++g_device_ops;
    const bool hang = job_->cfg.hang_at_op > 0 && n == job_->cfg.hang_at_op;
    emu::run_on_device(d.index, s, c, segs, hang ? 86400.0 : t, static_cast<int>(job_->cfg.comm_blocks));
    for (const Tensor& k : keep) k.record_stream(s);
    const Event done = Event::record(d, s);
    // The deadline of a collective whose wait is a stream wait, as for NCCL (comm/watchdog.h).
    watch(done, d.index, std::string(op) + " on group '" + name() + "' (" + std::to_string(size()) + " ranks, " +
                    stream_name(s) + " stream, emulated operation #" + std::to_string(n) + ")");
    return std::make_shared<EventWork>(done, std::move(keep));
#else
    BB_FAIL(op, " on group ", name(), ": a ", any.device().str(), " tensor in a CPU-only build");
#endif
  }

  std::shared_ptr<const Job> job_;
  GroupPtr self_;                 // size 1: every operation is the self group's
  std::map<int, Tensor> sent_;    // the last tensor sent to each member (recv's clone data)
};

}  // namespace

void EmulateConfig::validate() const {
  BB_CHECK(ranks >= 1 && ranks <= 65536, "emulate.ranks = ", ranks, ": must be in [1, 65536]");
  BB_CHECK(rank >= 0 && rank < ranks, "emulate.rank = ", rank, ": must be in [0, emulate.ranks = ", ranks, ")");
  link.validate("emulate");
  BB_CHECK(comm_blocks >= 1 && comm_blocks <= 1024, "emulate.comm_blocks = ", comm_blocks, ": must be in [1, 1024]");
  BB_CHECK(std::isfinite(wire_scale) && wire_scale >= 0 && wire_scale <= 1e6, "emulate.wire_scale = ", wire_scale,
           ": must be in [0, 1000000] (1: the link model; 0: an infinitely fast wire; > 1: slowed, for tests)");
  BB_CHECK(std::isfinite(device_memory_gib) && (device_memory_gib == 0 || (device_memory_gib >= 1 && device_memory_gib <= 1e4)),
           "emulate.device_memory_gib = ", device_memory_gib, ": must be 0 (the card's own) or in [1, 10000]");
}

std::string EmulateConfig::str() const {
  char mem[64] = "";
  if (device_memory_gib > 0) std::snprintf(mem, sizeof mem, "; device memory %.4g GiB", device_memory_gib);
  char buf[512];
  std::snprintf(buf, sizeof buf, "EMULATED rank %lld of %lld (%s; wire time x%g; %lld blocks per collective%s)",
                static_cast<long long>(rank), static_cast<long long>(ranks), link.str().c_str(), wire_scale,
                static_cast<long long>(comm_blocks), mem);
  return buf;
}

std::string EmulateConfig::tag() const {
  char scale[32] = "";
  if (wire_scale != 1) std::snprintf(scale, sizeof scale, ", wire x%g", wire_scale);
  char buf[160];
  std::snprintf(buf, sizeof buf, "[EMULATED %lld/%lld, %.4g+%.4g GB/s%s] ", static_cast<long long>(rank),
                static_cast<long long>(ranks), link.intra_gbps, link.inter_gbps, scale);
  return buf;
}

GroupPtr make_emulated_world(const EmulateConfig& cfg) {
  cfg.validate();
  auto job = std::make_shared<Job>();
  job->cfg = cfg;
  std::vector<int> wr(static_cast<size_t>(cfg.ranks));
  std::iota(wr.begin(), wr.end(), 0);
  return std::make_shared<EmulatedGroup>(job, "world", static_cast<int>(cfg.rank), static_cast<int>(cfg.ranks),
                                         std::move(wr));
}

const char* EmulatedTotals::class_name(int c) {
  static const char* kNames[kClasses] = {"ep", "cp", "param_gather", "grad_reduce", "other"};
  return c >= 0 && c < kClasses ? kNames[c] : "?";
}

EmulatedTotals emulated_totals() { return g_totals; }
void reset_emulated_totals() { g_totals = EmulatedTotals{}; }

namespace emu {

void run_on_host(const std::vector<Segment>& segs) {
  for (const Segment& g : segs) {
    switch (g.op) {
      case SegOp::copy:
        if (g.dst != g.src) std::memmove(g.dst, g.src, static_cast<size_t>(g.bytes));
        break;
      case SegOp::zero: std::memset(g.dst, 0, static_cast<size_t>(g.bytes)); break;
      case SegOp::scale: {
        const int64_t n = g.bytes / static_cast<int64_t>(dtype_size(g.dtype));
        auto each = [&](auto* dst, const auto* src, auto f) {
          for (int64_t i = 0; i < n; ++i) dst[i] = f(src[i]);
        };
        const float ff = static_cast<float>(g.factor);
        switch (g.dtype) {
          case DType::f32:
            each(static_cast<float*>(g.dst), static_cast<const float*>(g.src), [&](float x) { return x * ff; });
            break;
          case DType::bf16:
            each(static_cast<uint16_t*>(g.dst), static_cast<const uint16_t*>(g.src),
                 [&](uint16_t x) { return f32_to_bf16(bf16_to_f32(x) * ff); });
            break;
          case DType::f16:
            each(static_cast<uint16_t*>(g.dst), static_cast<const uint16_t*>(g.src),
                 [&](uint16_t x) { return f32_to_f16(f16_to_f32(x) * ff); });
            break;
          case DType::i32:
            each(static_cast<int32_t*>(g.dst), static_cast<const int32_t*>(g.src),
                 [&](int32_t x) { return static_cast<int32_t>(x * static_cast<int32_t>(g.factor)); });
            break;
          case DType::i64:
            each(static_cast<int64_t*>(g.dst), static_cast<const int64_t*>(g.src),
                 [&](int64_t x) { return x * static_cast<int64_t>(g.factor); });
            break;
          default: BB_FAIL("emulated collective: cannot reduce elements of dtype ", dtype_name(g.dtype));
        }
        break;
      }
    }
  }
}

}  // namespace emu

}  // namespace bb::comm

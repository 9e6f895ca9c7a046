// Multi-rank: every collective of the mpi communicator against values computed independently on
// each rank, group splitting, and the mesh's groups for folded layouts (comm/comm.h, comm/mesh.h).
#include <gtest/gtest.h>

#include <numeric>

#include "comm/emulated.h"
#include "comm/mesh.h"
#include "common/mpi_main.h"
#include "common/testing.h"

namespace bb {
namespace {

using test::world;

// A value that names (rank, element) so misplaced data cannot pass.
float val(int rank, int64_t i) { return static_cast<float>(rank * 1000 + i) * 0.5f; }

// Tensors on the test's device (the CPU, or a GPU with --device=cuda).
Tensor on_dev(const Tensor& t) { return test::device().is_cpu() ? t : t.to(test::device(), MemCategory::other); }
Tensor host_f32(const std::vector<float>& v) { return on_dev(Tensor::from_floats(v, {static_cast<int64_t>(v.size())})); }
Tensor zeros(const Shape& s, DType dt = DType::f32) { return Tensor::zeros(s, dt, test::device(), MemCategory::other); }

TEST(Comm, AllReduceSumMaxMin) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  const int64_t n = 37;
  for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::max, comm::ReduceOp::min}) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = val(r, i) * ((i % 2) ? 1.f : -1.f);
    Tensor t = host_f32(v);
    g.all_reduce(t, op)->wait();
    std::vector<float> got = t.to_floats();
    for (int64_t i = 0; i < n; ++i) {
      double want = op == comm::ReduceOp::sum ? 0.0 : (op == comm::ReduceOp::max ? -1e30 : 1e30);
      for (int q = 0; q < R; ++q) {
        const double x = val(q, i) * ((i % 2) ? 1.0 : -1.0);
        want = op == comm::ReduceOp::sum ? want + x : op == comm::ReduceOp::max ? std::max(want, x) : std::min(want, x);
      }
      ASSERT_EQ(got[static_cast<size_t>(i)], static_cast<float>(want)) << "op " << static_cast<int>(op) << " i " << i;
    }
  }
}

TEST(Comm, AllReduceOfBf16SumsInF32) {
  comm::Group& g = *world();
  // Small integers are exact in bf16; the sum over ranks too.
  std::vector<float> v = {1.f * (g.rank() + 1), -2.f, 0.5f};
  Tensor t = on_dev(Tensor::from_floats(v, {3}, DType::bf16));
  g.all_reduce(t)->wait();
  const float R = static_cast<float>(g.size());
  EXPECT_EQ(t.to_floats(), (std::vector<float>{R * (R + 1) / 2, -2.f * R, 0.5f * R}));
  EXPECT_EQ(t.dtype(), DType::bf16);
}

TEST(Comm, ReduceScatterAndAllGather) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  const int64_t n = 5;
  std::vector<float> in(static_cast<size_t>(R * n));
  for (int64_t i = 0; i < R * n; ++i) in[static_cast<size_t>(i)] = val(r, i);
  Tensor out = zeros({n});
  g.reduce_scatter(host_f32(in), out)->wait();
  std::vector<float> got = out.to_floats();
  for (int64_t i = 0; i < n; ++i) {
    float want = 0;
    for (int q = 0; q < R; ++q) want += val(q, r * n + i);
    EXPECT_EQ(got[static_cast<size_t>(i)], want);
  }
  // Gather into a fresh buffer, then in place (this rank's block is the input).
  Tensor all = zeros({R * n});
  std::vector<float> mine(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = val(r, i);
  g.all_gather(host_f32(mine), all)->wait();
  Tensor inplace = zeros({R * n});
  inplace.narrow(r * n, n).copy_from(host_f32(mine));
  g.all_gather(inplace.narrow(r * n, n), inplace)->wait();
  for (Tensor* t : {&all, &inplace}) {
    std::vector<float> a = t->to_floats();
    for (int q = 0; q < R; ++q)
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(a[static_cast<size_t>(q * n + i)], val(q, i));
  }
  // Sizes that do not fit are errors naming the op.
  test::expect_error_contains([&] { g.reduce_scatter(host_f32(in), zeros({n + 1})); },
                              "reduce_scatter");
}

TEST(Comm, AllGatherUnevenCounts) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  const int64_t W = 3;
  std::vector<int64_t> counts(static_cast<size_t>(R));
  for (int q = 0; q < R; ++q) counts[static_cast<size_t>(q)] = (q * 2) % 3;  // 0, 2, 1, 0: some empty
  std::vector<int32_t> mine;
  for (int64_t i = 0; i < counts[static_cast<size_t>(r)] * W; ++i) mine.push_back(r * 100 + static_cast<int32_t>(i));
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  Tensor in = mine.empty() ? zeros({0, W}, DType::i32) : on_dev(Tensor::from_ints(mine, {counts[static_cast<size_t>(r)], W}));
  Tensor out = zeros({total, W}, DType::i32);
  g.all_gather_v(in, out, counts)->wait();
  std::vector<int32_t> got = total > 0 ? out.to_ints() : std::vector<int32_t>{};
  size_t k = 0;
  for (int q = 0; q < R; ++q)
    for (int64_t i = 0; i < counts[static_cast<size_t>(q)] * W; ++i) ASSERT_EQ(got[k++], q * 100 + i);
}

TEST(Comm, AllToAllWithPerPeerCounts) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  const int64_t W = 2;
  auto count = [](int src, int dst) { return static_cast<int64_t>((src + 2 * dst) % 3); };
  std::vector<int64_t> sc, rc;
  std::vector<float> in;
  for (int p = 0; p < R; ++p) {
    sc.push_back(count(r, p));
    rc.push_back(count(p, r));
    for (int64_t j = 0; j < count(r, p) * W; ++j) in.push_back(static_cast<float>(r * 10000 + p * 100 + j));
  }
  const int64_t ns = std::accumulate(sc.begin(), sc.end(), int64_t{0}), nr = std::accumulate(rc.begin(), rc.end(), int64_t{0});
  Tensor tin = ns > 0 ? on_dev(Tensor::from_floats(in, {ns, W})) : zeros({0, W});
  Tensor tout = zeros({nr, W});
  g.all_to_all_v(tin, sc, tout, rc)->wait();
  std::vector<float> got = nr > 0 ? tout.to_floats() : std::vector<float>{};
  size_t k = 0;
  for (int p = 0; p < R; ++p)
    for (int64_t j = 0; j < count(p, r) * W; ++j) ASSERT_EQ(got[k++], static_cast<float>(p * 10000 + r * 100 + j));
}

// The host all-to-all of control values (the MoE dispatcher's per-expert counts): n values to
// and from every peer, each naming (source, destination, index).
TEST(Comm, AllToAllOfHostValues) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  for (int64_t n : {0, 1, 3}) {
    std::vector<int64_t> send, recv(static_cast<size_t>(R * n), -1);
    for (int p = 0; p < R; ++p)
      for (int64_t i = 0; i < n; ++i) send.push_back(r * 1000000 + p * 1000 + i);
    g.all_to_all_host(send.data(), recv.data(), n);
    for (int p = 0; p < R; ++p)
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(recv[static_cast<size_t>(p * n + i)], p * 1000000 + r * 1000 + i) << "from " << p << " value " << i;
  }
}

TEST(Comm, SendRecvRingBroadcastBarrierAndHostValues) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  if (R > 1) {
    Tensor out = host_f32({val(r, 0), val(r, 1)});
    Tensor in = zeros({2});
    // Both started before either is waited for: neither blocks the other.
    comm::WorkPtr s = g.send(out, (r + 1) % R), q = g.recv(in, (r + R - 1) % R);
    q->wait();
    s->wait();
    const int from = (r + R - 1) % R;
    EXPECT_EQ(in.to_floats(), (std::vector<float>{val(from, 0), val(from, 1)}));
  }
  Tensor b = host_f32({static_cast<float>(r), 7.f});
  g.broadcast(b, R - 1)->wait();
  EXPECT_EQ(b.to_floats(), (std::vector<float>{static_cast<float>(R - 1), 7.f}));
  g.barrier();
  int64_t iv[2] = {r, 1};
  g.all_reduce_host(iv, 2, comm::ReduceOp::sum);
  EXPECT_EQ(iv[0], static_cast<int64_t>(R) * (R - 1) / 2);
  EXPECT_EQ(iv[1], R);
  EXPECT_EQ(g.max(static_cast<int64_t>(r)), R - 1);
  std::string s = r == 0 ? "from rank zero" : "";
  g.broadcast_host(s, 0);
  EXPECT_EQ(s, "from rank zero");
}

TEST(Comm, OverlappingOperationsCompleteInAnyWaitOrder) {
  comm::Group& g = *world();
  Tensor a = host_f32({1.f, 2.f}), b = host_f32({3.f});
  comm::WorkPtr wa = g.all_reduce(a), wb = g.all_reduce(b);
  wb->wait();
  wa->wait();
  const float R = static_cast<float>(g.size());
  EXPECT_EQ(a.to_floats(), (std::vector<float>{R, 2 * R}));
  EXPECT_EQ(b.to_floats(), (std::vector<float>{3 * R}));
}

TEST(Comm, SplitGroupsKeepWorldRanks) {
  comm::Group& g = *world();
  const int r = g.rank();
  comm::GroupPtr half = g.split(r % 2, r, "parity");
  std::vector<int> want;
  for (int q = 0; q < g.size(); ++q)
    if (q % 2 == r % 2) want.push_back(q);
  EXPECT_EQ(half->world_ranks(), want);
  EXPECT_EQ(half->rank(), r / 2);
  EXPECT_EQ(half->sum(static_cast<int64_t>(r)), std::accumulate(want.begin(), want.end(), int64_t{0}));
}

// The members of a mesh group, recomputed from the rank order of mesh.h: ranks whose coordinates
// agree on every axis but `free`.
std::vector<int> members(const ParallelLayout& l, int rank, const std::string& group) {
  auto coords = [&](int q) {
    const int64_t local = q % (l.dp * l.cp);
    return std::array<int64_t, 5>{q / (l.dp * l.cp), local / l.cp, local % l.cp, local % l.ep, local / l.ep};
  };  // pp, dp, cp, ep, edp
  const auto me = coords(rank);
  std::vector<int> out;
  for (int q = 0; q < l.world(); ++q) {
    const auto c = coords(q);
    bool same = c[0] == me[0];
    if (group == "dp") same = same && c[2] == me[2];
    if (group == "cp") same = same && c[1] == me[1];
    if (group == "ep") same = same && c[4] == me[4];
    if (group == "edp") same = same && c[3] == me[3];
    if (same) out.push_back(q);
  }
  return out;
}

TEST(Mesh, FoldedLayoutsBuildTheirGroups) {
  const int R = world()->size(), r = world()->rank();
  std::vector<ParallelLayout> layouts;
  for (int64_t cp = 1; cp <= R; ++cp) {
    if (R % cp) continue;
    for (int64_t ep = 1; ep <= R; ++ep)
      if (R % ep == 0) layouts.push_back({R / cp, cp, ep, 1});
  }
  for (const ParallelLayout& l : layouts) {
    SCOPED_TRACE(l.str());
    l.validate(R, 24);  // experts every ep of 1-4 ranks divides
    Mesh m(world(), l);
    EXPECT_EQ(m.dp()->world_ranks(), members(l, r, "dp"));
    EXPECT_EQ(m.cp()->world_ranks(), members(l, r, "cp"));
    EXPECT_EQ(m.dense()->world_ranks(), members(l, r, "dense"));
    EXPECT_EQ(m.ep()->world_ranks(), members(l, r, "ep"));
    EXPECT_EQ(m.edp()->world_ranks(), members(l, r, "edp"));
    EXPECT_EQ(m.dp()->size() * m.cp()->size(), R);
    EXPECT_EQ(m.ep()->size() * m.edp()->size(), R);
  }
  if (R == 4) {
    // Written out: dp 2 x cp 2 with ep 2 folds EP over the CP pair; ep 4 spans DP and CP.
    Mesh a(world(), {2, 2, 2, 1});
    if (r == 0) {
      EXPECT_EQ(a.dp()->world_ranks(), (std::vector<int>{0, 2}));
      EXPECT_EQ(a.cp()->world_ranks(), (std::vector<int>{0, 1}));
      EXPECT_EQ(a.ep()->world_ranks(), (std::vector<int>{0, 1}));
      EXPECT_EQ(a.edp()->world_ranks(), (std::vector<int>{0, 2}));
    }
    Mesh b(world(), {2, 2, 4, 1});
    EXPECT_EQ(b.ep()->world_ranks(), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(b.edp()->size(), 1);
  }
}

TEST(Mesh, ImpossibleLayoutsAreClearErrors) {
  const int64_t R = world()->size();
  test::expect_error_contains([&] { ParallelLayout{R + 1, 1, 1, 1}.validate(R, 8); }, "rank(s) were launched");
  test::expect_error_contains([&] { ParallelLayout{R, 1, 3, 1}.validate(R, 8); }, "does not divide");
  test::expect_error_contains([&] { ParallelLayout{R, 1, 2, 1}.validate(R, 7); }, "routed experts");
  test::expect_error_contains([&] { ParallelLayout{R, 1, 1, 2}.validate(R, 8); }, "pipeline");
  test::expect_error_contains([&] { ParallelLayout{R, 1, 2, 1}.validate(R, 0); }, "no routed experts");
  test::expect_error_contains([&] { ParallelLayout{R, 1, 2 * R, 1}.validate(R, 8 * R); },
                              "is more than the " + std::to_string(R) + " rank(s) of a pipeline stage");
}

// The emulated backend (comm/emulated.h) plays one rank of a job whose peers are copies of it.
// Here the job is real: every rank holds the same data (for the all-to-alls, data that depends
// only on the offset between sender and receiver), runs the real collective over this
// communicator and the emulated one of the same size as its own rank, and the two must agree
// element for element. At one rank both are the self case.
TEST(Comm, EmulatedCollectivesAreThoseOfAJobOfIdenticalRanks) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  comm::EmulateConfig ec;
  ec.ranks = R;
  ec.rank = r;
  comm::GroupPtr emu = comm::make_emulated_world(ec);
  auto same = [&](const char* what, const Tensor& real, const Tensor& emulated) {
    ASSERT_EQ(real.to_floats(), emulated.to_floats()) << what << " on rank " << r << " of " << R;
  };
  const int64_t n = 6;
  std::vector<float> v(static_cast<size_t>(R * n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(static_cast<int>(i % 7) - 3);  // small integers: exact sums
  for (DType dt : {DType::f32, DType::bf16}) {
    for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::max}) {
      Tensor a = on_dev(Tensor::from_floats(v, {R * n}, dt)), b = on_dev(Tensor::from_floats(v, {R * n}, dt));
      g.all_reduce(a, op)->wait();
      emu->all_reduce(b, op)->wait();
      same("all_reduce", a, b);
      Tensor oa = zeros({n}, dt), ob = zeros({n}, dt);
      g.reduce_scatter(on_dev(Tensor::from_floats(v, {R * n}, dt)), oa, op)->wait();
      emu->reduce_scatter(on_dev(Tensor::from_floats(v, {R * n}, dt)), ob, op)->wait();
      same("reduce_scatter", oa, ob);
    }
    const std::vector<float> mine(v.begin(), v.begin() + n);
    Tensor ga = zeros({R * n}, dt), gb = zeros({R * n}, dt);
    g.all_gather(on_dev(Tensor::from_floats(mine, {n}, dt)), ga)->wait();
    emu->all_gather(on_dev(Tensor::from_floats(mine, {n}, dt)), gb)->wait();
    same("all_gather", ga, gb);
    const std::vector<int64_t> counts(static_cast<size_t>(R), 2);
    Tensor va = zeros({2 * R, 3}, dt), vb = zeros({2 * R, 3}, dt);
    g.all_gather_v(on_dev(Tensor::from_floats(mine, {2, 3}, dt)), va, counts)->wait();
    emu->all_gather_v(on_dev(Tensor::from_floats(mine, {2, 3}, dt)), vb, counts)->wait();
    same("all_gather_v", va, vb);
    // All-to-all: rank x sends peer p rows that depend on d = (p - x) mod R only, c(d) of them.
    auto c = [&](int d) { return static_cast<int64_t>(d % 3 + 1); };
    std::vector<int64_t> sc, rc;
    std::vector<float> in;
    for (int p = 0; p < R; ++p) {
      const int d = (p - r + R) % R;
      sc.push_back(c(d));
      rc.push_back(c((r - p + R) % R));
      for (int64_t j = 0; j < c(d) * 2; ++j) in.push_back(static_cast<float>(d * 10 + j));
    }
    const int64_t ns = std::accumulate(sc.begin(), sc.end(), int64_t{0}), nr = std::accumulate(rc.begin(), rc.end(), int64_t{0});
    Tensor aa = zeros({nr, 2}, dt), ab = zeros({nr, 2}, dt);
    g.all_to_all_v(on_dev(Tensor::from_floats(in, {ns, 2}, dt)), sc, aa, rc)->wait();
    emu->all_to_all_v(on_dev(Tensor::from_floats(in, {ns, 2}, dt)), sc, ab, rc)->wait();
    same("all_to_all_v", aa, ab);
  }
  std::vector<int64_t> hs, ha(static_cast<size_t>(R * 2)), hb(static_cast<size_t>(R * 2));
  for (int p = 0; p < R; ++p)
    for (int64_t i = 0; i < 2; ++i) hs.push_back(((p - r + R) % R) * 100 + i);
  g.all_to_all_host(hs.data(), ha.data(), 2);
  emu->all_to_all_host(hs.data(), hb.data(), 2);
  EXPECT_EQ(ha, hb);
  const int64_t mine2[2] = {5, -7};
  g.all_gather_host(mine2, ha.data(), 2);
  emu->all_gather_host(mine2, hb.data(), 2);
  EXPECT_EQ(ha, hb);
  double d[2] = {1.5, -2}, e[2] = {1.5, -2};
  g.all_reduce_host(d, 2, comm::ReduceOp::sum);
  emu->all_reduce_host(e, 2, comm::ReduceOp::sum);
  EXPECT_EQ(d[0], e[0]);
  EXPECT_EQ(d[1], e[1]);
}

// The host all-gather (the allgather dispatcher's counts): every member's values in rank order.
TEST(Comm, AllGatherOfHostValues) {
  comm::Group& g = *world();
  const int R = g.size(), r = g.rank();
  for (int64_t n : {0, 1, 3}) {
    std::vector<int64_t> mine, all(static_cast<size_t>(R * n), -1);
    for (int64_t i = 0; i < n; ++i) mine.push_back(r * 1000 + i);
    g.all_gather_host(mine.data(), all.data(), n);
    for (int p = 0; p < R; ++p)
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(all[static_cast<size_t>(p * n + i)], p * 1000 + i);
  }
}

}  // namespace
}  // namespace bb

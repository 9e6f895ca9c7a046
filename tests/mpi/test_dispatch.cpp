// Multi-rank: the MoE dispatchers (primitives/moe/dispatcher.h) over the world as the expert-
// parallel group. Every member (allgather, alltoall, chunked_alltoall:1..4) is checked with row
// payloads that encode their source (rank, row, expert): the experts must see exactly the rows of
// their experts, in the documented order, with their probabilities and saved tensors; combine
// and both backward movements must bring every row home, for uneven counts, experts with no rows
// and ranks with no rows. Then with the real expert MLPs: allgather = alltoall = the single-rank
// computation bit for bit with the `grouped` experts (row-independent CPU arithmetic), and
// chunked_alltoall:N = alltoall within a stated bound with the BLAS `sequential` experts. Runs at
// any world size.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "common/mpi_main.h"
#include "common/testing.h"
#include "core/rng.h"
#include "primitives/moe/dispatcher.h"
#include "primitives/registry.h"

namespace bb {
namespace {

using test::world;

Tensor on_dev(const Tensor& t) { return test::device().is_cpu() ? t : t.to(test::device(), MemCategory::other); }

const char* kMembers[] = {"allgather", "alltoall", "chunked_alltoall:1", "chunked_alltoall:2",
                          "chunked_alltoall:3", "chunked_alltoall:4"};

std::unique_ptr<Dispatcher> make(const std::string& member, int64_t num_experts, comm::GroupPtr group) {
  const Choice<DispatcherFactory> c = moe_dispatch_family().parse(member, "test");
  DispatcherConfig dc;
  dc.num_experts = num_experts;
  dc.group = std::move(group);
  dc.num_chunks = std::max<int64_t>(1, c.count);
  return c.value(dc);
}

// Rows of rank r for global expert e, for the count patterns of the tests (every rank computes
// every rank's counts, so the expected arrivals are known without communication).
using CountFn = std::function<int64_t(int r, int64_t e)>;

std::vector<int64_t> counts_of(const CountFn& f, int r, int64_t E) {
  std::vector<int64_t> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) c[static_cast<size_t>(e)] = f(r, e);
  return c;
}

// The payload of row i (expert e) of rank r: [r, i, e] (small integers: exact in f32 and bf16
// up to 256; the tests stay below).
std::vector<float> payload(int r, const std::vector<int64_t>& counts) {
  std::vector<float> v;
  int64_t i = 0;
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t k = 0; k < counts[e]; ++k, ++i) v.insert(v.end(), {float(r), float(i), float(e)});
  return v;
}

struct Arrival {
  int src;
  int64_t row, expert;
};

// The rows the experts of EP rank `me` must receive, in the dispatcher's order: expert j, then
// source rank, then the source's row order.
std::vector<Arrival> expected_arrivals(const CountFn& f, int P, int me, int64_t E) {
  const int64_t El = E / P;
  std::vector<Arrival> out;
  for (int64_t j = 0; j < El; ++j) {
    const int64_t e = me * El + j;
    for (int q = 0; q < P; ++q) {
      int64_t off = 0;
      for (int64_t e2 = 0; e2 < e; ++e2) off += f(q, e2);
      for (int64_t k = 0; k < f(q, e); ++k) out.push_back({q, off + k, e});
    }
  }
  return out;
}

// Fake experts that check what they are given and answer with values that name their input:
//   forward    y = [src + 0.5, 2 row, expert + 100 j]; saved gate_up = [src, row], act = [expert]
//   dgrad      d_x = d_y + [1, 1, 1] (d_y arrives as [src, row, expert] + 1000), d_row_prob =
//              prob + 0.25; checks the saved tensors of the chunk
//   wgrad      called once per micro-batch with every row in the whole layout
struct FakeExperts {
  std::vector<Arrival> want;  // whole layout
  int64_t El = 0, first = 0;
  bool with_prob = false;
  std::vector<std::pair<int, int64_t>> seen_fwd, seen_bwd;  // (src, row) in call order
  int fwd_calls = 0, dgrad_calls = 0, wgrad_calls = 0;

  static std::vector<float> host(const Tensor& t) { return t.to_floats(); }
  float prob_of(int src, int64_t row) const { return static_cast<float>(src * 1000 + row) / 8.0f; }

  // Rows of one call: expert j's rows contiguous with `counts`; each row must be an arrival
  // of expert first + j, and the sequence over calls must follow `want` per expert.
  void check_rows(const std::vector<float>& v, int64_t width, const std::vector<int64_t>& counts, float bias,
                  std::vector<std::pair<int, int64_t>>& seen) {
    ASSERT_EQ(static_cast<int64_t>(counts.size()), El);
    int64_t n = 0;
    for (int64_t j = 0; j < El; ++j)
      for (int64_t k = 0; k < counts[static_cast<size_t>(j)]; ++k, ++n) {
        const float* x = v.data() + n * width;
        ASSERT_EQ(x[2] - bias, static_cast<float>(first + j)) << "row " << n << " is not of local expert " << j;
        seen.emplace_back(static_cast<int>(x[0] - bias), static_cast<int64_t>(x[1] - bias));
      }
    ASSERT_EQ(n * width, static_cast<int64_t>(v.size()));
  }

  ExpertCalls calls() {
    ExpertCalls c;
    c.forward = [this](const Tensor& rows, const Tensor& prob, const std::vector<int64_t>& counts, ExpertsSaved* s) {
      ++fwd_calls;
      EXPECT_EQ(prob.defined(), with_prob);
      const std::vector<float> v = host(rows);
      const size_t before = seen_fwd.size();
      check_rows(v, 3, counts, 0.0f, seen_fwd);
      const int64_t M = rows.size(0);
      std::vector<float> y, gu, act;
      std::vector<float> p = prob.defined() ? host(prob) : std::vector<float>();
      int64_t n = 0;
      for (int64_t j = 0; j < El; ++j)
        for (int64_t k = 0; k < counts[static_cast<size_t>(j)]; ++k, ++n) {
          const float* x = v.data() + n * 3;
          if (prob.defined())
            EXPECT_EQ(p[static_cast<size_t>(n)], prob_of(static_cast<int>(x[0]), static_cast<int64_t>(x[1])));
          y.insert(y.end(), {x[0] + 0.5f, 2 * x[1], x[2] + 100.0f * static_cast<float>(j)});
          gu.insert(gu.end(), {x[0], x[1]});
          act.push_back(x[2]);
        }
      EXPECT_EQ(seen_fwd.size() - before, static_cast<size_t>(M));
      s->gate_up = on_dev(Tensor::from_floats(gu, {M, 2}));
      s->act = on_dev(Tensor::from_floats(act, {M, 1}));
      return on_dev(Tensor::from_floats(y, {M, 3}));
    };
    c.backward_data = [this](const Tensor& d_y, const Tensor& prob, const std::vector<int64_t>& counts,
                             const ExpertsSaved& s) {
      ++dgrad_calls;
      const std::vector<float> v = host(d_y), gu = host(s.gate_up), act = host(s.act);
      const size_t before = seen_bwd.size();
      check_rows(v, 3, counts, 1000.0f, seen_bwd);
      const int64_t M = d_y.size(0);
      std::vector<float> p = prob.defined() ? host(prob) : std::vector<float>();
      std::vector<float> dx, dp;
      for (int64_t n = 0; n < M; ++n) {
        const auto [src, row] = seen_bwd[before + static_cast<size_t>(n)];
        // The chunk's saved tensors belong to the same rows.
        EXPECT_EQ(gu[static_cast<size_t>(2 * n)], static_cast<float>(src));
        EXPECT_EQ(gu[static_cast<size_t>(2 * n + 1)], static_cast<float>(row));
        EXPECT_EQ(act[static_cast<size_t>(n)], v[static_cast<size_t>(3 * n + 2)] - 1000.0f);
        if (prob.defined()) {
          EXPECT_EQ(p[static_cast<size_t>(n)], prob_of(src, row));
          dp.push_back(p[static_cast<size_t>(n)] + 0.25f);
        }
        for (int d = 0; d < 3; ++d) dx.push_back(v[static_cast<size_t>(3 * n + d)] + 1.0f);
      }
      ExpertsDgrad g;
      g.d_x = on_dev(Tensor::from_floats(dx, {M, 3}));
      if (prob.defined()) g.d_row_prob = on_dev(Tensor::from_floats(dp, {M}));
      g.d_gate_up = on_dev(Tensor::from_floats(gu, {M, 2}));  // names its rows, like saved.gate_up
      return g;
    };
    c.backward_weight = [this](const Tensor& d_y, const Tensor& rows, const Tensor& prob,
                               const std::vector<int64_t>& counts, const ExpertsSaved& s, const Tensor& d_gate_up) {
      ++wgrad_calls;
      // The whole micro-batch in the common layout: every tensor names the same rows.
      const std::vector<float> dy = host(d_y), x = host(rows), gu = host(s.gate_up), dgu = host(d_gate_up);
      const std::vector<float> p = prob.defined() ? host(prob) : std::vector<float>();
      ASSERT_EQ(rows.size(0), static_cast<int64_t>(want.size()));
      int64_t n = 0;
      for (int64_t j = 0; j < El; ++j) n += counts[static_cast<size_t>(j)];
      ASSERT_EQ(n, static_cast<int64_t>(want.size()));
      for (size_t i = 0; i < want.size(); ++i) {
        const Arrival& a = want[i];
        EXPECT_EQ(x[3 * i], float(a.src));
        EXPECT_EQ(x[3 * i + 1], float(a.row));
        EXPECT_EQ(x[3 * i + 2], float(a.expert));
        EXPECT_EQ(dy[3 * i], float(a.src) + 1000.0f);
        EXPECT_EQ(dy[3 * i + 1], float(a.row) + 1000.0f);
        EXPECT_EQ(gu[2 * i], float(a.src));
        EXPECT_EQ(dgu[2 * i + 1], float(a.row));
        if (prob.defined()) EXPECT_EQ(p[i], prob_of(a.src, a.row));
      }
    };
    return c;
  }
};

void round_trip(const std::string& member, const CountFn& f, int64_t E, bool with_prob) {
  comm::GroupPtr g = world();
  const int P = g->size(), r = g->rank();
  SCOPED_TRACE(member + " E=" + std::to_string(E) + " P=" + std::to_string(P) + (with_prob ? " +prob" : ""));
  auto d = make(member, E, g);
  const int64_t El = E / P;
  ASSERT_EQ(d->num_local_experts(E), El);
  ASSERT_EQ(d->first_local_expert(E), r * El);
  const std::vector<int64_t> counts = counts_of(f, r, E);
  const int64_t N = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const std::vector<float> x = payload(r, counts);
  Tensor x_perm = on_dev(Tensor::from_floats(x, {N, 3}));
  std::vector<float> pv;
  for (int64_t i = 0; i < N; ++i) pv.push_back(static_cast<float>(r * 1000 + i) / 8.0f);
  Tensor prob = with_prob ? on_dev(Tensor::from_floats(pv, {N})) : Tensor();

  FakeExperts fx;
  fx.El = El;
  fx.first = r * El;
  fx.with_prob = with_prob;
  fx.want = expected_arrivals(f, P, r, E);
  const ExpertCalls calls = fx.calls();
  DispatchState st;
  Tensor y = d->forward(x_perm, prob, counts, calls, st);

  // The experts saw every expected row once, in order per expert.
  const Choice<DispatcherFactory> ch = moe_dispatch_family().parse(member, "test");
  const int chunks = static_cast<int>(std::max<int64_t>(1, ch.count));
  EXPECT_EQ(fx.fwd_calls, chunks);
  auto in_whole_order = [&](std::vector<std::pair<int, int64_t>> seen) {
    // Chunks deliver sub-runs; sorting by the position in `want` must give `want` exactly and
    // each expert's rows must arrive in order within every call.
    ASSERT_EQ(seen.size(), fx.want.size());
    std::vector<std::pair<int, int64_t>> w;
    for (const Arrival& a : fx.want) w.emplace_back(a.src, a.row);
    std::vector<std::pair<int, int64_t>> s = seen, ws = w;
    std::sort(s.begin(), s.end());
    std::sort(ws.begin(), ws.end());
    EXPECT_EQ(s, ws) << "the experts did not receive exactly the rows routed to them";
    if (chunks == 1) EXPECT_EQ(seen, w);
  };
  in_whole_order(fx.seen_fwd);
  EXPECT_EQ(st.num_rows(), static_cast<int64_t>(fx.want.size()));

  // Combine brought every row home: y = f(x) at the same position.
  ASSERT_EQ(y.size(0), N);
  const std::vector<float> yv = y.to_floats();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = static_cast<int64_t>(x[static_cast<size_t>(3 * i + 2)]);
    EXPECT_EQ(yv[static_cast<size_t>(3 * i)], float(r) + 0.5f) << "row " << i;
    EXPECT_EQ(yv[static_cast<size_t>(3 * i + 1)], 2.0f * float(i)) << "row " << i;
    EXPECT_EQ(yv[static_cast<size_t>(3 * i + 2)], float(e) + 100.0f * float(e % El)) << "row " << i;
  }

  // Backward: d_y_perm names its rows (+1000); d_x comes back +1, d_row_prob = prob + 0.25.
  std::vector<float> dyv = x;
  for (float& v : dyv) v += 1000.0f;
  DispatchRows back = d->backward(on_dev(Tensor::from_floats(dyv, {N, 3})), calls, st);
  EXPECT_EQ(fx.dgrad_calls, chunks);
  EXPECT_EQ(fx.wgrad_calls, 1);
  in_whole_order(fx.seen_bwd);
  ASSERT_EQ(back.rows.size(0), N);
  const std::vector<float> dx = back.rows.to_floats();
  for (size_t i = 0; i < dyv.size(); ++i) EXPECT_EQ(dx[i], dyv[i] + 1.0f) << "element " << i;
  EXPECT_EQ(back.row_prob.defined(), with_prob);
  if (with_prob) {
    const std::vector<float> dp = back.row_prob.to_floats();
    for (int64_t i = 0; i < N; ++i) EXPECT_EQ(dp[static_cast<size_t>(i)], pv[static_cast<size_t>(i)] + 0.25f);
  }
}

TEST(Dispatch, RoundTripWithSourcePayloadsIsExact) {
  const int P = world()->size();
  // Uneven counts with zeros per expert; rank 1 (if any) has no rows at all; the last expert
  // of every rank receives nothing from anyone.
  const CountFn uneven = [P](int r, int64_t e) -> int64_t {
    if (r == 1 && P > 1) return 0;
    if (e % 3 == 2) return 0;
    return (r * 5 + e * 3) % 7;
  };
  const CountFn dense = [](int r, int64_t e) -> int64_t { return 1 + (r + 2 * e) % 4; };
  const CountFn nothing = [](int, int64_t) -> int64_t { return 0; };
  for (const char* m : kMembers)
    for (bool prob : {false, true}) {
      round_trip(m, uneven, 3 * P, prob);  // E_l = 3
      round_trip(m, dense, P, prob);       // E_l = 1
      round_trip(m, dense, 4 * P, prob);
    }
  for (const char* m : kMembers) round_trip(m, nothing, 2 * P, true);  // nobody routes anything
}

// ---- the real expert MLPs ----------------------------------------------------------------------

struct LayerRun {
  Tensor y, d_x, d_prob, d_wgu, d_wd;  // host copies; weight gradients of the local experts
};

// The expert MLPs with weights wgu, wd; the weight gradients accumulate into dwgu, dwd.
ExpertCalls real_experts(ExpertsImpl impl, const Tensor& wgu, const Tensor& wd, Tensor& dwgu, Tensor& dwd) {
  ExpertCalls c;
  c.forward = [=](const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt, ExpertsSaved* s) {
    return experts_forward(impl, rows, cnt, wgu, wd, p, s);
  };
  c.rebuild = [=](const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt, ExpertsSaved* s) {
    experts_forward_saved(impl, rows, cnt, wgu, wd, p, *s);
  };
  c.backward_data = [=](const Tensor& dy, const Tensor& p, const std::vector<int64_t>& cnt, const ExpertsSaved& s) {
    return experts_backward_data(impl, dy, cnt, wgu, wd, p, s);
  };
  c.backward_weight = [=, &dwgu, &dwd](const Tensor& dy, const Tensor& rows, const Tensor& p,
                                       const std::vector<int64_t>& cnt, const ExpertsSaved& s, const Tensor& dgu) {
    ExpertsDgrad g;
    g.d_gate_up = dgu;
    experts_backward_weight(impl, dy, rows, cnt, p, s, g, dwgu, dwd);
  };
  return c;
}

// One MoE layer's experts over the dispatcher `d`: rows x_perm [N, H] with counts [E], local
// weights, forward then backward with d_y_perm; weight gradients accumulate from zero. rebuild:
// between them the state is rebuilt by forward_for_backward (as under full recompute).
LayerRun run_layer(Dispatcher& d, ExpertsImpl impl, const Tensor& x_perm, const Tensor& prob,
                   const std::vector<int64_t>& counts, const Tensor& wgu, const Tensor& wd, const Tensor& d_y_perm,
                   bool rebuild = false) {
  LayerRun out;
  Tensor dwgu = Tensor::zeros(wgu.shape(), DType::f32, wgu.device(), MemCategory::other);
  Tensor dwd = Tensor::zeros(wd.shape(), DType::f32, wd.device(), MemCategory::other);
  ExpertCalls c = real_experts(impl, wgu, wd, dwgu, dwd);
  DispatchState st;
  out.y = d.forward(x_perm, prob, counts, c, st).to(Device::cpu(), MemCategory::other);
  if (rebuild) {
    // A recompute: the state rebuilt by forward_for_backward replaces the forward's.
    st = DispatchState{};
    d.forward_for_backward(x_perm, prob, counts, c, st);
  }
  DispatchRows b = d.backward(d_y_perm, c, st);
  out.d_x = b.rows.to(Device::cpu(), MemCategory::other);
  if (b.row_prob.defined()) out.d_prob = b.row_prob.to(Device::cpu(), MemCategory::other);
  out.d_wgu = dwgu.to(Device::cpu(), MemCategory::other);
  out.d_wd = dwd.to(Device::cpu(), MemCategory::other);
  return out;
}

Tensor randn(const Shape& s, uint64_t seed, uint64_t offset, float std = 1.0f) {
  Tensor t = Tensor::empty(s, DType::f32, test::device(), MemCategory::other);
  fill_normal(t, seed, offset, 0.0f, std);
  return t;
}

double max_rel(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(x[i]) - y[i]));
    den = std::max(den, std::abs(static_cast<double>(y[i])));
  }
  return num / std::max(den, 1e-30);
}

struct LayerCase {
  int64_t E, H, F;
  std::vector<int64_t> counts;  // this rank's
  Tensor x, prob, dy, wgu_full, wd_full;
};

LayerCase make_case(int64_t E, bool with_prob) {
  const int P = world()->size(), r = world()->rank();
  LayerCase c;
  c.E = E;
  c.H = 40;  // > 32: OpenBLAS's NT kernels depend on M (the sequential experts then differ)
  c.F = 36;
  for (int64_t e = 0; e < E; ++e) c.counts.push_back(e % 5 == 3 ? 0 : (r * 7 + e * 5) % 9 + (r == P - 1 ? 3 : 0));
  const int64_t N = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  c.x = randn({N, c.H}, 100 + static_cast<uint64_t>(r), 0);
  c.dy = randn({N, c.H}, 200 + static_cast<uint64_t>(r), 0);
  if (with_prob) {
    std::vector<float> p;
    for (int64_t i = 0; i < N; ++i) p.push_back(0.1f + 0.8f * static_cast<float>((i * 37 + r) % 17) / 17.0f);
    c.prob = on_dev(Tensor::from_floats(p, {N}));
  }
  c.wgu_full = randn({E, 2 * c.F, c.H}, 7, 0, 0.2f);  // the same on every rank
  c.wd_full = randn({E, c.H, c.F}, 8, 0, 0.2f);
  return c;
}

// allgather and alltoall give the same bits (same expert inputs), and with the grouped experts
// (row-independent arithmetic, rows accumulated into the weight gradient in order) they equal
// the computation on one rank that holds every expert: y, d_x, d_row_prob on every rank, and the
// weight gradients summed over ranks.
TEST(Dispatch, MembersEqualTheSingleRankExpertsBitForBit) {
  if (!test::device().is_cpu()) GTEST_SKIP() << "bit-exact CPU arithmetic (GPU kernels accumulate atomically)";
  comm::GroupPtr g = world();
  const int P = g->size(), r = g->rank();
  for (bool with_prob : {false, true}) {
    SCOPED_TRACE(with_prob ? "memory_efficient (row_prob)" : "standard");
    LayerCase c = make_case(4 * P, with_prob);
    const int64_t El = c.E / P;
    Tensor wgu = c.wgu_full.narrow(r * El, El), wd = c.wd_full.narrow(r * El, El);
    for (ExpertsImpl impl : {ExpertsImpl::grouped, ExpertsImpl::sequential}) {
      SCOPED_TRACE(impl == ExpertsImpl::grouped ? "grouped" : "sequential");
      auto ag = make("allgather", c.E, g), a2a = make("alltoall", c.E, g);
      LayerRun A = run_layer(*ag, impl, c.x, c.prob, c.counts, wgu, wd, c.dy);
      LayerRun B = run_layer(*a2a, impl, c.x, c.prob, c.counts, wgu, wd, c.dy);
      EXPECT_EQ(A.y.to_floats(), B.y.to_floats());
      EXPECT_EQ(A.d_x.to_floats(), B.d_x.to_floats());
      if (with_prob) EXPECT_EQ(A.d_prob.to_floats(), B.d_prob.to_floats());
      EXPECT_EQ(A.d_wgu.to_floats(), B.d_wgu.to_floats());
      EXPECT_EQ(A.d_wd.to_floats(), B.d_wd.to_floats());
      if (impl != ExpertsImpl::grouped) continue;
      // The single-rank reference: every rank's rows through all experts on this rank alone,
      // ranks in order (so the weight gradient accumulates rank 0's rows first, as the EP
      // layout does).
      auto one = make("alltoall", c.E, comm::self_group());
      Tensor dwgu_ref = Tensor::zeros(c.wgu_full.shape(), DType::f32, Device::cpu(), MemCategory::other);
      Tensor dwd_ref = Tensor::zeros(c.wd_full.shape(), DType::f32, Device::cpu(), MemCategory::other);
      for (int q = 0; q < P; ++q) {
        // Rank q's inputs, rebuilt here from the same seeds.
        std::vector<int64_t> cq;
        for (int64_t e = 0; e < c.E; ++e) cq.push_back(e % 5 == 3 ? 0 : (q * 7 + e * 5) % 9 + (q == P - 1 ? 3 : 0));
        const int64_t Nq = std::accumulate(cq.begin(), cq.end(), int64_t{0});
        Tensor xq = randn({Nq, c.H}, 100 + static_cast<uint64_t>(q), 0);
        Tensor dyq = randn({Nq, c.H}, 200 + static_cast<uint64_t>(q), 0);
        Tensor pq;
        if (with_prob) {
          std::vector<float> p;
          for (int64_t i = 0; i < Nq; ++i) p.push_back(0.1f + 0.8f * static_cast<float>((i * 37 + q) % 17) / 17.0f);
          pq = on_dev(Tensor::from_floats(p, {Nq}));
        }
        // Accumulating into the same gradients as the layer does (rows of rank q after rank q-1)
        // is what the EP layout's order amounts to with per-row accumulation.
        LayerRun R;
        {
          ExpertCalls calls;
          calls.forward = [&](const Tensor& rows, const Tensor& p, const std::vector<int64_t>& cnt, ExpertsSaved* s) {
            return experts_forward(impl, rows, cnt, c.wgu_full, c.wd_full, p, s);
          };
          calls.backward_data = [&](const Tensor& dy, const Tensor& p, const std::vector<int64_t>& cnt,
                                    const ExpertsSaved& s) {
            return experts_backward_data(impl, dy, cnt, c.wgu_full, c.wd_full, p, s);
          };
          calls.backward_weight = [&](const Tensor& dy, const Tensor& rows, const Tensor& p,
                                      const std::vector<int64_t>& cnt, const ExpertsSaved& s, const Tensor& dgu) {
            ExpertsDgrad gr;
            gr.d_gate_up = dgu;
            experts_backward_weight(impl, dy, rows, cnt, p, s, gr, dwgu_ref, dwd_ref);
          };
          DispatchState st;
          R.y = one->forward(xq, pq, cq, calls, st).to(Device::cpu(), MemCategory::other);
          DispatchRows b = one->backward(dyq, calls, st);
          R.d_x = b.rows.to(Device::cpu(), MemCategory::other);
          if (with_prob) R.d_prob = b.row_prob.to(Device::cpu(), MemCategory::other);
        }
        if (q != r) continue;
        EXPECT_EQ(B.y.to_floats(), R.y.to_floats()) << "y on rank " << r;
        EXPECT_EQ(B.d_x.to_floats(), R.d_x.to_floats()) << "d_x on rank " << r;
        if (with_prob) EXPECT_EQ(B.d_prob.to_floats(), R.d_prob.to_floats()) << "d_row_prob on rank " << r;
      }
      EXPECT_EQ(B.d_wgu.to_floats(), dwgu_ref.narrow(r * El, El).to_floats()) << "d_w_gate_up of the local experts";
      EXPECT_EQ(B.d_wd.to_floats(), dwd_ref.narrow(r * El, El).to_floats()) << "d_w_down of the local experts";
    }
  }
}

// chunked_alltoall:N against alltoall. grouped experts: bit for bit (the same arithmetic per
// row; the saved tensors and the wgrad are alltoall's, in alltoall's layout). sequential: each
// chunk's BLAS GEMMs have fewer rows, and OpenBLAS's NT kernels round differently with M, so
// forward and data gradients differ by a few fp32 ulps: bound max |a - b| / max |b| <= 1e-6
// (measured below 3e-7); the weight gradient sums the rows in alltoall's order over these
// inputs, the same bound.
TEST(Dispatch, ChunkedEqualsAllToAll) {
  if (!test::device().is_cpu()) GTEST_SKIP() << "bit-exact CPU arithmetic (GPU kernels accumulate atomically)";
  comm::GroupPtr g = world();
  const int P = g->size(), r = g->rank();
  double worst = 0;
  for (bool with_prob : {false, true}) {
    LayerCase c = make_case(4 * P, with_prob);
    const int64_t El = c.E / P;
    Tensor wgu = c.wgu_full.narrow(r * El, El), wd = c.wd_full.narrow(r * El, El);
    for (ExpertsImpl impl : {ExpertsImpl::grouped, ExpertsImpl::sequential}) {
      auto a2a = make("alltoall", c.E, g);
      LayerRun B = run_layer(*a2a, impl, c.x, c.prob, c.counts, wgu, wd, c.dy);
      for (int n = 1; n <= 4; ++n) {
        SCOPED_TRACE(std::string(impl == ExpertsImpl::grouped ? "grouped" : "sequential") + " chunks " +
                     std::to_string(n) + (with_prob ? " +prob" : ""));
        auto ch = make("chunked_alltoall:" + std::to_string(n), c.E, g);
        LayerRun A = run_layer(*ch, impl, c.x, c.prob, c.counts, wgu, wd, c.dy);
        if (impl == ExpertsImpl::grouped || n == 1) {
          EXPECT_EQ(A.y.to_floats(), B.y.to_floats());
          EXPECT_EQ(A.d_x.to_floats(), B.d_x.to_floats());
          if (with_prob) EXPECT_EQ(A.d_prob.to_floats(), B.d_prob.to_floats());
          EXPECT_EQ(A.d_wgu.to_floats(), B.d_wgu.to_floats());
          EXPECT_EQ(A.d_wd.to_floats(), B.d_wd.to_floats());
        } else {
          for (auto [a, b, what] : {std::tuple{A.y, B.y, "y"}, {A.d_x, B.d_x, "d_x"}, {A.d_wgu, B.d_wgu, "d_w_gate_up"},
                                    {A.d_wd, B.d_wd, "d_w_down"}}) {
            const double e = max_rel(a, b);
            worst = std::max(worst, e);
            EXPECT_LE(e, 1e-6) << what;
          }
          if (with_prob) EXPECT_LE(max_rel(A.d_prob, B.d_prob), 1e-6);
        }
      }
    }
  }
  if (r == 0) std::printf("[chunked vs alltoall] sequential experts: max relative difference %.2e\n", worst);
}

// forward_for_backward (the recompute of a layer whose output is unused): the same dispatch
// and the same state as forward, bit for bit (rows, row_prob, gate_up, act, counts), so the
// backward from it gives forward's gradients exactly; the experts ran their rebuild (no fc2) once
// per chunk and no combine was posted. Every member, with and without row_prob, both experts.
TEST(Dispatch, ForwardForBackwardRebuildsTheStateWithoutFc2OrCombine) {
  comm::GroupPtr g = world();
  const int P = g->size(), r = g->rank();
  for (bool with_prob : {false, true}) {
    LayerCase c = make_case(4 * P, with_prob);
    const int64_t El = c.E / P;
    Tensor wgu = c.wgu_full.narrow(r * El, El), wd = c.wd_full.narrow(r * El, El);
    for (ExpertsImpl impl : {ExpertsImpl::grouped, ExpertsImpl::sequential})
      for (const char* member : kMembers) {
        SCOPED_TRACE(std::string(member) + (impl == ExpertsImpl::grouped ? " grouped" : " sequential") +
                     (with_prob ? " +prob" : ""));
        const Choice<DispatcherFactory> ch = moe_dispatch_family().parse(member, "test");
        const int64_t chunks = std::string(member).rfind("chunked", 0) == 0 ? std::max<int64_t>(1, ch.count) : 1;
        auto d = make(member, c.E, g);
        Tensor dwgu = Tensor::zeros(wgu.shape(), DType::f32, wgu.device(), MemCategory::other);
        Tensor dwd = Tensor::zeros(wd.shape(), DType::f32, wd.device(), MemCategory::other);
        const ExpertCalls calls = real_experts(impl, wgu, wd, dwgu, dwd);
        DispatchState fwd, re;
        Tensor y = d->forward(c.x, c.prob, c.counts, calls, fwd);
        const DispatchCounts after_forward = d->counts();
        EXPECT_EQ(after_forward.expert_forwards, chunks);
        EXPECT_EQ(after_forward.combines, chunks);
        d->forward_for_backward(c.x, c.prob, c.counts, calls, re);
        const DispatchCounts& n = d->counts();
        EXPECT_EQ(n.forwards, 1);
        EXPECT_EQ(n.forwards_for_backward, 1);
        EXPECT_EQ(n.expert_forwards, chunks) << "forward_for_backward ran the experts' fc2";
        EXPECT_EQ(n.expert_rebuilds, chunks);
        EXPECT_EQ(n.combines, chunks) << "forward_for_backward posted a combine";
        EXPECT_EQ(re.tokens_per_local_expert, fwd.tokens_per_local_expert);
        EXPECT_EQ(re.rows.to_floats(), fwd.rows.to_floats());
        EXPECT_EQ(re.row_prob.defined(), fwd.row_prob.defined());
        if (with_prob) EXPECT_EQ(re.row_prob.to_floats(), fwd.row_prob.to_floats());
        EXPECT_EQ(re.experts.gate_up.to_floats(), fwd.experts.gate_up.to_floats());
        EXPECT_EQ(re.experts.act.to_floats(), fwd.experts.act.to_floats());
        fwd = DispatchState{};
        re = DispatchState{};
        if (!test::device().is_cpu()) continue;  // the gradients: bit-exact CPU arithmetic below
        LayerRun A = run_layer(*make(member, c.E, g), impl, c.x, c.prob, c.counts, wgu, wd, c.dy);
        LayerRun B = run_layer(*make(member, c.E, g), impl, c.x, c.prob, c.counts, wgu, wd, c.dy, /*rebuild=*/true);
        EXPECT_EQ(A.y.to_floats(), y.to(Device::cpu(), MemCategory::other).to_floats());
        EXPECT_EQ(A.d_x.to_floats(), B.d_x.to_floats());
        if (with_prob) EXPECT_EQ(A.d_prob.to_floats(), B.d_prob.to_floats());
        EXPECT_EQ(A.d_wgu.to_floats(), B.d_wgu.to_floats());
        EXPECT_EQ(A.d_wd.to_floats(), B.d_wd.to_floats());
      }
  }
}

// Layouts a dispatcher cannot serve are refused when it is built, naming the fix.
TEST(Dispatch, BadLayoutsAreClearErrors) {
  comm::GroupPtr g = world();
  const int P = g->size();
  if (P > 1) {
    for (const char* m : {"allgather", "alltoall", "chunked_alltoall:2"})
      test::expect_error_contains([&] { make(m, P + 1, g); },
                                  "does not divide the model's " + std::to_string(P + 1) +
                                      " routed experts; choose parallel.ep among the divisors");
  }
  DispatcherConfig dc;
  dc.num_experts = 4 * P;  // divisible by the group: the chunk count is what is wrong
  dc.group = g;
  dc.num_chunks = kMaxDispatchChunks + 1;
  test::expect_error_contains([&] { make_chunked_alltoall_dispatcher(dc); }, "the chunk count must be in [1, 64]");
  // Inputs that do not match the counts.
  auto d = make("alltoall", 2 * P, g);
  DispatchState st;
  FakeExperts fx;
  test::expect_error_contains(
      [&] { d->forward(on_dev(Tensor::zeros({3, 3}, DType::f32, Device::cpu(), MemCategory::other)), Tensor(),
                       std::vector<int64_t>(static_cast<size_t>(2 * P), 0), fx.calls(), st); },
      "tokens_per_expert sums to 0 but x_perm is");
}

}  // namespace
}  // namespace bb

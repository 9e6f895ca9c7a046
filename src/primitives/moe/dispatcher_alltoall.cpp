// dispatcher_alltoall.cpp — the `alltoall` and `chunked_alltoall:N` dispatchers (dispatcher.h):
// one class, `alltoall` being the single chunk.
//
// Plan of one micro-batch (P ranks, E_l local experts, c[e] this rank's rows per global expert,
// r[q][j] the rows peer q sends for local expert j):
//   counts   one host all-to-all: c[p E_l + j] goes to peer p, r[q][j] arrives from peer q
//   chunks   every run of rows (to peer p for expert e, of length c[e]; from peer q for local
//            expert j, of length r[q][j]) is cut the same way on both sides: chunk k takes rows
//            [k len / N, (k + 1) len / N) of it, so the receiver knows every chunk's size
//            without another exchange
//   send     chunk k's rows of x_perm (per global expert, so already in peer order) are one
//            all-to-all-v; alltoall sends x_perm itself (no copy)
//   receive  peer-major [q][j]; sorted to expert-major [j][q] for the experts (the "grouped by
//            local expert" layout of dispatcher.h); the combine undoes both steps
// The whole micro-batch's expert inputs and saved tensors are kept in alltoall's layout
// (expert j: peer 0's rows, peer 1's rows, ...), whatever the chunking, so the delayed weight
// gradient sees exactly alltoall's tensors.
//
// Order of work (forward): post every chunk's dispatch; then per chunk wait for it, run its
// experts, post its combine; then wait for the combines and place the rows. forward_for_backward
// (a recompute whose output is unused): the same dispatches and state, the experts' rebuild
// (fc1 + activation, no fc2) per chunk, no combine. Backward: post
// every chunk's combine-backward; per chunk wait, run its expert dgrad, post its
// dispatch-backward; run the whole micro-batch's expert wgrad; wait and place. On a GPU the
// collectives run on the comm stream (comm.h), so chunk c+1's dispatch and chunk c-1's combine
// travel while chunk c's GEMMs run on the compute stream, and the wgrad GEMMs cover the last
// dispatch-backward. On CPU ranks the same calls are made (MPI's non-blocking collectives), the
// results are what counts.
#include <numeric>

#include "core/error.h"
#include "core/trace.h"
#include "primitives/moe/dispatcher.h"
#include "primitives/moe/dispatcher_rows.h"

namespace bb {

namespace {

using dispatch::RowRun;

struct AllToAllPlan final : DispatchPlan {
  struct Chunk {
    std::vector<int64_t> send_peer, recv_peer;  // [P] rows to / from each peer
    std::vector<int64_t> local_counts;          // [E_l] rows per local expert in this chunk
    int64_t num_send = 0, num_recv = 0;
    std::vector<RowRun> gather;    // x_perm -> send buffer (chunked only)
    std::vector<RowRun> sort;      // receive buffer (peer-major) -> chunk rows (expert-major)
    std::vector<RowRun> to_whole;  // chunk rows -> the whole micro-batch's layout (chunked only)
  };
  int64_t num_rows = 0;  // N, this rank's x_perm rows
  std::vector<int64_t> local_counts;  // [E_l] the whole micro-batch's rows per local expert
  std::vector<Chunk> chunks;
};

class AllToAllDispatcher final : public Dispatcher {
 public:
  AllToAllDispatcher(const DispatcherConfig& cfg, const char* name)
      : name_(name), group_(cfg.group ? cfg.group : comm::self_group("ep")), num_experts_(cfg.num_experts),
        num_chunks_(cfg.num_chunks), wgrad_stream_(cfg.wgrad_stream) {
    cfg.validate(name);
    P_ = group_->size();
    El_ = num_experts_ / P_;
  }
  const char* name() const override { return name_; }
  int64_t num_local_experts(int64_t num_experts) const override {
    check_model(num_experts);
    return El_;
  }
  int64_t first_local_expert(int64_t num_experts) const override {
    check_model(num_experts);
    return group_->rank() * El_;
  }

  Tensor forward(const Tensor& x_perm, const Tensor& row_prob, const std::vector<int64_t>& tokens_per_expert,
                 const ExpertCalls& experts, DispatchState& state) override {
    BB_RANGE("dispatch_alltoall_forward");
    ++counts_.forwards;
    return run(x_perm, row_prob, tokens_per_expert, experts, state, /*combine=*/true);
  }
  void forward_for_backward(const Tensor& x_perm, const Tensor& row_prob,
                            const std::vector<int64_t>& tokens_per_expert, const ExpertCalls& experts,
                            DispatchState& state) override {
    BB_RANGE("dispatch_alltoall_forward_for_backward");
    ++counts_.forwards_for_backward;
    run(x_perm, row_prob, tokens_per_expert, experts, state, /*combine=*/false);
  }
  DispatchRows backward(const Tensor& d_y_perm, const ExpertCalls& experts, DispatchState& state) override;

 private:
  void check_model(int64_t num_experts) const {
    BB_CHECK(num_experts == num_experts_, name_, ": built for ", num_experts_, " experts, asked about ",
             num_experts);
  }
  std::shared_ptr<AllToAllPlan> make_plan(const std::vector<int64_t>& counts) const;
  // forward (combine = true) or forward_for_backward (combine = false: ExpertCalls::rebuild per
  // chunk, no combine posted, returns undefined); the dispatch and the state are the same.
  Tensor run(const Tensor& x_perm, const Tensor& row_prob, const std::vector<int64_t>& tokens_per_expert,
             const ExpertCalls& experts, DispatchState& state, bool combine);

  const char* name_;
  comm::GroupPtr group_;
  int64_t num_experts_, num_chunks_;
  bool wgrad_stream_;
  int64_t P_ = 1, El_ = 0;
};

std::shared_ptr<AllToAllPlan> AllToAllDispatcher::make_plan(const std::vector<int64_t>& c) const {
  const int64_t P = P_, El = El_, N = num_chunks_, E = num_experts_;
  // r[q * El + j]: rows peer q sends for local expert j. c is already in peer order.
  std::vector<int64_t> r(static_cast<size_t>(E));
  {
    BB_RANGE("dispatch_counts");
    group_->all_to_all_host(c.data(), r.data(), El);
  }
  auto R = [&](int64_t q, int64_t j) { return r[static_cast<size_t>(q * El + j)]; };
  auto plan = std::make_shared<AllToAllPlan>();
  std::vector<int64_t> x_off(static_cast<size_t>(E) + 1, 0);  // x_perm row of global expert e
  for (size_t e = 0; e < static_cast<size_t>(E); ++e) x_off[e + 1] = x_off[e] + c[e];
  plan->num_rows = x_off.back();
  plan->local_counts.assign(static_cast<size_t>(El), 0);
  for (int64_t j = 0; j < El; ++j)
    for (int64_t q = 0; q < P; ++q) plan->local_counts[static_cast<size_t>(j)] += R(q, j);
  // whole[j * P + q]: first row of peer q's run for expert j in the whole (alltoall) layout.
  std::vector<int64_t> whole(static_cast<size_t>(El * P));
  for (int64_t j = 0, at = 0; j < El; ++j)
    for (int64_t q = 0; q < P; ++q) {
      whole[static_cast<size_t>(j * P + q)] = at;
      at += R(q, j);
    }
  plan->chunks.resize(static_cast<size_t>(N));
  for (int64_t k = 0; k < N; ++k) {
    AllToAllPlan::Chunk& ch = plan->chunks[static_cast<size_t>(k)];
    ch.send_peer.assign(static_cast<size_t>(P), 0);
    ch.recv_peer.assign(static_cast<size_t>(P), 0);
    ch.local_counts.assign(static_cast<size_t>(El), 0);
    // Send side: per global expert (peer order), chunk k of its run.
    for (int64_t e = 0; e < E; ++e) {
      const int64_t ce = c[static_cast<size_t>(e)], n = dispatch::chunk_len(ce, k, N);
      if (N > 1) ch.gather.push_back({ch.num_send, x_off[static_cast<size_t>(e)] + dispatch::chunk_begin(ce, k, N), n});
      ch.send_peer[static_cast<size_t>(e / El)] += n;
      ch.num_send += n;
    }
    // Receive side: peer-major in the buffer, expert-major in the chunk's rows.
    std::vector<int64_t> recv_at(static_cast<size_t>(El * P));  // [q * El + j]
    for (int64_t q = 0, at = 0; q < P; ++q)
      for (int64_t j = 0; j < El; ++j) {
        const int64_t n = dispatch::chunk_len(R(q, j), k, N);
        recv_at[static_cast<size_t>(q * El + j)] = at;
        at += n;
        ch.recv_peer[static_cast<size_t>(q)] += n;
        ch.local_counts[static_cast<size_t>(j)] += n;
        ch.num_recv += n;
      }
    for (int64_t j = 0, at = 0; j < El; ++j)
      for (int64_t q = 0; q < P; ++q) {
        const int64_t len = R(q, j), n = dispatch::chunk_len(len, k, N);
        ch.sort.push_back({at, recv_at[static_cast<size_t>(q * El + j)], n});
        if (N > 1)
          ch.to_whole.push_back({whole[static_cast<size_t>(j * P + q)] + dispatch::chunk_begin(len, k, N), at, n});
        at += n;
      }
  }
  return plan;
}

// An all-to-all-v in flight: the buffer it fills and its Work.
struct Flight {
  Tensor out;
  comm::WorkPtr work;
  void wait() {
    if (work) work->wait();
    work.reset();
  }
};

Tensor AllToAllDispatcher::run(const Tensor& x_perm, const Tensor& row_prob,
                               const std::vector<int64_t>& tokens_per_expert, const ExpertCalls& experts,
                               DispatchState& state, bool combine) {
  dispatch::check_dispatch_inputs(name_, x_perm, row_prob, tokens_per_expert, num_experts_);
  std::shared_ptr<const AllToAllPlan> plan;
  if (state.plan) {  // the training forward's (a recompute): no second count exchange
    plan = std::dynamic_pointer_cast<const AllToAllPlan>(state.plan);
    BB_CHECK(plan && plan->num_rows == x_perm.size(0) && plan->chunks.size() == static_cast<size_t>(num_chunks_),
             name_, ": the plan handed to this forward was not made by this dispatcher for these rows");
    ++counts_.plans_reused;
  } else {
    plan = make_plan(tokens_per_expert);
    ++counts_.plans;
  }
  const bool chunked = num_chunks_ > 1, with_prob = row_prob.defined();
  const size_t N = plan->chunks.size();
  comm::Group& g = *group_;

  // Every chunk's dispatch is posted before any expert runs.
  std::vector<Flight> rows_in(N), prob_in(N);
  for (size_t k = 0; k < N; ++k) {
    const AllToAllPlan::Chunk& ch = plan->chunks[k];
    Tensor send = chunked ? dispatch::gather_rows(x_perm, ch.gather, ch.num_send) : x_perm;
    rows_in[k].out = dispatch::rows_like(x_perm, ch.num_recv);
    rows_in[k].work = g.all_to_all_v(send, ch.send_peer, rows_in[k].out, ch.recv_peer, Stream::ep);
    if (with_prob) {
      Tensor sp = chunked ? dispatch::gather_rows(row_prob, ch.gather, ch.num_send) : row_prob;
      prob_in[k].out = dispatch::rows_like(row_prob, ch.num_recv);
      prob_in[k].work = g.all_to_all_v(sp, ch.send_peer, prob_in[k].out, ch.recv_peer, Stream::ep);
    }
  }

  const int64_t M = std::accumulate(plan->local_counts.begin(), plan->local_counts.end(), int64_t{0});
  if (chunked) {
    state.rows = dispatch::rows_like(x_perm, M);
    state.row_prob = with_prob ? dispatch::rows_like(row_prob, M) : Tensor();
    state.experts = ExpertsSaved{};
  }
  // Per chunk: its experts, then its combine (none when only the state is rebuilt).
  std::vector<Flight> back(N);
  for (size_t k = 0; k < N; ++k) {
    const AllToAllPlan::Chunk& ch = plan->chunks[k];
    rows_in[k].wait();
    prob_in[k].wait();
    Tensor rows = dispatch::gather_rows(rows_in[k].out, ch.sort, ch.num_recv);
    Tensor prob = with_prob ? dispatch::gather_rows(prob_in[k].out, ch.sort, ch.num_recv) : Tensor();
    rows_in[k] = Flight{};
    prob_in[k] = Flight{};
    ExpertsSaved saved;
    Tensor y;
    if (combine) {
      ++counts_.expert_forwards;
      y = experts.forward(rows, prob, ch.local_counts, &saved);
    } else {
      ++counts_.expert_rebuilds;
      experts.rebuild(rows, prob, ch.local_counts, &saved);
    }
    BB_CHECK(!combine ||
                 (y.defined() && y.dim() == 2 && y.size(0) == ch.num_recv && y.size(1) == x_perm.size(1)),
             name_,
             ": the experts returned ", y.defined() ? y.str() : std::string("nothing"), " for ", ch.num_recv,
             " rows of width ", x_perm.size(1));
    if (chunked) {
      if (!state.experts.gate_up.defined()) {
        state.experts.gate_up = dispatch::rows_like(saved.gate_up, M);
        state.experts.act = dispatch::rows_like(saved.act, M);
      }
      dispatch::copy_rows(state.rows, rows, ch.to_whole);
      if (with_prob) dispatch::copy_rows(state.row_prob, prob, ch.to_whole);
      dispatch::copy_rows(state.experts.gate_up, saved.gate_up, ch.to_whole);
      dispatch::copy_rows(state.experts.act, saved.act, ch.to_whole);
    } else {
      state.rows = rows;
      state.row_prob = prob;
      state.experts = saved;
    }
    if (!combine) continue;
    ++counts_.combines;
    Tensor send = dispatch::gather_rows(y, dispatch::reversed(ch.sort), ch.num_recv);
    back[k].out = dispatch::rows_like(y, ch.num_send);
    back[k].work = g.all_to_all_v(send, ch.recv_peer, back[k].out, ch.send_peer, Stream::ep);
  }

  state.tokens_per_local_expert = plan->local_counts;
  state.plan = plan;
  if (!combine) return Tensor();
  Tensor y_perm;
  for (size_t k = 0; k < N; ++k) {
    back[k].wait();
    if (!chunked) {
      y_perm = back[k].out;
      continue;
    }
    if (!y_perm.defined()) y_perm = dispatch::rows_like(back[k].out, plan->num_rows);
    dispatch::copy_rows(y_perm, back[k].out, dispatch::reversed(plan->chunks[k].gather));
  }
  return y_perm;
}

DispatchRows AllToAllDispatcher::backward(const Tensor& d_y_perm, const ExpertCalls& experts, DispatchState& state) {
  BB_RANGE("dispatch_alltoall_backward");
  const auto* plan = dynamic_cast<const AllToAllPlan*>(state.plan.get());
  BB_CHECK(plan, name_, " backward: the state was not filled by this dispatcher's forward");
  BB_CHECK(d_y_perm.defined() && d_y_perm.dim() == 2 && d_y_perm.size(0) == plan->num_rows, name_,
           " backward: d_y_perm is ", d_y_perm.defined() ? d_y_perm.str() : std::string("undefined"),
           ", the forward had ", plan->num_rows, " rows");
  const bool chunked = num_chunks_ > 1, with_prob = state.row_prob.defined();
  const size_t N = plan->chunks.size();
  comm::Group& g = *group_;
  const int64_t M = state.num_rows();

  // The combine's backward moves rows like the dispatch: every chunk posted first.
  std::vector<Flight> grads_in(N);
  for (size_t k = 0; k < N; ++k) {
    const AllToAllPlan::Chunk& ch = plan->chunks[k];
    Tensor send = chunked ? dispatch::gather_rows(d_y_perm, ch.gather, ch.num_send) : d_y_perm;
    grads_in[k].out = dispatch::rows_like(d_y_perm, ch.num_recv);
    grads_in[k].work = g.all_to_all_v(send, ch.send_peer, grads_in[k].out, ch.recv_peer, Stream::ep);
  }

  Tensor d_local, d_gate_up;  // the whole micro-batch's, for the weight gradient
  std::vector<Flight> dx_back(N), dp_back(N);
  for (size_t k = 0; k < N; ++k) {
    const AllToAllPlan::Chunk& ch = plan->chunks[k];
    grads_in[k].wait();
    Tensor d_y = dispatch::gather_rows(grads_in[k].out, ch.sort, ch.num_recv);
    grads_in[k] = Flight{};
    // This chunk's saved tensors (views of the whole ones for a single chunk).
    const std::vector<RowRun> from_whole = dispatch::reversed(ch.to_whole);
    ExpertsSaved saved = state.experts;
    Tensor prob = state.row_prob;
    if (chunked) {
      saved.gate_up = dispatch::gather_rows(state.experts.gate_up, from_whole, ch.num_recv);
      saved.act = dispatch::gather_rows(state.experts.act, from_whole, ch.num_recv);
      if (with_prob) prob = dispatch::gather_rows(state.row_prob, from_whole, ch.num_recv);
    }
    ExpertsDgrad dg = experts.backward_data(d_y, prob, ch.local_counts, saved);
    if (chunked) {
      if (!d_local.defined()) {
        d_local = dispatch::rows_like(d_y, M);
        d_gate_up = dispatch::rows_like(dg.d_gate_up, M);
      }
      dispatch::copy_rows(d_local, d_y, ch.to_whole);
      dispatch::copy_rows(d_gate_up, dg.d_gate_up, ch.to_whole);
    } else {
      d_local = d_y;
      d_gate_up = dg.d_gate_up;
    }
    const std::vector<RowRun> unsort = dispatch::reversed(ch.sort);
    Tensor send = dispatch::gather_rows(dg.d_x, unsort, ch.num_recv);
    dx_back[k].out = dispatch::rows_like(dg.d_x, ch.num_send);
    dx_back[k].work = g.all_to_all_v(send, ch.recv_peer, dx_back[k].out, ch.send_peer, Stream::ep);
    if (with_prob) {
      Tensor sp = dispatch::gather_rows(dg.d_row_prob, unsort, ch.num_recv);
      dp_back[k].out = dispatch::rows_like(dg.d_row_prob, ch.num_send);
      dp_back[k].work = g.all_to_all_v(sp, ch.recv_peer, dp_back[k].out, ch.send_peer, Stream::ep);
    }
  }
  // The weight gradient of the whole micro-batch, while the last dispatch-backward travels (on
  // the wgrad stream with wgrad_stream_: also while the compute stream goes on).
  dispatch::expert_wgrad(wgrad_stream_, experts, d_local, state.rows, state.row_prob, state.tokens_per_local_expert,
                         state.experts, d_gate_up);
  d_local = d_gate_up = Tensor();

  DispatchRows out;
  for (size_t k = 0; k < N; ++k) {
    dx_back[k].wait();
    dp_back[k].wait();
    if (!chunked) {
      out.rows = dx_back[k].out;
      out.row_prob = dp_back[k].out;
      continue;
    }
    const std::vector<RowRun> place = dispatch::reversed(plan->chunks[k].gather);
    if (!out.rows.defined()) {
      out.rows = dispatch::rows_like(dx_back[k].out, plan->num_rows);
      if (with_prob) out.row_prob = dispatch::rows_like(dp_back[k].out, plan->num_rows);
    }
    dispatch::copy_rows(out.rows, dx_back[k].out, place);
    if (with_prob) dispatch::copy_rows(out.row_prob, dp_back[k].out, place);
  }
  return out;
}

}  // namespace

std::unique_ptr<Dispatcher> make_alltoall_dispatcher(const DispatcherConfig& cfg) {
  DispatcherConfig c = cfg;
  c.num_chunks = 1;
  if (c.group_size() == 1) return make_single_rank_dispatcher(c);
  return std::make_unique<AllToAllDispatcher>(c, "alltoall");
}

std::unique_ptr<Dispatcher> make_chunked_alltoall_dispatcher(const DispatcherConfig& cfg) {
  return std::make_unique<AllToAllDispatcher>(cfg, "chunked_alltoall");
}

}  // namespace bb

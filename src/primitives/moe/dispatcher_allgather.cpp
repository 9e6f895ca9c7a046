// dispatcher_allgather.cpp — the `allgather` dispatcher, the family baseline (dispatcher.h).
//
// Every rank of the EP group (P ranks) learns every rank's per-expert counts (a host all-reduce
// of a [P, E] table with one row per rank), all-gathers every rank's x_perm rows, and keeps the
// runs of its own experts in the common layout (expert j: rank 0's rows, rank 1's rows, ...).
// The experts' outputs go back by a reduce-scatter over a zero-filled [P, N_max, H] buffer in
// which each rank writes only its experts' rows: every output row has exactly one nonzero
// contribution, so the sum is exact (x + 0 = x) and the combine equals a pure data movement.
// Backward: all-gather of d_y_perm (the combine's backward), reduce-scatter of d_x and
// d_row_prob (the dispatch's backward), the experts' wgrad while the reduce-scatters travel.
// forward_for_backward: the same all-gathers and state, the experts' rebuild (no fc2), no
// reduce-scatter.
// Simple and exact, but it moves P times the rows of alltoall (skills/dispatcher.md).
#include "core/error.h"
#include "core/trace.h"
#include "primitives/moe/dispatcher.h"
#include "primitives/moe/dispatcher_rows.h"

namespace bb {

namespace {

using dispatch::RowRun;

struct AllGatherPlan final : DispatchPlan {
  std::vector<int64_t> rows_of_rank;  // [P] N_q
  int64_t num_gathered = 0, max_rows = 0, my_rows = 0;
  std::vector<int64_t> local_counts;  // [E_l]
  std::vector<RowRun> select;  // gathered rows -> this rank's expert rows
  std::vector<RowRun> place;   // expert rows -> the [P x max_rows] reduce-scatter buffer
};

class AllGatherDispatcher final : public Dispatcher {
 public:
  explicit AllGatherDispatcher(const DispatcherConfig& cfg)
      : group_(cfg.group), num_experts_(cfg.num_experts), wgrad_stream_(cfg.wgrad_stream) {
    cfg.validate("allgather");
    BB_CHECK(group_, "allgather: no expert-parallel group");
    P_ = group_->size();
    El_ = num_experts_ / P_;
  }
  const char* name() const override { return "allgather"; }
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
    BB_RANGE("dispatch_allgather_forward");
    ++counts_.forwards;
    return run(x_perm, row_prob, tokens_per_expert, experts, state, /*combine=*/true);
  }
  void forward_for_backward(const Tensor& x_perm, const Tensor& row_prob,
                            const std::vector<int64_t>& tokens_per_expert, const ExpertCalls& experts,
                            DispatchState& state) override {
    BB_RANGE("dispatch_allgather_forward_for_backward");
    ++counts_.forwards_for_backward;
    run(x_perm, row_prob, tokens_per_expert, experts, state, /*combine=*/false);
  }

  DispatchRows backward(const Tensor& d_y_perm, const ExpertCalls& experts, DispatchState& state) override {
    BB_RANGE("dispatch_allgather_backward");
    const auto* plan = dynamic_cast<const AllGatherPlan*>(state.plan.get());
    BB_CHECK(plan, "allgather backward: the state was not filled by this dispatcher's forward");
    BB_CHECK(d_y_perm.defined() && d_y_perm.dim() == 2 && d_y_perm.size(0) == plan->my_rows,
             "allgather backward: d_y_perm is ", d_y_perm.defined() ? d_y_perm.str() : std::string("undefined"),
             ", the forward had ", plan->my_rows, " rows");
    Tensor all = dispatch::rows_like(d_y_perm, plan->num_gathered);
    group_->all_gather_v(d_y_perm, all, plan->rows_of_rank, Stream::ep)->wait();
    Tensor d_local = dispatch::gather_rows(all, plan->select, rows(plan->local_counts));
    all = Tensor();
    const std::vector<int64_t>& counts = state.tokens_per_local_expert;
    ExpertsDgrad dg = experts.backward_data(d_local, state.row_prob, counts, state.experts);
    auto [d_x, work] = scatter_back(dg.d_x, *plan, /*wait=*/false);
    std::pair<Tensor, comm::WorkPtr> d_p;
    if (dg.d_row_prob.defined()) d_p = scatter_back(dg.d_row_prob, *plan, false);
    // The weight gradient while the reduce-scatters travel.
    dispatch::expert_wgrad(wgrad_stream_, experts, d_local, state.rows, state.row_prob, counts, state.experts,
                           dg.d_gate_up);
    work->wait();
    if (d_p.second) d_p.second->wait();
    return {d_x, d_p.first};
  }

 private:
  // forward (combine = true: the experts' forward and the reduce-scatter back) or
  // forward_for_backward (combine = false: the experts' rebuild, nothing goes back).
  Tensor run(const Tensor& x_perm, const Tensor& row_prob, const std::vector<int64_t>& tokens_per_expert,
             const ExpertCalls& experts, DispatchState& state, bool combine) {
    dispatch::check_dispatch_inputs("allgather", x_perm, row_prob, tokens_per_expert, num_experts_);
    std::shared_ptr<const AllGatherPlan> plan;
    if (state.plan) {  // the training forward's (a recompute): no second count exchange
      plan = std::dynamic_pointer_cast<const AllGatherPlan>(state.plan);
      BB_CHECK(plan && plan->my_rows == x_perm.size(0),
               "allgather: the plan handed to this forward was not made by this dispatcher for these rows");
      ++counts_.plans_reused;
    } else {
      plan = make_plan(tokens_per_expert);
      ++counts_.plans;
    }
    comm::Group& g = *group_;
    const bool with_prob = row_prob.defined();
    Tensor all = dispatch::rows_like(x_perm, plan->num_gathered), all_prob;
    comm::WorkPtr w = g.all_gather_v(x_perm, all, plan->rows_of_rank, Stream::ep), wp;
    if (with_prob) {
      all_prob = dispatch::rows_like(row_prob, plan->num_gathered);
      wp = g.all_gather_v(row_prob, all_prob, plan->rows_of_rank, Stream::ep);
    }
    w->wait();
    if (wp) wp->wait();
    const int64_t M = rows(plan->local_counts);
    state.rows = dispatch::gather_rows(all, plan->select, M);
    state.row_prob = with_prob ? dispatch::gather_rows(all_prob, plan->select, M) : Tensor();
    all = all_prob = Tensor();
    state.experts = ExpertsSaved{};
    state.tokens_per_local_expert = plan->local_counts;
    state.plan = plan;
    if (!combine) {
      ++counts_.expert_rebuilds;
      experts.rebuild(state.rows, state.row_prob, plan->local_counts, &state.experts);
      return Tensor();
    }
    ++counts_.expert_forwards;
    Tensor y = experts.forward(state.rows, state.row_prob, plan->local_counts, &state.experts);
    ++counts_.combines;
    return scatter_back(y, *plan).first;
  }

  static int64_t rows(const std::vector<int64_t>& counts) {
    int64_t n = 0;
    for (int64_t c : counts) n += c;
    return n;
  }
  void check_model(int64_t num_experts) const {
    BB_CHECK(num_experts == num_experts_, "allgather: built for ", num_experts_, " experts, asked about ",
             num_experts);
  }

  std::shared_ptr<AllGatherPlan> make_plan(const std::vector<int64_t>& c) const {
    const int64_t P = P_, E = num_experts_, El = El_, me = group_->rank();
    std::vector<int64_t> all(static_cast<size_t>(P * E), 0);  // [q * E + e]
    {
      BB_RANGE("dispatch_counts");
      group_->all_gather_host(c.data(), all.data(), E);
    }
    auto plan = std::make_shared<AllGatherPlan>();
    plan->rows_of_rank.assign(static_cast<size_t>(P), 0);
    std::vector<int64_t> rank_at(static_cast<size_t>(P), 0);  // first gathered row of rank q
    for (int64_t q = 0, at = 0; q < P; ++q) {
      rank_at[static_cast<size_t>(q)] = at;
      for (int64_t e = 0; e < E; ++e) plan->rows_of_rank[static_cast<size_t>(q)] += all[static_cast<size_t>(q * E + e)];
      at += plan->rows_of_rank[static_cast<size_t>(q)];
      plan->max_rows = std::max(plan->max_rows, plan->rows_of_rank[static_cast<size_t>(q)]);
    }
    plan->num_gathered = rank_at.back() + plan->rows_of_rank.back();
    plan->my_rows = plan->rows_of_rank[static_cast<size_t>(me)];
    plan->local_counts.assign(static_cast<size_t>(El), 0);
    // Expert j's rows from rank q sit at rank q's first row + its rows of experts < e.
    for (int64_t j = 0, at = 0; j < El; ++j) {
      const int64_t e = me * El + j;
      for (int64_t q = 0; q < P; ++q) {
        int64_t off = 0;
        for (int64_t e2 = 0; e2 < e; ++e2) off += all[static_cast<size_t>(q * E + e2)];
        const int64_t n = all[static_cast<size_t>(q * E + e)];
        plan->select.push_back({at, rank_at[static_cast<size_t>(q)] + off, n});
        plan->place.push_back({q * plan->max_rows + off, at, n});
        plan->local_counts[static_cast<size_t>(j)] += n;
        at += n;
      }
    }
    return plan;
  }

  // The reduce-scatter back to the rows' owners: local rows [M, ...] -> [N_me, ...] (a view of
  // the [max_rows, ...] result). With wait = false the Work is returned unfinished.
  std::pair<Tensor, comm::WorkPtr> scatter_back(const Tensor& local, const AllGatherPlan& plan,
                                                bool wait = true) const {
    Tensor z = dispatch::rows_like(local, P_ * plan.max_rows, /*zero=*/true);
    dispatch::copy_rows(z, local, plan.place);
    Tensor out = dispatch::rows_like(local, plan.max_rows);
    comm::WorkPtr w = group_->reduce_scatter(z, out, comm::ReduceOp::sum, Stream::ep);
    if (wait) {
      w->wait();
      w.reset();
    }
    return {out.narrow(0, plan.my_rows), w};
  }

  comm::GroupPtr group_;
  int64_t num_experts_;
  bool wgrad_stream_;
  int64_t P_ = 1, El_ = 0;
};

}  // namespace

std::unique_ptr<Dispatcher> make_allgather_dispatcher(const DispatcherConfig& cfg) {
  if (cfg.group_size() == 1) return make_single_rank_dispatcher(cfg);
  return std::make_unique<AllGatherDispatcher>(cfg);
}

}  // namespace bb

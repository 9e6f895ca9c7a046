// dispatcher.cpp — the single-rank dispatcher (every expert local: the experts run on x_perm
// itself, nothing is copied), the config checks and the row-run helpers the multi-rank members
// share (dispatcher_rows.h).
#include "primitives/moe/dispatcher.h"

#include "core/error.h"
#include "primitives/moe/dispatcher_rows.h"

#include <climits>

#ifdef BB_WITH_CUDA
#include "backend/cuda/row_runs.h"
#endif

namespace bb {

namespace dispatch {

std::vector<RowRun> reversed(const std::vector<RowRun>& runs) {
  std::vector<RowRun> out;
  out.reserve(runs.size());
  for (const RowRun& r : runs) out.push_back({r.src, r.dst, r.n});
  return out;
}

Tensor rows_like(const Tensor& like, int64_t rows, bool zero) {
  Shape s = like.shape();
  BB_CHECK(!s.empty(), "dispatcher: a 0-d tensor has no rows");
  s[0] = rows;
  return zero ? Tensor::zeros(s, like.dtype(), like.device(), like.category())
              : Tensor::empty(s, like.dtype(), like.device(), like.category());
}

void copy_rows(const Tensor& dst, const Tensor& src, const std::vector<RowRun>& runs) {
  // Adjacent runs (contiguous on both sides) are merged into one copy.
  std::vector<RowRun> merged;
  size_t i = 0;
  while (i < runs.size()) {
    RowRun r = runs[i++];
    while (i < runs.size() && runs[i].dst == r.dst + r.n && runs[i].src == r.src + r.n) r.n += runs[i++].n;
    if (r.n > 0) merged.push_back(r);
  }
#ifdef BB_WITH_CUDA
  // On a GPU, more than a few runs go as one kernel over a small uploaded run table (one
  // cudaMemcpyAsync per run costs microseconds each, and a chunked dispatch has thousands).
  constexpr size_t kKernelRuns = 4;
  if (dst.device().is_cuda() && merged.size() > kKernelRuns) {
    BB_CHECK(src.device() == dst.device() && src.dtype() == dst.dtype() &&
                 src.numel() * dst.size(0) == dst.numel() * src.size(0),
             "dispatch copy_rows: ", src.str(), " and ", dst.str(), " differ in device, dtype or row size");
    const auto R = static_cast<int64_t>(merged.size());
    std::vector<int32_t> table(static_cast<size_t>(3 * R + 1));
    int64_t total = 0;
    for (int64_t r = 0; r < R; ++r) {
      const RowRun& m = merged[static_cast<size_t>(r)];
      BB_CHECK(m.dst >= 0 && m.src >= 0 && m.dst + m.n <= dst.size(0) && m.src + m.n <= src.size(0),
               "dispatch copy_rows: run (dst ", m.dst, ", src ", m.src, ", ", m.n, " rows) outside ", dst.str(),
               " / ", src.str());
      table[static_cast<size_t>(r)] = static_cast<int32_t>(total);
      table[static_cast<size_t>(R + 1 + r)] = static_cast<int32_t>(m.dst);
      table[static_cast<size_t>(2 * R + 1 + r)] = static_cast<int32_t>(m.src);
      total += m.n;
    }
    BB_CHECK(total < INT32_MAX && dst.size(0) < INT32_MAX && src.size(0) < INT32_MAX,
             "dispatch copy_rows: more than 2^31 rows");
    table[static_cast<size_t>(R)] = static_cast<int32_t>(total);
    const Tensor t = Tensor::from_ints(table, {3 * R + 1}, MemCategory::workspace).to(dst.device(), MemCategory::workspace);
    const int64_t row_bytes = dst.size(0) > 0 ? static_cast<int64_t>(dst.nbytes()) / dst.size(0) : 0;
    cuda::copy_row_runs(dst.raw(), src.raw(), t.data<int32_t>(), R, total, row_bytes);
    return;
  }
#endif
  for (const RowRun& r : merged) {
    Tensor d = dst.narrow(r.dst, r.n);
    d.copy_from(src.narrow(r.src, r.n));
  }
}

Tensor gather_rows(const Tensor& src, const std::vector<RowRun>& runs, int64_t rows) {
  if (rows == src.size(0)) {
    bool identity = true;
    int64_t covered = 0;
    for (const RowRun& r : runs) {
      if (r.n == 0) continue;
      identity = identity && r.dst == r.src;
      covered += r.n;
    }
    if (identity && covered == rows) return src;
  }
  Tensor out = rows_like(src, rows);
  copy_rows(out, src, runs);
  return out;
}

void check_dispatch_inputs(const char* who, const Tensor& x_perm, const Tensor& row_prob,
                           const std::vector<int64_t>& tokens_per_expert, int64_t num_experts) {
  BB_CHECK(static_cast<int64_t>(tokens_per_expert.size()) == num_experts, who, " dispatch: ",
           tokens_per_expert.size(), " expert counts for a model of ", num_experts, " experts");
  int64_t n = 0;
  for (int64_t c : tokens_per_expert) {
    BB_CHECK(c >= 0, who, " dispatch: negative expert count ", c);
    n += c;
  }
  BB_CHECK(x_perm.defined() && x_perm.dim() == 2 && n == x_perm.size(0), who,
           " dispatch: tokens_per_expert sums to ", n, " but x_perm is ",
           x_perm.defined() ? x_perm.str() : std::string("undefined"));
  if (row_prob.defined())
    BB_CHECK(row_prob.dtype() == DType::f32 && row_prob.dim() == 1 && row_prob.size(0) == n &&
                 row_prob.device() == x_perm.device(),
             who, " dispatch: row_prob ", row_prob.str(), " must be f32 [", n, "] on ",
             x_perm.device().str());
}

void expert_wgrad(bool side, const ExpertCalls& experts, const Tensor& d_y, const Tensor& rows, const Tensor& row_prob,
                  const std::vector<int64_t>& counts, const ExpertsSaved& saved, const Tensor& d_gate_up) {
  if (!side) {
    experts.backward_weight(d_y, rows, row_prob, counts, saved, d_gate_up);
    return;
  }
  const Device dev = d_y.device();
  const Stream from = current_stream();
  if (from != Stream::wgrad) Event::record(dev, from).wait(Stream::wgrad);
  StreamScope on(Stream::wgrad);
  experts.backward_weight(d_y, rows, row_prob, counts, saved, d_gate_up);
  for (const Tensor* t : {&d_y, &rows, &row_prob, &saved.gate_up, &saved.act, &d_gate_up})
    if (t->defined()) t->record_stream(Stream::wgrad);
}

}  // namespace dispatch

void DispatcherConfig::validate(const char* member) const {
  const int64_t P = group_size();
  BB_CHECK(num_experts >= 1, "primitives.moe_dispatch = ", member, ": the model has no routed experts");
  BB_CHECK(num_experts % P == 0, "primitives.moe_dispatch = ", member, ": the expert-parallel group has ", P,
           " ranks (parallel.ep), which does not divide the model's ", num_experts,
           " routed experts; choose parallel.ep among the divisors of ", num_experts);
  BB_CHECK(num_chunks >= 1 && num_chunks <= kMaxDispatchChunks, "primitives.moe_dispatch = ", member,
           ": the chunk count must be in [1, ", kMaxDispatchChunks, "], got ", num_chunks);
}

namespace {

class SingleRankDispatcher final : public Dispatcher {
 public:
  explicit SingleRankDispatcher(const DispatcherConfig& cfg)
      : num_experts_(cfg.num_experts), wgrad_stream_(cfg.wgrad_stream) {}
  const char* name() const override { return "single_rank"; }
  int64_t num_local_experts(int64_t num_experts) const override { return num_experts; }
  int64_t first_local_expert(int64_t) const override { return 0; }
  Tensor forward(const Tensor& x_perm, const Tensor& row_prob, const std::vector<int64_t>& tokens_per_expert,
                 const ExpertCalls& experts, DispatchState& state) override {
    dispatch::check_dispatch_inputs("single-rank", x_perm, row_prob, tokens_per_expert, num_experts_);
    state.tokens_per_local_expert = tokens_per_expert;
    state.rows = x_perm;
    state.row_prob = row_prob;
    state.plan = nullptr;
    ++counts_.forwards;
    ++counts_.expert_forwards;
    ++counts_.combines;
    return experts.forward(x_perm, row_prob, tokens_per_expert, &state.experts);
  }
  void forward_for_backward(const Tensor& x_perm, const Tensor& row_prob,
                            const std::vector<int64_t>& tokens_per_expert, const ExpertCalls& experts,
                            DispatchState& state) override {
    dispatch::check_dispatch_inputs("single-rank", x_perm, row_prob, tokens_per_expert, num_experts_);
    state.tokens_per_local_expert = tokens_per_expert;
    state.rows = x_perm;
    state.row_prob = row_prob;
    state.plan = nullptr;
    ++counts_.forwards_for_backward;
    ++counts_.expert_rebuilds;
    experts.rebuild(x_perm, row_prob, tokens_per_expert, &state.experts);
  }
  DispatchRows backward(const Tensor& d_y_perm, const ExpertCalls& experts, DispatchState& state) override {
    const std::vector<int64_t>& counts = state.tokens_per_local_expert;
    ExpertsDgrad g = experts.backward_data(d_y_perm, state.row_prob, counts, state.experts);
    dispatch::expert_wgrad(wgrad_stream_, experts, d_y_perm, state.rows, state.row_prob, counts, state.experts,
                           g.d_gate_up);
    return {g.d_x, g.d_row_prob};
  }

 private:
  int64_t num_experts_;
  bool wgrad_stream_;
};

}  // namespace

std::unique_ptr<Dispatcher> make_single_rank_dispatcher(const DispatcherConfig& cfg) {
  cfg.validate("single_rank");
  return std::make_unique<SingleRankDispatcher>(cfg);
}

}  // namespace bb

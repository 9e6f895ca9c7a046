// dispatcher.cpp — the single-rank dispatcher: every expert is local, so dispatch and combine
// hand the rows through unchanged (no copy) and keep the per-expert counts.
#include "primitives/moe/dispatcher.h"

#include "core/error.h"

namespace bb {

namespace {
class SingleRankDispatcher final : public Dispatcher {
 public:
  const char* name() const override { return "allgather"; }
  int64_t num_local_experts(int64_t num_experts) const override { return num_experts; }
  int64_t first_local_expert(int64_t) const override { return 0; }
  DispatchRows dispatch(const Tensor& x_perm, const Tensor& row_prob,
                        const std::vector<int64_t>& tokens_per_expert,
                        DispatchState& state) override {
    int64_t n = 0;
    for (int64_t c : tokens_per_expert) n += c;
    BB_CHECK(x_perm.dim() == 2 && n == x_perm.size(0), "dispatch: tokens_per_expert sums to ", n,
             " but x_perm is ", x_perm.str());
    state.tokens_per_local_expert = tokens_per_expert;
    return {x_perm, row_prob};
  }
  Tensor combine(const Tensor& y_local, const DispatchState&) override { return y_local; }
  Tensor combine_backward(const Tensor& d_y_perm, const DispatchState&) override {
    return d_y_perm;
  }
  DispatchRows dispatch_backward(const Tensor& d_rows, const Tensor& d_row_prob,
                                 const DispatchState&) override {
    return {d_rows, d_row_prob};
  }
};
}  // namespace

std::unique_ptr<Dispatcher> make_single_rank_dispatcher(int64_t) {
  return std::make_unique<SingleRankDispatcher>();
}

}  // namespace bb

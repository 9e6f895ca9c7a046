// context_shard.cpp — sharding a packed micro-batch over a context-parallel group
// (context_shard.h).
#include "runtime/context_shard.h"

#include <algorithm>

#include "core/error.h"

namespace bb {

MicroBatch shard_micro_batch(const MicroBatch& mb, int64_t cp, int64_t rank) {
  if (cp == 1) return mb;
  BB_CHECK(!mb.shard.split(), "shard_micro_batch: the micro-batch is already a context shard");
  BB_CHECK(mb.tokens.device().is_cpu() && mb.targets.device().is_cpu() && mb.positions.device().is_cpu(),
           "shard_micro_batch: the micro-batch must be on the host");
  const std::vector<int32_t> cu = mb.cu_seqlens.to_ints();
  std::vector<int64_t> seqlens;
  for (size_t i = 1; i < cu.size(); ++i) seqlens.push_back(cu[i] - cu[i - 1]);
  const std::vector<int64_t> rows = cp_layout::global_rows(seqlens, cp, rank);
  BB_CHECK(!rows.empty(), "context parallelism: rank ", rank, " of ", cp, " gets no token of a micro-batch of ",
           mb.tokens.numel(), " tokens in ", seqlens.size(), " sequences (each sequence is split into 2 x cp = ",
           2 * cp, " chunks); raise train.micro_batch_tokens or lower parallel.cp");
  const std::vector<int32_t> tok = mb.tokens.to_ints(), tgt = mb.targets.to_ints(), pos = mb.positions.to_ints();
  const auto n = static_cast<int64_t>(rows.size());
  std::vector<int32_t> t(rows.size()), g(rows.size()), p(rows.size());
  int64_t valid = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto j = static_cast<size_t>(rows[i]);
    t[i] = tok[j];
    g[i] = tgt[j];
    p[i] = pos[j];
    valid += g[i] >= 0;
  }
  const cp_layout::RankLayout l = cp_layout::rank_layout(seqlens, cp, rank);
  std::vector<int32_t> lcu{0};
  for (const cp_layout::RankSeq& s : l.seqs) lcu.push_back(static_cast<int32_t>(s.local_begin + s.head + s.tail));
  MicroBatch out;
  out.tokens = Tensor::from_ints(t, {n}, MemCategory::other);
  out.targets = Tensor::from_ints(g, {n}, MemCategory::other);
  out.positions = Tensor::from_ints(p, {n}, MemCategory::other);
  out.cu_seqlens = Tensor::from_ints(lcu, {static_cast<int64_t>(lcu.size())}, MemCategory::other);
  out.num_valid = valid;
  // The RL fields follow their tokens (seq_weight keeps the whole document's 1 / n: the shards'
  // weights of a sequence still sum to 1 over the cp ranks).
  auto gather = [&](const Tensor& f) {
    if (!f.defined()) return Tensor();
    const std::vector<float> v = f.to_floats();
    std::vector<float> o(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) o[i] = v[static_cast<size_t>(rows[i])];
    return Tensor::from_floats(o, {n}, DType::f32, MemCategory::other);
  };
  out.advantages = gather(mb.advantages);
  out.old_logprobs = gather(mb.old_logprobs);
  out.ref_logprobs = gather(mb.ref_logprobs);
  out.seq_weight = gather(mb.seq_weight);
  if (mb.routing.defined()) {  // [T, L * K]: whole rows follow their tokens
    const int64_t per = mb.routing.size(1);
    const std::vector<int32_t> v = mb.routing.to_ints();
    std::vector<int32_t> o(rows.size() * static_cast<size_t>(per));
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy_n(v.begin() + rows[i] * per, per, o.begin() + static_cast<int64_t>(i) * per);
    out.routing = Tensor::from_ints(o, {n, per}, MemCategory::other);
  }
  out.shard.cp = cp;
  out.shard.rank = rank;
  out.shard.seqlens = std::move(seqlens);
  out.shard.tokens = mb.tokens.numel();
  return out;
}

}  // namespace bb

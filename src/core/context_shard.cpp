// context_shard.cpp — the head-tail layout of context-parallel shards (context_shard.h).
#include "core/context_shard.h"

#include "core/error.h"

namespace bb::cp_layout {

RankLayout rank_layout(const std::vector<int64_t>& seqlens, int64_t cp, int64_t rank) {
  BB_CHECK(cp >= 1 && rank >= 0 && rank < cp, "context shard: rank ", rank, " of ", cp);
  RankLayout out;
  out.seqs.resize(seqlens.size());
  for (size_t b = 0; b < seqlens.size(); ++b) {
    const int64_t len = seqlens[b];
    BB_CHECK(len >= 0, "context shard: negative sequence length ", len);
    RankSeq& s = out.seqs[b];
    s.local_begin = out.tokens;
    s.head_pos = chunk_begin(len, cp, rank);
    s.head = chunk_len(len, cp, rank);
    // cp 1: chunks 0 and 1 are consecutive, together the whole sequence.
    s.tail_pos = chunk_begin(len, cp, 2 * cp - 1 - rank);
    s.tail = chunk_len(len, cp, 2 * cp - 1 - rank);
    out.tokens += s.head + s.tail;
  }
  return out;
}

std::vector<int64_t> global_rows(const std::vector<int64_t>& seqlens, int64_t cp, int64_t rank) {
  const RankLayout l = rank_layout(seqlens, cp, rank);
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(l.tokens));
  int64_t seq_begin = 0;
  for (size_t b = 0; b < seqlens.size(); ++b) {
    const RankSeq& s = l.seqs[b];
    for (int64_t i = 0; i < s.head; ++i) rows.push_back(seq_begin + s.head_pos + i);
    for (int64_t i = 0; i < s.tail; ++i) rows.push_back(seq_begin + s.tail_pos + i);
    seq_begin += seqlens[b];
  }
  return rows;
}

}  // namespace bb::cp_layout

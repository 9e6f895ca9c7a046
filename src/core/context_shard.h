// context_shard.h — how a packed micro-batch is split over the ranks of a context-parallel group
// (DESIGN.md sec. 4; skills/cp-ring.md). Host-side arithmetic only; the runtime shards the
// micro-batch with it (runtime/context_shard.h) and the context-parallel attention members use it
// to know every rank's rows without exchanging any layout.
//
// Head-tail (zigzag) split, no padding: every sequence of S tokens is cut into 2 CP chunks, chunk c
// holding positions [c S / (2 CP), (c + 1) S / (2 CP)) (integer division, so chunk sizes differ by
// at most one and a sequence shorter than 2 CP has empty chunks); rank r keeps chunks r and
// 2 CP - 1 - r. Under causal attention the two chunks' work adds up to the same amount on every
// rank. A rank's local batch lists, per sequence b, its chunk r then its chunk 2 CP - 1 - r as one
// local sequence (possibly empty) of its cu_seqlens; RoPE positions and targets travel with the
// tokens, so nothing else of the model changes.
#pragma once

#include <cstdint>
#include <vector>

namespace bb {

struct ContextShard {
  int64_t cp = 1, rank = 0;       // the group size and this shard's rank; cp 1 = not split
  std::vector<int64_t> seqlens;   // [B] the whole micro-batch's sequence lengths
  int64_t tokens = 0;             // the whole micro-batch's token count (sum of seqlens)
  bool split() const { return cp > 1; }
};

namespace cp_layout {

// First position of chunk c (0..2 cp) of a sequence of `len` tokens.
inline int64_t chunk_begin(int64_t len, int64_t cp, int64_t c) { return c * len / (2 * cp); }
inline int64_t chunk_len(int64_t len, int64_t cp, int64_t c) {
  return chunk_begin(len, cp, c + 1) - chunk_begin(len, cp, c);
}

// Rank r's two chunks of every sequence, as they lie in r's local batch.
struct RankSeq {
  int64_t local_begin = 0;        // first local row of sequence b on rank r
  int64_t head = 0, tail = 0;     // lengths of chunk r and chunk 2 cp - 1 - r
  int64_t head_pos = 0, tail_pos = 0;  // their first positions in the sequence
};
struct RankLayout {
  std::vector<RankSeq> seqs;  // [B]
  int64_t tokens = 0;         // local row count
};

RankLayout rank_layout(const std::vector<int64_t>& seqlens, int64_t cp, int64_t rank);

// For each local row of rank r (in local order), its row in the whole packed micro-batch.
std::vector<int64_t> global_rows(const std::vector<int64_t>& seqlens, int64_t cp, int64_t rank);

}  // namespace cp_layout
}  // namespace bb

// Context parallelism on one process: the head-tail layout (every row on exactly one rank, chunk
// sizes, short sequences), sharding a packed micro-batch, the data movements of the
// context-parallel attention members (cp_ops.h) against direct index loops, and the property the
// ring relies on: attention over a query block against key blocks, merged by their log-sum-exp,
// equals attention over all the keys (including blocks where some sequences have no key).
// Multi-rank equivalence of the members is tests/mpi/test_context_parallel.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>

#include "common/testing.h"
#include "core/context_shard.h"
#include "primitives/attention/attention.h"
#include "primitives/attention/context_parallel.h"
#include "primitives/attention/cp_ops.h"
#include "runtime/context_shard.h"

namespace bb {
namespace {

using test::randn;

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

TEST(CpLayout, EveryRowOnExactlyOneRankInHeadTailChunks) {
  const std::vector<int64_t> lens = {1, 2, 3, 7, 8, 9, 100, 0, 5};
  const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  for (int64_t cp : {1, 2, 3, 4}) {
    SCOPED_TRACE("cp " + std::to_string(cp));
    std::vector<int> seen(static_cast<size_t>(total), 0);
    int64_t sum = 0;
    for (int64_t r = 0; r < cp; ++r) {
      const cp_layout::RankLayout l = cp_layout::rank_layout(lens, cp, r);
      const std::vector<int64_t> rows = cp_layout::global_rows(lens, cp, r);
      ASSERT_EQ(static_cast<int64_t>(rows.size()), l.tokens);
      sum += l.tokens;
      for (int64_t g : rows) ++seen[static_cast<size_t>(g)];
      int64_t seq_begin = 0;
      for (size_t b = 0; b < lens.size(); ++b) {
        const cp_layout::RankSeq& s = l.seqs[b];
        // Chunk r then chunk 2cp-1-r, each of floor-split size.
        EXPECT_EQ(s.head, cp_layout::chunk_len(lens[b], cp, r));
        EXPECT_EQ(s.tail, cp_layout::chunk_len(lens[b], cp, 2 * cp - 1 - r));
        EXPECT_LE(s.head, (lens[b] + 2 * cp - 1) / (2 * cp));
        EXPECT_GE(s.head, lens[b] / (2 * cp));
        for (int64_t i = 0; i < s.head; ++i)
          EXPECT_EQ(rows[static_cast<size_t>(s.local_begin + i)], seq_begin + s.head_pos + i);
        for (int64_t i = 0; i < s.tail; ++i)
          EXPECT_EQ(rows[static_cast<size_t>(s.local_begin + s.head + i)], seq_begin + s.tail_pos + i);
        if (cp > 1) EXPECT_LE(s.head_pos + s.head, s.tail_pos);  // the head chunk lies before the tail
        seq_begin += lens[b];
      }
    }
    EXPECT_EQ(sum, total);
    for (int c : seen) EXPECT_EQ(c, 1);
  }
  // A 1-token sequence over cp 2: chunks 0..2 empty, chunk 3 (rank 0's tail) holds it.
  EXPECT_EQ(cp_layout::rank_layout({1}, 2, 0).tokens, 1);
  EXPECT_EQ(cp_layout::rank_layout({1}, 2, 1).tokens, 0);
}

MicroBatch packed(const std::vector<int64_t>& lens) {
  std::vector<int32_t> tok, tgt, pos, cu{0};
  int32_t id = 0;
  for (int64_t len : lens) {
    for (int64_t i = 0; i < len; ++i) {
      tok.push_back(id);
      tgt.push_back(i + 1 < len ? id + 1 : -1);
      pos.push_back(static_cast<int32_t>(i));
      ++id;
    }
    cu.push_back(id);
  }
  MicroBatch mb;
  const auto T = static_cast<int64_t>(tok.size());
  mb.tokens = Tensor::from_ints(tok, {T});
  mb.targets = Tensor::from_ints(tgt, {T});
  mb.positions = Tensor::from_ints(pos, {T});
  mb.cu_seqlens = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  for (int32_t t : tgt) mb.num_valid += t >= 0;
  return mb;
}

TEST(CpLayout, ShardingKeepsEveryTokenWithItsTargetAndPosition) {
  const std::vector<int64_t> lens = {40, 3, 1, 17, 2, 33};
  const MicroBatch whole = packed(lens);
  for (int64_t cp : {2, 4}) {
    int64_t valid = 0, tokens = 0;
    for (int64_t r = 0; r < cp; ++r) {
      const MicroBatch s = shard_micro_batch(whole, cp, r);
      EXPECT_TRUE(s.shard.split());
      EXPECT_EQ(s.shard.tokens, whole.tokens.numel());
      EXPECT_EQ(s.shard.seqlens, lens);
      const std::vector<int64_t> rows = cp_layout::global_rows(lens, cp, r);
      const std::vector<int32_t> t = s.tokens.to_ints(), g = s.targets.to_ints(), p = s.positions.to_ints();
      const std::vector<int32_t> wt = whole.tokens.to_ints(), wg = whole.targets.to_ints(), wp = whole.positions.to_ints();
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(t[i], wt[static_cast<size_t>(rows[i])]);
        EXPECT_EQ(g[i], wg[static_cast<size_t>(rows[i])]);
        EXPECT_EQ(p[i], wp[static_cast<size_t>(rows[i])]);
      }
      // One local sequence per sequence: the head and tail chunks.
      EXPECT_EQ(s.cu_seqlens.numel(), static_cast<int64_t>(lens.size()) + 1);
      EXPECT_DOUBLE_EQ(s.token_share(), static_cast<double>(s.tokens.numel()) / whole.tokens.numel());
      valid += s.num_valid;
      tokens += s.tokens.numel();
    }
    EXPECT_EQ(valid, whole.num_valid);
    EXPECT_EQ(tokens, whole.tokens.numel());
  }
  EXPECT_EQ(shard_micro_batch(whole, 1, 0).tokens.numel(), whole.tokens.numel());
  test::expect_error_contains([&] { shard_micro_batch(shard_micro_batch(whole, 2, 0), 2, 0); }, "already a context shard");
  test::expect_error_contains([&] { shard_micro_batch(packed({1}), 2, 1); }, "gets no token");
}

TEST(CpOps, GatherScatterAndHeadMovesMatchIndexLoops) {
  const int64_t T = 9, H = 4, D = 3;
  const std::vector<float> x = randn(static_cast<size_t>(T * H * D), 3);
  const Tensor xt = Tensor::from_floats(x, {T, H, D});
  const std::vector<int64_t> rows = {4, 0, 8, 3};
  const std::vector<float> g = cp::gather_rows(xt, rows, MemCategory::other).to_floats();
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t j = 0; j < H * D; ++j)
      EXPECT_EQ(g[i * H * D + static_cast<size_t>(j)], x[static_cast<size_t>(rows[i] * H * D + j)]);
  // bf16 rows move as 2-byte words.
  Tensor xb = xt.to_dtype(DType::bf16);
  EXPECT_EQ(cp::gather_rows(xb, rows, MemCategory::other).to_floats(),
            cp::gather_rows(xt, rows, MemCategory::other).to_dtype(DType::bf16).to_floats());

  Tensor acc = Tensor::zeros({T, H * D}, DType::f32, Device::cpu(), MemCategory::other);
  cp::scatter_add_rows(acc, Tensor::from_floats(g, {4, H * D}), rows);
  cp::scatter_add_rows(acc, Tensor::from_floats(g, {4, H * D}), rows);
  const std::vector<float> a = acc.to_floats();
  for (int64_t t = 0; t < T; ++t) {
    const bool hit = std::find(rows.begin(), rows.end(), t) != rows.end();
    for (int64_t j = 0; j < H * D; ++j)
      EXPECT_EQ(a[static_cast<size_t>(t * H * D + j)], hit ? 2 * x[static_cast<size_t>(t * H * D + j)] : 0.0f);
  }

  const Tensor lse = Tensor::from_floats(randn(static_cast<size_t>(H * T), 4), {H, T});
  const std::vector<float> gc = cp::gather_cols(lse, rows, MemCategory::other).to_floats(), l = lse.to_floats();
  for (int64_t h = 0; h < H; ++h)
    for (size_t i = 0; i < rows.size(); ++i)
      EXPECT_EQ(gc[static_cast<size_t>(h) * rows.size() + i], l[static_cast<size_t>(h * T + rows[i])]);

  // Split into 2 peers of 2 heads, join back: the identity. Overlapping ranges accumulate.
  const Tensor parts = cp::split_heads(xt, {0, 2}, 2, MemCategory::other);
  ASSERT_EQ(parts.shape(), (Shape{2 * T, 2, D}));
  Tensor back = Tensor::empty({T, H, D}, DType::f32, Device::cpu(), MemCategory::other);
  cp::join_heads(back, parts, {0, 2}, 2, false);
  EXPECT_EQ(back.to_floats(), x);
  const Tensor rep = cp::split_heads(xt, {1, 1, 3}, 1, MemCategory::other);  // head 1 twice
  Tensor sum = Tensor::zeros({T, H, D}, DType::f32, Device::cpu(), MemCategory::other);
  cp::join_heads(sum, rep, {1, 1, 3}, 1, true);
  const std::vector<float> s = sum.to_floats();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = static_cast<size_t>((t * H + h) * D + d);
        EXPECT_EQ(s[i], h == 1 ? 2 * x[i] : h == 3 ? x[i] : 0.0f);
      }
  test::expect_error_contains([&] { cp::gather_rows(xt, {T}, MemCategory::other); }, "outside");
  test::expect_error_contains([&] { cp::split_heads(xt, {3}, 2, MemCategory::other); }, "outside");
}

// Attention of a query block over all keys = the log-sum-exp merge of the same queries over key
// blocks (mask none), whichever way the keys are cut; a block in which a sequence has no key
// contributes nothing (lse -inf).
TEST(CpOps, MergedPartialAttentionEqualsAttentionOverAllKeys) {
  const int64_t Hq = 4, Hkv = 2, D = 8;
  const std::vector<int64_t> q_lens = {5, 3}, k_lens = {11, 6};
  const int64_t Tq = 8, Tk = 17;
  const Tensor q = Tensor::from_floats(randn(static_cast<size_t>(Tq * Hq * D), 5), {Tq, Hq, D});
  const Tensor k = Tensor::from_floats(randn(static_cast<size_t>(Tk * Hkv * D), 6), {Tk, Hkv, D});
  const Tensor v = Tensor::from_floats(randn(static_cast<size_t>(Tk * Hkv * D), 7), {Tk, Hkv, D});
  const float scale = 0.35f;
  auto cu = [](const std::vector<int64_t>& lens) {
    std::vector<int32_t> c{0};
    for (int64_t l : lens) c.push_back(c.back() + static_cast<int32_t>(l));
    return Tensor::from_ints(c, {static_cast<int64_t>(c.size())});
  };
  AttentionSaved full_s;
  const Tensor full = attention_forward(q, k, v, {cu(q_lens), cu(k_lens), AttentionMask::none, scale}, &full_s);
  // Keys of sequence 0 cut 4 | 7 | 0, of sequence 1 cut 0 | 2 | 4.
  const std::vector<std::vector<int64_t>> cuts = {{4, 0}, {7, 2}, {0, 4}};
  Tensor o = Tensor::zeros({Tq, Hq, D}, DType::f32, Device::cpu(), MemCategory::other);
  Tensor lse = Tensor::empty({Hq, Tq}, DType::f32, Device::cpu(), MemCategory::other);
  lse.fill_(-std::numeric_limits<double>::infinity());
  std::vector<int64_t> start = {0, 0};
  std::vector<int64_t> all_q(static_cast<size_t>(Tq));
  std::iota(all_q.begin(), all_q.end(), 0);
  for (const std::vector<int64_t>& cut : cuts) {
    std::vector<int64_t> krows;
    for (int b = 0; b < 2; ++b) {
      const int64_t base = b == 0 ? 0 : k_lens[0];
      for (int64_t i = 0; i < cut[static_cast<size_t>(b)]; ++i) krows.push_back(base + start[static_cast<size_t>(b)] + i);
      start[static_cast<size_t>(b)] += cut[static_cast<size_t>(b)];
    }
    AttentionSaved ps;
    const Tensor op = attention_forward(q, cp::gather_rows(k, krows, MemCategory::other),
                                        cp::gather_rows(v, krows, MemCategory::other),
                                        {cu(q_lens), cu(cut), AttentionMask::none, scale}, &ps);
    cp::merge_partial(o, lse, op, ps.lse, all_q);
  }
  EXPECT_LT(max_abs_diff(o.to_floats(), full.to_floats()), 1e-5);
  EXPECT_LT(max_abs_diff(lse.to_floats(), full_s.lse.to_floats()), 1e-5);
}

// On one rank every member is the local causal attention, forward and backward.
TEST(CpOps, MembersOnOneRankAreSdpa) {
  const MicroBatch mb = packed({6, 1, 9});
  const int64_t T = 16, Hq = 4, Hkv = 2, D = 8;
  const Tensor q = Tensor::from_floats(randn(static_cast<size_t>(T * Hq * D), 8), {T, Hq, D});
  const Tensor k = Tensor::from_floats(randn(static_cast<size_t>(T * Hkv * D), 9), {T, Hkv, D});
  const Tensor v = Tensor::from_floats(randn(static_cast<size_t>(T * Hkv * D), 10), {T, Hkv, D});
  const Tensor d_o = Tensor::from_floats(randn(static_cast<size_t>(T * Hq * D), 11), {T, Hq, D});
  AttentionSaved ref_s;
  const AttentionArgs args = AttentionArgs::causal_self(mb.cu_seqlens, 0.3f);
  const Tensor ref = attention_forward(q, k, v, args, &ref_s);
  const AttentionGrads ref_g = attention_backward(d_o, q, k, v, ref, args, ref_s);
  for (SelfAttentionFactory make : {make_sdpa_attention, make_cp_ring_attention, make_cp_a2a_attention}) {
    std::unique_ptr<SelfAttention> a = make({});
    SCOPED_TRACE(a->name());
    AttentionSaved s;
    const Tensor o = a->forward(q, k, v, mb, 0.3f, &s);
    EXPECT_EQ(o.to_floats(), ref.to_floats());
    const AttentionGrads g = a->backward(d_o, q, k, v, o, mb, 0.3f, s);
    EXPECT_EQ(g.dq.to_floats(), ref_g.dq.to_floats());
    EXPECT_EQ(g.dk.to_floats(), ref_g.dk.to_floats());
    EXPECT_EQ(g.dv.to_floats(), ref_g.dv.to_floats());
  }
  // sdpa refuses a shard; the members refuse a shard of another group size.
  const MicroBatch shard = shard_micro_batch(mb, 2, 0);
  test::expect_error_contains([&] { make_sdpa_attention({})->forward(q, k, v, shard, 0.3f, nullptr); },
                              "set primitives.attention");
  test::expect_error_contains([&] { make_cp_ring_attention({})->forward(q, k, v, shard, 0.3f, nullptr); },
                              "shard 0 of 2");
  test::expect_error_contains([] { check_cp_a2a_heads(6, 2, 4); }, "does not divide");
  test::expect_error_contains([] { check_cp_a2a_heads(12, 3, 4); }, "neither split");
}

}  // namespace
}  // namespace bb

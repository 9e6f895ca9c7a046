// gdn_context_parallel.cpp — the Gated DeltaNet context-parallel family (gdn_context_parallel.h;
// the state algebra and the costs: skills/gdn-cp-states.md).
#include "primitives/gdn/gdn_context_parallel.h"

#include <algorithm>
#include <set>

#include "core/context_shard.h"
#include "core/trace.h"
#include "primitives/attention/cp_ops.h"
#include "primitives/conv/causal_conv1d.h"
#include "primitives/linear/linear.h"

namespace bb {

bool gdn_cp_by_states(GdnCpMode mode, int64_t num_key_heads, int64_t num_value_heads, int64_t cp) {
  const bool split = cp <= 1 || (num_key_heads % cp == 0 && num_value_heads % cp == 0);
  if (mode == GdnCpMode::heads)
    BB_CHECK(split, "parallel.cp = ", cp, " with primitives.gdn_cp = \"heads\": the Gated DeltaNet layers split their ",
             num_key_heads, " key and ", num_value_heads,
             " value heads over the context-parallel ranks, which needs cp to divide both; choose cp among the common "
             "divisors of ", num_key_heads, " and ", num_value_heads,
             ", or set primitives.gdn_cp = \"states\" (or \"auto\"), which takes any head count");
  return mode == GdnCpMode::states || (mode == GdnCpMode::automatic && !split);
}

GdnContextParallel::GdnContextParallel(comm::GroupPtr group, GdnCpMode mode, int64_t num_key_heads,
                                       int64_t num_value_heads, int64_t conv_width)
    : group_(group), conv_width_(conv_width), xchg_(group) {
  const int64_t P = group ? group->size() : 1;
  states_ = P > 1 && gdn_cp_by_states(mode, num_key_heads, num_value_heads, P);
}

GdnContextParallel::Route GdnContextParallel::route(const MicroBatch& mb) const {
  if (!mb.shard.split()) return Route::local;
  return states_ ? Route::states : Route::heads;
}

// ---- every rank's pieces (host arithmetic) ----

namespace {
// Chunk c of a sequence: its rank and its slot there (2b + 0 for the head chunk, + 1 the tail).
int64_t owner_of(int64_t c, int64_t P) { return c < P ? c : 2 * P - 1 - c; }
int64_t slot_of(int64_t b, int64_t c, int64_t P) { return 2 * b + (c < P ? 0 : 1); }

}  // namespace

struct GdnContextParallel::Pieces {
  struct Piece {
    int64_t row = 0, len = 0, pos = 0;  // first local row on its rank, length, first position
  };
  // A piece whose first rows need tokens before it (it has rows and does not start its sequence):
  // its halo sequence in its rank's halo input, W - 1 halo rows then its first m rows.
  struct Halo {
    int64_t slot = 0, start = 0, m = 0;
    std::vector<int64_t> rows;                          // halo input rows with a token (position >= 0)
    std::vector<int64_t> from;                          // ... their rows in the gathered sent rows
    std::vector<std::pair<int64_t, int64_t>> target;    // ... and (rank, local row) holding the token
  };
  std::vector<int64_t> seqlens;
  int64_t P = 0, r = 0, W = 0;
  std::vector<std::vector<Piece>> ranks;  // [P][2B], slot 2b: chunk q of sequence b, 2b + 1: chunk 2P - 1 - q
  Tensor cu;                              // this rank's pieces as sequences (i32, host)
  // The conv halo (W > 1): every rank sends the last min(W - 1, len) rows of each of its pieces.
  std::vector<int64_t> send_rows;              // this rank's
  std::vector<int64_t> send_counts;            // [P]
  std::vector<std::vector<Halo>> halos;        // [P]
  std::vector<int64_t> halo_rows;              // [P] rows of each rank's halo input
  std::vector<int64_t> halo_grad_counts;       // [P] halo rows with a token, each rank's
  Tensor halo_cu;                              // this rank's halo sequences (i32, host)
};

const GdnContextParallel::Pieces& GdnContextParallel::pieces(const MicroBatch& mb) const {
  if (cache_ && cache_->P == mb.shard.cp && cache_->r == mb.shard.rank && cache_->seqlens == mb.shard.seqlens)
    return *cache_;
  const int64_t W = conv_width_;
  auto p = std::make_shared<Pieces>();
  p->seqlens = mb.shard.seqlens;
  p->P = mb.shard.cp;
  p->r = mb.shard.rank;
  p->W = W;
  const int64_t P = p->P, B = static_cast<int64_t>(p->seqlens.size());
  BB_CHECK(group_ && group_->size() == P && group_->rank() == p->r, "Gated DeltaNet context parallelism: the micro-batch is shard ",
           p->r, " of ", P, " but this rank is ", group_ ? group_->rank() : 0, " of a group of ",
           group_ ? group_->size() : 1);
  p->ranks.resize(static_cast<size_t>(P));
  for (int64_t q = 0; q < P; ++q) {
    const cp_layout::RankLayout L = cp_layout::rank_layout(p->seqlens, P, q);
    auto& v = p->ranks[static_cast<size_t>(q)];
    for (int64_t b = 0; b < B; ++b) {
      const cp_layout::RankSeq& s = L.seqs[static_cast<size_t>(b)];
      v.push_back({s.local_begin, s.head, s.head_pos});
      v.push_back({s.local_begin + s.head, s.tail, s.tail_pos});
    }
  }
  {
    std::vector<int32_t> cu{0};
    for (const Pieces::Piece& pc : p->ranks[static_cast<size_t>(p->r)])
      cu.push_back(cu.back() + static_cast<int32_t>(pc.len));
    p->cu = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  }
  if (W > 1) {
    const int64_t h = W - 1;
    // sent[q][s]: offset of piece (q, s)'s sent rows in the gathered rows.
    std::vector<std::vector<int64_t>> sent(static_cast<size_t>(P));
    int64_t off = 0;
    for (int64_t q = 0; q < P; ++q) {
      int64_t n = 0;
      for (const Pieces::Piece& pc : p->ranks[static_cast<size_t>(q)]) {
        const int64_t k = std::min(h, pc.len);
        sent[static_cast<size_t>(q)].push_back(off + n);
        if (q == p->r)
          for (int64_t i = pc.len - k; i < pc.len; ++i) p->send_rows.push_back(pc.row + i);
        n += k;
      }
      p->send_counts.push_back(n);
      off += n;
    }
    p->halos.resize(static_cast<size_t>(P));
    for (int64_t q = 0; q < P; ++q) {
      int64_t rows = 0, grads = 0;
      const auto& mine = p->ranks[static_cast<size_t>(q)];
      for (int64_t s = 0; s < static_cast<int64_t>(mine.size()); ++s) {
        const Pieces::Piece& pc = mine[static_cast<size_t>(s)];
        if (pc.len == 0 || pc.pos == 0) continue;
        const int64_t b = s / 2, len = p->seqlens[static_cast<size_t>(b)];
        Pieces::Halo hl;
        hl.slot = s;
        hl.start = rows;
        hl.m = std::min(h, pc.len);
        for (int64_t j = 0; j < h; ++j) {
          const int64_t pos = pc.pos - h + j;
          if (pos < 0) continue;
          int64_t c = 0;  // the chunk holding pos
          while (cp_layout::chunk_begin(len, P, c + 1) <= pos) ++c;
          const int64_t oq = owner_of(c, P), os = slot_of(b, c, P);
          const Pieces::Piece& src = p->ranks[static_cast<size_t>(oq)][static_cast<size_t>(os)];
          const int64_t k = std::min(h, src.len), first_sent = src.pos + src.len - k;
          BB_CHECK(pos >= first_sent && pos < src.pos + src.len, "Gated DeltaNet context parallelism: halo position ", pos,
                   " of sequence ", b, " is not among the rows its rank sends (internal error)");
          hl.rows.push_back(rows + j);
          hl.from.push_back(sent[static_cast<size_t>(oq)][static_cast<size_t>(os)] + (pos - first_sent));
          hl.target.emplace_back(oq, src.row + (pos - src.pos));
        }
        grads += static_cast<int64_t>(hl.rows.size());
        rows += h + hl.m;
        p->halos[static_cast<size_t>(q)].push_back(std::move(hl));
      }
      p->halo_rows.push_back(rows);
      p->halo_grad_counts.push_back(grads);
    }
    std::vector<int32_t> cu{0};
    for (const Pieces::Halo& hl : p->halos[static_cast<size_t>(p->r)])
      cu.push_back(cu.back() + static_cast<int32_t>(h + hl.m));
    p->halo_cu = Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())});
  }
  cache_ = std::move(p);
  return *cache_;
}

// ---- routing of the projections ----

std::pair<int64_t, int64_t> GdnContextParallel::my_heads(int64_t num_heads, const MicroBatch& mb) const {
  if (route(mb) != Route::heads) return {0, num_heads};
  return xchg_.my_heads(num_heads, mb, "Gated DeltaNet under context parallelism (primitives.gdn_cp = \"heads\")");
}

PendingExchange GdnContextParallel::start_to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb,
                                                   MemCategory cat) const {
  if (route(mb) != Route::heads) return PendingExchange(x);
  return xchg_.start_to_heads(x, num_heads, mb, cat);
}

PendingExchange GdnContextParallel::start_from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb,
                                                     MemCategory cat) const {
  if (route(mb) != Route::heads) return PendingExchange(xh);
  return xchg_.start_from_heads(xh, num_heads, mb, cat);
}

Tensor GdnContextParallel::to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const {
  return start_to_heads(x, num_heads, mb, cat).get();
}

Tensor GdnContextParallel::from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const {
  return start_from_heads(xh, num_heads, mb, cat).get();
}

Tensor GdnContextParallel::cu_seqlens(const MicroBatch& mb) const {
  switch (route(mb)) {
    case Route::local: return mb.cu_seqlens;
    case Route::heads: return xchg_.cu_seqlens(mb);
    case Route::states: return pieces(mb).cu;
  }
  return mb.cu_seqlens;
}

// ---- the conv ----

namespace {

// src[rows] ([0, C] when rows is empty).
Tensor take_rows(const Tensor& src, const std::vector<int64_t>& rows, MemCategory cat) {
  if (rows.empty()) return Tensor::empty({0, src.size(1)}, src.dtype(), src.device(), cat);
  return cp::gather_rows(src, rows, cat);
}

// dst[rows[i]] += src[i], rows possibly repeated: in rounds of distinct rows.
void add_rows(Tensor& dst, const Tensor& src, const std::vector<int64_t>& src_rows, const std::vector<int64_t>& rows) {
  std::vector<int64_t> pending(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) pending[i] = static_cast<int64_t>(i);
  while (!pending.empty()) {
    std::vector<int64_t> take, to, rest;
    std::set<int64_t> used;
    for (int64_t i : pending) {
      const int64_t row = rows[static_cast<size_t>(i)];
      if (used.count(row)) {
        rest.push_back(i);
        continue;
      }
      used.insert(row);
      take.push_back(src_rows[static_cast<size_t>(i)]);
      to.push_back(row);
    }
    cp::scatter_add_rows(dst, cp::gather_rows(src, take, MemCategory::workspace), to);
    pending = std::move(rest);
  }
}

}  // namespace

Tensor GdnContextParallel::conv_forward(const Tensor& pre, const Tensor& filters, const MicroBatch& mb,
                                        DType out_dtype, Tensor* halo) const {
  BB_RANGE("gdn_cp_conv_forward");
  const Tensor cu = cu_seqlens(mb);
  Tensor y = causal_conv1d_forward(pre, filters, cu, /*silu=*/true, MemCategory::activations, out_dtype);
  const int64_t W = filters.size(1);
  if (route(mb) != Route::states || W == 1) return y;
  BB_CHECK(W == conv_width_, "GdnContextParallel::conv_forward: filters of width ", W, " but the layer's is ", conv_width_);
  const Pieces& pc = pieces(mb);
  const int64_t C = pre.size(1), h = W - 1, r = pc.r;
  const auto& mine = pc.halos[static_cast<size_t>(r)];
  Tensor in;
  if (halo != nullptr && halo->defined()) {
    in = *halo;  // a rebuild: the halo the forward gathered
  } else {
    // The last rows of every piece from every rank, then this rank's halo sequences.
    const Tensor sent = take_rows(pre, pc.send_rows, MemCategory::workspace);
    int64_t total = 0;
    for (int64_t n : pc.send_counts) total += n;
    Tensor got = Tensor::empty({total, C}, DType::f32, pre.device(), MemCategory::workspace);
    group_->all_gather_v(sent, got, pc.send_counts)->wait();
    in = Tensor::zeros({pc.halo_rows[static_cast<size_t>(r)], C}, DType::f32, pre.device(), MemCategory::activations);
    std::vector<int64_t> from, to, own, own_to;
    for (const Pieces::Halo& hl : mine) {
      from.insert(from.end(), hl.from.begin(), hl.from.end());
      to.insert(to.end(), hl.rows.begin(), hl.rows.end());
      const Pieces::Piece& p = pc.ranks[static_cast<size_t>(r)][static_cast<size_t>(hl.slot)];
      for (int64_t i = 0; i < hl.m; ++i) {
        own.push_back(p.row + i);
        own_to.push_back(hl.start + h + i);
      }
    }
    if (!to.empty()) cp::scatter_add_rows(in, cp::gather_rows(got, from, MemCategory::workspace), to);
    if (!own.empty()) cp::scatter_add_rows(in, cp::gather_rows(pre, own, MemCategory::workspace), own_to);
    if (halo != nullptr) *halo = in;
  }
  if (mine.empty()) return y;
  const Tensor yh = causal_conv1d_forward(in, filters, pc.halo_cu, /*silu=*/true, MemCategory::workspace, out_dtype);
  for (const Pieces::Halo& hl : mine) {
    const Pieces::Piece& p = pc.ranks[static_cast<size_t>(r)][static_cast<size_t>(hl.slot)];
    Tensor dst = y.narrow(p.row, hl.m);
    dst.copy_from(yh.narrow(hl.start + h, hl.m));
  }
  return y;
}

Tensor GdnContextParallel::conv_backward(Tensor d_y, const Tensor& pre, const Tensor& filters, const MicroBatch& mb,
                                         const Tensor& halo, Tensor& d_w) const {
  BB_RANGE("gdn_cp_conv_backward");
  const Tensor cu = cu_seqlens(mb);
  const int64_t W = filters.size(1);
  if (route(mb) != Route::states || W == 1)
    return causal_conv1d_backward(d_y, pre, filters, cu, /*silu=*/true, d_w);
  BB_CHECK(W == conv_width_, "GdnContextParallel::conv_backward: filters of width ", W, " but the layer's is ", conv_width_);
  const Pieces& pc = pieces(mb);
  const int64_t C = pre.size(1), h = W - 1, r = pc.r;
  const auto& mine = pc.halos[static_cast<size_t>(r)];
  BB_CHECK(mine.empty() || (halo.defined() && halo.size(0) == pc.halo_rows[static_cast<size_t>(r)]),
           "GdnContextParallel::conv_backward: the halo of the forward is missing");
  // The first rows of a piece with a halo belong to its halo sequence's backward.
  Tensor d_hy = Tensor::zeros({pc.halo_rows[static_cast<size_t>(r)], C}, DType::f32, pre.device(), MemCategory::workspace);
  for (const Pieces::Halo& hl : mine) {
    const Pieces::Piece& p = pc.ranks[static_cast<size_t>(r)][static_cast<size_t>(hl.slot)];
    Tensor dst = d_hy.narrow(hl.start + h, hl.m);
    dst.copy_from(d_y.narrow(p.row, hl.m));
    Tensor src = d_y.narrow(p.row, hl.m);
    src.zero_();
  }
  Tensor d_pre = causal_conv1d_backward(d_y, pre, filters, cu, /*silu=*/true, d_w);
  d_y = Tensor();
  Tensor d_in;
  std::vector<int64_t> grad_rows;  // this rank's halo rows with a token, in order
  if (!mine.empty()) {
    d_in = causal_conv1d_backward(d_hy, halo, filters, pc.halo_cu, /*silu=*/true, d_w);
    std::vector<int64_t> from, to;
    for (const Pieces::Halo& hl : mine) {
      const Pieces::Piece& p = pc.ranks[static_cast<size_t>(r)][static_cast<size_t>(hl.slot)];
      for (int64_t i = 0; i < hl.m; ++i) {
        from.push_back(hl.start + h + i);
        to.push_back(p.row + i);
      }
      grad_rows.insert(grad_rows.end(), hl.rows.begin(), hl.rows.end());
    }
    cp::scatter_add_rows(d_pre, cp::gather_rows(d_in, from, MemCategory::workspace), to);
  }
  // The halo rows' gradients to the ranks holding their tokens.
  const Tensor sent = d_in.defined() ? take_rows(d_in, grad_rows, MemCategory::workspace)
                                     : Tensor::empty({0, C}, DType::f32, pre.device(), MemCategory::workspace);
  int64_t total = 0;
  for (int64_t n : pc.halo_grad_counts) total += n;
  Tensor got = Tensor::empty({total, C}, DType::f32, pre.device(), MemCategory::workspace);
  group_->all_gather_v(sent, got, pc.halo_grad_counts)->wait();
  std::vector<int64_t> from, to;
  int64_t at = 0;
  for (int64_t q = 0; q < pc.P; ++q)
    for (const Pieces::Halo& hl : pc.halos[static_cast<size_t>(q)])
      for (const auto& [owner, row] : hl.target) {
        if (owner == r) {
          from.push_back(at);
          to.push_back(row);
        }
        ++at;
      }
  if (!to.empty()) add_rows(d_pre, got, from, to);
  return d_pre;
}

// ---- the rule ----

namespace {

// Every rank's pieces' transitions P [2B, Hv, K, K] and a state-shaped companion X [2B, Hv, K, V]
// (the end states forward, the start-state gradients backward), all-gathered in one collective,
// and the views of chunk c of sequence b.
struct Gathered {
  Tensor all;  // [P x (2B Hv K K + 2B Hv K V)] f32
  int64_t P = 0, B = 0, Hv = 0, K = 0, V = 0;
  Gathered(comm::Group& group, const Tensor& trans, const Tensor& x, int64_t B_)
      : P(group.size()), B(B_), Hv(x.size(1)), K(x.size(2)), V(x.size(3)) {
    const int64_t na = trans.numel(), nb = x.numel();
    Tensor send = Tensor::empty({na + nb}, DType::f32, x.device(), MemCategory::workspace);
    Tensor sa = send.narrow(0, na).view(trans.shape());
    sa.copy_from(trans);
    Tensor sb = send.narrow(na, nb).view(x.shape());
    sb.copy_from(x);
    all = Tensor::empty({P * (na + nb)}, DType::f32, x.device(), MemCategory::workspace);
    group.all_gather(send, all)->wait();
  }
  int64_t per() const { return 2 * B * Hv * K * (K + V); }
  Tensor trans(int64_t b, int64_t c) const {
    return all.narrow(owner_of(c, P) * per() + slot_of(b, c, P) * Hv * K * K, Hv * K * K).view({Hv, K, K});
  }
  Tensor state(int64_t b, int64_t c) const {
    return all.narrow(owner_of(c, P) * per() + 2 * B * Hv * K * K + slot_of(b, c, P) * Hv * K * V, Hv * K * V)
        .view({Hv, K, V});
  }
};

}  // namespace

Tensor GdnContextParallel::rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const MicroBatch& mb, const GatedDeltaOptions& opts,
                                        GatedDeltaPrep* keep, GdnCpSaved* saved) const {
  BB_RANGE("gdn_cp_rule_forward");
  const Tensor cu = cu_seqlens(mb);
  if (route(mb) != Route::states)
    return gated_delta_rule_forward(q, k, v, g, beta, cu, opts, MemCategory::activations, keep);
  if (keep != nullptr) *keep = GatedDeltaPrep{};
  const Pieces& pc = pieces(mb);
  const int64_t P = pc.P, r = pc.r, B = static_cast<int64_t>(pc.seqlens.size());
  const int64_t Hv = v.size(1), K = k.size(2), V = v.size(2);
  GatedDeltaSummary sum = gated_delta_rule_summary(q, k, v, g, beta, cu, opts, MemCategory::activations);
  const Gathered all(*group_, sum.transition, sum.end_state, B);
  // S_start(c) = P_{c-1} S_start(c-1) + E_{c-1}, from zero at chunk 0, up to this rank's chunks.
  Tensor start = Tensor::empty({2 * B, Hv, K, V}, DType::f32, q.device(), MemCategory::activations);
  for (int64_t b = 0; b < B; ++b) {
    Tensor S = Tensor::zeros({Hv, K, V}, DType::f32, q.device(), MemCategory::workspace);
    for (int64_t c = 0;; ++c) {
      if (c == r || c == 2 * P - 1 - r) {
        Tensor dst = start.narrow(slot_of(b, c, P), 1).view({Hv, K, V});
        dst.copy_from(S);
        if (c == 2 * P - 1 - r) break;
      }
      Tensor next = all.state(b, c).clone(MemCategory::workspace);
      matmul_batched(all.trans(b, c), false, S, false, next, 1.f, 1.f);
      S = std::move(next);
    }
  }
  Tensor o = gated_delta_rule_forward(q, k, v, g, beta, cu, opts, MemCategory::activations, nullptr, &start);
  if (saved != nullptr) {
    saved->start = start;
    saved->transition = sum.transition;
  }
  return o;
}

GatedDeltaGrads GdnContextParallel::rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& g, const Tensor& beta, const MicroBatch& mb,
                                                  const GatedDeltaOptions& opts, GatedDeltaPrep* prep,
                                                  const GdnCpSaved& saved) const {
  BB_RANGE("gdn_cp_rule_backward");
  const Tensor cu = cu_seqlens(mb);
  if (route(mb) != Route::states) return gated_delta_rule_backward(d_o, q, k, v, g, beta, cu, opts, prep);
  BB_CHECK(saved.start.defined() && saved.transition.defined(),
           "GdnContextParallel::rule_backward: the forward's start states are missing");
  const Pieces& pc = pieces(mb);
  const int64_t P = pc.P, r = pc.r, B = static_cast<int64_t>(pc.seqlens.size());
  const int64_t Hv = v.size(1), K = k.size(2), V = v.size(2);
  const Gathered all(*group_, saved.transition, gated_delta_rule_start_grad(d_o, q, k, v, g, beta, cu, opts), B);
  // dS_end(c) = D_{c+1} + P_{c+1}^T dS_end(c+1), zero after the last chunk, down to this rank's.
  Tensor d_end = Tensor::empty({2 * B, Hv, K, V}, DType::f32, q.device(), MemCategory::workspace);
  for (int64_t b = 0; b < B; ++b) {
    Tensor G = Tensor::zeros({Hv, K, V}, DType::f32, q.device(), MemCategory::workspace);
    for (int64_t c = 2 * P - 1;; --c) {
      if (c == r || c == 2 * P - 1 - r) {
        Tensor dst = d_end.narrow(slot_of(b, c, P), 1).view({Hv, K, V});
        dst.copy_from(G);
        if (c == r) break;
      }
      Tensor next = all.state(b, c).clone(MemCategory::workspace);
      matmul_batched(all.trans(b, c), true, G, false, next, 1.f, 1.f);
      G = std::move(next);
    }
  }
  if (prep != nullptr) *prep = GatedDeltaPrep{};
  return gated_delta_rule_backward(d_o, q, k, v, g, beta, cu, opts, nullptr, &saved.start, &d_end);
}

}  // namespace bb

// context_parallel.cpp — the attention family's members (context_parallel.h): sdpa, cp_ring and
// cp_a2a over head-tail context shards (core/context_shard.h).
#include "primitives/attention/context_parallel.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/trace.h"
#include "primitives/attention/cp_ops.h"

namespace bb {
namespace {

constexpr MemCategory kAct = MemCategory::activations;
constexpr MemCategory kWs = MemCategory::workspace;

int64_t group_size(const comm::GroupPtr& g) { return g ? g->size() : 1; }

// The shard the group must hold: size and rank agree with the micro-batch's.
void check_shard(const char* member, const comm::GroupPtr& g, const MicroBatch& mb) {
  const int64_t P = group_size(g), r = g ? g->rank() : 0;
  if (!mb.shard.split()) {
    BB_CHECK(P == 1, member, ": the micro-batch is whole but the context-parallel group has ", P,
             " ranks; shard it first (runtime/context_shard.h)");
    return;
  }
  BB_CHECK(mb.shard.cp == P && mb.shard.rank == r, member, ": the micro-batch is shard ", mb.shard.rank, " of ",
           mb.shard.cp, " but this rank is ", r, " of a context-parallel group of ", P);
}

Tensor offsets(const std::vector<int64_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + static_cast<int32_t>(l));
  return Tensor::from_ints(cu, {static_cast<int64_t>(cu.size())}, MemCategory::other);
}

// Moves `send` to the next rank of the ring and receives the previous rank's block into `recv`
// (one all-to-all-v with a single non-empty pair each way: NCCL groups it, so a ring of sends
// cannot deadlock).
comm::WorkPtr ring_shift(comm::Group& g, const Tensor& send, const Tensor& recv) {
  const int P = g.size(), r = g.rank();
  std::vector<int64_t> sc(static_cast<size_t>(P), 0), rc(static_cast<size_t>(P), 0);
  sc[static_cast<size_t>((r + 1) % P)] = send.size(0);
  rc[static_cast<size_t>((r + P - 1) % P)] = recv.size(0);
  return g.all_to_all_v(send, sc, recv, rc, Stream::cp);
}

// [2T, H, D]: k then v (one message per ring step).
Tensor pack_kv(const Tensor& k, const Tensor& v, MemCategory cat) {
  const int64_t T = k.size(0);
  Tensor kv = Tensor::empty({2 * T, k.size(1), k.size(2)}, k.dtype(), k.device(), cat);
  if (T > 0) {
    kv.narrow(0, T).copy_from(k);
    kv.narrow(T, T).copy_from(v);
  }
  return kv;
}

bool is_identity(const std::vector<int64_t>& rows, int64_t n) {
  if (static_cast<int64_t>(rows.size()) != n) return false;
  for (int64_t i = 0; i < n; ++i)
    if (rows[static_cast<size_t>(i)] != i) return false;
  return true;
}

Tensor rows_of(const Tensor& t, const std::vector<int64_t>& rows) {
  return is_identity(rows, t.size(0)) ? t : cp::gather_rows(t, rows, kWs);
}

// ---- sdpa -----------------------------------------------------------------------------------

class SdpaAttention final : public SelfAttention {
 public:
  const char* name() const override { return "sdpa"; }
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const MicroBatch& mb, float scale,
                 AttentionSaved* saved) override {
    BB_CHECK(!mb.shard.split(), "primitives.attention = \"sdpa\" attends within one rank's tokens, but the "
             "micro-batch is split over ", mb.shard.cp, " context-parallel ranks; set primitives.attention = "
             "\"cp_ring\" or \"cp_a2a\"");
    return attention_forward(q, k, v, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
  }
  AttentionGrads backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const MicroBatch& mb, float scale, const AttentionSaved& saved) override {
    return attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
  }
};

// ---- cp_ring --------------------------------------------------------------------------------

// What this rank's queries see of the KV block of rank s (s != r), as packed pseudo-sequences:
// query rows (local), key rows (in s's block), one offsets pair, all with mask `none` (every
// visible key lies wholly before the queries). Pseudo-sequences with no query or no key are left
// out (their rows get nothing from s).
struct RingStep {
  std::vector<int64_t> q_rows, k_rows;
  Tensor cu_q, cu_kv;
  bool empty() const { return q_rows.empty() || k_rows.empty(); }
};

RingStep ring_step(const cp_layout::RankLayout& me, const cp_layout::RankLayout& peer, bool peer_before) {
  RingStep st;
  std::vector<int64_t> ql, kl;
  for (size_t b = 0; b < me.seqs.size(); ++b) {
    const cp_layout::RankSeq &m = me.seqs[b], &p = peer.seqs[b];
    // Peer before me in the ring order (s < r): all my rows see the peer's head chunk.
    // Peer after me (s > r): my tail chunk sees both of the peer's chunks.
    const int64_t q0 = peer_before ? m.local_begin : m.local_begin + m.head;
    const int64_t nq = peer_before ? m.head + m.tail : m.tail;
    const int64_t nk = peer_before ? p.head : p.head + p.tail;
    if (nq == 0 || nk == 0) continue;
    for (int64_t i = 0; i < nq; ++i) st.q_rows.push_back(q0 + i);
    for (int64_t i = 0; i < nk; ++i) st.k_rows.push_back(p.local_begin + i);
    ql.push_back(nq);
    kl.push_back(nk);
  }
  if (!st.empty()) {
    st.cu_q = offsets(ql);
    st.cu_kv = offsets(kl);
  }
  return st;
}

class RingAttention final : public SelfAttention {
 public:
  explicit RingAttention(comm::GroupPtr g) : group_(std::move(g)) {}
  const char* name() const override { return "cp_ring"; }

  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const MicroBatch& mb, float scale,
                 AttentionSaved* saved) override {
    BB_RANGE("cp_ring_forward");
    check_shard(name(), group_, mb);
    if (!mb.shard.split()) return attention_forward(q, k, v, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
    const int64_t P = group_->size(), r = group_->rank(), T = q.size(0), D = q.size(2);
    const std::vector<cp_layout::RankLayout> L = layouts(mb);
    BB_CHECK(L[static_cast<size_t>(r)].tokens == T, name(), ": q has ", T, " rows but the shard holds ",
             L[static_cast<size_t>(r)].tokens);
    // Step t attends the KV block of rank s = r - t while block s - 1 travels to this rank
    // (double buffered: `cur` is read by the attention and sent on, `nxt` is being received).
    // Step 0 is my own block, causal over the local sequences (chunk r then chunk 2P-1-r: the
    // local order is the causal order).
    Tensor o_acc, lse_acc;
    Tensor cur = pack_kv(k, v, kWs);
    int64_t s = r;
    for (int64_t t = 0; t < P; ++t) {
      Tensor nxt;
      comm::WorkPtr w;
      const int64_t sn = (s - 1 + P) % P;
      if (t + 1 < P) {
        nxt = Tensor::empty({2 * L[static_cast<size_t>(sn)].tokens, k.size(1), D}, k.dtype(), k.device(), kWs);
        w = ring_shift(*group_, cur, nxt);
      }
      if (t == 0) {
        AttentionSaved part;
        o_acc = attention_forward(q, k, v, AttentionArgs::causal_self(mb.cu_seqlens, scale), &part)
                    .to_dtype(DType::f32, kWs);
        lse_acc = part.lse;
      } else if (const RingStep st = ring_step(L[static_cast<size_t>(r)], L[static_cast<size_t>(s)], s < r);
                 !st.empty()) {
        const int64_t Ts = L[static_cast<size_t>(s)].tokens;
        AttentionSaved ps;
        Tensor op = attention_forward(rows_of(q, st.q_rows), cp::gather_rows(cur.narrow(0, Ts), st.k_rows, kWs),
                                      cp::gather_rows(cur.narrow(Ts, Ts), st.k_rows, kWs),
                                      AttentionArgs{st.cu_q, st.cu_kv, AttentionMask::none, scale}, &ps);
        cp::merge_partial(o_acc, lse_acc, op, ps.lse, st.q_rows);
      }
      if (w) {
        w->wait();
        cur = nxt;
        s = sn;
      }
    }
    if (saved) saved->lse = lse_acc;
    return o_acc.to_dtype(q.dtype(), kAct);
  }

  AttentionGrads backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const MicroBatch& mb, float scale, const AttentionSaved& saved) override {
    BB_RANGE("cp_ring_backward");
    check_shard(name(), group_, mb);
    if (!mb.shard.split())
      return attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
    const int64_t P = group_->size(), r = group_->rank(), T = q.size(0), D = q.size(2), Hkv = k.size(1);
    const std::vector<cp_layout::RankLayout> L = layouts(mb);
    Tensor dq;  // f32 accumulators, started by step 0
    // Step t: block s = r - t is here (prefetched during step t - 1), and its f32 gradient
    // accumulator (what the ranks before added) is arriving from the previous rank; the step's
    // attention backward runs before it waits for the accumulator, so that transfer overlaps the
    // step's compute; the accumulator moves on once this rank has added its part.
    Tensor cur = pack_kv(k, v, kWs);
    Tensor dcur;
    comm::WorkPtr wd;  // the transfer into dcur, if one is in flight
    int64_t s = r;
    for (int64_t t = 0; t < P; ++t) {
      const int64_t sn = (s - 1 + P) % P, Ts = L[static_cast<size_t>(s)].tokens, Tn = L[static_cast<size_t>(sn)].tokens;
      Tensor nxt;
      comm::WorkPtr wk;
      if (t + 1 < P) {
        nxt = Tensor::empty({2 * Tn, Hkv, D}, k.dtype(), k.device(), kWs);
        wk = ring_shift(*group_, cur, nxt);
      }
      if (t == 0) {
        AttentionGrads g = attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
        dq = g.dq.to_dtype(DType::f32, kWs);
        dcur = pack_kv(g.dk, g.dv, kWs).to_dtype(DType::f32, kWs);
      } else if (const RingStep st = ring_step(L[static_cast<size_t>(r)], L[static_cast<size_t>(s)], s < r);
                 !st.empty()) {
        AttentionSaved ls;
        ls.lse = cp::gather_cols(saved.lse, st.q_rows, kWs);
        AttentionGrads g = attention_backward(
            rows_of(d_o, st.q_rows), rows_of(q, st.q_rows), cp::gather_rows(cur.narrow(0, Ts), st.k_rows, kWs),
            cp::gather_rows(cur.narrow(Ts, Ts), st.k_rows, kWs), rows_of(o, st.q_rows),
            AttentionArgs{st.cu_q, st.cu_kv, AttentionMask::none, scale}, ls);
        cp::scatter_add_rows(dq, g.dq, st.q_rows);
        if (wd) wd->wait();
        wd = nullptr;
        Tensor dk_rows = dcur.narrow(0, Ts), dv_rows = dcur.narrow(Ts, Ts);
        cp::scatter_add_rows(dk_rows, g.dk, st.k_rows);
        cp::scatter_add_rows(dv_rows, g.dv, st.k_rows);
      }
      if (wk) {
        if (wd) wd->wait();  // nothing of mine for this block: forward what arrived
        Tensor dnxt = Tensor::empty({2 * Tn, Hkv, D}, DType::f32, k.device(), kWs);
        wd = ring_shift(*group_, dcur, dnxt);
        wk->wait();
        cur = nxt;
        dcur = dnxt;
        s = sn;
      }
    }
    if (wd) wd->wait();
    // The accumulator in hand is block r + 1's, complete: it goes home; mine arrives.
    Tensor mine = Tensor::empty({2 * T, Hkv, D}, DType::f32, k.device(), kWs);
    ring_shift(*group_, dcur, mine)->wait();
    dcur = Tensor();
    AttentionGrads out;
    out.dq = dq.to_dtype(q.dtype(), kAct);
    out.dk = mine.narrow(0, T).to_dtype(k.dtype(), kAct);
    out.dv = mine.narrow(T, T).to_dtype(v.dtype(), kAct);
    return out;
  }

 private:
  std::vector<cp_layout::RankLayout> layouts(const MicroBatch& mb) const {
    std::vector<cp_layout::RankLayout> L;
    for (int64_t s = 0; s < mb.shard.cp; ++s) L.push_back(cp_layout::rank_layout(mb.shard.seqlens, mb.shard.cp, s));
    return L;
  }
  comm::GroupPtr group_;
};

// ---- cp_a2a ---------------------------------------------------------------------------------

// The head split of P ranks: rank j attends query heads [q_start[j], + hq) and needs KV heads
// [kv_start[j], + hk).
struct HeadSplit {
  int64_t hq = 0, hk = 0;
  std::vector<int64_t> q_start, kv_start;
};

HeadSplit head_split(int64_t Hq, int64_t Hkv, int64_t P) {
  check_cp_a2a_heads(Hq, Hkv, P);
  HeadSplit h;
  h.hq = Hq / P;
  const int64_t group = Hq / Hkv;  // query heads per KV head
  h.hk = Hkv >= P ? Hkv / P : 1;
  for (int64_t j = 0; j < P; ++j) {
    h.q_start.push_back(j * h.hq);
    h.kv_start.push_back(j * h.hq / group);
  }
  return h;
}

// The order maps between the rank-major concatenation of every rank's rows (what an all-to-all
// delivers) and the whole micro-batch's packed order.
struct SeqOrder {
  std::vector<int64_t> counts;        // [P] rows per rank
  std::vector<int64_t> to_global;     // global row i <- rank-major row to_global[i]
  std::vector<int64_t> to_rank_major; // rank-major row m <- global row to_rank_major[m]
  Tensor cu;                          // the whole sequences' offsets
};

SeqOrder seq_order(const MicroBatch& mb) {
  SeqOrder o;
  const int64_t P = mb.shard.cp;
  for (int64_t j = 0; j < P; ++j) {
    std::vector<int64_t> rows = cp_layout::global_rows(mb.shard.seqlens, P, j);
    o.counts.push_back(static_cast<int64_t>(rows.size()));
    o.to_rank_major.insert(o.to_rank_major.end(), rows.begin(), rows.end());
  }
  o.to_global.assign(o.to_rank_major.size(), 0);
  for (size_t m = 0; m < o.to_rank_major.size(); ++m) o.to_global[static_cast<size_t>(o.to_rank_major[m])] = static_cast<int64_t>(m);
  o.cu = offsets(mb.shard.seqlens);
  return o;
}

// An all-to-all posted on the cp stream: the buffer it fills and its Work (which keeps the send
// buffer alive).
struct Posted {
  Tensor recv;
  comm::WorkPtr work;
  Tensor wait() {
    if (work) work->wait();
    work.reset();
    return recv;
  }
};

// Sequence-sharded [T, H, D] -> head-sharded [T_all, hc, D], posted: wait() gives the rows in
// rank-major order (to_heads_rows puts them in global order).
Posted post_to_heads(comm::Group& g, const Tensor& x, const std::vector<int64_t>& start, int64_t hc,
                     const SeqOrder& so) {
  const int64_t P = g.size(), T = x.size(0);
  Tensor send = cp::split_heads(x, start, hc, kWs);
  const int64_t total = std::accumulate(so.counts.begin(), so.counts.end(), int64_t{0});
  Posted p;
  p.recv = Tensor::empty({total, hc, x.size(2)}, x.dtype(), x.device(), kWs);
  p.work = g.all_to_all_v(send, std::vector<int64_t>(static_cast<size_t>(P), T), p.recv, so.counts, Stream::cp);
  return p;
}
Tensor to_heads_rows(Posted& p, const SeqOrder& so, MemCategory cat) {
  return cp::gather_rows(p.wait(), so.to_global, cat);
}
Tensor to_heads(comm::Group& g, const Tensor& x, const std::vector<int64_t>& start, int64_t hc, const SeqOrder& so,
                MemCategory cat) {
  Posted p = post_to_heads(g, x, start, hc, so);
  return to_heads_rows(p, so, cat);
}

// Head-sharded [T_all, hc, D] in global order -> this rank's rows, [P T, hc, D] (block j from
// rank j: its heads of my rows), posted.
Posted post_from_heads(comm::Group& g, const Tensor& xh, int64_t T_local, const SeqOrder& so) {
  const int64_t P = g.size();
  Tensor send = cp::gather_rows(xh, so.to_rank_major, kWs);
  Posted p;
  p.recv = Tensor::empty({P * T_local, xh.size(1), xh.size(2)}, xh.dtype(), xh.device(), kWs);
  p.work = g.all_to_all_v(send, so.counts, p.recv, std::vector<int64_t>(static_cast<size_t>(P), T_local), Stream::cp);
  return p;
}

class A2aAttention final : public SelfAttention {
 public:
  explicit A2aAttention(comm::GroupPtr g) : group_(std::move(g)) {}
  const char* name() const override { return "cp_a2a"; }

  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const MicroBatch& mb, float scale,
                 AttentionSaved* saved) override {
    BB_RANGE("cp_a2a_forward");
    check_shard(name(), group_, mb);
    if (!mb.shard.split()) return attention_forward(q, k, v, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
    comm::Group& g = *group_;
    const HeadSplit hs = head_split(q.size(1), k.size(1), g.size());
    const SeqOrder so = seq_order(mb);
    AttentionSaved local;
    AttentionSaved& S = saved ? *saved : local;
    // The three exchanges posted back to back: k's and v's head split run while q travels.
    Posted pq = post_to_heads(g, q, hs.q_start, hs.hq, so);
    Posted pk = post_to_heads(g, k, hs.kv_start, hs.hk, so);
    Posted pv = post_to_heads(g, v, hs.kv_start, hs.hk, so);
    S.q = to_heads_rows(pq, so, kAct);
    S.k = to_heads_rows(pk, so, kAct);
    S.v = to_heads_rows(pv, so, kAct);
    S.o = attention_forward(S.q, S.k, S.v, AttentionArgs::causal_self(so.cu, scale), &S);
    Posted back = post_from_heads(g, S.o, q.size(0), so);
    Tensor o = Tensor::empty(q.shape(), q.dtype(), q.device(), kAct);
    cp::join_heads(o, back.wait(), hs.q_start, hs.hq, /*accumulate=*/false);
    return o;
  }

  AttentionGrads backward(const Tensor& d_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const MicroBatch& mb, float scale, const AttentionSaved& saved) override {
    BB_RANGE("cp_a2a_backward");
    check_shard(name(), group_, mb);
    if (!mb.shard.split())
      return attention_backward(d_o, q, k, v, o, AttentionArgs::causal_self(mb.cu_seqlens, scale), saved);
    BB_CHECK(saved.q.defined() && saved.o.defined(), name(), ": backward without the forward's saved state");
    comm::Group& g = *group_;
    const HeadSplit hs = head_split(q.size(1), k.size(1), g.size());
    const SeqOrder so = seq_order(mb);
    const int64_t T = q.size(0);
    Tensor d_oh = to_heads(g, d_o, hs.q_start, hs.hq, so, kWs);
    AttentionGrads gh = attention_backward(d_oh, saved.q, saved.k, saved.v, saved.o,
                                           AttentionArgs::causal_self(so.cu, scale), saved);
    d_oh = Tensor();
    // The three gradients' exchanges posted back to back, joined in the same order.
    Posted bq = post_from_heads(g, gh.dq, T, so);
    Posted bk = post_from_heads(g, gh.dk, T, so);
    Posted bv = post_from_heads(g, gh.dv, T, so);
    gh = AttentionGrads{};
    AttentionGrads out;
    out.dq = Tensor::empty(q.shape(), q.dtype(), q.device(), kAct);
    cp::join_heads(out.dq, bq.wait(), hs.q_start, hs.hq, false);
    // KV heads replicated to several ranks collect one gradient piece from each.
    Tensor dk = Tensor::zeros(k.shape(), DType::f32, k.device(), kWs);
    Tensor dv = Tensor::zeros(v.shape(), DType::f32, v.device(), kWs);
    cp::join_heads(dk, bk.wait(), hs.kv_start, hs.hk, true);
    cp::join_heads(dv, bv.wait(), hs.kv_start, hs.hk, true);
    out.dk = dk.to_dtype(k.dtype(), kAct);
    out.dv = dv.to_dtype(v.dtype(), kAct);
    return out;
  }

 private:
  comm::GroupPtr group_;
};

}  // namespace

void check_cp_a2a_heads(int64_t num_heads, int64_t num_kv_heads, int64_t cp) {
  BB_CHECK(num_heads % cp == 0, "primitives.attention = \"cp_a2a\" splits the ", num_heads,
           " query heads over parallel.cp = ", cp, " ranks, which does not divide them; choose cp among the "
           "divisors of ", num_heads, " or use primitives.attention = \"cp_ring\" (any head count)");
  BB_CHECK(num_kv_heads % cp == 0 || cp % num_kv_heads == 0, "primitives.attention = \"cp_a2a\": the ",
           num_kv_heads, " KV heads can be neither split over parallel.cp = ", cp, " ranks nor replicated evenly "
           "(needs kv heads % cp == 0 or cp % kv heads == 0); use primitives.attention = \"cp_ring\"");
}

struct HeadExchange::Orders {
  std::vector<int64_t> seqlens;
  int64_t cp = 0, rank = 0;
  SeqOrder so;
};

const HeadExchange::Orders& HeadExchange::orders(const MicroBatch& mb) const {
  if (!cache_ || cache_->cp != mb.shard.cp || cache_->rank != mb.shard.rank || cache_->seqlens != mb.shard.seqlens) {
    auto o = std::make_shared<Orders>();
    o->seqlens = mb.shard.seqlens;
    o->cp = mb.shard.cp;
    o->rank = mb.shard.rank;
    o->so = seq_order(mb);
    cache_ = std::move(o);
  }
  return *cache_;
}

std::pair<int64_t, int64_t> HeadExchange::my_heads(int64_t num_heads, const MicroBatch& mb, const char* what) const {
  if (!mb.shard.split()) return {0, num_heads};
  check_shard("context-parallel head exchange", group_, mb);
  const int64_t P = group_->size();
  BB_CHECK(num_heads % P == 0, what, ": ", num_heads, " heads cannot be split over ", P,
           " context-parallel ranks (cp must divide them)");
  return {group_->rank() * (num_heads / P), num_heads / P};
}

Tensor PendingExchange::get() {
  if (finish_) {
    ready_ = finish_();
    finish_ = nullptr;
  }
  return std::move(ready_);
}

Tensor HeadExchange::to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const {
  return start_to_heads(x, num_heads, mb, cat).get();
}

Tensor HeadExchange::from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb, MemCategory cat) const {
  return start_from_heads(xh, num_heads, mb, cat).get();
}

PendingExchange HeadExchange::start_to_heads(const Tensor& x, int64_t num_heads, const MicroBatch& mb,
                                             MemCategory cat) const {
  if (!mb.shard.split()) return PendingExchange(x);
  const int64_t P = group_->size(), T = x.size(0), hd = x.size(1) / num_heads;
  BB_CHECK(x.dim() == 2 && hd * num_heads == x.size(1), "HeadExchange::to_heads: ", x.str(), " is not [T, ",
           num_heads, " x head_dim]");
  const auto [first, count] = my_heads(num_heads, mb, "HeadExchange::to_heads");
  (void)first;
  std::vector<int64_t> start;
  for (int64_t j = 0; j < P; ++j) start.push_back(j * count);
  orders(mb);
  std::shared_ptr<const Orders> o = cache_;  // the finish may come after another micro-batch's orders
  auto posted = std::make_shared<Posted>(post_to_heads(*group_, x.view({T, num_heads, hd}), start, count, o->so));
  const int64_t hc = count;  // (a structured binding cannot be captured before C++20's P1091)
  return PendingExchange(std::function<Tensor()>([posted, o, cat, hc, hd] {
    Tensor h = to_heads_rows(*posted, o->so, cat);
    return h.view({h.size(0), hc * hd});
  }));
}

PendingExchange HeadExchange::start_from_heads(const Tensor& xh, int64_t num_heads, const MicroBatch& mb,
                                               MemCategory cat) const {
  if (!mb.shard.split()) return PendingExchange(xh);
  const int64_t P = group_->size();
  const auto [first, count] = my_heads(num_heads, mb, "HeadExchange::from_heads");
  (void)first;
  const int64_t hd = xh.size(1) / count;
  BB_CHECK(xh.dim() == 2 && hd * count == xh.size(1), "HeadExchange::from_heads: ", xh.str(), " is not [T, ",
           count, " x head_dim]");
  orders(mb);
  std::shared_ptr<const Orders> o = cache_;
  const int64_t T = o->so.counts[static_cast<size_t>(group_->rank())];
  auto posted = std::make_shared<Posted>(post_from_heads(*group_, xh.view({xh.size(0), count, hd}), T, o->so));
  std::vector<int64_t> start;
  for (int64_t j = 0; j < P; ++j) start.push_back(j * count);
  const DType dt = xh.dtype();
  const Device dev = xh.device();
  const int64_t hc = count;
  return PendingExchange(std::function<Tensor()>([posted, start, hc, hd, T, num_heads, dt, dev, cat] {
    Tensor out = Tensor::empty({T, num_heads, hd}, dt, dev, cat);
    cp::join_heads(out, posted->wait(), start, hc, /*accumulate=*/false);
    return out.view({T, num_heads * hd});
  }));
}

Tensor HeadExchange::cu_seqlens(const MicroBatch& mb) const {
  return mb.shard.split() ? orders(mb).so.cu : mb.cu_seqlens;
}

std::unique_ptr<SelfAttention> make_sdpa_attention(const SelfAttentionConfig&) {
  return std::make_unique<SdpaAttention>();
}

std::unique_ptr<SelfAttention> make_cp_ring_attention(const SelfAttentionConfig& cfg) {
  return std::make_unique<RingAttention>(cfg.group);
}

std::unique_ptr<SelfAttention> make_cp_a2a_attention(const SelfAttentionConfig& cfg) {
  return std::make_unique<A2aAttention>(cfg.group);
}

}  // namespace bb

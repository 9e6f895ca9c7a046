#include "plan/estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "comm/emulated.h"
#include "comm/link_model.h"
#include "core/error.h"
#include "models/decoder.h"
#include "primitives/loss/policy.h"
#include "runtime/state.h"
#include "runtime/trainer.h"

namespace bb::plan {

int64_t Bytes::total() const {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

Bytes& Bytes::operator+=(const Bytes& o) {
  for (size_t i = 0; i < v.size(); ++i) v[i] += o.v[i];
  return *this;
}

void Bytes::max_with(const Bytes& o) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], o.v[i]);
}

namespace {

using C = MemCategory;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round256(int64_t x) { return ceil_div(x, 256) * 256; }

// The state family's view of one unit on this rank.
struct UnitMem {
  UnitKind kind = UnitKind::dense;
  int64_t layer = -1;
  int64_t n = 0, N = 1, S = 0;  // elements, group size, shard size
  int64_t vb = 2;               // value bytes
  bool whole = true;            // one rank holds it (N = 1 or replicated)
  // fsdp: gathered values V, the whole f32 gradient G. A reduction in flight holds RF = Gkeep (the
  // f32 gradient it reads, f32 reductions) + Out (its output, a bf16 copy of the input for bf16
  // reductions, MPI's f32 staging of 16-bit reductions); draining it briefly adds Tmp.
  int64_t V = 0, G = 0, Gkeep = 0, Out = 0, Tmp = 0;
  int64_t RF() const { return Gkeep + Out; }
};

// Sizes of one micro-batch's tensors on this rank (skills/planner.md's notation).
struct Dims {
  int64_t T = 0, H = 0, Hq = 0, Hkv = 0, D = 0, Q = 0, K = 0, I = 0, V = 0;
  int64_t E = 0, El = 0, top_k = 0, F = 0, Ssh = 0, N = 0, M = 0;
  int64_t Hk = 0, Hv = 0, Dk = 0, Dv = 0, CK = 0, Z = 0, Cc = 0, W = 0;
  int64_t a = 4;   // bytes of an activation (the parameter dtype)
  int64_t c = 0;   // 1 when a is not 4 (a converted copy exists)
  bool cuda = false;
  bool gate = false, qk_norm = true;
  int64_t nc = 0;  // Gated DeltaNet 64-token chunks (one sequence per micro-batch: ceil(T / 64))
};

// One block's memory, relative to what is live before it (the layer stream's input X excluded).
struct BlockMem {
  int64_t keep = 0;       // activations kept for the backward under the policy
  int64_t keep_none = 0;  // the same with nothing dropped (what the backward rebuilds to)
  int64_t keep_full = 0;  // under full recompute, past the layer's forward (the MoE routing stash)
  int64_t prep = 0;       // of keep_none: the part the block's backward frees first (the GDN prep)
  int64_t fwd = 0;        // activations beyond keep_none at the forward's peak (output excluded)
  int64_t bwd = 0;        // activations beyond keep_none - prep at the backward's peak (d_y included)
  // MLP-position blocks (dense MLP, MoE), relative to the block's entry (its input excluded):
  int64_t fwd_total = 0;  // activations at the forward's peak, the block's own kept tensors included
  int64_t bwd_total = 0;  // activations at the backward's peak (from the kept state, d_y included)
  int64_t after = 0;      // activations the block still holds while the layer's token mixer runs backward
  int64_t moe_keep = 0;     // moe-category bytes kept for the backward
  int64_t moe_fwd = 0;      // moe-category peak of the forward (the block's own kept bytes included)
  int64_t moe_bwd = 0;      // moe-category peak of the backward beyond moe_keep
  int64_t moe_after = 0;    // moe-category bytes held while the token mixer runs backward
  int64_t moe_rebuild = 0;  // moe-category peak of a full-recompute forward
  // MoE terms a token-chunked layer recombines (moe_block): the experts' fc1 output and
  // activation, the routed forward's transient beyond them, the routed backward's transient
  // (b1 without a selective rebuild), the row-probability gradient, and the activations held
  // after the routed backward relative to the kept state.
  int64_t exp = 0, route_f = 0, b1r = 0, rd = 0, after_local = 0;
};

BlockMem attention_block(const Dims& d, const RecomputeParts& drop, const RunConfig& cfg) {
  const int64_t T = d.T, a = d.a, H = d.H, Q = d.Q, K = d.K;
  const int64_t g = d.gate ? 1 : 0, n = d.qk_norm ? 1 : 0;
  BlockMem b;
  b.keep_none = T * (a * H + 4 + a * (3 + 2 * g) * Q + 3 * a * K + 4 * d.Hq * (1 + n) + 4 * n * d.Hkv);
  if (cfg.prim.attention.name == "cp_a2a" && cfg.cp > 1) {
    // The head-sharded q, k, v, o and lse the member keeps beside the block's own (T_all = the
    // whole micro-batch's tokens).
    const int64_t P = cfg.cp, Tall = T * P, hq = d.Hq / P, hk = std::max<int64_t>(1, d.Hkv / P);
    b.keep_none += a * Tall * (2 * hq + 2 * hk) * d.D + 4 * hq * Tall;
  }
  int64_t dropped = 0;
  if (drop.has(RecomputePart::norms)) dropped += a * T * H;
  if (drop.has(RecomputePart::attention)) dropped += a * T * (Q + K) + g * a * T * Q;
  if (drop.has(RecomputePart::core_attention))
    dropped += a * T * Q + 4 * d.Hq * T + (drop.has(RecomputePart::attention) ? 0 : g * a * T * Q);
  b.keep = b.keep_none - dropped;
  b.fwd = 2 * g * a * T * Q + n * a * T * (Q + K) + 4 * T * H + d.c * a * T * H;
  if (d.gate) {
    const int64_t w = a, cw = d.c * w;
    b.bwd = std::max({4 * T * H + (2 * a + 20) * T * Q, 8 * T * H + (2 * a + 16 + 2 * cw) * T * Q,
                      12 * T * H + (2 * a + 16) * T * Q}) +
            (3 * a + 4) * T * K;
  } else if (n) {
    b.bwd = 12 * T * H + (3 * a + 4) * T * (Q + K);
  } else {
    b.bwd = std::max(12 * T * H + (2 * a + 4) * T * (Q + K), 8 * T * H + (2 * a + 4) * T * (Q + K) + d.c * a * T * Q);
  }
  return b;
}

// The Gated DeltaNet's prep buffer (CUDA, bf16 inputs): kept from the rule's forward to its backward.
int64_t gdn_prep(const Dims& d) {
  if (!d.cuda) return 0;
  const int64_t T = d.T;
  const int64_t p = 2 * round256(2 * T * d.Hk * 128) + 2 * round256(2 * T * d.Hv * 128) +
                    2 * round256(2 * T * d.Hv * 64) + round256(4 * T * d.Hv) + round256(4 * d.nc * d.Hv);
  return p <= (int64_t{4} << 30) ? p : 0;
}

BlockMem gdn_block(const Dims& d, const RecomputeParts& drop) {
  const int64_t T = d.T, a = d.a, H = d.H, C3 = d.Cc, Z = d.Z, Hv = d.Hv, CK = d.CK;
  BlockMem b;
  const int64_t prep = gdn_prep(d);
  if (d.cuda) {
    b.keep_none = T * (a * H + 4 + (4 + a) * C3 + 3 * a * Z + (a + 8) * Hv) + prep;
  } else {
    b.keep_none = 4 * T * (H + 1 + 2 * C3 + 3 * Z + 3 * Hv);
  }
  b.prep = prep;
  int64_t dropped = 0;
  if (drop.has(RecomputePart::norms)) dropped += a * T * H;
  if (drop.has(RecomputePart::gdn)) dropped += (d.cuda ? a : 4) * T * C3 + prep;
  b.keep = b.keep_none - dropped;
  b.fwd = 4 * T * H + d.c * a * T * H;
  const int64_t p1 = 4 * T * H + 16 * T * Z + 8 * T * CK + 8 * T * Hv + prep;
  const int64_t p2 = d.cuda ? 4 * T * H + 16 * T * Z + 12 * T * CK + 12 * T * Hv + d.c * 4 * Z * d.W
                            : 4 * T * H + 16 * T * Z + 16 * T * CK + 16 * T * Hv;
  b.bwd = std::max({p1, p2, 12 * T * H + 4 * T * Z});
  return b;
}

BlockMem mlp_block(const Dims& d, const RecomputeParts& drop) {
  const int64_t T = d.T, a = d.a, H = d.H, I = d.I;
  BlockMem b;
  b.keep_none = T * (a * H + 4 + 3 * a * I);
  int64_t dropped = 0;
  if (drop.has(RecomputePart::norms)) dropped += a * T * H;
  if (drop.has(RecomputePart::mlp)) dropped += 3 * a * T * I;
  b.keep = b.keep_none - dropped;
  b.fwd = 4 * T * H + d.c * a * T * H;
  b.bwd = 12 * T * H + (4 + 2 * a) * T * I;
  b.fwd_total = b.keep_none + b.fwd;
  b.bwd_total = b.keep_none + b.bwd;  // the dropped parts are rebuilt first
  b.after = b.keep_none;
  return b;
}

// How long a collective's buffers live: CPU groups (MPI on CPU tensors, the emulated and one-rank
// groups) free them at the wait or hold nothing; NCCL and the emulated GPU backend keep them until
// the operation's handle is released (the end of the dispatcher's forward or backward).
enum class Holds { nothing, until_wait, until_return };

// Chunk k's rows of runs of `n` rows each (DispatchRows: every run split into C near-equal parts).
int64_t chunk_len(int64_t n, int64_t k, int64_t C) { return n * (k + 1) / C - n * k / C; }

// The MoE block: router, permute, the dispatcher's buffers, the experts, the shared expert
// (skills/planner.md; on CPU ranks each term is checked to the byte).
BlockMem moe_block_whole(const Dims& d, const RecomputeParts& drop, const RunConfig& cfg, Holds holds) {
  const int64_t T = d.T, a = d.a, H = d.H, E = d.E, Kt = d.top_k, F = d.F, S = d.Ssh, N = d.N, M = d.M;
  const int64_t sh = S > 0 ? 1 : 0;
  const bool me = cfg.prim.permute.value == PermuteMode::memory_efficient;
  const int64_t mem = me ? 1 : 0, std_ = me ? 0 : 1;
  const std::string& disp = cfg.prim.moe_dispatch.name;
  const bool chunked = disp.rfind("chunked_alltoall", 0) == 0;
  const int64_t P = cfg.ep;
  const int64_t c = P > 1 && d.El > 1 ? 1 : 0;  // the arrival sort is a real copy
  const int64_t R = a * H;                      // bytes of one row
  const int64_t dn = drop.has(RecomputePart::norms), dE = drop.has(RecomputePart::moe_experts),
                dS = drop.has(RecomputePart::shared_expert);
  const int64_t EXP = 3 * a * M * F;  // the experts' fc1 output and activation
  BlockMem b;
  b.keep_none = a * T * H + 4 * T + 8 * T * E + 8 * T * Kt + EXP + sh * (a * T * H + 4 * T + 3 * a * T * S);
  b.keep = b.keep_none - dn * a * T * H - dE * EXP - dS * sh * 3 * a * T * S;
  b.keep_full = 4 * T * Kt;  // the stashed top-k ids live until the micro-batch ends
  b.after = b.keep_none - EXP;  // the experts' state is freed when the dispatcher's backward returns

  // Chunks: with balanced routing every expert gets the same runs from every rank, so the rows
  // received per chunk equal the rows sent per chunk (runs of N / E rows).
  const int64_t C = chunked ? std::max<int64_t>(1, cfg.prim.moe_dispatch.count) : 1;
  const int64_t run = E > 0 ? N / E : 0, extra = E > 0 ? N % E : 0;
  auto rows_k = [&](int64_t k) { return (E - extra) * chunk_len(run, k, C) + extra * chunk_len(run + 1, k, C); };
  std::vector<int64_t> Mk(static_cast<size_t>(C));
  for (int64_t k = 0; k < C; ++k) Mk[static_cast<size_t>(k)] = rows_k(k) * M / std::max<int64_t>(1, N);
  int64_t Mk_max = 0;
  for (int64_t x : Mk) Mk_max = std::max(Mk_max, x);

  // Forward (activations, relative to the block's entry).
  b.exp = EXP;
  b.route_f = std::max(a * T * H, chunked ? 3 * a * Mk_max * F : 0);
  const int64_t f_out = a * T * H + 4 * T + 8 * T * E + 8 * T * Kt + EXP + b.route_f;
  const int64_t f_gated = sh ? b.keep_none + a * T * H + 4 * T * H + (d.c ? 4 * T * H : 0) : 0;
  const int64_t f_add = b.keep + a * T * H + 4 * T * H + d.c * a * T * H;
  b.fwd_total = std::max({f_out, f_gated, f_add});

  // Backward (activations, relative to the entry; d_y included).
  int64_t D_act = 2 * a * M * F, R_d = mem * 4 * N;
  if (chunked) {
    int64_t best = 0, Nle = 0, Mle = 0;
    for (int64_t k = 0; k < C; ++k) {
      const int64_t mk = Mk[static_cast<size_t>(k)];
      Nle += rows_k(k);
      Mle += mk;
      const int64_t held = holds == Holds::until_wait ? c * 4 * Mle : c * 4 * mk;
      best = std::max(best, 3 * a * mk * F + 2 * a * mk * F + 2 * a * M * F + mem * (4 * mk + held + 4 * Nle));
    }
    const int64_t tail = holds == Holds::until_wait ? mem * (4 * c * (M - Mk[0]) + 8 * N) : mem * 8 * N;
    D_act = std::max(best, tail);
  } else if (P <= 1) {
    D_act += mem * 4 * M;
  } else if (disp == "allgather") {
    D_act += mem * (4 * M + 4 * P * N + 4 * N);
  } else {
    D_act += mem * (4 * M + c * 4 * M + 4 * N);
  }
  b.b1r = std_ * 4 * T * Kt + D_act;
  b.rd = R_d;
  const int64_t b1 = dE * EXP + b.b1r;
  const int64_t after = -(1 - dE) * EXP + 4 * T * Kt + R_d + 4 * T * H + dn * a * T * H + dS * sh * 3 * a * T * S + 4 * T * E;
  b.after_local = after;
  const int64_t b2 = sh ? after + 4 * T * H + 4 * T + 4 * T * S + 2 * a * T * S : 0;
  const int64_t b3 = after + 4 * T * H;
  b.bwd_total = b.keep + 4 * T * H + std::max({b1, b2, b3}) + d.c * a * T * H;

  // moe category.
  const int64_t Y = N;  // y_perm rows (allgather: its [Nmax, H] storage; Nmax = N when balanced)
  b.moe_keep = 8 * N + R * M + mem * 4 * M + std_ * R * Y;
  // The block frees its routed state (map, y_perm, the dispatcher's rows) as soon as the routed
  // backward is done, before the router's and the shared expert's backward.
  b.moe_after = 0;
  int64_t Fm = 0, Bm = 0, Rb = 0;
  if (holds == Holds::until_return) {
    // NCCL / emulated GPU: the dispatcher's handles keep their buffers to its end (not verified
    // on a GPU yet: skills/planner.md).
    int64_t f = 0, bw = 0, rb = 0;
    if (P <= 1 && !chunked) {
      f = 2 * N;
      bw = 4 * N;
      rb = N;
    } else if (disp == "allgather") {
      f = N + P * N + 2 * M + P * N + N;
      bw = N + M + N + std::max(P * N + M, 2 * M + P * N + N);
      rb = N + P * N + M;
    } else if (chunked) {
      f = std::max(2 * N + 2 * M + 2 * Mk_max, 3 * N + 2 * M - Mk[0]);
      bw = std::max(3 * N + 3 * M + 2 * Mk_max, 4 * N + 2 * M - Mk[0]);
      rb = 2 * N + 2 * M + Mk_max;
    } else {
      f = c ? 2 * N + 3 * M : 2 * N + 2 * M;
      bw = c ? 3 * N + 4 * M : 3 * N + 3 * M;
      rb = N + 2 * M;
    }
    bw -= N;  // no y_perm (standard: freed once unpermute's backward has read it)
    Fm = 8 * N + f * R + mem * 4 * (N + M);
    Bm = std::max<int64_t>(0, bw * R - (M * R + std_ * N * R));
    Rb = 8 * N + (me ? rb : f) * R + mem * 4 * (N + M);
  } else if (chunked) {
    int64_t post = 0, mid = 0, end = 0, bmid = 0, bend = 0, rmid = 0;
    const int64_t NC1 = rows_k(C - 1);
    int64_t Nle = 0, Mle = 0;
    for (int64_t k = 0; k < C; ++k) {
      const int64_t mk = Mk[static_cast<size_t>(k)];
      Nle += rows_k(k);
      Mle += mk;
      const int64_t Mgt = M - Mle, Ngt = N - Nle;
      if (holds == Holds::until_wait) {
        mid = std::max(mid, R * (N + Ngt + Mgt + M + 2 * mk + c * Mle + Nle) + mem * 4 * (N + Ngt + Mgt + M + mk));
        bmid = std::max(bmid, R * (Ngt + Mgt + 2 * mk + M + c * Mle + Nle) + mem * 4 * mk);
      } else {
        mid = std::max(mid, R * (N + Mgt + M + (2 + c) * mk + Nle) + mem * 4 * (N + Mgt + M + mk));
        bmid = std::max(bmid, R * (Mgt + (2 + c) * mk + M + Nle) + mem * 4 * mk);
      }
      rmid = std::max(rmid, R * (N + Mgt + M + mk) + mem * 4 * (N + Mgt + M + mk));
    }
    if (holds == Holds::until_wait) {
      post = R * (2 * N + M) + mem * (8 * N + 4 * M);
      end = R * (3 * N + M + c * (M - Mk[0])) + mem * 4 * (N + M);
      bend = std::max(R * (N + M), R * (2 * N + c * (M - Mk[0])));
    } else {
      post = R * (N + M + NC1) + mem * 4 * (N + M + NC1);
      end = R * (3 * N + M) + mem * 4 * (N + M);
      bend = std::max(R * (M + NC1), 2 * R * N);
    }
    Fm = 8 * N + std::max({post, mid, end});
    Bm = R * N + std::max(bmid, bend);
    Rb = 8 * N + std::max(post, rmid);
  } else if (P <= 1) {
    Fm = 8 * N + 2 * R * N + mem * 4 * N;
    Bm = 2 * R * N;
    Rb = 8 * N + R * N + 4 * N;
  } else if (disp == "allgather") {
    const int64_t G = P * N;
    Fm = 8 * N + std::max(R * (N + G + M) + mem * 4 * (N + G + M), R * (N + 2 * M + P * N + N) + mem * 4 * (N + M));
    Bm = R * N + std::max(R * (G + M), R * (2 * M + P * N + N));
    Rb = 8 * N + R * (N + G + M) + mem * 4 * (N + G + M);
  } else {
    Fm = 8 * N + R * (2 * N + (2 + c) * M) + mem * 4 * (N + M);
    Bm = R * (2 * N + (2 + c) * M);
    Rb = 8 * N + R * (N + (1 + c) * M) + 4 * (N + (1 + c) * M);
  }
  // Standard permute: y_perm is freed once unpermute's backward (which writes d_y_perm, N rows)
  // has read it, before the dispatcher's backward; the CPU terms above count it as kept.
  if (holds != Holds::until_return) Bm = std::max(R * N, Bm - std_ * R * Y);
  b.moe_fwd = Fm;
  b.moe_bwd = Bm;
  b.moe_rebuild = me ? Rb : Fm;
  return b;
}

// The MoE block with its routed path over `chunks` sequential token chunks ([backend]
// moe_chunk_tokens; models/moe_block.h): the routed terms are those of the largest chunk, the
// router, norm, shared expert and the output / gradient rows stay whole. Under full recompute
// nothing routed is kept: the backward rebuilds each chunk before its backward.
BlockMem moe_block(const Dims& d, const RecomputeParts& drop, const RunConfig& cfg, Holds holds, int64_t chunks) {
  if (chunks <= 1) return moe_block_whole(d, drop, cfg, holds);
  Dims dc = d;
  dc.T = ceil_div(d.T, chunks);
  dc.N = dc.T * d.top_k;
  dc.M = d.N > 0 ? dc.N * d.M / d.N : 0;
  BlockMem b = moe_block_whole(d, drop, cfg, holds);
  const BlockMem c = moe_block_whole(dc, drop, cfg, holds);
  const int64_t T = d.T, a = d.a, H = d.H, E = d.E, Kt = d.top_k, S = d.Ssh, sh = S > 0 ? 1 : 0;
  const bool full = cfg.prim.recompute.value == RecomputePolicy::full;
  const int64_t dE = drop.has(RecomputePart::moe_experts);
  // Activations.
  if (full) {  // the recompute keeps no routed rows
    b.keep_none -= b.exp;
    b.keep -= b.exp;
  }
  const int64_t exp_fwd = full ? c.exp : b.exp;  // experts' state alive at the forward's last chunk
  const int64_t f_out = a * T * H + 4 * T + 8 * T * E + 8 * T * Kt + exp_fwd + a * T * H + c.route_f;
  const int64_t f_gated = sh ? b.keep_none + a * T * H + 4 * T * H + (d.c ? 4 * T * H : 0) : 0;
  const int64_t f_add = b.keep + a * T * H + 4 * T * H + d.c * a * T * H;
  b.fwd_total = std::max({f_out, f_gated, f_add});
  // Backward: d_h [T, H] and d_topk_prob [T, K] (f32) gather the chunks' rows; each chunk's
  // experts' state is rebuilt (full; selective moe_experts) or kept (none), its row gradients
  // freed with the chunk.
  const int64_t b1 = ((full ? 1 : dE) * c.exp) + c.b1r + 4 * T * H + 4 * T * Kt;
  const int64_t after = b.after_local - b.rd + (full ? b.exp : 0);
  const int64_t b2 = sh ? after + 4 * T * H + 4 * T + 4 * T * S + 2 * a * T * S : 0;
  const int64_t b3 = after + 4 * T * H;
  b.bwd_total = b.keep + 4 * T * H + std::max({b1, b2, b3}) + d.c * a * T * H;
  // moe category: one chunk's rows at a time (without recompute every chunk's are kept).
  if (full) {
    b.moe_fwd = c.moe_fwd;
    b.moe_rebuild = 0;
    b.moe_keep = 0;
    b.moe_bwd = std::max(c.moe_rebuild, c.moe_keep + c.moe_bwd);
  } else {
    b.moe_fwd = b.moe_keep - c.moe_keep + c.moe_fwd;
    b.moe_bwd = c.moe_bwd;
  }
  b.moe_after = 0;
  return b;
}

struct LayerMem {
  bool moe = false, gdn = false;
  BlockMem mix, mlp;
  std::vector<const UnitMem*> units;
};

// Bytes in the table's unit (GiB, or MiB when the whole peak is under a GiB).
std::string in_unit(int64_t b, bool mib) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(b) / double(int64_t{1} << (mib ? 20 : 30)));
  return buf;
}

}  // namespace

MemoryEstimate estimate_memory(const RunConfig& cfg, int64_t world_size, const EstimateOptions& opts) {
  BB_CHECK(world_size >= 1, "estimate: the world size must be >= 1, got ", world_size);
  MemoryEstimate est;
  est.world = world_size;
  est.layout = resolve_layout(cfg, world_size);
  // The device the run is for (it need not be this machine's: a GPU run is planned anywhere).
  est.device = cfg.device.rfind("cuda", 0) == 0 ? Device::cuda(0) : cfg.resolved_device();
  const DType param_dtype = cfg.model_dtype != "auto" ? dtype_from_name(cfg.model_dtype)
                            : est.device.is_cuda()    ? DType::bf16
                                                      : DType::f32;
  const ParallelLayout& L = est.layout;
  const ModelConfig& mc = cfg.model;
  const int64_t rank = opts.rank < 0 ? 0 : opts.rank;
  BB_CHECK(rank < world_size, "estimate: rank ", rank, " of a world of ", world_size);

  // The units as this rank's state family holds them: the model laid out (nothing allocated)
  // over the layout's groups.
  comm::EmulateConfig ec;
  ec.ranks = world_size;
  ec.rank = rank;
  Mesh mesh(comm::make_emulated_world(ec), L);
  ModelOptions mo;
  mo.prims = cfg.prim;
  mo.device = Device::cpu();
  mo.param_dtype = param_dtype;
  mo.defer_values = true;
  mo.ep_group = mesh.ep();
  mo.cp_group = mesh.cp();
  DecoderModel model(mc, mo, cfg.seed);
  const StateKind kind = cfg.prim.state.value;
  const bool offload = offloads_optimizer(cfg.prim.optimizer.value);
  const bool split = !offload && splits_master(cfg.backend.master_storage, param_dtype);
  const bool bf16_reduce = cfg.backend.grad_reduce_dtype == "bf16";
  // MPI reduces 16-bit floats through f32 host copies (comm/mpi_group.cpp), counted where the
  // device is the CPU; on a GPU those copies are host memory.
  const bool cpu = !est.device.is_cuda();
  const bool mpi_staging = cpu && cfg.comm != "emulated" && world_size > 1 && bf16_reduce;
  const Holds holds = !cpu ? Holds::until_return : cfg.comm == "emulated" || world_size == 1 ? Holds::nothing : Holds::until_wait;
  // params, grads and optimizer: the state family's closed forms (runtime/state.h).
  std::vector<int64_t> group_sizes;
  for (ParamUnit* pu : model.units())
    group_sizes.push_back(pu->kind == UnitKind::experts ? mesh.edp()->size() : mesh.dense()->size());
  const StateBytes sb = state_bytes(kind, model.units(), group_sizes, static_cast<int64_t>(dtype_size(param_dtype)),
                                    cfg.prim.optimizer.value, split);
  Bytes state;
  state[C::params] = sb.params;
  state[C::grads] = sb.grads;
  state[C::optimizer] = sb.optimizer;
  if (offload) {
    // On the CPU the host's memory is the device's: 12 of the 16 bytes optimizer, the
    // gradient's copy grads.
    est.host_optimizer = offload_host_bytes(kind, model.units(), group_sizes);
    const int64_t elems = est.host_optimizer / kOffloadHostBytesPerElement;
    if (cpu) {
      state[C::optimizer] += 12 * elems;
      state[C::grads] += 4 * elems;
    }
  }
  // What each unit gathers and reduces (category comm).
  std::vector<UnitMem> units;
  for (ParamUnit* pu : model.units()) {
    UnitMem u;
    u.kind = pu->kind;
    u.layer = pu->layer;
    u.n = pu->numel;
    u.N = group_sizes[units.size()];
    u.S = ceil_div(u.n, u.N);
    u.vb = static_cast<int64_t>(dtype_size(model.param_store().value_dtype(*pu)));
    u.whole = u.N == 1 || kind == StateKind::replicated;
    const int64_t NS = u.N * u.S;
    if (u.whole) {
      if (u.N > 1 && bf16_reduce) {  // f32: all-reduced in place
        u.Out = 2 * u.n + (mpi_staging ? 4 * u.n : 0);
        u.Tmp = 4 * u.n;  // the f32 sum widened back (MPI: the bf16 result copied back, as much)
      }
    } else if (kind == StateKind::zero1) {
      u.Out = bf16_reduce ? 2 * NS + 2 * u.S + (mpi_staging ? 4 * NS + 4 * u.S : 0) : 4 * u.S;
      u.Tmp = bf16_reduce ? 4 * u.S : 0;
    } else {
      u.V = u.vb * NS;
      u.G = 4 * NS;
      u.Gkeep = bf16_reduce || holds == Holds::nothing ? 0 : u.G;  // an f32 reduce-scatter reads the gradient itself
      u.Out = bf16_reduce ? 2 * NS + 2 * u.S + (mpi_staging ? 4 * NS + 4 * u.S : 0) : 4 * u.S;
      u.Tmp = mpi_staging ? 4 * u.S : 0;  // MPI: the f32 result rounded to bf16 and copied back
    }
    units.push_back(u);
  }
  if (cfg.on_nonfinite == "skip_step") {
    // The backup of the owned masters and moments, made at the first step and kept.
    for (const UnitMem& u : units) {
      const int64_t m = u.whole ? u.n : u.S;
      const bool sp = split && u.vb == 2;
      // adamw_offload keeps the backup where its state is: host memory (the device's on the CPU).
      const int64_t per = offload ? (cpu ? 12 : 0) : optimizer_bytes_per_element(cfg.prim.optimizer.value, sp) + (sp ? 2 : 0);
      state[C::optimizer] += per * m;
    }
  }
  est.persistent = state;

  // Per-layer and end units.
  const int64_t nl = mc.num_layers;
  std::vector<std::vector<const UnitMem*>> by_layer(static_cast<size_t>(nl));
  std::vector<const UnitMem*> embed, head;
  for (const UnitMem& u : units) {
    if (u.layer >= 0) by_layer[static_cast<size_t>(u.layer)].push_back(&u);
    else if (u.kind == UnitKind::embedding) embed.push_back(&u);
    else head.push_back(&u);
  }

  // The micro-batch on this rank.
  const int64_t mbt = opts.micro_batch_tokens > 0 ? opts.micro_batch_tokens : cfg.micro_batch_tokens;
  Dims d;
  d.T = ceil_div(mbt, L.cp);
  est.tokens_local = d.T;
  d.H = mc.hidden_size;
  d.Hq = mc.num_heads;
  d.Hkv = mc.num_kv_heads;
  d.D = mc.head_dim;
  d.Q = d.Hq * d.D;
  d.K = d.Hkv * d.D;
  d.I = mc.intermediate_size;
  d.V = mc.vocab_size;
  d.E = mc.num_experts;
  d.El = d.E > 0 ? d.E / L.ep : 0;
  d.top_k = mc.top_k;
  d.F = mc.moe_intermediate_size;
  d.Ssh = mc.shared_expert_intermediate_size;
  d.N = d.T * d.top_k;
  d.M = static_cast<int64_t>(std::ceil(static_cast<double>(d.N) * std::max(1.0, opts.expert_load)));
  d.Hk = mc.linear_num_key_heads;
  d.Hv = mc.linear_num_value_heads;
  d.Dk = mc.linear_key_head_dim;
  d.Dv = mc.linear_value_head_dim;
  d.CK = d.Hk * d.Dk;
  d.Z = d.Hv * d.Dv;
  d.Cc = 2 * d.CK + d.Z;
  d.W = mc.linear_conv_kernel_dim;
  d.a = static_cast<int64_t>(dtype_size(param_dtype));
  d.c = d.a == 4 ? 0 : 1;
  d.cuda = est.device.is_cuda();
  d.gate = mc.attn_output_gate;
  d.qk_norm = mc.qk_norm;
  d.nc = ceil_div(d.T, 64);
  const int64_t T = d.T, X = d.a * d.T * d.H, A = cfg.grad_accum;

  const RecomputePolicy policy = cfg.prim.recompute.value;
  RecomputeParts drop;
  if (policy == RecomputePolicy::selective) drop = recompute_parts(cfg.prim.recompute);

  // [backend] moe_chunk_tokens: the MoE layers' token chunks (runtime/trainer.h moe_token_chunks).
  const int64_t moe_chunks = cfg.backend.moe_chunk_tokens > 0 ? ceil_div(d.T, cfg.backend.moe_chunk_tokens) : 1;
  std::vector<LayerMem> layers(static_cast<size_t>(nl));
  for (int64_t l = 0; l < nl; ++l) {
    LayerMem& lm = layers[static_cast<size_t>(l)];
    lm.gdn = mc.layer_type(l) == LayerType::linear_attention;
    lm.moe = mc.is_moe_layer(l);
    lm.mix = lm.gdn ? gdn_block(d, drop) : attention_block(d, drop, cfg);
    lm.mlp = lm.moe ? moe_block(d, drop, cfg, holds, moe_chunks) : mlp_block(d, drop);
    lm.units = by_layer[static_cast<size_t>(l)];
  }

  // Step-wide terms: the device copies of every micro-batch's targets and positions (CUDA; on
  // the CPU they stay host tensors, category other), the persistent GEMM workspaces.
  Bytes base = state;
  if (d.cuda) base[C::activations] += 8 * T * A;
  else base[C::other] += (12 * T + 8) * A;
  if (d.cuda) base[C::workspace] += (int64_t{32} << 20) * (cfg.backend.expert_wgrad_stream ? 2 : 1);

  // What the state family gathers and reduces around each moment (runtime/state.h).
  const bool fsdp = kind == StateKind::fsdp;
  const bool tied = mc.tie_word_embeddings;
  const bool per_step = fsdp && cfg.backend.fsdp_reduce == "step" && A > 1;
  // Units of layer l; l >= nl: the head's.
  auto of = [&](int64_t l) -> const std::vector<const UnitMem*>& { return l >= nl ? head : layers[static_cast<size_t>(l)].units; };
  auto total = [](const std::vector<const UnitMem*>& us, auto f) {
    int64_t s = 0;
    for (const UnitMem* u : us) s += f(*u);
    return s;
  };
  auto V = [&](int64_t l) { return l < 0 ? 0 : total(of(l), [](const UnitMem& u) { return u.V; }); };
  auto G = [&](int64_t l) { return total(of(l), [](const UnitMem& u) { return u.G; }); };
  auto RF = [&](int64_t l) { return total(of(l), [](const UnitMem& u) { return u.RF(); }); };
  auto Out = [&](const std::vector<const UnitMem*>& us) { return total(us, [](const UnitMem& u) { return u.Out; }); };
  // Draining reductions in the order they were posted: unit m's transient beside the ones not yet drained.
  auto drain = [](const std::vector<const UnitMem*>& us) {
    int64_t peak = 0;
    for (size_t m = 0; m < us.size(); ++m) {
      int64_t live = us[m]->Tmp;
      for (size_t j = m; j < us.size(); ++j) live += us[j]->RF();
      peak = std::max(peak, live);
    }
    return peak;
  };
  // fsdp: a layer's units handed to their reductions one after the other, each released after
  // (the bf16 copy is made while the f32 gradient is still bound).
  auto hand_over = [](const std::vector<const UnitMem*>& us, bool gathered) {
    const int64_t v = gathered ? 1 : 0;
    int64_t peak = 0;
    for (size_t m = 0; m < us.size(); ++m) {
      int64_t live = us[m]->G + us[m]->Out + v * us[m]->V;
      for (size_t j = 0; j < us.size(); ++j)
        if (j < m) live += us[j]->RF();
        else if (j > m) live += us[j]->G + v * us[j]->V;
      peak = std::max(peak, live);
    }
    return peak;
  };
  auto cat = [](std::vector<const UnitMem*> a, const std::vector<const UnitMem*>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  auto only = [](const std::vector<const UnitMem*>& us, bool experts) {
    std::vector<const UnitMem*> o;
    for (const UnitMem* u : us)
      if ((u->kind == UnitKind::experts) == experts) o.push_back(u);
    return o;
  };
  const int64_t Vemb = total(embed, [](const UnitMem& u) { return u.V; }), Vhead = V(nl);
  const int64_t Gemb = total(embed, [](const UnitMem& u) { return u.G; }), Ghead = G(nl);
  int64_t Gall = Gemb + Ghead;
  for (int64_t l = 0; l < nl; ++l) Gall += G(l);
  // fsdp_reduce = "step": the last micro-batch starts with every fsdp gradient whole; the ones of
  // the layers at or below `i` (and the embedding's) are still whole at layer i's backward.
  auto G_below = [&](int64_t i) {
    int64_t s = Gemb;
    for (int64_t l = 0; l <= i && l < nl; ++l) s += G(l);
    return s;
  };

  // Activations of the layers below `i` as the forward keeps them.
  std::vector<int64_t> kept_below(static_cast<size_t>(nl + 1), 0), moe_below(static_cast<size_t>(nl + 1), 0);
  for (int64_t l = 0; l < nl; ++l) {
    const LayerMem& lm = layers[static_cast<size_t>(l)];
    const int64_t k = policy == RecomputePolicy::full ? X + lm.mlp.keep_full : 2 * X + lm.mix.keep + lm.mlp.keep;
    const int64_t m = policy == RecomputePolicy::full ? 0 : lm.mlp.moe_keep;
    kept_below[static_cast<size_t>(l + 1)] = kept_below[static_cast<size_t>(l)] + k;
    moe_below[static_cast<size_t>(l + 1)] = moe_below[static_cast<size_t>(l)] + m;
  }
  // Stashed top-k ids of MoE layers at or above `i` (kept until the micro-batch ends).
  auto stash_above = [&](int64_t i) {
    int64_t s = 0;
    for (int64_t l = i; l < nl; ++l) s += layers[static_cast<size_t>(l)].mlp.keep_full;
    return s;
  };

  std::vector<Moment>& ms = est.moments;
  auto add = [&](const std::string& name, Bytes b) {
    Bytes live = base;
    live += b;
    ms.push_back({name, live});
  };
  add("startup", Bytes{});

  // Forward.
  for (int64_t i = 0; i < nl; ++i) {
    const LayerMem& lm = layers[static_cast<size_t>(i)];
    Bytes b;
    const int64_t below = kept_below[static_cast<size_t>(i)];
    const int64_t mbelow = moe_below[static_cast<size_t>(i)];
    // Full recompute: the block's tensors are the forward's own (freed when it returns).
    const int64_t mix_kept = policy == RecomputePolicy::full ? 0 : lm.mix.keep;
    b[C::activations] = below + X + std::max(lm.mix.keep_none + lm.mix.fwd, mix_kept + X + lm.mlp.fwd_total);
    b[C::moe] = mbelow + (lm.moe ? lm.mlp.moe_fwd : 0);
    if (fsdp)
      b[C::comm] = (per_step ? Gall : 0) + (i == 0 ? std::max(Vemb + V(0), V(0) + V(1)) : V(i) + V(i + 1));
    add("layer " + std::to_string(i) + " forward", b);
  }
  // Head: the last output, the norm, the loss's gradient and its logits; the head's gradient
  // handed to its reduction.
  {
    Bytes b;
    b[C::activations] = kept_below[static_cast<size_t>(nl)] + X + 4 * T + std::max(d.a * T * d.H + 4 * T * d.H, 8 * T * d.H);
    b[C::moe] = moe_below[static_cast<size_t>(nl)];
    // linear_ce streams [rows, V] blocks; policy f32 [rows, V] blocks (rows by T when auto) or
    // [T, cols] column blocks with an f32 d_h accumulator (policy_vocab_cols).
    const LossHeadConfig& lc = cfg.prim.loss_chunks;
    if (cfg.prim.loss.name == "policy") {
      b[C::logits] = policy_logits_bytes(T, d.V, d.H, lc);
      b[C::workspace] += policy_dh_accumulator_bytes(T, d.V, d.H, lc);
    } else if (cfg.prim.loss.name == "linear_ce") {
      const int64_t lb = lc.bf16_logits && d.cuda && d.a == 2 ? 2 : 4;
      b[C::logits] = std::min<int64_t>(lc.fused_chunk_tokens, T) * d.V * lb;
    } else {
      b[C::logits] = d.cuda ? T * d.V * (4 + d.a) : 8 * T * d.V;
      b[C::activations] += 4 * T;
    }
    if (fsdp)
      b[C::comm] = Vhead + (tied ? Vemb : 0) + V(nl - 1) + (per_step ? Gall - Ghead : (tied ? Gemb : 0)) + Ghead + Out(head);
    add("head", b);
  }
  // Backward, from the last layer down.
  for (int64_t i = nl - 1; i >= 0; --i) {
    const LayerMem& lm = layers[static_cast<size_t>(i)];
    const int64_t below = kept_below[static_cast<size_t>(i)];
    const int64_t mbelow = moe_below[static_cast<size_t>(i)];
    const int64_t stash = stash_above(i + 1);  // the routing of the MoE layers above, kept to the end
    // fsdp: this layer and the next gathered, this layer's gradient whole, the layer above's
    // reduction in flight (drained, with its transient, when this layer's backward ends).
    int64_t comm = 0, comm_end = 0;
    if (fsdp) {
      const int64_t whole = per_step ? G_below(i) : G(i) + (tied ? Gemb : 0);
      comm = V(i) + V(i - 1) + whole + drain(of(i + 1));
      comm_end = V(i - 1) + (per_step ? G_below(i - 1) : (tied ? Gemb : 0)) + hand_over(of(i), true);
    }
    if (policy == RecomputePolicy::full) {
      // The recompute: the layer's forward again, keeping everything of this layer.
      Bytes r;
      r[C::activations] = below + X + lm.mlp.keep_full + stash + 4 * T * d.H +
                          std::max(lm.mix.keep_none + lm.mix.fwd, lm.mix.keep_none + X + lm.mlp.keep_none);
      r[C::moe] = mbelow + (lm.moe ? lm.mlp.moe_rebuild : 0);
      r[C::comm] = comm;
      add("layer " + std::to_string(i) + " recompute", r);
    }
    const int64_t stash_b = stash;
    // The MLP block's backward (the mixer's state as the forward kept it).
    Bytes b1;
    b1[C::activations] = below + X + (policy == RecomputePolicy::full ? lm.mix.keep_none : lm.mix.keep) + X +
                         lm.mlp.bwd_total + stash_b;
    b1[C::moe] = mbelow + (lm.moe ? lm.mlp.moe_keep + lm.mlp.moe_bwd : 0);
    // zero1 / replicated: the reductions of the layer above (or the head) in flight.
    b1[C::comm] = fsdp ? comm : Out(only(of(i + 1), false));
    add("layer " + std::to_string(i) + " backward (" + (lm.moe ? "moe" : "mlp") + ")", b1);
    // The token mixer's backward (the MLP block's state alive until the layer ends); zero1 /
    // replicated: this layer's experts reduce beside it.
    Bytes b2;
    b2[C::activations] = below + X + lm.mix.keep_none - lm.mix.prep + X + lm.mlp.after + lm.mix.bwd + stash_b;
    b2[C::moe] = mbelow + (lm.moe ? lm.mlp.moe_after : 0);
    b2[C::comm] = fsdp ? comm : drain(cat(only(of(i + 1), false), only(of(i), true)));
    add("layer " + std::to_string(i) + " backward (" + (lm.gdn ? "gdn" : "attention") + ")", b2);
    if (fsdp) {
      Bytes b3;  // after the layer's backward: the layers below and the gradient flowing down
      b3[C::comm] = comm_end;
      b3[C::activations] = below + stash + 4 * T * d.H;
      b3[C::moe] = mbelow;
      add("layer " + std::to_string(i) + " gradient reduction", b3);
    }
  }
  {
    Bytes b;
    if (fsdp) b[C::comm] = std::max(RF(0) + hand_over(embed, false), drain(cat(of(0), embed)));
    else b[C::comm] = drain(cat(only(of(0), false), embed));
    b[C::activations] = 4 * T * d.H;
    add("embedding backward", b);
  }
  add("optimizer update", Bytes{});

  // The step's collectives on the wire (the link model of [emulate]; nothing overlapped).
  {
    const comm::LinkModel& link = cfg.emulate.link;
    CommEstimate& ce = est.comm;
    const int64_t reduce_b = bf16_reduce ? 2 : 4;
    ce.layer_gather_s.assign(static_cast<size_t>(nl + 1), 0.0);
    ce.layer_reduce_s.assign(static_cast<size_t>(nl + 1), 0.0);
    for (ParamUnit* pu : model.units()) {
      const comm::GroupPtr g = pu->kind == UnitKind::experts ? mesh.edp() : mesh.dense();
      const int64_t N = g->size();
      if (N == 1) continue;
      const size_t at = static_cast<size_t>(pu->layer >= 0 ? pu->layer : nl);
      const int64_t S = ceil_div(pu->numel, N), vb = static_cast<int64_t>(dtype_size(model.param_store().value_dtype(*pu)));
      const int64_t gathers = kind == StateKind::fsdp ? 2 * A : kind == StateKind::zero1 ? 1 : 0;
      const int64_t reduces = kind == StateKind::fsdp && cfg.backend.fsdp_reduce != "step" ? A : 1;
      const double gather = link.all_gather_s(g->world_ranks(), vb * S * N);
      ce.param_gather_bytes += gathers * vb * S * (N - 1);
      ce.param_gather_s += gathers * gather;
      if (gathers > 0) ce.layer_gather_s[at] += gather;
      const double reduce = kind == StateKind::replicated ? link.all_reduce_s(g->world_ranks(), reduce_b * pu->numel)
                                                          : link.reduce_scatter_s(g->world_ranks(), reduce_b * S * N);
      ce.layer_reduce_s[at] += reduce;
      if (kind == StateKind::replicated) {
        ce.grad_reduce_bytes += 2 * reduce_b * pu->numel * (N - 1) / N;
        ce.grad_reduce_s += reduce;
      } else {
        ce.grad_reduce_bytes += reduces * reduce_b * S * (N - 1);
        ce.grad_reduce_s += reduces * reduce;
      }
    }
    const comm::GroupPtr ep = mesh.ep();
    if (ep->size() > 1 && d.E > 0) {
      const int64_t P = ep->size(), row = d.a * d.H;
      std::vector<int64_t> per(static_cast<size_t>(P), d.N / P * row);  // balanced: N / P rows to each member
      const double one = link.all_to_all_s(ep->world_ranks(), static_cast<int>(ep->rank()), per, per);
      const int64_t n_moe = mc.num_moe_layers();
      ce.ep_bytes += 5 * A * n_moe * (d.N / P) * row * (P - 1);
      ce.ep_s += 5 * A * n_moe * one;
      ce.ep_one_s = one;
    }
    const comm::GroupPtr cpg = mesh.cp();
    if (cpg->size() > 1) {
      const int64_t P = cpg->size(), kv = 2 * d.T * d.K * d.a, dkv = 2 * d.T * d.K * 4;
      const std::vector<int>& wr = cpg->world_ranks();
      const int64_t me = cpg->rank(), next = wr[static_cast<size_t>((me + 1) % P)];
      const double shift = link.send_recv_s(wr[static_cast<size_t>(me)], next, kv);
      const double shift_d = link.send_recv_s(wr[static_cast<size_t>(me)], next, kv + dkv);
      const int64_t n_attn = nl - mc.num_linear_attention_layers();
      const int64_t passes = policy == RecomputePolicy::full ? 2 : 1;
      ce.cp_bytes += A * n_attn * (P - 1) * (passes * kv + kv + dkv);
      ce.cp_s += A * n_attn * (P - 1) * (passes * shift + shift_d);
      ce.cp_shift_s = shift;
      ce.cp_shift_bwd_s = shift_d;
      // Gated DeltaNet layers (primitives.gdn_cp; skills/gdn-cp-states.md), one sequence per
      // micro-batch taken: `heads` all-to-alls the projections (2 Hk Dk + 2 Hv Dv + 2 Hv) there
      // and the output (Hv Dv) back in each forward, the same in the backward; `states`
      // all-gathers each of the 2 pieces' K x K and K x V summaries (f32) once a forward and once
      // a backward (the conv halo's few rows are left out).
      const int64_t n_gdn = mc.num_linear_attention_layers();
      if (n_gdn > 0) {
        const int64_t Hk = mc.linear_num_key_heads, Hv = mc.linear_num_value_heads;
        const int64_t Dk = mc.linear_key_head_dim, Dv = mc.linear_value_head_dim;
        const GdnCpMode mode = cfg.prim.gdn_cp.value;
        const bool split = Hk % P == 0 && Hv % P == 0;
        const bool states = mode == GdnCpMode::states || (mode == GdnCpMode::automatic && !split);
        if (states) {
          const int64_t mine = 2 * Hv * Dk * (Dk + Dv) * 4;
          ce.cp_bytes += A * n_gdn * (passes + 1) * mine * (P - 1);
          ce.gdn_pass_s = link.all_gather_s(wr, mine * P);
          ce.cp_s += A * n_gdn * (passes + 1) * ce.gdn_pass_s;
        } else {
          const int64_t row = (2 * Hk * Dk + 3 * Hv * Dv + 2 * Hv) * d.a;
          std::vector<int64_t> per(static_cast<size_t>(P), d.T / P * row);
          const double one = link.all_to_all_s(wr, static_cast<int>(me), per, per);
          ce.cp_bytes += A * n_gdn * (passes + 1) * (d.T / P) * row * (P - 1);
          ce.gdn_pass_s = one;
          ce.cp_s += A * n_gdn * (passes + 1) * one;
        }
      }
    }
  }

  // Peaks.
  for (const Moment& m : ms) {
    est.peak.max_with(m.live);
    if (m.live.total() > est.peak_total) {
      est.peak_total = m.live.total();
      est.peak_moment = m.name;
    }
  }
  est.reserved = est.peak_total;
  if (d.cuda)
    est.notes.push_back("workspace counts the persistent GEMM workspaces only (32 MiB per stream that runs GEMMs); "
                        "cuDNN and grouped-GEMM scratch are not modelled");
  if (est.host_optimizer > 0 && d.cuda)
    est.notes.push_back("primitives.optimizer = adamw_offload: " + format_bytes(est.host_optimizer) +
                        " of host memory per rank (f32 master, two f32 moments, the gradient's copy), not in these "
                        "device categories");
  if (L.cp > 1) est.notes.push_back("tokens per rank are taken as micro_batch_tokens / cp (the cp shards of a packed micro-batch differ by a few tokens)");
  if (d.E > 0)
    est.notes.push_back(opts.expert_load > 1 ? "expert rows per rank: " + std::to_string(opts.expert_load) + " x balanced"
                                             : "expert rows per rank as with balanced routing (T x top_k)");
  return est;
}

namespace {
nlohmann::json bytes_json(const Bytes& b, int64_t total) {
  nlohmann::json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[category_name(static_cast<MemCategory>(c))] = b.v[static_cast<size_t>(c)];
  j["total"] = total;
  return j;
}
}  // namespace

std::string MemoryEstimate::json() const {
  nlohmann::json j;
  j["predicted"] = true;
  j["layout"] = layout.str();
  j["world"] = world;
  j["device"] = device.str();
  j["tokens_per_rank"] = tokens_local;
  j["peak_bytes"] = bytes_json(peak, peak_total);
  j["peak_moment"] = peak_moment;
  j["reserved_bytes"] = reserved;
  j["host_optimizer_bytes"] = host_optimizer;
  nlohmann::json m = nlohmann::json::array();
  for (const Moment& x : moments) m.push_back({{"name", x.name}, {"bytes", bytes_json(x.live, x.live.total())}});
  j["moments"] = m;
  j["notes"] = notes;
  return j.dump();
}

std::string MemoryEstimate::table(bool all_moments) const {
  std::string s;
  char buf[512];
  const bool mib = peak_total < (int64_t{1} << 30);
  auto gib = [mib](int64_t b) { return in_unit(b, mib); };
  std::snprintf(buf, sizeof buf, "| moment | total %s | params | grads | optimizer | activations | logits | moe | comm | workspace | other |\n",
                mib ? "MiB" : "GiB");
  s += buf;
  s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  // One row per phase: the moment with the largest total of each.
  std::map<std::string, const Moment*> best;
  std::vector<std::string> order;
  for (const Moment& m : moments) {
    std::string phase = m.name;
    if (!all_moments && phase.rfind("layer ", 0) == 0) phase = phase.substr(phase.find(' ', 6) + 1);
    if (!best.count(phase)) order.push_back(phase);
    const Moment*& b = best[phase];
    if (!b || m.live.total() > b->live.total()) b = &m;
  }
  auto row = [&](const std::string& name, const Bytes& x, int64_t total) {
    std::snprintf(buf, sizeof buf, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name.c_str(),
                  gib(total).c_str(), gib(x[C::params]).c_str(), gib(x[C::grads]).c_str(), gib(x[C::optimizer]).c_str(),
                  gib(x[C::activations]).c_str(), gib(x[C::logits]).c_str(), gib(x[C::moe]).c_str(),
                  gib(x[C::comm]).c_str(), gib(x[C::workspace]).c_str(), gib(x[C::other]).c_str());
    s += buf;
  };
  for (const std::string& p : order) row(best[p]->name, best[p]->live, best[p]->live.total());
  row("peak per category", peak, peak_total);
  return s;
}

FitCheck check_fit(const RunConfig& cfg, int64_t world_size, int64_t rank, int64_t available) {
  FitCheck fc;
  EstimateOptions eo;
  eo.rank = rank;
  fc.estimate = estimate_memory(cfg, world_size, eo);
  if (fc.estimate.peak_total <= available) return fc;
  fc.fits = false;
  const MemoryEstimate& e = fc.estimate;
  // The largest categories at the peak moment.
  const Moment* at = nullptr;
  for (const Moment& m : e.moments)
    if (!at || m.live.total() > at->live.total()) at = &m;
  std::vector<int> order(kNumMemCategories);
  for (int c = 0; c < kNumMemCategories; ++c) order[static_cast<size_t>(c)] = c;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return at->live.v[static_cast<size_t>(a)] > at->live.v[static_cast<size_t>(b)]; });
  std::string largest;
  for (size_t i = 0; i < 3; ++i)
    largest += std::string(i ? ", " : "") + category_name(static_cast<MemCategory>(order[i])) + " " +
               format_bytes(at->live.v[static_cast<size_t>(order[i])]);
  // Settings to try, one at a time and then together (each kept when it lowers the peak).
  std::vector<std::vector<std::string>> tries;
  if (cfg.prim.recompute.value != RecomputePolicy::full) tries.push_back({"primitives.recompute=\"full\""});
  if (cfg.prim.loss.name != "linear_ce") tries.push_back({"primitives.loss=\"linear_ce\""});
  // Token-chunked MoE: the routed rows of 32K tokens at a time (same math, about the same time).
  const ParallelLayout& L = e.layout;
  constexpr int64_t kMoeChunk = 32768;
  if (cfg.model.num_moe_layers() > 0 && ceil_div(cfg.micro_batch_tokens, L.cp) > kMoeChunk &&
      (cfg.backend.moe_chunk_tokens == 0 || cfg.backend.moe_chunk_tokens > kMoeChunk))
    tries.push_back({"backend.moe_chunk_tokens=" + std::to_string(kMoeChunk)});
  if (cfg.prim.state.value != StateKind::fsdp) tries.push_back({"primitives.state=\"fsdp\""});
  if (cfg.model.num_experts > 0)
    for (int64_t ep = L.ep * 2; ep <= L.dp * L.cp; ep *= 2)
      if (cfg.model.num_experts % ep == 0 && (L.dp * L.cp) % ep == 0) {
        tries.push_back({"parallel.ep=" + std::to_string(ep)});
        break;
      }
  if (L.dp % 2 == 0) {
    std::vector<std::string> t = {"parallel.cp=" + std::to_string(L.cp * 2)};
    if (cfg.prim.attention.name == "sdpa") t.push_back("primitives.attention=\"cp_ring\"");
    tries.push_back(t);
  }
  for (int64_t div = 2; div <= 16; div *= 2)
    if (cfg.micro_batch_tokens / div >= 256)
      tries.push_back({"train.micro_batch_tokens=" + std::to_string(cfg.micro_batch_tokens / div),
                       "train.grad_accum=" + std::to_string(cfg.grad_accum * div)});
  auto apply = [&](const std::vector<std::string>& sets) -> std::pair<bool, int64_t> {
    try {
      RunConfig c = cfg;
      for (const std::string& kv : sets) {
        // Only the keys the tries above write; estimate_memory validates the layout they make.
        const size_t eq = kv.find('=');
        const std::string key = kv.substr(0, eq), val = kv.substr(eq + 1);
        auto unq = [](const std::string& v) { return v.size() >= 2 && v.front() == '"' ? v.substr(1, v.size() - 2) : v; };
        if (key.rfind("primitives.", 0) == 0) c.prim.set(key.substr(11), unq(val), "the memory check");
        else if (key == "parallel.ep") c.ep = std::stoll(val);
        else if (key == "parallel.cp") {
          c.cp = std::stoll(val);
          c.dp = 0;  // dp follows: ranks / (cp x pp)
        }
        else if (key == "train.micro_batch_tokens") c.micro_batch_tokens = std::stoll(val);
        else if (key == "train.grad_accum") c.grad_accum = std::stoll(val);
        else if (key == "backend.moe_chunk_tokens") c.backend.moe_chunk_tokens = std::stoll(val);
      }
      EstimateOptions o;
      o.rank = rank;
      const MemoryEstimate x = estimate_memory(c, world_size, o);
      return {x.peak_total <= available, x.peak_total};
    } catch (const std::exception&) {
      return {false, 0};
    }
  };
  std::string fix;
  int64_t fix_peak = 0;
  for (const auto& t : tries) {
    const auto [ok, peak] = apply(t);
    if (ok) {
      for (const std::string& kv : t) fix += " --set " + kv;
      fix_peak = peak;
      break;
    }
  }
  if (fix.empty()) {
    std::vector<std::string> all;
    int64_t best = e.peak_total;
    for (const auto& t : tries) {
      std::vector<std::string> with = all;
      with.insert(with.end(), t.begin(), t.end());
      const auto [ok, peak] = apply(with);
      if (peak > 0 && peak < best) {
        all = with;
        best = peak;
      }
      if (ok) {
        for (const std::string& kv : all) fix += " --set " + kv;
        fix_peak = peak;
        break;
      }
    }
  }
  std::string msg = "out of memory predicted: this run needs " + format_bytes(e.peak_total) + " per rank at its peak (" +
                    e.peak_moment + "; largest there: " + largest + "), the device has " + format_bytes(available) +
                    " available. Predicted per category (bumblebee plan --explain):\n" + e.table();
  if (!fix.empty())
    msg += "The nearest setting that fits (predicted " + format_bytes(fix_peak) + "):" + fix + "\n";
  else
    msg += "No single change of recompute, loss, MoE token chunks, state, ep, cp or micro-batch size fits; use more GPUs.\n";
  msg += "To start anyway: bumblebee train --force (train.memory_check = \"warn\").";
  fc.message = msg;
  return fc;
}

namespace {

// The recipe's order among layouts that fit (plan_layouts, choose_auto_layout): the smallest CP
// that brings the sequence to 32K per rank (or the largest there is), then the least wire time,
// then the smaller EP.
auto recipe_key(int64_t seq, const ParallelLayout& l, const MemoryEstimate& e) {
  const int64_t per_gpu = ceil_div(seq, l.cp);
  const bool over = per_gpu > 32768;
  return std::make_tuple(over ? 1 : 0, over ? -l.cp : l.cp, e.comm.total_s(), l.ep);
}

// The time model's order: more predicted tokens/s per GPU, then the smaller cp, then the smaller ep.
bool faster(const TimeEstimate& a, const ParallelLayout& la, const TimeEstimate& b, const ParallelLayout& lb) {
  const double ta = a.tokens_per_s(), tb = b.tokens_per_s();
  if (ta != tb) return ta > tb;
  return std::make_pair(la.cp, la.ep) < std::make_pair(lb.cp, lb.ep);
}

}  // namespace

RunConfig choose_auto_layout(const RunConfig& cfg, int64_t world, int64_t available, std::string* why) {
  if (!cfg.auto_layout()) return cfg;
  BB_CHECK(world >= 1, "parallel = auto: the job has no rank");
  BB_CHECK(cfg.pp == 1, "parallel = auto chooses dp, cp and ep with pp = 1 (pipeline parallelism is not implemented)");
  const ModelConfig& mc = cfg.model;
  std::vector<int64_t> cps, eps;
  // GSPO's sequence ratio needs each sequence whole on one rank.
  const bool whole_sequences = cfg.prim.name_of("loss") == "policy" && cfg.prim.loss_chunks.policy.ratio == PolicyRatio::sequence;
  if (cfg.auto_cp && whole_sequences) {
    cps.push_back(1);
  } else if (cfg.auto_cp) {
    for (int64_t cp = 1; cp <= world; cp *= 2)
      if (world % cp == 0 && (cp == 1 || cfg.micro_batch_tokens >= 2 * cp)) cps.push_back(cp);
  } else {
    cps.push_back(cfg.cp);
  }
  if (cfg.auto_ep) {
    for (int64_t ep = 1; ep <= world; ++ep)
      if ((mc.num_experts == 0 ? ep == 1 : mc.num_experts % ep == 0) && world % ep == 0) eps.push_back(ep);
  } else {
    eps.push_back(cfg.ep);
  }
  struct Cand {
    RunConfig c;
    MemoryEstimate e;
    bool fits;
    TimeEstimate t;
  };
  const bool timed = cfg.device.rfind("cuda", 0) == 0;
  std::vector<Cand> cands;
  std::string last_error;
  for (int64_t cp : cps) {
    if (world % cp != 0) continue;
    const int64_t dp = world / cp;
    if (!cfg.auto_dp && cfg.dp != 0 && cfg.dp != dp) continue;
    for (int64_t ep : eps) {
      RunConfig c = cfg;
      c.auto_dp = c.auto_cp = c.auto_ep = false;
      c.cp = cp;
      c.ep = ep;
      c.dp = dp;
      if (cp > 1 && c.prim.name_of("attention") == "sdpa") c.prim.set("attention", "cp_ring", "parallel = auto");
      try {
        ParallelLayout l{dp, cp, ep, 1};
        l.validate(world, mc.num_experts);
        MemoryEstimate e = estimate_memory(c, world);
        const bool fits = available <= 0 || e.peak_total <= available;
        TimeEstimate t = timed ? estimate_time(c, e, Calibration::builtin()) : TimeEstimate{};
        cands.push_back({std::move(c), std::move(e), fits, std::move(t)});
      } catch (const Error& err) {
        last_error = err.what();  // a layout the model or the ranks cannot take: not a candidate
      }
    }
  }
  BB_CHECK(!cands.empty(), "parallel = auto: no layout of ", world, " rank(s) is possible for this run",
           last_error.empty() ? std::string() : " (the last refused: " + last_error + ")",
           "; set parallel.dp, cp and ep by hand");
  const Cand* best = nullptr;
  const Cand* smallest = nullptr;
  for (const Cand& k : cands) {
    if (!smallest || k.e.peak_total < smallest->e.peak_total) smallest = &k;
    if (!k.fits) continue;
    const bool better = !best ? true
                        : timed ? faster(k.t, k.e.layout, best->t, best->e.layout)
                                : recipe_key(cfg.micro_batch_tokens, k.e.layout, k.e) <
                                      recipe_key(cfg.micro_batch_tokens, best->e.layout, best->e);
    if (better) best = &k;
  }
  if (!best) {
    // The closest candidate's largest categories.
    std::vector<std::pair<int64_t, int>> by;
    for (int i = 0; i < kNumMemCategories; ++i) by.push_back({smallest->e.peak[static_cast<MemCategory>(i)], i});
    std::sort(by.rbegin(), by.rend());
    std::string cats;
    for (size_t i = 0; i < 3 && i < by.size(); ++i)
      cats += std::string(i ? ", " : "") + category_name(static_cast<MemCategory>(by[i].second)) + " " + format_bytes(by[i].first);
    BB_FAIL("parallel = auto: no layout of ", world, " rank(s) fits ", format_bytes(available),
            " per rank; the smallest predicted peak is ", format_bytes(smallest->e.peak_total), " at ",
            smallest->e.layout.str(), " (largest: ", cats,
            "). Use more ranks, fewer tokens per micro-batch, primitives.recompute = \"full\" or primitives.state = "
            "\"fsdp\" (bumblebee plan --explain shows every phase)");
  }
  if (why) {
    const ParallelLayout& L = best->e.layout;
    char buf[768];
    if (timed) {
      std::snprintf(buf, sizeof buf,
                    "parallel = auto chose %s of %zu candidate layout(s) for %lld rank(s): the most predicted tokens/s per "
                    "GPU among those that fit (%.0f tokens/s/GPU, %.1f model TFLOP/s/GPU, %.1f ms a step of which %.1f ms "
                    "communication not hidden; cp %lld: %lld tokens per rank); predicted peak %s%s%s (PREDICTED, "
                    "calibration: %s)",
                    L.str().c_str(), cands.size(), static_cast<long long>(world), best->t.tokens_per_s(), best->t.tflops(),
                    best->t.step_s * 1e3,
                    (best->t.exposed_gather + best->t.exposed_reduce + best->t.exposed_ep + best->t.exposed_cp) * 1e3,
                    static_cast<long long>(L.cp), static_cast<long long>(ceil_div(cfg.micro_batch_tokens, L.cp)),
                    format_bytes(best->e.peak_total).c_str(), available > 0 ? " of " : "",
                    available > 0 ? format_bytes(available).c_str() : "", Calibration::builtin().device.c_str());
      *why = buf;
      return best->c;
    }
    std::snprintf(buf, sizeof buf,
                  "parallel = auto chose %s of %zu candidate layout(s) for %lld rank(s): cp %lld (%lld tokens per rank%s), "
                  "then the least predicted wire time (%.1f ms a step if nothing overlapped); predicted peak %s%s%s "
                  "(PREDICTED; CPU ranks have no time model)",
                  L.str().c_str(), cands.size(), static_cast<long long>(world), static_cast<long long>(L.cp),
                  static_cast<long long>(ceil_div(cfg.micro_batch_tokens, L.cp)),
                  ceil_div(cfg.micro_batch_tokens, L.cp) > 32768 ? ", above the 32K target: no larger cp fits" : "",
                  best->e.comm.total_s() * 1e3, format_bytes(best->e.peak_total).c_str(),
                  available > 0 ? " of " : "", available > 0 ? format_bytes(available).c_str() : "");
    *why = buf;
  }
  return best->c;
}

PlanResult plan_layouts(const RunConfig& base, const PlanRequest& req,
                        const std::function<void(int64_t, int64_t)>& progress) {
  BB_CHECK(req.gpus >= 1, "plan: --gpus must be >= 1, got ", req.gpus);
  BB_CHECK(req.seq >= 1, "plan: --seq must be >= 1, got ", req.seq);
  BB_CHECK(req.gpu_memory_gib > 0, "plan: --gpu-memory must be > 0 GiB, got ", req.gpu_memory_gib);
  BB_CHECK(req.margin >= 0 && req.margin < 1, "plan: the margin must be in [0, 1), got ", req.margin);
  PlanResult r;
  r.usable = static_cast<int64_t>(req.gpu_memory_gib * (1 - req.margin) * double(int64_t{1} << 30));
  const ModelConfig& mc = base.model;
  std::vector<std::pair<int64_t, int64_t>> layouts;  // (cp, ep)
  for (int64_t cp = 1; cp <= req.gpus; cp *= 2) {
    if (req.gpus % cp != 0 || (cp > 1 && req.seq < 2 * cp)) continue;
    const int64_t dpcp = req.gpus;  // pp = 1: every rank is in one stage
    if (mc.num_experts == 0) {
      layouts.push_back({cp, 1});
      continue;
    }
    for (int64_t ep = 1; ep <= dpcp; ++ep)
      if (mc.num_experts % ep == 0 && dpcp % ep == 0) layouts.push_back({cp, ep});
  }
  const int64_t total = static_cast<int64_t>(layouts.size());
  int64_t done = 0;
  for (const auto& [cp, ep] : layouts) {
    RunConfig c = base;
    c.device = "cuda";
    c.cp = cp;
    c.ep = ep;
    c.dp = 0;
    c.pp = 1;
    c.micro_batch_tokens = req.seq;
    c.prim.set("state", "fsdp", "the plan");
    c.prim.set("recompute", "full", "the plan");
    c.prim.set("loss", "linear_ce", "the plan");
    c.prim.set("permute", "memory_efficient", "the plan");
    if (mc.num_experts > 0) c.prim.set("moe_dispatch", ep > 1 ? "chunked_alltoall:2" : "alltoall", "the plan");
    c.prim.set("attention", cp > 1 ? "cp_ring" : "sdpa", "the plan");
    c.emulate.ranks = req.gpus;
    c.emulate.link.gpus_per_node = req.gpus_per_node;
    if (req.global_batch_tokens > 0) {
      // Sequences per data rank (dp = gpus / cp, pp 1) become micro-batches of its step.
      const int64_t dp = req.gpus / cp;
      c.grad_accum = std::max<int64_t>(1, ceil_div(req.global_batch_tokens, req.seq * dp));
    }
    PlanCandidate pc;
    try {
      pc.estimate = estimate_memory(c, req.gpus);
      pc.layout = pc.estimate.layout;
      pc.fits = pc.estimate.peak_total <= r.usable;
      pc.time = estimate_time(c, pc.estimate, req.calibration ? *req.calibration : Calibration::builtin());
      r.candidates.push_back(pc);
    } catch (const Error&) {
      // A layout the model cannot take (e.g. heads that cp cannot split): not a candidate.
    }
    if (progress) progress(++done, total);
  }
  // The choice: the most predicted tokens/s per GPU among the layouts that fit.
  PlanCandidate* best = nullptr;
  for (PlanCandidate& pc : r.candidates) {
    if (!pc.fits) continue;
    if (!best || faster(pc.time, pc.layout, best->time, best->layout)) best = &pc;
  }
  char buf[1536];
  if (!best) {
    std::snprintf(buf, sizeof buf,
                  "no layout of %lld GPUs fits %.1f GiB per GPU (less a %.0f %% margin) at %lld tokens per sequence "
                  "under the recipe; use more GPUs or shorter sequences",
                  static_cast<long long>(req.gpus), req.gpu_memory_gib, req.margin * 100, static_cast<long long>(req.seq));
    r.why = buf;
    return r;
  }
  best->chosen = true;
  const ParallelLayout& L = best->layout;
  // Why this CP and this EP: the best layout at another CP (same EP) and at another EP (same CP).
  const PlanCandidate* other_cp = nullptr;
  const PlanCandidate* other_ep = nullptr;
  for (const PlanCandidate& pc : r.candidates) {
    if (!pc.fits || &pc == best) continue;
    if (pc.layout.ep == L.ep && pc.layout.cp != L.cp && (!other_cp || faster(pc.time, pc.layout, other_cp->time, other_cp->layout)))
      other_cp = &pc;
    if (pc.layout.cp == L.cp && pc.layout.ep != L.ep && (!other_ep || faster(pc.time, pc.layout, other_ep->time, other_ep->layout)))
      other_ep = &pc;
  }
  const TimeEstimate& t = best->time;
  const double hidden_not = t.exposed_gather + t.exposed_reduce + t.exposed_ep + t.exposed_cp;
  const int64_t experts_per_rank = mc.num_experts > 0 ? mc.num_experts / L.ep : 0;
  std::string s;
  std::snprintf(buf, sizeof buf,
                "%s: %.0f tokens/s/GPU, %.1f model TFLOP/s/GPU predicted (a step of %.1f ms, %.1f ms of it "
                "communication the schedule does not hide, of %.1f ms on the wire), peak %s of %s usable. ",
                L.str().c_str(), t.tokens_per_s(), t.tflops(), t.step_s * 1e3, hidden_not * 1e3, t.wire_s * 1e3,
                format_bytes(best->estimate.peak_total).c_str(), format_bytes(r.usable).c_str());
  s += buf;
  std::snprintf(buf, sizeof buf, "CP %lld: %lld tokens per GPU", static_cast<long long>(L.cp),
                static_cast<long long>(ceil_div(req.seq, L.cp)));
  s += buf;
  if (other_cp) {
    std::snprintf(buf, sizeof buf, "; CP %lld would give %.0f tokens/s/GPU at a peak of %s",
                  static_cast<long long>(other_cp->layout.cp), other_cp->time.tokens_per_s(),
                  format_bytes(other_cp->estimate.peak_total).c_str());
    s += buf;
  }
  bool smaller_cp_fails = false;
  for (const PlanCandidate& pc : r.candidates)
    if (pc.layout.ep == L.ep && pc.layout.cp < L.cp && !pc.fits) smaller_cp_fails = true;
  if (smaller_cp_fails) s += " (a smaller CP does not fit: the sequence's activations need the split)";
  s += ". ";
  if (mc.num_experts > 0) {
    std::snprintf(buf, sizeof buf, "EP %lld: %lld of %lld experts per GPU, %.0f rows per expert a micro-batch",
                  static_cast<long long>(L.ep), static_cast<long long>(experts_per_rank),
                  static_cast<long long>(mc.num_experts),
                  static_cast<double>(ceil_div(req.seq, L.cp) * mc.top_k) / static_cast<double>(std::max<int64_t>(1, experts_per_rank)));
    s += buf;
    if (other_ep) {
      std::snprintf(buf, sizeof buf, "; EP %lld would give %.0f tokens/s/GPU (expert GEMMs %.1f ms, all-to-alls not hidden %.1f ms, "
                    "parameter gathers not hidden %.1f ms a step; here %.1f, %.1f, %.1f)",
                    static_cast<long long>(other_ep->layout.ep), other_ep->time.tokens_per_s(),
                    other_ep->time.expert_gemm * 1e3, other_ep->time.exposed_ep * 1e3, other_ep->time.exposed_gather * 1e3,
                    t.expert_gemm * 1e3, t.exposed_ep * 1e3, t.exposed_gather * 1e3);
      s += buf;
    }
    s += ". ";
  }
  std::snprintf(buf, sizeof buf, "dp %lld; fsdp, full recompute, linear_ce%s. PREDICTED with the calibration of %s.",
                static_cast<long long>(L.dp), L.ep > 1 ? ", chunked_alltoall:2" : "",
                (req.calibration ? *req.calibration : Calibration::builtin()).device.c_str());
  s += buf;
  r.why = s;
  return r;
}

}  // namespace bb::plan

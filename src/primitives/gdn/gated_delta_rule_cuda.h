// gated_delta_rule_cuda.h — host-side declarations of the chunked gated delta rule CUDA kernels
// (equations in gated_delta_rule_ref.h and skills/gated-delta-rule.md). Raw device pointers;
// everything is enqueued on cuda::stream(); no host synchronisation.
//
// Tensors (T tokens, Hk key heads, Hv value heads, K = V <= 128 head dims, K % 8 == V % 8 == 0):
//   q, k   [T, Hk, K]  f32 or bf16 (`dt`)      v   [T, Hv, V]  dt       o  [T, Hv, V]  dt (written)
//   g, beta [T, Hv]    f32
//   d_o    [T, Hv, V]  f32 or dt (`do_dt`)
//   dq, dk [T, Hk, K], dv [T, Hv, V], dg, dbeta [T, Hv]: f32, written (=)
//   table  the chunk table of gdn_chunk_table(), uploaded to the device
//   ws     workspace of gdn_*_workspace_bytes() bytes (device memory, no initial value needed)
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace bb::cuda {

struct GdnDims {
  int64_t T = 0;
  int Hk = 0, Hv = 0, K = 0, V = 0;
  float scale = 1.f;  // applied to q after the norm (already resolved: never 0 here)
  float eps = 1e-6f;
  bool l2norm = true;
  int num_chunks = 0;  // filled by gdn_chunk_table
  int num_seqs = 0;    // non-empty sequences, filled by gdn_chunk_table
};

// A sequence that continues across calls: the time segments of one long call
// (gated_delta_rule.cpp) carry its state. States are f32 [Hv][128][128] (K x V per value head,
// padded to the kernels' 128). seq_in / seq_out are table positions (gdn_table_seq), -1 for none.
//   forward:  sequence seq_in starts from s_in (else from zero); sequence seq_out leaves its end
//             state in s_out.
//   backward: the gradient of seq_out's end state starts from ds_in (else zero), and the gradient
//             of seq_in's start state is written to ds_out; seq_in's states are rebuilt from s_in.
struct GdnCarry {
  int seq_in = -1, seq_out = -1;
  const float* s_in = nullptr;
  float* s_out = nullptr;
  const float* ds_in = nullptr;
  float* ds_out = nullptr;
};
constexpr int64_t kGdnCarryFloatsPerHead = 128 * 128;

// Carried states between a caller's f32 [Hv][K][V] and the kernels' [Hv][128][128]: pad writes
// every entry of dst (src null: zeros, or with `identity` the K x K identity, V = K), unpad the
// K x V block back.
void gdn_pad_state(float* dst, const float* src, int Hv, int K, int V, bool identity = false);
void gdn_unpad_state(float* dst, const float* src, int Hv, int K, int V);

// Host: the chunk table for cu_seqlens (host, nseq + 1 entries): chunks of 64 tokens that never
// cross a sequence boundary (the last of a sequence may be partial), and the non-empty sequences
// longest first (the sequential state passes of long sequences start first). Layout, ints:
// [chunk_start x C][chunk_len x C][seq_first_chunk x S][seq_num_chunks x S]. Sets the counts.
std::vector<int32_t> gdn_chunk_table(const int32_t* cu, int64_t nseq, GdnDims& dims);

// The forward. keep_prep = false: ws is gdn_forward_workspace_bytes() of scratch. keep_prep =
// true: ws is a buffer of gdn_prep_bytes() that comes back holding chunk_prep's outputs (the
// normalised q, k; W, U, P, T, gamma) for gdn_backward's `prep`.
size_t gdn_forward_workspace_bytes(const GdnDims& dims, DType dt);
size_t gdn_prep_bytes(const GdnDims& dims, DType dt);
void gdn_forward(void* o, const void* q, const void* k, const void* v, const float* g,
                 const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                 bool keep_prep = false, const GdnCarry* carry = nullptr);

// The position in `table` (gdn_chunk_table) of the sequence starting at token `token_start`, or
// -1 when no non-empty sequence starts there.
int gdn_table_seq(const std::vector<int32_t>& table, const GdnDims& dims, int32_t token_start);

// The end state of carry.seq_out (into carry.s_out; its start from carry.s_in when it is
// carry.seq_in) and nothing else: qk_norm, chunk_prep and the state pass. ws: forward workspace.
void gdn_end_state(const void* q, const void* k, const void* v, const float* g, const float* beta,
                   const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                   const GdnCarry& carry);

// The gradient of carry.seq_in's start state from d_o alone (into carry.ds_out), plus, when
// carry.seq_out is set, what carry.ds_in at its end state gives: qk_norm, chunk_prep and the
// backward's reverse state pass, no input gradient. ws: backward workspace (no prep).
void gdn_start_grad(const void* d_o, DType do_dt, const void* q, const void* k, const void* v, const float* g,
                    const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                    const GdnCarry& carry);

// The backward. prep: null (qk_norm and chunk_prep run here) or the buffer of a keep_prep
// forward on the same inputs, dims and table; the backward then skips both and consumes it
// (its U part is overwritten: a kept prep serves one backward). have_prep sizes ws for that.
size_t gdn_backward_workspace_bytes(const GdnDims& dims, DType dt, DType do_dt,
                                    bool have_prep = false);
void gdn_backward(float* dq, float* dk, float* dv, float* dg, float* dbeta, const void* d_o,
                  DType do_dt, const void* q, const void* k, const void* v, const float* g,
                  const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                  void* prep = nullptr, const GdnCarry* carry = nullptr);

// Kernel variants, for the benchmarks and tests that compare them (bench_gdn, tests/gpu/
// test_gdn_gpu.cpp): every variant computes bitwise the same results, only which block or stream
// runs what differs. A run uses the defaults, each field's measured automatic choice.
// Process-wide; change it between calls, not during one.
struct GdnVariant {
  int vt = 0;                  // value columns per state-pass block: 16, 32 or 64; 0 automatic
  int state_warps = 0;         // warps per state-pass block (32 and 64 columns): 4 or 8; 0 automatic
  bool chunk_fastest = false;  // per-(chunk, head) grids with chunks fastest (default: value heads)
  bool prep_reload = true;     // chunk_prep loads K^ again after the solve (false: keeps it resident)
  int fwd_split = -1;          // % of the forward's chunk_prep run before the state pass; -1: 60
  bool overlap = true;         // the backward's two state passes on two streams (false: one)
};
void set_gdn_variant(const GdnVariant& v);
GdnVariant gdn_variant();

}  // namespace bb::cuda

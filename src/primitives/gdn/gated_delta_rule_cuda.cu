// gated_delta_rule_cuda.cu — the chunked (WY / UT) gated delta rule on the GPU, forward and
// backward, over packed variable-length sequences (equations: gated_delta_rule_ref.h and
// skills/gated-delta-rule.md; the chunked backward is derived there).
//
// Legend: T tokens, C = 64 tokens per chunk (the last chunk of a sequence may be shorter),
// D = 128 (K and V padded to it with zeros), per value head h and chunk with state S0 [K, V]:
//   gamma_t = sum_{i <= t} g_i (within the chunk), Gamma = exp(gamma), c_t = exp(gamma_last -
//   gamma_t) L = strictly lower (beta_t exp(gamma_t - gamma_i) k_t . k_i),  T = (I + L)^-1 W = (T
//   diag(beta Gamma)) K,  U = (T diag(beta)) V,  Delta = U - W S0 P = (i <= t) exp(gamma_t -
//   gamma_i) q_t . k_i O = diag(Gamma) Q S0 + P Delta,  S_next = Gamma_last S0 + K^T diag(c) Delta
//
// Kernels (128 threads = 4 warps; the sequential state passes 4 or 8 warps, pick_state_warps;
// chunk-local products on tensor cores):
//   forward:  qk_norm -> chunk_prep -> state_fwd<fused output>
//   backward: qk_norm -> chunk_prep (+T) -> state_fwd<recompute: boundary states h, Delta>
//             -> [d_o to operand planes] -> state_bwd (reverse: dh, dDelta) -> dqkw (dq, dk parts,
//             dW, dgamma parts) -> wy_bwd (dv, dbeta, dg, dk parts) -> finalize_qk (GVA sum + norm)
//
// Precision. Every matrix product is mma.sync m16n8k16 bf16 with fp32 accumulation; the state
// and all accumulations stay fp32. With bf16 inputs each operand is rounded to bf16 once
// (relative 2^-9). With f32 inputs each f32 operand x is split as hi = bf16(x), lo = bf16(x - hi)
// and a b = ah bh + ah bl + al bh (three products): about 2^-16 relative per product, which keeps
// the f32 path within 1e-4 of the fp64 reference. Intermediates that travel between kernels
// (normalised q/k, W, U, P, T, h, Delta, dh, dDelta, dW) are stored in the same "operand planes":
// one bf16 plane, or the hi and lo planes (lo at +plane_stride) for f32. The triangular solve is
// fp32 arithmetic (no tensor cores).
//
// Shared-memory operand tiles are [rows][cols] bf16 with 16-byte chunks XOR-swizzled by row, so
// ldmatrix (8 rows x 16 bytes) and the accumulator stores hit 32 distinct banks.
//
// Parallelism: the chunk-parallel kernels run one block per (chunk, value head); the state passes
// one block per (non-empty sequence, value head, VT value columns), sequential over the chunks of
// the sequence, with the next chunk's tiles prefetched by cp.async (two stages for bf16; one for
// f32, whose hi/lo tiles need twice the shared memory); in the backward the rebuild and the
// reverse pass run side by side on two streams (side_stream). Nothing is atomic: results are
// bitwise reproducible. Measured on an H200 (bench_gdn, ncu; skills/gated-delta-rule.md): the state
// passes are bound by shared-memory bandwidth (every warp reads the S / Delta tiles it shares
// with the others, about 250 KB per chunk and block), chunk_prep / dqkw / wy_bwd by latency at
// 3 / 2 / 2 blocks an SM; none is near the tensor-core or HBM ceilings. Shared-memory layouts
// overlap buffers whose lives do not overlap, to fit those blocks.
//
// Files. This one: the public entry points (gated_delta_rule_cuda.h: the chunk table, the
// forward / backward / end-state calls and their workspaces, GdnVariant) and the state both
// directions share (g_variant, the side streams). gated_delta_rule_fwd_cuda.cu: kernels qk_norm,
// chunk_prep and the state pass (forward output or the backward's rebuild), with their launchers
// and the forward's driver. gated_delta_rule_bwd_cuda.cu: the backward's kernels from d_o on, with
// their launchers and driver. gdn_cuda_common.cuh: the constants, PTX and tile helpers, Dims and
// the host helpers both use.
#include "primitives/gdn/gdn_cuda_common.cuh"

namespace bb::cuda {

using namespace gdn;  // gdn_cuda_common.cuh

namespace gdn {  // declared in gdn_cuda_common.cuh

GdnVariant g_variant;  // set_gdn_variant (benchmarks and tests); the defaults in a run

// Side streams: gdn_cuda_common.cuh.
SideStream& side_stream(int kind) {
  constexpr int kMaxDevices = 64;
  thread_local SideStream per_device[2][kMaxDevices];
  int dev = 0;
  BB_CHECK_CUDA(cudaGetDevice(&dev));
  BB_CHECK(dev >= 0 && dev < kMaxDevices, "gated_delta_rule (CUDA): device ", dev,
           " is beyond the ", kMaxDevices, " this backend supports");
  SideStream& ss = per_device[kind][dev];
  if (ss.s == nullptr) {
    int lo = 0, hi = 0;
    BB_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    // The forward's state pass goes first (it waits on chunk_prep's flags, resident); the
    // backward's rebuild pass shares SMs with the reverse pass at the compute stream's priority
    // (not the lowest, where the update beside the backward queues its short blocks: measured
    // 4.8 ms a layer instead of 2.2 for the Qwen3.5 slice's 8K backward with the update beside it).
    BB_CHECK_CUDA(cudaStreamCreateWithPriority(&ss.s, cudaStreamNonBlocking,
                                               kind == 1 ? hi : bb::cuda::work_stream_priority(dev)));
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&ss.fork, cudaEventDisableTiming));
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&ss.join, cudaEventDisableTiming));
  }
  return ss;
}

}  // namespace gdn

int gdn_table_seq(const std::vector<int32_t>& table, const GdnDims& dims, int32_t token_start) {
  const size_t nc = static_cast<size_t>(dims.num_chunks);
  for (int j = 0; j < dims.num_seqs; ++j) {
    const size_t first = static_cast<size_t>(table[2 * nc + static_cast<size_t>(j)]);
    if (table[first] == token_start) return j;
  }
  return -1;
}

void gdn_end_state(const void* q, const void* k, const void* v, const float* g, const float* beta,
                   const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                   const GdnCarry& carry) {
  if (dims.T == 0 || dims.num_chunks == 0 || carry.seq_out < 0) return;
  if (dt == DType::f32)
    end_state_impl<float>(static_cast<const float*>(q), static_cast<const float*>(k),
                          static_cast<const float*>(v), g, beta, table, dims, ws, carry);
  else
    end_state_impl<uint16_t>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                             static_cast<const uint16_t*>(v), g, beta, table, dims, ws, carry);
}

void gdn_start_grad(const void* d_o, DType do_dt, const void* q, const void* k, const void* v, const float* g,
                    const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                    const GdnCarry& carry) {
  if (dims.T == 0 || dims.num_chunks == 0 || carry.seq_in < 0 || carry.ds_out == nullptr) return;
  if (dt == DType::f32)
    start_grad_impl<float>(d_o, do_dt, static_cast<const float*>(q), static_cast<const float*>(k),
                           static_cast<const float*>(v), g, beta, table, dims, dt, ws, carry);
  else
    start_grad_impl<uint16_t>(d_o, do_dt, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                              static_cast<const uint16_t*>(v), g, beta, table, dims, dt, ws, carry);
}

std::vector<int32_t> gdn_chunk_table(const int32_t* cu, int64_t nseq, GdnDims& dims) {
  std::vector<int32_t> starts, lens, order;
  std::vector<int32_t> first(static_cast<size_t>(nseq)), count(static_cast<size_t>(nseq));
  for (int64_t s = 0; s < nseq; ++s) {
    first[static_cast<size_t>(s)] = static_cast<int32_t>(starts.size());
    for (int32_t c0 = cu[s]; c0 < cu[s + 1]; c0 += kC) {
      starts.push_back(c0);
      lens.push_back(std::min(kC, cu[s + 1] - c0));
    }
    count[static_cast<size_t>(s)] =
        static_cast<int32_t>(starts.size()) - first[static_cast<size_t>(s)];
    if (count[static_cast<size_t>(s)] > 0) order.push_back(static_cast<int32_t>(s));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return count[static_cast<size_t>(a)] > count[static_cast<size_t>(b)];
  });
  BB_CHECK(order.size() <= 65535,
           "gated_delta_rule (CUDA): at most 65535 non-empty sequences per call, got ",
           order.size());
  dims.num_chunks = static_cast<int>(starts.size());
  dims.num_seqs = static_cast<int>(order.size());
  std::vector<int32_t> table(starts);
  table.insert(table.end(), lens.begin(), lens.end());
  for (int32_t s : order) table.push_back(first[static_cast<size_t>(s)]);
  for (int32_t s : order) table.push_back(count[static_cast<size_t>(s)]);
  return table;
}

size_t gdn_forward_workspace_bytes(const GdnDims& dims, DType dt) {
  return dt == DType::f32 ? forward_ws<float>(dims, false) : forward_ws<uint16_t>(dims, false);
}

size_t gdn_prep_bytes(const GdnDims& dims, DType dt) {
  return dt == DType::f32 ? forward_ws<float>(dims, true) : forward_ws<uint16_t>(dims, true);
}

void gdn_forward(void* o, const void* q, const void* k, const void* v, const float* g,
                 const float* beta, const int32_t* table, const GdnDims& dims, DType dt, void* ws,
                 bool keep_prep, const GdnCarry* carry) {
  if (dims.T == 0 || dims.num_chunks == 0) return;
  if (dt == DType::f32)
    forward_impl<float>(static_cast<float*>(o), static_cast<const float*>(q),
                        static_cast<const float*>(k), static_cast<const float*>(v), g, beta, table,
                        dims, ws, keep_prep, carry);
  else
    forward_impl<uint16_t>(static_cast<uint16_t*>(o), static_cast<const uint16_t*>(q),
                           static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
                           beta, table, dims, ws, keep_prep, carry);
}

size_t gdn_backward_workspace_bytes(const GdnDims& dims, DType dt, DType do_dt, bool have_prep) {
  const bool own = do_needs_planes(dims, dt, do_dt);
  return dt == DType::f32 ? backward_ws<float>(dims, own, have_prep)
                          : backward_ws<uint16_t>(dims, own, have_prep);
}

void gdn_backward(float* dq, float* dk, float* dv, float* dg, float* dbeta, const void* d_o,
                  DType do_dt, const void* q, const void* k, const void* v, const float* g,
                  const float* beta, const int32_t* table, const GdnDims& dims, DType dt,
                  void* ws, void* prep, const GdnCarry* carry) {
  if (dims.T == 0 || dims.num_chunks == 0) return;
  if (dt == DType::f32)
    backward_impl<float>(dq, dk, dv, dg, dbeta, d_o, do_dt, static_cast<const float*>(q),
                         static_cast<const float*>(k), static_cast<const float*>(v), g, beta, table,
                         dims, dt, ws, prep, carry);
  else
    backward_impl<uint16_t>(dq, dk, dv, dg, dbeta, d_o, do_dt, static_cast<const uint16_t*>(q),
                            static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
                            beta, table, dims, dt, ws, prep, carry);
}

namespace {
// dst [Hv][128][128] from src [Hv][K][V] (null: zeros, or the K x K identity), pad zero.
__global__ void pad_state_kernel(float* dst, const float* src, int Hv, int K, int V, bool identity) {
  const int64_t n = static_cast<int64_t>(Hv) * 128 * 128;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    const int j = static_cast<int>(e % 128), i = static_cast<int>((e / 128) % 128), h = static_cast<int>(e / (128 * 128));
    float x = 0.f;
    if (i < K && j < V) {
      if (src != nullptr) x = src[(static_cast<int64_t>(h) * K + i) * V + j];
      else if (identity && i == j) x = 1.f;
    }
    dst[e] = x;
  }
}
__global__ void unpad_state_kernel(float* dst, const float* src, int Hv, int K, int V) {
  const int64_t n = static_cast<int64_t>(Hv) * K * V;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    const int j = static_cast<int>(e % V), i = static_cast<int>((e / V) % K), h = static_cast<int>(e / (static_cast<int64_t>(K) * V));
    dst[e] = src[(static_cast<int64_t>(h) * 128 + i) * 128 + j];
  }
}
}  // namespace

void gdn_pad_state(float* dst, const float* src, int Hv, int K, int V, bool identity) {
  const int64_t n = static_cast<int64_t>(Hv) * 128 * 128;
  launch(pad_state_kernel, dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096))), 256, 0,
         dst, src, Hv, K, V, identity);
}

void gdn_unpad_state(float* dst, const float* src, int Hv, int K, int V) {
  const int64_t n = static_cast<int64_t>(Hv) * K * V;
  if (n == 0) return;
  launch(unpad_state_kernel, dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096))), 256, 0,
         dst, src, Hv, K, V);
}

void set_gdn_variant(const GdnVariant& v) {
  BB_CHECK(v.vt == 0 || v.vt == 16 || v.vt == 32 || v.vt == 64, "GdnVariant: vt is 16, 32, 64 or 0, got ", v.vt);
  BB_CHECK(v.state_warps == 0 || v.state_warps == 4 || v.state_warps == 8, "GdnVariant: state_warps is 4, 8 or 0, got ",
           v.state_warps);
  BB_CHECK(v.fwd_split >= -1 && v.fwd_split <= 100, "GdnVariant: fwd_split is a percent or -1, got ", v.fwd_split);
  g_variant = v;
}

GdnVariant gdn_variant() { return g_variant; }

}  // namespace bb::cuda

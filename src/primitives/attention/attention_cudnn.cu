// attention_cudnn.cu — causal GQA attention over packed sequences through cuDNN 9's fused flash
// attention, built on the cuDNN backend (graph) API. Contract: attention_cudnn.h.
//
// cuDNN fuses an operation graph only when it matches the SDPA patterns its engines know, so the
// two graphs below spell out, node by node and with the same tensor types, what cudnn-frontend's
// composite SDPA nodes emit (for cuDNN 9.6 - 9.20) for: bf16 Q/K/V/O in the packed THD layout
// with ragged offsets (queries and keys packed separately), a padding mask from per-sequence
// lengths, the causal mask (top-left, or bottom-right: row + (seq_len_kv - seq_len_q) >= col),
// or none, the attention scale passed by value, and softmax stats in a packed [Tq, Hq] layout.
//
// Packing (the same scheme as TransformerEngine's THD path):
//   - the graph's batch is B rounded up to a power of two (the extra sequences are empty) and
//     its query / key lengths are the token buckets of Tq / Tkv, so one cached graph serves every
//     batch that falls in the same buckets;
//   - ragged offsets (int64, counted in elements) say where sequence b starts: cq[b] * Hq * D for
//     q / o / dq / d_o, ck[b] * Hkv * D for k / v / dk / dv, cq[b] * Hq for the stats;
//   - seq_len_q = cq[b+1] - cq[b], seq_len_kv = ck[b+1] - ck[b] (0 for the padding sequences).
// cuDNN's stats are max + log(sum exp(s - max)) in natural log: the CPU reference's lse, only
// laid out [T, Hq]; two small transposes convert to and from AttentionSaved.lse [Hq, T].
//
// Dense graphs: one sequence whose length is exactly its token bucket, with as many keys as
// queries (the single-sequence training step, T = 4096, 8192, 32768, ...), runs graphs without
// ragged offsets, lengths or padding mask, with the stats in lse's own [Hq, T] layout. They skip
// the two transposes and cuDNN's ragged dO.O row-sum kernel, which on an H200 (cuDNN 9.19) read
// at ~250 GB/s (0.5 ms a layer at 8K tokens, 2 ms at 32K). When cuDNN refuses a dense graph the
// call prints one line and runs the packed graph.
#include "primitives/attention/attention_cudnn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"
#include "primitives/attention/cudnn_backend.h"

namespace bb {

namespace {

using cudnn::Desc;
using cudnn::DescPtr;

// ---- small kernels -------------------------------------------------------------------------

// The offsets reach the device inside the launch parameters of this kernel: no staging buffer,
// no host synchronisation. 2 x 480 positions keep the parameter block under the classic 4 KB.
constexpr int kPrepChunk = 480;

struct PrepChunk {
  int32_t pos_q[kPrepChunk + 1];   // query token where entry first + j starts (Tq past the end)
  int32_t pos_kv[kPrepChunk + 1];  // key token where entry first + j starts (Tkv past the end)
  int64_t first;                   // first entry of this chunk
  int32_t count;                   // entries in this chunk
};

__global__ void ragged_prep_kernel(PrepChunk c, int64_t max_b, int64_t mult_q, int64_t mult_kv,
                                   int64_t mult_stats, int32_t* seq_len_q, int32_t* seq_len_kv,
                                   int64_t* off_q, int64_t* off_kv, int64_t* off_stats) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c.count) return;
  const int64_t i = c.first + j;
  off_q[i] = c.pos_q[j] * mult_q;
  off_kv[i] = c.pos_kv[j] * mult_kv;
  off_stats[i] = c.pos_q[j] * mult_stats;
  if (i < max_b) {
    seq_len_q[i] = c.pos_q[j + 1] - c.pos_q[j];
    seq_len_kv[i] = c.pos_kv[j + 1] - c.pos_kv[j];
  }
}

// dst[c * rows + r] = src[r * cols + c] for a row-major [rows, cols] f32 src.
__global__ void transpose_f32_kernel(float* dst, const float* src, int64_t rows, int64_t cols) {
  __shared__ float tile[32][33];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 32;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = src[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][i];
  }
}

void transpose_f32(float* dst, const float* src, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  dim3 grid(static_cast<unsigned>(cuda::ceil_div(rows, 32)),
            static_cast<unsigned>(cuda::ceil_div(cols, 32)));
  transpose_f32_kernel<<<grid, dim3(32, 8), 0, cuda::stream()>>>(dst, src, rows, cols);
  BB_CHECK_LAUNCH();
}

// ---- buckets, keys, handles ---------------------------------------------------------------

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Tensor UIDs of the graphs' non-virtual tensors (virtual ones count from kFirstVirtual).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kScale, kSeqQ, kSeqKV, kOffQ, kOffK, kOffV, kOffO, kOffStats,
  kNegInfPadding, kNegInfCausal, kOne, kSoftmaxSum, kDQAccum, kDKFull, kDVFull,
  kFirstVirtual = 1000,
};

struct GraphKey {
  bool backward;
  int device;
  int64_t b, s_q, s_kv, hq, hkv, d;
  DType dtype;
  AttentionMask mask;
  bool dense = false;  // b == 1, s_q == s_kv == the sequence's exact length, no ragged offsets
  auto tie() const {
    return std::make_tuple(backward, device, b, s_q, s_kv, hq, hkv, d, static_cast<int>(dtype),
                           static_cast<int>(mask), dense);
  }
  bool operator<(const GraphKey& o) const { return tie() < o.tie(); }
};

cudnnDataType_t cudnn_dtype(DType dt) {
  switch (dt) {
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    case DType::f16: return CUDNN_DATA_HALF;
    default: BB_FAIL("attention (cuDNN): unsupported dtype ", dtype_name(dt));
  }
}

// One cuDNN handle per device for the life of the process (never destroyed: process exit may
// already have torn down the CUDA context).
cudnnHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::map<int, cudnnHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cuda::set_device(device);
  cudnnHandle_t h = nullptr;
  BB_CHECK_CUDNN(cudnn::api().Create(&h), "cudnnCreate on cuda:", device);
  handles.emplace(device, h);
  return h;
}

int64_t runtime_version() { return static_cast<int64_t>(cudnn::api().GetVersion()); }

// ---- graph construction --------------------------------------------------------------------

// Owns every descriptor of one operation graph. Tensors are created with explicit dims, strides
// and types (the frontend's shape inference is done by hand at the call sites).
class GraphBuilder {
 public:
  int64_t tensor(int64_t uid, const Shape& dims, const Shape& strides, cudnnDataType_t dt,
                 bool is_virtual, int64_t ragged_uid = -1, bool by_value = false) {
    auto t = std::make_shared<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    t->set_dtype(CUDNN_ATTR_TENSOR_DATA_TYPE, dt);
    t->set_i64s(CUDNN_ATTR_TENSOR_DIMENSIONS, dims);
    t->set_i64s(CUDNN_ATTR_TENSOR_STRIDES, strides);
    t->set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
    t->set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    if (is_virtual) t->set_bool(CUDNN_ATTR_TENSOR_IS_VIRTUAL, true);
    if (by_value) t->set_bool(CUDNN_ATTR_TENSOR_IS_BY_VALUE, true);
    if (ragged_uid >= 0)
      t->set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *tensors_.at(ragged_uid));
    t->finalize("tensor");
    tensors_[uid] = t;
    if (!is_virtual) io_uids_.push_back(uid);
    return uid;
  }
  // A virtual (graph-internal) tensor.
  int64_t vt(const Shape& dims, const Shape& strides, cudnnDataType_t dt) {
    return tensor(next_virtual_++, dims, strides, dt, /*is_virtual=*/true);
  }
  // An f32 scalar passed by value at execution (a host pointer in the variant pack).
  int64_t scalar(int64_t uid) {
    return tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, -1, true);
  }

  // y = mode(x [, b [, t]]); `axis` only for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b = -1, int64_t t = -1,
                 cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = std::make_shared<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw->set_dtype(CUDNN_ATTR_POINTWISE_MATH_PREC, compute);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) pw->set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw->finalize("pointwise descriptor");
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *tensors_.at(x));
    if (b >= 0) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *tensors_.at(b));
    if (t >= 0) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *tensors_.at(t));
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *tensors_.at(y));
    op->set_float(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0f);
    op->set_float(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0f);
    op->finalize("pointwise operation");
    keep_.push_back(pw);
    ops_.push_back(op);
  }

  // c = a @ b over the last two dims; m / n / k overrides are per-batch [b,1,1,1] i32 lengths.
  void matmul(int64_t a, int64_t b, int64_t c, int64_t m = -1, int64_t n = -1, int64_t k = -1) {
    auto mm = std::make_shared<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm->set_dtype(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
    mm->finalize("matmul descriptor");
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *tensors_.at(a));
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *tensors_.at(b));
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *tensors_.at(c));
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
    if (m >= 0) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *tensors_.at(m));
    if (n >= 0) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *tensors_.at(n));
    if (k >= 0) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *tensors_.at(k));
    op->finalize("matmul operation");
    keep_.push_back(mm);
    ops_.push_back(op);
  }

  // y = reduce(x) over the dims where y has extent 1.
  void reduction(cudnnReduceTensorOp_t mode, int64_t x, int64_t y) {
    auto rd = std::make_shared<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    rd->set_dtype(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    rd->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    if (runtime_version() >= 91100) rd->set_bool(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, false);
    rd->finalize("reduction descriptor");
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *rd);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *tensors_.at(x));
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *tensors_.at(y));
    op->finalize("reduction operation");
    keep_.push_back(rd);
    ops_.push_back(op);
  }

  // y = x viewed with y's dims and strides (used for the transposes of P, dS and K).
  void reshape(int64_t x, int64_t y) {
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *tensors_.at(x));
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *tensors_.at(y));
    op->finalize("reshape operation");
    ops_.push_back(op);
  }

  const std::vector<DescPtr>& ops() const { return ops_; }
  const std::vector<int64_t>& io_uids() const { return io_uids_; }
  // Moves every descriptor into `keep` (the backend may refer to them until the plan dies).
  void release_into(std::vector<DescPtr>& keep) {
    for (auto& [uid, t] : tensors_) keep.push_back(t);
    keep.insert(keep.end(), keep_.begin(), keep_.end());
    keep.insert(keep.end(), ops_.begin(), ops_.end());
  }

 private:
  std::map<int64_t, DescPtr> tensors_;
  std::vector<DescPtr> ops_, keep_;
  std::vector<int64_t> io_uids_;
  int64_t next_virtual_ = kFirstVirtual;
};

// The fixed tensors both graphs share: offsets, lengths, scale. Layouts (elements), sq / skv the
// query / key token buckets:
//   q-like [b, hq, sq, d] strides {sq*hq*d, d, hq*d, 1}    (THD: token-major, heads inside)
//   kv-like [b, hkv, skv, d] strides {skv*hkv*d, d, hkv*d, 1}; K^T / V^T swap the last two.
//   scores [b, hq, sq, skv]; their transpose (P^T, dS^T) [b, hq, skv, sq] over the same memory.
struct Dims {
  int64_t b, sq, skv, hq, hkv, d;
  bool dense;  // one whole sequence: no ragged offsets, no lengths, stats laid out [Hq, T]
  // The ragged-offset tensor of a packed graph; none for a dense one.
  int64_t off(int64_t uid) const { return dense ? -1 : uid; }
  // A per-sequence length override of a packed graph's matmul; none for a dense one.
  int64_t len(int64_t uid) const { return dense ? -1 : uid; }
  Shape q_dims() const { return {b, hq, sq, d}; }
  Shape q_strides() const { return {sq * hq * d, d, hq * d, 1}; }
  Shape kv_dims() const { return {b, hkv, skv, d}; }
  Shape kv_strides() const { return {skv * hkv * d, d, hkv * d, 1}; }
  Shape kvt_dims() const { return {b, hkv, d, skv}; }
  Shape kvt_strides() const { return {skv * hkv * d, d, 1, hkv * d}; }
  Shape stats_dims() const { return {b, hq, sq, 1}; }
  // Packed: [Tq, Hq] with offsets. Dense: [Hq, Tq], AttentionSaved.lse's own layout.
  Shape stats_strides() const { return dense ? row_strides() : Shape{hq * sq, 1, hq, 1}; }
  Shape row_dims() const { return {b, hq, sq, 1}; }
  Shape row_strides() const { return {hq * sq, sq, 1, 1}; }
  Shape score_dims() const { return {b, hq, sq, skv}; }
  Shape score_strides() const { return {hq * sq * skv, sq * skv, skv, 1}; }
  Shape score_t_dims() const { return {b, hq, skv, sq}; }
  Shape score_t_strides() const { return {hq * sq * skv, sq * skv, 1, skv}; }
  // dK / dV per query head before the GQA reduction: [b, hq, skv, d] on the kv offsets
  // (cuDNN scales the ragged offset by hq / hkv).
  Shape kv_full_dims() const { return {b, hq, skv, d}; }
  Shape kv_full_strides() const { return {skv * hq * d, d, hq * d, 1}; }
};

void add_offsets_and_lengths(GraphBuilder& g, const Dims& x) {
  g.scalar(kScale);
  if (x.dense) return;
  for (int64_t uid : {kOffQ, kOffK, kOffV, kOffO, kOffStats})
    g.tensor(uid, {x.b + 1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT64, false);
  g.tensor(kSeqQ, {x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, false);
  g.tensor(kSeqKV, {x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, false);
}

// Scores outside [0, seq_len_q) x [0, seq_len_kv) of their sequence become -inf (packed graphs
// only: a dense graph's one sequence fills its whole extent).
int64_t padding_mask(GraphBuilder& g, const Dims& x, int64_t s) {
  if (x.dense) return s;
  const Shape sd = x.score_dims(), ss = x.score_strides();
  const int64_t row = g.vt(sd, ss, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, -1, -1, CUDNN_DATA_INT32, 2);
  const int64_t col = g.vt(sd, ss, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, -1, -1, CUDNN_DATA_INT32, 3);
  const int64_t row_ok = g.vt(sd, ss, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, row, row_ok, kSeqQ, -1, CUDNN_DATA_BOOLEAN);
  const int64_t col_ok = g.vt(sd, ss, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_LT, col, col_ok, kSeqKV, -1, CUDNN_DATA_BOOLEAN);
  const int64_t ok = g.vt(sd, ss, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_ok, ok, col_ok, -1, CUDNN_DATA_BOOLEAN);
  const int64_t neg_inf = g.scalar(kNegInfPadding);
  const int64_t out = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, out, neg_inf, ok);
  return out;
}

// Causal mask: a key column past the query row becomes -inf (rows and columns are positions
// inside the sequence, thanks to the ragged offsets). Top-left: keep col <= row. Bottom-right:
// keep col <= row + (seq_len_kv - seq_len_q), with the lengths per sequence. Mask `none` has no
// node at all (the padding mask alone).
int64_t causal_mask(GraphBuilder& g, const Dims& x, int64_t s, AttentionMask mask) {
  if (mask == AttentionMask::none) return s;
  const Shape sd = x.score_dims(), ss = x.score_strides();
  int64_t row = g.vt(sd, ss, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, -1, -1, CUDNN_DATA_FLOAT, 2);
  const int64_t col = g.vt(sd, ss, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, -1, -1, CUDNN_DATA_FLOAT, 3);
  // A dense graph is built only for Tq == Tkv, where bottom-right and top-left are one mask.
  if (mask == AttentionMask::causal_bottom_right && !x.dense) {
    const int64_t plus_kv = g.vt(sd, ss, CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_ADD, row, plus_kv, kSeqKV, -1, CUDNN_DATA_INT32);
    const int64_t shifted = g.vt(sd, ss, CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_SUB, plus_kv, shifted, kSeqQ, -1, CUDNN_DATA_INT32);
    row = shifted;
  }
  const int64_t keep = g.vt(sd, ss, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, -1, CUDNN_DATA_BOOLEAN);
  const int64_t neg_inf = g.scalar(kNegInfCausal);
  const int64_t out = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, out, neg_inf, keep);
  return out;
}

// O = softmax(mask(scale * Q K^T)) V and Stats = max + log(sum exp(. - max)) (natural log).
void build_forward_ops(GraphBuilder& g, const Dims& x, cudnnDataType_t io, AttentionMask mask) {
  add_offsets_and_lengths(g, x);
  g.tensor(kQ, x.q_dims(), x.q_strides(), io, false, x.off(kOffQ));
  g.tensor(kK, x.kvt_dims(), x.kvt_strides(), io, false, x.off(kOffK));
  g.tensor(kV, x.kv_dims(), x.kv_strides(), io, false, x.off(kOffV));
  g.tensor(kO, x.q_dims(), x.q_strides(), io, false, x.off(kOffO));
  g.tensor(kStats, x.stats_dims(), x.stats_strides(), CUDNN_DATA_FLOAT, false,
           x.off(kOffStats));

  const Shape sd = x.score_dims(), ss = x.score_strides();
  const int64_t s1 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.matmul(kQ, kK, s1, x.len(kSeqQ), x.len(kSeqKV));
  const int64_t s2 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, s1, s2, kScale);
  const int64_t s3 = padding_mask(g, x, s2);
  const int64_t s4 = causal_mask(g, x, s3, mask);

  const Shape rd = x.row_dims(), rs = x.row_strides();
  const int64_t mx = g.vt(rd, rs, CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s4, mx);
  const int64_t centered = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, s4, centered, mx);
  const int64_t e = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, centered, e);
  const int64_t sum = g.vt(rd, rs, CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const int64_t log_sum = g.vt(rd, rs, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, kStats, log_sum);
  const int64_t p = g.vt(sd, ss, io);  // P in the I/O type: the second matmul's A operand
  g.pointwise(CUDNN_POINTWISE_DIV, e, p, sum);
  g.matmul(p, kV, kO, x.len(kSeqQ), -1, x.len(kSeqKV));
}

// dQ, dK, dV of the forward above (flash-attention backward: P rebuilt from the stats).
// GQA (hq != hkv): dK / dV are first formed per query head (dK_full / dV_full, scratch in the
// packed layout with Hq heads) and then summed over each kv head's group.
void build_backward_ops(GraphBuilder& g, const Dims& x, cudnnDataType_t io, AttentionMask mask) {
  add_offsets_and_lengths(g, x);
  g.tensor(kQ, x.q_dims(), x.q_strides(), io, false, x.off(kOffQ));
  g.tensor(kK, x.kvt_dims(), x.kvt_strides(), io, false, x.off(kOffK));
  g.tensor(kV, x.kvt_dims(), x.kvt_strides(), io, false, x.off(kOffV));
  g.tensor(kO, x.q_dims(), x.q_strides(), io, false, x.off(kOffO));
  g.tensor(kDO, x.q_dims(), x.q_strides(), io, false, x.off(kOffO));
  g.tensor(kStats, x.stats_dims(), x.stats_strides(), CUDNN_DATA_FLOAT, false,
           x.off(kOffStats));
  g.tensor(kDQ, x.q_dims(), x.q_strides(), io, false, x.off(kOffQ));
  g.tensor(kDK, x.kv_dims(), x.kv_strides(), io, false, x.off(kOffK));
  g.tensor(kDV, x.kv_dims(), x.kv_strides(), io, false, x.off(kOffV));
  const bool gqa = x.hq != x.hkv;

  // softmax_sum_i = sum_d dO_id * O_id (f32 scratch in the packed stats layout).
  const int64_t dodo = g.vt(x.q_dims(), {x.hq * x.sq * x.d, x.sq * x.d, x.hq * x.d, 1},
                            CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, kDO, dodo, kO);
  const int64_t row_sum = g.vt(x.row_dims(), x.row_strides(), CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dodo, row_sum);
  g.scalar(kOne);
  g.tensor(kSoftmaxSum, x.stats_dims(), x.stats_strides(), CUDNN_DATA_FLOAT, false,
           x.off(kOffStats));
  g.pointwise(CUDNN_POINTWISE_MUL, row_sum, kSoftmaxSum, kOne);

  // P = exp(mask(scale * Q K^T) - stats)
  const Shape sd = x.score_dims(), ss = x.score_strides();
  const int64_t s1 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.matmul(kQ, kK, s1, x.len(kSeqQ), x.len(kSeqKV));
  const int64_t s2 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, s1, s2, kScale);
  const int64_t s3 = padding_mask(g, x, s2);
  const int64_t s4 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, s3, s4, kStats);
  const int64_t s5 = causal_mask(g, x, s4, mask);
  const int64_t p = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, s5, p);

  // dV = P^T dO
  const int64_t p_t = g.vt(x.score_t_dims(), x.score_t_strides(), io);
  g.reshape(p, p_t);
  if (!gqa) {
    g.matmul(p_t, kDO, kDV, x.len(kSeqKV), -1, x.len(kSeqQ));
  } else {
    g.tensor(kDVFull, x.kv_full_dims(), x.kv_full_strides(), io, false, x.off(kOffV));
    g.matmul(p_t, kDO, kDVFull, x.len(kSeqKV), -1, x.len(kSeqQ));
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, kDVFull, kDV);
  }

  // dS = scale * P * (dO V^T - softmax_sum)
  const int64_t dp = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.matmul(kDO, kV, dp, x.len(kSeqQ), x.len(kSeqKV));
  const int64_t dp2 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, dp2, kSoftmaxSum);
  const int64_t dp3 = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dp2, dp3, p);
  const int64_t ds = g.vt(sd, ss, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dp3, ds, kScale);

  // dK = dS^T Q
  const int64_t ds_t = g.vt(x.score_t_dims(), x.score_t_strides(), io);
  g.reshape(ds, ds_t);
  if (!gqa) {
    g.matmul(ds_t, kQ, kDK, x.len(kSeqKV), -1, x.len(kSeqQ));
  } else {
    g.tensor(kDKFull, x.kv_full_dims(), x.kv_full_strides(), io, false, x.off(kOffK));
    g.matmul(ds_t, kQ, kDKFull, x.len(kSeqKV), -1, x.len(kSeqQ));
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, kDKFull, kDK);
  }

  // dQ = dS K, accumulated in f32 scratch (packed like dq), then written in the I/O type.
  // cudnn-frontend leaves the reshaped K's type to the graph's intermediate type (f32).
  const int64_t k_view = g.tensor(kFirstVirtual - 1, x.kv_dims(), x.kv_strides(),
                                  CUDNN_DATA_FLOAT, true, x.off(kOffK));
  g.reshape(kK, k_view);
  g.tensor(kDQAccum, x.q_dims(), x.q_strides(), CUDNN_DATA_FLOAT, false, x.off(kOffQ));
  g.matmul(ds, k_view, kDQAccum, x.len(kSeqQ), -1, x.len(kSeqKV));
  g.pointwise(CUDNN_POINTWISE_IDENTITY, kDQAccum, kDQ);
}

struct Graph {
  std::vector<DescPtr> keep;  // tensors, op descriptors, operations
  DescPtr op_graph, plan;
  std::vector<int64_t> io_uids;
  int64_t workspace_bytes = 0;
};

// Finalizes the operation graph and takes the first heuristics (mode A) engine config that
// yields a plan. Throws with cuDNN's message when none does.
void make_plan(Graph& graph, GraphBuilder& g, cudnnHandle_t handle) {
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const DescPtr& op : g.ops()) ops.push_back(op->get());
  auto og = std::make_shared<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  og->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
          static_cast<int64_t>(ops.size()), ops.data());
  og->set_handle(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle);
  og->finalize("operation graph");

  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *og);
  cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  heur.finalize("engine heuristics");
  int64_t count = 0;
  BB_CHECK_CUDNN(cudnn::api().BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                                  nullptr),
                 "engine heuristics: result count");
  BB_CHECK(count > 0, "cuDNN's heuristics found no engine for the graph");
  std::vector<DescPtr> cfgs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    cfgs.push_back(std::make_shared<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(cfgs.back()->get());
  }
  int64_t returned = 0;
  BB_CHECK_CUDNN(cudnn::api().BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                                                  raw.data()),
                 "engine heuristics: results");
  std::string failures;
  for (int64_t i = 0; i < returned; ++i) {
    auto plan = std::make_shared<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set_handle(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle);
    plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[static_cast<size_t>(i)]);
    const cudnnStatus_t st = plan->try_finalize();
    if (st != CUDNN_STATUS_SUCCESS) {
      failures += "\n  engine config " + std::to_string(i) + ": " + cudnn::status_text(st);
      continue;
    }
    int64_t ws = 0, n = 0;
    BB_CHECK_CUDNN(cudnn::api().BackendGetAttribute(plan->get(),
                                                    CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                    CUDNN_TYPE_INT64, 1, &n, &ws),
                   "execution plan: workspace size");
    graph.op_graph = og;
    graph.plan = plan;
    graph.workspace_bytes = ws;
    graph.keep.insert(graph.keep.end(), cfgs.begin(), cfgs.end());
    return;
  }
  BB_FAIL("none of cuDNN's ", returned, " engine configs could be finalized:", failures);
}

std::mutex g_cache_mu;
std::map<GraphKey, std::shared_ptr<Graph>> g_cache;  // a null entry: a dense graph cuDNN refused
int64_t g_graphs_built = 0;
std::atomic<int64_t> g_dense_calls{0};

std::string shape_text(const char* op, const GraphKey& key, int64_t Tq, int64_t Tkv, int64_t B) {
  std::ostringstream os;
  os << op << ": cuDNN cannot run this attention configuration (Tq = " << Tq << ", Tkv = " << Tkv
     << ", B = " << B << ", Hq = " << key.hq << ", Hkv = " << key.hkv << ", D = " << key.d << ", "
     << dtype_name(key.dtype) << ", mask " << attention_mask_name(key.mask)
     << ", packed; graph batch " << key.b << ", tokens " << key.s_q << " x " << key.s_kv << ")";
  return os.str();
}

// The cached graph for `key`, built (and its plan chosen) on first use.
std::shared_ptr<Graph> graph_for(const GraphKey& key, const char* op, int64_t Tq, int64_t Tkv,
                                 int64_t B) {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  auto it = g_cache.find(key);
  if (it != g_cache.end()) return it->second;
  auto graph = std::make_shared<Graph>();
  try {
    cudnnHandle_t handle = handle_for(key.device);
    GraphBuilder g;
    const Dims x{key.b, key.s_q, key.s_kv, key.hq, key.hkv, key.d, key.dense};
    if (key.backward) build_backward_ops(g, x, cudnn_dtype(key.dtype), key.mask);
    else build_forward_ops(g, x, cudnn_dtype(key.dtype), key.mask);
    make_plan(*graph, g, handle);
    graph->io_uids = g.io_uids();
    g.release_into(graph->keep);
  } catch (const Error& e) {
    if (!key.dense) BB_FAIL(shape_text(op, key, Tq, Tkv, B), ": ", e.what());
    // A dense graph is an optimisation: when cuDNN refuses it, say so once per shape and run
    // the packed graph, which is built for every shape this path accepts.
    std::fprintf(stderr, "[attention] %s: cuDNN refused the dense (one whole sequence) graph, "
                 "using the packed one: %s\n", shape_text(op, key, Tq, Tkv, B).c_str(), e.what());
    g_cache.emplace(key, nullptr);
    return nullptr;
  }
  g_cache.emplace(key, graph);
  ++g_graphs_built;
  return graph;
}


// Runs a plan with the pointers of every non-virtual tensor (missing ones are a bug here).
void execute(const Graph& graph, int device, const std::map<int64_t, void*>& ptrs, void* ws) {
  std::vector<int64_t> uids;
  std::vector<void*> data;
  for (int64_t uid : graph.io_uids) {
    auto it = ptrs.find(uid);
    BB_CHECK(it != ptrs.end(), "attention (cuDNN): no pointer for graph tensor uid ", uid);
    uids.push_back(uid);
    data.push_back(it->second);
  }
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set_i64s(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
           static_cast<int64_t>(data.size()), data.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  pack.finalize("variant pack");
  cudnnHandle_t handle = handle_for(device);
  BB_CHECK_CUDNN(cudnn::api().SetStream(handle, cuda::stream()), "cudnnSetStream");
  BB_CHECK_CUDNN(cudnn::api().BackendExecute(handle, graph.plan->get(), pack.get()),
                 "cudnnBackendExecute (attention)");
}

// ---- per-call inputs -------------------------------------------------------------------------

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Device copies of the per-sequence lengths and ragged offsets (one workspace tensor).
struct Ragged {
  Tensor buf;
  int32_t* seq_len_q;
  int32_t* seq_len_kv;
  int64_t* off_q;      // cq[b] * Hq * D  (q, o, dq, d_o)
  int64_t* off_kv;     // ck[b] * Hkv * D (k, v, dk, dv; also dk_full / dv_full, see cuDNN's GQA)
  int64_t* off_stats;  // cq[b] * Hq
};

Ragged make_ragged(const AttentionArgs& args, int64_t num_seqs, const GraphKey& key) {
  const int64_t entries = key.b + 1;
  const int64_t len_bytes = align_up(key.b * 4, 256), off_bytes = align_up(entries * 8, 256);
  Ragged r;
  r.buf = Tensor::empty({2 * len_bytes + 3 * off_bytes}, DType::u8, Device::cuda(key.device),
                        MemCategory::workspace);
  char* base = static_cast<char*>(r.buf.raw());
  r.seq_len_q = reinterpret_cast<int32_t*>(base);
  r.seq_len_kv = reinterpret_cast<int32_t*>(base + len_bytes);
  r.off_q = reinterpret_cast<int64_t*>(base + 2 * len_bytes);
  r.off_kv = reinterpret_cast<int64_t*>(base + 2 * len_bytes + off_bytes);
  r.off_stats = reinterpret_cast<int64_t*>(base + 2 * len_bytes + 2 * off_bytes);
  const int32_t* cq = args.cu_seqlens_q.data<int32_t>();
  const int32_t* ck = args.kv_offsets().data<int32_t>();
  for (int64_t first = 0; first < entries; first += kPrepChunk) {
    PrepChunk c;
    c.first = first;
    c.count = static_cast<int32_t>(std::min<int64_t>(kPrepChunk, entries - first));
    for (int64_t j = 0; j <= c.count; ++j) {
      c.pos_q[j] = cq[std::min(first + j, num_seqs)];
      c.pos_kv[j] = ck[std::min(first + j, num_seqs)];
    }
    const int threads = 256;
    ragged_prep_kernel<<<static_cast<unsigned>(cuda::ceil_div(c.count, threads)), threads, 0,
                         cuda::stream()>>>(c, key.b, key.hq * key.d, key.hkv * key.d, key.hq,
                                           r.seq_len_q, r.seq_len_kv, r.off_q, r.off_kv,
                                           r.off_stats);
    BB_CHECK_LAUNCH();
  }
  return r;
}

struct CallDims {
  int64_t Tq, Tkv, B, hq, hkv, d;
  int device;
};

using NamedTensors = std::vector<std::pair<const char*, const Tensor*>>;

// What only the CUDA path needs on top of attention.cpp's checks: bf16, 16-byte alignment, a
// recent enough cuDNN, no sequence with queries but no keys.
CallDims check_cuda_inputs(const char* op, const NamedTensors& ts, const Tensor& q,
                           const Tensor& k, const AttentionArgs& args) {
  CallDims c{q.size(0), k.size(0), args.cu_seqlens_q.size(0) - 1, q.size(1), k.size(1), q.size(2),
             q.device().index};
  const int32_t* cq = args.cu_seqlens_q.data<int32_t>();
  const int32_t* ck = args.kv_offsets().data<int32_t>();
  for (int64_t b = 0; b < c.B; ++b)
    BB_CHECK(cq[b + 1] == cq[b] || ck[b + 1] > ck[b], op, ": sequence ", b, " has ",
             cq[b + 1] - cq[b], " queries and no key; the CUDA path does not take queries that "
             "see nothing (the CPU path gives them o = 0, lse = -inf)");
  for (auto& [name, t] : ts) {
    BB_CHECK(t->dtype() == DType::bf16, op, ": the CUDA path (cuDNN fused attention) needs bf16 '",
             name, "', got ", dtype_name(t->dtype()), " (f32 attention is CPU-only)");
    BB_CHECK(reinterpret_cast<uintptr_t>(t->raw()) % 16 == 0, op, ": argument '", name,
             "' must be 16-byte aligned for cuDNN, got ", t->raw());
  }
  // Head dims the GPU tests cover. cuDNN accepts other multiples of 8, but a head dim of 8 was
  // seen to give wrong gradients on an H200 (cuDNN 9.19), so untested ones are refused.
  BB_CHECK(c.d == 128 || c.d == 256, op, ": head_dim ", c.d,
           " is not supported by the CUDA path (cuDNN fused attention is validated for head_dim "
           "128 and 256); use one of those or run attention on the CPU");
  BB_CHECK(runtime_version() >= 90600, op, ": the packed (THD) cuDNN path needs cuDNN >= 9.6.0, "
           "found ", runtime_version());
  cuda::set_device(c.device);
  return c;
}

// The dense key for one sequence that exactly fills its token bucket with as many keys as
// queries (the single-sequence training step); nullopt otherwise. Exact buckets keep the number
// of distinct dense graphs as small as the packed ones'.
std::optional<GraphKey> dense_key_for(bool backward, const CallDims& c, DType dt,
                                      AttentionMask mask) {
  if (c.B != 1 || c.Tq != c.Tkv ||
      c.Tq != attention_cudnn_token_bucket(c.Tq))
    return std::nullopt;
  GraphKey key{backward, c.device, 1, c.Tq, c.Tkv, c.hq, c.hkv, c.d, dt, mask, true};
  // With Tq == Tkv bottom-right is top-left: one graph for both.
  if (mask == AttentionMask::causal_bottom_right) key.mask = AttentionMask::causal;
  return key;
}

GraphKey key_for(bool backward, const CallDims& c, DType dt, AttentionMask mask) {
  return {backward,
          c.device,
          attention_cudnn_batch_bucket(c.B),
          attention_cudnn_token_bucket(c.Tq),
          attention_cudnn_token_bucket(c.Tkv),
          c.hq,
          c.hkv,
          c.d,
          dt,
          mask,
          false};
}

Tensor workspace_bytes(int64_t bytes, int device) {
  return Tensor::empty({std::max<int64_t>(bytes, 1)}, DType::u8, Device::cuda(device),
                       MemCategory::workspace);
}

}  // namespace

int64_t attention_cudnn_token_bucket(int64_t num_tokens) {
  const int64_t p = pow2_ceil(std::max<int64_t>(num_tokens, 1));
  const int64_t step = std::max<int64_t>(64, p / 8);
  return align_up(std::max<int64_t>(num_tokens, 1), step);
}

int64_t attention_cudnn_batch_bucket(int64_t num_seqs) {
  return pow2_ceil(std::max<int64_t>(num_seqs, 1));
}

int64_t cudnn_runtime_version() { return runtime_version(); }

void set_cudnn_library(const std::string& file) { cudnn::set_library(file); }

int64_t attention_cudnn_graph_count() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  return g_graphs_built;
}

int64_t attention_cudnn_dense_calls() { return g_dense_calls.load(); }

Tensor attention_forward_cudnn(const Tensor& q, const Tensor& k, const Tensor& v,
                               const AttentionArgs& args, AttentionSaved* saved) {
  const char* op = "attention_forward";
  const CallDims c = check_cuda_inputs(op, {{"q", &q}, {"k", &k}, {"v", &v}}, q, k, args);
  const Device dev = q.device();
  Tensor o = Tensor::empty(q.shape(), q.dtype(), dev, MemCategory::activations);
  float scale = args.softmax_scale;
  float neg_inf = -std::numeric_limits<float>::infinity();

  if (auto dkey = dense_key_for(false, c, q.dtype(), args.mask)) {
    if (std::shared_ptr<Graph> graph = graph_for(*dkey, op, c.Tq, c.Tkv, c.B)) {
      // Stats straight into lse's [Hq, T] layout: no transpose.
      Tensor lse = Tensor::empty({c.hq, c.Tq}, DType::f32, dev,
                                 saved ? MemCategory::activations : MemCategory::workspace);
      Tensor ws = workspace_bytes(graph->workspace_bytes, c.device);
      const std::map<int64_t, void*> ptrs = {{kQ, q.raw()},     {kK, k.raw()},
                                             {kV, v.raw()},     {kO, o.raw()},
                                             {kStats, lse.raw()}, {kScale, &scale},
                                             {kNegInfCausal, &neg_inf}};
      execute(*graph, c.device, ptrs, ws.raw());
      ++g_dense_calls;
      if (saved) saved->lse = std::move(lse);
      return o;
    }
  }

  const GraphKey key = key_for(false, c, q.dtype(), args.mask);
  std::shared_ptr<Graph> graph = graph_for(key, op, c.Tq, c.Tkv, c.B);
  // cuDNN writes stats packed [Tq, Hq]; sized for the token bucket like cudnn-frontend does.
  Tensor stats = Tensor::empty({key.s_q, c.hq}, DType::f32, dev, MemCategory::workspace);
  Ragged r = make_ragged(args, c.B, key);
  Tensor ws = workspace_bytes(graph->workspace_bytes, c.device);
  std::map<int64_t, void*> ptrs = {
      {kQ, q.raw()}, {kK, k.raw()}, {kV, v.raw()}, {kO, o.raw()}, {kStats, stats.raw()},
      {kScale, &scale}, {kSeqQ, r.seq_len_q}, {kSeqKV, r.seq_len_kv}, {kOffQ, r.off_q},
      {kOffO, r.off_q}, {kOffK, r.off_kv}, {kOffV, r.off_kv}, {kOffStats, r.off_stats},
      {kNegInfPadding, &neg_inf}, {kNegInfCausal, &neg_inf}};
  execute(*graph, c.device, ptrs, ws.raw());
  if (saved) {
    saved->lse = Tensor::empty({c.hq, c.Tq}, DType::f32, dev, MemCategory::activations);
    transpose_f32(saved->lse.data<float>(), stats.data<float>(), c.Tq, c.hq);
  }
  return o;
}

AttentionGrads attention_backward_cudnn(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& o,
                                        const AttentionArgs& args, const AttentionSaved& saved) {
  const char* op = "attention_backward";
  const CallDims c = check_cuda_inputs(
      op, {{"d_o", &d_o}, {"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}}, q, k, args);
  const Device dev = q.device();
  const bool gqa = c.hq != c.hkv;
  AttentionGrads g;
  g.dq = Tensor::empty(q.shape(), q.dtype(), dev, MemCategory::activations);
  g.dk = Tensor::empty(k.shape(), k.dtype(), dev, MemCategory::activations);
  g.dv = Tensor::empty(v.shape(), v.dtype(), dev, MemCategory::activations);
  float scale = args.softmax_scale, one = 1.0f;
  float neg_inf = -std::numeric_limits<float>::infinity();

  std::shared_ptr<Graph> graph;
  std::optional<GraphKey> dkey = dense_key_for(true, c, q.dtype(), args.mask);
  if (dkey) graph = graph_for(*dkey, op, c.Tq, c.Tkv, c.B);
  const bool dense = graph != nullptr;
  const GraphKey key = dense ? *dkey : key_for(true, c, q.dtype(), args.mask);
  if (!dense) graph = graph_for(key, op, c.Tq, c.Tkv, c.B);
  // Scratch as cudnn-frontend sizes it for a graph of key.s_q x key.s_kv tokens (f32). A dense
  // graph reads lse in place ([Hq, T]); a packed one a [T, Hq] transpose of it.
  Tensor stats = dense ? Tensor() : Tensor::empty({key.s_q, c.hq}, DType::f32, dev,
                                                  MemCategory::workspace);
  Tensor softmax_sum = Tensor::empty({key.s_q, c.hq}, DType::f32, dev, MemCategory::workspace);
  Tensor dq_accum = Tensor::empty({key.s_q, c.hq, c.d}, DType::f32, dev, MemCategory::workspace);
  Tensor dk_full, dv_full;
  if (gqa) {
    dk_full = Tensor::empty({key.s_kv, c.hq, c.d}, DType::f32, dev, MemCategory::workspace);
    dv_full = Tensor::empty({key.s_kv, c.hq, c.d}, DType::f32, dev, MemCategory::workspace);
  }
  Tensor ws = workspace_bytes(graph->workspace_bytes, c.device);
  std::map<int64_t, void*> ptrs = {
      {kQ, q.raw()}, {kK, k.raw()}, {kV, v.raw()}, {kO, o.raw()}, {kDO, d_o.raw()},
      {kDQ, g.dq.raw()}, {kDK, g.dk.raw()}, {kDV, g.dv.raw()}, {kScale, &scale}, {kOne, &one},
      {kNegInfPadding, &neg_inf}, {kNegInfCausal, &neg_inf},
      {kSoftmaxSum, softmax_sum.raw()}, {kDQAccum, dq_accum.raw()}};
  if (gqa) {
    ptrs[kDKFull] = dk_full.raw();
    ptrs[kDVFull] = dv_full.raw();
  }
  Ragged r{};
  if (dense) {
    ptrs[kStats] = saved.lse.raw();  // read only
  } else {
    transpose_f32(stats.data<float>(), saved.lse.data<float>(), c.hq, c.Tq);
    r = make_ragged(args, c.B, key);
    ptrs[kStats] = stats.raw();
    ptrs[kSeqQ] = r.seq_len_q;
    ptrs[kSeqKV] = r.seq_len_kv;
    ptrs[kOffQ] = ptrs[kOffO] = r.off_q;
    ptrs[kOffK] = ptrs[kOffV] = r.off_kv;
    ptrs[kOffStats] = r.off_stats;
  }
  execute(*graph, c.device, ptrs, ws.raw());
  if (dense) ++g_dense_calls;
  return g;
}

}  // namespace bb

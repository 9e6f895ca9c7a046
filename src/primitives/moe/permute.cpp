// permute.cpp — boundary checks for token permutation, then the CPU reference or, for tensors
// on a CUDA device, the kernels of permute_cuda.cu.
//
// On CUDA, make_permute_map makes one device->host copy (the expert counts, which the map holds
// on the host, plus an out-of-range flag); the other functions never synchronise.
#include "primitives/moe/permute.h"

#include "core/trace.h"

#include "backend/cpu/util.h"
#include "primitives/moe/permute_ref.h"

#ifdef BB_WITH_CUDA
#include "primitives/moe/permute_cuda.h"
#endif

namespace bb {

namespace {

// The map must live where the data does.
void check_map_device(const PermuteMap& map, const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(map.slot_row.device() == t.device() && map.row_token.device() == t.device(), op,
           ": the PermuteMap is on ", map.slot_row.device().str(), " but argument '", arg,
           "' is on ", t.device().str(), "; build the map on the data's device");
}

void check_map(const PermuteMap& map, const char* op) {
  BB_CHECK(map.num_tokens >= 1 && map.top_k >= 1 && map.num_experts >= 1, op,
           ": invalid PermuteMap (T = ", map.num_tokens, ", K = ", map.top_k,
           ", E = ", map.num_experts, "); build it with make_permute_map");
  check_dtype(map.row_token, DType::i32, op, "map.row_token");
  check_shape(map.row_token, {map.num_rows()}, op, "map.row_token");
  check_dtype(map.slot_row, DType::i32, op, "map.slot_row");
  check_shape(map.slot_row, {map.num_tokens, map.top_k}, op, "map.slot_row");
  BB_CHECK(static_cast<int64_t>(map.tokens_per_expert.size()) == map.num_experts, op,
           ": map.tokens_per_expert has ", map.tokens_per_expert.size(),
           " entries, expected E = ", map.num_experts);
}

// Checks a float data tensor of shape [rows, -1]; returns its H.
int64_t check_rows(const Tensor& t, int64_t rows, const char* op, const char* arg) {
  check_float(t, op, arg);
  check_backend_device(t, op, arg);
  BB_CHECK(t.dim() == 2, op, ": argument '", arg, "' has shape ", shape_str(t.shape()),
           ", expected [", rows, ", H]");
  check_shape(t, {rows, -1}, op, arg);
  return t.size(1);
}

void check_prob(const Tensor& p, const PermuteMap& map, const char* op) {
  check_dtype(p, DType::f32, op, "topk_prob");
  check_backend_device(p, op, "topk_prob");
  check_shape(p, {map.num_tokens, map.top_k}, op, "topk_prob");
}

// An output of dtype `dt`: computed in f32 in `tmp`, then stored.
Tensor finish(const Tensor& tmp, DType dt, MemCategory cat) {
  if (dt == DType::f32) return tmp;
  Tensor out = Tensor::empty(tmp.shape(), dt, Device::cpu(), cat);
  cpu::store_f32(out, tmp);
  return out;
}

#ifdef BB_WITH_CUDA
PermuteMap make_permute_map_cuda(const Tensor& topk_idx, int64_t E,
                                 const std::vector<int64_t>* known_counts) {
  const char* op = "make_permute_map";
  const Device dev = topk_idx.device();
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), N = T * K;
  PermuteMap map;
  map.num_tokens = T;
  map.top_k = K;
  map.num_experts = E;
  map.row_token = Tensor::empty({N}, DType::i32, dev, MemCategory::moe);
  map.slot_row = Tensor::empty({T, K}, DType::i32, dev, MemCategory::moe);
  const size_t ws_bytes = cuda::permute_map_workspace_bytes(N, E);
  Tensor ws = Tensor::empty({static_cast<int64_t>(ws_bytes)}, DType::u8, dev, MemCategory::workspace);
  Tensor stats = Tensor::empty({E + 1}, DType::i32, dev, MemCategory::workspace);
  cuda::make_permute_map(map.row_token.data<int32_t>(), map.slot_row.data<int32_t>(),
                         stats.data<int32_t>(), topk_idx.data<int32_t>(), T, K, E, ws.raw(),
                         ws_bytes);
  if (known_counts) {  // the router's counts: no host synchronisation
    map.tokens_per_expert = *known_counts;
    return map;
  }
  // The one host synchronisation: counts + range flag (to_ints copies through cuda::memcpy,
  // which waits for the stream and records it with cuda::note_host_sync()).
  const std::vector<int32_t> st = stats.to_ints();
  if (st[0] != 0) {
    const int64_t pos = N - st[0];
    const int32_t v = topk_idx.view({N}).narrow(pos, 1).to_ints()[0];
    BB_FAIL(op, ": topk_idx[", pos / K, ", ", pos % K, "] = ", v, " is out of range [0, ", E, ")");
  }
  map.tokens_per_expert.assign(st.begin() + 1, st.end());
  return map;
}
#endif

}  // namespace

PermuteMap make_permute_map(const Tensor& topk_idx, int64_t num_experts,
                            const std::vector<int64_t>* known_counts) {
  BB_RANGE("make_permute_map");
  const char* op = "make_permute_map";
  check_dtype(topk_idx, DType::i32, op, "topk_idx");
  check_backend_device(topk_idx, op, "topk_idx");
  BB_CHECK(topk_idx.dim() == 2, op, ": argument 'topk_idx' has shape ", shape_str(topk_idx.shape()),
           ", expected [T, K]");
  BB_CHECK(topk_idx.size(0) > 0, op, ": empty batch (topk_idx has T = 0 tokens)");
  BB_CHECK(topk_idx.size(1) > 0, op, ": topk_idx has K = 0 columns");
  BB_CHECK(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1);
#ifdef BB_WITH_CUDA
  if (known_counts)
    BB_CHECK(static_cast<int64_t>(known_counts->size()) == num_experts, op, ": known_counts has ",
             known_counts->size(), " entries for ", num_experts, " experts");
  if (topk_idx.device().is_cuda()) return make_permute_map_cuda(topk_idx, num_experts, known_counts);
#endif
  const int32_t* idx = topk_idx.data<int32_t>();
  for (int64_t i = 0; i < T * K; ++i)
    BB_CHECK(idx[i] >= 0 && idx[i] < num_experts, op, ": topk_idx[", i / K, ", ", i % K,
             "] = ", idx[i], " is out of range [0, ", num_experts, ")");
  PermuteMap map;
  map.num_tokens = T;
  map.top_k = K;
  map.num_experts = num_experts;
  map.row_token = Tensor::empty({T * K}, DType::i32, Device::cpu(), MemCategory::moe);
  map.slot_row = Tensor::empty({T, K}, DType::i32, Device::cpu(), MemCategory::moe);
  map.tokens_per_expert.assign(num_experts, 0);
  ref::make_permute_map(map.row_token.data<int32_t>(), map.slot_row.data<int32_t>(),
                        map.tokens_per_expert.data(), idx, T, K, num_experts);
  return map;
}

Tensor permute_forward(const Tensor& x, const PermuteMap& map) {
  BB_RANGE("permute_forward");
  const char* op = "permute_forward";
  check_map(map, op);
  const int64_t H = check_rows(x, map.num_tokens, op, "x");
  const int64_t N = map.num_rows();
  check_map_device(map, x, op, "x");
  Tensor out = Tensor::empty({N, H}, x.dtype(), x.device(), MemCategory::moe);
#ifdef BB_WITH_CUDA
  if (x.device().is_cuda()) {
    cuda::permute_rows(out.raw(), x.raw(), map.slot_row.data<int32_t>(), map.num_tokens,
                       map.top_k, H * static_cast<int64_t>(dtype_size(x.dtype())));
    return out;
  }
#endif
  // A pure copy: no conversion for 16-bit storage.
  if (x.dtype() == DType::f32)
    ref::permute_forward(out.data<float>(), x.data<float>(), map.row_token.data<int32_t>(), N, H);
  else
    ref::permute_forward(out.data<uint16_t>(), x.data<uint16_t>(), map.row_token.data<int32_t>(), N,
                         H);
  return out;
}

Tensor permute_backward(const Tensor& d_x_perm, const PermuteMap& map, bool out_f32) {
  BB_RANGE("permute_backward");
  const char* op = "permute_backward";
  check_map(map, op);
  const int64_t H = check_rows(d_x_perm, map.num_rows(), op, "d_x_perm");
  const int64_t T = map.num_tokens;
  check_map_device(map, d_x_perm, op, "d_x_perm");
  const DType out_dtype = out_f32 ? DType::f32 : d_x_perm.dtype();
#ifdef BB_WITH_CUDA
  if (d_x_perm.device().is_cuda()) {
    Tensor out = Tensor::empty({T, H}, out_dtype, d_x_perm.device(), MemCategory::activations);
    cuda::gather_sum_rows(out.raw(), d_x_perm.raw(), d_x_perm.dtype(),
                          map.slot_row.data<int32_t>(), nullptr, T, map.top_k, H, out_f32);
    return out;
  }
#endif
  Tensor src = cpu::as_f32(d_x_perm);
  const MemCategory cat = MemCategory::activations;
  Tensor tmp = cpu::empty_f32({T, H}, out_dtype == DType::f32 ? cat : MemCategory::workspace);
  ref::permute_backward(tmp.data<float>(), src.data<float>(), map.slot_row.data<int32_t>(), T,
                        map.top_k, H);
  return finish(tmp, out_dtype, cat);
}

Tensor unpermute_forward(const Tensor& y_perm, const PermuteMap& map, const Tensor& topk_prob,
                         MemCategory out_cat) {
  BB_RANGE("unpermute_forward");
  const char* op = "unpermute_forward";
  check_map(map, op);
  const int64_t H = check_rows(y_perm, map.num_rows(), op, "y_perm");
  const int64_t T = map.num_tokens;
  check_map_device(map, y_perm, op, "y_perm");
  const float* prob = nullptr;
  if (topk_prob.defined()) {
    check_prob(topk_prob, map, op);
    check_same_device(y_perm, topk_prob, op);
    prob = topk_prob.data<float>();
  }
#ifdef BB_WITH_CUDA
  if (y_perm.device().is_cuda()) {
    Tensor out = Tensor::empty({T, H}, y_perm.dtype(), y_perm.device(), out_cat);
    cuda::gather_sum_rows(out.raw(), y_perm.raw(), y_perm.dtype(), map.slot_row.data<int32_t>(),
                          prob, T, map.top_k, H);
    return out;
  }
#endif
  Tensor src = cpu::as_f32(y_perm);
  Tensor tmp =
      cpu::empty_f32({T, H}, y_perm.dtype() == DType::f32 ? out_cat : MemCategory::workspace);
  ref::unpermute_forward(tmp.data<float>(), src.data<float>(), map.slot_row.data<int32_t>(), prob,
                         T, map.top_k, H);
  return finish(tmp, y_perm.dtype(), out_cat);
}

UnpermuteGrads unpermute_backward(const Tensor& d_y, const Tensor& y_perm, const PermuteMap& map,
                                  const Tensor& topk_prob) {
  BB_RANGE("unpermute_backward");
  const char* op = "unpermute_backward";
  check_map(map, op);
  const int64_t T = map.num_tokens, K = map.top_k, N = map.num_rows();
  const int64_t H = check_rows(d_y, T, op, "d_y");
  check_map_device(map, d_y, op, "d_y");
  const bool on_cuda = d_y.device().is_cuda();
  const float* prob = nullptr;
  Tensor yp;
  UnpermuteGrads g;
  if (topk_prob.defined()) {
    check_prob(topk_prob, map, op);
    check_same_device(d_y, topk_prob, op);
    prob = topk_prob.data<float>();
    check_rows(y_perm, N, op, "y_perm");
    check_shape(y_perm, {N, H}, op, "y_perm");
    check_same_device(d_y, y_perm, op);
    // CUDA: the dot products read y_perm in d_y's dtype (a converted copy only when they differ).
    if (on_cuda)
      yp = y_perm.dtype() == d_y.dtype() ? y_perm : y_perm.to_dtype(d_y.dtype(), MemCategory::workspace);
    else
      yp = cpu::as_f32(y_perm);
    g.d_topk_prob = Tensor::empty({T, K}, DType::f32, d_y.device(), MemCategory::activations);
  }
#ifdef BB_WITH_CUDA
  if (on_cuda) {
    g.d_y_perm = Tensor::empty({N, H}, d_y.dtype(), d_y.device(), MemCategory::moe);
    cuda::unpermute_backward(g.d_y_perm.raw(), prob ? g.d_topk_prob.data<float>() : nullptr,
                             d_y.raw(), prob ? yp.raw() : nullptr, d_y.dtype(),
                             map.slot_row.data<int32_t>(), prob, T, K, H);
    return g;
  }
#endif
  Tensor dy = cpu::as_f32(d_y);
  const MemCategory cat = MemCategory::moe;
  Tensor tmp = cpu::empty_f32({N, H}, d_y.dtype() == DType::f32 ? cat : MemCategory::workspace);
  ref::unpermute_backward(tmp.data<float>(), prob ? g.d_topk_prob.data<float>() : nullptr,
                          dy.data<float>(), prob ? yp.data<float>() : nullptr,
                          map.slot_row.data<int32_t>(), prob, T, K, H);
  g.d_y_perm = finish(tmp, d_y.dtype(), cat);
  return g;
}

Tensor permute_probs(const Tensor& topk_prob, const PermuteMap& map) {
  const char* op = "permute_probs";
  check_map(map, op);
  check_prob(topk_prob, map, op);
  check_map_device(map, topk_prob, op, "topk_prob");
  Tensor out = Tensor::empty({map.num_rows()}, DType::f32, topk_prob.device(), MemCategory::moe);
#ifdef BB_WITH_CUDA
  if (topk_prob.device().is_cuda()) {
    cuda::permute_probs(out.data<float>(), topk_prob.data<float>(), map.slot_row.data<int32_t>(),
                        map.num_rows());
    return out;
  }
#endif
  ref::permute_probs(out.data<float>(), topk_prob.data<float>(), map.slot_row.data<int32_t>(),
                     map.num_tokens, map.top_k);
  return out;
}

Tensor unpermute_probs_grad(const Tensor& d_row_prob, const PermuteMap& map) {
  const char* op = "unpermute_probs_grad";
  check_map(map, op);
  check_dtype(d_row_prob, DType::f32, op, "d_row_prob");
  check_backend_device(d_row_prob, op, "d_row_prob");
  check_shape(d_row_prob, {map.num_rows()}, op, "d_row_prob");
  check_map_device(map, d_row_prob, op, "d_row_prob");
  Tensor out = Tensor::empty({map.num_tokens, map.top_k}, DType::f32, d_row_prob.device(),
                             MemCategory::activations);
#ifdef BB_WITH_CUDA
  if (d_row_prob.device().is_cuda()) {
    cuda::unpermute_probs_grad(out.data<float>(), d_row_prob.data<float>(),
                               map.slot_row.data<int32_t>(), map.num_rows());
    return out;
  }
#endif
  ref::unpermute_probs_grad(out.data<float>(), d_row_prob.data<float>(),
                            map.slot_row.data<int32_t>(), map.num_tokens, map.top_k);
  return out;
}

}  // namespace bb

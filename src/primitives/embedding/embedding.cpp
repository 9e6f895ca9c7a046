// embedding.cpp — boundary checks for the embedding lookup, then the CPU loops or the CUDA
// kernels (embedding_cuda.h) depending on where the table lives.
//
// Token ids are range-checked on the host in both paths (a bad id must be an error, not a
// stray read). On CUDA the ids therefore make one host round trip per call: host ids are
// uploaded, device ids are read back; either copy synchronises (cuda::memcpy counts it).
#include "primitives/embedding/embedding.h"

#include "core/trace.h"

#include <cstring>
#include <vector>

#include "backend/cpu/util.h"
#include "primitives/embedding/embedding_cuda.h"
#include "primitives/embedding/embedding_ref.h"

namespace bb {

namespace {
void check_ids(const char* op, const Tensor& ids) {
  check_dtype(ids, DType::i32, op, "ids");
  BB_CHECK(ids.dim() == 1, op, ": ids must be [T], got ", shape_str(ids.shape()));
  BB_CHECK(ids.numel() > 0, op, ": empty batch (0 tokens)");
}

void check_range(const char* op, const int32_t* p, int64_t T, int64_t V) {
  for (int64_t t = 0; t < T; ++t)
    BB_CHECK(p[t] >= 0 && p[t] < V, op, ": token id ", p[t], " at position ", t,
             " is outside the vocabulary [0, ", V, ")");
}

#ifdef BB_WITH_CUDA
// The ids of a CUDA call, checked on the host: returns them on `dev` (uploading if needed) and
// fills `host` with a host copy.
Tensor cuda_ids(const char* op, const Tensor& ids, Device dev, int64_t V, Tensor& host) {
  BB_CHECK(ids.device().is_cpu() || ids.device() == dev, op, ": ids on ", ids.device().str(),
           " but the table on ", dev.str());
  host = ids.device().is_cpu() ? ids : ids.to(Device::cpu(), MemCategory::workspace);
  check_range(op, host.data<int32_t>(), host.numel(), V);
  return ids.device().is_cpu() ? ids.to(dev, MemCategory::workspace) : ids;
}
#endif
}  // namespace

Tensor embedding_forward(const Tensor& ids, const Tensor& table, MemCategory out_cat) {
  BB_RANGE("embedding_forward");
  check_float(table, "embedding_forward", "table");
  BB_CHECK(table.dim() == 2, "embedding_forward: table must be [V, H], got ",
           shape_str(table.shape()));
  check_ids("embedding_forward", ids);
  const int64_t T = ids.numel(), H = table.size(1);
  Tensor y = Tensor::empty({T, H}, table.dtype(), table.device(), out_cat);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(table.dtype());
  if (table.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    Tensor host;
    Tensor dev_ids = cuda_ids("embedding_forward", ids, table.device(), table.size(0), host);
    cuda::embedding_forward(y.raw(), table.raw(), dev_ids.data<int32_t>(), T,
                            static_cast<int64_t>(row_bytes));
    return y;
#else
    BB_FAIL("embedding_forward: not implemented on ", table.device().str(),
            " in this build (no CUDA backend)");
#endif
  }
  BB_CHECK(ids.device().is_cpu(), "embedding_forward: ids on ", ids.device().str(),
           " but the table on the CPU");
  check_range("embedding_forward", ids.data<int32_t>(), T, table.size(0));
  // A lookup is a row copy in any dtype: no conversion needed.
  const int32_t* id = ids.data<int32_t>();
  const char* src = static_cast<const char*>(table.raw());
  char* dst = static_cast<char*>(y.raw());
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(dst + t * row_bytes, src + static_cast<int64_t>(id[t]) * row_bytes, row_bytes);
  return y;
}

void embedding_backward(const Tensor& d_y, const Tensor& ids, Tensor& d_table) {
  BB_RANGE("embedding_backward");
  check_dtype(d_table, DType::f32, "embedding_backward", "d_table");
  BB_CHECK(d_table.dim() == 2, "embedding_backward: d_table must be [V, H], got ",
           shape_str(d_table.shape()));
  check_ids("embedding_backward", ids);
  check_shape(d_y, {ids.numel(), d_table.size(1)}, "embedding_backward", "d_y");
  const int64_t T = ids.numel(), V = d_table.size(0), H = d_table.size(1);
  if (d_table.device().is_cuda()) {
#ifdef BB_WITH_CUDA
    check_same_device(d_table, d_y, "embedding_backward");
    BB_CHECK(d_y.dtype() == DType::f32 || d_y.dtype() == DType::bf16,
             "embedding_backward: argument 'd_y' has dtype ", dtype_name(d_y.dtype()),
             ", the CUDA path takes f32 or bf16");
    Tensor host;
    (void)cuda_ids("embedding_backward", ids, d_table.device(), V, host);
    // Group the tokens by id on the host with a counting sort (O(T + V), stable: ascending t
    // inside a group), so that the device adds each id's rows in ascending t: deterministic and
    // the CPU loop's rounding. One upload of [order (T) | seg_start (U+1) | seg_id (U)].
    const int32_t* id = host.data<int32_t>();
    std::vector<int32_t> start(static_cast<size_t>(V) + 1, 0);
    for (int64_t t = 0; t < T; ++t) ++start[static_cast<size_t>(id[t]) + 1];
    std::vector<int32_t> seg_start, seg_id;
    for (int64_t v = 0; v < V; ++v) {
      if (start[v + 1] > 0) {
        seg_start.push_back(start[v]);
        seg_id.push_back(static_cast<int32_t>(v));
      }
      start[v + 1] += start[v];
    }
    seg_start.push_back(static_cast<int32_t>(T));
    std::vector<int32_t> order(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) order[start[id[t]]++] = static_cast<int32_t>(t);
    const auto U = static_cast<int64_t>(seg_id.size());
    std::vector<int32_t> packed = order;
    packed.insert(packed.end(), seg_start.begin(), seg_start.end());
    packed.insert(packed.end(), seg_id.begin(), seg_id.end());
    Tensor groups = Tensor::from_ints(packed, {static_cast<int64_t>(packed.size())})
                        .to(d_table.device(), MemCategory::workspace);
    const int32_t* g = groups.data<int32_t>();
    cuda::embedding_backward(d_table.data<float>(), d_y.raw(), d_y.dtype(), g, g + T,
                             g + T + U + 1, U, H);
    return;
#else
    BB_FAIL("embedding_backward: not implemented on ", d_table.device().str(),
            " in this build (no CUDA backend)");
#endif
  }
  BB_CHECK(ids.device().is_cpu() && d_y.device().is_cpu(),
           "embedding_backward: ids and d_y must be on the CPU with d_table");
  check_range("embedding_backward", ids.data<int32_t>(), T, V);
  Tensor dyf = cpu::as_f32(d_y);
  ref::embedding_backward<float>(d_table.data<float>(), ids.data<int32_t>(), dyf.data<float>(), T,
                                 H);
}

}  // namespace bb

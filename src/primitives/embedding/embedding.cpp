#include "primitives/embedding/embedding.h"

#include <cstring>

#include "backend/cpu/util.h"
#include "primitives/embedding/embedding_ref.h"

namespace bb {

namespace {
void check_ids(const char* op, const Tensor& ids, int64_t V) {
  check_dtype(ids, DType::i32, op, "ids");
  BB_CHECK(ids.dim() == 1, op, ": ids must be [T], got ", shape_str(ids.shape()));
  BB_CHECK(ids.numel() > 0, op, ": empty batch (0 tokens)");
  const int32_t* p = ids.data<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    BB_CHECK(p[t] >= 0 && p[t] < V, op, ": token id ", p[t], " at position ", t,
             " is outside the vocabulary [0, ", V, ")");
}
}  // namespace

Tensor embedding_forward(const Tensor& ids, const Tensor& table, MemCategory out_cat) {
  check_float(table, "embedding_forward", "table");
  BB_CHECK(table.dim() == 2, "embedding_forward: table must be [V, H], got ",
           shape_str(table.shape()));
  BB_CHECK(table.device().is_cpu(), "embedding_forward: not implemented on ",
           table.device().str(), " yet");
  check_ids("embedding_forward", ids, table.size(0));
  const int64_t T = ids.numel(), H = table.size(1);
  Tensor y = Tensor::empty({T, H}, table.dtype(), table.device(), out_cat);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(table.dtype());
  // A lookup is a row copy in any dtype: no conversion needed.
  const int32_t* id = ids.data<int32_t>();
  const char* src = static_cast<const char*>(table.raw());
  char* dst = static_cast<char*>(y.raw());
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(dst + t * row_bytes, src + static_cast<int64_t>(id[t]) * row_bytes, row_bytes);
  return y;
}

void embedding_backward(const Tensor& d_y, const Tensor& ids, Tensor& d_table) {
  check_dtype(d_table, DType::f32, "embedding_backward", "d_table");
  BB_CHECK(d_table.dim() == 2, "embedding_backward: d_table must be [V, H], got ",
           shape_str(d_table.shape()));
  check_ids("embedding_backward", ids, d_table.size(0));
  check_shape(d_y, {ids.numel(), d_table.size(1)}, "embedding_backward", "d_y");
  Tensor dyf = cpu::as_f32(d_y);
  ref::embedding_backward<float>(d_table.data<float>(), ids.data<int32_t>(), dyf.data<float>(),
                                 ids.numel(), d_table.size(1));
}

}  // namespace bb

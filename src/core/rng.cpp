#include "core/rng.h"

#include <vector>

#ifdef BB_WITH_CUDA
#include "backend/cuda/rng_cuda.h"
#endif

namespace bb {

namespace {
void store_floats(Tensor& t, const std::vector<float>& v) {
  Tensor host = Tensor::from_floats(v, t.shape(), t.dtype(), MemCategory::other);
  t.copy_from(host);
}
}  // namespace

void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, float lo, float hi) {
  check_float(t, "fill_uniform", "t");
#ifdef BB_WITH_CUDA
  if (t.device().is_cuda()) return cuda::fill_random(t.raw(), t.dtype(), t.numel(), seed, offset, lo, hi, false);
#endif
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = lo + (hi - lo) * philox_uniform(seed, offset + i);
  store_floats(t, v);
}

void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, float mean, float std) {
  check_float(t, "fill_normal", "t");
#ifdef BB_WITH_CUDA
  if (t.device().is_cuda()) return cuda::fill_random(t.raw(), t.dtype(), t.numel(), seed, offset, mean, std, true);
#endif
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = mean + std * philox_normal(seed, offset + i);
  store_floats(t, v);
}

}  // namespace bb

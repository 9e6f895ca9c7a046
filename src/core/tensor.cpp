#include "core/tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/parallel.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  // A zero anywhere makes the product 0 however large the other dims are; checking for it
  // first keeps a [0, 2^40, 2^40] shape (legal: an empty tensor) from tripping the check.
  for (int64_t d : s)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : s)
    if (__builtin_mul_overflow(n, d, &n))
      BB_FAIL("shape ", shape_str(s), " has more elements than a 64-bit count holds");
  return n;
}

size_t shape_nbytes(const Shape& s, DType dt) {
  const int64_t n = shape_numel(s);
  BB_CHECK(n >= 0, "shape ", shape_str(s), " has a negative dimension");
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(dt)), &bytes))
    BB_FAIL("shape ", shape_str(s), " of dtype ", dtype_name(dt),
            " needs more bytes than a 64-bit size holds");
  return static_cast<size_t>(bytes);
}

Storage::Storage(size_t bytes, Device dev, MemCategory cat)
    : bytes_(bytes), dev_(dev), cat_(cat), stream_(current_stream()), used_(stream_bit(stream_)) {
  ptr_ = allocator_for(dev).allocate(bytes, cat, static_cast<int>(stream_));
}

Storage::~Storage() {
  allocator_for(dev_).deallocate(ptr_, bytes_, cat_, static_cast<int>(stream_), used_streams());
}

namespace {
void device_copy(void* dst, Device ddev, const void* src, Device sdev, size_t bytes) {
  if (bytes == 0) return;
  if (ddev.is_cpu() && sdev.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef BB_WITH_CUDA
  cuda::memcpy(dst, ddev, src, sdev, bytes);
#else
  BB_FAIL("copy between ", sdev.str(), " and ", ddev.str(), " needs a CUDA build");
#endif
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dt, Device dev, MemCategory cat) {
  for (int64_t d : shape)
    BB_CHECK(d >= 0, "Tensor::empty: negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dt;
  t.storage_ = std::make_shared<Storage>(shape_nbytes(shape, dt), dev, cat);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Device dev, MemCategory cat) {
  Tensor t = empty(shape, dt, dev, cat);
  t.zero_();
  return t;
}

Tensor Tensor::from_floats(const std::vector<float>& v, const Shape& shape, DType dt,
                           MemCategory cat) {
  BB_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_floats: ", v.size(),
           " values for shape ", shape_str(shape));
  BB_CHECK(is_floating(dt), "from_floats: dtype ", dtype_name(dt), " is not a float type");
  Tensor t = empty(shape, dt, Device::cpu(), cat);
  if (dt == DType::f32) {
    if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * 4);
  } else {
    uint16_t* p = static_cast<uint16_t*>(t.raw());
    for (size_t i = 0; i < v.size(); ++i)
      p[i] = dt == DType::bf16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  }
  return t;
}

Tensor Tensor::from_ints(const std::vector<int32_t>& v, const Shape& shape, MemCategory cat) {
  BB_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_ints: ", v.size(),
           " values for shape ", shape_str(shape));
  Tensor t = empty(shape, DType::i32, Device::cpu(), cat);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * 4);
  return t;
}

int64_t Tensor::size(int i) const {
  if (i < 0) i += dim();
  BB_CHECK(i >= 0 && i < dim(), "size(", i, "): tensor has ", dim(), " dimensions");
  return shape_[i];
}

int64_t Tensor::numel() const { return shape_numel(shape_); }
Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }
MemCategory Tensor::category() const { return storage_ ? storage_->category() : MemCategory::other; }

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  std::ostringstream os;
  os << dtype_name(dtype_) << shape_str(shape_) << " on " << device().str() << " ("
     << category_name(category()) << ")";
  return os.str();
}

void* Tensor::raw() const {
  if (!storage_ || !storage_->data()) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::narrow(int64_t start, int64_t len) const {
  BB_CHECK(defined() && dim() >= 1, "narrow: needs a tensor with at least one dimension, got ", str());
  BB_CHECK(start >= 0 && len >= 0 && start + len <= shape_[0], "narrow(", start, ", ", len,
           "): out of range for leading dimension ", shape_[0]);
  Tensor t = *this;
  t.shape_[0] = len;
  int64_t row = numel() / (shape_[0] == 0 ? 1 : shape_[0]);
  if (shape_[0] == 0) row = 0;
  t.offset_ += static_cast<size_t>(start * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  Shape known_dims;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      BB_CHECK(infer < 0, "view: more than one -1 in ", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      BB_CHECK(s[i] >= 0, "view: negative dimension in ", shape_str(shape));
      known_dims.push_back(s[i]);
    }
  }
  const int64_t known = shape_numel(known_dims);  // checked
  if (infer >= 0) {
    BB_CHECK(known > 0 && numel() % known == 0, "view: cannot infer ", shape_str(shape),
             " from ", str());
    s[infer] = numel() / known;
  }
  BB_CHECK(shape_numel(s) == numel(), "view: shape ", shape_str(shape), " has ", shape_numel(s),
           " elements, tensor ", str(), " has ", numel());
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::to(Device dev) const { return to(dev, category()); }

Tensor Tensor::to(Device dev, MemCategory cat) const {
  BB_CHECK(defined(), "to: tensor is undefined");
  Tensor t = empty(shape_, dtype_, dev, cat);
  device_copy(t.raw(), dev, raw(), device(), nbytes());
  return t;
}

Tensor Tensor::clone() const { return to(device(), category()); }
Tensor Tensor::clone(MemCategory cat) const { return to(device(), cat); }

Tensor Tensor::to_dtype(DType dt) const { return to_dtype(dt, category()); }

Tensor Tensor::to_dtype(DType dt, MemCategory cat) const {
  BB_CHECK(defined(), "to_dtype: tensor is undefined");
  if (dt == dtype_) return clone(cat);
  BB_CHECK(is_floating(dt) && is_floating(dtype_), "to_dtype: only float conversions, got ",
           dtype_name(dtype_), " -> ", dtype_name(dt));
  if (device().is_cpu()) {
    Tensor t = empty(shape_, dt, Device::cpu(), cat);
    if (dtype_ == DType::f32 && (dt == DType::bf16 || dt == DType::f16)) {
      // Straight from the values (no widened copy: exports convert whole models this way).
      const float* s = static_cast<const float*>(raw());
      uint16_t* p = static_cast<uint16_t*>(t.raw());
      const bool bf = dt == DType::bf16;
      auto convert = [s, p, bf](int64_t lo, int64_t hi) {
        if (bf)
          for (int64_t i = lo; i < hi; ++i) p[i] = f32_to_bf16(s[i]);
        else
          for (int64_t i = lo; i < hi; ++i) p[i] = f32_to_f16(s[i]);
      };
      // Large tensors (a model's weights in an export) on several threads.
      parallel_ranges(numel(), int64_t{1} << 22, convert);
      return t;
    }
    std::vector<float> v = to_floats();
    if (dt == DType::f32) {
      if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * 4);  // an empty tensor may have no buffer
    } else {
      uint16_t* p = static_cast<uint16_t*>(t.raw());
      for (size_t i = 0; i < v.size(); ++i)
        p[i] = dt == DType::bf16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
    }
    return t;
  }
#ifdef BB_WITH_CUDA
  Tensor t = empty(shape_, dt, device(), cat);
  cuda::convert(t.raw(), dt, raw(), dtype_, numel());
  return t;
#else
  BB_FAIL("to_dtype on ", device().str(), " needs a CUDA build");
#endif
}

int64_t first_nonfinite(const Tensor& h) {
  BB_CHECK(h.device().is_cpu(), "first_nonfinite: ", h.str(), " must be a host tensor");
  const int64_t n = h.numel();
  // Exponent all ones: Inf or NaN. Ranges scan on a few threads (an export scans every weight);
  // each keeps the smallest index found, and stops once an earlier one is known.
  auto scan = [n](const auto* p, auto mask) -> int64_t {
    std::atomic<int64_t> first{n};
    parallel_ranges(n, int64_t{1} << 22, [&](int64_t lo, int64_t hi) {
      constexpr int64_t kStep = 1 << 14;
      for (int64_t a = lo; a < hi && a < first.load(std::memory_order_relaxed); a += kStep) {
        const int64_t b = std::min(hi, a + kStep);
        for (int64_t k = a; k < b; ++k)
          if ((p[k] & mask) == mask) {
            int64_t cur = first.load();
            while (k < cur && !first.compare_exchange_weak(cur, k)) {
            }
            return;
          }
      }
    });
    return first.load() == n ? -1 : first.load();
  };
  if (h.dtype() == DType::f32) return scan(static_cast<const uint32_t*>(h.raw()), uint32_t{0x7f800000u});
  if (h.dtype() == DType::bf16) return scan(static_cast<const uint16_t*>(h.raw()), uint16_t{0x7f80u});
  const std::vector<float> v = h.to_floats();
  for (size_t k = 0; k < v.size(); ++k)
    if (!std::isfinite(v[k])) return static_cast<int64_t>(k);
  return -1;
}

void Tensor::copy_from(const Tensor& src) {
  BB_CHECK(defined() && src.defined(), "copy_from: undefined tensor");
  BB_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from: ", src.str(), " into ", str(),
           " (shape and dtype must match)");
  device_copy(raw(), device(), src.raw(), src.device(), nbytes());
}

void Tensor::zero_() {
  if (nbytes() == 0) return;
  if (device().is_cpu()) {
    std::memset(raw(), 0, nbytes());
    return;
  }
#ifdef BB_WITH_CUDA
  cuda::memset_zero(raw(), nbytes());
#endif
}

void Tensor::record_stream(Stream s) const {
  if (storage_) storage_->record_stream(s);
}

void Tensor::fill_(double value) {
  BB_CHECK(defined(), "fill_: tensor is undefined");
  const int64_t n = numel();
  Tensor host = device().is_cpu() ? *this : empty(shape_, dtype_, Device::cpu(), MemCategory::other);
  switch (dtype_) {
    case DType::f32: { float* p = host.data<float>(); for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(value); break; }
    case DType::bf16: { uint16_t h = f32_to_bf16(static_cast<float>(value)); uint16_t* p = host.data<uint16_t>(); for (int64_t i = 0; i < n; ++i) p[i] = h; break; }
    case DType::f16: { uint16_t h = f32_to_f16(static_cast<float>(value)); uint16_t* p = host.data<uint16_t>(); for (int64_t i = 0; i < n; ++i) p[i] = h; break; }
    case DType::i32: { int32_t* p = host.data<int32_t>(); for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>(value); break; }
    case DType::i64: { int64_t* p = host.data<int64_t>(); for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int64_t>(value); break; }
    case DType::i16: { int16_t* p = host.data<int16_t>(); for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int16_t>(value); break; }
    case DType::u8:
    case DType::boolean: { uint8_t* p = host.data<uint8_t>(); for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(value); break; }
  }
  if (!device().is_cpu()) copy_from(host);
}

std::vector<float> Tensor::to_floats() const {
  BB_CHECK(defined(), "to_floats: tensor is undefined");
  BB_CHECK(is_floating(dtype_), "to_floats: tensor ", str(), " is not floating point");
  Tensor host = device().is_cpu() ? *this : to(Device::cpu(), MemCategory::other);
  const int64_t n = numel();
  std::vector<float> v(static_cast<size_t>(n));
  if (dtype_ == DType::f32) {
    if (n) std::memcpy(v.data(), host.raw(), static_cast<size_t>(n) * 4);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(host.raw());
    for (int64_t i = 0; i < n; ++i) v[i] = dtype_ == DType::bf16 ? bf16_to_f32(p[i]) : f16_to_f32(p[i]);
  }
  return v;
}

std::vector<int32_t> Tensor::to_ints() const {
  BB_CHECK(defined(), "to_ints: tensor is undefined");
  Tensor host = device().is_cpu() ? *this : to(Device::cpu(), MemCategory::other);
  const int64_t n = numel();
  std::vector<int32_t> v(static_cast<size_t>(n));
  switch (dtype_) {
    case DType::i32: if (n) std::memcpy(v.data(), host.raw(), static_cast<size_t>(n) * 4); break;
    case DType::i64: { const int64_t* p = static_cast<const int64_t*>(host.raw()); for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(p[i]); break; }
    case DType::u8: case DType::boolean: { const uint8_t* p = static_cast<const uint8_t*>(host.raw()); for (int64_t i = 0; i < n; ++i) v[i] = p[i]; break; }
    case DType::i16: { const int16_t* p = static_cast<const int16_t*>(host.raw()); for (int64_t i = 0; i < n; ++i) v[i] = p[i]; break; }
    default: BB_FAIL("to_ints: tensor ", str(), " is not an integer type");
  }
  return v;
}

void check_defined(const Tensor& t, const char* op, const char* arg) {
  BB_CHECK(t.defined(), op, ": argument '", arg, "' is undefined");
}

void check_shape(const Tensor& t, const Shape& expected, const char* op, const char* arg) {
  check_defined(t, op, arg);
  bool ok = t.dim() == static_cast<int>(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i)
    ok = expected[i] < 0 || expected[i] == t.shape()[i];
  BB_CHECK(ok, op, ": argument '", arg, "' has shape ", shape_str(t.shape()), ", expected ",
           shape_str(expected), " (-1 = any)");
}

void check_dtype(const Tensor& t, DType expected, const char* op, const char* arg) {
  check_defined(t, op, arg);
  BB_CHECK(t.dtype() == expected, op, ": argument '", arg, "' has dtype ", dtype_name(t.dtype()),
           ", expected ", dtype_name(expected));
}

void check_float(const Tensor& t, const char* op, const char* arg) {
  check_defined(t, op, arg);
  BB_CHECK(is_floating(t.dtype()), op, ": argument '", arg, "' has dtype ", dtype_name(t.dtype()),
           ", expected a float type (f32, bf16 or f16)");
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  BB_CHECK(a.device() == b.device(), op, ": tensors on different devices (", a.device().str(),
           " and ", b.device().str(), ")");
}

void check_backend_device(const Tensor& t, const char* op, const char* arg) {
#ifdef BB_WITH_CUDA
  if (t.device().is_cuda()) return;
#endif
  BB_CHECK(t.device().is_cpu(), op, ": not implemented on ", t.device().str(), " yet (argument '",
           arg, "' is ", t.str(), ")");
}

}  // namespace bb

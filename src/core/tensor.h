// tensor.h — a contiguous n-d array on one device, with memory accounting.
//
// A Tensor is a view (byte offset + shape + dtype) into shared Storage. Storage is allocated
// through the device's Allocator under a MemCategory, and freed when the last view goes away.
// Views are cheap: `narrow` along the leading dimension and `view` (reshape) share storage.
// Copies between devices are explicit (`to`). There is no autograd.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/stream.h"

namespace bb {

using Shape = std::vector<int64_t>;

// Memory of one allocation. It is allocated on the creating thread's current stream
// (core/stream.h); record_stream adds the streams that use it besides that one, so the memory is
// not handed out again before they are done with it.
class Storage {
 public:
  Storage(size_t bytes, Device dev, MemCategory cat);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return dev_; }
  MemCategory category() const { return cat_; }
  Stream stream() const { return stream_; }
  void record_stream(Stream s) { used_.fetch_or(stream_bit(s), std::memory_order_relaxed); }
  uint32_t used_streams() const { return used_.load(std::memory_order_relaxed); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Device dev_;
  MemCategory cat_;
  Stream stream_;
  std::atomic<uint32_t> used_;
};

template <class T>
constexpr bool dtype_matches(DType dt) {
  if constexpr (std::is_same_v<T, float>) return dt == DType::f32;
  else if constexpr (std::is_same_v<T, uint16_t>) return dt == DType::bf16 || dt == DType::f16;
  else if constexpr (std::is_same_v<T, int32_t>) return dt == DType::i32;
  else if constexpr (std::is_same_v<T, int64_t>) return dt == DType::i64;
  else if constexpr (std::is_same_v<T, int16_t>) return dt == DType::i16;
  else if constexpr (std::is_same_v<T, uint8_t>) return dt == DType::u8 || dt == DType::boolean;
  else return false;
}

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dt, Device dev, MemCategory cat);
  static Tensor zeros(const Shape& shape, DType dt, Device dev, MemCategory cat);
  // Host tensor from values; `dt` may be f32/bf16/f16 for float values (converted).
  static Tensor from_floats(const std::vector<float>& v, const Shape& shape, DType dt = DType::f32,
                            MemCategory cat = MemCategory::other);
  static Tensor from_ints(const std::vector<int32_t>& v, const Shape& shape,
                          MemCategory cat = MemCategory::other);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int i) const;
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  MemCategory category() const;
  std::string str() const;  // "bf16[4, 8] on cpu (activations)" for messages

  void* raw() const;
  template <class T>
  T* data() const {
    BB_CHECK(defined(), "data(): tensor is undefined");
    BB_CHECK(dtype_matches<T>(dtype_), "data(): element type does not match tensor dtype ",
             dtype_name(dtype_));
    return static_cast<T*>(raw());
  }

  // Rows [start, start+len) of the leading dimension; shares storage.
  Tensor narrow(int64_t start, int64_t len) const;
  // Same storage, new shape with the same element count; one entry may be -1.
  Tensor view(const Shape& shape) const;

  // Copy to another device (same dtype). `cat` defaults to this tensor's category.
  Tensor to(Device dev) const;
  Tensor to(Device dev, MemCategory cat) const;
  // Copy with another dtype (float <-> float conversions; on the tensor's device).
  Tensor to_dtype(DType dt) const;
  Tensor to_dtype(DType dt, MemCategory cat) const;
  Tensor clone() const;
  Tensor clone(MemCategory cat) const;
  // Copies src (same shape and dtype, any device) into this tensor.
  void copy_from(const Tensor& src);
  void zero_();
  // Marks the storage as used by work on stream `s` (record-stream semantics, core/stream.h):
  // call it when a side stream reads or writes this tensor.
  void record_stream(Stream s) const;
  // Sets every element (float dtypes: value; integer dtypes: value truncated).
  void fill_(double value);

  // Host copy of the values as f32 / i32 (any device; float or integer dtype respectively).
  std::vector<float> to_floats() const;
  std::vector<int32_t> to_ints() const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::f32;
};

// The first element of a host float tensor that is Inf or NaN, or -1. f32 and bf16 are read in
// place (an exponent of all ones), without a widened copy.
int64_t first_nonfinite(const Tensor& host);

// Element count of a shape (1 for []). Throws bb::Error naming the shape when the product
// overflows int64 (a zero dim makes any shape valid: the count is 0).
int64_t shape_numel(const Shape& s);
// numel * dtype size, with the same check on the byte count.
size_t shape_nbytes(const Shape& s, DType dt);

// Boundary checks used by every primitive; the message names the op and the argument.
void check_shape(const Tensor& t, const Shape& expected, const char* op, const char* arg);
void check_dtype(const Tensor& t, DType expected, const char* op, const char* arg);
void check_float(const Tensor& t, const char* op, const char* arg);  // f32 or bf16 or f16
void check_defined(const Tensor& t, const char* op, const char* arg);
void check_same_device(const Tensor& a, const Tensor& b, const char* op);
// The CPU always; a CUDA device when this build has the CUDA backend.
void check_backend_device(const Tensor& t, const char* op, const char* arg);

}  // namespace bb

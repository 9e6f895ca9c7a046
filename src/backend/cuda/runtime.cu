// runtime.cu — device copies, conversions, the compute stream and the stream-ordered allocator.
//
// Device memory comes from the CUDA memory pool of each device (cudaMallocAsync on the compute
// stream). The pool's release threshold is raised to "keep everything", so after the first
// step no allocation reaches the driver (no cudaMalloc/cudaFree inside the step); the pool's
// reserved high-water mark is reported next to the per-category peaks.
#include <atomic>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mutex>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/runtime.h"

namespace bb {

namespace cuda {

namespace {
std::atomic<int64_t> g_host_syncs{0};

struct DeviceState {
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  int sms = 0;
};

DeviceState& state(int dev) {
  static std::mutex mu;
  static std::vector<DeviceState> states;
  std::lock_guard<std::mutex> lock(mu);
  if (states.empty()) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    states.resize(static_cast<size_t>(n));
  }
  BB_CHECK(dev >= 0 && dev < static_cast<int>(states.size()), "cuda:", dev, " requested but ",
           states.size(), " CUDA device(s) are visible");
  DeviceState& s = states[static_cast<size_t>(dev)];
  if (!s.stream) {
    BB_CHECK_CUDA(cudaSetDevice(dev));
    BB_CHECK_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    BB_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&s.pool, dev));
    uint64_t keep = UINT64_MAX;  // never give memory back to the driver between steps
    BB_CHECK_CUDA(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &keep));
    BB_CHECK_CUDA(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, dev));
  }
  return s;
}

int current_device() {
  int d = 0;
  BB_CHECK_CUDA(cudaGetDevice(&d));
  return d;
}

template <class D, class S>
__device__ __forceinline__ D convert_one(S x);
template <> __device__ __forceinline__ float convert_one<float, float>(float x) { return x; }
template <> __device__ __forceinline__ float convert_one<float, __nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float convert_one<float, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ __nv_bfloat16 convert_one<__nv_bfloat16, float>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half convert_one<__half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 convert_one<__nv_bfloat16, __half>(__half x) { return __float2bfloat16_rn(__half2float(x)); }
template <> __device__ __forceinline__ __half convert_one<__half, __nv_bfloat16>(__nv_bfloat16 x) { return __float2half_rn(__bfloat162float(x)); }
template <> __device__ __forceinline__ __nv_bfloat16 convert_one<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16 x) { return x; }
template <> __device__ __forceinline__ __half convert_one<__half, __half>(__half x) { return x; }

template <class D, class S>
__global__ void convert_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = convert_one<D, S>(src[i]);
}

template <class D, class S>
void launch_convert(void* dst, const void* src, int64_t n) {
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 65535));
  convert_kernel<D, S><<<blocks, threads, 0, stream()>>>(static_cast<D*>(dst), static_cast<const S*>(src), n);
  BB_CHECK_LAUNCH();
}

template <class S>
void convert_from(void* dst, DType dt, const void* src, int64_t n) {
  switch (dt) {
    case DType::f32: launch_convert<float, S>(dst, src, n); break;
    case DType::bf16: launch_convert<__nv_bfloat16, S>(dst, src, n); break;
    case DType::f16: launch_convert<__half, S>(dst, src, n); break;
    default: BB_FAIL("cuda::convert: destination dtype ", dtype_name(dt), " is not a float type");
  }
}
}  // namespace

cudaStream_t stream() { return state(current_device()).stream; }
int sm_count() { return state(current_device()).sms; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

const char* unavailable_reason() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(e);
  }
  return n > 0 ? "" : "no CUDA device is visible";
}

void memcpy(void* dst, Device ddev, const void* src, Device sdev, size_t bytes) {
  if (bytes == 0) return;
  const int dev = ddev.is_cuda() ? ddev.index : sdev.index;
  BB_CHECK_CUDA(cudaSetDevice(dev));
  cudaStream_t s = stream();
  cudaMemcpyKind kind = ddev.is_cuda() ? (sdev.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                       : cudaMemcpyDeviceToHost;
  BB_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, s));
  // Host memory must not change or be read before the copy completes.
  if (kind != cudaMemcpyDeviceToDevice) {
    BB_CHECK_CUDA(cudaStreamSynchronize(s));
    note_host_sync();
  }
}

void memset_zero(void* p, size_t bytes) {
  if (bytes) BB_CHECK_CUDA(cudaMemsetAsync(p, 0, bytes, stream()));
}

void convert(void* dst, DType dt, const void* src, DType st, int64_t n) {
  if (n == 0) return;
  switch (st) {
    case DType::f32: convert_from<float>(dst, dt, src, n); break;
    case DType::bf16: convert_from<__nv_bfloat16>(dst, dt, src, n); break;
    case DType::f16: convert_from<__half>(dst, dt, src, n); break;
    default: BB_FAIL("cuda::convert: source dtype ", dtype_name(st), " is not a float type");
  }
}

void synchronize() {
  BB_CHECK_CUDA(cudaStreamSynchronize(stream()));
  note_host_sync();
}

int64_t host_sync_count() { return g_host_syncs.load(); }
void note_host_sync() { g_host_syncs.fetch_add(1); }

}  // namespace cuda

namespace {
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int dev) : dev_(dev) {}
  Device device() const override { return Device::cuda(dev_); }

 protected:
  void* raw_allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    BB_CHECK_CUDA(cudaSetDevice(dev_));
    void* p = nullptr;
    cudaError_t e = cudaMallocAsync(&p, bytes, cuda::stream());
    BB_CHECK(e == cudaSuccess, "out of GPU memory on cuda:", dev_, " allocating ", format_bytes(static_cast<int64_t>(bytes)),
             " (", cudaGetErrorString(e), "); see the per-category peaks in the log");
    // Tests set BB_POISON_ALLOC=1: new memory reads as NaN (0xFF bytes) so that an output a
    // kernel forgot to write cannot pass as zeros.
    static const bool poison = std::getenv("BB_POISON_ALLOC") != nullptr;
    if (poison) BB_CHECK_CUDA(cudaMemsetAsync(p, 0xFF, bytes, cuda::stream()));
    return p;
  }
  void raw_deallocate(void* p, size_t) override {
    if (p) cudaFreeAsync(p, cuda::stream());
  }
  int64_t reserved_peak() const override {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev_) != cudaSuccess) return 0;
    uint64_t v = 0;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &v);
    return static_cast<int64_t>(v);
  }
  void reset_reserved_peak() override {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev_) != cudaSuccess) return;
    uint64_t zero = 0;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
  }

 private:
  int dev_;
};
}  // namespace

Allocator& cuda_allocator(int device_index) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<CudaAllocator>> allocs;
  std::lock_guard<std::mutex> lock(mu);
  const int n = cuda::device_count();
  BB_CHECK(device_index >= 0 && device_index < n, "cuda:", device_index, " requested but ", n,
           " CUDA device(s) are visible (", cuda::unavailable_reason(), ")");
  if (allocs.empty()) allocs.resize(static_cast<size_t>(n));
  auto& a = allocs[static_cast<size_t>(device_index)];
  if (!a) a = std::make_unique<CudaAllocator>(device_index);
  return *a;
}

}  // namespace bb

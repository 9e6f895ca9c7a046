// runtime.cu — streams, events, device copies, conversions and the stream-ordered allocator.
//
// Device memory comes from the CUDA memory pool of each device (cudaMallocAsync on the
// allocating thread's current stream). The pool's release threshold is raised to "keep
// everything", so after the first step no allocation reaches the driver (no cudaMalloc/cudaFree
// inside the step); the pool's reserved high-water mark is reported next to the per-category
// peaks.
//
// Record-stream semantics (core/stream.h). A buffer used only on the stream it was allocated on
// is freed on that stream: the pool hands it out again in that stream's order. A buffer that
// other streams used as well is freed on the device's private *release stream*, after that
// stream waited for an event recorded on every user: the free is then ordered after all their
// queued work, and no user stream waits for another because of it. The pool does not insert
// dependencies of its own (cudaMemPoolReuseAllowInternalDependencies = 0): a block freed on the
// release stream is reused by another stream only once the free has completed.
//
// NOTES: the per-thread cache (device, current stream, SM count) is what makes cuda::stream()
// and the launch helpers cheap; every device switch goes through cuda::set_device so the cache
// stays right.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/check.cuh"
#include "backend/cuda/vec.cuh"
#include "backend/cuda/runtime.h"

namespace bb {

namespace cuda {

namespace {
std::atomic<int64_t> g_host_syncs{0};
std::atomic<bool> g_poison{false};
std::atomic<bool> g_cross_stream_reuse{false};  // [backend] pool_cross_stream_reuse

void apply_cross_stream_reuse(cudaMemPool_t pool) {
  int reuse = g_cross_stream_reuse.load() ? 1 : 0;
  BB_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &reuse));
}

constexpr int kMaxDevices = 64;

struct DeviceState {
  std::mutex mu;  // creation of streams, the event pool, the release path
  std::atomic<cudaStream_t> streams[kNumStreams] = {};
  cudaStream_t release = nullptr;
  cudaEvent_t release_marks[kNumStreams] = {};
  cudaMemPool_t pool = nullptr;  // the device's current pool (the default one unless capped)
  int64_t pool_cap = 0;          // set_memory_limit's cap on the pool, 0: none
  int sms = 0;
  int cc = 0;  // compute capability, 10 major + minor
  int priority_low = 0, priority_high = 0;
  std::vector<cudaEvent_t> free_events;
};

// Stream priorities (lower number = higher priority): comm highest (NCCL kernels must not wait
// behind compute blocks), then compute and wgrad, then copy lowest, so that the block scheduler
// hands SMs to the step's kernels before the copy stream's (the training state's early sums
// and updates beside the backward). With a one-level range they are all the same.
int work_priority(const DeviceState& st) {
  return st.priority_low > st.priority_high ? st.priority_low - 1 : st.priority_low;
}

std::atomic<DeviceState*> g_states[kMaxDevices] = {};
std::mutex g_states_mu;

int visible_devices() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      cudaGetLastError();
      c = 0;
    }
    return c;
  }();
  return n;
}

DeviceState& state(int dev) {
  BB_CHECK(dev >= 0 && dev < visible_devices() && dev < kMaxDevices, "cuda:", dev,
           " requested but ", visible_devices(), " CUDA device(s) are visible");
  if (DeviceState* s = g_states[dev].load(std::memory_order_acquire)) return *s;
  std::lock_guard<std::mutex> lock(g_states_mu);
  if (DeviceState* s = g_states[dev].load(std::memory_order_acquire)) return *s;
  auto* s = new DeviceState;  // lives for the process (streams outlive static destructors)
  BB_CHECK_CUDA(cudaSetDevice(dev));
  BB_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&s->priority_low, &s->priority_high));
  cudaStream_t compute = nullptr;
  BB_CHECK_CUDA(cudaStreamCreateWithPriority(&compute, cudaStreamNonBlocking, work_priority(*s)));
  s->streams[0].store(compute);
  BB_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&s->pool, dev));
  uint64_t keep = UINT64_MAX;  // never give memory back to the driver between steps
  BB_CHECK_CUDA(cudaMemPoolSetAttribute(s->pool, cudaMemPoolAttrReleaseThreshold, &keep));
  apply_cross_stream_reuse(s->pool);
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&s->sms, cudaDevAttrMultiProcessorCount, dev));
  int major = 0, minor = 0;
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  s->cc = 10 * major + minor;
  g_states[dev].store(s, std::memory_order_release);
  return *s;
}

}  // namespace

int work_stream_priority(int dev) { return work_priority(state(dev)); }

namespace {
cudaStream_t named_stream(DeviceState& st, int dev, Stream which) {
  const int i = static_cast<int>(which);
  if (cudaStream_t s = st.streams[i].load(std::memory_order_acquire)) return s;
  std::lock_guard<std::mutex> lock(st.mu);
  if (cudaStream_t s = st.streams[i].load(std::memory_order_acquire)) return s;
  set_device(dev);
  cudaStream_t s = nullptr;
  // Communication streams at the high priority: their kernels take few SMs and everything
  // downstream waits for them (the experts for the dispatch, a layer for its gather).
  const bool comm_class = which == Stream::comm || which == Stream::ep || which == Stream::gather ||
                          which == Stream::reduce || which == Stream::cp;
  const int prio = comm_class                               ? st.priority_high
                   : which == Stream::copy || which == Stream::upload ? st.priority_low
                                                            : work_priority(st);
  BB_CHECK_CUDA(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio));
  st.streams[i].store(s, std::memory_order_release);
  return s;
}

struct ThreadCache {
  int dev = -1;
  cudaStream_t stream = nullptr;  // current stream of `dev`, null = look it up
  int sms = 0;
};
thread_local ThreadCache t_cache;

int cached_device() {
  if (t_cache.dev < 0) {
    int d = 0;
    BB_CHECK_CUDA(cudaGetDevice(&d));
    t_cache.dev = d;
  }
  return t_cache.dev;
}

// ---- pinned staging of host -> device copies -----------------------------------------------

constexpr size_t kStagedMaxBytes = size_t{64} << 20;   // larger copies go synchronously
constexpr size_t kStagingCapBytes = size_t{512} << 20;  // pinned memory held at most
constexpr size_t kMinBlockBytes = size_t{1} << 20;

struct StagingBlock {
  void* host = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;  // recorded after the copy out of the block
  bool busy = false;           // a copy out of it was queued (done may not have fired)
};

struct Staging {
  std::mutex mu;
  std::vector<StagingBlock> blocks;
  size_t total = 0;
};

Staging& staging() {
  static Staging* s = new Staging;  // pinned blocks live for the process
  return *s;
}

// Copies into a free pinned block and queues the upload; false when no block can be had
// within the cap (the caller then copies synchronously).
bool staged_upload(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  Staging& st = staging();
  std::lock_guard<std::mutex> lock(st.mu);
  StagingBlock* pick = nullptr;
  for (StagingBlock& b : st.blocks) {
    if (b.bytes < bytes) continue;
    if (b.busy) {
      const cudaError_t q = cudaEventQuery(b.done);
      if (q == cudaErrorNotReady) continue;
      BB_CHECK_CUDA(q);
      b.busy = false;
    }
    if (!pick || b.bytes < pick->bytes) pick = &b;
  }
  if (!pick) {
    size_t size = kMinBlockBytes;
    while (size < bytes) size *= 2;
    if (st.total + size > kStagingCapBytes) return false;
    StagingBlock b;
    b.bytes = size;
    BB_CHECK(cudaMallocHost(&b.host, size) == cudaSuccess, "cannot allocate ",
             format_bytes(static_cast<int64_t>(size)), " of pinned host memory for uploads");
    BB_CHECK_CUDA(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
    st.total += size;
    st.blocks.push_back(b);
    pick = &st.blocks.back();
  }
  std::memcpy(pick->host, src, bytes);
  BB_CHECK_CUDA(cudaMemcpyAsync(dst, pick->host, bytes, cudaMemcpyHostToDevice, s));
  BB_CHECK_CUDA(cudaEventRecord(pick->done, s));
  pick->busy = true;
  return true;
}

// ---- conversions -----------------------------------------------------------------------------

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

// kVec elements a thread and step: one 16-byte access (or two, for 4-byte sources) when both
// pointers are 16-byte aligned (the launcher checks), so the conversion streams at the copy
// rate; elements past the last whole vector go one by one. kVec = 1 is the scalar fallback.
template <class D, class S, int kVec>
__global__ void convert_kernel(D* dst, const S* src, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = n / kVec;
  for (int64_t i = first; i < nv; i += stride) {
    const Pack<S, kVec> in = reinterpret_cast<const Pack<S, kVec>*>(src)[i];
    Pack<D, kVec> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = convert_one<D, S>(in.v[k]);
    reinterpret_cast<Pack<D, kVec>*>(dst)[i] = out;
  }
  for (int64_t i = nv * kVec + first; i < n; i += stride) dst[i] = convert_one<D, S>(src[i]);
}

template <class D, class S>
void launch_convert(void* dst, const void* src, int64_t n) {
  const int threads = 256;
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
  if (aligned) {
    constexpr int kVec = 8;  // 16 bytes of 2-byte types, 32 of f32
    const int blocks = static_cast<int>(std::min<int64_t>(std::max<int64_t>(ceil_div(n / kVec, threads), 1), 65535));
    convert_kernel<D, S, kVec><<<blocks, threads, 0, stream()>>>(static_cast<D*>(dst), static_cast<const S*>(src), n);
  } else {
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 65535));
    convert_kernel<D, S, 1><<<blocks, threads, 0, stream()>>>(static_cast<D*>(dst), static_cast<const S*>(src), n);
  }
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

__global__ void spin_then_copy_kernel(unsigned char* dst, const unsigned char* src, size_t bytes,
                                      long long cycles) {
  if (threadIdx.x == 0) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}
}  // namespace

// ---- streams ---------------------------------------------------------------------------------

void set_device(int dev) {
  if (t_cache.dev == dev) return;
  BB_CHECK_CUDA(cudaSetDevice(dev));
  t_cache.dev = dev;
  t_cache.stream = nullptr;
  t_cache.sms = 0;
}

int current_device() { return cached_device(); }

void current_stream_changed() { t_cache.stream = nullptr; }

cudaStream_t stream() {
  if (t_cache.stream) return t_cache.stream;
  const int dev = cached_device();
  t_cache.stream = named_stream(state(dev), dev, current_stream());
  return t_cache.stream;
}

cudaStream_t stream_of(int dev, Stream s) { return named_stream(state(dev), dev, s); }

int sm_count() {
  if (t_cache.sms == 0) t_cache.sms = state(cached_device()).sms;
  return t_cache.sms;
}

int compute_capability(int dev) { return state(dev).cc; }

int device_count() { return visible_devices(); }

std::string device_name(int dev) {
  cudaDeviceProp prop{};
  BB_CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
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

// ---- copies ----------------------------------------------------------------------------------

void memcpy(void* dst, Device ddev, const void* src, Device sdev, size_t bytes) {
  if (bytes == 0) return;
  set_device(ddev.is_cuda() ? ddev.index : sdev.index);
  cudaStream_t s = stream();
  if (ddev.is_cuda() && sdev.is_cuda()) {
    BB_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  if (ddev.is_cuda() && bytes <= kStagedMaxBytes && staged_upload(dst, src, bytes, s)) return;
  // Device -> host (the host reads the result) or a large upload: wait for the copy.
  BB_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes,
                                ddev.is_cuda() ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s));
  BB_CHECK_CUDA(cudaStreamSynchronize(s));
  note_host_sync();
}

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  BB_CHECK(cudaMallocHost(&p, bytes) == cudaSuccess, "cannot allocate ", bytes, " bytes of pinned host memory");
  return p;
}

void pinned_free(void* p) {
  if (p) cudaFreeHost(p);
}

bool host_register(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return false;
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  cudaGetLastError();  // not sticky: clear it
  return false;
}

void host_unregister(void* p) {
  if (p && cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

void copy_to_pinned_async(void* pinned_dst, const void* src, size_t bytes) {
  if (bytes) BB_CHECK_CUDA(cudaMemcpyAsync(pinned_dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
}

void copy_pinned_async(void* dst, const void* src, size_t bytes) {
  if (bytes) BB_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
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

void synchronize_device(int dev) {
  set_device(dev);
  BB_CHECK_CUDA(cudaDeviceSynchronize());
  note_host_sync();
}

int64_t host_sync_count() { return g_host_syncs.load(); }
void note_host_sync() { g_host_syncs.fetch_add(1); }

// ---- events ----------------------------------------------------------------------------------

void* event_acquire(int dev) {
  DeviceState& st = state(dev);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (!st.free_events.empty()) {
      cudaEvent_t e = st.free_events.back();
      st.free_events.pop_back();
      return e;
    }
  }
  set_device(dev);
  cudaEvent_t e = nullptr;
  BB_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void event_release(int dev, void* event) {
  DeviceState& st = state(dev);
  std::lock_guard<std::mutex> lock(st.mu);
  st.free_events.push_back(static_cast<cudaEvent_t>(event));
}

void event_record(void* event, int dev, Stream s) {
  BB_CHECK_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event), stream_of(dev, s)));
}

void stream_wait_event(int dev, Stream s, void* event) {
  BB_CHECK_CUDA(cudaStreamWaitEvent(stream_of(dev, s), static_cast<cudaEvent_t>(event), 0));
}

bool event_done(void* event) {
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (q == cudaErrorNotReady) return false;
  BB_CHECK_CUDA(q);
  return true;
}

void event_synchronize(void* event) {
  BB_CHECK_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  note_host_sync();
}

void set_memory_limit(int dev, int64_t bytes) {
  DeviceState& st = state(dev);
  set_device(dev);
  BB_CHECK(st.pool_cap == 0, "cuda:", dev, ": the memory limit is set once per process (already ",
           format_bytes(st.pool_cap), ")");
  // What the process already holds outside the pool (context, module code, library handles)
  // counts against the card's memory too.
  size_t free_b = 0, total_b = 0;
  BB_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  uint64_t pooled = 0;
  BB_CHECK_CUDA(cudaMemPoolGetAttribute(st.pool, cudaMemPoolAttrReservedMemCurrent, &pooled));
  const int64_t outside = static_cast<int64_t>(total_b - free_b) - static_cast<int64_t>(pooled);
  const int64_t cap = bytes - std::max<int64_t>(outside, 0);
  BB_CHECK(cap > 0, "cuda:", dev, ": a memory limit of ", format_bytes(bytes), " leaves nothing for the run (",
           format_bytes(outside), " are in use outside the allocator)");
  BB_CHECK(static_cast<size_t>(bytes) <= total_b, "cuda:", dev, ": a memory limit of ", format_bytes(bytes),
           " is more than the card's ", format_bytes(static_cast<int64_t>(total_b)));
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = dev;
  props.maxSize = static_cast<size_t>(cap);
  cudaMemPool_t pool = nullptr;
  BB_CHECK_CUDA(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = UINT64_MAX;
  BB_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  apply_cross_stream_reuse(pool);
  BB_CHECK_CUDA(cudaDeviceSetMemPool(dev, pool));
  st.pool = pool;
  st.pool_cap = cap;
}

int64_t memory_limit(int dev) { return state(dev).pool_cap; }

void set_pool_cross_stream_reuse(bool on) {
  g_cross_stream_reuse.store(on);
  for (int dev = 0; dev < kMaxDevices; ++dev)
    if (DeviceState* s = g_states[dev].load(std::memory_order_acquire)) {
      set_device(dev);
      apply_cross_stream_reuse(s->pool);
    }
}

void release_cached_memory(int dev) {
  DeviceState& st = state(dev);
  synchronize_device(dev);
  BB_CHECK_CUDA(cudaMemPoolTrimTo(st.pool, 0));
}

int64_t device_memory_used(int dev) {
  set_device(dev);
  size_t free_b = 0, total_b = 0;
  BB_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<int64_t>(total_b - free_b);
}

int64_t memory_available(int dev) {
  DeviceState& st = state(dev);
  set_device(dev);
  uint64_t reserved = 0, used = 0;
  BB_CHECK_CUDA(cudaMemPoolGetAttribute(st.pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  BB_CHECK_CUDA(cudaMemPoolGetAttribute(st.pool, cudaMemPoolAttrUsedMemCurrent, &used));
  if (st.pool_cap > 0) return st.pool_cap - static_cast<int64_t>(used);
  size_t free_b = 0, total_b = 0;
  BB_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<int64_t>(free_b) + static_cast<int64_t>(reserved - used);
}

void set_poison_allocations(bool on) { g_poison.store(on); }

void spin_then_copy(void* dst, const void* src, size_t bytes, double spin_ms) {
  int khz = 0;
  BB_CHECK_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, cached_device()));
  const long long cycles = static_cast<long long>(spin_ms * khz);
  spin_then_copy_kernel<<<1, 256, 0, stream()>>>(static_cast<unsigned char*>(dst),
                                                 static_cast<const unsigned char*>(src), bytes,
                                                 cycles);
  BB_CHECK_LAUNCH();
}

}  // namespace cuda

namespace {
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int dev) : dev_(dev) {}
  Device device() const override { return Device::cuda(dev_); }

 protected:
  void* raw_allocate(size_t bytes, int stream) override {
    if (bytes == 0) return nullptr;
    cuda::set_device(dev_);
    cudaStream_t s = cuda::stream_of(dev_, static_cast<Stream>(stream));
    void* p = nullptr;
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e == cudaErrorMemoryAllocation) {
      // The pool may hold enough free memory in pieces, or freed on other streams behind work not
      // yet done: wait for every stream, give the pool's unused memory back, and try once more
      // (measured: one emulated rank of Qwen3.5-35B-A3B failed a 2.75 GiB workspace with 29 GiB
      // live and 77.5 GiB held, bench/results/2026-12-06-h100-plan-time.md).
      cudaGetLastError();
      cuda::release_cached_memory(dev_);
      e = cudaMallocAsync(&p, bytes, s);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      const int64_t cap = cuda::memory_limit(dev_);
      BB_FAIL("out of GPU memory on cuda:", dev_, " allocating ", format_bytes(static_cast<int64_t>(bytes)), " (",
              cudaGetErrorString(e), cap > 0 ? "; the allocator is capped at " + format_bytes(cap) + " for this run" : "",
              ")");
    }
    if (cuda::g_poison.load(std::memory_order_relaxed)) BB_CHECK_CUDA(cudaMemsetAsync(p, 0xFF, bytes, s));
    return p;
  }
  void raw_deallocate(void* p, size_t, int stream, uint32_t used) override {
    if (!p) return;
    const Stream own = static_cast<Stream>(stream);
    used |= stream_bit(own);
    if (used == stream_bit(own)) {
      cudaFreeAsync(p, cuda::stream_of(dev_, own));
      return;
    }
    // Used on several streams: free on the release stream, after the work every user queued.
    // The streams are looked up before the lock: creating one takes the same mutex.
    cudaStream_t users[kNumStreams] = {};
    for (int i = 0; i < kNumStreams; ++i)
      if (used & (1u << i)) users[i] = cuda::stream_of(dev_, static_cast<Stream>(i));
    cuda::DeviceState& st = cuda::state(dev_);
    std::lock_guard<std::mutex> lock(st.mu);
    cuda::set_device(dev_);
    if (!st.release) {
      if (cudaStreamCreateWithFlags(&st.release, cudaStreamNonBlocking) != cudaSuccess) return;
      for (cudaEvent_t& m : st.release_marks) cudaEventCreateWithFlags(&m, cudaEventDisableTiming);
    }
    for (int i = 0; i < kNumStreams; ++i) {
      if (!(used & (1u << i))) continue;
      // Each wait captures the mark as recorded now, so one event per stream is reused.
      cudaEventRecord(st.release_marks[i], users[i]);
      cudaStreamWaitEvent(st.release, st.release_marks[i], 0);
    }
    cudaFreeAsync(p, st.release);
  }
  // The pool never gives memory back (release threshold UINT64_MAX, no trim), so its reserved
  // high-water mark is what it holds: it is not reset with the live peaks (a driver call at
  // every step's start that could only give the same number).
  int64_t reserved_peak() const override {
    cudaMemPool_t pool;
    if (cudaDeviceGetMemPool(&pool, dev_) != cudaSuccess) return 0;
    uint64_t v = 0;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &v);
    return static_cast<int64_t>(v);
  }

 private:
  int dev_;
};
}  // namespace

// Looked up on every tensor allocation and free: lock-free after the first use of a device.
Allocator& cuda_allocator(int device_index) {
  static std::atomic<CudaAllocator*> allocs[cuda::kMaxDevices] = {};
  static std::mutex mu;
  const int n = cuda::device_count();
  BB_CHECK(device_index >= 0 && device_index < n && device_index < cuda::kMaxDevices, "cuda:",
           device_index, " requested but ", n, " CUDA device(s) are visible (",
           cuda::unavailable_reason(), ")");
  if (CudaAllocator* a = allocs[device_index].load(std::memory_order_acquire)) return *a;
  std::lock_guard<std::mutex> lock(mu);
  if (CudaAllocator* a = allocs[device_index].load(std::memory_order_acquire)) return *a;
  auto* a = new CudaAllocator(device_index);  // lives for the process, like the pool
  allocs[device_index].store(a, std::memory_order_release);
  return *a;
}

}  // namespace bb

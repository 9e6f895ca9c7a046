// stream.cpp — the thread's current stream and device-agnostic events (core/stream.h). CUDA
// builds forward events to backend/cuda/runtime.h; on the CPU everything is already complete.
#include "core/stream.h"

#include "core/error.h"

#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb {

namespace {
thread_local Stream t_stream = Stream::compute;
}  // namespace

const char* stream_name(Stream s) {
  switch (s) {
    case Stream::compute: return "compute";
    case Stream::comm: return "comm";
    case Stream::wgrad: return "wgrad";
    case Stream::copy: return "copy";
    case Stream::ep: return "ep";
    case Stream::gather: return "gather";
    case Stream::reduce: return "reduce";
    case Stream::cp: return "cp";
    case Stream::upload: return "upload";
  }
  return "?";
}

Stream current_stream() { return t_stream; }

StreamScope::StreamScope(Stream s) : prev_(t_stream) {
  t_stream = s;
#ifdef BB_WITH_CUDA
  cuda::current_stream_changed();
#endif
}

StreamScope::~StreamScope() {
  t_stream = prev_;
#ifdef BB_WITH_CUDA
  cuda::current_stream_changed();
#endif
}

struct Event::Impl {
  int device = -1;
  void* handle = nullptr;  // cudaEvent_t of a CUDA event
  ~Impl() {
#ifdef BB_WITH_CUDA
    if (handle) cuda::event_release(device, handle);
#endif
  }
};

Event Event::record(Device dev, Stream s) {
  Event e;
  if (dev.is_cpu()) return e;  // CPU work is already done when it returns
#ifdef BB_WITH_CUDA
  e.impl_ = std::make_shared<Impl>();
  e.impl_->device = dev.index;
  e.impl_->handle = cuda::event_acquire(dev.index);
  cuda::event_record(e.impl_->handle, dev.index, s);
  return e;
#else
  BB_FAIL("Event::record on ", dev.str(), ": this build has no CUDA backend");
#endif
}

void Event::wait(Stream s) const {
  if (!impl_) return;
#ifdef BB_WITH_CUDA
  cuda::stream_wait_event(impl_->device, s, impl_->handle);
#else
  (void)s;
#endif
}

bool Event::done() const {
  if (!impl_) return true;
#ifdef BB_WITH_CUDA
  return cuda::event_done(impl_->handle);
#else
  return true;
#endif
}

void Event::synchronize() const {
  if (!impl_) return;
#ifdef BB_WITH_CUDA
  cuda::event_synchronize(impl_->handle);
#endif
}

void synchronize_device(Device dev) {
  if (dev.is_cpu()) return;
#ifdef BB_WITH_CUDA
  cuda::synchronize_device(dev.index);
#else
  BB_FAIL("synchronize_device(", dev.str(), "): this build has no CUDA backend");
#endif
}

}  // namespace bb

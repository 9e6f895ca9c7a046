// runtime.h — the CUDA runtime pieces the core needs: streams and events (the CUDA side of
// core/stream.h), device copies, dtype conversion, host-sync accounting and the stream-ordered
// allocator.
//
// Host-only header (no CUDA types leak into core headers): streams and events are passed as
// void* here; kernels and .cu files include backend/cuda/check.cuh for the CUDA types.
//
// Streams. Each device has one stream per bb::Stream (compute, comm, wgrad, copy), created on
// first use, non-blocking (no implicit ordering with the legacy stream); comm has the highest
// priority so that collectives are not starved by compute. cuda::stream() (check.cuh) is the
// calling thread's current stream: a thread-local read, no lock and no driver call once the
// thread has used it (the device is cached per thread by cuda::set_device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/stream.h"

namespace bb::cuda {

// Number of CUDA devices visible (0 when there is no driver or no device; never throws).
int device_count();
// Human-readable reason why no device is usable, or "" when one is.
const char* unavailable_reason();
// The device's name as the driver gives it ("NVIDIA H200").
std::string device_name(int dev);

// Makes `dev` current for this thread (a no-op when it already is; cached per thread).
void set_device(int dev);
// The device this thread issues work on.
int current_device();
// core/stream.h tells the runtime that this thread's current stream changed.
void current_stream_changed();

// The priority of `dev`'s compute and wgrad streams (CUDA's number: lower is higher). A
// primitive's own side streams take it: a stream created without a priority gets the lowest,
// the copy stream's, whose queued short blocks (the update beside the backward) it would then
// share SMs with as an equal instead of going first.
int work_stream_priority(int dev);

// Copies between any combination of host and device memory, ordered on the current stream.
//   host -> device: the bytes are first copied into a pinned staging buffer, so the call
//     returns at once and `src` may change right after (no host sync); copies over 64 MiB
//     (checkpoint loads) take the synchronous path instead and count a host sync;
//   device -> host: waits for the copy (the host reads the result): a counted host sync;
//   device -> device: asynchronous.
void memcpy(void* dst, Device ddev, const void* src, Device sdev, size_t bytes);
void memset_zero(void* p, size_t bytes);
// Pinned host memory for small results the host reads after a sync it does anyway (the step's
// non-finite flags): copy_to_pinned_async enqueues a device -> host copy on the current stream
// and returns at once (no host sync); dst is valid after the next synchronize of that stream.
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);
void copy_to_pinned_async(void* pinned_dst, const void* src, size_t bytes);
// Copies `bytes` between page-locked host memory (pinned_alloc, host_register) and device memory,
// either way, on the current stream; returns at once (no host sync). Both buffers stay untouched
// until the stream has passed the copy.
void copy_pinned_async(void* dst, const void* src, size_t bytes);
// Page-locks existing host memory (cudaHostRegister), so that copies into it run at the link's
// rate; host_unregister before the memory is freed. host_register reports failure (false)
// instead of throwing: the memory then stays pageable, which is slower but correct.
bool host_register(void* p, size_t bytes);
void host_unregister(void* p);
// Element conversion between float dtypes on the device (f32/bf16/f16).
void convert(void* dst, DType dt, const void* src, DType st, int64_t n);
// Waits for all work on the current stream.
void synchronize();
// Waits for all work on every stream of `dev`.
void synchronize_device(int dev);
// Counts deliberate host-device synchronisations (the step log prints them).
int64_t host_sync_count();
void note_host_sync();

// Events (what core/stream.h's Event is built on). Pooled per device; disable-timing events.
void* event_acquire(int dev);
void event_release(int dev, void* event);
void event_record(void* event, int dev, Stream s);
void stream_wait_event(int dev, Stream s, void* event);
bool event_done(void* event);
void event_synchronize(void* event);  // counts a host sync

// Caps the memory the allocator may hold on `dev` so that the process as a whole stays within
// `bytes` (what it holds outside the allocator now, the context and libraries, is subtracted):
// a larger allocation then fails as on a card with that much memory. Once per device, before
// the run allocates (later allocations come from a new pool; earlier ones stay where they are).
void set_memory_limit(int dev, int64_t bytes);
// Whether the memory pools may reuse memory freed on one stream for another stream's allocation
// by inserting a wait ([backend] pool_cross_stream_reuse); applies to every device's pool now
// and to pools made later.
void set_pool_cross_stream_reuse(bool on);
// The allocator's cap on `dev` (0: none).
int64_t memory_limit(int dev);
// What a run can still allocate on `dev`: the cap less what the pool holds, or without a cap the
// card's free memory plus what the pool holds unused (cudaMemGetInfo, the pool's reserve).
int64_t memory_available(int dev);

// Gives the pool's unused memory on `dev` back to the driver (after draining the device, so that
// every pending free has completed): what Trainer::offload leaves is then only what is still
// allocated. The pool grows again on the next allocations.
void release_cached_memory(int dev);
// The device memory in use on `dev` by every process, as the driver reports it (cudaMemGetInfo's
// total - free: what nvidia-smi shows, this process's context included).
int64_t device_memory_used(int dev);

// Fresh device memory reads as NaN (0xFF bytes) while on, so that an output a kernel forgot to
// write cannot pass as zeros. The GPU tests turn it on; off by default.
void set_poison_allocations(bool on);

// Test helper: on the current stream, spins for about `spin_ms` milliseconds of GPU time, then
// copies `bytes` from src to dst (device pointers). Gives tests a long-running reader.
void spin_then_copy(void* dst, const void* src, size_t bytes, double spin_ms);

}  // namespace bb::cuda

// runtime.h — the CUDA runtime pieces the core needs: a checked-call macro, the stream every
// primitive uses, device copies, dtype conversion, and the stream-ordered allocator.
//
// Host-only header (no CUDA types leak into core headers): streams are passed as void* here;
// kernels and .cu files include backend/cuda/check.cuh for the CUDA types.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/memory.h"

namespace bb::cuda {

// Number of CUDA devices visible (0 when there is no driver or no device; never throws).
int device_count();
// Human-readable reason why no device is usable, or "" when one is.
const char* unavailable_reason();

// Copies between any combination of host and device memory, ordered on the current stream;
// device-to-host copies synchronize before returning (the host reads the result).
void memcpy(void* dst, Device ddev, const void* src, Device sdev, size_t bytes);
void memset_zero(void* p, size_t bytes);
// Element conversion between float dtypes on the device (f32/bf16/f16).
void convert(void* dst, DType dt, const void* src, DType st, int64_t n);
// Waits for all work on the current stream.
void synchronize();
// Counts deliberate host-device synchronisations (the step log prints them).
int64_t host_sync_count();
void note_host_sync();

}  // namespace bb::cuda

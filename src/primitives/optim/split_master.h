// split_master.h — the split fp32 master's two halves (adamw.h): bits(master) = (hi << 16) + lo
// with 32-bit wrap-around, hi the master rounded to nearest bf16 with ties away from zero, lo the
// exact remainder in [-2^15, 2^15). Exact for every bit pattern. Host and device share these
// inline functions, so the CPU reference and the CUDA kernels split and join alike.
#pragma once

#include <cstdint>

#include "core/rng.h"  // BB_HD

namespace bb {

BB_HD uint16_t split_master_hi(uint32_t bits) { return static_cast<uint16_t>((bits + 0x8000u) >> 16); }
BB_HD int16_t split_master_lo(uint32_t bits, uint16_t hi) {
  return static_cast<int16_t>(static_cast<uint16_t>(bits - (static_cast<uint32_t>(hi) << 16)));
}
BB_HD uint32_t split_master_bits(uint16_t hi, int16_t lo) {
  return (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo));
}

}  // namespace bb

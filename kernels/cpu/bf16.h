// bfloat16 as the CPU library stores it (its 16 bits in a uint16_t): widened to float32 exactly as read, and
// float32 rounded to it as torch's bfloat16 ops store (nearest even, c10's round_to_nearest_even; NaN stays
// NaN). matvec.cpp and rows.cpp compute in float32 over widened values and round where torch rounds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixserve_cpu_bf16 {

// A bfloat16 value's float32: its 16 bits are the float's upper half.
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// f as bfloat16, rounded to nearest even.
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// A stored element as float32: itself, or a bfloat16's bits widened (exact).
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }

// The value a store of T keeps: f itself for float, f rounded to bfloat16 for uint16_t.
template <typename T>
inline float keep(float f) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return bf16_to_float(to_bf16(f));
  } else {
    return f;
  }
}

inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = to_bf16(v); }

}  // namespace radixserve_cpu_bf16

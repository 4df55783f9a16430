#pragma once
// Storage element types and their conversions, written once for the host and the device.
// Float16 and bfloat16 are stored as raw 16-bit patterns so that host code needs no CUDA
// headers; conversions round to nearest even, like the hardware does.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "qevict/core/platform.hpp"

namespace qevict {

enum class element_type : std::uint8_t { f32, f16, bf16 };

QEVICT_HOST_DEVICE constexpr std::size_t element_bytes(element_type e) {
  return e == element_type::f32 ? 4u : 2u;
}

inline const char* to_string(element_type e) {
  switch (e) {
    case element_type::f32: return "f32";
    case element_type::f16: return "f16";
    case element_type::bf16: return "bf16";
  }
  return "?";
}

namespace numeric {

QEVICT_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
QEVICT_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

QEVICT_HOST_DEVICE std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
QEVICT_HOST_DEVICE float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t{h} << 16); }

QEVICT_HOST_DEVICE float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal half: value = mant * 2^-24, exact in float.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

QEVICT_HOST_DEVICE std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): round abs/2^-24 to nearest even.
    const float scaled = bits_float(abs) * 16777216.0f;  // exact: power-of-two scaling
    std::uint32_t m = static_cast<std::uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t r = abs - 0x38000000u;  // re-bias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

/// Read element `i` of a buffer stored as `e`.
QEVICT_HOST_DEVICE float load(element_type e, const void* base, std::size_t i) {
  switch (e) {
    case element_type::f32: return static_cast<const float*>(base)[i];
    case element_type::f16: return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  }
}

/// Write element `i` of a buffer stored as `e` (round to nearest even).
QEVICT_HOST_DEVICE void store(element_type e, void* base, std::size_t i, float v) {
  switch (e) {
    case element_type::f32: static_cast<float*>(base)[i] = v; break;
    case element_type::f16: static_cast<std::uint16_t*>(base)[i] = float_to_f16(v); break;
    default: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v); break;
  }
}

QEVICT_HOST_DEVICE bool is_finite(float v) { return (float_bits(v) & 0x7f800000u) != 0x7f800000u; }

/// The largest finite float.
inline constexpr float largest_float = 3.40282347e+38f;

/// Whether x is a number of magnitude at most `limit` (a finite limit >= 0): false for NaN, and
/// with `largest_float` as the limit, whether x is finite. One integer comparison: for such limits,
/// |x| <= limit exactly where the bits of |x| (the sign cleared) are at most the limit's, and the
/// bits of an infinity or a NaN exceed those of every finite float.
QEVICT_HOST_DEVICE bool within(float x, float limit) { return (float_bits(x) & 0x7fffffffu) <= float_bits(limit); }

/// The inputs the cache checks element by element (the order of the CUDA backend's error record).
enum class input : int { query, key, value };

/// The argument name of an input in the cache's calls and errors: "q", "k" or "v".
QEVICT_HOST_DEVICE constexpr const char* to_string(input x) {
  return x == input::query ? "q" : x == input::key ? "k" : "v";
}

/// The largest magnitude of an element of each input that the cache accepts, whatever its element
/// type, on both backends: 2^17 for queries, 2^14 for keys and values. Finite is not enough. An
/// input near float's or the element type's limit would overflow where the cache stores or rotates
/// it, and the CUDA decode kernel takes some of its tensor-core operands in fp16 (every 16-bit
/// operand of an f16 cache; the query and the keys of INT2 records stored after RoPE or
/// window-relative, whatever the element type), which is exact only within fp16's ±65504. At these
/// limits:
///   - a key rotated by RoPE is at most √2 · 2^14 = 23171 (stored, and as an fp16 operand);
///   - an INT2 key record of a channel spanning ±23171 has the zero −23296 and the scale 15552
///     (stored as bf16, the zero rounded down and the scale up), and the kernel's fp16 operand of
///     4 × scale is at most 62208;
///   - a query scaled by log2(e)/√64 (head_dim 64, the largest factor of the CUDA kernels) and
///     rotated is at most 1.4427 / 8 · √2 · 2^17 = 33428;
///   - a score is at most head_dim · √2 · 2^17 · √2 · 2^14 = 2^41 at head_dim 512, and a
///     quantizer's range at most 46341, far from float's limit.
QEVICT_HOST_DEVICE constexpr float largest_magnitude(input x) { return x == input::query ? 131072.0f : 16384.0f; }

/// The largest weight a value-weighted scorer may give one token per unit of probability,
/// ‖W_o^(h) v‖ (cache::set_output_projection): 2^64. A window's score adds at most one such weight
/// a decode step (a query head's probabilities sum to 1, and a unit averages its query heads) and
/// at most one per observation query at prefill, over fewer than 2^31 tokens each, so it stays
/// below 2^96, far within float's 2^128.
inline constexpr double largest_token_weight = 18446744073709551616.0;  // 2^64

/// What is wrong with a float that is NaN or infinite: "is NaN" or "is infinite".
inline std::string non_finite_problem(float x) { return x != x ? "is NaN" : "is infinite"; }

/// What is wrong with an element x of input `in` that fails within(x, largest_magnitude(in)), in
/// the words of both backends' errors: "is NaN", "is infinite" or "= x is beyond ±limit, ...".
inline std::string input_problem(float x, input in) {
  if (!is_finite(x)) return non_finite_problem(x);
  char text[128];
  std::snprintf(text, sizeof text, "= %g is beyond ±%g, the largest magnitude the cache accepts in %s",
                static_cast<double>(x), static_cast<double>(largest_magnitude(in)),
                in == input::query ? "a query" : "a key or value");
  return text;
}

}  // namespace numeric
}  // namespace qevict

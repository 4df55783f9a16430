// bf16 and f16 element storage: conversions against hand-computed bit patterns (round to nearest
// even, subnormals, overflow to infinity, NaN and infinity), a round trip through the cache's
// element storage, and the input limits against the fp16 operands they keep in range.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <qevict/core/numeric.hpp>
#include <qevict/policies/quantizers.hpp>

using namespace qevict::numeric;

namespace {
constexpr float inf = std::numeric_limits<float>::infinity();
const float nan_value = std::numeric_limits<float>::quiet_NaN();
}  // namespace

TEST_CASE("bf16: hand values") {
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(-2.5f) == 0xC020);
  CHECK(float_to_bf16(0.0f) == 0x0000);
  CHECK(float_to_bf16(-0.0f) == 0x8000);
  CHECK(float_to_bf16(65504.0f) == 0x4780);  // 65504 = 0x477FE000: the mantissa rounds up to 2^16
  CHECK(bf16_to_float(0x4780) == 65536.0f);
  CHECK(bf16_to_float(0x3F80) == 1.0f);
  CHECK(bf16_to_float(0xC020) == -2.5f);
  // Round to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even).
  CHECK(float_to_bf16(1.0f + 0x1p-8f) == 0x3F80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 -> 1 + 2^-6 (0x3F82).
  CHECK(float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3F82);
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3F81);  // above halfway rounds up
  // Subnormals keep their top bits: 2^-130 = 0x00080000 in float -> 0x0008.
  CHECK(float_to_bf16(0x1p-130f) == 0x0008);
  CHECK(bf16_to_float(0x0001) == 0x1p-133f);
  // Overflow, infinity and NaN.
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);
  CHECK(float_to_bf16(inf) == 0x7F80);
  CHECK(float_to_bf16(-inf) == 0xFF80);
  const std::uint16_t n = float_to_bf16(nan_value);
  CHECK((n & 0x7F80) == 0x7F80);
  CHECK((n & 0x007F) != 0);  // still a NaN, never infinity
  CHECK(std::isnan(bf16_to_float(n)));
  // A NaN whose payload sits only in the low 16 bits must not become infinity.
  CHECK(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));
}

TEST_CASE("f16: hand values") {
  CHECK(float_to_f16(1.0f) == 0x3C00);
  CHECK(float_to_f16(-2.5f) == 0xC100);
  CHECK(float_to_f16(65504.0f) == 0x7BFF);  // the largest finite half
  CHECK(f16_to_float(0x7BFF) == 65504.0f);
  CHECK(float_to_f16(65519.0f) == 0x7BFF);  // below the halfway point 65520
  CHECK(float_to_f16(65520.0f) == 0x7C00);  // halfway, ties to even: infinity
  CHECK(float_to_f16(1e6f) == 0x7C00);
  CHECK(float_to_f16(-1e6f) == 0xFC00);
  CHECK(float_to_f16(inf) == 0x7C00);
  CHECK(f16_to_float(0xFC00) == -inf);
  CHECK(std::isnan(f16_to_float(float_to_f16(nan_value))));
  CHECK(float_to_f16(0.0f) == 0x0000);
  CHECK(float_to_f16(-0.0f) == 0x8000);
  // Normal rounding: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> 1 (even).
  CHECK(float_to_f16(1.0f + 0x1p-11f) == 0x3C00);
  CHECK(float_to_f16(1.0f + 3 * 0x1p-11f) == 0x3C02);
  // Smallest normal 2^-14 and subnormals k * 2^-24.
  CHECK(float_to_f16(0x1p-14f) == 0x0400);
  CHECK(f16_to_float(0x0400) == 0x1p-14f);
  CHECK(float_to_f16(0x1p-24f) == 0x0001);
  CHECK(f16_to_float(0x0001) == 0x1p-24f);
  CHECK(f16_to_float(0x03FF) == 1023 * 0x1p-24f);
  CHECK(f16_to_float(0x8001) == -0x1p-24f);
  CHECK(float_to_f16(3 * 0x1p-25f) == 0x0002);  // 1.5 * 2^-24: tie, to even (2)
  CHECK(float_to_f16(0x1p-25f) == 0x0000);      // 0.5 * 2^-24: tie, to even (0)
  CHECK(float_to_f16(0x1p-25f + 0x1p-35f) == 0x0001);
  CHECK(float_to_f16(1023.5f * 0x1p-24f) == 0x0400);  // rounds up into the smallest normal
  CHECK(float_to_f16(-5 * 0x1p-24f) == 0x8005);
  // Every half value survives a round trip through float.
  int mismatches = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const std::uint16_t b = static_cast<std::uint16_t>(h);
    if ((b & 0x7C00) == 0x7C00 && (b & 0x03FF)) continue;  // NaNs: payloads may change
    mismatches += float_to_f16(f16_to_float(b)) != b;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("load/store by element type, and is_finite") {
  std::uint16_t h[2] = {};
  float f[1] = {};
  store(qevict::element_type::f16, h, 1, -2.5f);
  CHECK(h[1] == 0xC100);
  CHECK(load(qevict::element_type::f16, h, 1) == -2.5f);
  store(qevict::element_type::bf16, h, 0, 1.0f);
  CHECK(h[0] == 0x3F80);
  CHECK(load(qevict::element_type::bf16, h, 0) == 1.0f);
  store(qevict::element_type::f32, f, 0, 0.1f);
  CHECK(load(qevict::element_type::f32, f, 0) == 0.1f);
  CHECK(qevict::element_bytes(qevict::element_type::f32) == 4);
  CHECK(qevict::element_bytes(qevict::element_type::bf16) == 2);
  CHECK(is_finite(1.0f));
  CHECK(is_finite(std::numeric_limits<float>::max()));
  CHECK(is_finite(std::numeric_limits<float>::denorm_min()));
  CHECK(!is_finite(inf));
  CHECK(!is_finite(-inf));
  CHECK(!is_finite(nan_value));
}

TEST_CASE("input limits: within, and the largest magnitude of each input") {
  // within: one comparison of |x|'s bits with the limit's, against the plain comparisons.
  const float next_above_limit = std::nextafter(2.0f, 3.0f);
  for (float x :
       {0.0f, -0.0f, 1.0f, -1.5f, 2.0f, -2.0f, next_above_limit, -next_above_limit, 1e-45f, -1e-45f, 1e30f, -1e30f,
        std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), inf, -inf, nan_value, -nan_value}) {
    CAPTURE(x);
    for (float limit : {0.0f, 2.0f, 16384.0f, largest_float})
      CHECK(within(x, limit) == (x == x && std::fabs(x) <= limit));
  }
  CHECK(within(std::numeric_limits<float>::max(), largest_float));  // largest_float as the limit: finite
  CHECK(!within(-inf, largest_float));
  CHECK(largest_magnitude(input::query) == 131072.0f);
  CHECK(largest_magnitude(input::key) == 16384.0f);
  CHECK(largest_magnitude(input::value) == 16384.0f);
  CHECK(std::string(to_string(input::query)) == "q");
  CHECK(std::string(to_string(input::value)) == "v");

  // The fp16 operands of the CUDA decode kernel at these limits (numeric.hpp gives the figures).
  constexpr float fp16_max = 65504.0f;
  const auto fits_fp16 = [&](float x) { return std::fabs(f16_to_float(float_to_f16(x))) <= fp16_max; };
  const float kv = largest_magnitude(input::key), q = largest_magnitude(input::query);
  // A key pair (kv, kv) rotated by 45 degrees: one member sqrt(2) * kv, stored in any element type.
  const float rotated = static_cast<float>(std::sqrt(2.0) * kv);
  CHECK(fits_fp16(rotated));
  CHECK(std::isfinite(bf16_to_float(float_to_bf16(rotated))));
  // The INT2 record of a channel spanning +-rotated, as the quantizer stores it (bf16 scale and
  // zero): the zero, and the kernel's operand of 4 x scale, fit fp16.
  std::uint16_t scale = 0, zero = 0;
  qevict::quantizers::asymmetric<2>::choose_scale_zero(-rotated, rotated, scale, zero);
  CHECK(bf16_to_float(zero) == -23296.0f);
  CHECK(bf16_to_float(scale) == 15552.0f);
  CHECK(fits_fp16(4 * bf16_to_float(scale)));
  CHECK(fits_fp16(bf16_to_float(zero)));
  // An INT2 value scale rides on a probability of at most 1: the scale of +-kv fits fp16.
  qevict::quantizers::asymmetric<2>::choose_scale_zero(-kv, kv, scale, zero);
  CHECK(fits_fp16(bf16_to_float(scale)));
  // The query scaled by log2(e)/sqrt(head_dim) and rotated, at head_dim 64 and 128 (the CUDA
  // kernels' head sizes): its largest member fits fp16.
  for (int d : {64, 128}) {
    const double scaled = 1.4426950408889634 / std::sqrt(static_cast<double>(d)) * std::sqrt(2.0) * q;
    CAPTURE(d);
    CHECK(fits_fp16(static_cast<float>(scaled)));
  }
  // A score at head_dim 512 (the largest) with every channel at the limits, rotated: finite.
  CHECK(std::isfinite(512.0f * (std::sqrt(2.0f) * q) * rotated));

  CHECK(input_problem(nan_value, input::key) == "is NaN");
  CHECK(input_problem(-inf, input::query) == "is infinite");
  CHECK(input_problem(70000.0f, input::value) ==
        "= 70000 is beyond ±16384, the largest magnitude the cache accepts in a key or value");
  CHECK(input_problem(-2e5f, input::query) ==
        "= -200000 is beyond ±131072, the largest magnitude the cache accepts in a query");
  CHECK(non_finite_problem(inf) == "is infinite");
}

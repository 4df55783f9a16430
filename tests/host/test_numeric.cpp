// bf16 and f16 element storage: conversions against hand-computed bit patterns (round to nearest
// even, subnormals, overflow to infinity, NaN and infinity), and a round trip through the cache's
// element storage.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include <qevict/core/numeric.hpp>

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

TEST_CASE("input limits: within, and the largest key or value magnitude of each element type") {
  using qevict::element_type;
  const float inf = std::numeric_limits<float>::infinity(), nan_value = std::numeric_limits<float>::quiet_NaN();
  CHECK(within(2.0f, 2.0f));
  CHECK(within(-2.0f, 2.0f));
  CHECK(!within(2.5f, 2.0f));
  CHECK(!within(nan_value, 2.0f));
  CHECK(within(std::numeric_limits<float>::max(), largest_float));  // largest_float as the limit: finite
  CHECK(!within(-inf, largest_float));
  // At each type's limit, a key pair rotated to its largest (both members at the limit, rotated by
  // 45 degrees: √2 times one) and a quantizer's range (max − min, in float) stay finite where they
  // are stored.
  for (element_type e : {element_type::f16, element_type::bf16, element_type::f32}) {
    CAPTURE(qevict::to_string(e));
    const float limit = largest_kv_magnitude(e);
    const float rotated = static_cast<float>(std::sqrt(2.0) * limit);
    const float range = limit - (-limit);
    CHECK(std::isfinite(range));
    CHECK(std::isfinite(rotated - (-rotated)));
    if (e == element_type::f16) {
      CHECK(f16_to_float(float_to_f16(rotated)) <= 65504.0f);
      CHECK(f16_to_float(float_to_f16(range / 3)) <= 65504.0f);  // an INT2 scale stored as f16
    } else {
      CHECK(is_finite(bf16_to_float(float_to_bf16(rotated))));
    }
  }
  CHECK(input_problem(nan_value, 1.0f, element_type::bf16) == "is NaN");
  CHECK(input_problem(-inf, 1.0f, element_type::bf16) == "is infinite");
  CHECK(input_problem(70000.0f, 32752.0f, element_type::f16) ==
        "= 70000 is beyond ±32752, the largest magnitude of a key or value that a cache of f16 elements accepts");
}

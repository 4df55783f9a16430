// The asymmetric quantizer: record sizes, bit packing, the grouping (keys per channel, values per
// token) and the round-trip bound |x - x̂| <= scale/2 for 2, 4 and 8 bits with bf16 and f32
// metadata. Records are decoded independently (support/reference.hpp) from the documented layout.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <qevict/policies/quantizers.hpp>

#include "support/reference.hpp"

using namespace qevict;
using qevict_test::decode_record;

TEST_CASE("record_layout: sizes by hand") {
  CHECK(quantizers::asymmetric<2>::layout(8, 1, 128).window_bytes() == 256 + 512 + 256 + 32);
  CHECK(quantizers::asymmetric<4>::layout(8, 1, 128).window_bytes() == 512 + 512 + 512 + 32);
  CHECK(quantizers::asymmetric<8>::layout(8, 1, 128).window_bytes() == 1024 + 512 + 1024 + 32);
  CHECK(quantizers::asymmetric<2, meta::f32>::layout(8, 1, 128).window_bytes() == 256 + 1024 + 256 + 64);
  CHECK(quantizers::asymmetric<2>::layout(8, 8, 128).window_bytes() == 8 * 1056);
  // W = 1, head_dim 8: 2 bytes of codes padded to 4.
  const auto tiny = quantizers::asymmetric<2>::layout(1, 3, 8);
  CHECK(tiny.code_section() == 4);
  CHECK(tiny.head_bytes() == 4 + 32 + 4 + 4);
  CHECK(tiny.window_bytes() == 3 * 44);
  CHECK(tiny.code_bytes() == 3 * 8);
  CHECK(tiny.metadata_bytes() == 3 * 36);
  CHECK(quantizers::asymmetric<2, meta::f32>::layout(1, 1, 8).window_bytes() == 4 + 64 + 4 + 8);
  // Offsets inside one head.
  const auto L = quantizers::asymmetric<4>::layout(8, 2, 16);
  CHECK(L.key_scale_offset() == 64);
  CHECK(L.key_zero_offset() == 96);
  CHECK(L.value_codes_offset() == 128);
  CHECK(L.value_scale_offset() == 192);
  CHECK(L.value_zero_offset() == 208);
  CHECK(L.head_bytes() == 224);
}

TEST_CASE("bit packing by hand: INT2, 4 tokens, head_dim 8, f32 metadata") {
  using Q = quantizers::asymmetric<2, meta::f32>;
  const auto L = Q::layout(4, 1, 8);
  std::vector<float> keys(32), values(32);
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 8; ++c) {
      keys[t * 8 + c] = static_cast<float>(t);      // channel range [0, 3]: zero 0, scale 1, code t
      values[t * 8 + c] = static_cast<float>(c % 4);  // token range [0, 3]: zero 0, scale 1, code c%4
    }
  std::vector<std::uint8_t> rec(L.window_bytes(), 0xEE);
  Q::quantize(L, keys.data(), values.data(), rec.data());
  // Key code e = t*8 + c at byte e/4, bits 2*(e%4): token t fills bytes 2t, 2t+1 with t,t,t,t.
  const std::uint8_t expected_keys[8] = {0x00, 0x00, 0x55, 0x55, 0xAA, 0xAA, 0xFF, 0xFF};
  CHECK(std::memcmp(rec.data(), expected_keys, 8) == 0);
  for (int c = 0; c < 8; ++c) {
    float s, z;
    std::memcpy(&s, rec.data() + 8 + 4 * c, 4);
    std::memcpy(&z, rec.data() + 40 + 4 * c, 4);
    CHECK(s == 1.0f);
    CHECK(z == 0.0f);
  }
  // Value codes c%4 = 0,1,2,3,0,1,2,3 -> bytes 0b11100100 = 0xE4, twice per token.
  for (int i = 0; i < 8; ++i) CHECK(rec[72 + i] == 0xE4);
}

TEST_CASE("value code order by hand: 16-bit element e of a piece holds channels e, e+8, ...") {
  // INT2, one token, head_dim 72: one whole piece of 64 channels, then 8 channels in order.
  using Q = quantizers::asymmetric<2, meta::f32>;
  const auto L = Q::layout(1, 1, 72);
  CHECK(L.value_piece_channels() == 64);
  std::vector<float> keys(72, 0.0f), values(72);
  // Channel c = e + 8f of the piece gets code (3f + e) % 4 (token range [0, 3]: zero 0, scale 1);
  // the tail channels 64 + i get i % 4.
  for (int c = 0; c < 64; ++c) values[c] = static_cast<float>((3 * (c / 8) + c % 8) % 4);
  for (int i = 0; i < 8; ++i) values[64 + i] = static_cast<float>(i % 4);
  std::vector<std::uint8_t> rec(L.window_bytes(), 0xEE);
  Q::quantize(L, keys.data(), values.data(), rec.data());
  // Byte 2e + k holds fields 4k..4k+3 of element e: codes (3m + e) % 4 for m = 0..3.
  //   e % 4 = 0: 0,3,2,1 -> 0x6C   1: 1,0,3,2 -> 0xB1   2: 2,1,0,3 -> 0xC6   3: 3,2,1,0 -> 0x1B
  const std::uint8_t expected[18] = {0x6C, 0x6C, 0xB1, 0xB1, 0xC6, 0xC6, 0x1B, 0x1B, 0x6C,
                                     0x6C, 0xB1, 0xB1, 0xC6, 0xC6, 0x1B, 0x1B, 0xE4, 0xE4};
  const std::uint8_t* codes = rec.data() + L.value_codes_offset();
  for (int i = 0; i < 18; ++i) {
    CAPTURE(i);
    CHECK(codes[i] == expected[i]);
  }
  for (int c = 0; c < 72; ++c) {
    CAPTURE(c);
    CHECK(L.value_channel(L.value_slot(c)) == c);
  }
  CHECK(L.value_slot(1) == 8);   // element 1, field 0
  CHECK(L.value_slot(8) == 1);   // element 0, field 1
  CHECK(L.value_slot(63) == 63);
  CHECK(L.value_slot(66) == 66);  // past the last whole piece
  std::vector<float> back(72);
  Q::dequantize_value(L, rec.data(), 0, 0, back.data());
  for (int c = 0; c < 72; ++c) CHECK(back[c] == values[c]);
}

TEST_CASE("value code order by hand: INT4, 32 channels a piece") {
  using Q = quantizers::asymmetric<4, meta::f32>;
  const auto L = Q::layout(1, 1, 32);
  CHECK(L.value_piece_channels() == 32);
  std::vector<float> keys(32, 0.0f), values(32);
  // Channel c = e + 8f (f = 0..3) gets code f + 4 (e % 4): range [0, 15], zero 0, scale 1.
  for (int c = 0; c < 32; ++c) values[c] = static_cast<float>(c / 8 + 4 * (c % 8 % 4));
  std::vector<std::uint8_t> rec(L.window_bytes(), 0xEE);
  Q::quantize(L, keys.data(), values.data(), rec.data());
  // Element e = bytes 2e (fields 0, 1) and 2e + 1 (fields 2, 3), low nibble first.
  const std::uint8_t expected[16] = {0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,
                                     0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE};
  const std::uint8_t* codes = rec.data() + L.value_codes_offset();
  for (int i = 0; i < 16; ++i) {
    CAPTURE(i);
    CHECK(codes[i] == expected[i]);
  }
}

namespace {

template <class Q>
void check_round_trip(int tokens, int heads, int d, std::uint64_t seed) {
  constexpr bool f32_meta = std::is_same_v<typename Q::meta_type, meta::f32>;
  CAPTURE(Q::bits);
  CAPTURE(f32_meta);
  CAPTURE(tokens);
  CAPTURE(d);
  const auto L = Q::layout(tokens, heads, d);
  qevict_test::rng r(seed);
  const std::size_t n = static_cast<std::size_t>(tokens) * heads * d;
  std::vector<float> keys(n), values(n);
  for (std::size_t i = 0; i < n; ++i) {
    // Mix magnitudes and offsets, as real keys (outlier channels) and values do.
    keys[i] = r.normal(1.0f) * (i % 5 == 0 ? 20.0f : 1.0f) + (i % 3 == 0 ? 3.0f : 0.0f);
    values[i] = r.normal(0.5f);
  }
  std::vector<std::uint8_t> rec(L.window_bytes());
  Q::quantize(L, keys.data(), values.data(), rec.data());
  const auto w = decode_record(rec, tokens, heads, d, Q::bits, f32_meta);
  std::vector<float> kq(static_cast<std::size_t>(d)), vq(static_cast<std::size_t>(d));
  int failures = 0;
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < tokens; ++t) {
      Q::dequantize_key(L, rec.data(), h, t, kq.data());
      Q::dequantize_value(L, rec.data(), h, t, vq.data());
      for (int c = 0; c < d; ++c) {
        const std::size_t i = (static_cast<std::size_t>(t) * heads + h) * d + c;
        // The library's dequantization is exactly the documented layout.
        failures += kq[c] != w.keys[i];
        failures += vq[c] != w.values[i];
        const float ks = w.key_scale[h * d + c], vs = w.value_scale[h * tokens + t];
        failures += !(ks >= 0.0f && vs >= 0.0f);
        // Float slack: a few ulps of the numbers involved.
        const double kslack = 4e-7 * (std::abs(keys[i]) + ks * Q::max_code) + 1e-30;
        const double vslack = 4e-7 * (std::abs(values[i]) + vs * Q::max_code) + 1e-30;
        failures += std::abs(static_cast<double>(keys[i]) - kq[c]) > ks / 2.0 + kslack;
        failures += std::abs(static_cast<double>(values[i]) - vq[c]) > vs / 2.0 + vslack;
      }
    }
  CHECK(failures == 0);
}

}  // namespace

TEST_CASE("round trip within scale/2 for 2, 4 and 8 bits, bf16 and f32 metadata") {
  std::uint64_t seed = 1;
  for (int tokens : {1, 8, 32})
    for (int d : {8, 64}) {
      check_round_trip<quantizers::asymmetric<2>>(tokens, 2, d, seed++);
      check_round_trip<quantizers::asymmetric<4>>(tokens, 2, d, seed++);
      check_round_trip<quantizers::asymmetric<8>>(tokens, 2, d, seed++);
      check_round_trip<quantizers::asymmetric<2, meta::f32>>(tokens, 2, d, seed++);
      check_round_trip<quantizers::asymmetric<4, meta::f32>>(tokens, 2, d, seed++);
      check_round_trip<quantizers::asymmetric<8, meta::f32>>(tokens, 2, d, seed++);
    }
}

TEST_CASE("the scale shrinks with more bits, and a constant group is reproduced exactly when representable") {
  qevict_test::rng r(5);
  std::vector<float> keys = r.normals(8 * 16), values = r.normals(8 * 16);
  auto worst = [&](auto q) {
    using Q = decltype(q);
    const auto L = Q::layout(8, 1, 16);
    std::vector<std::uint8_t> rec(L.window_bytes());
    Q::quantize(L, keys.data(), values.data(), rec.data());
    const auto w = decode_record(rec, 8, 1, 16, Q::bits, false);
    double e = 0.0;
    for (std::size_t i = 0; i < keys.size(); ++i)
      e = std::max({e, std::abs(static_cast<double>(keys[i]) - w.keys[i]), std::abs(static_cast<double>(values[i]) - w.values[i])});
    return e;
  };
  const double e2 = worst(quantizers::asymmetric<2>{}), e4 = worst(quantizers::asymmetric<4>{}), e8 = worst(quantizers::asymmetric<8>{});
  CHECK(e4 < e2);
  CHECK(e8 < e4);
  CHECK(e8 < 0.05);

  using Q = quantizers::asymmetric<2>;
  const auto L = Q::layout(4, 1, 8);
  std::vector<float> k(32, 1.5f), v(32, -0.25f);
  std::vector<std::uint8_t> rec(L.window_bytes());
  Q::quantize(L, k.data(), v.data(), rec.data());
  const auto w = decode_record(rec, 4, 1, 8, 2, false);
  for (std::size_t i = 0; i < 32; ++i) {
    CHECK(w.keys[i] == 1.5f);
    CHECK(w.values[i] == -0.25f);
  }
}

TEST_CASE("grouping: keys per channel across tokens, values per token across channels") {
  // One channel of the keys spans [-1000, 1000]; every other channel stays within +-0.01. With
  // per-channel key groups the quiet channels keep errors of ~0.01/3; a per-token grouping would
  // give them errors of hundreds.
  using Q = quantizers::asymmetric<2>;
  const int T = 8, d = 16;
  const auto L = Q::layout(T, 1, d);
  qevict_test::rng r(9);
  std::vector<float> keys(T * d), values(T * d);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      keys[t * d + c] = c == 0 ? (t % 2 ? 1000.0f : -1000.0f) : r.uniform(-0.01f, 0.01f);
      values[t * d + c] = t == 0 ? (c % 2 ? 1000.0f : -1000.0f) : r.uniform(-0.01f, 0.01f);
    }
  std::vector<std::uint8_t> rec(L.window_bytes());
  Q::quantize(L, keys.data(), values.data(), rec.data());
  const auto w = decode_record(rec, T, 1, d, 2, false);
  double quiet_key = 0.0, quiet_value = 0.0;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      const int i = t * d + c;
      if (c != 0) quiet_key = std::max(quiet_key, std::abs(static_cast<double>(keys[i]) - w.keys[i]));
      if (t != 0) quiet_value = std::max(quiet_value, std::abs(static_cast<double>(values[i]) - w.values[i]));
    }
  CHECK(quiet_key < 0.005);
  CHECK(quiet_value < 0.005);
  // The loud channel sits at its group's ends: only the bf16 rounding of its scale shows (< 1%).
  for (int t = 0; t < T; ++t) CHECK(std::abs(w.keys[t * d] - keys[t * d]) <= 10.0f);
  CHECK(w.key_scale[0] > 600.0f);   // one scale per channel: only channel 0 is loud
  CHECK(w.key_scale[1] < 0.01f);
  CHECK(w.value_scale[0] > 600.0f);  // one scale per token: only token 0 is loud
  CHECK(w.value_scale[1] < 0.01f);
}

// <qevict/core/records.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/records.hpp>

#include <cstdint>
#include <vector>

#include <qevict/policies/rope.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/records.hpp stands alone: qevict::dequantize_window") {
  // A 2-token, 1-head, 2-channel record whose groups span no range reads back exactly.
  using Q = qevict::quantizers::asymmetric<2, qevict::meta::f32>;
  const qevict::quantizers::record_layout layout = Q::layout(2, 1, 2);
  const std::vector<float> k{1.0f, -2.0f, 1.0f, -2.0f}, v{0.5f, 0.5f, 3.0f, 3.0f};
  std::vector<std::uint8_t> record(layout.window_bytes());
  Q::quantize(layout, k.data(), v.data(), record.data());
  const double inv_freq[1] = {0.0};
  std::vector<float> k_post(4), v_out(4);
  qevict::dequantize_window<Q, qevict::rope::none>(layout, record.data(), qevict::rope_layout::rotate_half, inv_freq, 0,
                                                  k_post.data(), v_out.data());
  CHECK(k_post == k);
  CHECK(v_out == v);
}

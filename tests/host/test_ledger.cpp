// Migration-stable quantization (Algorithm 1, lines 9-18): a window is quantized once, on its
// first demotion; 100 promote/demote cycles later its ledger record is bit-identical, and what
// attention reads back is RoPE(dequantized pre-RoPE key) at the window's original positions (or,
// for the other key frames, the dequantized key rotated by the frame's read rotation) — one
// quantization round trip, never more.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <qevict/cache.hpp>

#include "support/reference.hpp"

using qevict::tier;
using namespace qevict_test;

namespace {

/// The smallest bytes-per-sequence-layer budget whose capacities satisfy `want`.
template <class Config, class Pred>
std::size_t find_budget(const qevict::geometry& g, const qevict::limits& lim, Pred want) {
  const qevict::region_plan e = qevict::make_region_plan<Config>(g, qevict::budget::everything(), lim);
  const std::size_t fixed = e.sink_bytes() + e.recent_bytes() + e.table_bytes();
  for (std::size_t hist = 0; hist < 64 * e.full_window_bytes; ++hist)
    if (want(Config::allocator::split(hist, e.full_window_bytes, e.quantized_window_bytes()))) return fixed + hist;
  FAIL("no budget gives the wanted capacities");
  return 0;
}

template <class Quantizer>
void check_cycles(qevict::rope_layout layout, qevict::element_type element, double key_tolerance) {
  using cfg = qevict::config<qevict::scorers::cumulative_mass, Quantizer, qevict::window<8, 1, 8>,
                             qevict::allocators::three_tier<40>, qevict::rope::rotary, 32>;
  CAPTURE(static_cast<int>(layout));
  CAPTURE(static_cast<int>(element));
  qevict::geometry g{.layers = 1, .q_heads = 4, .kv_heads = 2, .head_dim = 16, .element = element};
  g.rope.layout = layout;
  const qevict::limits lim{.max_batch = 1, .max_tokens = 64};
  // One Full slot and room for two ledger records: the two windows trade places every event.
  const std::size_t bytes = find_budget<cfg>(g, lim, [](qevict::capacities c) { return c.full == 1 && c.quantized >= 2; });
  qevict::cache<cfg> kv(g, qevict::budget::bytes_per_sequence_layer(bytes), lim,
                        qevict::options{.observation_window = 4, .routing = qevict::routing_mode::manual});
  REQUIRE(kv.plan().caps.full == 1);
  const long long p0 = 50;
  const qevict::sequence_id s = kv.add_sequence(p0);
  // 25 tokens: 1 sink, windows 0 and 1 aged at the prefill's routing event, window 2 recent.
  rng r(11);
  const int n = 25, row = 2 * 16;
  std::vector<float> q = r.normals(n * 4 * 16), k = r.normals(n * row), v = r.normals(n * row), out(n * 4 * 16);
  for (float& x : k) x *= 3.0f;
  kv.prefill(0, s, q, k, v, out);
  REQUIRE(kv.counts(s, 0).full == 1);
  REQUIRE(kv.counts(s, 0).quantized == 1);

  // First demotion of window 0 (window 1 is Full): this is when its record is written.
  kv.set_score(s, 0, 0, 0.0f);
  kv.set_score(s, 0, 1, 1.0f);
  kv.route();
  REQUIRE(kv.windows(s, 0)[0].where == tier::quantized);
  const auto first = kv.ledger_record(s, 0, 0);
  const std::vector<std::uint8_t> record(first.begin(), first.end());
  REQUIRE(record.size() == kv.plan().quantized_window_bytes());

  // What attention must see for window 0: the record decoded independently, keys rotated (in
  // double, own RoPE) to the original positions p0 + 1 + j.
  constexpr bool f32_meta = std::is_same_v<typename Quantizer::meta_type, qevict::meta::f32>;
  // A record keeps its keys before RoPE (the paper), after it, or relative to the window's first
  // token: attention rotates a dequantized key by the frame's read rotation (own RoPE, in double).
  using frame = typename Quantizer::key_frame;
  const long long t0 = p0 + 1;
  const decoded_window dq = decode_record(record, 8, 2, 16, Quantizer::bits, f32_meta);
  std::vector<double> expected_keys(dq.keys.begin(), dq.keys.end());
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 2; ++h) rope_rotate(rope_spec{10000.0, layout}, 16, &expected_keys[(j * 2 + h) * 16], frame::read_rotation(t0, t0 + j));
  // The original keys in the record's frame: rotated to their position, less the read rotation.
  std::vector<double> original_keys(8 * row);
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 16; ++c) original_keys[(j * 2 + h) * 16 + c] = k[(1 + j) * row + h * 16 + c];
      rope_rotate(rope_spec{10000.0, layout}, 16, &original_keys[(j * 2 + h) * 16], t0 + j - frame::read_rotation(t0, t0 + j));
    }
  // One round trip from the original keys: within half a scale per element (plus the float noise
  // of rotating the stored key to the record's frame).
  int outside = 0;
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 16; ++c) {
        const std::size_t i = (static_cast<std::size_t>(j) * 2 + h) * 16 + c;
        const double original = original_keys[i];
        const double bound = dq.key_scale[h * 16 + c] / 2.0 + key_tolerance * 8.0 + 1e-5;
        outside += std::abs(original - dq.keys[i]) > bound;
      }
  CHECK(outside == 0);

  std::vector<float> kr(8 * row), vr(8 * row), first_promoted_k, first_promoted_v;
  auto check_read_back = [&] {
    kv.read_window(s, 0, 0, kr, vr);
    double key_error = 0.0;
    for (std::size_t i = 0; i < kr.size(); ++i) key_error = std::max(key_error, std::abs(kr[i] - expected_keys[i]));
    CHECK(key_error <= key_tolerance);
    int value_mismatches = 0;
    for (std::size_t i = 0; i < vr.size(); ++i)
      value_mismatches += std::abs(static_cast<double>(vr[i]) - dq.values[i]) > key_tolerance / 8.0 * std::abs(dq.values[i]);
    CHECK(value_mismatches == 0);
  };
  check_read_back();

  for (int cycle = 0; cycle < 100; ++cycle) {
    // Promote window 0 (dequantize the ledger, re-apply RoPE), demote window 1 onto its old codes.
    kv.set_score(s, 0, 0, static_cast<float>(2 * cycle + 2));
    kv.route();
    REQUIRE(kv.windows(s, 0)[0].where == tier::full);
    REQUIRE(kv.windows(s, 0)[1].where == tier::quantized);
    const auto now = kv.ledger_record(s, 0, 0);
    CHECK(std::vector<std::uint8_t>(now.begin(), now.end()) == record);
    check_read_back();
    if (cycle == 0) {
      first_promoted_k = kr;
      first_promoted_v = vr;
    } else {
      // Bit-identical to the first promotion: no error accumulates over the cycles.
      CHECK(kr == first_promoted_k);
      CHECK(vr == first_promoted_v);
    }
    // Demote window 0 again: the codes are reused, not recomputed from the promoted copy.
    kv.set_score(s, 0, 1, static_cast<float>(2 * cycle + 3));
    kv.route();
    REQUIRE(kv.windows(s, 0)[0].where == tier::quantized);
    const auto again = kv.ledger_record(s, 0, 0);
    CHECK(std::vector<std::uint8_t>(again.begin(), again.end()) == record);
    check_read_back();
  }
  // The two windows kept their identities and scores across 200 moves.
  const auto ws = kv.windows(s, 0);
  CHECK(ws[0].first_position == p0 + 1);
  CHECK(ws[1].first_position == p0 + 9);
  CHECK(ws[0].score == 200.0f);
  CHECK(ws[1].score == 201.0f);
}

}  // namespace

TEST_CASE("100 demote/promote cycles: ledger bytes and read-back are stable (INT2, bf16 metadata)") {
  // f32 storage: the promoted copy is the rotated dequantized key, rounded to float once.
  check_cycles<qevict::quantizers::asymmetric<2>>(qevict::rope_layout::rotate_half, qevict::element_type::f32, 2e-5);
  check_cycles<qevict::quantizers::asymmetric<2>>(qevict::rope_layout::interleaved, qevict::element_type::f32, 2e-5);
}

TEST_CASE("100 demote/promote cycles: INT4 with f32 metadata, and bf16 element storage") {
  check_cycles<qevict::quantizers::asymmetric<4, qevict::meta::f32>>(qevict::rope_layout::rotate_half,
                                                                     qevict::element_type::f32, 2e-5);
  // bf16 storage rounds the promoted copy to 8 significant bits; keys here stay below ~16.
  check_cycles<qevict::quantizers::asymmetric<2>>(qevict::rope_layout::rotate_half, qevict::element_type::bf16, 0.07);
}

TEST_CASE("100 demote/promote cycles: keys quantized after RoPE are read back without rotation") {
  using post_rope = qevict::quantizers::asymmetric<2, qevict::meta::bf16, qevict::quantizers::key_frame::after_rope>;
  check_cycles<post_rope>(qevict::rope_layout::rotate_half, qevict::element_type::f32, 2e-5);
  check_cycles<post_rope>(qevict::rope_layout::interleaved, qevict::element_type::f32, 2e-5);
}

TEST_CASE("100 demote/promote cycles: window-relative keys are read back rotated by the window's start") {
  using relative = qevict::quantizers::asymmetric<2, qevict::meta::bf16, qevict::quantizers::key_frame::window_relative>;
  check_cycles<relative>(qevict::rope_layout::rotate_half, qevict::element_type::f32, 2e-5);
  check_cycles<relative>(qevict::rope_layout::interleaved, qevict::element_type::f32, 2e-5);
}

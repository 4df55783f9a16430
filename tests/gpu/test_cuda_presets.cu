// Every preset the CUDA backend supports (backend::cuda_supports), on the CUDA backend against the
// host backend (the oracle), with backend_comparison.cuh's checks: outputs, window scores, routing
// tables identical after every event, arenas byte for byte. Since the host backend's presets are
// tested for their defining behaviour (tests/presets), identical tables carry that behaviour over.
//
// The window sizes the decode kernel handles differently are all covered: W = 1 (h2o, snapkv: one
// item gathers 8 windows from their Full slots; r1: an item is 8 Full windows or one record), W = 32 (r4 with records before RoPE, kivi2 with
// records after RoPE: a window is 4 items, its record staged part by part), and W = 2, 4 and 16 in
// configurations of their own (with and without records); so are 4-bit codes (kivi4 after RoPE at W = 32, kvquant_like
// before RoPE at W = 8, and three-tier INT4 caches whose records are promoted and demoted), 8-bit
// codes (three-tier INT8 caches at W = 4, 8 and 16, before and after RoPE), and a quantized top
// tier (zipcache_like: 4-bit Full windows and 2-bit records in one attention pass; 8-bit Full
// windows over 2-bit records).
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "backend_comparison.cuh"

namespace {

using namespace qevict;
using gpu_test::case_spec;
using gpu_test::quick;
using gpu_test::run_case;

/// A budget the preset is defined for: everything for methods that never evict (and for full_kv),
/// 20% of the full cache for the others.
template <class Preset>
budget budget_for() {
  if constexpr (Preset::allocator::keeps_everything) return budget::everything();
  else if (std::string_view{Preset::name} == "full_kv") return budget::everything();
  else return budget::fraction(0.20);
}

/// head_dim 64 with one query head per KV head (bf16, rotate_half), and head_dim 128 with GQA
/// groups of 4 over two layers (fp16, interleaved); ragged prompts, a sequence replaced halfway.
std::vector<case_spec> shapes(const budget& b) {
  const int steps = quick() ? 24 : 256;
  return {{64, 1, 7, element_type::bf16, b, 900, steps, 1, rope_layout::rotate_half, true},
          {128, 4, 5, element_type::f16, b, 700, steps, 2, rope_layout::interleaved, true}};
}

/// Every shape at budget b and, in each, every config in order, each with the next seed; the
/// observer (if any) sees every routing event. Returns the seed after the last run.
template <class... Cfgs, class Observer = gpu_test::no_policy_check>
unsigned run_shapes(const budget& b, unsigned seed, Observer&& observe = {}) {
  for (const case_spec& c : shapes(b)) {
    CAPTURE(c.head_dim);
    CAPTURE(c.group);
    (run_case<Cfgs>(c, seed++, observe), ...);
  }
  return seed;
}

}  // namespace

TEST_CASE("CUDA backend: every supported preset against the host backend") {
  std::vector<std::string> ran, host_only;
  unsigned seed = 1001;
  presets::for_each([&]<class Preset>(std::string_view name) {
    using cfg = typename Preset::config_type;
    if constexpr (backend::cuda_supports<cfg>) {
      CAPTURE(name);
      run_shapes<cfg>(budget_for<Preset>(), seed);
      ran.emplace_back(name);
    } else {
      host_only.emplace_back(name);
    }
    seed += 10;
  });
  std::string ran_list, host_list;
  for (const std::string& n : ran) ran_list += " " + n;
  for (const std::string& n : host_only) host_list += " " + n;
  MESSAGE("on the CUDA backend:" << ran_list << "; host backend only:" << host_list);
  // The presets with W = 1 and W = 32 are among them (the kernel's item mapping differs for them).
  const auto has = [&](std::string_view n) {
    for (const std::string& r : ran)
      if (r == n) return true;
    return false;
  };
  CHECK(has("h2o"));
  CHECK(has("snapkv"));
  CHECK(has("r1"));  // W = 1 with records: one record per item
  CHECK(has("r4"));
  CHECK(has("kivi2"));
  // 4-bit codes, after RoPE (kivi4, W = 32) and before it (kvquant_like, W = 8).
  CHECK(has("kivi4"));
  CHECK(has("kvquant_like"));
}

TEST_CASE("CUDA backend: 4-bit records that are promoted, demoted and evicted (three tiers)") {
  using int4 = config<>::with_quantizer<quantizers::asymmetric<4>>;
  using int4_post = config<>::with_quantizer<quantizers::asymmetric<4, meta::bf16, quantizers::key_frame::after_rope>>;
  run_shapes<int4>(budget::fraction(0.20), 3001);
  run_shapes<int4_post>(budget::fraction(0.10), 3011);
}

TEST_CASE("CUDA backend: 8-bit records before and after RoPE, in windows of 4, 8 and 16 tokens, and as a quantized top tier") {
  // 8-bit codes take the 4-bit records' paths (keys dequantized in fp32) with a code a byte; in
  // bf16 a value code goes through fp32 (it does not fit below bf16's exponent). W = 16 stages a
  // window in two parts, W = 4 copies a record in 4-byte pieces (one record per item), and a top
  // tier of 8-bit records sits over 2-bit ones.
  using post = quantizers::key_frame::after_rope;
  using int8 = config<>::with_quantizer<quantizers::asymmetric<8>>;
  using int8_post16 = config<>::with_window<window<16, 5, 32>>::with_quantizer<quantizers::asymmetric<8, meta::bf16, post>>;
  using int8_four = config<>::with_window<window<4, 3, 32>>::with_quantizer<quantizers::asymmetric<8>>;
  using top8 = config<>::with_full_tier<full_tier::quantized_as<quantizers::asymmetric<8>>>;
  using top8_post = config<>::with_quantizer<quantizers::asymmetric<2, meta::bf16, post>>::with_full_tier<
      full_tier::quantized_as<quantizers::asymmetric<8, meta::bf16, post>>>;
  static_assert(backend::cuda_supports<int8> && backend::cuda_supports<int8_post16> && backend::cuda_supports<int8_four> &&
                backend::cuda_supports<top8> && backend::cuda_supports<top8_post>);
  // Records must be attended after the events (and, with the quantized top tier, Full windows too),
  // or the test would not exercise the 8-bit paths.
  long long full = 0, quantized = 0;
  const auto count = [&](auto& t, sequence_id s, int l, gpu_test::routing_event) {
    const tier_counts c = t.host.counts(s, l);
    full += c.full;
    quantized += c.quantized;
  };
  unsigned seed = run_shapes<int8, int8_post16, int8_four>(budget::fraction(0.20), 3101, count);
  MESSAGE("8-bit ledger: window-events quantized " << quantized);
  CHECK(quantized > 0);
  full = quantized = 0;
  run_shapes<top8, top8_post>(budget::fraction(0.30), seed, count);
  MESSAGE("8-bit top tier: window-events full " << full << ", quantized " << quantized);
  CHECK(full > 0);
  CHECK(quantized > 0);
}

TEST_CASE("CUDA backend: a quantized top tier (4-bit Full windows over 2-bit records, as zipcache_like)") {
  // zipcache_like with a budget between "every window at 2 bits" and "every window at 4 bits", so
  // that windows move between the tiers; three tiers whose Full windows are 4-bit records (with
  // eviction), before RoPE at W = 8 and after RoPE at W = 16; and per-KV-head selection over both.
  using zipcache = presets::zipcache_like::config_type;
  using top4 = config<>::with_full_tier<full_tier::quantized_as<quantizers::asymmetric<4>>>;
  using post = quantizers::key_frame::after_rope;
  using top4_post16 = config<>::with_window<window<16, 5, 32>>::with_quantizer<quantizers::asymmetric<2, meta::bf16, post>>::
      with_full_tier<full_tier::quantized_as<quantizers::asymmetric<4, meta::bf16, post>>>;
  using top4_per_head = top4::with_selection<selection::per_kv_head>;
  static_assert(backend::cuda_supports<zipcache> && backend::cuda_supports<top4> && backend::cuda_supports<top4_post16> &&
                backend::cuda_supports<top4_per_head>);
  // Both tiers must hold windows after the events, or the test would not exercise both record
  // widths in one attention pass, promotions (2-bit record -> 4-bit) and demotions (4 -> 2).
  long long full = 0, quantized = 0, evicted = 0;
  const auto count = [&](auto& t, sequence_id s, int l, gpu_test::routing_event) {
    const tier_counts c = t.host.counts(s, l);
    full += c.full;
    quantized += c.quantized;
    evicted += c.evicted;
  };
  unsigned seed = 6001;
  // 35 %: every window's 2-bit record plus 4-bit room for fewer windows than a lane has.
  seed = run_shapes<zipcache>(budget::fraction(0.35), seed, count);
  MESSAGE("zipcache_like: window-events full " << full << ", quantized " << quantized << ", evicted " << evicted);
  CHECK(full > 0);
  CHECK(quantized > 0);
  CHECK(evicted == 0);
  full = quantized = 0;
  run_shapes<top4, top4_post16, top4_per_head>(budget::fraction(0.20), seed, count);
  CHECK(full > 0);
  CHECK(quantized > 0);
}

TEST_CASE("CUDA backend: windows of 2, 4 and 16 tokens") {
  using two = config<>::with_window<window<2, 8, 32>>::with_allocator<allocators::two_tier>;
  using four = config<>::with_window<window<4, 3, 32>>::with_allocator<allocators::two_tier>;
  using sixteen = config<>::with_window<window<16, 5, 32>>;
  using sixteen_relative = sixteen::with_quantizer<quantizers::asymmetric<2, meta::bf16, quantizers::key_frame::window_relative>>;
  static_assert(backend::cuda_supports<two> && backend::cuda_supports<four> && backend::cuda_supports<sixteen>);
  run_shapes<two>(budget::fraction(0.20), 2001);
  run_shapes<four>(budget::fraction(0.10), 2011);
  run_shapes<sixteen>(budget::fraction(0.20), 2021);
  run_shapes<sixteen_relative>(budget::fraction(0.10), 2031);
}

TEST_CASE("CUDA backend: records of windows shorter than 8 tokens (one record per item), in every key frame") {
  // r1 (W = 1, before RoPE) runs with the presets above; here W = 2 and 4 with three tiers, records
  // after RoPE and window-relative ones at W = 1 and 2, 4-bit records at W = 4, and per-KV-head
  // selection at W = 1, whose 580-byte records leave a padded tail at head_dim 128.
  namespace keys = quantizers::key_frame;
  using two = config<>::with_window<window<2, 8, 32>>;
  using four = config<>::with_window<window<4, 3, 32>>;
  using one_post = presets::r1::config_type::with_quantizer<quantizers::asymmetric<2, meta::bf16, keys::after_rope>>;
  using two_relative = two::with_quantizer<quantizers::asymmetric<2, meta::bf16, keys::window_relative>>;
  using four_int4 = four::with_quantizer<quantizers::asymmetric<4>>;
  using one_per_head = presets::r1::config_type::with_selection<selection::per_kv_head>;
  static_assert(backend::cuda_supports<two> && backend::cuda_supports<four> && backend::cuda_supports<one_post> &&
                backend::cuda_supports<two_relative> && backend::cuda_supports<four_int4> && backend::cuda_supports<one_per_head>);
  // The records must be attended, or the test would not exercise the one-record items.
  long long quantized = 0;
  const auto count = [&](auto& t, sequence_id s, int l, gpu_test::routing_event) { quantized += t.host.counts(s, l).quantized; };
  run_shapes<two, four, one_post, two_relative, four_int4, one_per_head>(budget::fraction(0.20), 7001, count);
  MESSAGE("Quantized windows after the events: " << quantized);
  CHECK(quantized > 0);
}

TEST_CASE("CUDA backend: per-KV-head selection (each KV head ranks, stores and quantizes its own windows)") {
  // Three tiers with records before RoPE (W = 8), 4-bit records after RoPE in windows of 16, and
  // window-relative records; adakv and defensivekv above cover W = 1 without records.
  using per_head = config<>::with_selection<selection::per_kv_head>;
  using per_head_post4 = per_head::with_quantizer<quantizers::asymmetric<4, meta::bf16, quantizers::key_frame::after_rope>>::with_window<
      window<16, 5, 32>>;
  using per_head_relative = per_head::with_quantizer<quantizers::asymmetric<2, meta::bf16, quantizers::key_frame::window_relative>>;
  static_assert(backend::cuda_supports<per_head> && backend::cuda_supports<per_head_post4> &&
                backend::cuda_supports<per_head_relative>);
  // The heads must actually choose differently, or the test would not tell per-head lists from
  // one shared list: count the aged windows whose two KV heads sit in different tiers.
  int split_windows = 0;
  const auto count_splits = [&](auto& t, sequence_id s, int l, gpu_test::routing_event) {
    const auto ws = t.host.windows(s, l);
    for (std::size_t i = 0; i + 1 < ws.size(); i += 2)
      if (ws[i].where != ws[i + 1].where) ++split_windows;
  };
  run_shapes<per_head, per_head_post4, per_head_relative>(budget::fraction(0.20), 4001, count_splits);
  MESSAGE("windows whose KV heads were in different tiers after an event: " << split_windows);
  CHECK(split_windows > 0);
}

TEST_CASE("CUDA backend: a budget per layer (budget::with_layer_shares), so every layer's region has its own size") {
  // layer_defensivekv's own use (per-KV-head selection, W = 1, two tiers) and a three-tier cache
  // with records, whose Full and ledger sections then start at different offsets in each layer.
  using layer_defensive = presets::layer_defensivekv::config_type;
  using three_tier = config<>;
  const budget shares = budget::fraction(0.20).with_layer_shares({1.0, 2.0, 4.0});
  const int steps = quick() ? 24 : 128;
  const case_spec small{64, 2, 5, element_type::bf16, shares, 700, steps, 3, rope_layout::rotate_half, true};
  const case_spec large{128, 4, 3, element_type::f16, shares, 600, steps, 3, rope_layout::interleaved, false};
  run_case<layer_defensive>(small, 5001);
  run_case<layer_defensive>(large, 5002);
  run_case<three_tier>(small, 5003);
  run_case<three_tier>(large, 5004);
  // The layers really differ.
  const qevict::region_plan p0 = make_region_plan<three_tier>(
      geometry{.layers = 3, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .element = element_type::bf16}, shares, limits{.max_batch = 5, .max_tokens = 2048}, 0);
  const qevict::region_plan p2 = make_region_plan<three_tier>(
      geometry{.layers = 3, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .element = element_type::bf16}, shares, limits{.max_batch = 5, .max_tokens = 2048}, 2);
  CHECK(p0.region_bytes < p2.region_bytes);
  CHECK(p0.caps.full < p2.caps.full);
}

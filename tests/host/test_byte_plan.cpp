// Eq. 3 (tier capacities from the historical budget) and the byte plan of one (sequence, layer),
// against values computed by hand.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <qevict/cache.hpp>
#include <qevict/core/layout.hpp>
#include <qevict/policies/allocators.hpp>
#include <qevict/presets.hpp>

namespace {

using qevict::allocators::three_tier;

}  // namespace

TEST_CASE("Eq. 3: the review's worked example (section 4.5)") {
  // B_hist = 100 MB, M_f = 1 MB, M_q = 0.131 MB, q = 0.70:
  //   K_f = floor(0.30 * 100 / 1) = 30, K_q = floor(0.70 * 100 / 0.131) = floor(534.35) = 534.
  const qevict::capacities c = three_tier<70>::split(100'000'000, 1'000'000, 131'000);
  CHECK(c.full == 30);
  CHECK(c.quantized == 534);
  // 30 windows of 8 tokens in full precision, 534 * 8 = 4272 tokens in INT2.
  CHECK(c.full * 8 == 240);
  CHECK(c.quantized * 8 == 4272);
}

TEST_CASE("Eq. 3: q = 0 is two-tier, q = 1 is quantize-all, floors are exact") {
  const qevict::capacities two = qevict::allocators::two_tier::split(100'000'000, 1'000'000, 131'000);
  CHECK(two.full == 100);
  CHECK(two.quantized == 0);
  const qevict::capacities all = three_tier<100>::split(100'000'000, 1'000'000, 131'000);
  CHECK(all.full == 0);
  CHECK(all.quantized == 763);  // floor(100e6 / 131e3) = floor(763.36)
  // Exactly at a boundary: (1 - 0.5) * 2000 / 1000 = 1 exactly; one byte less floors to 0.
  CHECK(three_tier<50>::split(2000, 1000, 250).full == 1);
  CHECK(three_tier<50>::split(2000, 1000, 250).quantized == 4);
  CHECK(three_tier<50>::split(1999, 1000, 250).full == 0);
  CHECK(three_tier<50>::split(1999, 1000, 250).quantized == 3);
  // A tiny history buys nothing.
  CHECK(three_tier<70>::split(0, 4096, 1056).full == 0);
  CHECK(three_tier<70>::split(0, 4096, 1056).quantized == 0);
  // Large budgets do not overflow: 30% of 1e15 bytes in 1e6-byte windows.
  CHECK(three_tier<70>::split(1'000'000'000'000'000ull, 1'000'000, 131'000).full == 300'000'000ull);
  // The everything() budget is the smallest history with K_f >= windows.
  const std::size_t need = three_tier<70>::bytes_for_all_full(128, 32768);
  CHECK(need == 13'981'014);  // ceil(128 * 32768 / 0.30)
  CHECK(three_tier<70>::split(need, 32768, 8448).full == 128);
  CHECK(three_tier<70>::split(need - 1, 32768, 8448).full == 127);
  CHECK(qevict::allocators::two_tier::bytes_for_all_full(10, 100) == 1000);
}

TEST_CASE("record layout: INT2 with bf16 metadata, head_dim 128, W = 8 costs 1056 of 4096 bytes per head") {
  const auto L = qevict::quantizers::asymmetric<2>::layout(8, 1, 128);
  // key codes 8*128*2/8 = 256, key scale+zero 2*128*2 = 512, value codes 256, value scale+zero 2*8*2 = 32
  CHECK(L.window_bytes() == 1056);
  CHECK(L.code_bytes() == 512);
  CHECK(L.metadata_bytes() == 544);
  // The review's "0.258 of a BF16 window": 1056 / 4096.
  CHECK(static_cast<double>(L.window_bytes()) / 4096.0 == doctest::Approx(0.2578125));
}

TEST_CASE("region plan: every byte term for head_dim 128, 8 KV heads, bf16, W = 8, 5 sinks, 32 recent, Ω = 8") {
  qevict::geometry g;
  g.layers = 2;
  g.q_heads = 32;
  g.kv_heads = 8;
  g.head_dim = 128;
  g.element = qevict::element_type::bf16;
  const qevict::limits lim{.max_batch = 1, .max_tokens = 1024};
  const qevict::region_plan p =
      qevict::make_region_plan<qevict::paper_config>(g, qevict::budget::bytes_per_sequence_layer(1'000'000), lim);
  CHECK(p.token_bytes == 4096);        // 2 (K and V) * 8 heads * 128 * 2 bytes
  CHECK(p.full_window_bytes == 32768);  // M_f: 8 tokens
  CHECK(p.quantized_window_bytes() == 8 * 1056);  // M_q: 8 heads of 1056 bytes
  CHECK(p.record.code_bytes() == 8 * 512);
  CHECK(p.record.metadata_bytes() == 8 * 544);
  CHECK(p.recent_capacity == 47);      // L + W - 1 + Ω = 32 + 7 + 8
  CHECK(p.max_windows == 128);         // floor((1024 - 5 + 7) / 8)
  CHECK(p.sink_bytes() == 5 * 4096);
  CHECK(p.recent_bytes() == 47 * 4096);
  CHECK(p.table_bytes() == 128 * sizeof(qevict::window_record));
  CHECK(sizeof(qevict::window_record) == 12);
  CHECK(p.budget_bytes == 1'000'000);
  CHECK(p.hist_bytes == 785'472);  // 1e6 - 20480 - 192512 - 1536
  CHECK(p.caps.full == 7);         // floor(0.3 * 785472 / 32768) = floor(7.19)
  CHECK(p.caps.quantized == 65);   // floor(0.7 * 785472 / 8448) = floor(65.08)
  // Sections in order: table, sinks, recent ring, Full pool, ledger.
  CHECK(p.table_offset == 0);
  CHECK(p.sink_offset == 1536);
  CHECK(p.recent_offset == 22'016);
  CHECK(p.full_offset == 214'528);
  CHECK(p.ledger_offset == 443'904);
  CHECK(p.region_bytes == 993'024);
  const qevict::byte_terms r = p.reserved();
  CHECK(r.sink == 20'480);
  CHECK(r.recent == 192'512);
  CHECK(r.tables == 1'536);
  CHECK(r.full == 7 * 32768);
  CHECK(r.quantized_codes == 65 * 4096);
  CHECK(r.quantized_metadata == 65 * 4352);
  CHECK(r.total() == p.region_bytes);
  CHECK(r.total() <= p.budget_bytes);

  // A fraction of the full cache of max_tokens tokens: 0.2 * 1024 * 4096 = 838860.8 -> 838860.
  const qevict::region_plan f = qevict::make_region_plan<qevict::paper_config>(g, qevict::budget::fraction(0.2), lim);
  CHECK(f.budget_bytes == 838'860);
  CHECK(f.hist_bytes == 838'860 - 214'528);

  // everything(): the table and protected regions plus exactly enough for 128 Full windows.
  const qevict::region_plan e = qevict::make_region_plan<qevict::paper_config>(g, qevict::budget::everything(), lim);
  CHECK(e.hist_bytes == 13'981'014);
  CHECK(e.caps.full == 128);
  CHECK(e.caps.quantized == 128);  // capped at the windows that can exist

  // cache::required_bytes is one region per (slot, layer).
  CHECK(qevict::cache<qevict::paper_config>::required_bytes(g, qevict::budget::bytes_per_sequence_layer(1'000'000),
                                                            qevict::limits{.max_batch = 3, .max_tokens = 1024}) ==
        3 * 2 * 993'024);
}

TEST_CASE("region plan: W = 1, f32, INT4 with f32 metadata") {
  using cfg = qevict::config<qevict::scorers::cumulative_mass, qevict::quantizers::asymmetric<4, qevict::meta::f32>,
                             qevict::window<1, 2, 3>, qevict::allocators::three_tier<50>, qevict::rope::rotary, 4>;
  qevict::geometry g{.layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  const qevict::region_plan p = qevict::make_region_plan<cfg>(g, qevict::budget::bytes_per_sequence_layer(2000),
                                                              qevict::limits{.max_batch = 1, .max_tokens = 10});
  CHECK(p.token_bytes == 64);  // 2 * 1 * 8 * 4
  CHECK(p.full_window_bytes == 64);
  // codes round_up4(1*8*4/8 = 4) = 4 each; key scale+zero 2*8*4 = 64; value scale+zero 2*1*4 = 8
  CHECK(p.quantized_window_bytes() == 4 + 64 + 4 + 8);
  CHECK(p.recent_capacity == 3 + 1 - 1 + 4);
  CHECK(p.max_windows == 8);
  CHECK(p.hist_bytes == 2000 - 2 * 64 - 7 * 64 - 8 * 12);  // 1328
  // floor(0.5 * 1328 / 64) = 10 and floor(0.5 * 1328 / 80) = 8, both capped at the 8 windows that can exist.
  CHECK(p.caps.full == 8);
  CHECK(p.caps.quantized == 8);
  const qevict::region_plan small = qevict::make_region_plan<cfg>(g, qevict::budget::bytes_per_sequence_layer(1000),
                                                                  qevict::limits{.max_batch = 1, .max_tokens = 10});
  CHECK(small.hist_bytes == 328);
  CHECK(small.caps.full == 2);       // floor(164 / 64)
  CHECK(small.caps.quantized == 2);  // floor(164 / 80)
  CHECK(small.region_bytes == 96 + 128 + 448 + 2 * 64 + 2 * 80);
}

TEST_CASE("region plan: a region ends on 16 bytes; a W = 1 record of 580 bytes can leave a tail, counted in the tables term") {
  // r1 with one KV head per routing unit: the ledger holds records of 580 bytes (key codes 32, key
  // scales and zeros 2 * 256, value codes 32, value scale and zero 2 * 2), so K_q records end on a
  // multiple of 16 bytes only when K_q is a multiple of 4.
  using cfg = qevict::presets::r1::config_type::with_selection<qevict::selection::per_kv_head>;
  const qevict::geometry g{.layers = 1, .q_heads = 4, .kv_heads = 2, .head_dim = 128, .element = qevict::element_type::bf16};
  const qevict::limits lim{.max_batch = 1, .max_tokens = 1024};
  int padded = 0;
  for (std::size_t bytes = 1'500'000; bytes < 1'500'000 + 8 * 580; bytes += 4) {
    CAPTURE(bytes);
    const qevict::region_plan p = qevict::make_region_plan<cfg>(g, qevict::budget::bytes_per_sequence_layer(bytes), lim);
    REQUIRE(p.quantized_window_bytes() == 580);
    CHECK(p.region_bytes % 16 == 0);
    CHECK(p.region_bytes <= p.budget_bytes);
    CHECK(p.ledger_end() == p.ledger_offset + p.caps.quantized * 580);
    CHECK(p.tail_padding_bytes() == (16 - p.ledger_end() % 16) % 16);
    const qevict::byte_terms r = p.reserved();
    CHECK(r.tables == p.table_bytes() + p.tail_padding_bytes());
    CHECK(r.total() == p.region_bytes);
    // Eq. 3's K_q, or one less where its padded end would pass the budget.
    const qevict::capacities eq3 = cfg::allocator::split(p.hist_bytes, p.full_window_bytes, 580, p.table_entries());
    CHECK(p.caps.full == eq3.full);
    const std::size_t eq3_end = p.ledger_offset + eq3.quantized * 580;
    if ((eq3_end + 15) / 16 * 16 <= p.budget_bytes) {
      CHECK(p.caps.quantized == eq3.quantized);
    } else {
      CHECK(p.caps.quantized == eq3.quantized - 1);
    }
    if (p.tail_padding_bytes() != 0) ++padded;
  }
  CHECK(padded > 0);  // (otherwise the loop would test little)
  // A budget whose Eq. 3 capacities leave less room than their padding: found by Eq. 3 alone, then
  // the plan must keep one record less.
  const qevict::region_plan base = qevict::make_region_plan<cfg>(g, qevict::budget::bytes_per_sequence_layer(1'500'000), lim);
  const std::size_t fixed = base.budget_bytes - base.hist_bytes;
  std::size_t tight = 0;
  for (std::size_t bytes = 1'500'000; bytes < 3'500'000 && tight == 0; ++bytes) {
    const qevict::capacities c = cfg::allocator::split(bytes - fixed, base.full_window_bytes, 580, base.table_entries());
    const std::size_t end = fixed + c.full * base.full_window_bytes + c.quantized * 580;
    if ((end + 15) / 16 * 16 > bytes) tight = bytes;
  }
  REQUIRE(tight != 0);
  CAPTURE(tight);
  const qevict::region_plan t = qevict::make_region_plan<cfg>(g, qevict::budget::bytes_per_sequence_layer(tight), lim);
  const qevict::capacities eq3 = cfg::allocator::split(t.hist_bytes, t.full_window_bytes, 580, t.table_entries());
  CHECK(t.caps.full == eq3.full);
  CHECK(t.caps.quantized == eq3.quantized - 1);
  CHECK(t.region_bytes % 16 == 0);
  CHECK(t.region_bytes <= t.budget_bytes);
  CHECK(t.reserved().total() == t.region_bytes);
  // everything() grows by the padding instead of dropping a record.
  const qevict::region_plan e = qevict::make_region_plan<cfg>(g, qevict::budget::everything(), lim);
  CHECK(e.caps.full == e.table_entries());
  CHECK(e.region_bytes % 16 == 0);
  CHECK(e.region_bytes <= e.budget_bytes);
}

// Algorithm 1 on hand-made score histories: assign_tiers directly, and the cache driven through a
// designed sequence of routing events with set_score + route(). Every expected tier set below is
// worked out by hand from Eq. 4-5: rank by score (ties: older window first), top K_f Full; a Full
// window that still holds its ledger record takes one of the K_q ledger slots; the next candidates
// fill the remaining quantized room; the rest is evicted for good.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <set>
#include <vector>

#include <qevict/cache.hpp>
#include <qevict/core/routing.hpp>

#include "support/reference.hpp"

using qevict::tier;

namespace {

std::vector<std::int32_t> windows_in(const std::vector<qevict::routing_candidate>& c, tier t) {
  std::vector<std::int32_t> out;
  for (const auto& x : c)
    if (x.next == t) out.push_back(x.window);
  return out;
}

}  // namespace

TEST_CASE("assign_tiers: ranking, ties to the older window, ledger copies take quantized room") {
  using qevict::routing_candidate;
  SUBCASE("plain Eq. 5") {
    std::vector<routing_candidate> c = {{0, 1.0f, false}, {1, 5.0f, false}, {2, 5.0f, false},
                                        {3, 0.5f, true},  {4, 2.0f, true},  {5, 0.1f, false}};
    qevict::assign_tiers(c, qevict::capacities{2, 3});
    // Sorted: 1 (5), 2 (5, younger than 1), 4 (2), 0 (1), 3 (0.5), 5 (0.1).
    CHECK(windows_in(c, tier::full) == std::vector<std::int32_t>{1, 2});
    CHECK(windows_in(c, tier::quantized) == std::vector<std::int32_t>{4, 0, 3});
    CHECK(windows_in(c, tier::evicted) == std::vector<std::int32_t>{5});
    CHECK(c.front().window == 1);  // returned in ranking order
  }
  SUBCASE("tie-break does not depend on input order") {
    std::vector<routing_candidate> c = {{7, 2.0f, false}, {3, 2.0f, false}, {5, 2.0f, false}};
    qevict::assign_tiers(c, qevict::capacities{1, 1});
    CHECK(windows_in(c, tier::full) == std::vector<std::int32_t>{3});
    CHECK(windows_in(c, tier::quantized) == std::vector<std::int32_t>{5});
    CHECK(windows_in(c, tier::evicted) == std::vector<std::int32_t>{7});
  }
  SUBCASE("Full windows with ledger records shrink the quantized room") {
    std::vector<routing_candidate> c = {{0, 9.0f, true}, {1, 8.0f, true}, {2, 7.0f, false}, {3, 6.0f, false},
                                        {4, 5.0f, true}};
    qevict::assign_tiers(c, qevict::capacities{2, 3});
    CHECK(windows_in(c, tier::full) == std::vector<std::int32_t>{0, 1});
    CHECK(windows_in(c, tier::quantized) == std::vector<std::int32_t>{2});  // 3 - 2 ledger copies
    CHECK(windows_in(c, tier::evicted) == std::vector<std::int32_t>{3, 4});
  }
  SUBCASE("capacities larger than the pool, and zero capacities") {
    std::vector<routing_candidate> c = {{0, 1.0f, false}, {1, 2.0f, false}};
    qevict::assign_tiers(c, qevict::capacities{5, 5});
    CHECK(windows_in(c, tier::full) == std::vector<std::int32_t>{1, 0});
    std::vector<routing_candidate> z = {{0, 1.0f, false}, {1, 2.0f, true}};
    qevict::assign_tiers(z, qevict::capacities{0, 0});
    CHECK(windows_in(z, tier::evicted) == std::vector<std::int32_t>{1, 0});
    std::vector<routing_candidate> none;
    qevict::assign_tiers(none, qevict::capacities{1, 1});  // nothing to do, nothing to break
    std::vector<routing_candidate> q_only = {{0, 1.0f, false}, {1, 3.0f, false}, {2, 2.0f, false}};
    qevict::assign_tiers(q_only, qevict::capacities{0, 2});
    CHECK(windows_in(q_only, tier::quantized) == std::vector<std::int32_t>{1, 2});
    CHECK(windows_in(q_only, tier::evicted) == std::vector<std::int32_t>{0});
  }
}

namespace {

// W = 4 tokens, 2 sinks, 4 recent tokens; a long routing interval so that the recent ring holds
// everything appended between the hand-placed routing events.
using routing_config = qevict::config<qevict::scorers::cumulative_mass, qevict::quantizers::asymmetric<2>,
                                      qevict::window<4, 2, 4>, qevict::allocators::three_tier<33>, qevict::rope::rotary, 32>;
using routing_cache = qevict::cache<routing_config>;

struct scenario {
  qevict::geometry g{.layers = 2, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  // Fixed bytes: sinks 2*64 + recent (4+3+32)*64 + table 16*12 = 2816; history 800 bytes:
  // K_f = floor(0.67*800/256) = 2, K_q = floor(0.33*800/64) = 4.
  routing_cache kv{g, qevict::budget::bytes_per_sequence_layer(2816 + 800), qevict::limits{.max_batch = 2, .max_tokens = 64},
                   qevict::options{.observation_window = 4, .routing = qevict::routing_mode::manual}};
  qevict_test::rng r{7};
  qevict::sequence_id s = -1;

  void append(int n) {
    const qevict::sequence_id batch[] = {s};
    for (int i = 0; i < n; ++i)
      for (int l = 0; l < g.layers; ++l) kv.append(l, batch, r.normals(8), r.normals(8));
  }
  void set(int w, float score) {
    for (int l = 0; l < g.layers; ++l) kv.set_score(s, l, w, score);
  }
  std::set<int> in(tier t, int layer = 0) const {
    std::set<int> out;
    for (const auto& w : kv.windows(s, layer))
      if (w.where == t) out.insert(w.index);
    return out;
  }
  void expect(std::set<int> full, std::set<int> quantized, std::set<int> evicted, std::set<int> ledger) const {
    for (int l = 0; l < g.layers; ++l) {
      CAPTURE(l);
      CHECK(in(tier::full, l) == full);
      CHECK(in(tier::quantized, l) == quantized);
      CHECK(in(tier::evicted, l) == evicted);
      std::set<int> with_ledger;
      for (const auto& w : kv.windows(s, l)) {
        if (w.has_ledger) with_ledger.insert(w.index);
        // Identity: the window keeps its index and its first position wherever it lives.
        CHECK(w.first_position == 100 + 2 + 4 * w.index);
      }
      CHECK(with_ledger == ledger);
      const qevict::tier_counts c = kv.counts(s, l);
      CHECK(c.full == full.size());
      CHECK(c.quantized == quantized.size());
      CHECK(c.evicted == evicted.size());
      CHECK(c.quantized + c.ledger_copies <= kv.plan().caps.quantized);
      for (int w : ledger) CHECK(kv.ledger_record(s, l, w).size() == kv.plan().quantized_window_bytes());
    }
  }
  std::vector<std::uint8_t> record(int w, int layer = 0) const {
    auto r_ = kv.ledger_record(s, layer, w);
    return {r_.begin(), r_.end()};
  }
  float score(int w) const { return kv.windows(s, 0)[static_cast<std::size_t>(w)].score; }
};

}  // namespace

TEST_CASE("Algorithm 1 through the cache: a designed score history") {
  scenario sc;
  REQUIRE(sc.kv.plan().caps.full == 2);
  REQUIRE(sc.kv.plan().caps.quantized == 4);
  sc.s = sc.kv.add_sequence(100);
  {  // Prompt of 6 tokens: 2 sinks and window 0, still recent.
    std::vector<float> q = sc.r.normals(6 * 16), k = sc.r.normals(6 * 8), v = sc.r.normals(6 * 8), out(6 * 16);
    for (int l = 0; l < sc.g.layers; ++l) sc.kv.prefill(l, sc.s, q, k, v, out);
  }
  CHECK(sc.in(tier::recent) == std::set<int>{0});

  // E1: 18 tokens, windows 0-2 age. Scores 1, 3, 2 -> Full {1, 2}, Quantized {0} (first quantization).
  sc.append(12);
  sc.set(0, 1.0f); sc.set(1, 3.0f); sc.set(2, 2.0f);
  sc.kv.route();
  sc.expect({1, 2}, {0}, {}, {0});
  CHECK(sc.in(tier::recent) == std::set<int>{3});
  const auto record0 = sc.record(0);

  // E2: window 3 ages. Scores 10, 3, 2, 4 -> Full {0 (promoted), 3}; the ledger copy of 0 leaves
  // 3 quantized slots: Quantized {1, 2} (demoted, quantized for the first time).
  sc.append(4);
  sc.set(0, 10.0f); sc.set(3, 4.0f);
  sc.kv.route();
  sc.expect({0, 3}, {1, 2}, {}, {0, 1, 2});
  CHECK(sc.record(0) == record0);  // promotion reads the ledger, never rewrites it
  const auto record1 = sc.record(1);

  // E3: a tie, 1 and 2 both at 3: the older window 1 wins. Full {0, 1}, Quantized {2, 3}.
  sc.set(2, 3.0f); sc.set(3, 1.0f);
  sc.kv.route();
  sc.expect({0, 1}, {2, 3}, {}, {0, 1, 2, 3});
  CHECK(sc.kv.counts(sc.s, 0).ledger_copies == 2);

  // E4: windows 4, 5 age. Ranking 0 (10), 4 (5), 1 (3), 2 (3), 3 (1), 5 (0.5): Full {0, 4},
  // 1 is demoted again (reusing its codes), one ledger copy leaves room for 3 quantized:
  // {1, 2, 3}; the new window 5 is evicted without ever being quantized.
  sc.append(8);
  sc.set(4, 5.0f); sc.set(5, 0.5f);
  sc.kv.route();
  sc.expect({0, 4}, {1, 2, 3}, {5}, {0, 1, 2, 3});
  CHECK(sc.record(1) == record1);

  // E5: window 0 falls to 0 and is demoted onto its old codes.
  sc.set(0, 0.0f);
  sc.kv.route();
  sc.expect({4, 1}, {2, 3, 0}, {5}, {0, 1, 2, 3});
  CHECK(sc.record(0) == record0);

  // E6: window 6 ages at 2.9; the evicted window 5 gets a huge score and must stay evicted.
  // Ranking 4, 1, 2, 6 (2.9), 3 (0.1), 0 (0): Full {4, 1}, Quantized {2, 6, 3}, 0 is evicted.
  sc.append(4);
  sc.set(5, 100.0f); sc.set(3, 0.1f); sc.set(6, 2.9f);
  sc.kv.route();
  sc.expect({4, 1}, {2, 6, 3}, {0, 5}, {1, 2, 3, 6});

  // E7: window 7 ages last in the ranking and is evicted; window 0 (evicted) never comes back.
  sc.append(4);
  sc.set(0, 1000.0f); sc.set(7, 0.05f);
  sc.kv.route();
  sc.expect({4, 1}, {2, 6, 3}, {0, 5, 7}, {1, 2, 3, 6});

  // Identity across all those moves: each window still carries the score it was given.
  CHECK(sc.score(0) == 1000.0f);
  CHECK(sc.score(1) == 3.0f);
  CHECK(sc.score(2) == 3.0f);
  CHECK(sc.score(3) == 0.1f);
  CHECK(sc.score(4) == 5.0f);
  CHECK(sc.score(5) == 100.0f);
  CHECK(sc.score(6) == 2.9f);
  CHECK(sc.score(7) == 0.05f);
  // Evicted windows cannot be read back.
  std::vector<float> k(32), v(32);
  CHECK_THROWS_AS(sc.kv.read_window(sc.s, 0, 0, k, v), qevict::error);
  CHECK(sc.kv.ledger_record(sc.s, 0, 0).empty());
}

TEST_CASE("Algorithm 1, automatic routing: the Ω-th attend routes, by the scores it accumulated") {
  // With Ω = 32 and routing_mode::automatic, nothing moves until the 32nd attend.
  scenario base;
  using auto_cache = routing_cache;
  auto_cache kv(base.g, qevict::budget::bytes_per_sequence_layer(2816 + 800), qevict::limits{.max_batch = 1, .max_tokens = 64},
                qevict::options{.observation_window = 4, .routing = qevict::routing_mode::automatic});
  qevict_test::rng r(3);
  const qevict::sequence_id s = kv.add_sequence();
  std::vector<float> q = r.normals(6 * 16), k = r.normals(6 * 8), v = r.normals(6 * 8), out(6 * 16);
  kv.prefill(0, s, q, k, v, out);
  const qevict::sequence_id batch[] = {s};
  std::vector<float> o(16);
  for (int step = 1; step <= 32; ++step) {
    kv.append(0, batch, r.normals(8), r.normals(8));
    if (step == 31) {
      // Just before the routing event: override the scores so the outcome is known.
      for (int w = 0; w < 8; ++w) kv.set_score(s, 0, w, static_cast<float>(w % 3) * 100.0f + static_cast<float>(w));
      CHECK(kv.counts(s, 0).full == 0);  // nothing aged yet
    }
    kv.attend(0, batch, r.normals(16), o);
  }
  // 38 tokens: floor((38 - 2 - 4) / 4) = 8 windows aged. Scores ~ 100*(w%3) + w plus two steps of
  // attention mass (< 2): 5 (205), 2 (202), 7 (107), 4 (104), 1 (101), 6 (6), 3 (3), 0 (0).
  // Full {5, 2}; Quantized {7, 4, 1, 6}; evicted {3, 0}.
  std::set<int> full, quantized, evicted;
  for (const auto& w : kv.windows(s, 0)) {
    if (w.where == tier::full) full.insert(w.index);
    if (w.where == tier::quantized) quantized.insert(w.index);
    if (w.where == tier::evicted) evicted.insert(w.index);
  }
  CHECK(full == std::set<int>{5, 2});
  CHECK(quantized == std::set<int>{7, 4, 1, 6});
  CHECK(evicted == std::set<int>{3, 0});
}

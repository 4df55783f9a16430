// The budget is never exceeded: long random runs (sequences of different lengths added and
// removed mid-run, ragged batches, appends without attends) under several configurations. After
// every step the report stays within the budget per layer, the tier counts are consistent, and
// every output is finite.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <qevict/cache.hpp>

#include "support/reference.hpp"

using namespace qevict_test;

namespace {

template <class Config>
void random_run(double fraction, int steps, std::uint64_t seed, int max_tokens = 700, int max_prompt = 120) {
  constexpr int W = Config::window_policy::size;
  CAPTURE(W);
  CAPTURE(Config::allocator::quantized_percent);
  CAPTURE(Config::quantizer::bits);
  const qevict::geometry g{.layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 8};
  const qevict::limits lim{.max_batch = 4, .max_tokens = max_tokens};
  qevict::cache<Config> kv(g, qevict::budget::fraction(fraction), lim);
  const qevict::capacities caps = kv.plan().caps;
  REQUIRE(caps.full + caps.quantized > 0);
  rng r(seed);
  const std::size_t krow = 2 * 8, qrow = 4 * 8;
  std::vector<qevict::sequence_id> active;
  std::size_t added = 0, removed = 0, max_evicted = 0, max_quantized = 0, max_full = 0;
  int failures = 0;
  auto fail = [&](bool bad, const std::string& what) {
    if (bad && failures++ < 5) FAIL_CHECK(what);
  };
  auto add = [&] {
    const qevict::sequence_id s = kv.add_sequence(r.integer(0, 5000));
    const int n = r.integer(1, max_prompt);
    for (int l = 0; l < g.layers; ++l) {
      std::vector<float> q = r.normals(n * qrow, 2.0f), k = r.normals(n * krow), v = r.normals(n * krow), out(n * qrow);
      kv.prefill(l, s, q, k, v, out);
      for (float x : out) fail(!std::isfinite(x), "prefill output is not finite");
    }
    active.push_back(s);
    ++added;
  };
  add();
  add();
  for (int step = 0; step < steps; ++step) {
    // Sequences come and go; full ones leave.
    if (active.size() < 4 && r.integer(0, 99) < 3) add();
    if (active.size() > 1 && r.integer(0, 99) < 2) {
      const std::size_t i = static_cast<std::size_t>(r.integer(0, static_cast<int>(active.size()) - 1));
      kv.remove_sequence(active[i]);
      active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      ++removed;
    }
    for (std::size_t i = 0; i < active.size();) {
      if (kv.tokens(active[i], 0) >= lim.max_tokens) {
        kv.remove_sequence(active[i]);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
        ++removed;
      } else {
        ++i;
      }
    }
    if (active.empty()) add();
    // A ragged batch in shuffled order.
    std::vector<qevict::sequence_id> batch;
    for (qevict::sequence_id s : active)
      if (r.integer(0, 9) < 8) batch.push_back(s);
    if (batch.empty()) batch.push_back(active.front());
    std::shuffle(batch.begin(), batch.end(), r.engine);
    const bool skip_attend = r.integer(0, 19) == 0;  // an append without an attend
    for (int l = 0; l < g.layers; ++l) {
      kv.append(l, batch, r.normals(batch.size() * krow), r.normals(batch.size() * krow));
      if (skip_attend) continue;
      std::vector<float> out(batch.size() * qrow);
      kv.attend(l, batch, r.normals(batch.size() * qrow, 2.0f), out);
      for (float x : out) fail(!std::isfinite(x), "attend output is not finite");
    }
    // The budget, per layer, after every step.
    const qevict::budget_report rep = kv.report();
    fail(rep.sequences != active.size(), "report counts the wrong number of sequences");
    for (const qevict::layer_report& lr : rep.layers) {
      fail(lr.budget_bytes != active.size() * kv.plan().budget_bytes, "layer budget is not B_total per sequence");
      fail(lr.used.total() > lr.budget_bytes, "used bytes exceed the budget: " + rep.to_string());
      fail(lr.reserved.total() > lr.budget_bytes, "reserved bytes exceed the budget");
      fail(lr.used.full > lr.reserved.full, "Full windows exceed the Full pool");
      fail(lr.used.quantized_codes + lr.used.quantized_metadata + lr.used.ledger_copies >
               lr.reserved.quantized_codes + lr.reserved.quantized_metadata,
           "ledger records exceed the quantized pool");
      fail(lr.used.recent > lr.reserved.recent, "recent tokens exceed the recent region");
    }
    for (qevict::sequence_id s : active)
      for (int l = 0; l < g.layers; ++l) {
        const qevict::tier_counts c = kv.counts(s, l);
        const int tokens = kv.tokens(s, l);
        fail(c.full > caps.full, "more Full windows than K_f");
        fail(c.quantized + c.ledger_copies > caps.quantized, "more ledger records than K_q");
        fail(c.ledger_copies > c.full, "ledger copies without Full windows");
        fail(c.sink_tokens + (c.full + c.quantized + c.evicted) * W + c.recent_tokens != static_cast<std::size_t>(tokens),
             "tier counts do not add up to the tokens");
        fail(c.recent_tokens > static_cast<std::size_t>(kv.plan().recent_capacity), "recent region overflows");
        std::size_t full = 0, quantized = 0, evicted = 0;
        for (const qevict::window_info& w : kv.windows(s, l)) {
          full += w.where == qevict::tier::full;
          quantized += w.where == qevict::tier::quantized;
          evicted += w.where == qevict::tier::evicted;
          fail(w.where == qevict::tier::quantized && !w.has_ledger, "a quantized window without a ledger record");
          fail(w.where == qevict::tier::evicted && w.has_ledger, "an evicted window keeps a ledger record");
        }
        fail(full != c.full || quantized != c.quantized || evicted != c.evicted, "windows() disagrees with counts()");
        max_evicted = std::max(max_evicted, c.evicted);
        max_quantized = std::max(max_quantized, c.quantized);
        max_full = std::max(max_full, c.full);
      }
  }
  CHECK(failures == 0);
  // The run exercised what it claims to: churn, eviction, and each tier the config has.
  CHECK(added > 4);
  CHECK(removed > 2);
  CHECK(max_evicted > 0);
  if (caps.full > 0) CHECK(max_full > 0);
  if (caps.quantized > 0) CHECK(max_quantized > 0);
}

template <int W, int Sinks, int Recent, int QPercent, int Bits>
using run_config = qevict::config<qevict::scorers::cumulative_mass, qevict::quantizers::asymmetric<Bits>,
                                  qevict::window<W, Sinks, Recent>, qevict::allocators::three_tier<QPercent>,
                                  qevict::rope::rotary, 8>;

}  // namespace

TEST_CASE("budget never exceeded: W = 8, q = 0.7, INT2 (the paper)") { random_run<run_config<8, 5, 32, 70, 2>>(0.2, 1200, 1); }
TEST_CASE("budget never exceeded: W = 1, q = 0.7, INT4") { random_run<run_config<1, 4, 8, 70, 4>>(0.2, 1000, 2); }
TEST_CASE("budget never exceeded: W = 1, q = 0, INT2") { random_run<run_config<1, 2, 4, 0, 2>>(0.15, 700, 3); }
// W = 32 windows are large: longer prompts and sequences, so that the tiers fill and evict.
TEST_CASE("budget never exceeded: W = 32, q = 0.7, INT2") { random_run<run_config<32, 4, 32, 70, 2>>(0.2, 1000, 4, 1000, 600); }
TEST_CASE("budget never exceeded: W = 32, q = 0, INT4") { random_run<run_config<32, 4, 16, 0, 4>>(0.3, 700, 5, 1000, 600); }
TEST_CASE("budget never exceeded: W = 8, q = 0, INT2") { random_run<run_config<8, 5, 32, 0, 2>>(0.2, 700, 6); }

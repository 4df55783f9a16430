// The presets (include/qevict/presets.hpp) against what each compared method is defined to do:
// every preset honours its budget over random runs; full_kv is dense attention; StreamingLLM keeps
// sinks plus the newest windows; H2O keeps the tokens with the most cumulative attention (counted
// here from the attend observer); SnapKV's selection is frozen after prefill and its prefill
// scores are max-pooled; KIVI quantizes everything outside its residual and evicts nothing; AdaKV
// selects per KV head; CriticalKV weights attention by ‖v‖; DefensiveKV takes the maximum over
// observation queries; the ablations and ZipCache-like have the tiers they claim; per-layer
// shares split one total; match_budgets gives every preset the same budget. Expected values come
// from the byte formulas written out here and from the dense double-precision reference.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include <qevict/backend/cuda/supports.hpp>
#include <qevict/cache.hpp>
#include <qevict/presets.hpp>

#include "support/driver.hpp"
#include "support/reference.hpp"

using namespace qevict_test;
using qevict::tier;
namespace presets = qevict::presets;

namespace {

// ---- byte formulas, written out from the documented layouts -----------------------------------

std::size_t round4(std::size_t n) { return (n + 3) / 4 * 4; }

/// One quantized record (bf16 scale/zero): per head, key and value codes padded to 4 bytes, key
/// scale/zero per channel, value scale/zero per token.
std::size_t record_bytes(int tokens, int heads, int d, int bits) {
  const std::size_t codes = round4(static_cast<std::size_t>(tokens) * d * bits / 8);
  return static_cast<std::size_t>(heads) * (2 * codes + 2 * static_cast<std::size_t>(d) * 2 + 2 * static_cast<std::size_t>(tokens) * 2);
}

/// The byte terms every preset shares, from its window policy, Ω and selection.
struct plan_terms {
  std::size_t token = 0, sinks = 0, recent = 0, table = 0, windows = 0, units = 1;
  std::size_t fixed() const { return sinks + recent + table; }
};

template <class Preset>
plan_terms terms_of(const qevict::geometry& g, const qevict::limits& lim) {
  using W = typename Preset::window_policy;
  plan_terms t;
  t.token = 2 * static_cast<std::size_t>(g.kv_heads) * g.head_dim * qevict::element_bytes(g.element);
  t.units = Preset::selection_policy::splits_heads ? static_cast<std::size_t>(g.kv_heads) : 1;
  t.windows = static_cast<std::size_t>((lim.max_tokens - W::sinks + W::size - 1) / W::size);
  t.sinks = W::sinks * t.token;
  t.recent = static_cast<std::size_t>(W::recent + W::size - 1 + Preset::routing_interval) * t.token;
  // The window table: one record per routing unit, possibly padded for alignment (the plan knows by
  // how much; it is at most 15 bytes).
  t.table = qevict::make_region_plan<Preset>(g, qevict::budget::everything(), lim).table_bytes();
  const std::size_t records = t.windows * t.units * sizeof(qevict::window_record);
  REQUIRE(t.table >= records);
  REQUIRE(t.table < records + 16);
  return t;
}

/// M_f and M_q of one routing unit: a window (or one KV head of it) at full precision or as the
/// top tier's record, and its ledger record.
template <class Preset>
std::pair<std::size_t, std::size_t> unit_bytes(const qevict::geometry& g, const qevict::limits& lim) {
  using W = typename Preset::window_policy;
  using F = typename Preset::full_tier_policy;
  const plan_terms t = terms_of<Preset>(g, lim);
  const int heads = g.kv_heads / static_cast<int>(t.units);
  std::size_t m_f = W::size * t.token / t.units;
  if constexpr (F::quantized) m_f = record_bytes(W::size, heads, g.head_dim, F::quantizer::bits);
  return {m_f, record_bytes(W::size, heads, g.head_dim, Preset::quantizer::bits)};
}

qevict::geometry small_geometry(int layers = 2, int q_heads = 4, int kv_heads = 2, int head_dim = 16, float theta = 10000.0f) {
  qevict::geometry g;
  g.layers = layers;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.rope.theta = theta;
  return g;
}

// With θ = 1e12 and head_dim 8, rotary pairs 2 and 3 (channels 2, 6 and 3, 7 in the rotate-half
// layout) turn by less than 1e-3 rad over the positions used here, so logits built on channels 2
// and 3 are what the hand-made cases say they are.
constexpr float still_theta = 1e12f;

template <class Preset>
qevict::budget fitting_budget() {
  return Preset::allocator::keeps_everything ? qevict::budget::everything() : qevict::budget::fraction(0.2);
}

// ---- the budget after every step -----------------------------------------------------------------

struct run_summary {
  std::size_t max_full = 0, max_quantized = 0, max_evicted = 0, final_full = 0, final_quantized = 0;
  int failures = 0;
};

/// Checks the report and tier counts of every sequence and layer against the plan of each layer,
/// and recounts the bytes each layer holds from the tier counts and the formulas above.
template <class Cache>
void check_budget(const Cache& kv, const std::vector<qevict::sequence_id>& ids, run_summary& sum) {
  using Preset = typename Cache::config_type;
  auto fail = [&](bool bad, const std::string& what) {
    if (bad && sum.failures++ < 5) FAIL_CHECK(what);
  };
  const qevict::limits lim{.max_batch = 1, .max_tokens = kv.plan().max_tokens};
  const plan_terms t = terms_of<Preset>(kv.geo(), lim);
  const auto [m_f, m_q] = unit_bytes<Preset>(kv.geo(), lim);
  const qevict::budget_report rep = kv.report();
  for (int l = 0; l < kv.geo().layers; ++l) {
    std::size_t held = 0;
    for (qevict::sequence_id s : ids) {
      const qevict::tier_counts c = kv.counts(s, l);
      const std::size_t bytes = (c.sink_tokens + c.recent_tokens) * t.token + c.full * m_f +
                                (c.quantized + c.ledger_copies) * m_q + t.table;
      fail(bytes > kv.plan(l).budget_bytes, "a sequence holds more than B_total in layer " + std::to_string(l));
      held += bytes;
    }
    fail(held != rep.layers[static_cast<std::size_t>(l)].used.total(), "the report's held bytes differ from the recount");
  }
  fail(rep.sequences != ids.size(), "report counts the wrong number of sequences");
  for (int l = 0; l < kv.geo().layers; ++l) {
    const qevict::layer_report& lr = rep.layers[static_cast<std::size_t>(l)];
    const qevict::region_plan& p = kv.plan(l);
    fail(lr.budget_bytes != ids.size() * p.budget_bytes, "layer budget is not B_total per sequence");
    fail(lr.used.total() > lr.budget_bytes, "layer " + std::to_string(l) + " holds more than its budget:\n" + rep.to_string());
    fail(lr.reserved.total() > lr.budget_bytes, "layer " + std::to_string(l) + " reserves more than its budget");
    fail(p.region_bytes > p.budget_bytes, "the region plan exceeds its budget");
  }
  for (qevict::sequence_id s : ids)
    for (int l = 0; l < kv.geo().layers; ++l) {
      const qevict::region_plan& p = kv.plan(l);
      const qevict::tier_counts c = kv.counts(s, l);
      const std::size_t units = static_cast<std::size_t>(p.units);
      const std::size_t routed = c.full + c.quantized + c.evicted;
      fail(routed % units != 0, "routed units are not whole windows");
      fail(c.sink_tokens + routed / units * static_cast<std::size_t>(p.window) + c.recent_tokens !=
               static_cast<std::size_t>(kv.tokens(s, l)),
           "tier counts do not add up to the tokens");
      fail(c.full > p.caps.full, "more Full units than K_f");
      fail(c.quantized + c.ledger_copies > p.caps.quantized, "more ledger records than K_q");
      fail(c.recent_tokens > static_cast<std::size_t>(p.recent_capacity), "the recent region overflows");
      sum.max_full = std::max(sum.max_full, c.full);
      sum.max_quantized = std::max(sum.max_quantized, c.quantized);
      sum.max_evicted = std::max(sum.max_evicted, c.evicted);
    }
}

/// Random prompts (one per entry of `prompts`), then `steps` ragged decode steps over every layer;
/// the budget is checked after the prefill and after every step, and `on_step(kv, ids, step)`
/// (step -1 after the prefill) adds the test's own checks.
template <class Preset, class OnStep>
run_summary random_run(const qevict::geometry& g, const qevict::budget& b, const qevict::limits& lim,
                       const std::vector<int>& prompts, int steps, std::uint64_t seed, OnStep&& on_step) {
  qevict::cache<Preset> kv(g, b, lim);
  rng r(seed);
  const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
  const std::size_t qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;
  std::vector<qevict::sequence_id> ids;
  run_summary sum;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const int n = prompts[i];
    const qevict::sequence_id s = kv.add_sequence(static_cast<long long>(17 * i));
    for (int l = 0; l < g.layers; ++l) {
      const std::vector<float> q = r.normals(n * qrow, 2.0f), k = r.normals(n * krow), v = r.normals(n * krow);
      std::vector<float> out(n * qrow);
      kv.prefill(l, s, q, k, v, out);
    }
    ids.push_back(s);
  }
  check_budget(kv, ids, sum);
  on_step(kv, ids, -1);
  for (int t = 0; t < steps; ++t) {
    std::vector<qevict::sequence_id> batch;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if ((t + static_cast<int>(i)) % 5 != 0) batch.push_back(ids[i]);
    if (batch.empty()) batch.push_back(ids.front());
    if (t % 2) std::reverse(batch.begin(), batch.end());
    for (int l = 0; l < g.layers; ++l) {
      kv.append(l, batch, r.normals(batch.size() * krow), r.normals(batch.size() * krow));
      std::vector<float> out(batch.size() * qrow);
      kv.attend(l, batch, r.normals(batch.size() * qrow, 2.0f), out);
      for (float x : out)
        if (!std::isfinite(x) && sum.failures++ < 5) FAIL_CHECK("attend output is not finite");
    }
    check_budget(kv, ids, sum);
    on_step(kv, ids, t);
  }
  for (qevict::sequence_id s : ids) {
    const qevict::tier_counts c = kv.counts(s, 0);
    sum.final_full += c.full;
    sum.final_quantized += c.quantized;
  }
  return sum;
}

struct no_step_check {
  template <class Cache>
  void operator()(const Cache&, const std::vector<qevict::sequence_id>&, int) const {}
};

/// Tier of each window (unit 0 only when `unit` is 0 and the preset has one unit per window).
std::vector<tier> tiers_of(const std::vector<qevict::window_info>& ws, int unit = 0) {
  std::vector<tier> t;
  for (const qevict::window_info& w : ws)
    if (w.unit == unit) t.push_back(w.where);
  return t;
}

/// Head-averaged probabilities of the prompt's observation queries (the last `obs`), from the
/// dense reference: probs[i][j] for observer i (0-based within the window) and token j.
std::vector<std::vector<double>> observation_probs(const history& h, int q_heads, const rope_spec& rs,
                                                   const std::vector<float>& q, int obs) {
  const int n = h.size();
  const std::size_t qrow = static_cast<std::size_t>(q_heads) * h.head_dim;
  std::vector<std::vector<double>> probs;
  std::vector<double> out, p;
  for (int i = std::max(0, n - obs); i < n; ++i) {
    dense_attend(h, q_heads, rs, &q[i * qrow], i + 1, out, &p);
    p.resize(static_cast<std::size_t>(n), 0.0);
    probs.push_back(p);
  }
  return probs;
}

/// Max-pooling over `width` neighbouring entries (SnapKV's clustering), clipped at the ends.
std::vector<double> max_pool(const std::vector<double>& x, int width) {
  const int r = width / 2, n = static_cast<int>(x.size());
  std::vector<double> y(x.size());
  for (int i = 0; i < n; ++i) {
    double m = 0.0;
    for (int j = std::max(0, i - r); j <= std::min(n - 1, i + r); ++j) m = std::max(m, x[static_cast<std::size_t>(j)]);
    y[static_cast<std::size_t>(i)] = m;
  }
  return y;
}

/// A prompt given token by token: prefills every layer of a fresh sequence with it.
struct prompt {
  std::vector<float> q, k, v;
};

template <class Cache>
qevict::sequence_id prefill_prompt(Cache& kv, const prompt& p) {
  const qevict::sequence_id s = kv.add_sequence();
  std::vector<float> out(p.q.size());
  for (int l = 0; l < kv.geo().layers; ++l) kv.prefill(l, s, p.q, p.k, p.v, out);
  return s;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// `layers` layers of Llama-3.1-8B geometry, bf16.
qevict::geometry llama_8b(int layers) {
  qevict::geometry g{.layers = layers, .q_heads = 32, .kv_heads = 8, .head_dim = 128, .element = qevict::element_type::bf16};
  g.rope.theta = 500000.0f;
  return g;
}

}  // namespace

// ---- every preset ------------------------------------------------------------------------------

TEST_CASE("every preset honours its budget over a random run (prefill, 250 ragged decode steps, 3 sequences)") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 3, .max_tokens = 448};
  int count = 0;
  std::uint64_t seed = 10;
  presets::for_each([&]<class Preset>(std::string_view name) {
    CAPTURE(std::string(name));
    ++count;
    const run_summary sum = random_run<Preset>(g, fitting_budget<Preset>(), lim, {150, 70, 3}, 250, seed++, no_step_check{});
    CHECK(sum.failures == 0);
    if constexpr (Preset::allocator::keeps_everything) {
      CHECK(sum.max_evicted == 0);
    } else {
      CHECK(sum.max_evicted > 0);  // the budget was binding
    }
  });
  CHECK(count == 19);
}

TEST_CASE("presets that keep everything: a budget one byte short throws qevict::error naming the minimum") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 1, .max_tokens = 448};
  auto check = [&]<class Preset>(std::size_t per_window) {
    CAPTURE(std::string(Preset::name));
    const plan_terms t = terms_of<Preset>(g, lim);
    const std::size_t need = t.fixed() + t.windows * t.units * per_window;
    // Exactly the minimum fits and keeps a record for every window.
    const qevict::region_plan p = qevict::make_region_plan<Preset>(g, qevict::budget::bytes_per_sequence_layer(need), lim);
    CHECK(p.caps.full + p.caps.quantized >= t.windows * t.units);
    CHECK(p.region_bytes <= need);
    // One byte less does not, and the error says how much is needed.
    bool threw = false;
    try {
      qevict::cache<Preset> kv(g, qevict::budget::bytes_per_sequence_layer(need - 1), lim);
    } catch (const qevict::error& e) {
      threw = true;
      CAPTURE(std::string(e.what()));
      CHECK(contains(e.what(), "at least " + std::to_string(need) + " bytes"));
    }
    CHECK(threw);
    // A fraction far too small fails the same way.
    CHECK_THROWS_AS(qevict::cache<Preset>(g, qevict::budget::fraction(0.05), lim), qevict::error);
  };
  const int d = g.head_dim, h = g.kv_heads;
  check.operator()<presets::kivi2>(record_bytes(32, h, d, 2));
  check.operator()<presets::kivi4>(record_bytes(32, h, d, 4));
  check.operator()<presets::kvquant_like>(record_bytes(8, h, d, 4));
  // ZipCache-like keeps every window at 2 bits at least; the 4-bit tier is what is left over.
  check.operator()<presets::zipcache_like>(record_bytes(8, h, d, 2));
}

TEST_CASE("full_kv with budget::everything() is dense double-precision attention") {
  const qevict::geometry g = small_geometry(2, 4, 2, 16);
  qevict::cache<presets::full_kv> kv(g, qevict::budget::everything(), qevict::limits{.max_batch = 3, .max_tokens = 300});
  histories hs;
  rng r(3);
  const std::vector<int> prompts = {37, 3, 90};
  std::vector<qevict::sequence_id> ids;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(add_sequence(kv, hs, static_cast<long long>(100 * i)));
    CHECK(prefill_random(kv, hs, ids.back(), prompts[i], r, 2.0f) <= 1e-5);
  }
  const double worst = worst_decode_error_vs_dense(kv, hs, ids, 150, r, /*shuffle=*/false);
  CHECK(worst <= 1e-5);
  std::size_t full = 0;
  for (qevict::sequence_id s : ids)
    for (int l = 0; l < g.layers; ++l) {
      const qevict::tier_counts c = kv.counts(s, l);
      CHECK(c.quantized == 0);
      CHECK(c.evicted == 0);
      full += c.full;
    }
  CHECK(full > 20);
}

// ---- eviction methods ----------------------------------------------------------------------------

TEST_CASE("streaming_llm keeps exactly the sinks and the newest windows, nothing quantized") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 3, .max_tokens = 448};
  const plan_terms t = terms_of<presets::streaming_llm>(g, lim);
  const std::size_t k_f = 6, m_f = 8 * t.token;
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + k_f * m_f + m_f / 2);
  std::size_t checked = 0, evicted_seen = 0;
  const run_summary sum = random_run<presets::streaming_llm>(
      g, b, lim, {150, 70, 3}, 250, 21, [&](const auto& kv, const std::vector<qevict::sequence_id>& ids, int) {
        REQUIRE(kv.plan().caps.full == k_f);
        REQUIRE(kv.plan().caps.quantized == 0);
        for (qevict::sequence_id s : ids)
          for (int l = 0; l < kv.geo().layers; ++l) {
            const std::vector<tier> w = tiers_of(kv.windows(s, l));
            const qevict::tier_counts c = kv.counts(s, l);
            CHECK(c.sink_tokens == static_cast<std::size_t>(std::min(kv.tokens(s, l), 4)));
            std::size_t aged = 0;
            while (aged < w.size() && w[aged] != tier::recent) ++aged;
            for (std::size_t i = aged; i < w.size(); ++i) CHECK(w[i] == tier::recent);  // recent is a suffix
            // Of the aged windows, the newest min(K_f, aged) are Full and every older one is evicted.
            const std::size_t kept = std::min(k_f, aged);
            for (std::size_t i = 0; i < aged; ++i) {
              CHECK(w[i] == (i + kept >= aged ? tier::full : tier::evicted));
              evicted_seen += w[i] == tier::evicted;
            }
            ++checked;
          }
      });
  CHECK(sum.failures == 0);
  CHECK(sum.max_quantized == 0);
  CHECK(checked > 700);
  CHECK(evicted_seen > 0);
}

TEST_CASE("h2o keeps the tokens with the highest cumulative attention (counted from the attend observer)") {
  const qevict::geometry g = small_geometry(2, 4, 2, 16);
  const qevict::limits lim{.max_batch = 2, .max_tokens = 400};
  const plan_terms t = terms_of<presets::h2o>(g, lim);
  const std::size_t k_f = 40;
  qevict::cache<presets::h2o> kv(g, qevict::budget::bytes_per_sequence_layer(t.fixed() + k_f * t.token + 100), lim);
  REQUIRE(kv.plan().caps.full == k_f);
  REQUIRE(kv.plan().window == 1);
  REQUIRE(kv.plan().routing_interval == 1);
  // No prefill: every score is attention observed during decode.
  const std::vector<qevict::sequence_id> ids = {kv.add_sequence(), kv.add_sequence(50)};
  // attention[s][layer][token], accumulated from the observer.
  std::map<qevict::sequence_id, std::vector<std::vector<double>>> attention;
  std::map<qevict::sequence_id, std::vector<std::vector<tier>>> before;
  for (qevict::sequence_id s : ids) {
    attention[s].assign(2, {});
    before[s].assign(2, {});
  }
  rng r(5);
  const std::size_t krow = 2 * 16, qrow = 4 * 16;
  std::size_t events = 0, evictions = 0, evicted_observed = 0;
  double worst_gap = 0.0;
  for (int step = 0; step < 300; ++step) {
    for (int l = 0; l < g.layers; ++l) {
      kv.append(l, ids, r.normals(ids.size() * krow), r.normals(ids.size() * krow));
      for (qevict::sequence_id s : ids) attention[s][l].resize(static_cast<std::size_t>(kv.tokens(s, l)), 0.0);
      std::vector<float> out(ids.size() * qrow);
      kv.attend(l, ids, r.normals(ids.size() * qrow, 2.0f), out, [&](const qevict::attention_event& e) {
        attention[ids[static_cast<std::size_t>(e.batch_index)]][l][static_cast<std::size_t>(e.token)] += e.probability;
        evicted_observed += e.where == tier::evicted;
      });
      // attend() routed (Ω = 1): compare the kept tokens with the ones this event evicted.
      for (qevict::sequence_id s : ids) {
        const std::vector<tier> now = tiers_of(kv.windows(s, l));
        std::vector<tier>& was = before[s][l];
        was.resize(now.size(), tier::recent);
        const std::vector<double>& a = attention[s][l];
        double min_kept = INFINITY, max_evicted = -INFINITY;
        std::size_t kept = 0;
        for (std::size_t i = 0; i < now.size(); ++i) {
          CHECK_FALSE((was[i] == tier::evicted && now[i] != tier::evicted));  // eviction is final
          CHECK(now[i] != tier::quantized);
          if (now[i] == tier::full) {
            min_kept = std::min(min_kept, a[i]);
            ++kept;
          }
          if (now[i] == tier::evicted && was[i] != tier::evicted) {
            max_evicted = std::max(max_evicted, a[i]);
            ++evictions;
          }
        }
        if (kept > 0 && max_evicted > -INFINITY) {
          ++events;
          worst_gap = std::max(worst_gap, max_evicted - min_kept);
          CHECK(min_kept >= max_evicted - 1e-5);
        }
        CHECK(kept <= k_f);
        was = now;
      }
    }
  }
  CHECK(worst_gap <= 1e-5);
  CHECK(events > 300);  // every step after the cache filled evicted a token
  CHECK(evictions > 400);
  CHECK(evicted_observed == 0);  // evicted tokens are never attended
}

TEST_CASE("snapkv: the kept set is frozen after prefill") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 3, .max_tokens = 448};
  std::map<std::pair<qevict::sequence_id, int>, std::vector<tier>> settled;  // tier of each aged window, when it aged
  std::size_t prompt_full = 0, prompt_evicted = 0, compared = 0;
  const run_summary sum = random_run<presets::snapkv>(
      g, qevict::budget::fraction(0.3), lim, {200, 120, 3}, 200, 31,
      [&](const auto& kv, const std::vector<qevict::sequence_id>& ids, int step) {
        for (qevict::sequence_id s : ids)
          for (int l = 0; l < kv.geo().layers; ++l) {
            const std::vector<tier> now = tiers_of(kv.windows(s, l));
            std::vector<tier>& first = settled[{s, l}];
            if (step < 0)
              for (tier x : now) {
                prompt_full += x == tier::full;
                prompt_evicted += x == tier::evicted;
              }
            for (std::size_t i = 0; i < now.size(); ++i) {
              if (now[i] == tier::recent) {
                CHECK(i >= first.size());
                continue;
              }
              if (i < first.size()) {
                CHECK(now[i] == first[i]);  // never re-decided
                ++compared;
              } else {
                CHECK(i == first.size());
                first.push_back(now[i]);
              }
            }
          }
      });
  CHECK(sum.failures == 0);
  CHECK(prompt_full > 0);
  CHECK(prompt_evicted > 0);
  CHECK(compared > 10000);
}

TEST_CASE("snapkv: prefill scores are the observation window's mass, max-pooled over 7 tokens") {
  const qevict::geometry g = small_geometry(1, 2, 1, 8, still_theta);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 100, obs = 32, spike = 40, d = 8;
  rng r(41);
  prompt p{r.normals(n * 2 * d, 0.3f), r.normals(n * d, 0.3f), r.normals(n * d)};
  p.k[spike * d + 3] = 6.0f;  // every observation query finds token 40
  for (int i = n - obs; i < n; ++i)
    for (int h = 0; h < 2; ++h) p.q[(i * 2 + h) * d + 3] = 6.0f;
  qevict::cache<presets::snapkv> kv(g, qevict::budget::everything(), lim);
  const qevict::sequence_id s = prefill_prompt(kv, p);

  history h(1, d, 0);
  for (int i = 0; i < n; ++i) h.push(&p.k[i * d], &p.v[i * d]);
  const auto probs = observation_probs(h, 2, rope_of(g), p.q, obs);
  std::vector<double> mass(n, 0.0);
  for (const auto& row : probs)
    for (int j = 0; j < n; ++j) mass[j] += row[j];
  const std::vector<double> pooled = max_pool(mass, 7);
  const std::vector<qevict::window_info> ws = kv.windows(s, 0);
  REQUIRE(ws.size() == static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j) {
    CAPTURE(j);
    CHECK(ws[j].score == doctest::Approx(pooled[j]).epsilon(1e-5));
  }
  // The hand-made shape: the spike's mass spreads to its three neighbours on each side only.
  CHECK(mass[spike] > 20.0);
  for (int j = spike - 3; j <= spike + 3; ++j) CHECK(ws[j].score == doctest::Approx(mass[spike]).epsilon(1e-5));
  CHECK(mass[spike - 3] < 0.05 * mass[spike]);  // pooled, not its own mass
  CHECK(ws[spike - 4].score < 0.05 * mass[spike]);
  CHECK(ws[spike + 4].score < 0.05 * mass[spike]);
}

TEST_CASE("kivi2 and kivi4 evict nothing over a long run and quantize everything outside the residual") {
  auto run = [&]<class Preset>() {
    CAPTURE(std::string(Preset::name));
    const qevict::geometry g = small_geometry(1, 4, 2, 16);
    const qevict::limits lim{.max_batch = 1, .max_tokens = 1000};
    REQUIRE(qevict::cache<Preset>(g, qevict::budget::everything(), lim).plan().window == 32);
    std::size_t last_quantized = 0;
    int last_tokens = 0;
    const run_summary sum = random_run<Preset>(
        g, qevict::budget::everything(), lim, {300}, 650, 51,
        [&](const auto& kv, const std::vector<qevict::sequence_id>& ids, int) {
          const qevict::tier_counts c = kv.counts(ids[0], 0);
          const int tokens = kv.tokens(ids[0], 0);
          CHECK(c.evicted == 0);
          CHECK(c.full == 0);
          CHECK(c.sink_tokens == 0);
          // The full-precision residual is the newest 128 tokens at least (more until the next event).
          CHECK(c.recent_tokens >= static_cast<std::size_t>(std::min(tokens, 128)));
          CHECK(c.recent_tokens <= static_cast<std::size_t>(128 + 31 + 8));
          CHECK(c.quantized * 32 + c.recent_tokens == static_cast<std::size_t>(tokens));
          for (const qevict::window_info& w : kv.windows(ids[0], 0)) CHECK((w.where == tier::recent || w.has_ledger));
          last_quantized = c.quantized;
          last_tokens = tokens;
        });
    CHECK(sum.failures == 0);
    // Every window older than the residual is quantized, as of the last routing event (at most Ω
    // tokens ago).
    CHECK(last_quantized <= static_cast<std::size_t>((last_tokens - 128) / 32));
    CHECK(last_quantized >= static_cast<std::size_t>((last_tokens - 128 - 8) / 32));
    CHECK(last_tokens > 800);
  };
  run.operator()<presets::kivi2>();
  run.operator()<presets::kivi4>();
}

TEST_CASE("adakv: KV heads that attend differently keep different windows from one shared budget") {
  // Head 0's queries attend the first 64 tokens, head 1's the later ones (channel 3 of keys is +2
  // or -2, queries +3); other channels carry noise the queries do not see.
  const qevict::geometry g = small_geometry(1, 4, 2, 8, still_theta);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 160, early = 64, d = 8, hkv = 2, hq = 4;
  rng r(61);
  prompt p{std::vector<float>(static_cast<std::size_t>(n) * hq * d, 0.0f), r.normals(n * hkv * d, 0.5f), r.normals(n * hkv * d)};
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < hkv; ++h) {
      p.k[(i * hkv + h) * d + 3] = (i < early) == (h == 0) ? 2.0f : -2.0f;
      p.k[(i * hkv + h) * d + 7] = 0.0f;
    }
    for (int h = 0; h < hq; ++h) p.q[(i * hq + h) * d + 3] = 3.0f;
  }
  const plan_terms t = terms_of<presets::adakv>(g, lim);
  REQUIRE(t.units == 2);
  const std::size_t k_f = 100, m_f = t.token / 2;  // one token of one KV head
  qevict::cache<presets::adakv> kv(g, qevict::budget::bytes_per_sequence_layer(t.fixed() + k_f * m_f + m_f / 2), lim);
  REQUIRE(kv.plan().caps.full == k_f);
  REQUIRE(kv.plan().full_window_bytes == m_f);
  const qevict::sequence_id s = prefill_prompt(kv, p);
  std::vector<std::set<int>> kept(2);
  for (const qevict::window_info& w : kv.windows(s, 0))
    if (w.where == tier::full) kept[static_cast<std::size_t>(w.unit)].insert(w.index);
  CHECK(kept[0] != kept[1]);
  for (int w = 0; w < early; ++w) CHECK(kept[0].count(w) == 1);  // head 0 keeps every early token
  CHECK(*kept[1].begin() >= early - 3);                          // head 1 keeps none (pooling reaches 3 back)
  CHECK(kept[1].size() > 10);
  // One budget for the layer: the units of both heads together fill K_f, and the bytes fit.
  CHECK(kept[0].size() + kept[1].size() == k_f);
  const qevict::tier_counts c = kv.counts(s, 0);
  CHECK(c.full == k_f);
  CHECK(t.fixed() + c.full * m_f <= kv.plan().budget_bytes);
  const qevict::layer_report lr = kv.report().layers[0];
  CHECK(lr.used.total() <= lr.budget_bytes);
  CHECK(lr.used.full == k_f * m_f);
}

TEST_CASE("criticalkv ranks by attention × ‖v‖: at equal attention the larger value norm wins") {
  // All keys are zero, so every observation query attends uniformly; value norms are 1, except
  // token 30 (norm 5) and token 80 (norm 10), in both KV heads.
  const qevict::geometry g = small_geometry(1, 2, 2, 8);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 120, d = 8, hkv = 2;
  rng r(71);
  prompt p{r.normals(n * 2 * d), std::vector<float>(static_cast<std::size_t>(n) * hkv * d, 0.0f), {}};
  p.v.assign(p.k.size(), 0.0f);
  for (int i = 0; i < n; ++i) {
    const std::vector<float> dir = r.normals(d);
    double norm = 0.0;
    for (float x : dir) norm += static_cast<double>(x) * x;
    const double want = i == 30 ? 5.0 : i == 80 ? 10.0 : 1.0;
    for (int h = 0; h < hkv; ++h)
      for (int c = 0; c < d; ++c) p.v[(i * hkv + h) * d + c] = static_cast<float>(dir[c] * want / std::sqrt(norm));
  }
  const plan_terms t = terms_of<presets::criticalkv>(g, lim);
  const std::size_t k_f = 14, m_f = t.token / 2;
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + k_f * m_f);
  qevict::cache<presets::criticalkv> critical(g, b, lim);
  qevict::cache<presets::adakv> plain(g, b, lim);
  REQUIRE(critical.plan().caps.full == k_f);
  const qevict::sequence_id sc = prefill_prompt(critical, p), sp = prefill_prompt(plain, p);

  // Expected scores: the observation window's uniform attention times ‖v‖, max-pooled over 7.
  history h(hkv, d, 0);
  for (int i = 0; i < n; ++i) h.push(&p.k[i * hkv * d], &p.v[i * hkv * d]);
  const auto probs = observation_probs(h, 2, rope_of(g), p.q, 32);
  std::vector<double> weighted(n, 0.0), attention(n, 0.0);
  for (const auto& row : probs)
    for (int j = 0; j < n; ++j) {
      double norm = 0.0;
      for (int c = 0; c < d; ++c) norm += static_cast<double>(p.v[j * hkv * d + c]) * p.v[j * hkv * d + c];
      weighted[j] += row[j] * std::sqrt(norm);
      attention[j] += row[j];
    }
  const std::vector<double> expected = max_pool(weighted, 7);
  const std::vector<qevict::window_info> wc = critical.windows(sc, 0), wp = plain.windows(sp, 0);
  std::vector<std::set<int>> kept(2);
  for (const qevict::window_info& w : wc) {
    CHECK(w.score == doctest::Approx(expected[static_cast<std::size_t>(w.index)]).epsilon(1e-5));
    if (w.where == tier::full) kept[static_cast<std::size_t>(w.unit)].insert(w.index);
  }
  CHECK(attention[30] == doctest::Approx(attention[80]).epsilon(1e-12));  // equal attention
  CHECK(wc[2 * 80].score > 1.5 * wc[2 * 30].score);                       // the larger norm wins
  CHECK(wp[2 * 80].score == doctest::Approx(wp[2 * 30].score).epsilon(1e-6));  // without ‖v‖, a tie
  for (int u = 0; u < 2; ++u) {
    CHECK(kept[u] == std::set<int>{77, 78, 79, 80, 81, 82, 83});
    CHECK(critical.windows(sc, 0)[static_cast<std::size_t>(2 * 30 + u)].where == tier::evicted);
  }
}

TEST_CASE("criticalkv with the output projection W_o: each query head weighs attention by ‖W_o^(h) v‖") {
  // Zero keys, so every observation query attends uniformly (p = 1 / (i + 1) over tokens 0..i);
  // random values and a random W_o [hidden][q_heads * d]. Two query heads per KV head.
  const qevict::geometry g = small_geometry(1, 4, 2, 8);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 120, d = 8, hkv = 2, hq = 4, hidden = 12, obs = 32;
  rng r(73);
  prompt p{r.normals(n * hq * d), std::vector<float>(static_cast<std::size_t>(n) * hkv * d, 0.0f), r.normals(n * hkv * d)};
  const std::vector<float> w_o = r.normals(static_cast<std::size_t>(hidden) * hq * d, 0.5f);
  const plan_terms t = terms_of<presets::criticalkv>(g, lim);
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + 20 * (t.token / 2));
  qevict::cache<presets::criticalkv> projected(g, b, lim), fallback(g, b, lim);
  projected.set_output_projection(0, w_o, hidden);
  const qevict::sequence_id sp = prefill_prompt(projected, p), sf = prefill_prompt(fallback, p);

  // Expected, computed directly: ‖W_o^(h) v‖ = the norm of the hidden-size vector sum_c W[r][h d + c] v[c].
  auto projected_norm = [&](int h, const float* v) {
    double sq = 0.0;
    for (int row = 0; row < hidden; ++row) {
      double x = 0.0;
      for (int c = 0; c < d; ++c) x += static_cast<double>(w_o[static_cast<std::size_t>(row) * hq * d + h * d + c]) * v[c];
      sq += x * x;
    }
    return std::sqrt(sq);
  };
  for (int u = 0; u < hkv; ++u) {
    std::vector<double> mass(n, 0.0);
    for (int i = n - obs; i < n; ++i)
      for (int j = 0; j <= i; ++j) {
        const float* v = &p.v[(static_cast<std::size_t>(j) * hkv + u) * d];
        // The unit's two query heads, each with probability 1 / (i + 1), divided by the unit's query heads.
        mass[j] += (projected_norm(2 * u, v) + projected_norm(2 * u + 1, v)) / (i + 1) / 2.0;
      }
    const std::vector<double> expected = max_pool(mass, 7);
    for (const qevict::window_info& w : projected.windows(sp, 0))
      if (w.unit == u) CHECK(w.score == doctest::Approx(expected[static_cast<std::size_t>(w.index)]).epsilon(1e-5));
  }
  // The projection changes the scores (it is not the value norm in disguise).
  int differ = 0;
  const auto wp = projected.windows(sp, 0), wf = fallback.windows(sf, 0);
  for (std::size_t i = 0; i < wp.size(); ++i) differ += std::abs(wp[i].score - wf[i].score) > 1e-3f * std::abs(wf[i].score);
  CHECK(differ > static_cast<int>(wp.size()) / 2);

  // W_o = c_h · I per head (hidden = q_heads * d, block diagonal): ‖W_o^(h) v‖ = c_h ‖v‖, so with
  // c = 2, 2, 4, 4 unit 0's scores are exactly twice the ‖v‖ scores and unit 1's four times.
  std::vector<float> diag(static_cast<std::size_t>(hq) * d * hq * d, 0.0f);
  const float c_of[] = {2.0f, 2.0f, 4.0f, 4.0f};
  for (int h = 0; h < hq; ++h)
    for (int c = 0; c < d; ++c) diag[(static_cast<std::size_t>(h) * d + c) * hq * d + h * d + c] = c_of[h];
  qevict::cache<presets::criticalkv> scaled(g, b, lim);
  scaled.set_output_projection(0, diag, hq * d);
  const qevict::sequence_id ss = prefill_prompt(scaled, p);
  const auto wsc = scaled.windows(ss, 0);
  for (std::size_t i = 0; i < wsc.size(); ++i) CHECK(wsc[i].score == (wsc[i].unit == 0 ? 2.0f : 4.0f) * wf[i].score);

  // Bad input.
  std::vector<float> nan_w = w_o;
  nan_w[5] = std::nanf("");
  CHECK_THROWS_WITH_AS(projected.set_output_projection(0, std::span(w_o).first(10), hidden),
                       doctest::Contains("set_output_projection: w_o has 10 floats"), qevict::error);
  CHECK_THROWS_WITH_AS(projected.set_output_projection(0, nan_w, hidden), doctest::Contains("set_output_projection: w_o[5] is NaN"),
                       qevict::error);
  CHECK_THROWS_WITH_AS(projected.set_output_projection(1, w_o, hidden), doctest::Contains("set_output_projection: layer 1 is out of range"),
                       qevict::error);
  CHECK_THROWS_WITH_AS(projected.set_output_projection(0, w_o, 0), doctest::Contains("hidden must be positive"), qevict::error);
  qevict::cache<presets::adakv> plain(g, b, lim);
  CHECK_THROWS_WITH_AS(plain.set_output_projection(0, w_o, hidden), doctest::Contains("does not weigh values"), qevict::error);
}

TEST_CASE("criticalkv: a W_o that could weigh a token beyond 2^64 is refused; one within gives finite, exact scores") {
  // Finite elements are not enough: with values of 2^14, an element of 1e37 would weigh a token by
  // about 1.6e41, beyond float's largest, and the window scores would overflow. The check bounds
  // ‖W_o^(h) v‖ <= ‖W_o^(h)‖_F · √d · 2^14 <= 2^64, so with d = 8 a query head's slice may have a
  // Frobenius norm up to 2^64 / (√8 · 2^14) = 2^48.5.
  const qevict::geometry g = small_geometry(1, 4, 2, 8);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 120, d = 8, hkv = 2, hq = 4, hidden = 12, obs = 32;
  const plan_terms t = terms_of<presets::criticalkv>(g, lim);
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + 20 * (t.token / 2));
  // W_o with one element per query head, at row h, channel h: ‖W_o^(h) v‖ = |element| · |v[h]|.
  auto single = [&](float element) {
    std::vector<float> w(static_cast<std::size_t>(hidden) * hq * d, 0.0f);
    for (int h = 0; h < hq; ++h) w[static_cast<std::size_t>(h) * hq * d + h * d + h] = element;
    return w;
  };
  qevict::cache<presets::criticalkv> kv(g, b, lim);
  kv.set_output_projection(0, single(0x1p48f), hidden);  // 2^48 <= 2^48.5: accepted
  CHECK_THROWS_WITH_AS(
      kv.set_output_projection(0, single(0x1p49f), hidden),
      doctest::Contains("set_output_projection: query head 0's slice of w_o has Frobenius norm 5.629e+14, so a "
                        "value within ±16384 could be weighed by up to 2.609e+19, beyond 2^64"),
      qevict::error);
  std::vector<float> huge = single(1.0f);
  huge[static_cast<std::size_t>(5) * hq * d + 2 * d + 3] = 1e37f;  // row 5, query head 2, channel 3
  CHECK_THROWS_WITH_AS(kv.set_output_projection(0, huge, hidden),
                       doctest::Contains("query head 2's slice of w_o has Frobenius norm 1e+37"), qevict::error);

  // The refusals left the accepted W_o in place: with zero keys (uniform attention) and every value
  // at its limit 2^14, every token weighs 2^48 · 2^14 = 2^62 for every query head, so a window's
  // mass is the sum over observation queries i >= j of 2^62 / (i + 1), max-pooled over 7.
  prompt p{std::vector<float>(static_cast<std::size_t>(n) * hq * d, 0.0f),
           std::vector<float>(static_cast<std::size_t>(n) * hkv * d, 0.0f),
           std::vector<float>(static_cast<std::size_t>(n) * hkv * d, 16384.0f)};
  const qevict::sequence_id s = prefill_prompt(kv, p);
  std::vector<double> mass(n, 0.0);
  for (int i = n - obs; i < n; ++i)
    for (int j = 0; j <= i; ++j) mass[static_cast<std::size_t>(j)] += 0x1p62 / (i + 1);
  const std::vector<double> expected = max_pool(mass, 7);
  int checked = 0;
  for (const qevict::window_info& w : kv.windows(s, 0)) {
    CHECK(std::isfinite(w.score));
    CHECK(w.score == doctest::Approx(expected[static_cast<std::size_t>(w.index)]).epsilon(1e-5));
    ++checked;
  }
  CHECK(checked == hkv * n);  // one window per token and KV head
}

TEST_CASE("defensivekv takes the maximum over observation queries: one spike beats a steady larger sum") {
  // Token 30 is found by one observation query only (channel 2), with almost all of its
  // attention; token 60 takes about a tenth of every other observation query's attention (channel 3).
  const qevict::geometry g = small_geometry(1, 2, 2, 8, still_theta);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 256};
  const int n = 120, d = 8, hkv = 2, hq = 2, spike = 30, steady = 60, spike_query = 115;
  rng r(81);
  prompt p{std::vector<float>(static_cast<std::size_t>(n) * hq * d, 0.0f), std::vector<float>(static_cast<std::size_t>(n) * hkv * d, 0.0f),
           r.normals(n * hkv * d)};
  for (int h = 0; h < hkv; ++h) {
    p.k[(spike * hkv + h) * d + 2] = 10.0f;
    p.k[(steady * hkv + h) * d + 3] = 1.0f;
  }
  for (int i = n - 32; i < n; ++i)
    for (int h = 0; h < hq; ++h) p.q[(i * hq + h) * d + (i == spike_query ? 2 : 3)] = i == spike_query ? 10.0f : 7.4f;
  const plan_terms t = terms_of<presets::defensivekv>(g, lim);
  const std::size_t m_f = t.token / 2;
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + 2 * m_f);  // one token per head
  using summing = presets::defensivekv::config_type::with_scorer<qevict::scorers::cumulative_mass>;
  qevict::cache<presets::defensivekv> defensive(g, b, lim);
  qevict::cache<summing> sum(g, b, lim);
  REQUIRE(defensive.plan().caps.full == 2);
  const qevict::sequence_id sd = prefill_prompt(defensive, p), ss = prefill_prompt(sum, p);

  history h(hkv, d, 0);
  for (int i = 0; i < n; ++i) h.push(&p.k[i * hkv * d], &p.v[i * hkv * d]);
  const auto probs = observation_probs(h, hq, rope_of(g), p.q, 32);
  std::vector<double> worst(n, 0.0), total(n, 0.0);
  for (const auto& row : probs)
    for (int j = 0; j < n; ++j) {
      worst[j] = std::max(worst[j], row[j]);
      total[j] += row[j];
    }
  REQUIRE(worst[spike] > worst[steady]);  // the case is what it claims to be
  REQUIRE(total[steady] > total[spike]);
  const std::vector<qevict::window_info> wd = defensive.windows(sd, 0), ws = sum.windows(ss, 0);
  for (const qevict::window_info& w : wd) CHECK(w.score == doctest::Approx(worst[static_cast<std::size_t>(w.index)]).epsilon(1e-5));
  for (int u = 0; u < 2; ++u) {
    CHECK(wd[static_cast<std::size_t>(2 * spike + u)].where == tier::full);
    CHECK(wd[static_cast<std::size_t>(2 * steady + u)].where == tier::evicted);
    CHECK(ws[static_cast<std::size_t>(2 * steady + u)].where == tier::full);  // summing keeps the steady one
    CHECK(ws[static_cast<std::size_t>(2 * spike + u)].where == tier::evicted);
  }
}

// ---- the ablations and the quantization methods ----------------------------------------------

TEST_CASE("r1, r2, r3, r4: window sizes and tiers of the ablations") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 3, .max_tokens = 448};
  static_assert(std::is_same_v<presets::r3::config_type, presets::qevict::config_type>, "R3 is the paper's configuration");
  auto windows_of = [&]<class Preset>(int w) {
    qevict::cache<Preset> kv(g, qevict::budget::fraction(0.3), lim);
    CHECK(kv.plan().window == w);
    CHECK(kv.plan().sinks == 5);
    const qevict::sequence_id s = kv.add_sequence(7);
    rng r(90);
    const int n = 200;
    std::vector<float> q = r.normals(n * 64), k = r.normals(n * 32), v = r.normals(n * 32), out(n * 64);
    kv.prefill(0, s, q, k, v, out);
    const std::vector<qevict::window_info> ws = kv.windows(s, 0);
    CHECK(ws.size() == static_cast<std::size_t>((n - 5 + w - 1) / w));
    for (std::size_t i = 0; i < ws.size(); ++i) CHECK(ws[i].first_position == 7 + 5 + static_cast<long long>(i) * w);
  };
  windows_of.operator()<presets::r1>(1);
  windows_of.operator()<presets::r3>(8);
  windows_of.operator()<presets::r4>(32);

  // R2 keeps nothing quantized, however long the run.
  const run_summary r2 = random_run<presets::r2>(
      g, qevict::budget::fraction(0.3), lim, {150, 70}, 200, 91, [](const auto& kv, const std::vector<qevict::sequence_id>& ids, int) {
        for (qevict::sequence_id s : ids)
          for (const qevict::window_info& w : kv.windows(s, 0)) CHECK_FALSE(w.has_ledger);
      });
  CHECK(r2.failures == 0);
  CHECK(r2.max_quantized == 0);
  CHECK(r2.max_evicted > 0);
  CHECK(qevict::cache<presets::r2>(g, qevict::budget::fraction(0.3), lim).plan().caps.quantized == 0);
  // R1 and R3 do use their quantized tier.
  CHECK(random_run<presets::r1>(g, qevict::budget::fraction(0.3), lim, {150}, 60, 92, no_step_check{}).max_quantized > 0);
  CHECK(random_run<presets::r3>(g, qevict::budget::fraction(0.3), lim, {150}, 60, 93, no_step_check{}).max_quantized > 0);
}

TEST_CASE("zipcache_like evicts nothing and uses both its 4-bit top tier and its 2-bit tier") {
  const qevict::geometry g = small_geometry();
  const qevict::limits lim{.max_batch = 3, .max_tokens = 448};
  const plan_terms t = terms_of<presets::zipcache_like>(g, lim);
  const std::size_t m_q = record_bytes(8, 2, 16, 2), m_4 = record_bytes(8, 2, 16, 4);
  // Every window at 2 bits, plus 12 windows' worth at 4 bits.
  const qevict::budget b = qevict::budget::bytes_per_sequence_layer(t.fixed() + t.windows * m_q + 12 * m_4);
  const qevict::region_plan p = qevict::make_region_plan<presets::zipcache_like>(g, b, lim);
  CHECK(p.full_window_bytes == m_4);
  CHECK(p.quantized_window_bytes() == m_q);
  CHECK(p.caps.quantized == t.windows);
  CHECK(p.caps.full == 12);
  const run_summary sum = random_run<presets::zipcache_like>(g, b, lim, {150, 70, 3}, 250, 101, no_step_check{});
  CHECK(sum.failures == 0);
  CHECK(sum.max_evicted == 0);
  CHECK(sum.final_full > 0);
  CHECK(sum.final_quantized > 0);
}

// ---- budgets -------------------------------------------------------------------------------------

TEST_CASE("layer_defensivekv with budget::with_layer_shares: per-layer budgets, same total, each honoured") {
  const qevict::geometry g = small_geometry(3, 4, 2, 16);
  const qevict::limits lim{.max_batch = 2, .max_tokens = 448};
  const qevict::budget uniform = qevict::budget::fraction(0.5);
  const qevict::budget shared = uniform.with_layer_shares({2.0, 3.0, 4.0});
  qevict::cache<presets::layer_defensivekv> even(g, uniform, lim), uneven(g, shared, lim);
  std::size_t total_even = 0, total_uneven = 0;
  for (int l = 0; l < 3; ++l) {
    total_even += even.plan(l).budget_bytes;
    total_uneven += uneven.plan(l).budget_bytes;
  }
  const std::size_t full_cache = 448 * 256;
  CHECK(even.plan(0).budget_bytes == full_cache / 2);
  CHECK(total_uneven <= total_even);
  CHECK(total_uneven + 3 >= total_even);  // the same total, up to one byte of rounding per layer
  CHECK(uneven.plan(0).budget_bytes < uneven.plan(1).budget_bytes);
  CHECK(uneven.plan(1).budget_bytes < uneven.plan(2).budget_bytes);
  CHECK(static_cast<double>(uneven.plan(0).budget_bytes) == doctest::Approx(full_cache * 0.5 * 3 * 2 / 9).epsilon(1e-4));
  CHECK(uneven.plan(0).caps.full < uneven.plan(2).caps.full);
  const run_summary sum = random_run<presets::layer_defensivekv>(g, shared, lim, {150, 70}, 200, 111, no_step_check{});
  CHECK(sum.failures == 0);
  CHECK(sum.max_evicted > 0);
}

TEST_CASE("match_budgets: one budget for every fitting preset; the others say why") {
  const qevict::geometry g = llama_8b(32);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 4096};
  std::vector<std::string> order;
  presets::for_each([&]<class Preset>(std::string_view name) { order.emplace_back(name); });
  REQUIRE(order.size() == 19);
  CHECK(std::set<std::string>(order.begin(), order.end()).size() == 19);
  const std::size_t token = 2 * 8 * 128 * 2;
  std::size_t kivi2_need = 0;
  {
    const plan_terms t = terms_of<presets::kivi2>(g, lim);
    kivi2_need = t.fixed() + t.windows * record_bytes(32, 8, 128, 2);
  }
  auto check_rows = [&](const qevict::budget& b, std::size_t expected_budget, std::size_t& fitting) {
    const std::vector<presets::matched_budget> rows = presets::match_budgets(g, b, lim);
    REQUIRE(rows.size() == order.size());
    fitting = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const presets::matched_budget& m = rows[i];
      CAPTURE(m.name);
      CHECK(m.name == order[i]);
      if (m.fits) {
        ++fitting;
        CHECK(m.budget_bytes == expected_budget);
        CHECK(m.reserved_bytes <= m.budget_bytes);
        CHECK(m.why_not.empty());
      } else {
        CHECK(contains(m.why_not, "bytes"));
        CHECK(m.budget_bytes == 0);
      }
      if (m.name == "kivi2") CHECK(m.fits == (expected_budget >= kivi2_need));
      if (m.name == "full_kv" || m.name == "qevict" || m.name == "streaming_llm") CHECK(m.fits);
    }
    return rows;
  };
  std::size_t fitting = 0;
  for (double f : {0.2, 0.1, 0.05}) {
    CAPTURE(f);
    const std::size_t expected = static_cast<std::size_t>(f * 4096.0 * static_cast<double>(token));
    const auto rows = check_rows(qevict::budget::fraction(f), expected, fitting);
    CHECK(fitting >= 13);
    if (f < 0.1) CHECK(fitting < 19);  // 5% cannot keep every token quantized
    for (const auto& m : rows)
      if (!m.fits) CHECK(m.why_not.find("never evicts") != std::string::npos);
  }
  // An absolute budget is the same number of bytes for every row.
  check_rows(qevict::budget::bytes_per_sequence_layer(700'000), 700'000, fitting);
  check_rows(qevict::budget::bytes_per_sequence_layer(kivi2_need), kivi2_need, fitting);
}

TEST_CASE("switching methods is one line: the same driver runs every preset through presets::for_each") {
  const qevict::geometry g = small_geometry(1, 4, 2, 16);
  const qevict::limits lim{.max_batch = 1, .max_tokens = 448};
  std::set<std::string> names;
  std::set<std::vector<std::size_t>> outcomes;
  presets::for_each([&]<class Preset>(std::string_view name) {
    qevict::cache<Preset> kv(g, fitting_budget<Preset>(), lim);  // the one line that changes
    names.insert(std::string(name));
    rng r(7);  // the same input for every method
    const qevict::sequence_id s = kv.add_sequence();
    const int n = 120;
    std::vector<float> q = r.normals(n * 64, 2.0f), k = r.normals(n * 32), v = r.normals(n * 32), out(n * 64);
    kv.prefill(0, s, q, k, v, out);
    for (int t = 0; t < 40; ++t) {
      kv.append(0, std::span(&s, 1), r.normals(32), r.normals(32));
      std::vector<float> o(64);
      kv.attend(0, std::span(&s, 1), r.normals(64, 2.0f), o);
      for (float x : o) CHECK(std::isfinite(x));
    }
    const qevict::tier_counts c = kv.counts(s, 0);
    outcomes.insert({c.full, c.quantized, c.evicted, c.recent_tokens, c.sink_tokens});
  });
  CHECK(names.size() == 19);
  CHECK(outcomes.size() >= 8);  // the compositions really differ
}

TEST_CASE("qevict_post_rope, qevict_window_relative: the paper's byte plan; only the frame of the quantized keys differs") {
  const qevict::geometry g = llama_8b(2);
  const qevict::limits lim{.max_batch = 4, .max_tokens = 8192};
  for (double f : {0.05, 0.10, 0.20, 0.50}) {
    CAPTURE(f);
    const auto a = qevict::make_region_plan<presets::qevict>(g, qevict::budget::fraction(f), lim);
    const auto b = qevict::make_region_plan<presets::qevict_post_rope>(g, qevict::budget::fraction(f), lim);
    const auto c = qevict::make_region_plan<presets::qevict_window_relative>(g, qevict::budget::fraction(f), lim);
    for (const auto& other : {b, c}) {
      CHECK(a.region_bytes == other.region_bytes);
      CHECK(a.caps.full == other.caps.full);
      CHECK(a.caps.quantized == other.caps.quantized);
      CHECK(a.quantized_window_bytes() == other.quantized_window_bytes());
    }
  }
  static_assert(!presets::qevict::quantizer::key_frame::rotated);
  static_assert(presets::qevict_post_rope::quantizer::key_frame::rotated);
  static_assert(presets::qevict_window_relative::quantizer::key_frame::read_rotation(80, 85) == 80);
}

TEST_CASE("backend::cuda_supports: every preset runs on the CUDA backend, and the policies that keep a composition on the host") {
  using qevict::backend::cuda_support;
  std::set<std::string> on_cuda, all;
  presets::for_each([&]<class Preset>(std::string_view name) {
    all.insert(std::string(name));
    if constexpr (qevict::backend::cuda_supports<typename Preset::config_type>) on_cuda.insert(std::string(name));
  });
  // docs/policies.md, "Backends".
  CHECK(all.size() == 19);
  CHECK(on_cuda == all);
  // layer_defensivekv is defensivekv's configuration, used with budget::with_layer_shares.
  static_assert(std::is_same_v<presets::layer_defensivekv::config_type, presets::defensivekv::config_type>);
  // r1: W = 1 with quantized records (one record per decode item).
  using r1 = cuda_support<presets::r1::config_type>;
  CHECK(r1::short_windows);
  CHECK(r1::quantizer);
  // Every window size, with or without records; a quantized top tier only with W >= 8.
  using qevict::config;
  CHECK(qevict::backend::cuda_supports<config<>::with_window<qevict::window<4, 5, 32>>::with_allocator<qevict::allocators::two_tier>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_window<qevict::window<4, 5, 32>>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_window<qevict::window<16, 5, 32>>>);
  CHECK_FALSE(cuda_support<presets::zipcache_like::config_type::with_window<qevict::window<4, 5, 32>>>::short_windows);
  // Value-weighted scores (criticalkv's) need a cache without records.
  CHECK_FALSE(cuda_support<presets::criticalkv::config_type::with_allocator<qevict::allocators::three_tier<>>>::scorer);
  // INT4 and INT8 codes before or after RoPE; not window-relative (its fp16 path is exact for
  // 2-bit codes); scale and zero in bf16 only.
  using qevict::quantizers::asymmetric;
  namespace frame = qevict::quantizers::key_frame;
  CHECK(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<4>>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<4, qevict::meta::bf16, frame::after_rope>>>);
  CHECK_FALSE(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<4, qevict::meta::bf16, frame::window_relative>>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<8>>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<8, qevict::meta::bf16, frame::after_rope>>>);
  CHECK_FALSE(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<8, qevict::meta::bf16, frame::window_relative>>>);
  CHECK_FALSE(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<4, qevict::meta::f32>>>);
  // A quantized top tier: records of a kernel quantizer in the ledger's key frame, windows of at
  // least 8 tokens, scores that do not weigh values.
  using qevict::full_tier::quantized_as;
  CHECK(cuda_support<presets::zipcache_like::config_type>::full_tier);
  CHECK(qevict::backend::cuda_supports<config<>::with_full_tier<quantized_as<asymmetric<4>>>>);
  CHECK(qevict::backend::cuda_supports<config<>::with_quantizer<asymmetric<2, qevict::meta::bf16, frame::after_rope>>::with_full_tier<
            quantized_as<asymmetric<4, qevict::meta::bf16, frame::after_rope>>>>);
  CHECK_FALSE(cuda_support<config<>::with_full_tier<quantized_as<asymmetric<4, qevict::meta::bf16, frame::after_rope>>>>::full_tier);
  CHECK(cuda_support<config<>::with_full_tier<quantized_as<asymmetric<8>>>>::full_tier);
  CHECK_FALSE(cuda_support<config<>::with_full_tier<quantized_as<asymmetric<8, qevict::meta::f32>>>>::full_tier);
  CHECK_FALSE(cuda_support<config<>::with_quantizer<asymmetric<2, qevict::meta::bf16, frame::window_relative>>::with_full_tier<
                  quantized_as<asymmetric<4, qevict::meta::bf16, frame::window_relative>>>>::full_tier);
  CHECK_FALSE(cuda_support<config<>::with_window<qevict::window<4, 5, 32>>::with_allocator<qevict::allocators::two_tier>::with_full_tier<
                  quantized_as<asymmetric<4>>>>::short_windows);
  CHECK_FALSE(cuda_support<presets::criticalkv::config_type::with_full_tier<quantized_as<asymmetric<4>>>>::scorer);
}

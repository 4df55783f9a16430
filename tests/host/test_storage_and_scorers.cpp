// External storage behaves exactly like owned storage; the decaying scorer multiplies every
// window's history by its factor at each routing event; prefill with only the last queries gives
// the same cache as prefill with all of them.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <qevict/cache.hpp>

#include "support/driver.hpp"
#include "support/reference.hpp"

using namespace qevict_test;
using qevict::tier;

namespace {

const qevict::geometry geo{.layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 16};
constexpr std::size_t krow = 32, qrow = 64;

template <class A, class B>
void expect_same_state(const A& a, const B& b, const std::vector<qevict::sequence_id>& ids) {
  CHECK(a.report().to_string() == b.report().to_string());
  for (qevict::sequence_id s : ids)
    for (int l = 0; l < geo.layers; ++l) {
      const auto wa = a.windows(s, l), wb = b.windows(s, l);
      REQUIRE(wa.size() == wb.size());
      int differences = 0;
      for (std::size_t i = 0; i < wa.size(); ++i)
        differences += wa[i].where != wb[i].where || wa[i].score != wb[i].score || wa[i].has_ledger != wb[i].has_ledger;
      CHECK(differences == 0);
    }
}

/// Drives two caches with the same inputs: a prompt of each length (the sequence added at first
/// position `first_position(n)`; every prefill output must agree), then `steps` decode steps of
/// every layer for all of them. Returns the number of steps whose outputs differed.
template <class A, class B, class FirstPosition>
int run_in_lockstep(A& a, B& b, std::initializer_list<int> prompts, int steps, rng& r, FirstPosition first_position,
                    std::vector<qevict::sequence_id>& ids) {
  for (int n : prompts) {
    const qevict::sequence_id s = a.add_sequence(first_position(n));
    REQUIRE(b.add_sequence(first_position(n)) == s);
    ids.push_back(s);
    for (int l = 0; l < geo.layers; ++l) {
      const auto q = r.normals(n * qrow), k = r.normals(n * krow), v = r.normals(n * krow);
      std::vector<float> oa(n * qrow), ob(n * qrow);
      a.prefill(l, s, q, k, v, oa);
      b.prefill(l, s, q, k, v, ob);
      CHECK(oa == ob);
    }
  }
  int differing_steps = 0;
  for (int t = 0; t < steps; ++t)
    for (int l = 0; l < geo.layers; ++l) {
      const auto k = r.normals(2 * krow), v = r.normals(2 * krow), q = r.normals(2 * qrow, 2.0f);
      std::vector<float> oa(2 * qrow), ob(2 * qrow);
      a.append(l, ids, k, v);
      b.append(l, ids, k, v);
      a.attend(l, ids, q, oa);
      b.attend(l, ids, q, ob);
      differing_steps += oa != ob;
    }
  return differing_steps;
}

}  // namespace

TEST_CASE("external storage gives results identical to owned storage") {
  using cache_t = qevict::cache<qevict::paper_config>;
  const qevict::limits lim{.max_batch = 2, .max_tokens = 400};
  const qevict::budget budget = qevict::budget::fraction(0.2);
  const std::size_t bytes = cache_t::required_bytes(geo, budget, lim);
  // 16-byte aligned caller memory, filled with a pattern to see that the cache writes into it.
  auto arena = std::make_unique<std::max_align_t[]>(bytes / sizeof(std::max_align_t) + 1);
  std::memset(arena.get(), 0xA5, bytes);
  cache_t owned(geo, budget, lim);
  cache_t external(geo, budget, lim, qevict::storage::external{arena.get(), bytes});
  rng r(17);
  std::vector<qevict::sequence_id> ids;
  CHECK(run_in_lockstep(owned, external, {150, 40}, 250, r, [](int n) { return static_cast<long long>(n); }, ids) == 0);
  expect_same_state(owned, external, ids);
  CHECK(owned.counts(ids[0], 0).quantized > 0);  // the run used the ledger too
  for (int w = 0; w < 20; ++w) {
    const auto ra = owned.ledger_record(ids[0], 1, w), rb = external.ledger_record(ids[0], 1, w);
    CHECK(std::vector<std::uint8_t>(ra.begin(), ra.end()) == std::vector<std::uint8_t>(rb.begin(), rb.end()));
  }
  // The cache's bytes live in the caller's arena.
  std::size_t touched = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(arena.get());
  for (std::size_t i = 0; i < bytes; ++i) touched += p[i] != 0xA5;
  CHECK(touched > bytes / 4);
}

TEST_CASE("regions from an engine allocator give results identical to owned storage") {
  using cache_t = qevict::cache<qevict::paper_config>;
  const qevict::limits lim{.max_batch = 2, .max_tokens = 300};
  const qevict::budget budget = qevict::budget::fraction(0.5).with_layer_shares({1.0, 1.5});
  // A toy page allocator: one separately allocated, 16-byte aligned block per request.
  std::vector<std::unique_ptr<std::max_align_t[]>> pages;
  std::vector<std::size_t> sizes;
  qevict::storage::regions from{[&](int, int, std::size_t bytes) -> void* {
    pages.push_back(std::make_unique<std::max_align_t[]>(bytes / sizeof(std::max_align_t) + 1));
    sizes.push_back(bytes);
    return pages.back().get();
  }};
  cache_t owned(geo, budget, lim);
  cache_t paged(geo, budget, lim, from);
  REQUIRE(pages.size() == 4);  // max_batch × layers
  CHECK(sizes[0] == owned.plan(0).region_bytes);
  CHECK(sizes[1] == owned.plan(1).region_bytes);
  CHECK(sizes[1] > sizes[0]);  // layer 1 has a larger share than layer 0
  CHECK(sizes[0] + sizes[1] == cache_t::required_bytes(geo, budget, lim) / 2);
  rng r(23);
  std::vector<qevict::sequence_id> ids;
  CHECK(run_in_lockstep(owned, paged, {120, 30}, 150, r, [](int) { return 0LL; }, ids) == 0);
  expect_same_state(owned, paged, ids);

  // A provider that fails is refused at construction, with the region it failed on.
  auto refuses = [&](qevict::storage::regions bad, const char* what) {
    try {
      cache_t kv(geo, budget, lim, bad);
      FAIL("no error");
    } catch (const qevict::error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  refuses(qevict::storage::regions{[](int, int, std::size_t) -> void* { return nullptr; }}, "provide(0, 0) returned null");
  static std::max_align_t block[4096];
  refuses(qevict::storage::regions{[](int, int, std::size_t) -> void* { return reinterpret_cast<char*>(block) + 8; }},
          "is not 16-byte aligned");
  refuses(qevict::storage::regions{}, "no provide function");
}

TEST_CASE("decaying_mass: each routing event halves every window's history") {
  using cfg = qevict::paper_config::with_scorer<qevict::scorers::decaying_mass<500>>;
  CHECK(qevict::scorers::decaying_mass<500>::after_routing(8.0f) == 4.0f);
  CHECK(qevict::scorers::decaying_mass<900>::after_routing(10.0f) == doctest::Approx(9.0f));
  CHECK(qevict::scorers::decaying_mass<500>::accumulate(1.0f, 0.25f) == 1.25f);

  SUBCASE("set_score + route: aged and recent windows both decay") {
    qevict::cache<cfg> kv(geo, qevict::budget::everything(), qevict::limits{.max_batch = 1, .max_tokens = 200},
                          qevict::options{.routing = qevict::routing_mode::manual});
    rng r(1);
    const qevict::sequence_id s = kv.add_sequence();
    const int n = 70;  // windows 0-3 aged (floor((70-5-32)/8) = 4), windows 4-8 recent
    const auto q = r.normals(n * qrow), k = r.normals(n * krow), v = r.normals(n * krow);
    std::vector<float> out(n * qrow);
    kv.prefill(0, s, q, k, v, out);
    REQUIRE(kv.windows(s, 0)[3].where == tier::full);
    REQUIRE(kv.windows(s, 0)[5].where == tier::recent);
    kv.set_score(s, 0, 3, 8.0f);
    kv.set_score(s, 0, 5, 8.0f);
    kv.route(s);
    CHECK(kv.windows(s, 0)[3].score == 4.0f);
    CHECK(kv.windows(s, 0)[5].score == 4.0f);
    kv.route(s);
    CHECK(kv.windows(s, 0)[3].score == 2.0f);
    CHECK(kv.windows(s, 0)[5].score == 2.0f);
  }

  SUBCASE("automatic routing: score = sum over steps of mass * 0.5^(routing events since)") {
    qevict::cache<cfg> kv(geo, qevict::budget::everything(), qevict::limits{.max_batch = 1, .max_tokens = 300});
    histories hs;
    rng r(2);
    const qevict::sequence_id s = add_sequence(kv, hs);
    const int n = 60, obs = 32, sinks = 5, window = 8;
    std::vector<std::vector<double>> expected(2, std::vector<double>(64, 0.0));
    for (int l = 0; l < geo.layers; ++l) {
      const auto q = r.normals(n * qrow, 2.0f), k = r.normals(n * krow), v = r.normals(n * krow);
      std::vector<float> out(n * qrow);
      kv.prefill(l, s, q, k, v, out);
      for (int i = 0; i < n; ++i) hs.at(s, l).push(&k[i * krow], &v[i * krow]);
      std::vector<double> ref, probs;
      for (int i = n - obs; i < n; ++i) {
        dense_attend(hs.at(s, l), geo.q_heads, rope_of(geo), &q[i * qrow], i + 1, ref, &probs);
        for (int j = sinks; j <= i; ++j) expected[l][static_cast<std::size_t>((j - sinks) / window)] += probs[j];
      }
      for (double& e : expected[l]) e *= 0.5;  // the prefill's routing event
    }
    const std::vector<qevict::sequence_id> batch = {s};
    double worst = 0.0;
    for (int t = 1; t <= 120; ++t) {
      for (int l = 0; l < geo.layers; ++l) {
        std::vector<float> out(qrow);
        kv.append(l, batch, r.normals(krow), r.normals(krow));
        kv.attend(l, batch, r.normals(qrow, 2.0f), out, [&](const qevict::attention_event& e) {
          if (e.window >= 0) expected[l][static_cast<std::size_t>(e.window)] += e.probability;
        });
        if (t % 8 == 0)
          for (double& e : expected[l]) e *= 0.5;  // this attend was the Ω-th: a routing event
        for (const qevict::window_info& w : kv.windows(s, l))
          worst = std::max(worst, std::abs(w.score - expected[l][static_cast<std::size_t>(w.index)]) /
                                      std::max(1e-3, expected[l][static_cast<std::size_t>(w.index)]));
      }
    }
    CHECK(worst <= 1e-5);
  }
}

TEST_CASE("prefill with only the last queries and no output equals a full prefill") {
  using cache_t = qevict::cache<qevict::paper_config>;
  const qevict::limits lim{.max_batch = 1, .max_tokens = 300};
  cache_t full(geo, qevict::budget::fraction(0.25), lim), partial(geo, qevict::budget::fraction(0.25), lim);
  rng r(5);
  const qevict::sequence_id s = full.add_sequence(3);
  REQUIRE(partial.add_sequence(3) == s);
  const int n = 150;
  for (int l = 0; l < geo.layers; ++l) {
    const auto q = r.normals(n * qrow, 2.0f), k = r.normals(n * krow), v = r.normals(n * krow);
    std::vector<float> out(n * qrow);
    full.prefill(l, s, q, k, v, out);
    // Exactly the observation window's queries (the default 32).
    partial.prefill(l, s, std::span(q).last(32 * qrow), k, v);
  }
  expect_same_state(full, partial, {s});
  const std::vector<qevict::sequence_id> batch = {s};
  int differing = 0;
  for (int t = 0; t < 40; ++t)
    for (int l = 0; l < geo.layers; ++l) {
      const auto k = r.normals(krow), v = r.normals(krow), q = r.normals(qrow);
      std::vector<float> oa(qrow), ob(qrow);
      full.append(l, batch, k, v);
      partial.append(l, batch, k, v);
      full.attend(l, batch, q, oa);
      partial.attend(l, batch, q, ob);
      differing += oa != ob;
    }
  CHECK(differing == 0);
  expect_same_state(full, partial, {s});
}

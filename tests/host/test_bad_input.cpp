// Bad input: each mistake gets a qevict::error whose message names the problem, and the cache is
// exactly as it was. "Exactly" is checked against a twin cache that never saw the bad call: the
// same report, windows and token counts, and bit-identical outputs of the next decode step.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <qevict/cache.hpp>
#include <qevict/presets.hpp>

#include "support/reference.hpp"

using namespace qevict_test;

namespace {

using cfg = qevict::paper_config;
using cache_t = qevict::cache<cfg>;

const qevict::geometry geo{.layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 8};
constexpr std::size_t krow = 16, qrow = 32;
// Fixed bytes: sinks 5*128 + recent 47*128 + table 10*12 padded to 128 = 6784; the rest buys K_f = 1, K_q = 19.
const qevict::budget tight = qevict::budget::bytes_per_sequence_layer(12000);
const qevict::limits lim{.max_batch = 3, .max_tokens = 80};

/// Two caches fed the same valid calls; the bad calls go to `a` only.
struct twin {
  cache_t a, b;
  rng r{42};
  std::vector<qevict::sequence_id> ids;

  bool manual;

  explicit twin(qevict::options opt = {})
      : a(geo, tight, lim, opt), b(geo, tight, lim, opt), manual(opt.routing == qevict::routing_mode::manual) {
    for (int n : {50, 10}) {
      const qevict::sequence_id s = a.add_sequence(7);
      REQUIRE(b.add_sequence(7) == s);
      ids.push_back(s);
      for (int l = 0; l < geo.layers; ++l) {
        const auto q = r.normals(n * qrow), k = r.normals(n * krow), v = r.normals(n * krow);
        std::vector<float> out(n * qrow);
        a.prefill(l, s, q, k, v, out);
        b.prefill(l, s, q, k, v, out);
      }
    }
    for (int t = 0; t < 12; ++t) step();
  }

  /// One valid decode step of both caches; returns true when their outputs are bit-identical.
  bool step() {
    bool same = true;
    // With manual routing the engine routes: here, whenever a recent region is full.
    for (qevict::sequence_id s : ids)
      if (manual && a.counts(s, 0).recent_tokens >= static_cast<std::size_t>(a.plan().recent_capacity)) {
        a.route(s);
        b.route(s);
      }
    for (int l = 0; l < geo.layers; ++l) {
      const auto k = r.normals(ids.size() * krow), v = r.normals(ids.size() * krow), q = r.normals(ids.size() * qrow);
      a.append(l, ids, k, v);
      b.append(l, ids, k, v);
      std::vector<float> oa(ids.size() * qrow), ob(ids.size() * qrow);
      a.attend(l, ids, q, oa);
      b.attend(l, ids, q, ob);
      same = same && oa == ob;
    }
    return same;
  }

  /// A new sequence in both caches, for prefills that must fail.
  qevict::sequence_id add_fresh() {
    const qevict::sequence_id s = a.add_sequence();
    REQUIRE(b.add_sequence() == s);
    return s;
  }
  /// After the failed prefills: `s` holds no token, and leaves both caches.
  void remove_fresh(qevict::sequence_id s) {
    CHECK(a.tokens(s, 0) == 0);
    a.remove_sequence(s);
    b.remove_sequence(s);
  }

  /// The whole observable state of `a` equals that of `b`, and the next step agrees.
  void check_unchanged() {
    CHECK(a.report().to_string() == b.report().to_string());
    for (qevict::sequence_id s : ids)
      for (int l = 0; l < geo.layers; ++l) {
        CHECK(a.tokens(s, l) == b.tokens(s, l));
        const auto wa = a.windows(s, l), wb = b.windows(s, l);
        REQUIRE(wa.size() == wb.size());
        for (std::size_t i = 0; i < wa.size(); ++i) {
          CHECK(wa[i].where == wb[i].where);
          CHECK(wa[i].score == wb[i].score);
          CHECK(wa[i].has_ledger == wb[i].has_ledger);
          CHECK(wa[i].first_position == wb[i].first_position);
        }
      }
    for (int t = 0; t < 9; ++t) CHECK(step());  // past the next routing event too
  }
};

/// The call throws qevict::error and its message contains `what`.
template <class F>
void expect_error(F&& call, const std::string& what) {
  CAPTURE(what);
  try {
    call();
    FAIL("no qevict::error was thrown");
  } catch (const qevict::error& e) {
    const std::string message = e.what();
    CAPTURE(message);
    CHECK(message.find(what) != std::string::npos);
    CHECK(message.rfind("qevict: ", 0) == 0);
  }
}

}  // namespace

TEST_CASE("construction: budget too small, external storage too small or misaligned, bad geometry") {
  expect_error([] { cache_t kv(geo, qevict::budget::bytes_per_sequence_layer(6783), lim); }, "at least 6784 bytes are needed");
  expect_error([] { cache_t kv(geo, qevict::budget::fraction(0.01), lim); }, "cannot hold the 5 sinks");
  expect_error([] { cache_t kv(geo, qevict::budget::fraction(1.5), lim); }, "the fraction must be in (0, 1]");
  const std::size_t need = cache_t::required_bytes(geo, tight, lim);
  std::vector<std::byte> arena(need + 32);
  expect_error([&] { cache_t kv(geo, tight, lim, qevict::storage::external{arena.data(), need - 1}); }, "smaller than the");
  expect_error([&] { cache_t kv(geo, tight, lim, qevict::storage::external{nullptr, need}); }, "null pointer");
  auto* misaligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(arena.data()) + 16) / 16 * 16 + 4);
  expect_error([&] { cache_t kv(geo, tight, lim, qevict::storage::external{misaligned, need}); }, "16-byte aligned");
  qevict::geometry odd = geo;
  odd.q_heads = 3;
  expect_error([&] { cache_t kv(odd, tight, lim); }, "multiple of kv_heads");
  odd = geo;
  odd.head_dim = 12;
  expect_error([&] { cache_t kv(odd, tight, lim); }, "multiple of 8");
  expect_error([] { cache_t kv(geo, tight, lim, qevict::options{.observation_window = 0}); }, "observation_window");
  // RoPE's parameters: every one that is used must make finite frequencies.
  odd = geo;
  odd.rope.theta = std::numeric_limits<float>::infinity();
  expect_error([&] { cache_t kv(odd, tight, lim); }, "rope.theta must be positive and finite");
  odd = geo;
  odd.rope.llama3_factor = std::numeric_limits<float>::infinity();
  expect_error([&] { cache_t kv(odd, tight, lim); }, "rope.llama3_factor must be finite");
  odd.rope.llama3_factor = 8.0f;
  odd.rope.llama3_low_freq_factor = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { cache_t kv(odd, tight, lim); }, "rope.llama3_low_freq_factor must be positive");
  odd.rope.llama3_low_freq_factor = 4.0f;  // not below the high-frequency factor (4)
  expect_error([&] { cache_t kv(odd, tight, lim); }, "rope.llama3_high_freq_factor finite and larger than it");
  odd.rope.llama3_low_freq_factor = 1.0f;
  CHECK_NOTHROW(cache_t(odd, tight, lim));  // Llama-3's own values
  // Sizes at the ends of their types: refused by name, or accepted exactly.
  expect_error([] { cache_t kv(geo, tight, qevict::limits{.max_batch = 1, .max_tokens = std::numeric_limits<int>::max()}); },
               "limits: max_tokens (2147483647) must be at most 1073741824");
  expect_error([] { cache_t kv(geo, qevict::budget::bytes_per_sequence_layer(std::numeric_limits<std::size_t>::max()), lim); },
               "budget::bytes_per_sequence_layer(18446744073709551615): at most 281474976710656 bytes (2^48)");
  const cache_t huge(geo, qevict::budget::bytes_per_sequence_layer(qevict::budget::largest_bytes), lim);
  CHECK(huge.plan().budget_bytes == qevict::budget::largest_bytes);
  // A fraction of a cache too large to plan: 2^28 KV heads of 512 f32 channels, 2^30 tokens.
  qevict::geometry wide{
      .layers = 1, .q_heads = 1 << 28, .kv_heads = 1 << 28, .head_dim = 512, .element = qevict::element_type::f32};
  expect_error(
      [&] {
        (void)cache_t::required_bytes(wide, qevict::budget::fraction(1.0), qevict::limits{.max_tokens = 1 << 30});
      },
      "budget::fraction(1) comes to 1.181e+21 bytes per sequence in layer 0, more than 2^48");
  // An arena whose size would wrap around 2^64: a sequence of 64 layers of 2^30 tokens (4 KiB a
  // token, a budget of 2^42 bytes a layer) takes 1.57e14 bytes, and 2^17 of them 2.06e19, which
  // wrapped around to 2.14e18 before the check.
  const qevict::geometry llama{
      .layers = 64, .q_heads = 32, .kv_heads = 8, .head_dim = 128, .element = qevict::element_type::bf16};
  const std::size_t one = cache_t::required_bytes(llama, qevict::budget::fraction(1.0),
                                                  qevict::limits{.max_batch = 1, .max_tokens = 1 << 30});
  CHECK(one == 157082423656448u);
  expect_error(
      [&] {
        (void)cache_t::required_bytes(llama, qevict::budget::fraction(1.0),
                                      qevict::limits{.max_batch = 1 << 17, .max_tokens = 1 << 30});
      },
      "limits: an arena of max_batch = 131072 sequences of 157082423656448 bytes each would exceed 2^62 bytes");
  // Just under the bound it is planned (2^14 such sequences: about 2^61 bytes).
  CHECK(cache_t::required_bytes(llama, qevict::budget::fraction(1.0),
                                qevict::limits{.max_batch = 1 << 14, .max_tokens = 1 << 30}) == one << 14);
  cache_t kv(geo, tight, lim);
  const long long last = std::numeric_limits<long long>::max() - lim.max_tokens;
  expect_error([&] { kv.add_sequence(last + 1); }, "add_sequence: first_position 9223372036854775728 leaves no room for limits::max_tokens = 80 positions");
  CHECK(kv.add_sequence(last) == 0);  // its last position is the largest long long
}

TEST_CASE("prefill: shapes, non-finite values, non-empty sequence, max_tokens") {
  twin t;
  const qevict::sequence_id s0 = t.ids[0];
  const qevict::sequence_id fresh = t.add_fresh();
  const int n = 6;
  auto q = t.r.normals(n * qrow), k = t.r.normals(n * krow), v = t.r.normals(n * krow);
  std::vector<float> out(n * qrow);
  expect_error([&] { t.a.prefill(0, fresh, q, std::span(k).first(k.size() - 1), v, out); }, "not a positive multiple of kv_heads*head_dim");
  expect_error([&] { t.a.prefill(0, fresh, q, k, std::span(v).first(krow), out); }, "v has 16 floats, expected 96");
  expect_error([&] { t.a.prefill(0, fresh, std::span(q).first(qrow), k, v, out); }, "q has 32 floats, expected 192");
  expect_error([&] { t.a.prefill(0, fresh, q, k, v, std::span(out).first(1)); }, "out has 1 floats");
  expect_error([&] { t.a.prefill(0, fresh, q, std::span<const float>(), v, out); }, "not a positive multiple");
  auto bad = k;
  bad[17] = std::numeric_limits<float>::infinity();
  expect_error([&] { t.a.prefill(0, fresh, q, bad, v, out); }, "prefill: k[17] is infinite");
  auto nan_q = q;
  nan_q[3] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { t.a.prefill(1, fresh, nan_q, k, v, out); }, "prefill: q[3] is NaN");
  expect_error([&] { t.a.prefill(0, s0, q, k, v, out); }, "already holds 62 tokens in layer 0");
  expect_error([&] { t.a.prefill(2, fresh, q, k, v, out); }, "layer 2 is out of range [0, 2)");
  const int big = lim.max_tokens + 1;
  auto bq = t.r.normals(big * qrow), bk = t.r.normals(big * krow), bv = t.r.normals(big * krow);
  std::vector<float> bo(big * qrow);
  expect_error([&] { t.a.prefill(0, fresh, bq, bk, bv, bo); }, "exceeds limits::max_tokens = 80");
  t.remove_fresh(fresh);
  t.check_unchanged();
}

TEST_CASE("append, attend and prefill: finite inputs beyond their limits") {
  // Keys and values beyond ±2^14 and queries beyond ±2^17 (numeric::largest_magnitude) are
  // refused, whatever the element type (this cache's is f32), and the cache is as before.
  twin t;
  using qevict::numeric::input;
  CHECK(qevict::numeric::largest_magnitude(input::key) == 16384.0f);
  auto k = t.r.normals(2 * krow), v = t.r.normals(2 * krow), q = t.r.normals(2 * qrow);
  std::vector<float> out(2 * qrow);
  auto big_k = k, big_v = v, big_q = q;
  big_k[krow + 3] = 3e4f;
  big_v[5] = -16384.5f;
  big_q[qrow + 2] = 2e5f;
  expect_error([&] { t.a.append(0, t.ids, big_k, v); },
               "append: k[19] = 30000 is beyond ±16384, the largest magnitude the cache accepts in a key or value");
  expect_error([&] { t.a.append(1, t.ids, k, big_v); }, "append: v[5] = -16384.5 is beyond ±16384");
  t.a.append(0, t.ids, k, v);  // the attend needs this step's token, in both caches
  t.b.append(0, t.ids, k, v);
  expect_error([&] { t.a.attend(0, t.ids, big_q, out); },
               "attend: q[34] = 200000 is beyond ±131072, the largest magnitude the cache accepts in a query");
  std::vector<float> oa(2 * qrow), ob(2 * qrow);
  t.a.attend(0, t.ids, q, oa);
  t.b.attend(0, t.ids, q, ob);
  CHECK(oa == ob);
  for (int l = 1; l < geo.layers; ++l) {  // the rest of the step
    t.a.append(l, t.ids, k, v);
    t.b.append(l, t.ids, k, v);
    t.a.attend(l, t.ids, q, oa);
    t.b.attend(l, t.ids, q, ob);
  }
  const qevict::sequence_id fresh = t.add_fresh();
  const int n = 4;
  auto pq = t.r.normals(n * qrow), pk = t.r.normals(n * krow), pv = t.r.normals(n * krow);
  std::vector<float> pout(n * qrow);
  auto big_pv = pv, big_pq = pq;
  big_pv[n * krow - 1] = 32768.0f;
  big_pq[0] = -1e6f;
  expect_error([&] { t.a.prefill(0, fresh, pq, pk, big_pv, pout); }, "prefill: v[63] = 32768 is beyond ±16384");
  expect_error([&] { t.a.prefill(0, fresh, big_pq, pk, pv, pout); }, "prefill: q[0] = -1e+06 is beyond ±131072");
  t.remove_fresh(fresh);
  t.check_unchanged();
}

namespace {
/// 120 decode steps of one sequence whose every other token holds the limits: one key pair at
/// ±2^14 (signs alternating between tokens, so that a window's channel spans both), one value
/// channel at −2^14, and one query channel at ±2^17. Every output and window score stays finite,
/// through RoPE, quantization (quantized windows exist) and routing.
template <class Config>
void run_at_the_limits(qevict::element_type element) {
  using qevict::numeric::input;
  qevict::geometry g = geo;
  g.element = element;
  CAPTURE(qevict::to_string(element));
  CAPTURE(Config::quantizer::name);
  const float kv = qevict::numeric::largest_magnitude(input::key),
              qmax = qevict::numeric::largest_magnitude(input::query);
  qevict::cache<Config> kv_cache(g, qevict::budget::fraction(0.5), qevict::limits{.max_batch = 1, .max_tokens = 256});
  const qevict::sequence_id s = kv_cache.add_sequence();
  rng r{7};
  std::vector<float> out(qrow);
  for (int step = 0; step < 120; ++step) {
    auto k = r.normals(krow), v = r.normals(krow), q = r.normals(qrow);
    if (step % 2 == 0) {
      const float sign = step % 4 == 0 ? 1.0f : -1.0f;
      k[0] = sign * kv, k[4] = sign * kv;  // rotate_half pairs channel 0 with channel head_dim / 2
      v[1] = -kv;
      q[0] = -sign * qmax;
    }
    for (int l = 0; l < g.layers; ++l) {
      kv_cache.append(l, std::span(&s, 1), k, v);
      kv_cache.attend(l, std::span(&s, 1), q, out);
      for (float x : out) REQUIRE(std::isfinite(x));
    }
  }
  CHECK(kv_cache.counts(s, 0).quantized > 0);  // the extremes went through the quantizer
  for (int l = 0; l < g.layers; ++l)
    for (const auto& w : kv_cache.windows(s, l)) CHECK(std::isfinite(w.score));
}
}  // namespace

TEST_CASE("inputs at their limits stay finite, in every element type and key frame") {
  for (qevict::element_type e : {qevict::element_type::f16, qevict::element_type::bf16, qevict::element_type::f32}) {
    run_at_the_limits<cfg>(e);
    run_at_the_limits<qevict::presets::qevict_post_rope::config_type>(e);
    run_at_the_limits<qevict::presets::qevict_window_relative::config_type>(e);
  }
}

TEST_CASE("append and attend: shapes, positions, non-finite values, ids, layers") {
  twin t;
  const auto ids = t.ids;
  auto k = t.r.normals(2 * krow), v = t.r.normals(2 * krow), q = t.r.normals(2 * qrow);
  std::vector<float> out(2 * qrow);
  expect_error([&] { t.a.append(0, ids, std::span(k).first(krow), v); }, "append: k has 16 floats, expected 32");
  expect_error([&] { t.a.append(0, ids, k, std::span(v).first(3)); }, "append: v has 3 floats, expected 32");
  expect_error([&] { t.a.attend(0, ids, std::span(q).first(qrow), out); }, "attend: q has 32 floats, expected 64");
  expect_error([&] { t.a.attend(0, ids, q, std::span(out).first(5)); }, "attend: out has 5 floats, expected 64");
  // Positions: the second sequence's is wrong, so the first must not be appended either.
  const long long next0 = 7 + t.a.tokens(ids[0], 0), next1 = 7 + t.a.tokens(ids[1], 0);
  expect_error([&] { t.a.append(0, ids, k, v, std::vector<long long>{next0, next1 + 1}); },
               "position " + std::to_string(next1 + 1) + " of sequence 1 in layer 0 is not the next position " + std::to_string(next1));
  expect_error([&] { t.a.append(0, ids, k, v, std::vector<long long>{next0 - 1, next1}); }, "is not the next position");
  expect_error([&] { t.a.append(0, ids, k, v, std::vector<long long>{next0}); }, "positions has 1 entries for 2 sequences");
  // Non-finite values in the second sequence's row.
  auto nan_k = k, inf_v = v, nan_q = q;
  nan_k[krow + 2] = std::numeric_limits<float>::quiet_NaN();
  inf_v[krow + 5] = -std::numeric_limits<float>::infinity();
  nan_q[qrow + 1] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { t.a.append(0, ids, nan_k, v); }, "append: k[18] is NaN");
  expect_error([&] { t.a.append(1, ids, k, inf_v); }, "append: v[21] is infinite");
  expect_error([&] { t.a.attend(0, ids, nan_q, out); }, "attend: q[33] is NaN");
  // Sequence ids and layers.
  const std::vector<qevict::sequence_id> unknown = {ids[0], 2}, dup = {ids[1], ids[1]}, negative = {-1, ids[0]};
  expect_error([&] { t.a.append(0, unknown, k, v); }, "append: sequence 2 is not in the cache");
  expect_error([&] { t.a.attend(0, negative, q, out); }, "attend: sequence -1 is not in the cache");
  expect_error([&] { t.a.append(0, dup, k, v); }, "sequence 1 is listed twice in one batch");
  expect_error([&] { t.a.attend(0, dup, q, out); }, "listed twice");
  expect_error([&] { t.a.append(2, ids, k, v); }, "append: layer 2 is out of range [0, 2)");
  expect_error([&] { t.a.attend(-1, ids, q, out); }, "attend: layer -1 is out of range");
  expect_error([&] { t.a.append(0, std::span<const qevict::sequence_id>(), {}, {}); }, "lists no sequence");
  expect_error([&] { (void)t.a.tokens(ids[0], 7); }, "tokens: layer 7 is out of range");
  expect_error([&] { t.a.set_score(ids[0], 0, 0, std::numeric_limits<float>::infinity()); }, "score must be finite");
  expect_error([&] { t.a.set_score(ids[0], 0, 999, 1.0f); }, "window 999 does not exist");
  // Routing units: this cache has one per window (selection::per_layer).
  expect_error([&] { t.a.set_score(ids[0], 0, 0, 1.0f, 1); }, "set_score: unit 1 does not exist (the cache has 1 routing unit per window; -1 means all of them)");
  expect_error([&] { t.a.set_score(ids[0], 0, 0, 1.0f, -2); }, "set_score: unit -2 does not exist");
  expect_error([&] { (void)t.a.ledger_record(ids[0], 0, 0, -1); }, "ledger_record: unit -1 does not exist (the cache has 1 routing unit per window)");
  std::vector<float> wk(8 * krow), wv(8 * krow);
  expect_error([&] { t.a.read_window(ids[0], 0, 0, std::span(wk).first(3), wv); }, "k_post has 3 floats");
  t.check_unchanged();
}

TEST_CASE("removed sequences, too many sequences, max_tokens reached, attend before append") {
  twin t;
  const qevict::sequence_id extra = t.a.add_sequence();
  REQUIRE(t.b.add_sequence() == extra);
  expect_error([&] { (void)t.a.add_sequence(); }, "all 3 sequence slots (limits::max_batch) are in use");
  expect_error([&] { (void)t.a.add_sequence(-1); }, "first_position must be >= 0");
  // Attend on a sequence with no token in that layer.
  const std::vector<qevict::sequence_id> with_empty = {t.ids[0], extra};
  std::vector<float> q = t.r.normals(2 * qrow), out(2 * qrow);
  expect_error([&] { t.a.attend(0, with_empty, q, out); }, "sequence 2 has no tokens in layer 0");
  t.a.remove_sequence(extra);
  t.b.remove_sequence(extra);
  const std::vector<qevict::sequence_id> removed = {extra};
  const auto k = t.r.normals(krow), v = t.r.normals(krow);
  expect_error([&] { t.a.append(0, removed, k, v); }, "sequence 2 is not in the cache");
  expect_error([&] { t.a.remove_sequence(extra); }, "remove_sequence: sequence 2 is not in the cache");
  expect_error([&] { (void)t.a.windows(extra, 0); }, "windows: sequence 2 is not in the cache");
  expect_error([&] { t.a.route(extra); }, "route: sequence 2 is not in the cache");
  t.check_unchanged();

  // Fill sequence 1 of both caches to max_tokens, then one more append must fail in the batch.
  const std::vector<qevict::sequence_id> one = {t.ids[1]};
  while (t.a.tokens(t.ids[1], 0) < lim.max_tokens)
    for (int l = 0; l < geo.layers; ++l) {
      const auto kk = t.r.normals(krow), vv = t.r.normals(krow), qq = t.r.normals(qrow);
      std::vector<float> oa(qrow), ob(qrow);
      t.a.append(l, one, kk, vv);
      t.b.append(l, one, kk, vv);
      t.a.attend(l, one, qq, oa);
      t.b.attend(l, one, qq, ob);
    }
  const auto k2 = t.r.normals(2 * krow), v2 = t.r.normals(2 * krow);
  expect_error([&] { t.a.append(0, t.ids, k2, v2); }, "sequence 1 reached limits::max_tokens = 80 in layer 0");
  CHECK(t.a.report().to_string() == t.b.report().to_string());
  CHECK(t.a.tokens(t.ids[0], 0) == t.b.tokens(t.ids[0], 0));
}

TEST_CASE("manual routing: append into a full recent region is refused until route()") {
  twin t(qevict::options{.routing = qevict::routing_mode::manual});
  const std::vector<qevict::sequence_id> one = {t.ids[1]};
  // Fill the recent region of sequence 1 (capacity 47 tokens) in both caches.
  while (t.a.counts(t.ids[1], 0).recent_tokens < 47u)
    for (int l = 0; l < geo.layers; ++l) {
      const auto kk = t.r.normals(krow), vv = t.r.normals(krow);
      t.a.append(l, one, kk, vv);
      t.b.append(l, one, kk, vv);
    }
  const auto k = t.r.normals(2 * krow), v = t.r.normals(2 * krow);
  expect_error([&] { t.a.append(0, t.ids, k, v); },
               "append: the recent region of sequence 1 in layer 0 is full; with routing_mode::manual call route() first");
  CHECK(t.a.report().to_string() == t.b.report().to_string());
  // route() makes room; the next steps (appends to both sequences) then succeed in both caches.
  t.a.route(t.ids[1]);
  t.b.route(t.ids[1]);
  CHECK(t.a.counts(t.ids[1], 0).recent_tokens < 47u);
  t.check_unchanged();
}

TEST_CASE("per-KV-head selection: set_score and ledger_record address one routing unit (KV head)") {
  using per_head = qevict::config<>::with_selection<qevict::selection::per_kv_head>;
  qevict::cache<per_head> kv(geo, qevict::budget::fraction(0.6), qevict::limits{.max_batch = 1, .max_tokens = 160});
  const qevict::sequence_id s = kv.add_sequence(0);
  rng r{7};
  for (int l = 0; l < geo.layers; ++l) {
    const auto q = r.normals(80 * qrow), k = r.normals(80 * krow), v = r.normals(80 * krow);
    std::vector<float> out(80 * qrow);
    kv.prefill(l, s, q, k, v, out);
  }
  kv.set_score(s, 1, 2, 5.0f, 1);  // KV head 1 of window 2 only
  for (const qevict::window_info& w : kv.windows(s, 1))
    if (w.index == 2) CHECK((w.unit == 1) == (w.score == 5.0f));
  kv.set_score(s, 1, 3, 7.0f);  // every unit
  int set = 0;
  for (const qevict::window_info& w : kv.windows(s, 1)) set += w.index == 3 && w.score == 7.0f;
  CHECK(set == geo.kv_heads);
  expect_error([&] { kv.set_score(s, 1, 3, 1.0f, 2); }, "set_score: unit 2 does not exist (the cache has 2 routing units per window");
  // Each KV head's record holds that head only.
  int records = 0;
  for (const qevict::window_info& w : kv.windows(s, 0))
    if (w.has_ledger) {
      CHECK(kv.ledger_record(s, 0, w.index, w.unit).size() == kv.plan().quantized_window_bytes());
      ++records;
    }
  CHECK(records > 0);
  expect_error([&] { (void)kv.ledger_record(s, 0, 0, 2); }, "ledger_record: unit 2 does not exist");
}

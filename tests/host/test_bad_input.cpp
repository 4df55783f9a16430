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

TEST_CASE("append and prefill: finite keys and values too large for the cache's element type") {
  // An f32 cache refuses keys and values beyond a quarter of float's range, and the cache is as
  // before; queries need only be finite.
  twin t;
  const float limit = qevict::numeric::largest_kv_magnitude(geo.element);
  CHECK(limit == std::numeric_limits<float>::max() / 4);
  auto k = t.r.normals(2 * krow), v = t.r.normals(2 * krow), q = t.r.normals(2 * qrow);
  auto big_k = k, big_v = v;
  big_k[krow + 3] = 3e38f;
  big_v[5] = -1e38f;
  expect_error([&] { t.a.append(0, t.ids, big_k, v); }, "append: k[19] = 3e+38 is beyond ±8.50706e+37, the largest "
                                                         "magnitude of a key or value that a cache of f32 elements accepts");
  expect_error([&] { t.a.append(1, t.ids, k, big_v); }, "append: v[5] = -1e+38 is beyond ±8.50706e+37");
  const qevict::sequence_id fresh = t.add_fresh();
  const int n = 4;
  auto pq = t.r.normals(n * qrow), pk = t.r.normals(n * krow), pv = t.r.normals(n * krow);
  pv[n * krow - 1] = 2 * limit;
  std::vector<float> out(n * qrow);
  expect_error([&] { t.a.prefill(0, fresh, pq, pk, pv, out); }, "prefill: v[63] = ");
  t.remove_fresh(fresh);
  t.check_unchanged();
}

TEST_CASE("an f16 cache: keys and values at its limit stay finite through rotation, quantization and routing") {
  // f16 holds ±65504: a key of 1e5, finite as a float, would be stored as an infinity and make
  // every later output NaN, so it is refused. Half the range is accepted: RoPE grows a key pair by
  // at most √2, and the quantizers' ranges are formed in float.
  qevict::geometry g16 = geo;
  g16.element = qevict::element_type::f16;
  const float limit = qevict::numeric::largest_kv_magnitude(g16.element);
  CHECK(limit == 32752.0f);
  cache_t kv(g16, qevict::budget::fraction(0.5), qevict::limits{.max_batch = 1, .max_tokens = 256});
  const qevict::sequence_id s = kv.add_sequence();
  rng r{7};
  auto k = r.normals(krow), v = r.normals(krow), q = r.normals(qrow);
  std::vector<float> out(qrow);
  auto too_big = k;
  too_big[0] = 1e5f;
  expect_error([&] { kv.append(0, std::span(&s, 1), too_big, v); },
               "append: k[0] = 100000 is beyond ±32752, the largest magnitude of a key or value that a cache of f16 elements accepts");
  CHECK(kv.tokens(s, 0) == 0);
  for (int step = 0; step < 120; ++step) {
    k = r.normals(krow), v = r.normals(krow), q = r.normals(qrow);
    // Every other token holds the extremes in one key pair and one value channel.
    if (step % 2 == 0) {
      k[0] = limit, k[4] = -limit;  // rotate_half pairs channel 0 with channel head_dim / 2
      v[1] = -limit;
    }
    for (int l = 0; l < geo.layers; ++l) {
      kv.append(l, std::span(&s, 1), k, v);
      kv.attend(l, std::span(&s, 1), q, out);
      for (float x : out) REQUIRE(std::isfinite(x));
    }
  }
  const qevict::tier_counts c = kv.counts(s, 0);
  CHECK(c.quantized > 0);  // the extremes went through the quantizer
  for (int l = 0; l < geo.layers; ++l)
    for (const auto& w : kv.windows(s, l)) CHECK(std::isfinite(w.score));
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

// Attention mass as the attend observer reports it: it sums to one per sequence and step over the
// sink, recent, Full and Quantized tiers; with an everything budget it equals the dense
// reference's head-averaged probabilities; and every window's score is exactly its prefill
// observation-window mass plus the masses observed since (Eq. 1, cumulative scorer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <vector>

#include <qevict/cache.hpp>

#include "support/driver.hpp"
#include "support/reference.hpp"

using namespace qevict_test;
using qevict::tier;

namespace {

struct observed {
  std::vector<double> total;                    // [batch index] sum of probabilities this step
  std::vector<std::vector<double>> per_token;   // [batch index][token]
};

/// Prefill scores by the definition: the last `obs` prompt queries' head-averaged probabilities
/// summed over each window's tokens.
std::vector<double> prefill_scores(const history& h, int q_heads, const rope_spec& r, const std::vector<float>& q, int obs,
                                   int sinks, int window) {
  const int n = h.size();
  const std::size_t qrow = static_cast<std::size_t>(q_heads) * h.head_dim;
  std::vector<double> scores(static_cast<std::size_t>(n), 0.0), out, probs;
  for (int i = std::max(0, n - obs); i < n; ++i) {
    dense_attend(h, q_heads, r, &q[i * qrow], i + 1, out, &probs);
    for (int j = sinks; j <= i; ++j) scores[static_cast<std::size_t>((j - sinks) / window)] += probs[j];
  }
  return scores;
}

template <class Config>
void run(qevict::budget budget, bool compare_dense, std::uint64_t seed) {
  qevict::geometry g{.layers = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 16};
  const qevict::limits lim{.max_batch = 3, .max_tokens = 512};
  const int obs = 32, sinks = 5, window = 8;
  qevict::cache<Config> kv(g, budget, lim, qevict::options{.observation_window = obs});
  histories hs;
  rng r(seed);
  const std::size_t krow = 2 * 16, qrow = 4 * 16;
  const std::vector<int> prompts = {60, 130, 9};
  std::vector<qevict::sequence_id> ids;
  // expected[s][layer][window]: the score each window must carry.
  std::map<qevict::sequence_id, std::vector<std::vector<double>>> expected;
  for (int n : prompts) {
    const qevict::sequence_id s = add_sequence(kv, hs, 3 * n);
    ids.push_back(s);
    expected[s].resize(2);
    for (int l = 0; l < 2; ++l) {
      const std::vector<float> q = r.normals(n * qrow, 2.0f), k = r.normals(n * krow), v = r.normals(n * krow);
      std::vector<float> out(n * qrow);
      kv.prefill(l, s, q, k, v, out);
      for (int i = 0; i < n; ++i) hs.at(s, l).push(&k[i * krow], &v[i * krow]);
      expected[s][l] = prefill_scores(hs.at(s, l), 4, rope_of(g), q, obs, sinks, window);
      expected[s][l].resize(lim.max_tokens, 0.0);
    }
  }
  int steps_checked = 0;
  double worst_total = 0.0, worst_prob = 0.0, worst_score = 0.0;
  std::map<tier, int> seen;
  int bad_events = 0;
  for (int t = 0; t < 300; ++t) {
    std::vector<qevict::sequence_id> batch;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if ((t + static_cast<int>(i)) % 3 != 0) batch.push_back(ids[i]);
    for (int l = 0; l < 2; ++l) {
      const std::vector<float> k = r.normals(batch.size() * krow), v = r.normals(batch.size() * krow);
      const std::vector<float> q = r.normals(batch.size() * qrow, 2.0f);
      kv.append(l, batch, k, v);
      for (std::size_t b = 0; b < batch.size(); ++b) hs.at(batch[b], l).push(&k[b * krow], &v[b * krow]);
      observed o;
      o.total.assign(batch.size(), 0.0);
      o.per_token.resize(batch.size());
      for (std::size_t b = 0; b < batch.size(); ++b) o.per_token[b].assign(hs.at(batch[b], l).size(), -1.0);
      std::vector<float> out(batch.size() * qrow);
      kv.attend(l, batch, q, out, [&](const qevict::attention_event& e) {
        const std::size_t b = static_cast<std::size_t>(e.batch_index);
        o.total[b] += e.probability;
        ++seen[e.where];
        const int w = e.token < sinks ? -1 : (e.token - sinks) / window;
        if (e.where == tier::evicted || e.window != w || o.per_token[b][e.token] != -1.0) ++bad_events;
        if ((e.where == tier::sink) != (e.token < sinks)) ++bad_events;
        o.per_token[b][e.token] = e.probability;
        if (w >= 0) expected[batch[b]][l][static_cast<std::size_t>(w)] += e.probability;
      });
      for (std::size_t b = 0; b < batch.size(); ++b) {
        worst_total = std::max(worst_total, std::abs(o.total[b] - 1.0));
        if (compare_dense) {
          const history& h = hs.at(batch[b], l);
          std::vector<double> ref, probs;
          dense_attend(h, 4, rope_of(g), &q[b * qrow], h.size(), ref, &probs);
          for (int j = 0; j < h.size(); ++j)
            worst_prob = std::max(worst_prob, std::abs(o.per_token[b][j] - probs[j]) / (probs[j] + 1e-4));
        }
        ++steps_checked;
      }
    }
    // Scores equal prefill mass + every observed mass, for every window, evicted ones included.
    for (qevict::sequence_id s : ids)
      for (int l = 0; l < 2; ++l)
        for (const qevict::window_info& w : kv.windows(s, l)) {
          const double want = expected[s][l][static_cast<std::size_t>(w.index)];
          worst_score = std::max(worst_score, std::abs(static_cast<double>(w.score) - want) / std::max(1.0, want));
        }
  }
  CHECK(steps_checked > 300);
  CHECK(worst_total <= 1e-5);
  CHECK(worst_score <= 1e-5);
  CHECK(bad_events == 0);
  if (compare_dense) {
    CHECK(worst_prob <= 1e-5);
    CHECK(seen[tier::quantized] == 0);
    CHECK(seen[tier::evicted] == 0);
  } else {
    // The compressed run really exercised every tier.
    CHECK(seen[tier::quantized] > 0);
    CHECK(seen[tier::full] > 0);
    std::size_t evicted = 0;
    for (qevict::sequence_id s : ids) evicted += kv.counts(s, 0).evicted;
    CHECK(evicted > 0);
  }
  CHECK(seen[tier::sink] > 0);
  CHECK(seen[tier::recent] > 0);
}

}  // namespace

TEST_CASE("20% budget, paper config: probabilities sum to one per sequence; scores are the observed masses") {
  run<qevict::paper_config>(qevict::budget::fraction(0.2), false, 1);
}

TEST_CASE("everything budget: observed probabilities equal the dense reference; scores are the observed masses") {
  run<qevict::paper_config>(qevict::budget::everything(), true, 2);
}

#pragma once
// Drives a qevict::cache and a dense reference side by side: random pre-RoPE q/k/v per
// (sequence, layer), prefill and ragged decode batches, and the histories the reference needs.

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include <qevict/cache.hpp>

#include "support/reference.hpp"

namespace qevict_test {

/// The histories of every (sequence, layer) a test created, keyed by sequence id.
struct histories {
  std::map<qevict::sequence_id, std::vector<history>> by_sequence;  // [layer]
  history& at(qevict::sequence_id s, int layer) { return by_sequence.at(s)[static_cast<std::size_t>(layer)]; }
};

inline rope_spec rope_of(const qevict::geometry& g) { return rope_spec{static_cast<double>(g.rope.theta), g.rope.layout}; }

/// Adds a sequence to the cache and an empty history for each layer.
template <class Cache>
qevict::sequence_id add_sequence(Cache& kv, histories& hs, long long first_position = 0) {
  const qevict::geometry& g = kv.geo();
  const qevict::sequence_id s = kv.add_sequence(first_position);
  hs.by_sequence[s] = std::vector<history>(static_cast<std::size_t>(g.layers), history(g.kv_heads, g.head_dim, first_position));
  return s;
}

/// Prefills `n` random tokens into every layer of `s`; returns the largest relative error of the
/// prefill output against dense causal attention (row by row).
template <class Cache>
double prefill_random(Cache& kv, histories& hs, qevict::sequence_id s, int n, rng& r, float query_sigma = 1.0f) {
  const qevict::geometry& g = kv.geo();
  const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
  const std::size_t qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;
  double worst = 0.0;
  for (int l = 0; l < g.layers; ++l) {
    const std::vector<float> q = r.normals(n * qrow, query_sigma), k = r.normals(n * krow), v = r.normals(n * krow);
    std::vector<float> out(n * qrow);
    kv.prefill(l, s, q, k, v, out);
    history& h = hs.at(s, l);
    for (int i = 0; i < n; ++i) h.push(&k[i * krow], &v[i * krow]);
    std::vector<double> ref;
    for (int i = 0; i < n; ++i) {
      dense_attend(h, g.q_heads, rope_of(g), &q[i * qrow], i + 1, ref);
      worst = std::max(worst, relative_error(std::span<const float>(&out[i * qrow], qrow), ref));
    }
  }
  return worst;
}

/// One decode step of every layer for a ragged batch: append a random token to each listed
/// sequence, attend with a random query. Returns the outputs, [layer][batch][q_heads][head_dim].
template <class Cache, class Observer = qevict::no_observer>
std::vector<std::vector<float>> decode_random(Cache& kv, histories& hs, std::span<const qevict::sequence_id> batch, rng& r,
                                              std::vector<std::vector<float>>* queries = nullptr,
                                              Observer&& observe = {}, float query_sigma = 1.0f) {
  const qevict::geometry& g = kv.geo();
  const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
  const std::size_t qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;
  std::vector<std::vector<float>> outs(static_cast<std::size_t>(g.layers));
  if (queries) queries->assign(static_cast<std::size_t>(g.layers), {});
  for (int l = 0; l < g.layers; ++l) {
    const std::vector<float> k = r.normals(batch.size() * krow), v = r.normals(batch.size() * krow);
    const std::vector<float> q = r.normals(batch.size() * qrow, query_sigma);
    kv.append(l, batch, k, v);
    for (std::size_t b = 0; b < batch.size(); ++b) hs.at(batch[b], l).push(&k[b * krow], &v[b * krow]);
    outs[l].assign(batch.size() * qrow, 0.0f);
    kv.attend(l, batch, q, outs[l], observe);
    if (queries) (*queries)[l] = q;
  }
  return outs;
}

/// `steps` decode steps over a ragged batch drawn from `ids` (each sequence sits out every fourth
/// step; with `shuffle`, odd steps list them in reverse order), each output compared with a
/// double-precision dense attention over the sequence's whole history. Returns the worst
/// relative error.
template <class Cache>
double worst_decode_error_vs_dense(Cache& kv, histories& hs, const std::vector<qevict::sequence_id>& ids, int steps,
                                   rng& r, bool shuffle) {
  const qevict::geometry& g = kv.geo();
  const std::size_t qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;
  double worst = 0.0;
  for (int t = 0; t < steps; ++t) {
    std::vector<qevict::sequence_id> batch;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if ((t + static_cast<int>(i)) % 4 != 0) batch.push_back(ids[i]);
    if (shuffle && t % 2) std::reverse(batch.begin(), batch.end());
    std::vector<std::vector<float>> queries;
    const auto outs = decode_random(kv, hs, batch, r, &queries, qevict::no_observer{}, 2.0f);
    for (int l = 0; l < g.layers; ++l)
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const history& h = hs.at(batch[b], l);
        std::vector<double> ref;
        dense_attend(h, g.q_heads, rope_of(g), &queries[l][b * qrow], h.size(), ref);
        worst = std::max(worst, relative_error(std::span<const float>(&outs[l][b * qrow], qrow), ref));
      }
  }
  return worst;
}

}  // namespace qevict_test

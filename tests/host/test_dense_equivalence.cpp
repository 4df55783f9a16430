// With a budget that keeps every window Full, the cache is plain causal attention: prefill and
// every decode step must match a double-precision dense attention over all tokens (own RoPE),
// for ragged batches, GQA ratios 1/2/4, head_dim 8/16/64 and both RoPE pair layouts.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include <qevict/cache.hpp>

#include "support/driver.hpp"
#include "support/reference.hpp"

using namespace qevict_test;

namespace {

struct dense_case {
  int q_heads, kv_heads, head_dim;
  qevict::rope_layout layout;
  float theta;
};

template <class Config>
void check_dense(const dense_case& c, qevict::budget budget, std::uint64_t seed) {
  CAPTURE(c.q_heads);
  CAPTURE(c.kv_heads);
  CAPTURE(c.head_dim);
  CAPTURE(static_cast<int>(c.layout));
  qevict::geometry g;
  g.layers = 2;
  g.q_heads = c.q_heads;
  g.kv_heads = c.kv_heads;
  g.head_dim = c.head_dim;
  g.rope.layout = c.layout;
  g.rope.theta = c.theta;
  const std::vector<int> prompts = {37, 3, 90};          // ragged, one shorter than the sinks
  const std::vector<long long> first = {0, 11, 1000};    // first positions
  const int steps = c.head_dim >= 64 ? 120 : 200;
  qevict::cache<Config> kv(g, budget, qevict::limits{.max_batch = 3, .max_tokens = 400});
  histories hs;
  rng r(seed);
  std::vector<qevict::sequence_id> ids;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(add_sequence(kv, hs, first[i]));
    CHECK(prefill_random(kv, hs, ids.back(), prompts[i], r, 2.0f) <= 1e-5);
  }
  // Ragged batch: each sequence sits out some steps, and the order changes.
  const double worst = worst_decode_error_vs_dense(kv, hs, ids, steps, r, /*shuffle=*/true);
  CHECK(worst <= 1e-5);
  // Every window that aged out of the recent region is Full; nothing was quantized or evicted.
  std::size_t aged_full = 0;
  for (qevict::sequence_id s : ids)
    for (int l = 0; l < g.layers; ++l) {
      const qevict::tier_counts n = kv.counts(s, l);
      CHECK(n.quantized == 0);
      CHECK(n.evicted == 0);
      CHECK(n.sink_tokens == static_cast<std::size_t>(std::min(kv.tokens(s, l), 5)));
      std::size_t full = 0, recent_windows = 0;
      for (const qevict::window_info& w : kv.windows(s, l)) {
        CHECK((w.where == qevict::tier::full || w.where == qevict::tier::recent));
        CHECK(!w.has_ledger);
        full += w.where == qevict::tier::full;
        recent_windows += w.where == qevict::tier::recent;
      }
      CHECK(full == n.full);
      // Sinks + Full windows + recent tokens account for every token.
      CHECK(n.sink_tokens + n.full * 8 + n.recent_tokens == static_cast<std::size_t>(kv.tokens(s, l)));
      aged_full += full;
    }
  CHECK(aged_full > 20);  // the run really aged windows out of the recent region
}

const dense_case cases[] = {
    {2, 2, 8, qevict::rope_layout::rotate_half, 10000.0f},    // GQA 1
    {4, 2, 16, qevict::rope_layout::interleaved, 10000.0f},   // GQA 2
    {8, 2, 64, qevict::rope_layout::rotate_half, 500000.0f},  // GQA 4
    {4, 1, 64, qevict::rope_layout::interleaved, 10000.0f},   // GQA 4
    {4, 4, 16, qevict::rope_layout::rotate_half, 10000.0f},   // GQA 1
};

}  // namespace

TEST_CASE("everything budget, paper config: prefill and decode equal dense attention") {
  std::uint64_t seed = 1;
  for (const dense_case& c : cases) check_dense<qevict::paper_config>(c, qevict::budget::everything(), seed++);
}

TEST_CASE("everything budget, two-tier config: prefill and decode equal dense attention") {
  using two_tier = qevict::paper_config::with_allocator<qevict::allocators::two_tier>;
  std::uint64_t seed = 100;
  for (const dense_case& c : cases) check_dense<two_tier>(c, qevict::budget::everything(), seed++);
}

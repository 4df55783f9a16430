// The smallest complete use of qevict on a CPU: one cache, a synthetic prompt, 256 decode steps.
// It prints the tier counts as routing events move windows between tiers, then the byte report.
//
// The attention inputs are synthetic but not uniform noise: a few "topic" directions recur, so
// that some old windows regain attention later and get promoted back from the quantized tier.

#include <qevict/cache.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const qevict::geometry geometry{.layers = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 64,
                                  .element = qevict::element_type::bf16,
                                  .rope = {.theta = 500000.0f, .layout = qevict::rope_layout::rotate_half}};
  using config = qevict::config<>;  // the paper: W = 8, 5 sinks, 32 recent, INT2, q = 0.70, Ω = 8
  qevict::cache<config> kv(geometry, qevict::budget::fraction(0.20), qevict::limits{.max_batch = 1, .max_tokens = 2048});
  const qevict::sequence_id seq = kv.add_sequence();

  const int d = geometry.head_dim, kv_row = geometry.kv_heads * d, q_row = geometry.q_heads * d;
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<std::vector<float>> topics(6, std::vector<float>(static_cast<std::size_t>(d)));
  for (auto& t : topics) for (auto& x : t) x = 2.0f * noise(rng);
  // A token about topic `t`: its key (per KV head) leans towards that topic's direction.
  auto token_about = [&](int t, std::vector<float>& out, int heads) {
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c) out[static_cast<std::size_t>(h * d + c)] = topics[static_cast<std::size_t>(t)][static_cast<std::size_t>(c)] + noise(rng);
  };

  const int prompt = 1024;
  std::vector<float> q(static_cast<std::size_t>(prompt * q_row)), k(static_cast<std::size_t>(prompt * kv_row)),
      v(static_cast<std::size_t>(prompt * kv_row)), out(static_cast<std::size_t>(prompt * q_row)), row(static_cast<std::size_t>(q_row));
  for (int i = 0; i < prompt; ++i) {
    token_about((i / 64) % 6, row, geometry.kv_heads);
    std::copy_n(row.begin(), kv_row, k.begin() + i * kv_row);
    for (int c = 0; c < kv_row; ++c) v[static_cast<std::size_t>(i * kv_row + c)] = noise(rng);
    token_about((i / 64) % 6, row, geometry.q_heads);
    std::copy_n(row.begin(), q_row, q.begin() + i * q_row);
  }
  for (int layer = 0; layer < geometry.layers; ++layer) kv.prefill(layer, seq, q, k, v, out);

  auto print_counts = [&](int step) {
    const qevict::tier_counts c = kv.counts(seq, 0);
    std::printf("step %4d  layer 0: %3zu full (%2zu keep a ledger copy)  %3zu quantized  %3zu evicted  %2zu recent tokens\n",
                step, c.full, c.ledger_copies, c.quantized, c.evicted, c.recent_tokens);
  };
  print_counts(0);
  std::vector<float> k1(static_cast<std::size_t>(kv_row)), v1(static_cast<std::size_t>(kv_row)), q1(static_cast<std::size_t>(q_row)),
      o1(static_cast<std::size_t>(q_row));
  for (int step = 1; step <= 256; ++step) {
    const int topic = (step / 32) % 6;  // the decode drifts through the prompt's topics
    for (int layer = 0; layer < geometry.layers; ++layer) {
      token_about(topic, k1, geometry.kv_heads);
      for (auto& x : v1) x = noise(rng);
      token_about(topic, q1, geometry.q_heads);
      kv.append(layer, std::span(&seq, 1), k1, v1);
      kv.attend(layer, std::span(&seq, 1), q1, o1);  // routes itself every 8 steps
    }
    if (step % 32 == 0) print_counts(step);
  }
  std::printf("\n%s", kv.report().to_string().c_str());
  return 0;
}

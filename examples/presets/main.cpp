// Every compared method at one byte budget. Prints presets::match_budgets for one Llama-3.1-8B
// layer (32 query heads, 8 KV heads, head_dim 128, bf16, 4096-token sequences) at 20%, 10% and
// 5% of the uncompressed cache, then runs each preset that fits a 20% budget on the same
// synthetic 512-token prompt and 128 decode steps (one layer, 1024-token limit) and prints its
// tier counts and the bytes it holds.
//
// Switching methods is one line: qevict::cache<qevict::presets::snapkv> kv(geometry, budget, limits);

#include <qevict/cache.hpp>
#include <qevict/presets.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

qevict::geometry llama_layer() {
  qevict::geometry g;
  g.layers = 1;
  g.q_heads = 32;
  g.kv_heads = 8;
  g.head_dim = 128;
  g.element = qevict::element_type::bf16;
  g.rope = {.theta = 500000.0f, .layout = qevict::rope_layout::rotate_half, .llama3_factor = 8.0f};
  return g;
}

void print_table(const qevict::geometry& g, const qevict::limits& lim, double fraction) {
  const qevict::budget b = qevict::budget::fraction(fraction);
  const std::vector<qevict::presets::matched_budget> rows = qevict::presets::match_budgets(g, b, lim);
  std::printf("\n%.0f%% of a %d-token layer cache (%zu B uncompressed):\n", 100.0 * fraction, lim.max_tokens,
              static_cast<std::size_t>(lim.max_tokens) * g.token_bytes());
  std::printf("  %-22s %-4s %10s %10s %7s %7s %6s\n", "preset", "fits", "budget B", "reserved B", "K_f", "K_q", "units");
  for (const qevict::presets::matched_budget& m : rows) {
    if (m.fits) {
      std::printf("  %-22s %-4s %10zu %10zu %7zu %7zu %6zu\n", m.name.c_str(), "yes", m.budget_bytes, m.reserved_bytes,
                  m.caps.full, m.caps.quantized, m.units);
    } else {
      // The reason ends with the bytes the preset would need.
      const std::size_t at = m.why_not.find("needs at least");
      const std::string reason = at == std::string::npos ? m.why_not : m.why_not.substr(at);
      std::printf("  %-22s %-4s %s\n", m.name.c_str(), "no", reason.c_str());
    }
  }
}

/// A prompt and decode stream about a few recurring "topics", so that attention is not uniform.
struct synthetic {
  int d, kv_row, q_row;
  std::mt19937 rng{11};
  std::normal_distribution<float> noise{0.0f, 1.0f};
  std::vector<std::vector<float>> topics;
  explicit synthetic(const qevict::geometry& g)
      : d(g.head_dim), kv_row(g.kv_heads * g.head_dim), q_row(g.q_heads * g.head_dim), topics(6) {
    for (auto& t : topics) {
      t.resize(static_cast<std::size_t>(d));
      for (float& x : t) x = 1.5f * noise(rng);
    }
  }
  void about(int topic, float* out, int heads) {
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c)
        out[h * d + c] = topics[static_cast<std::size_t>(topic)][static_cast<std::size_t>(c)] + noise(rng);
  }
  void values(float* out) {
    for (int c = 0; c < kv_row; ++c) out[c] = noise(rng);
  }
};

template <class Preset>
void run(const qevict::geometry& g, const qevict::budget& b, const qevict::limits& lim) {
  qevict::cache<Preset> kv(g, b, lim);  // the only line that names the method
  synthetic data(g);
  const qevict::sequence_id s = kv.add_sequence();
  const int prompt = 512, observed = 32, steps = 128;
  std::vector<float> k(static_cast<std::size_t>(prompt) * data.kv_row), v(k.size());
  std::vector<float> q(static_cast<std::size_t>(observed) * data.q_row);
  for (int i = 0; i < prompt; ++i) {
    data.about((i / 48) % 6, &k[static_cast<std::size_t>(i) * data.kv_row], g.kv_heads);
    data.values(&v[static_cast<std::size_t>(i) * data.kv_row]);
    if (i >= prompt - observed)
      data.about((i / 48) % 6, &q[static_cast<std::size_t>(i - (prompt - observed)) * data.q_row], g.q_heads);
  }
  // The engine computed the prompt's attention itself: only the last queries, for the scores.
  kv.prefill(0, s, q, k, v);
  const qevict::tier_counts after_prefill = kv.counts(s, 0);
  std::vector<float> k1(static_cast<std::size_t>(data.kv_row)), v1(k1.size()), q1(static_cast<std::size_t>(data.q_row)), o1(q1.size());
  for (int t = 0; t < steps; ++t) {
    const int topic = (t / 32) % 6;  // decode drifts back through the prompt's topics
    data.about(topic, k1.data(), g.kv_heads);
    data.values(v1.data());
    data.about(topic, q1.data(), g.q_heads);
    kv.append(0, std::span(&s, 1), k1, v1);
    kv.attend(0, std::span(&s, 1), q1, o1);
  }
  const qevict::tier_counts c = kv.counts(s, 0);
  const qevict::layer_report lr = kv.report().layers[0];
  std::printf("  %-22s %5zu %5zu %5zu  | %5zu %5zu %5zu %5zu  %8zu / %8zu B%s\n", Preset::name, after_prefill.full,
              after_prefill.quantized, after_prefill.evicted, c.full, c.quantized, c.evicted, c.recent_tokens,
              lr.used.total(), lr.budget_bytes, kv.plan().units > 1 ? "  (units: window x KV head)" : "");
}

}  // namespace

int main() {
  const qevict::geometry g = llama_layer();
  const qevict::limits table_limits{.max_batch = 1, .max_tokens = 4096};
  std::printf("presets::match_budgets, one Llama-3.1-8B layer (H_q = 32, H_kv = 8, d = 128, bf16)\n");
  for (double f : {0.20, 0.10, 0.05}) print_table(g, table_limits, f);

  const qevict::limits run_limits{.max_batch = 1, .max_tokens = 1024};
  const qevict::budget b = qevict::budget::fraction(0.20);
  std::printf("\n512-token prompt + 128 decode steps at 20%% of a %d-token cache; counts in routing units\n",
              run_limits.max_tokens);
  std::printf("  %-22s %5s %5s %5s  | %5s %5s %5s %5s  %s\n", "preset", "full", "quant", "evict", "full", "quant", "evict",
              "recent", "held / budget");
  std::printf("  %-22s %-17s  | %s\n", "", "after prefill", "after decode");
  const std::vector<qevict::presets::matched_budget> rows = qevict::presets::match_budgets(g, b, run_limits);
  std::size_t i = 0;
  qevict::presets::for_each([&]<class Preset>(std::string_view name) {
    const qevict::presets::matched_budget& m = rows[i++];
    if (m.fits) run<Preset>(g, b, run_limits);
    else std::printf("  %-22s does not fit this budget\n", std::string(name).c_str());
  });
  return 0;
}

// Host-backend costs an integrator pays on a CPU: a routing event (Algorithm 1 with its
// migrations) and a decode step (append + attend), for one layer of Llama-3.1-8B geometry
// (32 query heads, 8 KV heads, head_dim 128, bf16) at a 20% budget.
//
//   ./bench_host --benchmark_filter=routing     (time per routing event; per_window: seconds per window)
//   ./bench_host --benchmark_filter=decode
//
// Arguments: windows per sequence, batch, and for routing whether scores are reshuffled before
// each event (1: every window's rank changes, the most migrations) or kept (0: ranking only).

#include <benchmark/benchmark.h>
#include <qevict/cache.hpp>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

namespace {

const qevict::geometry llama8b_layer{.layers = 1, .q_heads = 32, .kv_heads = 8, .head_dim = 128,
                                     .element = qevict::element_type::bf16,
                                     .rope = {.theta = 500000.0f, .layout = qevict::rope_layout::rotate_half}};
using config = qevict::config<>;
using cache_type = qevict::cache<config>;
constexpr int sinks = 5, recent = 32, window = 8;

/// Fills x with values in [-2, 2): a cheap generator, since the largest prompts hold a billion
/// floats and their contents do not change what routing costs.
void fill(std::vector<float>& x, std::uint64_t& state) {
  for (float& v : x) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    v = static_cast<float>(state >> 40) * (4.0f / 16777216.0f) - 2.0f;
  }
}

/// A cache with `batch` sequences of `windows` aged windows each, ingested through prefill.
std::unique_ptr<cache_type> make_cache(int windows, int batch, std::mt19937& rng) {
  const int tokens = sinks + windows * window + recent;
  auto kv = std::make_unique<cache_type>(llama8b_layer, qevict::budget::fraction(0.20),
                                         qevict::limits{.max_batch = batch, .max_tokens = tokens + 1024});
  const std::size_t row = 8 * 128;
  std::vector<float> k(static_cast<std::size_t>(tokens) * row), v(k.size()), q(32 * 128);
  std::uint64_t state = rng() | 1u;
  for (int b = 0; b < batch; ++b) {
    fill(k, state);
    fill(v, state);
    fill(q, state);
    const qevict::sequence_id s = kv->add_sequence();
    kv->prefill(0, s, q, k, v);
  }
  return kv;
}

void routing(benchmark::State& state) {
  const int windows = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(1));
  const bool reshuffle = state.range(2) != 0;
  std::mt19937 rng(42);
  auto kv = make_cache(windows, batch, rng);
  std::uniform_real_distribution<float> score(0.0f, 1.0f);
  for (auto _ : state) {
    if (reshuffle) {
      state.PauseTiming();
      for (int b = 0; b < batch; ++b)
        for (const auto& w : kv->windows(b, 0))
          if (w.where == qevict::tier::full || w.where == qevict::tier::quantized) kv->set_score(b, 0, w.index, score(rng));
      state.ResumeTiming();
    }
    kv->route();
  }
  state.counters["windows"] = static_cast<double>(windows) * batch;
  // Seconds per window per routing event (printed with an SI prefix, e.g. "21.6n" = 21.6 ns).
  state.counters["per_window"] = benchmark::Counter(static_cast<double>(windows) * batch,
                                                    benchmark::Counter::kIsIterationInvariantRate |
                                                        benchmark::Counter::kInvert);
}

void decode(benchmark::State& state) {
  const int windows = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(1));
  std::mt19937 rng(7);
  auto kv = make_cache(windows, batch, rng);
  std::vector<qevict::sequence_id> seqs(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) seqs[static_cast<std::size_t>(b)] = b;
  std::normal_distribution<float> noise;
  std::vector<float> k(static_cast<std::size_t>(batch) * 8 * 128), v(k.size()), q(static_cast<std::size_t>(batch) * 32 * 128),
      out(q.size());
  for (auto& x : k) x = noise(rng);
  for (auto& x : v) x = noise(rng);
  for (auto& x : q) x = noise(rng);
  for (auto _ : state) {
    kv->append(0, seqs, k, v);
    kv->attend(0, seqs, q, out);  // routes every 8th step, as in a real decode
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["windows"] = static_cast<double>(windows) * batch;
}

}  // namespace

BENCHMARK(routing)
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {1, 4}, {0, 1}})
    ->ArgNames({"windows", "batch", "reshuffle"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(decode)
    ->ArgsProduct({{1024, 4096}, {1, 4}})
    ->ArgNames({"windows", "batch"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_MAIN();

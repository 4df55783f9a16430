// Google Benchmark: the fused decode-attention kernel (attention + split-K merge, with and without
// window mass), one layer of Llama-3.1-8B geometry, for records in each key frame. Manual time from CUDA events, L2 flushed
// before each iteration; run with --benchmark_repetitions=N --benchmark_report_aggregates_only for
// medians. Bytes/s counts the cache bytes one step reads.
#include <benchmark/benchmark.h>

#include "gpu/decode_setup.cuh"

namespace {

using bench::paper;
using bench::post_rope;
using bench::window_relative;

/// One decode step for a cache of Config (its records' key frame decides the kernel's INT2 path).
template <bool EmitMass, class Config>
void decode_step(benchmark::State& st) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const int batch = static_cast<int>(st.range(0)), context = static_cast<int>(st.range(1));
  const double fraction = static_cast<double>(st.range(2)) / 100.0;
  const qevict::geometry g = bench::llama_layer();
  bench::decode_state s = bench::make_state<Config>(g, batch, context, fraction);
  const qevict::kernels::decode_arguments a = s.arguments();
  for (auto _ : st) {
    const float ms = bench::median_ms([&] {
      qevict::kernels::decode_attention<EmitMass, qevict::scorers::cumulative_mass>(g.element, s.layout, a, s.max_items, nullptr);
    }, 0, 1);
    st.SetIterationTime(ms / 1e3);
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations()) * static_cast<std::int64_t>(s.bytes_read));
  st.counters["full_windows"] = s.n_full;
  st.counters["quantized_windows"] = s.n_quantized;
  s.release();
}

// (batch, context, budget percent; 0 = every window Full)
void points(benchmark::internal::Benchmark* b) {
  for (auto [batch, context] : {std::pair{32, 1280}, {32, 8192}, {32, 32768}, {1, 32768}, {1, 131072}})
    for (int pct : {20, 10, 5, 0}) b->Args({batch, context, pct});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(decode_step<true, paper>)->Apply(points);
BENCHMARK(decode_step<false, paper>)->Apply(points);
BENCHMARK(decode_step<true, window_relative>)->Apply(points);
BENCHMARK(decode_step<true, post_rope>)->Apply(points);

}  // namespace

BENCHMARK_MAIN();

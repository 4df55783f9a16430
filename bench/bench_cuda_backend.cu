// Google Benchmark: the CUDA backend's calls, each on its own, as a decode loop makes them. One
// layer of Llama-3.1-8B geometry, 32 sequences prefilled with 31744-token prompts (a 32K-token
// cache: bench/gpu/backend_setup.cuh), budget as the argument (percent), records in each key frame:
//   append_batch  the batch's keys and values of one decode step;
//   attend_batch  one decode step's attention with window mass (attend prologue, query,
//                 attention and window-mass kernels), after that step's append;
//   route_batch   a routing event for the whole batch (decide, quantize, store kernels), after the
//                 8 decode steps it follows;
//   prefill       one sequence's prompt: storing it, observation-window scoring and its first
//                 routing, into a cache whose other 31 sequences are prefilled.
// Manual time from CUDA events around the timed call only (the state is far larger than L2; no
// flush). Each repetition builds its state anew; run with --benchmark_repetitions=N
// --benchmark_report_aggregates_only for medians.
#include <benchmark/benchmark.h>

#include "gpu/backend_setup.cuh"

namespace {

using bench::paper;
using bench::post_rope;
using bench::window_relative;

bool has_device(benchmark::State& st) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    st.SkipWithError("no CUDA device");
    return false;
  }
  return true;
}

/// CUDA events around one stream-ordered call: its milliseconds once the stream reaches the end.
class event_timer {
 public:
  explicit event_timer(cudaStream_t s) : stream_(s) {
    QEVICT_CUDA_CHECK(cudaEventCreate(&a_));
    QEVICT_CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~event_timer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  template <class Fn>
  double ms(Fn&& call) {
    QEVICT_CUDA_CHECK(cudaEventRecord(a_, stream_));
    call();
    QEVICT_CUDA_CHECK(cudaEventRecord(b_, stream_));
    QEVICT_CUDA_CHECK(cudaEventSynchronize(b_));
    float t = 0;
    QEVICT_CUDA_CHECK(cudaEventElapsedTime(&t, a_, b_));
    return t;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t a_, b_;
};

/// Runs `timed(state)` once per iteration after `untimed(state)`, each iteration's time from its
/// CUDA events, on a state built for the benchmark's budget argument.
template <class Config, class Untimed, class Timed>
void run(benchmark::State& st, Untimed&& untimed, Timed&& timed) {
  if (!has_device(st)) return;
  cudaStream_t stream;
  QEVICT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    bench::backend_state<Config> s(static_cast<double>(st.range(0)) / 100.0, stream);
    event_timer timer(stream);
    for (int i = 0; i < 2; ++i) {  // warm-up
      untimed(s);
      timer.ms([&] { timed(s); });
    }
    for (auto _ : st) {
      untimed(s);
      st.SetIterationTime(timer.ms([&] { timed(s); }) / 1e3);
    }
    s.kv.check();
    const auto c = s.kv.counts(s.seqs[0], 0);
    st.counters["full_windows"] = static_cast<double>(c.full);
    st.counters["quantized_windows"] = static_cast<double>(c.quantized);
  }
  QEVICT_CUDA_CHECK(cudaStreamDestroy(stream));
}

template <class Config>
void append_batch(benchmark::State& st) {
  run<Config>(st, [](auto&) {}, [](auto& s) { s.kv.append_batch(0, s.seqs, s.step_k, s.step_v); });
}

template <class Config>
void attend_batch(benchmark::State& st) {
  run<Config>(st, [](auto& s) { s.kv.append_batch(0, s.seqs, s.step_k, s.step_v); },
              [](auto& s) { s.kv.attend_batch(0, s.seqs, s.step_q, s.out); });
}

template <class Config>
void route_batch(benchmark::State& st) {
  run<Config>(st, [](auto& s) { for (int i = 0; i < 8; ++i) s.step(); }, [](auto& s) { s.kv.route_batch(0, s.seqs); });
}

template <class Config>
void prefill(benchmark::State& st) {
  // The last sequence leaves its slot before each prompt and takes it again.
  run<Config>(st, [](auto& s) { s.kv.remove_sequence(s.seqs.back()); s.seqs.back() = s.kv.add_sequence(0); },
              [](auto& s) {
                s.kv.prefill(0, s.seqs.back(), s.q, s.observation_rows, s.k, s.v, nullptr, s.prompt);
              });
}

// Budgets in percent. Iterations are fixed so that the decode steps stay within the state's
// headroom of bench::decode_headroom tokens (a route iteration takes 8 steps).
void at_20(benchmark::internal::Benchmark* b) { b->Arg(20)->Iterations(64)->UseManualTime()->Unit(benchmark::kMillisecond); }
void route_points(benchmark::internal::Benchmark* b) {
  b->Arg(20)->Arg(5)->Iterations(16)->UseManualTime()->Unit(benchmark::kMillisecond);
}
void prefill_point(benchmark::internal::Benchmark* b) { b->Arg(20)->Iterations(8)->UseManualTime()->Unit(benchmark::kMillisecond); }

}  // namespace

BENCHMARK(append_batch<paper>)->Apply(at_20);
BENCHMARK(attend_batch<paper>)->Apply(at_20);
BENCHMARK(attend_batch<window_relative>)->Apply(at_20);
BENCHMARK(attend_batch<post_rope>)->Apply(at_20);
BENCHMARK(route_batch<paper>)->Apply(route_points);
BENCHMARK(route_batch<window_relative>)->Apply(route_points);
BENCHMARK(route_batch<post_rope>)->Apply(route_points);
BENCHMARK(prefill<paper>)->Apply(prefill_point);
BENCHMARK(prefill<post_rope>)->Apply(prefill_point);

BENCHMARK_MAIN();

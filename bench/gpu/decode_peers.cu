// Times the fused decode-attention kernel (with and without window mass) for one layer of
// Llama-3.1-8B geometry at the (batch, context, budget) points of run_peers.sh, for records with
// keys before RoPE (the paper), relative to their window's start, and after RoPE; prints one JSON
// line per point. Built and run by bench/gpu/run_peers.sh next to the PyTorch peers.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "decode_setup.cuh"

int main(int argc, char** argv) {
  using namespace qevict;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  const int points[][2] = {{32, 1280}, {32, 8192}, {32, 32768}, {1, 32768}, {1, 131072}};
  const double budgets[] = {0.20, 0.10, 0.05, 0.0};
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  const geometry g = bench::llama_layer();
  auto measure = [&]<class Config>(const char* impl, int batch, int context, double f) {
    bench::decode_state s = bench::make_state<Config>(g, batch, context, f);
    const kernels::decode_arguments a = s.arguments();
    const float with_mass = bench::median_ms([&] {
      kernels::decode_attention<true, scorers::cumulative_mass>(g.element, s.layout, a, s.max_items, nullptr);
    }, 5, reps);
    const float without_mass = bench::median_ms([&] {
      kernels::decode_attention<false, scorers::cumulative_mass>(g.element, s.layout, a, s.max_items, nullptr);
    }, 5, reps);
    std::printf("{\"impl\": \"%s\", \"batch\": %d, \"context\": %d, \"budget\": %.2f, \"ms\": %.5f, "
                "\"ms_no_mass\": %.5f, \"bytes\": %zu, \"full_windows\": %d, \"quantized_windows\": %d}\n",
                impl, batch, context, f, with_mass, without_mass, s.bytes_read, s.n_full, s.n_quantized);
    std::fflush(stdout);
    s.release();
  };
  for (const auto& pt : points) {
    for (double f : budgets) {
      // The paper's records (keys before RoPE) and records with keys after RoPE: same bytes.
      measure.template operator()<bench::paper>("qevict", pt[0], pt[1], f);
      if (f > 0) measure.template operator()<bench::window_relative>("qevict_window_relative", pt[0], pt[1], f);
      if (f > 0) measure.template operator()<bench::post_rope>("qevict_post_rope", pt[0], pt[1], f);
    }
  }
  return 0;
}

// One (batch, context, budget) point of the decode benchmark, for profilers and quick variants:
//   decode_point BATCH CONTEXT BUDGET [REPS] [ITEMS_PER_CHUNK] [pre|relative|post] [mass|nomass] [both|records|full]
// (BUDGET 0 = every window Full; ITEMS_PER_CHUNK 0 (default) = the launch's own choice,
// kernels::decode_chunk; the records' key frame: before RoPE (default), relative to the window's
// start, after RoPE; with window mass (default) or without; the budget's Full and Quantized
// windows (default), or only its records, or only its Full windows: bench::kept_tiers).
// Prints one JSON line like decode_peers; REPS 0 launches once (for ncu).
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "decode_setup.cuh"

int main(int argc, char** argv) {
  using namespace qevict;
  if (argc < 4) {
    std::printf("usage: decode_point BATCH CONTEXT BUDGET [REPS] [ITEMS_PER_CHUNK] [pre|relative|post] [mass|nomass] [both|records|full]\n");
    return 2;
  }
  // One of `allowed` (its first by default when the argument is absent), or a usage error.
  auto choice = [&](int k, std::initializer_list<const char*> allowed) -> std::string {
    const std::string v = argc > k ? argv[k] : *allowed.begin();
    for (const char* a : allowed)
      if (v == a) return v;
    std::fprintf(stderr, "decode_point: argument %d is '%s'; expected one of:", k, v.c_str());
    for (const char* a : allowed) std::fprintf(stderr, " %s", a);
    std::fprintf(stderr, "\n");
    std::exit(2);
  };
  const int batch = std::atoi(argv[1]), context = std::atoi(argv[2]);
  const double f = std::atof(argv[3]);
  const int reps = argc > 4 ? std::atoi(argv[4]) : 30;
  const int ipc = argc > 5 ? std::atoi(argv[5]) : 0;  // 0: automatic
  const std::string frame = choice(6, {"pre", "relative", "post"});
  const bool mass = choice(7, {"mass", "nomass"}) == "mass";
  const std::string kept = choice(8, {"both", "records", "full"});
  const bench::kept_tiers tiers = kept == "records" ? bench::kept_tiers::records_only
                                  : kept == "full"  ? bench::kept_tiers::full_only
                                                    : bench::kept_tiers::both;
  const geometry g = bench::llama_layer();
  bench::decode_state s = frame == "post"       ? bench::make_state<bench::post_rope>(g, batch, context, f, ipc, tiers)
                          : frame == "relative" ? bench::make_state<bench::window_relative>(g, batch, context, f, ipc, tiers)
                                                : bench::make_state(g, batch, context, f, ipc, tiers);
  const kernels::decode_arguments a = s.arguments();
  auto step = [&] {
    if (mass) kernels::decode_attention<true, scorers::cumulative_mass>(g.element, s.layout, a, s.max_items, nullptr);
    else kernels::decode_attention<false, scorers::cumulative_mass>(g.element, s.layout, a, s.max_items, nullptr);
  };
  if (reps == 0) {
    step();
    QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const float ms = bench::median_ms(step, 5, reps);
  std::printf("{\"impl\": \"%s\", \"mass\": %s, \"batch\": %d, \"context\": %d, \"budget\": %.2f, \"items_per_chunk\": %d, \"ms\": %.5f, "
              "\"kept\": \"%s\", \"full_windows\": %d, \"quantized_windows\": %d, \"bytes\": %zu, \"tbps\": %.3f}\n",
              frame == "post" ? "qevict_post_rope" : frame == "relative" ? "qevict_window_relative" : "qevict", mass ? "true" : "false", batch, context, f, ipc, ms, kept.c_str(), s.n_full, s.n_quantized, s.bytes_read, s.bytes_read / ms / 1e9);
  s.release();
  return 0;
}

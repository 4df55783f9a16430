// The cost of a routing event against the decode steps it serves: batch 32, 32K tokens, one layer
// of Llama-3.1-8B geometry (32 query heads, 8 KV heads, head_dim 128, bf16), the paper's config and
// the same config with records in the two other key frames.
// State: the CUDA backend's own prefill (observation-window scoring, first routing) of 32 random
// prompts; then rounds of Ω = 8 decode steps (append + attend, the decode kernel with window mass)
// followed by one routing event for all 32 lanes (one launch of each routing kernel). CUDA events
// around each part; medians over the rounds. Also checks that a decode step and a routing event
// can be captured in a CUDA graph (no allocation or synchronization inside).
//   routing_cost [rounds]      prints a markdown table
//   routing_cost rounds w1     the paper's config against r1 (W = 1: one ledger record per decode
//                              item) at 16K tokens, the most a W = 1 table may have for routing's
//                              shared-memory sort
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "backend_setup.cuh"

using namespace qevict;

namespace {

template <class Config>
void run(const char* frame, double fraction, int rounds, cudaStream_t st, int context = 32768) {
  bench::backend_state<Config> s(fraction, st, 32, context);
  auto& kv = s.kv;
  const auto& seqs = s.seqs;
  const int batch = s.batch;
  std::vector<cudaEvent_t> ev(2 * 8 + 2);
  for (auto& e : ev) QEVICT_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<float> t_steps, t_attend, t_route;
  for (int r = 0; r < rounds + 2; ++r) {
    QEVICT_CUDA_CHECK(cudaEventRecord(ev[0], st));
    for (int i = 0; i < 8; ++i) {
      kv.append_batch(0, seqs, s.step_k, s.step_v);
      QEVICT_CUDA_CHECK(cudaEventRecord(ev[1 + 2 * i], st));
      kv.attend_batch(0, seqs, s.step_q, s.out);
      QEVICT_CUDA_CHECK(cudaEventRecord(ev[2 + 2 * i], st));
    }
    kv.route_batch(0, seqs);
    QEVICT_CUDA_CHECK(cudaEventRecord(ev[17], st));
    QEVICT_CUDA_CHECK(cudaEventSynchronize(ev[17]));
    if (r < 2) continue;  // warm-up
    float steps = 0, attend = 0, route = 0, x = 0;
    QEVICT_CUDA_CHECK(cudaEventElapsedTime(&steps, ev[0], ev[16]));
    for (int i = 0; i < 8; ++i) {
      QEVICT_CUDA_CHECK(cudaEventElapsedTime(&x, ev[1 + 2 * i], ev[2 + 2 * i]));
      attend += x;
    }
    QEVICT_CUDA_CHECK(cudaEventElapsedTime(&route, ev[16], ev[17]));
    t_steps.push_back(steps);
    t_attend.push_back(attend);
    t_route.push_back(route);
  }
  kv.check();
  const tier_counts c = kv.counts(seqs[0], 0);
  const float ms_steps = bench::median(t_steps), ms_attend = bench::median(t_attend), ms_route = bench::median(t_route);
  std::printf("| %s | %d | %d | %.0f%% | %zu / %zu / %zu | %.4f | %.4f | %.4f | %.1f%% | %.1f%% |\n", frame, batch, context, fraction * 100, c.full,
              c.quantized, c.evicted, ms_attend, ms_steps, ms_route, 100.0 * ms_route / ms_attend, 100.0 * ms_route / ms_steps);
  std::fflush(stdout);

  // Graph capture of one decode step and one routing event.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  QEVICT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  s.step();
  kv.route_batch(0, seqs);
  QEVICT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  QEVICT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  QEVICT_CUDA_CHECK(cudaGraphLaunch(exec, st));
  QEVICT_CUDA_CHECK(cudaStreamSynchronize(st));
  std::printf("<!-- graph capture of append + attend + route at %.0f%%: ok -->\n", fraction * 100);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto& e : ev) cudaEventDestroy(e);
}

}  // namespace

int main(int argc, char** argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool w1 = argc > 2 && std::string_view(argv[2]) == "w1";
  cudaStream_t st;
  QEVICT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("| %s | batch |", w1 ? "config" : "key frame");
  std::printf(" context | budget | windows of seq 0 (full / quantized / evicted) | 8 attends [ms] | 8 × (append + attend) [ms] | routing event [ms] | routing / 8 attends | routing / 8 steps |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  using window_relative = presets::qevict_window_relative::config_type;
  using post_rope = presets::qevict_post_rope::config_type;
  if (w1) {
    for (double f : {0.20, 0.05}) {
      run<config<>>("qevict (W = 8)", f, rounds, st, 16384);
      run<presets::r1::config_type>("r1 (W = 1)", f, rounds, st, 16384);
    }
    cudaStreamDestroy(st);
    return 0;
  }
  for (double f : {0.20, 0.05}) {
    run<config<>>("before RoPE (paper)", f, rounds, st);
    run<window_relative>("window-relative", f, rounds, st);
    run<post_rope>("after RoPE", f, rounds, st);
  }
  cudaStreamDestroy(st);
  return 0;
}

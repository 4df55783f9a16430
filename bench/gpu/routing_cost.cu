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

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

#include "qevict/backend/cuda.cuh"
#include "qevict/presets.hpp"

using namespace qevict;

namespace {

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

float* upload_random(std::size_t n, unsigned seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> h(n);
  for (auto& x : h) x = d(rng);
  float* p = nullptr;
  QEVICT_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
  QEVICT_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

template <class Config>
void run(const char* frame, double fraction, int rounds, cudaStream_t st, int context = 32768) {
  const int batch = 32, prompt = context - 1024;
  geometry g;
  g.layers = 1;
  g.q_heads = 32;
  g.kv_heads = 8;
  g.head_dim = 128;
  g.element = element_type::bf16;
  g.rope.theta = 500000.0f;
  options opt;
  opt.routing = routing_mode::manual;
  backend::cuda_cache<Config> kv(g, budget::fraction(fraction), limits{.max_batch = batch, .max_tokens = context}, opt, nullptr, 0,
                                   backend::cuda_settings{st});
  const std::size_t krow = 8 * 128, qrow = 32 * 128;
  float* k = upload_random(static_cast<std::size_t>(prompt) * krow, 1, 1.0f);
  float* v = upload_random(static_cast<std::size_t>(prompt) * krow, 2, 1.0f);
  float* q = upload_random(32 * qrow, 3, 1.5f);
  std::vector<sequence_id> seqs;
  for (int b = 0; b < batch; ++b) {
    seqs.push_back(kv.add_sequence(1000LL * b));
    kv.prefill(0, seqs.back(), q, 32, k, v, nullptr, prompt);
  }
  kv.check();
  float* step_k = upload_random(batch * krow, 4, 1.0f);
  float* step_v = upload_random(batch * krow, 5, 1.0f);
  float* step_q = upload_random(batch * qrow, 6, 1.5f);
  float* out = nullptr;
  QEVICT_CUDA_CHECK(cudaMalloc(&out, batch * qrow * sizeof(float)));
  std::vector<cudaEvent_t> ev(2 * 8 + 2);
  for (auto& e : ev) QEVICT_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<float> t_steps, t_attend, t_route;
  for (int r = 0; r < rounds + 2; ++r) {
    QEVICT_CUDA_CHECK(cudaEventRecord(ev[0], st));
    for (int i = 0; i < 8; ++i) {
      kv.append_batch(0, seqs, step_k, step_v);
      QEVICT_CUDA_CHECK(cudaEventRecord(ev[1 + 2 * i], st));
      kv.attend_batch(0, seqs, step_q, out);
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
  const float ms_steps = median(t_steps), ms_attend = median(t_attend), ms_route = median(t_route);
  std::printf("| %s | %d | %d | %.0f%% | %zu / %zu / %zu | %.4f | %.4f | %.4f | %.1f%% | %.1f%% |\n", frame, batch, context, fraction * 100, c.full,
              c.quantized, c.evicted, ms_attend, ms_steps, ms_route, 100.0 * ms_route / ms_attend, 100.0 * ms_route / ms_steps);
  std::fflush(stdout);

  // Graph capture of one decode step and one routing event.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  QEVICT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  kv.append_batch(0, seqs, step_k, step_v);
  kv.attend_batch(0, seqs, step_q, out);
  kv.route_batch(0, seqs);
  QEVICT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  QEVICT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  QEVICT_CUDA_CHECK(cudaGraphLaunch(exec, st));
  QEVICT_CUDA_CHECK(cudaStreamSynchronize(st));
  std::printf("<!-- graph capture of append + attend + route at %.0f%%: ok -->\n", fraction * 100);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto& e : ev) cudaEventDestroy(e);
  for (float* p : {k, v, q, step_k, step_v, step_q, out}) cudaFree(p);
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

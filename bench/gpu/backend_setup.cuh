#pragma once
// A CUDA-backend cache in the state a long decode reaches, for timing the calls a decode loop
// makes: one layer of Llama-3.1-8B geometry (bench::llama_layer), `batch` sequences each
// prefilled on the device with a random prompt of `context` - 1024 tokens (observation-window
// scores and the first routing event, as the backend does them), routing in manual mode, and
// random keys, values and queries for the decode steps that follow. Used by routing_cost.cu and
// bench_cuda_backend.cu.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <random>
#include <vector>

#include "decode_setup.cuh"
#include "qevict/backend/cuda.cuh"

namespace bench {

/// The median of a run of timings (the upper one of an even count).
inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// n normally distributed floats (standard deviation sd) in new device memory.
inline float* upload_random(std::size_t n, unsigned seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> h(n);
  for (auto& x : h) x = d(rng);
  float* p = nullptr;
  QEVICT_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
  QEVICT_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

/// Tokens of headroom a state leaves above its prompts for decode steps.
inline constexpr int decode_headroom = 1024;

/// The prefilled cache and the inputs of its decode steps. Not copyable: it owns device memory.
template <class Config>
struct backend_state {
  static constexpr int observation_rows = 32;  ///< query rows of each prompt's observation window
  geometry g = llama_layer();
  int batch, prompt;
  backend::cuda_cache<Config> kv;
  std::vector<sequence_id> seqs;
  float *k = nullptr, *v = nullptr, *q = nullptr;                 // one prompt (every sequence's)
  float *step_k = nullptr, *step_v = nullptr, *step_q = nullptr;  // one decode step of the batch
  float* out = nullptr;

  backend_state(double fraction, cudaStream_t stream, int batch_ = 32, int context_ = 32768)
      : batch(batch_), prompt(context_ - decode_headroom),
        kv(g, budget::fraction(fraction), limits{.max_batch = batch_, .max_tokens = context_}, manual_routing(), nullptr, 0,
           backend::cuda_settings{stream}) {
    const std::size_t kv_row = static_cast<std::size_t>(g.kv_heads) * g.head_dim, q_row = static_cast<std::size_t>(g.q_heads) * g.head_dim;
    k = upload_random(prompt * kv_row, 1, 1.0f);
    v = upload_random(prompt * kv_row, 2, 1.0f);
    q = upload_random(observation_rows * q_row, 3, 1.5f);
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(kv.add_sequence(1000LL * b));
      kv.prefill(0, seqs.back(), q, observation_rows, k, v, nullptr, prompt);
    }
    kv.check();
    step_k = upload_random(batch * kv_row, 4, 1.0f);
    step_v = upload_random(batch * kv_row, 5, 1.0f);
    step_q = upload_random(batch * q_row, 6, 1.5f);
    QEVICT_CUDA_CHECK(cudaMalloc(&out, batch * q_row * sizeof(float)));
  }
  backend_state(const backend_state&) = delete;
  backend_state& operator=(const backend_state&) = delete;
  ~backend_state() {
    for (float* p : {k, v, q, step_k, step_v, step_q, out}) cudaFree(p);
  }

  /// One decode step of the whole batch: append its keys and values, then attend.
  void step() {
    kv.append_batch(0, seqs, step_k, step_v);
    kv.attend_batch(0, seqs, step_q, out);
  }

 private:
  static options manual_routing() {
    options opt;
    opt.routing = routing_mode::manual;
    return opt;
  }
};

}  // namespace bench

// qevict on the GPU, as an engine uses it: one cache on the CUDA backend for a batch of sequences
// with prompts of different lengths, every call on the engine's stream, inputs and outputs in
// device memory. The same inputs also go to the same cache on the host backend, and every 16
// decode steps it prints how far the GPU's attention outputs have been from the host's (float
// rounding; the window scores differ by about 1e-6 relative, so two windows whose scores are that
// close may also be routed differently, which the GPU tests rule out by sharing scores).
//
//   qevict_cuda [preset]      preset: qevict (default), qevict_window_relative, h2o, r1, kivi2, zipcache_like
//
// Exits with 77 on a machine without a CUDA device.

#include <cuda_runtime.h>

#include <qevict/backend/cuda.cuh>
#include <qevict/cache.hpp>
#include <qevict/presets.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

/// A device copy of host floats (the engine's activations already live on the device).
struct device_floats {
  float* ptr = nullptr;
  std::size_t n = 0;
  explicit device_floats(std::size_t count) : n(count) { QEVICT_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(float))); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  ~device_floats() { cudaFree(ptr); }
  void upload(const std::vector<float>& x, cudaStream_t st) {
    QEVICT_CUDA_CHECK(cudaMemcpyAsync(ptr, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice, st));
  }
  std::vector<float> download(cudaStream_t st) const {
    std::vector<float> x(n);
    QEVICT_CUDA_CHECK(cudaMemcpyAsync(x.data(), ptr, n * sizeof(float), cudaMemcpyDeviceToHost, st));
    QEVICT_CUDA_CHECK(cudaStreamSynchronize(st));
    return x;
  }
  std::span<const float> in() const { return {ptr, n}; }
  std::span<float> out() { return {ptr, n}; }
};

/// Largest relative L2 error of one head's output row, GPU against host.
double worst_head_error(const std::vector<float>& gpu, const std::vector<float>& host, int head_dim) {
  double worst = 0.0;
  for (std::size_t row = 0; row < host.size() / head_dim; ++row) {
    double num = 0.0, den = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      const double r = host[row * head_dim + c], g = gpu[row * head_dim + c];
      num += (g - r) * (g - r);
      den += r * r;
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

template <class Preset>
int run(cudaStream_t st) {
  using config = typename Preset::config_type;
  static_assert(qevict::backend::cuda_supports<config>, "this preset does not run on the CUDA backend");
  const qevict::geometry g{.layers = 2, .q_heads = 16, .kv_heads = 4, .head_dim = 128,
                           .element = qevict::element_type::bf16,
                           .rope = {.theta = 500000.0f, .layout = qevict::rope_layout::rotate_half}};
  const qevict::limits lim{.max_batch = 4, .max_tokens = 4096};
  // Methods that never evict get the budget they need for everything, except two-precision ones
  // (zipcache_like), whose budget decides how many windows get the 4-bit top tier (the rest are
  // 2-bit): 35% of the full cache gives it both.
  constexpr bool mixed = std::is_same_v<typename Preset::allocator, qevict::allocators::mixed_precision>;
  const qevict::budget b = mixed ? qevict::budget::fraction(0.35)
                           : Preset::allocator::keeps_everything ? qevict::budget::everything()
                                                                 : qevict::budget::fraction(0.20);
  // The GPU cache: its arena, tables and workspace are device memory it allocates here, once.
  qevict::cache<config, qevict::backend::cuda> gpu(g, b, lim, qevict::backend::cuda::settings{.stream = st});
  qevict::cache<config> host(g, b, lim);  // the reference: the same algorithm in scalar C++
  std::printf("%s on the GPU: %zu bytes for %d sequences x %d layers (K_f = %zu, K_q = %zu per layer)\n", Preset::name,
              qevict::cache<config, qevict::backend::cuda>::required_bytes(g, b, lim), lim.max_batch, g.layers,
              gpu.plan().caps.full, gpu.plan().caps.quantized);
  const qevict::device_memory mem = gpu.device_bytes();
  std::printf("device memory: %zu bytes = arena %zu + tables %zu + decode workspace %zu\n", mem.total(), mem.arena, mem.tables,
              mem.decode_workspace);

  const std::size_t kv_row = static_cast<std::size_t>(g.kv_heads) * g.head_dim, q_row = static_cast<std::size_t>(g.q_heads) * g.head_dim;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](std::size_t n, float sd) {
    std::vector<float> x(n);
    for (float& e : x) e = sd * normal(rng);
    return x;
  };

  // Prefill: ragged prompts, each sequence on its own; only the observation window's queries
  // (the last options::observation_window rows) are needed to score the prompt.
  std::vector<qevict::sequence_id> seqs;
  for (const int prompt : {3000, 1200, 2500, 40}) {
    const qevict::sequence_id s = gpu.add_sequence();
    host.add_sequence();
    seqs.push_back(s);
    for (int layer = 0; layer < g.layers; ++layer) {
      const std::vector<float> k = random(prompt * kv_row, 1.0f), v = random(prompt * kv_row, 1.0f);
      const int observed = std::min(prompt, 32);
      const std::vector<float> q = random(observed * q_row, 1.5f);
      device_floats dk(k.size()), dv(v.size()), dq(q.size());
      dk.upload(k, st);
      dv.upload(v, st);
      dq.upload(q, st);
      gpu.prefill(layer, s, dq.in(), dk.in(), dv.in(), std::span<float>());
      host.prefill(layer, s, q, k, v, std::span<float>());
      QEVICT_CUDA_CHECK(cudaStreamSynchronize(st));  // the uploads' host vectors go out of scope
    }
  }

  // Decode: one token per sequence and layer per step. append and attend neither allocate nor
  // synchronize; the cache routes itself every Ω steps on the same stream.
  const std::size_t batch = seqs.size();
  device_floats dk(batch * kv_row), dv(batch * kv_row), dq(batch * q_row), dout(batch * q_row);
  double worst = 0.0;
  for (int step = 1; step <= 64; ++step) {
    for (int layer = 0; layer < g.layers; ++layer) {
      const std::vector<float> k = random(batch * kv_row, 1.0f), v = random(batch * kv_row, 1.0f), q = random(batch * q_row, 1.5f);
      dk.upload(k, st);
      dv.upload(v, st);
      dq.upload(q, st);
      gpu.append(layer, seqs, dk.in(), dv.in());
      gpu.attend(layer, seqs, dq.in(), dout.out());
      std::vector<float> out(batch * q_row);
      host.append(layer, seqs, k, v);
      host.attend(layer, seqs, q, out);
      worst = std::max(worst, worst_head_error(dout.download(st), out, g.head_dim));
    }
    if (step % 16 == 0) {
      gpu.check();  // a synchronizing call: throws qevict::error if any input of the last calls was not finite
      const qevict::tier_counts c = gpu.counts(seqs[0], 0);
      std::printf("step %2d  sequence 0, layer 0: %3zu full  %4zu quantized  %4zu evicted; worst head error vs host %.2e\n", step,
                  c.full, c.quantized, c.evicted, worst);
    }
  }
  std::printf("\n%s", gpu.report().to_string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  cudaStream_t st;
  QEVICT_CUDA_CHECK(cudaStreamCreate(&st));
  const std::string name = argc > 1 ? argv[1] : "qevict";
  int rc = 2;
  if (name == "qevict") rc = run<qevict::presets::qevict>(st);
  else if (name == "qevict_window_relative") rc = run<qevict::presets::qevict_window_relative>(st);
  else if (name == "h2o") rc = run<qevict::presets::h2o>(st);
  else if (name == "r1") rc = run<qevict::presets::r1>(st);
  else if (name == "kivi2") rc = run<qevict::presets::kivi2>(st);
  else if (name == "zipcache_like") rc = run<qevict::presets::zipcache_like>(st);
  else std::printf("unknown preset %s (qevict, qevict_window_relative, h2o, r1, kivi2, zipcache_like)\n", name.c_str());
  QEVICT_CUDA_CHECK(cudaStreamDestroy(st));
  return rc;
}

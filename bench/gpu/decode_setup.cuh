#pragma once
// A synthetic decode state on the GPU for timing: the byte layout of a real cache (region_plan)
// with its pools filled, so that the kernel reads exactly what it would read in a model. Sinks,
// recent ring and Full windows hold bf16 values; ledger records hold arbitrary codes and finite
// bf16 metadata. The first K_f aged windows are Full, the next K_q Quantized, the rest evicted.
// Queries are random (unit variance, like the PyTorch peers' randn): zeros would make every score
// equal and every tensor-core product a product of zeros, which times something a model never runs.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "qevict/cache.hpp"
#include "qevict/presets.hpp"
#include "qevict/kernels/decode_attention.cuh"

namespace bench {

using namespace qevict;

/// The paper's cache and the same cache with records in the two other key frames.
using paper = config<>;
using window_relative = presets::qevict_window_relative::config_type;
using post_rope = presets::qevict_post_rope::config_type;

// A hash of element i of a filled buffer.
__device__ __forceinline__ std::uint32_t hash32(std::size_t i, std::uint32_t seed) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
  return x;
}

// p[i] = value(hash32(i, seed)) over a grid-stride loop.
template <class T, class Value>
__device__ __forceinline__ void fill(T* p, std::size_t n, std::uint32_t seed, Value value) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = value(hash32(i, seed));
}

// Finite bf16 values in [-1, 1] everywhere: every byte of the arena is then valid as a token row,
// a code or a bf16 metadata word.
__global__ void fill_bf16(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  fill(p, n, seed, [](std::uint32_t x) {
    const float f = static_cast<float>(x & 0xffffu) / 32768.0f - 1.0f;
    return static_cast<std::uint16_t>(__float_as_uint(f) >> 16);
  });
}

// Random floats of variance 1 (uniform in [-sqrt 3, sqrt 3]).
__global__ void fill_unit_variance(float* p, std::size_t n, std::uint32_t seed) {
  fill(p, n, seed, [](std::uint32_t x) {
    x *= 3266489917u; x ^= x >> 16;
    return (static_cast<float>(x >> 8) / 16777216.0f * 2.0f - 1.0f) * 1.7320508f;
  });
}

/// Which of the budget's kept windows a state lists: both tiers (what a cache holds), or, to see
/// what each costs on its own, only the K_q records or only the K_f Full windows (same counts).
enum class kept_tiers { both, records_only, full_only };

struct decode_state {
  region_plan plan;
  kernels::decode_layout layout;
  std::byte* arena = nullptr;
  kernels::lane_state* lanes = nullptr;
  kernels::window_entry* entries = nullptr;
  int* entry_counts = nullptr;
  int* batch_lanes = nullptr;
  float *q = nullptr, *out = nullptr;
  kernels::decode_workspace workspace;
  std::byte* workspace_block = nullptr;  // zeroed once (decode_workspace::bind)
  double* inv_freq = nullptr;
  int batch = 0, max_items = 0, items_per_chunk = 0;  // 0: the launch chooses (kernels::decode_chunk)
  std::size_t bytes_read = 0;  ///< KV bytes one decode step reads
  int n_full = 0, n_quantized = 0;

  kernels::decode_arguments arguments() const {
    kernels::decode_arguments a;
    a.arena = arena; a.lanes = lanes; a.entries = entries; a.entry_counts = entry_counts; a.batch_lanes = batch_lanes; a.batch = batch;
    a.q = q; a.out = out; a.inv_freq = inv_freq;
    workspace.bind(workspace_block, a);
    a.items_per_chunk = items_per_chunk;
    a.max_chunks = kernels::decode_workspace::chunks_for(layout, items_per_chunk);
    return a;
  }
  void release() {
    cudaFree(arena); cudaFree(lanes); cudaFree(entries); cudaFree(entry_counts); cudaFree(batch_lanes); cudaFree(q); cudaFree(out);
    cudaFree(workspace_block); cudaFree(inv_freq);
  }
};

inline geometry llama_layer(element_type e = element_type::bf16) {
  geometry g;
  g.layers = 1;
  g.q_heads = 32;
  g.kv_heads = 8;
  g.head_dim = 128;
  g.element = e;
  g.rope.theta = 500000.0f;
  return g;
}

/// `fraction` <= 0 means budget::everything() (every window Full).
template <class Config = qevict::config<>>
decode_state make_state(const geometry& g, int batch, int context, double fraction, int items_per_chunk = 0,
                        kept_tiers tiers = kept_tiers::both) {
  decode_state s;
  const budget b = fraction > 0 ? budget::fraction(fraction) : budget::everything();
  const limits lim{.max_batch = batch, .max_tokens = context};
  s.plan = make_region_plan<Config>(g, b, lim);
  s.layout = kernels::decode_layout::for_config<Config>(s.plan, g.rope.layout);
  s.batch = batch;
  s.items_per_chunk = items_per_chunk;
  const std::size_t arena_bytes = s.plan.region_bytes * batch;
  QEVICT_CUDA_CHECK(cudaMalloc(&s.arena, arena_bytes));
  fill_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(s.arena), arena_bytes / 2, 12345u);
  QEVICT_CUDA_CHECK_LAUNCH("fill_bf16");

  const region_plan& p = s.plan;
  const int started = (context - p.sinks + p.window - 1) / p.window;
  const int aged = std::max(0, (context - p.sinks - p.recent) / p.window);
  s.n_full = static_cast<int>(std::min<std::size_t>(p.caps.full, aged));
  s.n_quantized = static_cast<int>(std::min<std::size_t>(p.caps.quantized, aged - s.n_full));
  if (tiers == kept_tiers::records_only) s.n_full = 0;
  if (tiers == kept_tiers::full_only) s.n_quantized = 0;
  std::vector<kernels::window_entry> entries(static_cast<std::size_t>(batch) * s.layout.entries_per_lane);
  std::vector<kernels::lane_state> lanes(batch);
  std::vector<int> entry_counts(batch), batch_lanes(batch);
  for (int l = 0; l < batch; ++l) {
    // Spread the kept windows over the whole context, as routing leaves them, Full ones among
    // them; listed as routing lists them: the Full windows, then the Quantized ones.
    const int kept = s.n_full + s.n_quantized;
    const int stride = std::max(1, kept / std::max(s.n_full, 1));
    int used_full = 0, used_quantized = 0;
    kernels::window_entry* list = entries.data() + static_cast<std::size_t>(l) * s.layout.entries_per_lane;
    for (int i = 0; i < kept; ++i) {
      const int w = static_cast<int>(static_cast<long long>(i) * aged / std::max(kept, 1));
      const bool full = (used_full < s.n_full && i % stride == 0) || used_quantized >= s.n_quantized;
      if (full) {
        list[used_full] = kernels::window_entry{w, used_full};
        ++used_full;
      } else {
        list[s.n_full + used_quantized] = kernels::window_entry{w, ~used_quantized};
        ++used_quantized;
      }
    }
    lanes[l] = kernels::lane_state{context, aged, 0, static_cast<long long>(s.layout.region_offset(l))};
    entry_counts[l] = kept;
    batch_lanes[l] = l;
  }
  const int nf = s.n_full, nq = s.n_quantized;
  const std::size_t d = g.head_dim, hkv = g.kv_heads;
  const int recent_tokens = context - p.sinks - aged * p.window;
  s.bytes_read = static_cast<std::size_t>(batch) *
                 (static_cast<std::size_t>(p.sinks + recent_tokens) * 2 * hkv * d * 2 +
                  static_cast<std::size_t>(nf) * p.full_window_bytes + static_cast<std::size_t>(nq) * p.record.window_bytes());
  s.max_items = 1 + nf + nq + (started - aged);

  QEVICT_CUDA_CHECK(cudaMalloc(&s.lanes, lanes.size() * sizeof(lanes[0])));
  QEVICT_CUDA_CHECK(cudaMemcpy(s.lanes, lanes.data(), lanes.size() * sizeof(lanes[0]), cudaMemcpyHostToDevice));
  QEVICT_CUDA_CHECK(cudaMalloc(&s.entries, std::max<std::size_t>(1, entries.size()) * sizeof(entries[0])));
  QEVICT_CUDA_CHECK(cudaMemcpy(s.entries, entries.data(), entries.size() * sizeof(entries[0]), cudaMemcpyHostToDevice));
  QEVICT_CUDA_CHECK(cudaMalloc(&s.entry_counts, batch * sizeof(int)));
  QEVICT_CUDA_CHECK(cudaMemcpy(s.entry_counts, entry_counts.data(), batch * sizeof(int), cudaMemcpyHostToDevice));
  QEVICT_CUDA_CHECK(cudaMalloc(&s.batch_lanes, batch * sizeof(int)));
  QEVICT_CUDA_CHECK(cudaMemcpy(s.batch_lanes, batch_lanes.data(), batch * sizeof(int), cudaMemcpyHostToDevice));
  const std::size_t qn = static_cast<std::size_t>(batch) * g.q_heads * d;
  QEVICT_CUDA_CHECK(cudaMalloc(&s.q, qn * sizeof(float)));
  fill_unit_variance<<<256, 256>>>(s.q, qn, 777u);
  QEVICT_CUDA_CHECK_LAUNCH("fill_unit_variance");
  QEVICT_CUDA_CHECK(cudaMalloc(&s.out, qn * sizeof(float)));
  const auto inv = rope::rotary::inverse_frequencies(g.rope, g.head_dim);
  QEVICT_CUDA_CHECK(cudaMalloc(&s.inv_freq, inv.size() * sizeof(double)));
  QEVICT_CUDA_CHECK(cudaMemcpy(s.inv_freq, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));
  const auto ws = kernels::decode_workspace::sizes(s.layout, batch, items_per_chunk);
  s.workspace = ws;
  QEVICT_CUDA_CHECK(cudaMalloc(&s.workspace_block, ws.bytes()));
  QEVICT_CUDA_CHECK(cudaMemset(s.workspace_block, 0, ws.bytes()));
  QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
  return s;
}

/// How the timing loop flushes L2 before each run (environment variable QEVICT_BENCH_FLUSH):
///   dirty  (default) a 256 MiB memset: L2 is left full of written lines, which the timed run
///          writes back to HBM as its reads evict them;
///   clean  the memset, then a read of another 256 MiB: L2 is left full of unwritten lines, as the
///          weights read by a model's projections leave it before its attention.
/// peers.py reads the same variable, so that one run times every implementation alike.
inline bool clean_flush() {
  static const bool clean = [] {
    const char* v = std::getenv("QEVICT_BENCH_FLUSH");
    const std::string mode = v ? v : "dirty";
    if (mode != "dirty" && mode != "clean") {
      std::fprintf(stderr, "QEVICT_BENCH_FLUSH must be dirty or clean, not '%s'\n", mode.c_str());
      std::exit(2);
    }
    return mode == "clean";
  }();
  return clean;
}

/// Reads n 16-byte words (into L2, not L1) and keeps the compiler from dropping the loads.
__global__ void read_through_l2(const uint4* p, std::size_t n, unsigned* never_written) {
  unsigned x = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *never_written = x;  // the buffer is zeros: never taken
}

/// Median milliseconds of `fn` over `reps` timed runs after `warmup`, with the L2 cache flushed
/// before each run (so that small states are read from HBM, as in a model's layer loop; see
/// clean_flush for how).
template <class Fn>
float median_ms(Fn&& fn, int warmup = 5, int reps = 30) {
  static char* flush = nullptr;
  static char* clean = nullptr;
  const std::size_t flush_bytes = 256u << 20;
  if (!flush) QEVICT_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  if (clean_flush() && !clean) {
    QEVICT_CUDA_CHECK(cudaMalloc(&clean, flush_bytes + 16));
    QEVICT_CUDA_CHECK(cudaMemset(clean, 0, flush_bytes + 16));
  }
  cudaEvent_t a, b;
  QEVICT_CUDA_CHECK(cudaEventCreate(&a));
  QEVICT_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < warmup + reps; ++i) {
    QEVICT_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
    if (clean_flush()) {
      read_through_l2<<<1024, 256>>>(reinterpret_cast<const uint4*>(clean), flush_bytes / 16, reinterpret_cast<unsigned*>(clean + flush_bytes));
      QEVICT_CUDA_CHECK(cudaGetLastError());
    }
    QEVICT_CUDA_CHECK(cudaEventRecord(a));
    fn();
    QEVICT_CUDA_CHECK(cudaEventRecord(b));
    QEVICT_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    QEVICT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench

#pragma once
// Prefill on the device: RoPE of the prompt's keys and queries, exact causal attention (a plain
// warp-per-key kernel with an online softmax; the prompt is attended once), the observation
// window's window masses, the initial scores (the scorer's aggregation and pooling, the functions
// of policies/scorers.hpp that the host calls too) and the placement of the sinks and the recent
// tokens. The first routing event follows (routing.cuh), with the prefill's buffers as the source
// of the windows that age.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "qevict/kernels/cache_state.cuh"

namespace qevict::kernels::detail {

/// x[rows][heads][D] rotated to positions first, first + 1, ... (one thread per pair).
template <bool Rotates>
__global__ void rotate_rows_kernel(const cache_params P, const cache_pointers S, const float* x, float* y, int rows, int heads,
                                   long long first) {
  if (failed(S.error)) return;
  const int D = P.L.head_dim;
  const std::size_t pairs = static_cast<std::size_t>(rows) * heads * (D / 2);
  for (std::size_t e = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; e < pairs;
       e += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(e % (D / 2));
    const std::size_t rh = e / (D / 2);
    const long long r = static_cast<long long>(rh / heads);
    int a, b;
    pair_members(P.L.layout, D, i, a, b);
    float x0 = x[rh * D + a], x1 = x[rh * D + b];
    if constexpr (Rotates) rotate_pair(x0, x1, first + r, S.inv_freq[i], +1);
    y[rh * D + a] = x0;
    y[rh * D + b] = x1;
  }
}

/// Causal attention of queries first_row..n-1 (grid.x) for every query head (grid.y); 4 warps.
/// Observation queries (>= first_observer) add p / (query heads of the unit) of each token to the
/// mass of its window's table entry (window * units + unit), in qmass[observer][started * units];
/// times ‖v‖ of the token for a value-weighted scorer.
template <int D, bool ValueWeighted>
__global__ void __launch_bounds__(128) prefill_attention_kernel(const cache_params P, const cache_pointers S, const float* qr,
                                                                const float* kr, const float* v, float* out, double* qmass,
                                                                int n, int q0, int first_row, int first_observer, int started) {
  if (failed(S.error)) return;
  constexpr int M = D / 32;
  const decode_layout& L = P.L;
  const int i = first_row + blockIdx.x, qh = blockIdx.y, HQ = P.q_heads, G = L.group, kvh = qh / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::size_t krow = static_cast<std::size_t>(L.kv_heads) * D;
  const float scale = rsqrtf(static_cast<float>(D));
  float q[M];
#pragma unroll
  for (int m = 0; m < M; ++m) q[m] = qr[(static_cast<std::size_t>(i - q0) * HQ + qh) * D + lane + 32 * m] * scale;
  auto logit = [&](int j) {
    const float* k = kr + j * krow + static_cast<std::size_t>(kvh) * D;
    float dot = 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) dot += q[m] * k[lane + 32 * m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    return dot;
  };
  float mx = -INFINITY, sum = 0.f, acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int j = warp; j <= i; j += 4) {
    const float s = logit(j);
    const float m_new = fmaxf(mx, s);
    const float alpha = __expf(mx - m_new), p = __expf(s - m_new);
    sum = sum * alpha + p;
    const float* vj = v + j * krow + static_cast<std::size_t>(kvh) * D;
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = acc[m] * alpha + p * vj[lane + 32 * m];
    mx = m_new;
  }
  __shared__ float ms[4], ss[4], os[4][D];
  if (lane == 0) {
    ms[warp] = mx;
    ss[warp] = sum;
  }
#pragma unroll
  for (int m = 0; m < M; ++m) os[warp][lane + 32 * m] = acc[m];
  __syncthreads();
  float Mx = -INFINITY;
  for (int w = 0; w < 4; ++w) Mx = fmaxf(Mx, ms[w]);
  float Ls = 0.f;
  for (int w = 0; w < 4; ++w) Ls += ms[w] == -INFINITY ? 0.f : ss[w] * __expf(ms[w] - Mx);
  if (out)
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      float o = 0.f;
      for (int w = 0; w < 4; ++w) o += ms[w] == -INFINITY ? 0.f : os[w][c] * __expf(ms[w] - Mx);
      out[(static_cast<std::size_t>(i) * HQ + qh) * D + c] = o / Ls;
    }
  if (i >= first_observer) {
    const int U = L.units, u = L.unit_of(kvh);
    const double unit_queries = static_cast<double>(HQ) / U;
    double* row = qmass + static_cast<std::size_t>(i - first_observer) * started * U;
    for (int j = L.sinks + warp; j <= i; j += 4) {
      const float p = __expf(logit(j) - Mx) / Ls;
      double weight = 1.0;
      if constexpr (ValueWeighted) {
        const float* vj = v + j * krow + static_cast<std::size_t>(kvh) * D;
        float sq = 0.f;
#pragma unroll
        for (int m = 0; m < M; ++m) sq = fmaf(vj[lane + 32 * m], vj[lane + 32 * m], sq);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        weight = sqrtf(sq);
      }
      if (lane == 0) atomicAdd(row + (j - L.sinks) / L.window * U + u, weight * p / unit_queries);
    }
  }
}

/// The scorer's aggregation of the observation queries, one thread per table entry: row o of
/// qmass ([observers][entries]) holds query o's masses; row 0 receives their aggregate.
template <class Scorer>
__global__ void prefill_aggregate_kernel(const cache_pointers S, double* qmass, int observers, int entries) {
  if (failed(S.error)) return;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < entries; e += gridDim.x * blockDim.x) {
    double m = 0.0;
    for (int o = 0; o < observers; ++o)
      m = scorers::aggregate_observation<Scorer>(m, qmass[static_cast<std::size_t>(o) * entries + e]);
    qmass[e] = m;
  }
}

/// Initial scores from the aggregated observation masses (qmass row 0, after the scorer's pooling
/// over the neighbouring windows of the same unit); sinks and recent tokens into their blocks; the
/// lane's token count.
template <class Scorer>
__global__ void prefill_place_kernel(const cache_params P, const cache_pointers S, int lane_index, const float* kr, const float* v,
                                     const double* mass, int n, int started, int aged_after) {
  if (failed(S.error)) return;
  const decode_layout& L = P.L;
  const int D = L.head_dim, H = L.kv_heads;
  std::byte* region = S.arena + L.region_offset(lane_index);
  window_record* table = reinterpret_cast<window_record*>(region);
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const int U = L.units;
  for (std::size_t e = tid; e < static_cast<std::size_t>(started) * U; e += stride) {
    const int w = static_cast<int>(e / U);
    const double m = scorers::pooled_prefill_mass<Scorer>(mass + e % U, U, w, started);
    table[e].score = Scorer::accumulate(Scorer::initial_score(w), static_cast<float>(m));
  }
  const int recent_from = L.sinks + aged_after * L.window;
  for (std::size_t e = tid; e < static_cast<std::size_t>(n) * H * D; e += stride) {
    const int t = static_cast<int>(e / (static_cast<std::size_t>(H) * D)), h = static_cast<int>((e / D) % H), c = static_cast<int>(e % D);
    if (t >= L.sinks && t < recent_from) continue;
    const bool sink = t < L.sinks;
    void* base = region + (sink ? L.sink_offset : L.recent_offset);
    const int C = sink ? L.sinks : L.recent_capacity;
    const int slot = sink ? t : (t - L.sinks) % L.recent_capacity;
    numeric::store(P.element, base, key_index(D, C, h, slot, c), kr[e]);
    numeric::store(P.element, base, value_index(D, C, h, slot, c), v[e]);
  }
  if (tid == 0) {
    S.lanes[lane_index].tokens = n;
    S.extra[lane_index].steps = 0;
  }
}

}  // namespace qevict::kernels::detail

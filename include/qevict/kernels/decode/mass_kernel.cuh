#pragma once
// The window-mass kernel: after the attention kernel's merges, each window's mass from its items'
// logarithms and its heads' log-sum-exps, added to the window's score by the scorer.

#include <cuda_runtime.h>

#include <cstddef>

#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/items.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/decode/merge.cuh"
#include "qevict/kernels/dependent_launch.cuh"

namespace qevict::kernels::detail {

/// Threads per CTA of the window-mass kernel. Its threads hold 32 values and 32 log-sum-exps at once
/// (about 90 registers): at 128 threads a CTA, five CTAs fit on an SM (660 on an H200), so that the
/// 640 CTAs of a 20 % step at batch 32 and 32K tokens all run at once (256 threads a CTA: two CTAs
/// an SM, and that grid in two waves).
constexpr int mass_threads = 128;

/// KV heads whose values and log-sum-exps a thread of the window-mass kernel loads before its first
/// addition, for groups of at most MaxGroup query heads: 32 of each in registers, so that a unit
/// of 8 KV heads with groups of at most 4 is summed after one round trip to memory.
template <int MaxGroup>
inline constexpr int mass_heads_at_once = 32 / MaxGroup;

/// Window masses of a launch with EmitMass, after the decode kernel has merged its chunks: each
/// listed or recent window's mass is the sum over its unit's query heads of 2^(its items' values
/// (part_mass) - the head's log-sum-exp (part_lse)), divided by the unit's query heads, and goes
/// into its score. Grid: (x, batch), one thread per window. MaxGroup (4 or 8) bounds the
/// launch's GQA group. per_sequence: the decode launch had several chunks a (sequence, KV head), and
/// each CTA waits for its own sequence's merges (wait_for_lse_written); else for the whole decode
/// grid.
template <int W, class Scorer, int MaxGroup>
__global__ void __launch_bounds__(mass_threads)
    decode_mass_kernel(const decode_layout L, const decode_arguments A, bool per_sequence) {
  static_assert(MaxGroup == 4 || MaxGroup == 8, "decode_mass_kernel: groups are loaded in 16-byte pieces of 4 heads");
  const int b = blockIdx.y;
  const int lane_index = A.batch_lanes[b];
  const lane_state lane = A.lanes[lane_index];
  const int G = L.group, HQ = L.kv_heads * G;
  // Thread i takes the i-th listed or recent window of every unit: the sum of its items' values
  // (W > 8: its parts; W < 8: its share of one item) over the unit's heads, added to its score
  // once. A unit's mass is divided by its query heads, so that a step's masses of one unit sum
  // to 1 (the host's rule; with per-layer selection, all query heads).
  constexpr int S = item_count::windows_per_item(W), P = W >= 8 ? W / 8 : 1;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int started = windows_started(lane.tokens, L.sinks, W);
  const int first_item = L.sinks > 0 ? 1 : 0;
  const int hu = L.heads_per_unit;
  window_record* table = reinterpret_cast<window_record*>(A.arena + lane.region);
  for (int u = 0; u < L.units; ++u) {
    const int list = lane_index * L.units + u;
    const int n_entries = A.entry_counts[list];
    const int n_items = items_of<W>(L, lane, n_entries);
    const bool listed = i < n_entries;
    const int r = listed ? i : i - n_entries;  // index among the listed or among the recent windows
    const bool has_window = i < n_entries + (started - lane.aged);
    const int w = !has_window ? -1 : listed ? A.entries[static_cast<std::size_t>(list) * L.entries_per_lane + i].window : lane.aged + r;
    // w < 0: no window, or a padding entry (decode_layout::record_entries).
    const int base = first_item + (listed ? 0 : item_count::listed(W, n_entries));
    const int item0 = base + (W >= 8 ? r * P : r / S), j = W >= 8 ? 0 : r % S;
    window_record* rec = table + (w < 0 ? 0 : w * L.units + u);
    const float score = w < 0 ? 0.f : rec->score;  // loaded before the wait, so that its latency overlaps it
    // Everything above is the routing state, which the decode kernel does not write; its masses
    // and log-sum-exps follow, once the sequence's KV heads are merged (every thread of the CTA
    // reaches the wait, which is a barrier) or the decode grid has ended.
    if (u == 0) {
      if (per_sequence) wait_for_lse_written(L, A, b);
      else grid::wait_for_previous_kernel();
    }
    if (w < 0) continue;
    // The unit's heads in order, each over its query heads, in a fixed order of additions. The
    // values and log-sum-exps of mass_heads_at_once heads are loaded into registers of their own before
    // the first addition, so that all their loads are in flight at once (a register that the next
    // load reused would wait for the addition, and so for the load before it); a group of 4 or 8
    // query heads is loaded in 16-byte pieces.
    constexpr int K = mass_heads_at_once<MaxGroup>;
    const std::size_t head_stride = static_cast<std::size_t>(L.max_items) * S * G;
    const std::size_t bh0 = static_cast<std::size_t>(b) * L.kv_heads + u * hu;  // the unit's first KV head
    const bool whole_pieces = G % 4 == 0;
    float mass = 0.f;
    for (int p = 0; p < P && item0 + p < n_items; ++p) {
      const int li = item0 + p;
      const float* pm = A.part_mass + ((bh0 * L.max_items + li) * S + j) * G;
      const float* f = A.part_lse + bh0 * G;
      for (int k0 = 0; k0 < hu; k0 += K) {
        float v[K][MaxGroup], w[K][MaxGroup];
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (k0 + k >= hu) break;
          const float* vk = pm + (k0 + k) * head_stride;
          const float* wk = f + (k0 + k) * G;
          if (whole_pieces) {
#pragma unroll
            for (int q = 0; q < MaxGroup / 4; ++q)
              if (4 * q < G) {
                const float4 a = *reinterpret_cast<const float4*>(vk + 4 * q), e = *reinterpret_cast<const float4*>(wk + 4 * q);
                v[k][4 * q] = a.x, v[k][4 * q + 1] = a.y, v[k][4 * q + 2] = a.z, v[k][4 * q + 3] = a.w;
                w[k][4 * q] = e.x, w[k][4 * q + 1] = e.y, w[k][4 * q + 2] = e.z, w[k][4 * q + 3] = e.w;
              }
          } else {
#pragma unroll
            for (int hg = 0; hg < MaxGroup; ++hg)
              if (hg < G) v[k][hg] = vk[hg], w[k][hg] = wk[hg];
          }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (k0 + k >= hu) break;
#pragma unroll
          for (int hg = 0; hg < MaxGroup; ++hg)
            if (hg < G) mass += exp2_sfu(v[k][hg] - w[k][hg]);  // 2^-inf = 0: a window without mass
        }
      }
    }
    mass /= static_cast<float>(HQ / L.units);
    rec->score = Scorer::accumulate(score, mass);
  }
  if (per_sequence) end_after_decode_grid(A);
}

}  // namespace qevict::kernels::detail

#pragma once
// Routing events on the device (Algorithm 1), for every due (sequence, layer) lane in one launch
// of each of three kernels:
//
//   route_decide_kernel   one CTA per lane: candidates = Full ∪ Quantized ∪ newly aged table
//                         entries (window * units + unit: a window, or one KV head of it with
//                         per-KV-head selection), sorted in shared memory by (score desc, entry
//                         asc) — core/routing.hpp's ranks_before — then assign_tiers' rule (K_f,
//                         then K_q − |F ∩ ledger|, both in units), slot bookkeeping, window-table
//                         update, each unit's window list, after_routing. A frozen selection ranks
//                         only the newly aged entries, for the free slots.
//   quantize_kernel       first demotions into the ledger (from a Full slot, the recent ring or
//                         the prefill's buffers): unrotate, quantize with the policy's own code.
//   store_full_kernel     promotions (dequantize + RoPE) and newly aged windows into Full slots
//                         (token rows, or records of a quantized top tier: quantize_head again).
//
// Slots. The host backend keeps each lane's free slots on two stacks and, in rank order, frees
// (evictions, then demotions) before it takes (demotions needing a record, new quantized windows;
// promotions, new Full windows). All pushes of one event precede all pops of the same stack, so
// the stack position of every push and pop follows from prefix counts in rank order: the device
// gives every window exactly the slot the host gives it, and the arenas match byte for byte.
//
// Data. A Full slot freed by a demotion can be taken by a promotion of the same event: the
// quantize kernel (which reads it) runs before the store kernel (which writes it).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "qevict/kernels/cache_state.cuh"
#include "qevict/kernels/dependent_launch.cuh"

namespace qevict::kernels {

/// Where the tokens of windows that age during this event come from: the recent ring (decode) or
/// the prefill's RoPE'd keys and values (float, [tokens][kv_heads][head_dim]).
struct route_source {
  const float* k_post = nullptr;
  const float* v = nullptr;
};

namespace detail {

constexpr int route_threads = 1024;

/// The decide kernel's block scans, its radix sort's among them. Warp scans would finish each scan
/// by having every thread fold in the totals of all 32 warps (route_threads / 32 steps per
/// thread); with one CTA per lane and a handful of scans per event, those steps were about half
/// of the kernel's instructions. Raking leaves that serial part to one warp.
constexpr cub::BlockScanAlgorithm route_scan = cub::BLOCK_SCAN_RAKING;

/// The decide kernel's stable radix sort of Items (key, table entry) pairs per thread, for more than
/// route_threads candidates (bitonic_sort_block sorts fewer).
template <int Items>
using route_sort = cub::BlockRadixSort<std::uint32_t, route_threads, Items, int, 4, true, route_scan>;

/// Items per decide-kernel thread for `count` items (a lane's table entries or windows, or the
/// candidates the sort ranks): the smallest of 1, 4 or 16 that holds them.
constexpr int route_items_for(int count) { return count <= route_threads ? 1 : count <= 4 * route_threads ? 4 : 16; }
constexpr int route_max_entries = 16 * route_threads;

/// f.template operator()<Items>() for Items = items, one of route_items_for's counts up to MaxItems:
/// the one place that maps a count to the instantiation that runs it (the host picks the kernel,
/// the kernel its sort).
template <int MaxItems, class F>
QEVICT_HOST_DEVICE constexpr void with_route_items(int items, F&& f) {
  if (items == 1) f.template operator()<1>();
  if constexpr (MaxItems >= 4)
    if (items == 4) f.template operator()<4>();
  if constexpr (MaxItems >= 16)
    if (items == 16) f.template operator()<16>();
}

/// Float score -> unsigned key whose ascending order is descending score (+0 and -0 equal). A finite
/// score never gives ~0u, which marks a table entry that is no candidate.
__device__ __forceinline__ std::uint32_t descending_score_key(float s) {
  if (s == 0.0f) s = 0.0f;
  std::uint32_t u = __float_as_uint(s);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~u;
}
constexpr std::uint32_t not_a_candidate = ~0u;

/// Counts of the seven kinds of candidate a routing event moves (route_decide_kernel's flags), one
/// 16-bit field each (a lane has at most route_max_entries = 2^14 candidates, so no field carries
/// into the next), summed by one block scan.
struct move_counts {
  static constexpr int kinds = 7;
  unsigned long long lo = 0, hi = 0;  // kinds 0-3, 4-6

  __device__ int operator[](int f) const { return static_cast<int>(((f < 4 ? lo : hi) >> (16 * (f & 3))) & 0xffffu); }
  __device__ void add(int f) { (f < 4 ? lo : hi) += 1ull << (16 * (f & 3)); }
  __device__ move_counts operator+(const move_counts& o) const { return move_counts{lo + o.lo, hi + o.hi}; }
};
struct move_counts_sum {
  __device__ move_counts operator()(const move_counts& a, const move_counts& b) const { return a + b; }
};
using route_move_scan = cub::BlockScan<move_counts, route_threads, route_scan>;

/// Sorts the CTA's route_threads (key, entry) pairs, one a thread, by key and then entry, ascending:
/// afterwards thread t holds the pair of rank t. The decide kernel's sort of at most route_threads
/// candidates (a decode event's, at small budgets). A bitonic network of 55 compare-exchange steps:
/// the 40 between lanes of one warp by shuffles, the 15 across warps through `buffer` (2 *
/// route_threads words), one barrier each. cub's radix sort would take 8 passes of 4 bits, each of
/// which clears, scans and rewrites every thread's digit counters (about 30 shared-memory operations
/// and 6 barriers a pass) however few the candidates. Entries are distinct for real candidates, so
/// the order is the stable sort's (ranks_before).
__device__ __forceinline__ void bitonic_sort_block(std::uint32_t& key, int& entry, unsigned long long* buffer) {
  static_assert(route_threads == 1024, "bitonic_sort_block: the network below is unrolled for 1024 threads");
  const int t = static_cast<int>(threadIdx.x);
  unsigned long long v = static_cast<unsigned long long>(key) << 32 | static_cast<std::uint32_t>(entry);
  int step = 0;  // which half of buffer the next step across warps writes
#pragma unroll
  for (int k = 2; k <= route_threads; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      unsigned long long other;
      if (j >= 32) {
        // Two halves, alternately: a step writes the half that the step before it did not read.
        unsigned long long* half = buffer + (step++ & 1) * route_threads;
        half[t] = v;
        __syncthreads();
        other = half[t ^ j];
      } else {
        other = __shfl_xor_sync(0xffffffffu, v, j);
      }
      // The smaller of the two where keep_smaller, else the larger: one comparison (where the two
      // are equal, either is both).
      const bool keep_smaller = ((t & j) == 0) == ((t & k) == 0);
      v = (other < v) == keep_smaller ? other : v;
    }
  }
  key = static_cast<std::uint32_t>(v >> 32);
  entry = static_cast<int>(static_cast<std::uint32_t>(v));
}

/// Whether route_decide_kernel<…, MaxItems> keeps a copy of the lane's window table in shared
/// memory (12 bytes an entry: 48 KB for 4 entries a thread). The candidates' slots after the sort
/// and the window lists are then read there: two global round trips fewer on the kernel's chain of
/// dependent steps, one CTA a lane. 16 entries a thread (192 KB) do not fit beside the sort's storage.
template <int MaxItems>
inline constexpr bool route_mirrors_table = MaxItems <= 4;

/// A candidate of a routing event: its sort key (descending_score_key) and table entry.
struct route_candidate {
  std::uint32_t key;
  std::int32_t entry;
};

/// Shared memory of route_decide_kernel<Scorer, Routing, MaxItems> for the packed candidates, the
/// largest sort it may run, or the scan of the move counts, whichever is larger (one region, used
/// in turn), rounded up to 16 bytes.
template <int MaxItems>
constexpr std::size_t route_sort_bytes() {
  std::size_t bytes = sizeof(route_candidate) * MaxItems * route_threads;
  const auto at_least = [&](std::size_t b) { bytes = b > bytes ? b : bytes; };
  at_least(sizeof(typename route_move_scan::TempStorage));
  at_least(2 * route_threads * sizeof(unsigned long long));  // bitonic_sort_block's buffer
  if constexpr (MaxItems >= 4) at_least(sizeof(typename route_sort<4>::TempStorage));
  if constexpr (MaxItems >= 16) at_least(sizeof(typename route_sort<16>::TempStorage));
  return (bytes + 15) / 16 * 16;
}

/// Dynamic shared memory of route_decide_kernel<Scorer, Routing, MaxItems>: the sort's region and,
/// where route_mirrors_table, the copy of the lane's window table behind it.
template <int MaxItems>
constexpr std::size_t route_decide_bytes() {
  return route_sort_bytes<MaxItems>() + (route_mirrors_table<MaxItems> ? sizeof(window_record) * MaxItems * route_threads : 0);
}

/// Algorithm 1's decision and the slot bookkeeping, one CTA per listed lane. After its first event a
/// lane under a frozen routing policy (routing::frozen_after_prefill) ranks only its newly aged
/// windows, for the slots still free, as the host's route_lane does.
///
/// MaxItems (route_items_for(P.sort_capacity)) table entries per thread cover the lane's table.
/// Every phase works on what the threads hold in registers, in blocked order (thread t holds items
/// Items * t ... Items * t + Items - 1): the table's entries, whose candidates one block scan packs
/// in entry order into shared memory; those, Items = route_items_for(candidates) to a thread, in one
/// stable sort (bitonic for one a thread, radix for more), which leaves them in rank order; the
/// prefix counts in rank order that place every push, pop and task, from one block scan; and each
/// unit's window list, from one more. One CTA runs a lane's whole chain of dependent steps, so its
/// time is mostly their latencies: the kernel's first loads go out together, and where the table
/// fits (route_mirrors_table) the later phases read their entries from a copy in shared memory.
template <class Scorer, class Routing, int MaxItems>
__global__ void __launch_bounds__(route_threads) route_decide_kernel(const cache_params P, const cache_pointers S,
                                                                     const lane_list list, int source_kind) {
  using move_scan = route_move_scan;
  using list_scan = cub::BlockScan<int, route_threads, route_scan>;
  // The packed candidates, then the sort's storage, then move_scan's; behind them the table's copy
  // (route_decide_bytes<MaxItems>).
  extern __shared__ __align__(16) unsigned char sort_storage[];
  constexpr bool mirrored = route_mirrors_table<MaxItems>;
  window_record* const table_s = reinterpret_cast<window_record*>(sort_storage + route_sort_bytes<MaxItems>());
  __shared__ typename list_scan::TempStorage list_storage;
  __shared__ int kept_by_full;
  const decode_layout& L = P.L;
  int* task_count = S.task_counts + 2 * blockIdx.x;
  // The loads that start the kernel's chain go out together: the error flag, the lane's state and
  // its table's entries (thread t: entries MaxItems * t ...; the table has at most MaxItems *
  // route_threads), whose addresses need only the lane's index. Nothing is written before the flag
  // is tested.
  const int l = list.lane[blockIdx.x];
  const bool bad = failed(S.error);
  lane_state& lane = S.lanes[l];
  lane_extra& extra = S.extra[l];
  const lane_state lane_at_start = lane;
  const lane_extra extra_at_start = extra;
  window_record* table = reinterpret_cast<window_record*>(S.arena + L.region_offset(l));
  // The table's entries after the first barrier, and the slots a move gives an entry: read from
  // the copy where there is one, written to the table and the copy.
  const auto table_entry = [&](int e) { return mirrored ? table_s[e] : table[e]; };
  const auto set_slots = [&](int e, std::int32_t full_slot, std::int32_t ledger_slot) {
    table[e].full_slot = full_slot;
    table[e].ledger_slot = ledger_slot;
    if constexpr (mirrored) {
      table_s[e].full_slot = full_slot;
      table_s[e].ledger_slot = ledger_slot;
    }
  };
  const int U = L.units;
  const int table_entries = P.max_windows * U;
  const int first_entry = MaxItems * static_cast<int>(threadIdx.x);  // this thread's first table entry
  window_record rec[MaxItems];
#pragma unroll
  for (int i = 0; i < MaxItems; ++i)
    if (first_entry + i < table_entries) rec[i] = table[first_entry + i];
  if (bad) {
    if (threadIdx.x == 0) task_count[0] = task_count[1] = 0;
    return;
  }
  std::int32_t* free_full = S.free_full + static_cast<std::size_t>(l) * P.full_stride;
  std::int32_t* free_ledger = S.free_ledger + static_cast<std::size_t>(l) * P.ledger_stride;
  migration_task* qtasks = S.quantize_tasks + static_cast<std::size_t>(blockIdx.x) * P.max_tasks;
  migration_task* stasks = S.store_tasks + static_cast<std::size_t>(blockIdx.x) * P.max_tasks;

  const int tokens = lane_at_start.tokens;
  const int aged_before = lane_at_start.aged;
  const int span = tokens - L.sinks - P.recent;
  const int aged_after = max(aged_before, span > 0 ? span / L.window : 0);
  const int started = windows_started(tokens, L.sinks, L.window);
  const bool frozen = !Routing::rerank_after_first_event && extra_at_start.routed != 0;
  const int full_capacity = frozen ? extra_at_start.free_full : P.full_capacity;
  const int ledger_capacity = frozen ? extra_at_start.free_ledger : P.ledger_capacity;

  // Eq. 4: candidates = Full ∪ Quantized ∪ newly aged entries; only the newly aged under a frozen
  // selection. Entry e belongs to window L.window_of_entry(e). They are packed in entry order, so
  // that the stable sort breaks equal scores toward the lower entry (ranks_before).
  if (threadIdx.x == 0) kept_by_full = 0;
  route_candidate* packed = reinterpret_cast<route_candidate*>(sort_storage);
  int n = 0;
  {
    const int first = (frozen ? aged_before : 0) * U, last = aged_after * U;
    route_candidate c[MaxItems];
    int count = 0;
#pragma unroll
    for (int i = 0; i < MaxItems; ++i) {
      const int e = first_entry + i;
      c[i] = route_candidate{not_a_candidate, e};
      if (e >= first && e < last && tier_of(rec[i], L.window_of_entry(e) < aged_before) != tier::evicted) {
        c[i].key = descending_score_key(rec[i].score);
        ++count;
      }
      if constexpr (mirrored)
        if (e < table_entries) table_s[e] = rec[i];
    }
    int at = 0;
    list_scan(list_storage).ExclusiveSum(count, at, n);
#pragma unroll
    for (int i = 0; i < MaxItems; ++i)
      if (c[i].key != not_a_candidate) packed[at++] = c[i];
    __syncthreads();  // packed and the table's copy are complete; list_storage is free
  }

  // Ranks, Algorithm 1's tiers and the slot bookkeeping, with Items candidates per thread.
  move_counts T;
  int full_top = 0, ledger_top = 0;  // stack sizes after the pushes
  const auto rank_and_move = [&]<int Items>() {
    const int mine = Items * static_cast<int>(threadIdx.x);  // the rank of this thread's first item
    std::uint32_t key[Items];
    int entry[Items];
#pragma unroll
    for (int i = 0; i < Items; ++i) {
      const bool real = mine + i < n;  // the rest sort behind the candidates
      key[i] = real ? packed[mine + i].key : not_a_candidate;
      entry[i] = real ? packed[mine + i].entry : 0;
    }
    __syncthreads();  // the sort's storage overlaps packed
    if constexpr (Items == 1) {
      bitonic_sort_block(key[0], entry[0], reinterpret_cast<unsigned long long*>(sort_storage));
    } else {
      using radix_sort = route_sort<Items>;
      radix_sort(*reinterpret_cast<typename radix_sort::TempStorage*>(sort_storage)).Sort(key, entry);
    }

    // The ranked candidates' slots (item i of this thread has rank mine + i).
    std::int32_t full_slot[Items], ledger_slot[Items];
    tier prev[Items];
    int has_in_full = 0;
    const int n_full = min(full_capacity, n);
#pragma unroll
    for (int i = 0; i < Items; ++i) {
      full_slot[i] = ledger_slot[i] = -1;
      prev[i] = tier::evicted;
      if (mine + i < n) {
        const window_record r = table_entry(entry[i]);
        full_slot[i] = r.full_slot;
        ledger_slot[i] = r.ledger_slot;
        prev[i] = tier_of(r, L.window_of_entry(entry[i]) < aged_before);
        has_in_full += mine + i < n_full && r.ledger_slot >= 0 ? 1 : 0;
      }
    }
    // assign_tiers: the top K_f are Full; Quantized takes K_q − |F ∩ ledger| of the rest.
    if (has_in_full > 0) atomicAdd(&kept_by_full, has_in_full);
    __syncthreads();
    const int room = ledger_capacity > kept_by_full ? ledger_capacity - kept_by_full : 0;
    const int n_quantized = min(room, n - n_full);

    // Flags of the candidate at rank r: 0 evicted holding a Full slot, 1 demoted (Full -> Quantized),
    // 2 promoted (Quantized -> Full), 3 newly aged -> Full, 4 evicted holding a record,
    // 5 demoted without a record yet, 6 newly aged -> Quantized.
    unsigned char flags[Items];
    move_counts local;
#pragma unroll
    for (int i = 0; i < Items; ++i) {
      const int r = mine + i;
      const tier next = r < n_full ? tier::full : r < n_full + n_quantized ? tier::quantized : tier::evicted;
      const bool evict = r < n && next == tier::evicted;
      bool f[move_counts::kinds];
      f[0] = evict && full_slot[i] >= 0;
      f[4] = evict && ledger_slot[i] >= 0;
      f[1] = r < n && next == tier::quantized && prev[i] == tier::full;
      f[5] = f[1] && ledger_slot[i] < 0;
      f[6] = r < n && next == tier::quantized && prev[i] == tier::recent;
      f[2] = r < n && next == tier::full && prev[i] == tier::quantized;
      f[3] = r < n && next == tier::full && prev[i] == tier::recent;
      flags[i] = 0;
#pragma unroll
      for (int k = 0; k < move_counts::kinds; ++k)
        if (f[k]) {
          flags[i] |= static_cast<unsigned char>(1u << k);
          local.add(k);
        }
    }
    // Each kind's rank of this thread's first item, and the totals, in rank order.
    move_counts before;
    // The sort's storage is free since the barrier above.
    move_scan(*reinterpret_cast<typename move_scan::TempStorage*>(sort_storage)).ExclusiveScan(local, before, move_counts{}, move_counts_sum{}, T);
    const int full0 = extra_at_start.free_full, ledger0 = extra_at_start.free_ledger;
    full_top = full0 + T[0] + T[1];
    ledger_top = ledger0 + T[4];
    // Pushes: freed Full slots (evictions, then demotions), freed records (evictions).
    {
      move_counts at = before;
#pragma unroll
      for (int i = 0; i < Items; ++i) {
        const unsigned f = flags[i];
        if (f & 1u) free_full[full0 + at[0]] = full_slot[i];
        if (f & 2u) free_full[full0 + T[0] + at[1]] = full_slot[i];
        if (f & 16u) free_ledger[ledger0 + at[4]] = ledger_slot[i];
#pragma unroll
        for (int k = 0; k < move_counts::kinds; ++k)
          if (f & (1u << k)) at.add(k);
      }
    }
    __syncthreads();  // the pushes are visible to the pops
    // Pops and table updates; migration tasks in the host's order.
    {
      move_counts at = before;
#pragma unroll
      for (int i = 0; i < Items; ++i) {
        const unsigned f = flags[i];
        if (f == 0) continue;
        const int w = entry[i];  // the table entry
        std::int32_t fs = full_slot[i], ls = ledger_slot[i];
        if (f & (1u | 16u)) {
          fs = ls = -1;
        } else if (f & 2u) {
          if (f & 32u) {
            const int slot = free_ledger[ledger_top - 1 - at[5]];
            qtasks[at[5]] = migration_task{w, 1, fs, slot};
            ls = slot;
          }
          fs = -1;
        } else if (f & 64u) {
          const int k = T[5] + at[6];
          const int slot = free_ledger[ledger_top - 1 - k];
          qtasks[k] = migration_task{w, source_kind, 0, slot};
          ls = slot;
        } else if (f & 4u) {
          const int slot = free_full[full_top - 1 - at[2]];
          stasks[at[2]] = migration_task{w, 3, ls, slot};
          fs = slot;
        } else if (f & 8u) {
          const int k = T[2] + at[3];
          const int slot = free_full[full_top - 1 - k];
          stasks[k] = migration_task{w, source_kind, 0, slot};
          fs = slot;
        }
        set_slots(w, fs, ls);
#pragma unroll
        for (int k = 0; k < move_counts::kinds; ++k)
          if (f & (1u << k)) at.add(k);
      }
    }
  };
  with_route_items<MaxItems>(route_items_for(n), rank_and_move);
  __syncthreads();  // the table is updated
  // Each unit's window list: its Full windows in window order, then its Quantized ones, and
  // after_routing on every live entry. Listing each tier together makes nearly every item pair the
  // decode kernel takes two items of one kind (two records, or two of token rows), the kinds it
  // handles without branches. With records of windows shorter than 8 tokens (L.record_entries > 1)
  // each Quantized window is followed by padding, and the Full ones are padded to whole items
  // (decode_layout::record_entries). Thread t holds windows MaxItems * t ...; one scan of both tiers'
  // counts (16-bit fields: at most 2^14 windows) places them.
  const int R = L.record_entries;
  constexpr window_entry padding{-1, 0};
  const int first_window = MaxItems * static_cast<int>(threadIdx.x);  // this thread's first window
  for (int u = 0; u < U; ++u) {
    const std::size_t list_index = static_cast<std::size_t>(l) * U + u;
    window_entry* out = S.entries + list_index * L.entries_per_lane;
    std::int32_t code[MaxItems];  // the list entry's slot: Full slot, or ~ledger slot
    tier t[MaxItems];
    int local_counts = 0;  // Full | Quantized << 16
#pragma unroll
    for (int i = 0; i < MaxItems; ++i) {
      const int w = first_window + i;
      t[i] = tier::evicted;
      code[i] = 0;
      if (w < started) {
        const int e = w * U + u;
        const window_record r = table_entry(e);
        t[i] = tier_of(r, w < aged_after);
        // Only a score that after_routing changes is stored (none for a scorer whose scores
        // routing leaves as they are).
        if (t[i] != tier::evicted) {
          const float after = Scorer::after_routing(r.score);
          if (after != r.score) table[e].score = after;
        }
        code[i] = r.full_slot >= 0 ? r.full_slot : ~r.ledger_slot;
        local_counts += t[i] == tier::full ? 1 : t[i] == tier::quantized ? 1 << 16 : 0;
      }
    }
    int offsets, totals;
    list_scan(list_storage).ExclusiveSum(local_counts, offsets, totals);
    const int n_listed_full = totals & 0xffff, n_listed_quantized = totals >> 16;
    const int full_end = (n_listed_full + R - 1) / R * R;  // whole items
    int at_full = offsets & 0xffff, at_quantized = full_end + R * (offsets >> 16);
#pragma unroll
    for (int i = 0; i < MaxItems; ++i) {
      if (t[i] == tier::full) {
        out[at_full++] = window_entry{first_window + i, code[i]};
      } else if (t[i] == tier::quantized) {
        out[at_quantized] = window_entry{first_window + i, code[i]};
        for (int k = 1; k < R; ++k) out[at_quantized + k] = padding;
        at_quantized += R;
      }
    }
    for (int e = n_listed_full + static_cast<int>(threadIdx.x); e < full_end; e += blockDim.x) out[e] = padding;
    if (threadIdx.x == 0) S.entry_counts[list_index] = full_end + R * n_listed_quantized;
    __syncthreads();  // list_storage is free for the next unit
  }
  if (threadIdx.x == 0) {
    lane.aged = aged_after;
    extra.steps = 0;
    extra.routed = 1;
    extra.free_full = full_top - T[2] - T[3];
    extra.free_ledger = ledger_top - T[5] - T[6];
    task_count[0] = T[5] + T[6];
    task_count[1] = T[2] + T[3];
  }
}

/// Dequantized key / value element of a record head, as Q::dequantize_* computes it (product and
/// sum rounded separately, like the host's scalar code).
template <class Q>
__device__ __forceinline__ float record_key(const quantizers::record_layout& R, const std::uint8_t* rec, int t, int c) {
  const float s = Q::meta_type::decode(Q::load_meta(rec + R.key_scale_offset(), c));
  const float z = Q::meta_type::decode(Q::load_meta(rec + R.key_zero_offset(), c));
  return __fadd_rn(z, __fmul_rn(s, static_cast<float>(Q::get_code(rec, static_cast<std::size_t>(t) * R.head_dim + c))));
}
template <class Q>
__device__ __forceinline__ float record_value(const quantizers::record_layout& R, const std::uint8_t* rec, int t, int c) {
  const float s = Q::meta_type::decode(Q::load_meta(rec + R.value_scale_offset(), t));
  const float z = Q::meta_type::decode(Q::load_meta(rec + R.value_zero_offset(), t));
  return __fadd_rn(z, __fmul_rn(s, static_cast<float>(Q::get_code(rec + R.value_codes_offset(), static_cast<std::size_t>(t) * R.head_dim + R.value_slot(c)))));
}

/// Reads the tokens of window w (W tokens) as attention sees them — keys after RoPE — from where a
/// migration task takes them: the recent ring (kind 0), a Full slot (kind 1: token rows, or a
/// record of FullQ when the top tier is quantized), the prefill's rows (kind 2) or a ledger record
/// of LedgerQ (kind 3). A record is dequantized and its keys are rotated by their key frame's read
/// rotation when Rotates, as the host backend's dequantize_rotated does. LedgerQ and FullQ name the
/// record sources a kernel can meet (void: none of that kind), so that the per-element reads of a
/// kernel that meets only token rows carry no record branch. The source kind is a template argument
/// too (with_source picks it once per task): a warp reads one window per task, element by element,
/// and with a kind known at compile time each element's read is one address and one load rather
/// than a branch over four places. A Full slot and a record hold the heads of one unit: KV head h
/// is head L.head_in_unit(h) there.
template <int D, int W, element_type E, class LedgerQ, class FullQ, bool Rotates, int Kind>
struct token_reader {
  static_assert(Kind >= 0 && Kind <= 3, "token_reader: the source kind is 0 (recent ring), 1 (Full slot), 2 (prefill rows) or 3 (ledger record)");
  const cache_params* P;
  const std::byte* region;
  route_source src;
  int slot;
  long long first_position;  ///< of the lane's first token
  const double* inv_freq;
  /// The calling warp's copy of its KV head's ledger record (kind 3) in shared memory
  /// (stage_record_head), or nullptr to read the record where it lies.
  const std::uint8_t* staged = nullptr;

  /// Channels a and b (rotary pair i) of token j's key, KV head h.
  __device__ __forceinline__ void key_pair(int w, int j, int h, int i, int a, int b, float& x0, float& x1) const {
    if constexpr (any_records) {
      if (const std::uint8_t* rec = record(h)) {
        x0 = from_record(false, rec, j, a);
        x1 = from_record(false, rec, j, b);
        if constexpr (Rotates) {
          const long long t0 = first_position + P->L.sinks + static_cast<long long>(w) * W;
          // Both tiers' quantizers share one key frame (cuda_support::full_tier).
          rotate_pair(x0, x1, frame::read_rotation(t0, t0 + j), inv_freq[i], +1);
        }
        return;
      }
    }
    x0 = load(false, w, j, h, a);
    x1 = load(false, w, j, h, b);
  }
  /// Channel c of token j's key when no record needs rotating (not Rotates).
  __device__ __forceinline__ float key(int w, int j, int h, int c) const {
    static_assert(!Rotates, "token_reader::key: rotated records are read in pairs (key_pair)");
    if constexpr (any_records) {
      if (const std::uint8_t* rec = record(h)) return from_record(false, rec, j, c);
    }
    return load(false, w, j, h, c);
  }
  __device__ __forceinline__ float value(int w, int j, int h, int c) const {
    if constexpr (any_records) {
      if (const std::uint8_t* rec = record(h)) return from_record(true, rec, j, c);
    }
    return load(true, w, j, h, c);
  }

  /// KV head h's ledger record (kind 3) where it lies.
  __device__ __forceinline__ const std::uint8_t* ledger_record(int h) const {
    static_assert(ledger_records && Kind == 3, "token_reader::ledger_record: only a reader of ledger records has one");
    const decode_layout& L = P->L;
    return reinterpret_cast<const std::uint8_t*>(region + L.ledger_offset + static_cast<std::size_t>(slot) * L.record_bytes) +
           static_cast<std::size_t>(L.head_in_unit(h)) * L.ledger_format.head_bytes;
  }

 private:
  static constexpr bool ledger_records = !std::is_void_v<LedgerQ>, full_records = !std::is_void_v<FullQ>;
  static constexpr bool any_records = ledger_records || full_records;
  // The records' key frame (both tiers share one); a reader without records rotates nothing, and
  // any quantizer's frame stands in.
  using frame = typename std::conditional_t<ledger_records, LedgerQ, std::conditional_t<full_records, FullQ, quantizers::asymmetric<2>>>::key_frame;

  /// KV head h's record in the source (its staged copy where the warp made one), or nullptr for
  /// token rows.
  __device__ __forceinline__ const std::uint8_t* record(int h) const {
    const decode_layout& L = P->L;
    if constexpr (ledger_records && Kind == 3) return staged != nullptr ? staged : ledger_record(h);
    if constexpr (full_records && Kind == 1)
      return reinterpret_cast<const std::uint8_t*>(region + L.full_offset + static_cast<std::size_t>(slot) * L.full_window_bytes) +
             static_cast<std::size_t>(L.head_in_unit(h)) * L.full_format.head_bytes;
    return nullptr;
  }
  /// Element (token j, channel c) of a record: LedgerQ's in the ledger, FullQ's in a Full slot.
  template <class Q>
  __device__ __forceinline__ static float element_of(bool value, const std::uint8_t* rec, int j, int c) {
    const quantizers::record_layout R = Q::layout(W, 1, D);
    return value ? record_value<Q>(R, rec, j, c) : record_key<Q>(R, rec, j, c);
  }
  __device__ __forceinline__ float from_record(bool value, const std::uint8_t* rec, int j, int c) const {
    if constexpr (ledger_records && full_records) return Kind == 1 ? element_of<FullQ>(value, rec, j, c) : element_of<LedgerQ>(value, rec, j, c);
    else if constexpr (full_records) return element_of<FullQ>(value, rec, j, c);
    else return element_of<LedgerQ>(value, rec, j, c);
  }
  /// The element of the keys (value = false) or the values section of token rows: the recent ring
  /// (kind 0), a Full slot (kind 1) or the prefill's rows.
  __device__ __forceinline__ float load(bool value, int w, int j, int h, int c) const {
    const decode_layout& L = P->L;
    if constexpr (Kind == 0 || Kind == 1) {
      const int capacity = Kind == 0 ? L.recent_capacity : W;
      const int s = Kind == 0 ? (w * W + j) % L.recent_capacity : j;
      const int head = Kind == 0 ? h : L.head_in_unit(h);
      const std::byte* base = Kind == 0 ? region + L.recent_offset
                                        : region + L.full_offset + static_cast<std::size_t>(slot) * L.full_window_bytes;
      return numeric::load(E, base, value ? value_index(D, capacity, head, s, c) : key_index(D, capacity, head, s, c));
    }
    const std::size_t t = static_cast<std::size_t>(L.sinks) + static_cast<std::size_t>(w) * W + j;
    return (value ? src.v : src.k_post)[(t * L.kv_heads + h) * D + c];
  }
};

/// f.template operator()<Kind>() for a migration task's source kind, one of the Kinds a kernel meets
/// (the last of them for any other value).
template <int... Kinds, class F>
QEVICT_HOST_DEVICE constexpr void with_source(int kind, F&& f) {
  constexpr int kinds[] = {Kinds...};
  constexpr int last = kinds[sizeof...(Kinds) - 1];
  bool done = false;
  ((!done && (kind == Kinds || Kinds == last) ? (f.template operator()<Kinds>(), done = true) : false), ...);
}

/// Work item `item` of a lane's migration tasks for the quantize and store kernels: (task, KV head
/// of the task's unit, keys or values), so that a window's keys and values go to two warps at once
/// (each is a chain of dependent steps). A lane has n_tasks * heads_per_unit * 2 items.
struct migration_item {
  migration_task task;
  bool keys;    ///< keys (true) or values
  int in_unit;  ///< the head's place in the unit's Full slot and record
  int h;        ///< the KV head
  int w;        ///< the window

  __device__ static migration_item of(const decode_layout& L, const migration_task* tasks, int item) {
    const int hu = L.heads_per_unit, task_head = item >> 1;
    migration_item m;
    m.task = tasks[task_head / hu];
    m.keys = (item & 1) == 0;
    m.in_unit = task_head % hu;
    m.h = L.unit_of_entry(m.task.entry) * hu + m.in_unit;
    m.w = L.window_of_entry(m.task.entry);
    return m;
  }
};

/// Quantizes one KV head's keys (keys = true) or values of window w, read through `rd`, into the
/// record head `rec` of quantizer Q, with one warp: the policy's own choose_scale_zero / code_of,
/// keys rotated back into Q's key frame first (Rotates). Worker k (k < D/4) owns code slots
/// 4k..4k+3, i.e. one code byte (2-bit codes), two (4-bit codes) or four (8-bit codes) per token, so no two lanes
/// share a byte: key channels 4k..4k+3, and the value channels record_layout::value_channel
/// places there.
template <int D, int W, class Q, bool Rotates, class Reader>
__device__ __forceinline__ void quantize_head(const Reader& rd, std::uint8_t* rec, int w, int h, bool keys, int lane_id, long long window_start,
                              rope_layout layout, const double* inv_freq) {
  static_assert(Q::bits == 2 || Q::bits == 4 || Q::bits == 8, "quantize_head: 2-, 4- or 8-bit codes");
  using code_unit =  // a worker's 4 codes
      std::conditional_t<Q::bits == 2, std::uint8_t, std::conditional_t<Q::bits == 4, std::uint16_t, std::uint32_t>>;
  constexpr int token_bytes = D * Q::bits / 8;
  const int worker = lane_id;
  const bool active = worker < D / 4;
  constexpr unsigned active_lanes = D / 4 >= 32 ? 0xffffffffu : (1u << (D / 4)) - 1u;
  const quantizers::record_layout R = Q::layout(W, 1, D);
  if (keys && active) {
    // Keys in the record's key frame, one group per channel across the window's tokens.
    float kx[W][4];
    // Each worker rotates two rotary pairs (below); their cosines and sines, in double, are formed
    // once per distinct rotation: once per token for keys stored before RoPE, once per window for
    // window-relative keys (every token rotated back by the window's start).
    const bool low = worker < D / 8;  // with rotate-half pairs: holds channels below D/2
    auto pair_of = [&](int k) {       // the worker's k-th pair (k = 0, 1)
      return layout == rope_layout::interleaved ? 2 * worker + k : 4 * (low ? worker : worker - D / 8) + (low ? k : k + 2);
    };
    [[maybe_unused]] long long rotation = 0;
    [[maybe_unused]] double cs[2][2];  // [pair][cos, sin] of `rotation`
#pragma unroll
    for (int j = 0; j < W; ++j) {
      // The record's frame: rotated back by what attention will rotate the key by.
      const long long pos = Q::key_frame::read_rotation(window_start, window_start + j);
      if constexpr (Rotates) {
        if (j == 0 || pos != rotation) {  // folds away for either frame once W is unrolled
          rotation = pos;
#pragma unroll
          for (int k = 0; k < 2; ++k) thread::rope_cos_sin(pos, inv_freq[pair_of(k)], cs[k][0], cs[k][1]);
        }
        // Each rotary pair once per warp (its double-precision angle is most of the work): with
        // interleaved pairs a worker holds both members of its two pairs; with rotate-half pairs
        // channel c < D/2 sits in worker c/4 and its partner c + D/2 in worker c/4 + D/8, so each of
        // the two rotates two of the four pairs they share and hands the other member across.
        if (layout == rope_layout::interleaved) {
#pragma unroll
          for (int m = 0; m < 4; m += 2) {  // pair i = worker * 2 + m / 2: channels 4 * worker + m, + 1
            const int i = pair_of(m / 2);
            int a, b;
            pair_members(layout, D, i, a, b);
            float x0, x1;
            rd.key_pair(w, j, h, i, a, b, x0, x1);
            rotate_pair(x0, x1, cs[m / 2][0], cs[m / 2][1], -1);
            kx[j][m] = x0;
            kx[j][m + 1] = x1;
          }
        } else {
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            // This worker rotates the pair of its slot t (low) or t + 2 (high); slot s of worker k
            // and slot s of worker k + D/8 are the two members of pair 4k + s (k < D/8).
            const int i = pair_of(t);
            int a, b;
            pair_members(layout, D, i, a, b);
            float x0, x1;  // channels i and i + D/2
            rd.key_pair(w, j, h, i, a, b, x0, x1);
            rotate_pair(x0, x1, cs[t][0], cs[t][1], -1);
            const float partner = __shfl_xor_sync(active_lanes, low ? x1 : x0, D / 8);
            kx[j][t] = low ? x0 : partner;
            kx[j][t + 2] = low ? partner : x1;
          }
        }
      } else {
#pragma unroll
        for (int m = 0; m < 4; ++m) kx[j][m] = rd.key(w, j, h, 4 * worker + m);
      }
    }
    code_unit bytes[W] = {};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int c = 4 * worker + m;
      float lo = kx[0][m], hi = lo;
#pragma unroll
      for (int j = 1; j < W; ++j) {
        lo = kx[j][m] < lo ? kx[j][m] : lo;
        hi = kx[j][m] > hi ? kx[j][m] : hi;
      }
      typename Q::meta_storage s, z;
      Q::choose_scale_zero(lo, hi, s, z);
      Q::store_meta(rec + R.key_scale_offset(), c, s);
      Q::store_meta(rec + R.key_zero_offset(), c, z);
      const float sf = Q::meta_type::decode(s), zf = Q::meta_type::decode(z);
#pragma unroll
      for (int j = 0; j < W; ++j) bytes[j] |= static_cast<code_unit>(static_cast<unsigned>(Q::code_of(kx[j][m], sf, zf)) << (Q::bits * m));
    }
#pragma unroll
    for (int j = 0; j < W; ++j) *reinterpret_cast<code_unit*>(rec + j * token_bytes + worker * sizeof(code_unit)) = bytes[j];
  }
  // Values: one group per token across channels.
  for (int j = 0; j < W && !keys; ++j) {
    float vx[4];
    float lo = INFINITY, hi = -INFINITY;
    if (active) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        vx[m] = rd.value(w, j, h, R.value_channel(4 * worker + m));  // the code slot's channel
        lo = fminf(lo, vx[m]);
        hi = fmaxf(hi, vx[m]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    typename Q::meta_storage s, z;
    Q::choose_scale_zero(lo, hi, s, z);
    if (lane_id == 0) {
      Q::store_meta(rec + R.value_scale_offset(), j, s);
      Q::store_meta(rec + R.value_zero_offset(), j, z);
    }
    if (active) {
      const float sf = Q::meta_type::decode(s), zf = Q::meta_type::decode(z);
      code_unit unit = 0;
#pragma unroll
      for (int m = 0; m < 4; ++m) unit |= static_cast<code_unit>(static_cast<unsigned>(Q::code_of(vx[m], sf, zf)) << (Q::bits * m));
      *reinterpret_cast<code_unit*>(rec + R.value_codes_offset() + j * token_bytes + worker * sizeof(code_unit)) = unit;
    }
  }
}

/// This CTA's share of a lane's migration tasks of one kind (quantize_kernel's, or store_full_kernel's
/// when `store`), as route_decide_kernel listed them: f(item, the lane's region, its first
/// position) for each of the warp's work items (migration_item).
template <class F>
__device__ __forceinline__ void for_each_migration_item(const cache_params& P, const cache_pointers& S, const lane_list& list,
                                                        bool store, F&& f) {
  const decode_layout& L = P.L;
  // What no kernel of the event writes is read before the previous kernel (the decide kernel, or
  // the quantize kernel before the store kernel) has finished (launch_dependent).
  const int l = list.lane[blockIdx.x];
  std::byte* region = S.arena + L.region_offset(l);
  const long long first = S.lanes[l].first_position;
  grid::wait_for_previous_kernel();
  if (failed(S.error)) return;
  const int n_tasks = S.task_counts[2 * blockIdx.x + (store ? 1 : 0)];
  const int warps = blockDim.x / 32 * gridDim.y;
  const migration_task* tasks = (store ? S.store_tasks : S.quantize_tasks) + static_cast<std::size_t>(blockIdx.x) * P.max_tasks;
  for (int item = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32; item < n_tasks * L.heads_per_unit * 2; item += warps)
    f(migration_item::of(L, tasks, item), region, first);
}

/// Quantizes window tasks (windows of W tokens, the KV heads of one unit) into ledger records: one
/// warp per (task, KV head, keys or values). FullQ: the top tier's quantizer (void: token rows),
/// for demotions from a Full slot.
template <int D, int W, element_type E, class Q, class FullQ, bool Rotates>
__global__ void __launch_bounds__(256) quantize_kernel(const cache_params P, const cache_pointers S, const lane_list list,
                                                       const route_source src) {
  const decode_layout& L = P.L;
  for_each_migration_item(P, S, list, false, [&](const migration_item& m, std::byte* region, long long first) {
    const auto [task, keys, in_unit, h, w] = m;
    std::uint8_t* rec = reinterpret_cast<std::uint8_t*>(region + L.ledger_offset + static_cast<std::size_t>(task.dst_slot) * L.record_bytes +
                                                        static_cast<std::size_t>(in_unit) * L.ledger_format.head_bytes);
    // Sources: the recent ring, a Full slot or the prefill's rows (never a ledger record).
    with_source<0, 1, 2>(task.source, [&]<int Kind>() {
      const token_reader<D, W, E, void, FullQ, Rotates, Kind> rd{&P, region, src, task.src_slot, first, S.inv_freq};
      quantize_head<D, W, Q, Rotates>(rd, rec, w, h, keys, threadIdx.x & 31, first + L.sinks + static_cast<long long>(w) * W,
                                      L.layout, S.inv_freq);
    });
  });
}

/// Copies Bytes bytes (a record head) from global to shared memory with the 32 lanes of a warp, every
/// load issued before any store: one round trip to memory for the whole head. 16-byte words where
/// Bytes allows them, else 4-byte words: a record head is a whole number of 4-byte words (its code
/// sections are rounded to 4 bytes, and its bf16 scales and zeros take 4 bytes a channel and 4 a
/// token), and the ledger's 16-byte aligned offset (required at construction) followed by whole
/// heads keeps `src` aligned to the word.
template <std::size_t Bytes>
__device__ __forceinline__ void stage_record_head(std::uint8_t* dst, const std::uint8_t* src, int lane_id) {
  static_assert(Bytes % 4 == 0, "stage_record_head: a record head is a whole number of 4-byte words");
  using word = std::conditional_t<Bytes % 16 == 0, uint4, std::uint32_t>;
  constexpr int words = static_cast<int>(Bytes / sizeof(word)), per_lane = (words + 31) / 32;
  word w[per_lane];
#pragma unroll
  for (int i = 0; i < per_lane; ++i)
    if (lane_id + 32 * i < words) w[i] = reinterpret_cast<const word*>(src)[lane_id + 32 * i];
#pragma unroll
  for (int i = 0; i < per_lane; ++i)
    if (lane_id + 32 * i < words) reinterpret_cast<word*>(dst)[lane_id + 32 * i] = w[i];
}

/// Fills Full slots (windows of W tokens, the KV heads of one unit): promotions from the ledger and
/// newly aged windows, one warp per (task, KV head, keys or values). Token rows take the keys after
/// RoPE (a promoted record dequantized and rotated to its positions); a quantized top tier
/// (FullQ not void) re-encodes them as FullQ records, as the host backend's store_full does.
///
/// A promotion reads every byte of its record head a few bytes at a time (a code, a scale, a zero
/// for each element), each read a round trip to device memory behind the one before it. The warp
/// first copies the head into shared memory, with wide loads all in flight at once, and reads the
/// elements from there (stage_record_head), where the head fits: up to 4 KB a warp. At most 64
/// registers a thread (__launch_bounds__'s 4 CTAs an SM), so that a routing event's grid of 16 CTAs
/// for each of 32 lanes runs in one wave on an H200's 132 SMs: with 80 registers the CTAs of the
/// last lanes waited for a second wave.
template <int D, int W, element_type E, class Q, class FullQ, bool Rotates>
__global__ void __launch_bounds__(256, 4) store_full_kernel(const cache_params P, const cache_pointers S, const lane_list list,
                                                         const route_source src) {
  constexpr std::size_t head_bytes = Q::layout(W, 1, D).head_bytes();
  constexpr std::size_t staged_bytes = (head_bytes + 15) / 16 * 16;
  constexpr bool stages = staged_bytes <= 4096;
  __shared__ __align__(16) std::uint8_t staged[256 / 32][stages ? staged_bytes : 16];
  const decode_layout& L = P.L;
  const int lane_id = threadIdx.x & 31;
  for_each_migration_item(P, S, list, true, [&](const migration_item& m, std::byte* region, long long first) {
    const auto [task, keys, in_unit, h, w] = m;
    std::byte* slot = region + L.full_offset + static_cast<std::size_t>(task.dst_slot) * L.full_window_bytes;
    // Sources: the recent ring, the prefill's rows or a ledger record (never a Full slot).
    with_source<0, 2, 3>(task.source, [&]<int Kind>() {
      token_reader<D, W, E, Q, void, Rotates, Kind> rd{&P, region, src, task.src_slot, first, S.inv_freq};
      if constexpr (Kind == 3 && stages) {
        std::uint8_t* copy = staged[threadIdx.x / 32];
        __syncwarp();  // the warp's previous item has read its copy
        stage_record_head<head_bytes>(copy, rd.ledger_record(h), lane_id);
        __syncwarp();
        rd.staged = copy;
      }
      if constexpr (!std::is_void_v<FullQ>) {
        quantize_head<D, W, FullQ, Rotates>(rd, reinterpret_cast<std::uint8_t*>(slot) + static_cast<std::size_t>(in_unit) * L.full_format.head_bytes,
                                            w, h, keys, lane_id, first + L.sinks + static_cast<long long>(w) * W, L.layout, S.inv_freq);
      } else {
        // A lane takes fixed channels across a batch of tokens and reads the whole batch before it
        // stores any of it: the reads overlap, and a record's scales and zeros, shared by the
        // batch's tokens (keys) or by a token's channels (values), are loaded once.
        constexpr int tokens = W < 8 ? W : 8;
        for (int i = lane_id; keys && i < D / 2; i += 32) {
          int a, b;
          pair_members(L.layout, D, i, a, b);
          for (int j0 = 0; j0 < W; j0 += tokens) {
            float x[tokens][2];
#pragma unroll
            for (int t = 0; t < tokens; ++t) rd.key_pair(w, j0 + t, h, i, a, b, x[t][0], x[t][1]);
#pragma unroll
            for (int t = 0; t < tokens; ++t) {
              numeric::store(E, slot, key_index(D, W, in_unit, j0 + t, a), x[t][0]);
              numeric::store(E, slot, key_index(D, W, in_unit, j0 + t, b), x[t][1]);
            }
          }
        }
        for (int j0 = 0; !keys && j0 < W; j0 += tokens) {
          float x[tokens][D / 32];
#pragma unroll
          for (int t = 0; t < tokens; ++t)
#pragma unroll
            for (int m = 0; m < D / 32; ++m) x[t][m] = rd.value(w, j0 + t, h, lane_id + 32 * m);
#pragma unroll
          for (int t = 0; t < tokens; ++t)
#pragma unroll
            for (int m = 0; m < D / 32; ++m) numeric::store(E, slot, value_index(D, W, in_unit, j0 + t, lane_id + 32 * m), x[t][m]);
        }
      }
    });
  });
}

}  // namespace detail
}  // namespace qevict::kernels

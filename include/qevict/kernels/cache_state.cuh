#pragma once
// Device state of the CUDA backend and the small kernels of a decode step: the input check
// (every element within numeric::largest_magnitude of its input; reported through a device
// error flag), append (RoPE, store into the sinks or the recent ring) and the attend prologue
// (batch lanes, the lane states the decode kernel sees).
//
// Error flag. Inputs live on the device, so the host cannot scan them without a sync. Each call
// scans its inputs first; a bad value sets the flag, and every later kernel that changes
// the cache sees the flag and does nothing, so the cache stays as it was before the bad call until
// the host reads the flag at its next synchronizing call and throws qevict::error.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "qevict/core/layout.hpp"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/rope.cuh"

namespace qevict::kernels {

/// The first bad input the device found (code 0: none).
struct device_error {
  int code = 0;         ///< 1: NaN, 2: infinite, 3: finite but beyond the input's limit
  int call = 0;         ///< 1: append, 2: attend, 3: prefill
  int input = 0;        ///< numeric::input: 0 q, 1 k, 2 v
  float value = 0.f;    ///< the element found
  long long index = 0;  ///< element index in that input
};

/// Up to 1024 lanes (sequence slot * layers + layer) passed by value to a launch.
struct lane_list {
  static constexpr int capacity = 1024;
  int n = 0;
  int lane[capacity];
};

/// Per-lane bookkeeping that only the CUDA backend keeps (the decode kernel does not read it).
struct lane_extra {
  int steps = 0;               ///< attends since the last routing event
  int free_full = 0;           ///< entries on the lane's stack of free Full slots
  int free_ledger = 0;         ///< entries on the lane's stack of free ledger slots
  int routed = 0;              ///< 1 once the lane had a routing event (a frozen selection then holds)
};

/// One data movement of a routing event: one table entry (window * units + unit), the KV heads
/// of that unit.
struct migration_task {
  std::int32_t entry = 0;
  std::int32_t source = 0;    ///< 0: recent ring, 1: Full slot src_slot, 2: prefill buffers, 3: ledger slot src_slot
  std::int32_t src_slot = 0;
  std::int32_t dst_slot = 0;  ///< ledger slot (quantize) or Full slot (store)
};

/// Grid-invariant description of one layer of the cache, built on the host from its region_plan
/// (a launch covers lanes of one layer).
struct cache_params {
  decode_layout L;
  element_type element = element_type::bf16;
  int q_heads = 0;
  int recent = 0;              ///< L: tokens that never age
  int routing_interval = 0;
  int max_windows = 0;
  int sort_capacity = 0;       ///< power of two >= max_windows * units (the decide kernel's table size)
  int full_capacity = 0;       ///< K_f (in units) of this layer
  int ledger_capacity = 0;     ///< K_q (in units) of this layer
  int full_stride = 0;         ///< free-slot stack entries per lane (the largest K_f of any layer)
  int ledger_stride = 0;       ///< the same for K_q
  int max_tasks = 0;           ///< per lane and routing event, of each kind
};

/// Device pointers of the state (every array is sized at construction).
struct cache_pointers {
  std::byte* arena = nullptr;
  lane_state* lanes = nullptr;          ///< the truth for tokens, aged, first position
  lane_state* attend_lanes = nullptr;   ///< what the decode kernel reads (zeroed for a bad call)
  window_entry* entries = nullptr;      ///< window lists: entries_per_lane per (lane, unit)
  int* entry_counts = nullptr;          ///< entries of each list (the truth)
  int* attend_counts = nullptr;         ///< what the decode kernel reads (zeroed for a bad call)
  lane_extra* extra = nullptr;
  std::int32_t* free_full = nullptr;    ///< K_f per lane (a stack)
  std::int32_t* free_ledger = nullptr;  ///< K_q per lane (a stack)
  int* batch_lanes = nullptr;           ///< lane of each batch element of the current attend
  device_error* error = nullptr;
  const double* inv_freq = nullptr;
  migration_task* quantize_tasks = nullptr;  ///< max_tasks per routed lane of one launch
  migration_task* store_tasks = nullptr;
  int* task_counts = nullptr;                ///< 2 per routed lane of one launch
};

namespace detail {

__device__ __forceinline__ bool failed(const device_error* e) {
  return *reinterpret_cast<const volatile int*>(&e->code) != 0;
}

/// Element i of x: if it is not a number of magnitude at most `limit` (numeric::within) and no bad
/// input was found before, records it in the flag. Returns whether it passed.
__device__ __forceinline__ bool check_input(const float* x, std::size_t i, float limit, device_error* e, int call,
                                            int input) {
  const float v = x[i];
  if (numeric::within(v, limit)) return true;
  if (atomicCAS(&e->code, 0, v != v ? 1 : numeric::is_finite(v) ? 3 : 2) == 0) {
    e->call = call;
    e->input = input;
    e->value = v;
    e->index = static_cast<long long>(i);
  }
  return false;
}

/// Loads a thread of scan_input issues before it tests any of them.
inline constexpr int scan_loads_in_flight = 8;

__device__ __forceinline__ bool all_within(float v, float limit) { return numeric::within(v, limit); }
__device__ __forceinline__ bool all_within(float4 v, float limit) {
  return numeric::within(v.x, limit) & numeric::within(v.y, limit) & numeric::within(v.z, limit) &
         numeric::within(v.w, limit);
}

/// Whether p[first], p[first + stride], ... (below `loads`) are all within the limit:
/// scan_loads_in_flight loads at a time, every one issued before the first test, and no branch on
/// a loaded value.
template <class T>
__device__ __forceinline__ bool all_within(const T* p, std::size_t loads, std::size_t first, std::size_t stride,
                                           float limit) {
  constexpr int U = scan_loads_in_flight;
  bool ok = true;
  std::size_t j = first;
  for (; j + (U - 1) * stride < loads; j += U * stride) {
    T v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = p[j + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) ok &= all_within(v[u], limit);
  }
  for (; j < loads; j += stride) ok &= all_within(p[j], limit);
  return ok;
}

/// Scans x[0, n) with threads `first`, `first + stride`, ... (of a block or a grid), each taking
/// every stride-th 16-byte piece (every stride-th element where x is not 16-byte aligned); the
/// first value found that is not a number of magnitude at most `limit` (numeric::largest_magnitude
/// of the input) sets the flag. A loop that stopped at the first bad value could not issue a load
/// before it had tested the last one, one round trip to memory per element a thread reads;
/// all_within keeps several in flight. Only a thread that found a bad value looks again, element
/// by element, to record one.
__device__ inline void scan_input(const float* x, std::size_t n, std::size_t first, std::size_t stride, float limit,
                                  device_error* e, int call, int input) {
  const bool pieces = reinterpret_cast<std::uintptr_t>(x) % 16 == 0;
  const std::size_t per_load = pieces ? 4 : 1, loads = n / per_load;
  const bool tail = pieces && first == 0;  // the elements past the last whole piece: the first thread's
  bool ok = pieces ? all_within(reinterpret_cast<const float4*>(x), loads, first, stride, limit)
                   : all_within(x, loads, first, stride, limit);
  if (tail) ok &= all_within(x + loads * 4, n - loads * 4, 0, 1, limit);
  if (ok) return;
  for (std::size_t j = first; j < loads; j += stride)
    for (std::size_t c = 0; c < per_load; ++c)
      if (!check_input(x, j * per_load + c, limit, e, call, input)) return;
  if (tail)
    for (std::size_t i = loads * 4; i < n; ++i)
      if (!check_input(x, i, limit, e, call, input)) return;
}

/// scan_input on one block (every block that calls it scans all of x).
__device__ inline void scan_input(const float* x, std::size_t n, float limit, device_error* e, int call, int input) {
  scan_input(x, n, threadIdx.x, blockDim.x, limit, e, call, input);
}

/// scan_input on one block against the limit of input `in` (numeric::largest_magnitude), which the
/// error record names.
__device__ inline void scan_input(const float* x, std::size_t n, numeric::input in, device_error* e, int call) {
  scan_input(x, n, numeric::largest_magnitude(in), e, call, static_cast<int>(in));
}

/// Multi-block version for large inputs (prefill).
__global__ void scan_input_kernel(const float* x, std::size_t n, float limit, device_error* e, int call, int input) {
  scan_input(x, n, blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x,
             static_cast<std::size_t>(gridDim.x) * blockDim.x, limit, e, call, input);
}

/// Rotates the pair (x0, x1) by the angle whose cosine and sine are (c, s) (sign 1) or by its
/// negative (sign -1) exactly as rope::rotary does on the host: both products in double, no fused
/// multiply-add, then float.
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, double c, double s, int sign) {
  if (sign < 0) s = -s;
  const double a = x0, b = x1;
  x0 = static_cast<float>(__dsub_rn(__dmul_rn(a, c), __dmul_rn(b, s)));
  x1 = static_cast<float>(__dadd_rn(__dmul_rn(a, s), __dmul_rn(b, c)));
}

/// The same by the angle position * inv_freq, its cosine and sine in double as on the host.
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, long long position, double inv_freq, int sign) {
  double c, s;
  thread::rope_cos_sin(position, inv_freq, c, s);
  rotate_pair(x0, x1, c, s, sign);
}

__device__ __forceinline__ void pair_members(rope_layout layout, int head_dim, int i, int& a, int& b) {
  ::qevict::rope::rotary::pair(layout, head_dim, i, a, b);  // the host's pairing, one definition
}

/// Index of key (h, slot, c) in a token block of capacity C: [heads][keys C | values C][head_dim].
__device__ __forceinline__ std::size_t key_index(int D, int C, int h, int slot, int c) {
  return (static_cast<std::size_t>(2 * h) * C + slot) * D + c;
}
__device__ __forceinline__ std::size_t value_index(int D, int C, int h, int slot, int c) {
  return (static_cast<std::size_t>(2 * h + 1) * C + slot) * D + c;
}

/// Append: one block per listed lane. Every block scans all of k and v first (a few hundred KB
/// from L2), so each decides alone, and identically, whether the call is bad.
template <class Scorer, bool Rotates>
__global__ void __launch_bounds__(512) append_kernel(const cache_params P, const cache_pointers S, const lane_list list,
                                                     const float* k, const float* v) {
  const decode_layout& L = P.L;
  const int D = L.head_dim, H = L.kv_heads;
  const std::size_t row = static_cast<std::size_t>(H) * D;
  scan_input(k, list.n * row, numeric::input::key, S.error, 1);
  scan_input(v, list.n * row, numeric::input::value, S.error, 1);
  __syncthreads();
  if (failed(S.error)) return;
  const int b = blockIdx.x;
  const int lane_index = list.lane[b];
  const lane_state lane = S.lanes[lane_index];
  const int t = lane.tokens;
  std::byte* region = S.arena + L.region_offset(lane_index);
  const bool sink = t < L.sinks;
  void* base = region + (sink ? L.sink_offset : L.recent_offset);
  const int C = sink ? L.sinks : L.recent_capacity;
  const int slot = sink ? t : (t - L.sinks) % L.recent_capacity;
  const float* kb = k + b * row;
  const float* vb = v + b * row;
  // Keys: one thread per rotary pair.
  for (int e = threadIdx.x; e < H * D / 2; e += blockDim.x) {
    const int h = e / (D / 2), i = e % (D / 2);
    int a, bb;
    pair_members(L.layout, D, i, a, bb);
    float x0 = kb[static_cast<std::size_t>(h) * D + a], x1 = kb[static_cast<std::size_t>(h) * D + bb];
    if constexpr (Rotates) rotate_pair(x0, x1, lane.first_position + t, S.inv_freq[i], +1);
    numeric::store(P.element, base, key_index(D, C, h, slot, a), x0);
    numeric::store(P.element, base, key_index(D, C, h, slot, bb), x1);
  }
  for (int e = threadIdx.x; e < H * D; e += blockDim.x)
    numeric::store(P.element, base, value_index(D, C, e / D, slot, e % D), vb[e]);
  __syncthreads();  // every thread has read lanes[].tokens
  if (threadIdx.x == 0) {
    if (t >= L.sinks && (t - L.sinks) % L.window == 0) {  // first token of a new window
      const int w = (t - L.sinks) / L.window;
      for (int u = 0; u < L.units; ++u) reinterpret_cast<window_record*>(region)[w * L.units + u].score = Scorer::initial_score(w);
    }
    S.lanes[lane_index].tokens = t + 1;
  }
}

/// Attend prologue: one block. Scans q, writes the batch's lanes and the lane states the decode
/// kernel reads (empty lanes after a bad input, so that nothing changes), counts the step.
__global__ void __launch_bounds__(1024) attend_prologue_kernel(const cache_params P, const cache_pointers S,
                                                               const lane_list list, const float* q) {
  scan_input(q, static_cast<std::size_t>(list.n) * P.q_heads * P.L.head_dim, numeric::input::query, S.error, 2);
  __syncthreads();
  const bool bad = failed(S.error);
  for (int b = threadIdx.x; b < list.n; b += blockDim.x) {
    const int l = list.lane[b];
    S.batch_lanes[b] = l;
    lane_state s = S.lanes[l];
    if (bad) {
      s.tokens = 0;
      s.aged = 0;
    } else {
      ++S.extra[l].steps;
    }
    S.attend_lanes[l] = s;
    for (int u = 0; u < P.L.units; ++u) {
      const std::size_t list = static_cast<std::size_t>(l) * P.L.units + u;
      S.attend_counts[list] = bad ? 0 : S.entry_counts[list];
    }
  }
}

/// Resets the lanes of a new sequence: empty table, every slot free. One block per listed lane (all
/// of P's layer).
__global__ void reset_lanes_kernel(const cache_params P, const cache_pointers S, const lane_list list, long long first_position) {
  const int l = list.lane[blockIdx.x];
  window_record* table = reinterpret_cast<window_record*>(S.arena + P.L.region_offset(l));
  for (int e = threadIdx.x; e < P.max_windows * P.L.units; e += blockDim.x) table[e] = window_record{};
  for (int u = threadIdx.x; u < P.L.units; u += blockDim.x) S.entry_counts[static_cast<std::size_t>(l) * P.L.units + u] = 0;
  // Host order: the stack holds K-1 ... 0, so the first pop gives slot 0.
  for (int i = threadIdx.x; i < P.full_capacity; i += blockDim.x)
    S.free_full[static_cast<std::size_t>(l) * P.full_stride + i] = P.full_capacity - 1 - i;
  for (int i = threadIdx.x; i < P.ledger_capacity; i += blockDim.x)
    S.free_ledger[static_cast<std::size_t>(l) * P.ledger_stride + i] = P.ledger_capacity - 1 - i;
  if (threadIdx.x == 0) {
    lane_state s;
    s.first_position = first_position;
    s.region = static_cast<long long>(P.L.region_offset(l));
    S.lanes[l] = s;
    S.attend_lanes[l] = s;
    lane_extra x;
    x.free_full = P.full_capacity;
    x.free_ledger = P.ledger_capacity;
    S.extra[l] = x;
  }
}

}  // namespace detail
}  // namespace qevict::kernels

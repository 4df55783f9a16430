#pragma once
// The CUDA backend: the same algorithm and the same region layout as the host backend, with the
// arena, the window tables, the window lists, the free-slot stacks and the lane counters on the
// device. Every call is ordered on one cudaStream_t (backend::cuda::settings); append, attend and
// route neither allocate nor synchronize, so a decode step can be captured in a CUDA graph.
//
// Inputs (q, k, v, out) are device pointers, row-major float as documented in cache.hpp. The host
// keeps mirrors of each lane's token count, aged windows and steps since routing (all follow from
// the calls alone), so shapes, capacities and the routing schedule are decided without a sync.
// Inputs are checked on the device as on the host (each element within numeric::largest_magnitude
// of its input; kernels/cache_state.cuh): a bad input freezes the cache and
// the next synchronizing call — check(), report(), windows(), counts(), read_window(),
// ledger_record() — throws qevict::error naming it; the cache is then as it was before that call.
//
// Supported policies and geometries: backend/cuda/supports.hpp, the one place the conditions are
// written (cuda_support<Config>); anything else fails at compile time (policies) or at
// construction (geometry: bf16 or f16 elements, head_dim 64 or 128, GQA groups up to 8).
//
// CUDA graphs: the kernels read token counts, positions and window lists from the device, so a
// captured decode step replays correctly on the device. The host mirrors advance with calls only,
// so an engine that replays a captured step must not mix replays with direct calls of the same
// lanes (the mirrors would lag behind the device).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "qevict/backend/cuda/supports.hpp"
#include "qevict/backend/host/host_cache.hpp"
#include "qevict/core/layout.hpp"
#include "qevict/core/records.hpp"
#include "qevict/core/report.hpp"
#include "qevict/kernels/cache_state.cuh"
#include "qevict/kernels/check.cuh"
#include "qevict/kernels/decode_attention.cuh"
#include "qevict/kernels/prefill.cuh"
#include "qevict/kernels/routing.cuh"

/// CTAs per lane of a decode routing event's quantize and store kernels.
#ifndef QEVICT_ROUTE_CTAS_PER_LANE
#define QEVICT_ROUTE_CTAS_PER_LANE 16u
#endif
/// CTAs of a prefill's first routing event's quantize and store kernels (one lane).
#ifndef QEVICT_PREFILL_ROUTE_CTAS
#define QEVICT_PREFILL_ROUTE_CTAS 512u
#endif

namespace qevict {
namespace backend {

template <class Config>
class cuda_cache;

/// Run-time settings of the CUDA backend.
struct cuda_settings {
  cudaStream_t stream = nullptr;  ///< every call is ordered on this stream
  /// Split-K chunk of the decode kernel: a multiple of 8 up to kernels::max_items_per_chunk(W)
  /// items (384 for windows of at least 8 tokens, 128 below), or 0 to choose per call
  /// (kernels::decode_chunk: nearly equal chunks of up to that many items, whichever keeps the
  /// busiest CTA slot shortest).
  int items_per_chunk = 0;
};

/// Backend tag: device-resident cache, stream-ordered kernels.
struct cuda {
  static constexpr const char* name = "cuda";
  /// q, k, v and out are device pointers; cache<> leaves their finiteness check to the backend.
  static constexpr bool inputs_on_device = true;
  using settings = cuda_settings;
  template <class Config>
  using engine = cuda_cache<Config>;
};

template <class Config>
class cuda_cache {
  using quantizer = typename Config::quantizer;
  using scorer = typename Config::scorer;
  using rope = typename Config::rope;
  using routing_policy = typename Config::routing_policy;
  using W = typename Config::window_policy;
  using support = cuda_support<Config>;  // the conditions, written once in supports.hpp
  static_assert(support::short_windows,
                "qevict::backend::cuda: unsupported window policy for this full-tier policy: windows shorter than 8 tokens "
                "need a top tier of token rows (full_tier::full_precision) on the CUDA backend");
  static_assert(support::sinks, "qevict::backend::cuda: unsupported window policy: at most 8 sink tokens");
  static_assert(support::quantizer,
                "qevict::backend::cuda: unsupported quantizer: only quantizers::asymmetric<Bits, meta::bf16, KeyFrame> with "
                "Bits = 2 (any key frame), 4 or 8 (key_frame::before_rope or after_rope)");
  static_assert(support::full_tier,
                "qevict::backend::cuda: unsupported full-tier policy: a quantized top tier (full_tier::quantized_as<Q>) needs Q "
                "to be asymmetric<2, 4 or 8, meta::bf16> in the same key frame as the ledger's quantizer, before or after RoPE");
  static_assert(support::scorer,
                "qevict::backend::cuda: unsupported scorer for this allocator: value-weighted attention needs an allocator "
                "without quantized records (e.g. allocators::two_tier) and a top tier of token rows on the CUDA backend");
  static constexpr bool rotates = rope::rotates;
  /// The top tier's record quantizer, void when Full slots hold token rows.
  using full_quantizer = typename support::full_quantizer;
  static constexpr int full_bits = support::full_bits;
  /// Whether a record's keys are rotated by the key frame's read rotation (and back when quantized).
  static constexpr bool records_rotate = kernels::decode_layout::rotation_for<Config>() != kernels::record_rotation::none;

 public:
  cuda_cache(const geometry& g, const budget& b, const limits& lim, const options& opt, std::byte* external,
             std::size_t external_bytes, const cuda_settings& set = {})
      : geo_(g),
        lim_(lim),
        opt_(opt),
        set_(set),
        plans_(make_region_plans<Config>(g, b, lim)),
        plan_(plans_.front()),
        arena_(make_arena_plan(plans_, lim)),
        sequences_(lim.max_batch) {
    detail::require(opt.observation_window >= 1, "options: observation_window must be >= 1");
    detail::require(g.element == element_type::bf16 || g.element == element_type::f16,
                    "backend::cuda: the element type must be bf16 or f16");
    detail::require(g.head_dim == 64 || g.head_dim == 128, "backend::cuda: head_dim must be 64 or 128");
    detail::require(g.q_heads / g.kv_heads <= 8, "backend::cuda: the GQA group (q_heads / kv_heads) must be at most 8");
    detail::require(g.layers <= kernels::lane_list::capacity,
                    "backend::cuda: at most " + std::to_string(kernels::lane_list::capacity) + " layers");
    detail::require(lim.max_batch <= kernels::lane_list::capacity,
                    "backend::cuda: limits::max_batch must be at most " + std::to_string(kernels::lane_list::capacity));
    detail::require(set.items_per_chunk == 0 || (set.items_per_chunk % 8 == 0 && set.items_per_chunk >= 8 &&
                                                 set.items_per_chunk <= kernels::max_items_per_chunk(W::size)),
                    [&] {
                      return "backend::cuda: items_per_chunk must be 0 (automatic) or a multiple of 8 in [8, " +
                             std::to_string(kernels::max_items_per_chunk(W::size)) + "], got " +
                             std::to_string(set.items_per_chunk);
                    });
    lanes_total_ = static_cast<std::size_t>(lim.max_batch) * g.layers;
    // Regions as the host backend lays them out (arena_plan): sequence-major, then layer; with a
    // budget per layer (budget::with_layer_shares) each layer's region has its own size, and its own
    // cache_params.
    // Per-lane arrays (window lists, free-slot stacks) have one stride for all layers: the largest.
    std::vector<kernels::decode_layout> layouts;
    int list_capacity = 0, full_stride = 0, ledger_stride = 0;
    for (const region_plan& p : plans_) {
      layouts.push_back(kernels::decode_layout::for_config<Config>(p, g.rope.layout));
      list_capacity = std::max(list_capacity, layouts.back().entries_per_lane);
      full_stride = std::max(full_stride, static_cast<int>(p.caps.full));
      ledger_stride = std::max(ledger_stride, static_cast<int>(p.caps.quantized));
    }
    // Routing ranks table entries: one per window, or one per window and KV head with per-KV-head
    // selection.
    const int entries = static_cast<int>(plan_.table_entries());
    int sort_capacity = 1;
    while (sort_capacity < std::max(1, entries)) sort_capacity <<= 1;
    for (int l = 0; l < g.layers; ++l) {
      const region_plan& p = plans_[static_cast<std::size_t>(l)];
      kernels::cache_params P;
      P.L = layouts[static_cast<std::size_t>(l)];
      P.L.layers = g.layers;
      P.L.sequence_stride = arena_.sequence_stride;
      P.L.layer_offset = arena_.layer_offset[static_cast<std::size_t>(l)];
      P.L.set_list_capacity(list_capacity);
      detail::require((P.L.region_bytes | P.L.sink_offset | P.L.recent_offset | P.L.full_offset | P.L.ledger_offset) % 16 == 0,
                      "backend::cuda: regions are not 16-byte aligned; choose limits::max_tokens so that "
                      "(max_tokens - sinks + window - 1) / window is a multiple of 4");
      P.element = g.element;
      P.q_heads = g.q_heads;
      P.recent = p.recent;
      P.routing_interval = p.routing_interval;
      P.max_windows = p.max_windows;
      P.sort_capacity = sort_capacity;
      P.full_capacity = static_cast<int>(p.caps.full);
      P.ledger_capacity = static_cast<int>(p.caps.quantized);
      P.full_stride = full_stride;
      P.ledger_stride = ledger_stride;
      P.max_tasks = std::max(1, entries);
      params_.push_back(P);
    }
    detail::require(sort_capacity <= kernels::detail::route_max_entries,
                    "backend::cuda: limits::max_tokens is too large for routing's one-CTA sort (at most " +
                        std::to_string(kernels::detail::route_max_entries) +
                        " windows, or window-heads with per-KV-head selection)");
    with_route_decide(sort_capacity, [&]<int MaxItems>() {
      // Always, not only past 48 KB of dynamic memory: the kernel's static shared memory (a block
      // scan's) counts against the same default limit.
      const std::size_t smem = kernels::detail::route_decide_bytes<MaxItems>();
      QEVICT_CUDA_CHECK(cudaFuncSetAttribute(kernels::detail::route_decide_kernel<scorer, routing_policy, MaxItems>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    });

    const std::size_t need = required_bytes();
    if (external != nullptr) {
      detail::require(external_bytes >= need, "external storage of " + std::to_string(external_bytes) +
                                                  " bytes is smaller than the " + std::to_string(need) + " bytes required");
      detail::require(reinterpret_cast<std::uintptr_t>(external) % 16 == 0, "external storage must be 16-byte aligned");
      cudaPointerAttributes attr{};
      detail::require(cudaPointerGetAttributes(&attr, external) == cudaSuccess &&
                          (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged),
                      "backend::cuda: external storage must be device memory");
      S_.arena = external;
    } else {
      S_.arena = alloc<std::byte>(need, memory_.arena);
    }
    S_.lanes = alloc<kernels::lane_state>(lanes_total_, memory_.tables);
    S_.attend_lanes = alloc<kernels::lane_state>(lanes_total_, memory_.tables);
    const std::size_t lists = lanes_total_ * static_cast<std::size_t>(plan_.units);
    S_.entries = alloc<kernels::window_entry>(lists * std::max(1, list_capacity), memory_.tables);
    S_.entry_counts = alloc<int>(lists, memory_.tables);
    S_.attend_counts = alloc<int>(lists, memory_.tables);
    S_.extra = alloc<kernels::lane_extra>(lanes_total_, memory_.tables);
    S_.free_full = alloc<std::int32_t>(lanes_total_ * std::max(1, full_stride), memory_.tables);
    S_.free_ledger = alloc<std::int32_t>(lanes_total_ * std::max(1, ledger_stride), memory_.tables);
    S_.batch_lanes = alloc<int>(static_cast<std::size_t>(lim.max_batch), memory_.tables);
    S_.error = alloc<kernels::device_error>(1, memory_.tables);
    const std::vector<double> inv = rope::inverse_frequencies(g.rope, g.head_dim);
    double* inv_d = alloc<double>(inv.size(), memory_.tables);
    QEVICT_CUDA_CHECK(cudaMemcpyAsync(inv_d, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice, set_.stream));
    S_.inv_freq = inv_d;
    S_.quantize_tasks = alloc<kernels::migration_task>(static_cast<std::size_t>(lim.max_batch) * std::max(1, entries), memory_.tables);
    S_.store_tasks = alloc<kernels::migration_task>(static_cast<std::size_t>(lim.max_batch) * std::max(1, entries), memory_.tables);
    S_.task_counts = alloc<int>(2 * static_cast<std::size_t>(lim.max_batch), memory_.tables);
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.error, 0, sizeof(kernels::device_error), set_.stream));
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.lanes, 0, lanes_total_ * sizeof(kernels::lane_state), set_.stream));
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.attend_lanes, 0, lanes_total_ * sizeof(kernels::lane_state), set_.stream));
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.extra, 0, lanes_total_ * sizeof(kernels::lane_extra), set_.stream));
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.entry_counts, 0, lists * sizeof(int), set_.stream));
    QEVICT_CUDA_CHECK(cudaMemsetAsync(S_.attend_counts, 0, lists * sizeof(int), set_.stream));
    // Decode workspace for a whole batch.
    const auto ws = kernels::decode_workspace::sizes(params_[0].L, lim.max_batch, set_.items_per_chunk);  // the same max_items for all layers
    workspace_ = ws;
    workspace_block_ = alloc<std::byte>(ws.bytes(), memory_.decode_workspace);
    QEVICT_CUDA_CHECK(cudaMemsetAsync(workspace_block_, 0, ws.bytes(), set_.stream));
    mirrors_.resize(lanes_total_);
    QEVICT_CUDA_CHECK(cudaStreamSynchronize(set_.stream));
  }

  cuda_cache(const cuda_cache&) = delete;
  cuda_cache& operator=(const cuda_cache&) = delete;
  /// Waits for the stream's work; the allocations are then freed by their owners (allocations_).
  ~cuda_cache() { cudaStreamSynchronize(set_.stream); }

  // ---- sizes -------------------------------------------------------------------------------
  const region_plan& plan() const { return plan_; }
  const region_plan& plan(int layer) const { return plans_[static_cast<std::size_t>(layer)]; }
  const geometry& geo() const { return geo_; }
  const limits& lim() const { return lim_; }
  const options& opts() const { return opt_; }
  const cuda_settings& settings() const { return set_; }
  std::size_t required_bytes() const { return arena_.bytes; }
  /// Device memory allocated at construction, by part.
  device_memory device_bytes() const { return memory_; }
  /// Device pointer of the arena: the region of (sequence s, layer l) at s * (the sum of the layers'
  /// region bytes) + (the region bytes of the layers before l), as on the host backend.
  const std::byte* arena() const { return S_.arena; }

  // ---- sequences ---------------------------------------------------------------------------
  sequence_id add_sequence(long long first_position) {
    const sequence_id s = sequences_.take(first_position);
    for (int l = 0; l < geo_.layers; ++l) {
      kernels::lane_list list;
      list.n = 1;
      list.lane[0] = lane_index(s, l);
      mirrors_[static_cast<std::size_t>(list.lane[0])] = mirror{};
      kernels::detail::reset_lanes_kernel<<<1, 256, 0, set_.stream>>>(params(l), S_, list, first_position);
      QEVICT_CUDA_CHECK_LAUNCH("reset_lanes_kernel");
    }
    return s;
  }
  void remove_sequence(sequence_id s) { sequences_.release(s); }
  bool is_active(sequence_id s) const { return sequences_.active(s); }
  int tokens(sequence_id s, int layer) const { return mirror_of(s, layer).tokens; }
  long long first_position(sequence_id s) const { return sequences_.first_position(s); }
  bool recent_full(sequence_id s, int layer) const { return recent_full(mirror_of(s, layer)); }

  // ---- prefill -----------------------------------------------------------------------------
  /// Device pointers; shapes were validated by cache<>. May allocate (stream-ordered) scratch.
  void prefill(int layer, sequence_id s, const float* q, int q_rows, const float* k, const float* v, float* out, int n) {
    const int d = geo_.head_dim, hkv = geo_.kv_heads, hq = geo_.q_heads;
    const std::size_t krow = static_cast<std::size_t>(hkv) * d, qrow = static_cast<std::size_t>(hq) * d;
    cudaStream_t st = set_.stream;
    const int lane = lane_index(s, layer);
    const kernels::cache_params& P = params(layer);
    const long long p0 = first_position(s);
    const int q0 = n - q_rows;
    launch_scan(q, static_cast<std::size_t>(q_rows) * qrow, numeric::input::query, 3);
    launch_scan(k, static_cast<std::size_t>(n) * krow, numeric::input::key, 3);
    launch_scan(v, static_cast<std::size_t>(n) * krow, numeric::input::value, 3);
    const int first_observer = std::max(q0, n - opt_.observation_window);
    const int observers = n - first_observer;
    const int started = windows_started(n);
    const int entries = started * plan_.units;  // table entries the observation queries score
    // Stream-ordered scratch, freed on the stream when this call returns or throws.
    const stream_scratch<float> kr_owned(static_cast<std::size_t>(n) * krow, st);
    const stream_scratch<float> qr_owned(static_cast<std::size_t>(q_rows) * qrow, st);
    const std::size_t qmass_n = std::max<std::size_t>(1, static_cast<std::size_t>(observers) * std::max(entries, 1));
    const stream_scratch<double> qmass_owned(qmass_n, st);
    float* const kr = kr_owned.get();
    float* const qr = qr_owned.get();
    double* const qmass = qmass_owned.get();
    QEVICT_CUDA_CHECK(cudaMemsetAsync(qmass, 0, qmass_n * sizeof(double), st));
    kernels::detail::rotate_rows_kernel<rotates><<<1024, 256, 0, st>>>(P, S_, k, kr, n, hkv, p0);
    QEVICT_CUDA_CHECK_LAUNCH("rotate_rows_kernel");
    kernels::detail::rotate_rows_kernel<rotates><<<1024, 256, 0, st>>>(P, S_, q, qr, q_rows, hq, p0 + q0);
    QEVICT_CUDA_CHECK_LAUNCH("rotate_rows_kernel");
    const int first_row = out ? q0 : first_observer;
    const dim3 grid(static_cast<unsigned>(n - first_row), static_cast<unsigned>(hq));
    constexpr bool value_weighted = scorer::token_signal == scorers::signal::value_weighted_attention;
    if (d == 128)
      kernels::detail::prefill_attention_kernel<128, value_weighted><<<grid, 128, 0, st>>>(P, S_, qr, kr, v, out, qmass, n, q0, first_row, first_observer, std::max(started, 1));
    else
      kernels::detail::prefill_attention_kernel<64, value_weighted><<<grid, 128, 0, st>>>(P, S_, qr, kr, v, out, qmass, n, q0, first_row, first_observer, std::max(started, 1));
    QEVICT_CUDA_CHECK_LAUNCH("prefill_attention_kernel");
    const int aged_after = aged_windows_for(n);
    kernels::detail::prefill_aggregate_kernel<scorer><<<static_cast<unsigned>(std::max(1, (entries + 255) / 256)), 256, 0, st>>>(
        S_, qmass, observers, entries);
    QEVICT_CUDA_CHECK_LAUNCH("prefill_aggregate_kernel");
    kernels::detail::prefill_place_kernel<scorer><<<256, 256, 0, st>>>(P, S_, lane, kr, v, qmass, n, started, aged_after);
    QEVICT_CUDA_CHECK_LAUNCH("prefill_place_kernel");
    mirror& m = mirrors_[static_cast<std::size_t>(lane)];
    m.tokens = n;
    kernels::lane_list list;
    list.n = 1;
    list.lane[0] = lane;
    launch_route(layer, list, kernels::route_source{kr, v}, 2);
  }

  // ---- decode ------------------------------------------------------------------------------
  /// One token for each listed lane: k and v are device [batch][kv_heads][head_dim], pre-RoPE keys.
  void append_batch(int layer, std::span<const sequence_id> seqs, const float* k, const float* v) {
    kernels::lane_list due, list;
    list.n = static_cast<int>(seqs.size());
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      list.lane[b] = lane_index(seqs[b], layer);
      if (recent_full(mirror_of(seqs[b], layer))) due.lane[due.n++] = list.lane[b];
    }
    const kernels::cache_params& P = params(layer);
    if (due.n > 0) launch_route(layer, due, kernels::route_source{}, 0);
    kernels::detail::append_kernel<scorer, rotates><<<static_cast<unsigned>(list.n), 512, 0, set_.stream>>>(P, S_, list, k, v);
    QEVICT_CUDA_CHECK_LAUNCH("append_kernel");
    for (std::size_t b = 0; b < seqs.size(); ++b) ++mirrors_[static_cast<std::size_t>(list.lane[b])].tokens;
  }
  void append(int layer, sequence_id s, const float* k, const float* v) { append_batch(layer, std::span(&s, 1), k, v); }

  /// Attention of each listed sequence's newest query (device [batch][q_heads][head_dim]) into out.
  void attend_batch(int layer, std::span<const sequence_id> seqs, const float* q, float* out) {
    kernels::lane_list list, due;
    list.n = static_cast<int>(seqs.size());
    const kernels::cache_params& P = params(layer);
    int max_items = 1;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int l = lane_index(seqs[b], layer);
      list.lane[b] = l;
      const mirror& m = mirrors_[static_cast<std::size_t>(l)];
      max_items = std::max(max_items, P.L.items_for(P.L.max_entries_for(m.aged),
                                                     std::max(0, m.tokens - plan_.sinks - m.aged * plan_.window)));
    }
    kernels::detail::attend_prologue_kernel<<<1, 1024, 0, set_.stream>>>(P, S_, list, q);
    QEVICT_CUDA_CHECK_LAUNCH("attend_prologue_kernel");
    kernels::decode_arguments a;
    a.arena = S_.arena;
    a.lanes = S_.attend_lanes;
    a.entries = S_.entries;
    a.entry_counts = S_.attend_counts;
    a.batch_lanes = S_.batch_lanes;
    a.batch = list.n;
    a.q = q;
    a.out = out;
    a.inv_freq = S_.inv_freq;
    workspace_.bind(workspace_block_, a);
    a.items_per_chunk = set_.items_per_chunk;
    a.max_chunks = kernels::decode_workspace::chunks_for(P.L, set_.items_per_chunk);
    kernels::decode_attention<true, scorer, W::size, quantizer::bits, full_bits>(geo_.element, P.L, a, max_items, set_.stream);
    for (int b = 0; b < list.n; ++b) {
      mirror& m = mirrors_[static_cast<std::size_t>(list.lane[b])];
      ++m.steps;
      if (opt_.routing == routing_mode::automatic && m.steps >= Config::routing_interval) due.lane[due.n++] = list.lane[b];
    }
    if (due.n > 0) launch_route(layer, due, kernels::route_source{}, 0);
  }

  /// A routing event now for (seqs[i], layer), every listed sequence in one launch.
  void route_batch(int layer, std::span<const sequence_id> seqs) {
    kernels::lane_list list;
    list.n = static_cast<int>(seqs.size());
    for (std::size_t b = 0; b < seqs.size(); ++b) list.lane[b] = lane_index(seqs[b], layer);
    launch_route(layer, list, kernels::route_source{}, 0);
  }

  /// A routing event now for (s, layer).
  void route(sequence_id s, int layer) {
    kernels::lane_list list;
    list.n = 1;
    list.lane[0] = lane_index(s, layer);
    launch_route(layer, list, kernels::route_source{}, 0);
  }

  /// Waits for the stream and throws qevict::error if the device found a bad input.
  void check() const {
    QEVICT_CUDA_CHECK(cudaStreamSynchronize(set_.stream));
    kernels::device_error e;
    QEVICT_CUDA_CHECK(cudaMemcpy(&e, S_.error, sizeof e, cudaMemcpyDeviceToHost));
    if (e.code == 0) return;
    // The device skipped every change since the bad call: bring the mirrors back to its state.
    std::vector<kernels::lane_state> lanes(lanes_total_);
    std::vector<kernels::lane_extra> extra(lanes_total_);
    QEVICT_CUDA_CHECK(cudaMemcpy(lanes.data(), S_.lanes, lanes.size() * sizeof(lanes[0]), cudaMemcpyDeviceToHost));
    QEVICT_CUDA_CHECK(cudaMemcpy(extra.data(), S_.extra, extra.size() * sizeof(extra[0]), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < lanes_total_; ++i) mirrors_[i] = mirror{lanes[i].tokens, lanes[i].aged, extra[i].steps};
    QEVICT_CUDA_CHECK(cudaMemset(S_.error, 0, sizeof(kernels::device_error)));
    const char* calls[] = {"?", "append", "attend", "prefill"};
    const auto in = static_cast<numeric::input>(e.input % 3);
    throw error(
        std::string(calls[e.call & 3]) + ": " + numeric::to_string(in) + "[" + std::to_string(e.index) + "] " +
        numeric::input_problem(e.value, in) +
        " (found on the device); that call and every later change were skipped, the cache is as it was before it");
  }

  // ---- introspection (synchronizing) ----------------------------------------------------------
  std::vector<window_info> windows(sequence_id s, int layer) const {
    check();
    const std::vector<window_record> table = download_table(s, layer);
    const mirror& m = mirror_of(s, layer);
    return describe_windows(plan_, table.data(), m.tokens, m.aged, first_position(s));
  }

  tier_counts counts(sequence_id s, int layer) const {
    check();
    return counts_of(download_table(s, layer), mirror_of(s, layer));
  }

  budget_report report() const {
    check();
    budget_report r;
    r.caps = plan_.caps;
    r.units = static_cast<std::size_t>(plan_.units);
    r.budget_per_sequence_layer = plan_.budget_bytes;
    r.full_window_bytes = plan_.full_window_bytes;
    r.quantized_window_bytes = plan_.quantized_window_bytes();
    r.layers.resize(static_cast<std::size_t>(geo_.layers));
    for (sequence_id s = 0; s < sequences_.size(); ++s) {
      if (!sequences_.active(s)) continue;
      ++r.sequences;
      for (int l = 0; l < geo_.layers; ++l) {
        const mirror& m = mirror_of(s, l);
        add_lane(r.layers[static_cast<std::size_t>(l)], plan(l), counts_of(download_table(s, l), m), m.tokens);
      }
    }
    return r;
  }

  /// Keys (after RoPE) and values of window w as attention sees them, [window][kv_heads][head_dim].
  /// Throws if any unit of the window is evicted.
  void read_window(sequence_id s, int layer, int w, float* k_post, float* v) const {
    check();
    const mirror& m = mirror_of(s, layer);
    const std::vector<window_record> table = download_table(s, layer);
    const region_plan& p = plan(layer);
    const int d = geo_.head_dim, hkv = geo_.kv_heads, Wn = p.window, U = p.units, hu = p.heads_per_unit;
    const std::size_t eb = element_bytes(geo_.element);
    const std::byte* region = region_of(s, layer);
    auto put = [&](int j, int h, int c, float key, float value) {
      k_post[(static_cast<std::size_t>(j) * hkv + h) * d + c] = key;
      v[(static_cast<std::size_t>(j) * hkv + h) * d + c] = value;
    };
    const std::vector<double> inv = rope::inverse_frequencies(geo_.rope, d);
    std::vector<std::uint8_t> bytes;
    std::vector<float> kw(static_cast<std::size_t>(Wn) * hu * d), vw(kw.size());
    // A record of quantizer Q at `offset`, read back as the host backend reads it.
    const auto from_record = [&]<class Q>(std::size_t offset, const quantizers::record_layout& layout, int u) {
      bytes.resize(layout.window_bytes());
      QEVICT_CUDA_CHECK(cudaMemcpy(bytes.data(), region + offset, bytes.size(), cudaMemcpyDeviceToHost));
      dequantize_window<Q, rope>(layout, bytes.data(), geo_.rope.layout, inv.data(), window_first_position(s, w), kw.data(), vw.data());
      for (int j = 0; j < Wn; ++j)
        for (int hl = 0; hl < hu; ++hl)
          for (int c = 0; c < d; ++c) {
            const std::size_t at = (static_cast<std::size_t>(j) * hu + hl) * d + c;
            put(j, u * hu + hl, c, kw[at], vw[at]);
          }
    };
    for (int u = 0; u < U; ++u) {
      const window_record& rec = table[static_cast<std::size_t>(w) * U + u];
      const tier t = tier_of(rec, w < m.aged);
      detail::require(t != tier::evicted, "read_window: window " + std::to_string(w) + " is evicted");
      if (t == tier::quantized) {
        from_record.template operator()<quantizer>(p.ledger_offset + static_cast<std::size_t>(rec.ledger_slot) * p.quantized_window_bytes(),
                                                   p.record, u);
        continue;
      }
      if constexpr (support::quantized_top) {
        if (t == tier::full) {
          from_record.template operator()<full_quantizer>(p.full_offset + static_cast<std::size_t>(rec.full_slot) * p.full_window_bytes,
                                                          p.full_record, u);
          continue;
        }
      }
      // Token rows: a Full slot holds the unit's heads, the recent ring all heads.
      int capacity = Wn, first_slot = 0, heads = hu, head0 = 0;
      std::size_t offset = 0;
      if (t == tier::full) {
        offset = p.full_offset + static_cast<std::size_t>(rec.full_slot) * p.full_window_bytes;
      } else {
        detail::require(p.sinks + (w + 1) * Wn <= m.tokens, "read_window: window " + std::to_string(w) + " is not complete yet");
        offset = p.recent_offset;
        capacity = p.recent_capacity;
        first_slot = w * Wn;
        heads = hkv;
        head0 = u * hu;
      }
      // Only the window's rows are copied, into their places in a host image of the block: the
      // ring's other slots may hold no token yet, and the window may wrap around the ring's end.
      // A row is one head's keys or values: `capacity` slots of slot_bytes.
      const std::size_t slot_bytes = static_cast<std::size_t>(d) * eb, row_bytes = capacity * slot_bytes;
      std::vector<std::byte> block(static_cast<std::size_t>(heads) * 2 * row_bytes);
      const int first = first_slot % capacity, before_end = std::min(Wn, capacity - first);
      const auto copy_slots = [&](int slot, int n) {
        const std::size_t at = static_cast<std::size_t>(2 * head0) * row_bytes + slot * slot_bytes;
        QEVICT_CUDA_CHECK(cudaMemcpy2D(block.data() + at, row_bytes, region + offset + at, row_bytes, n * slot_bytes,
                                       static_cast<std::size_t>(2 * hu), cudaMemcpyDeviceToHost));
      };
      copy_slots(first, before_end);
      if (before_end < Wn) copy_slots(0, Wn - before_end);
      for (int j = 0; j < Wn; ++j) {
        const int slot = (first_slot + j) % capacity;
        for (int hl = 0; hl < hu; ++hl) {
          const int hb = head0 + hl;  // the head's place in the block
          for (int c = 0; c < d; ++c)
            put(j, u * hu + hl, c, numeric::load(geo_.element, block.data(), (static_cast<std::size_t>(2 * hb) * capacity + slot) * d + c),
                numeric::load(geo_.element, block.data(), (static_cast<std::size_t>(2 * hb + 1) * capacity + slot) * d + c));
        }
      }
    }
  }

  /// The bytes of the ledger record of window w, unit `unit` (a host copy, valid until the next
  /// call; empty if none).
  std::span<const std::uint8_t> ledger_record(sequence_id s, int layer, int w, int unit = 0) const {
    check();
    const std::vector<window_record> table = download_table(s, layer);
    const window_record& rec = table[static_cast<std::size_t>(w) * plan_.units + unit];
    if (rec.ledger_slot < 0) return {};
    record_copy_.resize(plan(layer).quantized_window_bytes());
    QEVICT_CUDA_CHECK(cudaMemcpy(record_copy_.data(),
                                 region_of(s, layer) + plan(layer).ledger_offset + static_cast<std::size_t>(rec.ledger_slot) * record_copy_.size(),
                                 record_copy_.size(), cudaMemcpyDeviceToHost));
    return {record_copy_.data(), record_copy_.size()};
  }

  /// Overrides window w's cumulative score, of one unit or (unit < 0) of all its units
  /// (stream-ordered).
  void set_score(sequence_id s, int layer, int w, float score, int unit = -1) {
    window_record* table = reinterpret_cast<window_record*>(region_of(s, layer));
    score_staging_ = score;
    for (int u = 0; u < plan_.units; ++u)
      if (unit < 0 || unit == u)
        QEVICT_CUDA_CHECK(cudaMemcpyAsync(&table[static_cast<std::size_t>(w) * plan_.units + u].score, &score_staging_, sizeof(float),
                                          cudaMemcpyHostToDevice, set_.stream));
    QEVICT_CUDA_CHECK(cudaStreamSynchronize(set_.stream));
  }

  int windows_started(int tokens) const { return plan_.windows_started(tokens); }
  int aged(sequence_id s, int layer) const { return mirror_of(s, layer).aged; }

 private:
  /// Host mirror of a lane: all three follow from the calls alone.
  struct mirror {
    int tokens = 0;
    int aged = 0;
    int steps = 0;
  };

  /// Frees what cudaMalloc gave. Owners of the allocations, so that a constructor that throws
  /// part-way (a failed allocation, a bad setting found late) frees what it had taken: members are
  /// destroyed even when the constructor's body does not finish.
  struct device_free {
    void operator()(void* p) const noexcept { cudaFree(p); }
  };
  using device_allocation = std::unique_ptr<void, device_free>;

  /// Scratch of n elements from cudaMallocAsync on `stream`, given back on the same stream when
  /// the owner goes out of scope (also when the call that took it throws).
  template <class T>
  class stream_scratch {
   public:
    stream_scratch(std::size_t n, cudaStream_t stream) : stream_(stream) {
      QEVICT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), std::max<std::size_t>(n, 1) * sizeof(T), stream));
    }
    stream_scratch(const stream_scratch&) = delete;
    stream_scratch& operator=(const stream_scratch&) = delete;
    ~stream_scratch() { cudaFreeAsync(p_, stream_); }
    T* get() const { return p_; }

   private:
    T* p_ = nullptr;
    cudaStream_t stream_;
  };

  /// Device memory for n elements, counted in `part` (one of memory_'s).
  template <class T>
  T* alloc(std::size_t n, std::size_t& part) {
    void* p = nullptr;
    const std::size_t bytes = std::max<std::size_t>(n, 1) * sizeof(T);
    QEVICT_CUDA_CHECK(cudaMalloc(&p, bytes));
    device_allocation owned(p);
    allocations_.push_back(std::move(owned));
    part += bytes;
    return static_cast<T*>(p);
  }

  int lane_index(sequence_id s, int layer) const { return static_cast<int>(s) * geo_.layers + layer; }
  const kernels::cache_params& params(int layer) const { return params_[static_cast<std::size_t>(layer)]; }
  /// The region of (s, layer) in the arena (the host backend's layout).
  std::byte* region_of(sequence_id s, int layer) const {
    return S_.arena + arena_.region_offset(static_cast<int>(s), layer);
  }
  mirror& mirror_of(sequence_id s, int layer) { return mirrors_[static_cast<std::size_t>(lane_index(s, layer))]; }
  const mirror& mirror_of(sequence_id s, int layer) const { return mirrors_[static_cast<std::size_t>(lane_index(s, layer))]; }
  int aged_windows_for(int tokens) const {
    const int span = tokens - plan_.sinks - plan_.recent;
    return span > 0 ? span / plan_.window : 0;
  }
  bool recent_full(const mirror& m) const {
    return m.tokens >= plan_.sinks && std::max(0, m.tokens - plan_.sinks - m.aged * plan_.window) >= plan_.recent_capacity;
  }
  long long window_first_position(sequence_id s, int w) const {
    return first_position(s) + plan_.sinks + static_cast<long long>(w) * plan_.window;
  }

  void launch_scan(const float* x, std::size_t n, numeric::input in, int call) {
    if (n == 0) return;
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(1024, (n + 255) / 256));
    kernels::detail::scan_input_kernel<<<blocks, 256, 0, set_.stream>>>(x, n, numeric::largest_magnitude(in), S_.error,
                                                                        call, static_cast<int>(in));
    QEVICT_CUDA_CHECK_LAUNCH("scan_input_kernel");
  }

  /// f.template operator()<MaxItems>() with the decide kernel's table entries per thread for a lane
  /// of sort_capacity table entries (kernels::detail::route_items_for).
  template <class F>
  static void with_route_decide(int sort_capacity, F&& f) {
    kernels::detail::with_route_items<kernels::detail::route_max_entries / kernels::detail::route_threads>(
        kernels::detail::route_items_for(sort_capacity), f);
  }

  /// One routing event for every listed lane: decide, quantize, store.
  void launch_route(int layer, const kernels::lane_list& list, const kernels::route_source& src, int source_kind) {
    cudaStream_t st = set_.stream;
    const kernels::cache_params& P = params(layer);
    const unsigned lanes = static_cast<unsigned>(list.n);
    with_route_decide(P.sort_capacity, [&]<int MaxItems>() {
      kernels::detail::route_decide_kernel<scorer, routing_policy, MaxItems>
          <<<lanes, kernels::detail::route_threads, kernels::detail::route_decide_bytes<MaxItems>(), st>>>(P, S_, list, source_kind);
    });
    QEVICT_CUDA_CHECK_LAUNCH("route_decide_kernel");
    // Warps per lane for the data movements, one (window, KV head) each at a time. A decode event
    // moves from a few windows per lane (a settled ranking) to dozens (the events after a prefill,
    // whose scores meet the decode mass, and small budgets, where ranks churn); enough CTAs of 8
    // warps per lane keep those from serializing, and CTAs without work return at once. A prefill's
    // event quantizes or stores every window of its one lane that the budget keeps (thousands at
    // 32K tokens), 16 work items each: its CTAs fill the whole device.
    const dim3 grid(static_cast<unsigned>(list.n), source_kind == 2 ? QEVICT_PREFILL_ROUTE_CTAS : QEVICT_ROUTE_CTAS_PER_LANE);
    // Each starts while the kernel before it finishes, and waits for it before it reads its tasks.
    // The element type is a template argument, so that each element's load or store is one
    // conversion rather than a switch over three: the code a warp runs through once per event
    // (one window's keys or values) is what an event waits for.
    const auto migrate = [&]<int D, element_type E>() {
      kernels::launch_dependent("quantize_kernel", kernels::detail::quantize_kernel<D, W::size, E, quantizer, full_quantizer, records_rotate>,
                                grid, dim3(256), 0, st, P, S_, list, src);
      kernels::launch_dependent("store_full_kernel", kernels::detail::store_full_kernel<D, W::size, E, quantizer, full_quantizer, records_rotate>,
                                grid, dim3(256), 0, st, P, S_, list, src);
    };
    kernels::with_head_dim_and_element("route", geo_.head_dim, geo_.element, migrate);
    for (int i = 0; i < list.n; ++i) {
      mirror& m = mirrors_[static_cast<std::size_t>(list.lane[i])];
      m.aged = std::max(m.aged, aged_windows_for(m.tokens));
      m.steps = 0;
    }
  }

  std::vector<window_record> download_table(sequence_id s, int layer) const {
    std::vector<window_record> t(std::max<std::size_t>(1, plan_.table_entries()));
    QEVICT_CUDA_CHECK(cudaMemcpy(t.data(), region_of(s, layer),
                                 plan_.table_entries() * sizeof(window_record), cudaMemcpyDeviceToHost));
    return t;
  }

  tier_counts counts_of(const std::vector<window_record>& table, const mirror& m) const {
    return count_tiers(plan_, table.data(), m.tokens, m.aged);
  }

  geometry geo_;
  limits lim_;
  options opt_;
  cuda_settings set_;
  std::vector<region_plan> plans_;
  region_plan plan_;
  arena_plan arena_;  ///< where each (sequence, layer) region lies in the arena
  std::size_t lanes_total_ = 0;
  std::vector<kernels::cache_params> params_;  ///< one per layer
  kernels::cache_pointers S_{};
  std::vector<device_allocation> allocations_;  ///< every cudaMalloc of the constructor (freed with the cache)
  kernels::decode_workspace workspace_;  // the decode kernel's, in one block
  device_memory memory_;  // what alloc() asked for, by part
  std::byte* workspace_block_ = nullptr;
  mutable std::vector<mirror> mirrors_;
  sequence_slots sequences_;
  mutable std::vector<std::uint8_t> record_copy_;
  float score_staging_ = 0.0f;
};

}  // namespace backend
}  // namespace qevict

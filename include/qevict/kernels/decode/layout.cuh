#pragma once
// What the decode kernels read of a cache, as the host side hands it to them: each lane's state,
// the window lists' entries, the record formats, the layout of the regions (decode_layout) and one
// launch's arguments and workspace (decode_arguments, decode_workspace).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "qevict/core/layout.hpp"
#include "qevict/kernels/split_k.hpp"
#include "qevict/policies/rope.hpp"

namespace qevict::kernels {

/// Device-resident state of one lane (sequence slot, layer). The entry counts of its window lists
/// are kept apart (decode_arguments::entry_counts), one per routing unit.
struct lane_state {
  int tokens = 0;
  int aged = 0;
  long long first_position = 0;
  /// Byte offset of the lane's region in the arena (decode_layout::region_offset, stored when the
  /// lane is reset, so that the decode kernel loads it instead of dividing by the layer count).
  long long region = 0;
};

/// One Full or Quantized window in a lane's list. slot >= 0: Full slot; slot < 0: ledger slot ~slot.
struct window_entry {
  std::int32_t window;
  std::int32_t slot;
};

/// What attention does to a record's dequantized keys (from the quantizer's key frame):
///   each_key          keys before RoPE: every key rotated to its own position;
///   none              keys after RoPE (or no RoPE): used as they are;
///   query_per_window  window-relative keys: the query rotated back by the window's start, once
///                     per window, q . R(t0) k_rel = (R(t0)^T q) . k_rel.
enum class record_rotation : int { each_key = 0, none = 1, query_per_window = 2 };

/// Items of a lane, written once for the host (the layout's run-time window size) and the kernels
/// (their compile-time W, so that the divisions fold away).
struct item_count {
  /// Windows per item: 8/W for W < 8, else 1.
  QEVICT_HOST_DEVICE static constexpr int windows_per_item(int window) { return window >= 8 ? 1 : 8 / window; }
  /// Items of `entries` listed windows: W/8 each for W >= 8, 8/W windows per item for W < 8.
  QEVICT_HOST_DEVICE static constexpr int listed(int window, int entries) {
    return window >= 8 ? entries * (window / 8) : (entries + windows_per_item(window) - 1) / windows_per_item(window);
  }
  /// Items of a lane: the sink group, `entries` listed windows, `recent_tokens` recent tokens.
  QEVICT_HOST_DEVICE static constexpr int of_lane(int window, int sinks, int entries, int recent_tokens) {
    return (sinks > 0 ? 1 : 0) + listed(window, entries) + (recent_tokens + 7) / 8;
  }
};

/// Where the parts of one KV head's quantized record lie: in the window's record (W tokens, in its
/// ledger record or Full slot), and in its shared-memory copy, which is staged in the layout of an
/// 8-token record (the window's record itself when W = 8).
struct record_format {
  int bits = 0;                ///< code width (2, 4 or 8); 0: no records of this kind
  std::size_t head_bytes = 0;  ///< one KV head's record (W tokens)
  /// Offsets in the window's record, where an item's parts are copied from.
  std::size_t key_scale = 0, value_codes = 0, value_scale = 0, value_zero = 0;
  /// Offsets in the staged 8-token record, and its size.
  std::size_t staged_key_scale = 0, staged_key_zero = 0, staged_value_codes = 0, staged_value_scale = 0,
              staged_value_zero = 0, staged_bytes = 0;

  static constexpr record_format of(const quantizers::record_layout& r) {
    const quantizers::record_layout staged{8, 1, r.head_dim, r.bits, r.meta_bytes};
    record_format f;
    f.bits = r.bits;
    f.head_bytes = r.head_bytes();
    f.key_scale = r.key_scale_offset();
    f.value_codes = r.value_codes_offset();
    f.value_scale = r.value_scale_offset();
    f.value_zero = r.value_zero_offset();
    f.staged_key_scale = staged.key_scale_offset();
    f.staged_key_zero = staged.key_zero_offset();
    f.staged_value_codes = staged.value_codes_offset();
    f.staged_value_scale = staged.value_scale_offset();
    f.staged_value_zero = staged.value_zero_offset();
    f.staged_bytes = staged.head_bytes();
    return f;
  }
};

/// Grid-invariant description of the byte layout (built on the host from region_plan).
///
/// Items. The kernel works on items of 8 tokens whatever the window size W (1, 2, 4, 8, 16 or 32):
/// a window of W >= 8 tokens is W/8 items (its parts), and with W < 8 one item gathers the tokens
/// of 8/W consecutive listed Full windows (each from its own Full slot) or holds one ledger record
/// (record_entries). A part of a quantized record, or a record shorter than 8 tokens, is staged in
/// shared memory in the layout of an 8-token record (its key metadata, shared by the window's
/// tokens, copied into every part), so the compute never sees W.
struct decode_layout {
  int kv_heads = 0, group = 0, head_dim = 0, window = 0, sinks = 0, recent_capacity = 0;
  /// Where the regions of this layout's layer lie: lane l (sequence l / layers, this layer) at
  /// region_offset(l). Layers may differ in size (a budget per layer), so a layout describes one
  /// layer; by default one layer of lane-major regions (lane l at l * region_bytes).
  int layers = 1;
  std::size_t sequence_stride = 0, layer_offset = 0;
  /// Routing units per window (1, or kv_heads with per-KV-head selection) and the KV heads of one
  /// unit: a Full slot and a ledger record hold one unit's heads, and every unit has its own window
  /// list (list of lane l, unit u: l * units + u).
  int units = 1, heads_per_unit = 1;

  /// KV head h's unit and its place among the unit's heads. Units are the whole layer or single
  /// heads, so both are a select rather than a division (which the decode kernel, at its register
  /// limit, would rather spill than recompute).
  QEVICT_HOST_DEVICE constexpr int unit_of(int h) const { return units == 1 ? 0 : h; }
  QEVICT_HOST_DEVICE constexpr int head_in_unit(int h) const { return units == 1 ? h : 0; }
  /// The window and the unit of window-table entry e (window * units + unit); with one unit a
  /// select, not a division.
  QEVICT_HOST_DEVICE constexpr int window_of_entry(int e) const { return units == 1 ? e : e / units; }
  QEVICT_HOST_DEVICE constexpr int unit_of_entry(int e) const { return units == 1 ? 0 : e % units; }
  rope_layout layout = rope_layout::rotate_half;
  std::size_t region_bytes = 0, sink_offset = 0, recent_offset = 0, full_offset = 0, ledger_offset = 0;
  std::size_t full_window_bytes = 0, record_bytes = 0;
  /// The ledger's records, and the Full slots' records when the top tier is quantized
  /// (full_tier::quantized_as; full_format.bits == 0: a Full slot holds token rows).
  record_format ledger_format{}, full_format{};
  int entries_per_lane = 0;  ///< capacity of one window list (one lane and unit)
  /// List entries one Quantized window takes: 1, or windows_per_item() when W < 8 and the layer
  /// keeps records. Then a record is an item of its own (its W tokens; the item's other tokens do not
  /// exist), and a list is [the Full windows, padded to a multiple of 8/W entries][each Quantized
  /// window followed by 8/W - 1 padding entries], padding being window -1: item i still covers the
  /// entries [i * 8/W, (i + 1) * 8/W), and holds 8/W Full windows or one record.
  int record_entries = 1;
  int max_items = 0;  ///< items a lane can have: sink group + listed windows' items + recent items
  /// How attention turns a record's dequantized keys into the query's frame.
  record_rotation records = record_rotation::each_key;

  /// Byte offset of lane l's region in the arena.
  QEVICT_HOST_DEVICE constexpr std::size_t region_offset(int lane) const {
    return static_cast<std::size_t>(lane / layers) * sequence_stride + layer_offset;
  }

  /// item_count with this layout's window size.
  QEVICT_HOST_DEVICE constexpr int windows_per_item() const { return item_count::windows_per_item(window); }
  QEVICT_HOST_DEVICE constexpr int listed_items(int entries) const { return item_count::listed(window, entries); }
  QEVICT_HOST_DEVICE constexpr int items_for(int entries, int recent_tokens) const {
    return item_count::of_lane(window, sinks, entries, recent_tokens);
  }
  /// Sets the capacity of a window list and the items a lane can then have (a cache whose layers
  /// differ gives every layer the largest capacity, so that the lists share one stride).
  constexpr void set_list_capacity(int entries) {
    entries_per_lane = entries;
    max_items = items_for(entries, recent_capacity);
  }
  /// The most entries a list can have once `aged` windows have aged (each is listed at most once).
  constexpr int max_entries_for(int aged) const {
    return entries_per_lane < record_entries * aged ? entries_per_lane : record_entries * aged;
  }
  /// The entries one list needs for k_full Full and k_quantized Quantized units (any of which one
  /// unit can hold, up to the windows that exist).
  constexpr int list_entries_for(std::size_t k_full, std::size_t k_quantized, int max_windows) const {
    const std::size_t n = static_cast<std::size_t>(max_windows), r = static_cast<std::size_t>(record_entries);
    const std::size_t f = std::min(k_full, n), q = std::min(k_quantized, n);
    if (r == 1) return static_cast<int>(std::min(f + q, n));
    return static_cast<int>(std::min((f + r - 1) / r * r + r * q, r * n));
  }

  /// The layout of `p` for a cache whose RoPE layout is `pairs` and whose records need
  /// `rotation` (see for_config).
  static decode_layout from_plan(const region_plan& p, rope_layout pairs, record_rotation rotation) {
    decode_layout d;
    d.layout = pairs;
    d.records = rotation;
    d.kv_heads = p.kv_heads;
    d.units = p.units;
    d.heads_per_unit = p.heads_per_unit;
    d.group = p.q_heads / p.kv_heads;
    d.head_dim = p.head_dim;
    d.window = p.window;
    d.sinks = p.sinks;
    d.recent_capacity = p.recent_capacity;
    d.region_bytes = p.region_bytes;
    d.sequence_stride = p.region_bytes;
    d.sink_offset = p.sink_offset;
    d.recent_offset = p.recent_offset;
    d.full_offset = p.full_offset;
    d.ledger_offset = p.ledger_offset;
    d.full_window_bytes = p.full_window_bytes;
    d.record_bytes = p.record.window_bytes();
    d.ledger_format = record_format::of(p.record);
    if (p.full_record.bits != 0) d.full_format = record_format::of(p.full_record);
    d.record_entries = p.window < 8 && p.caps.quantized > 0 ? d.windows_per_item() : 1;
    // Caps count units of the whole layer, so one unit can hold up to all of them.
    d.set_list_capacity(d.list_entries_for(p.caps.full, p.caps.quantized, p.max_windows));
    return d;
  }

  /// What attention does to the records of a cache built from Config (its RoPE policy and its
  /// quantizer's key frame); anything but `none` also means the records were rotated back when
  /// quantized.
  template <class Config>
  static constexpr record_rotation rotation_for() {
    using frame = typename Config::quantizer::key_frame;
    if constexpr (!Config::rope::rotates || frame::rotated) return record_rotation::none;
    else if constexpr (std::is_same_v<frame, quantizers::key_frame::window_relative>) return record_rotation::query_per_window;
    else return record_rotation::each_key;
  }

  /// The layout of a cache built from Config.
  template <class Config>
  static decode_layout for_config(const region_plan& p, rope_layout pairs) {
    return from_plan(p, pairs, rotation_for<Config>());
  }
};

/// What one launch reads and writes. All pointers are device pointers.
struct decode_arguments {
  std::byte* arena = nullptr;              ///< regions: lane l's at L.region_offset(l)
  const lane_state* lanes = nullptr;       ///< per lane
  const window_entry* entries = nullptr;   ///< per list (lane * units + unit), entries_per_lane each
  const int* entry_counts = nullptr;       ///< per list: its entries
  const int* batch_lanes = nullptr;        ///< lane of each batch element
  int batch = 0;
  const float* q = nullptr;                ///< [batch][q_heads][head_dim], before RoPE
  float* out = nullptr;                    ///< [batch][q_heads][head_dim]
  const double* inv_freq = nullptr;        ///< [head_dim / 2]
  // Workspace (decode_workspace::bytes).
  float* part_o = nullptr;
  float2* part_ml = nullptr;
  /// [batch][kv_heads][max_items][windows per item][group]: log2 of each item window's sum of 2^s
  /// over its tokens, per query head (s: the head's scores in log2 units), written by the CTA that
  /// serves the item.
  float* part_mass = nullptr;
  /// [batch][kv_heads][group]: each query head's log-sum-exp over all its tokens, log2 units
  /// (head_lse), written by the CTA that merges a (sequence, KV head) for the window masses.
  float* part_lse = nullptr;
  /// [batch][kv_heads]: chunks of each (sequence, KV head) that have written their partials. Zero
  /// before the first launch; every launch leaves them zero (the merging CTA resets its own).
  unsigned* tickets = nullptr;
  /// With EmitMass: [0] the mass kernel's CTAs that have finished, then [batch][2]: the sequence's
  /// KV heads whose log-sum-exps are written, and the mass kernel's CTAs that have seen all of them
  /// (wait_for_lse_written). Zero before the first launch; every launch leaves them zero (the
  /// sequence's last mass CTA resets its two, the grid's last CTA the first).
  unsigned* mass_signals = nullptr;
  /// [batch][kv_heads][2 * head_dim / 16][32 lanes] uint4: the query of each KV head's group as the
  /// decode kernel's lanes hold it (query_fragments), written with prepare_query.
  uint4* q_fragments = nullptr;
  /// [batch][kv_heads][8][head_dim/2]: e^{i j f_p}, for keys rotated one by one (records stored
  /// before RoPE; no bytes otherwise), written with the (sequence, KV head)'s query.
  float2* cs_table = nullptr;
  /// Items of one split-K chunk: a multiple of 8 up to max_items_per_chunk(W) (384 for windows of
  /// at least 8 tokens, 128 below), or 0 to let the launch choose (decode_chunk: nearly equal
  /// chunks of up to that many items, whichever keeps the busiest CTA slot shortest).
  int items_per_chunk = 0;
  /// Chunks per (sequence, KV head) the workspace holds (decode_workspace::chunks_for).
  int max_chunks = 0;
};

/// Workspace sizes for `batch` sequences. Partial outputs are kept per chunk, window masses per
/// item (whatever the chunk length).
struct decode_workspace {
  std::size_t o = 0, ml = 0, mass = 0, lse = 0, tickets = 0, signals = 0, q = 0, table = 0;
  /// Chunks of a (sequence, KV head) with the longest lane: for items_per_chunk 0 (automatic),
  /// chunks of min_automatic_chunk items, the most chunks any automatic choice makes.
  static int chunks_for(const decode_layout& L, int items_per_chunk) {
    const int c = items_per_chunk == 0 ? min_automatic_chunk : items_per_chunk;
    return (L.max_items + c - 1) / c;
  }
  static decode_workspace sizes(const decode_layout& L, int batch, int items_per_chunk) {
    const std::size_t chunks = static_cast<std::size_t>(chunks_for(L, items_per_chunk));
    const std::size_t bh = static_cast<std::size_t>(batch) * L.kv_heads;
    decode_workspace w;
    w.o = bh * chunks * L.group * L.head_dim * sizeof(float);
    w.ml = bh * chunks * L.group * sizeof(float2);
    w.mass = bh * static_cast<std::size_t>(L.max_items) * L.windows_per_item() * L.group * sizeof(float);
    w.lse = bh * L.group * sizeof(float);
    w.tickets = bh * sizeof(unsigned);  // must start zeroed
    w.signals = (1 + 2 * static_cast<std::size_t>(batch)) * sizeof(unsigned);  // must start zeroed
    w.q = bh * 32 * (2 * L.head_dim / 16) * sizeof(uint4);
    w.table = L.records == record_rotation::each_key ? bh * 8 * (L.head_dim / 2) * sizeof(float2) : 0;
    return w;
  }
  /// Bytes of one device block that holds every part, each from a 256-byte boundary (bind).
  std::size_t bytes() const {
    return aligned(o) + aligned(ml) + aligned(mass) + aligned(lse) + aligned(tickets) + aligned(signals) + aligned(q) +
           aligned(table);
  }
  /// Points a's workspace (part_o to cs_table) into `block`: bytes() bytes of device memory, from a
  /// 256-byte boundary, zeroed once before the first launch (the tickets and the mass signals must
  /// start at zero, and every launch leaves them so).
  void bind(void* block, decode_arguments& a) const {
    auto* at = static_cast<std::byte*>(block);
    auto take = [&](auto*& part, std::size_t n) {
      part = reinterpret_cast<std::remove_reference_t<decltype(part)>>(at);
      at += aligned(n);
    };
    take(a.part_o, o);
    take(a.part_ml, ml);
    take(a.part_mass, mass);
    take(a.part_lse, lse);
    take(a.tickets, tickets);
    take(a.mass_signals, signals);
    take(a.q_fragments, q);
    take(a.cs_table, table);
  }

 private:
  static std::size_t aligned(std::size_t n) { return (n + 255) / 256 * 256; }
};

}  // namespace qevict::kernels

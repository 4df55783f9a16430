#pragma once
// Fused decode attention over a QEvict cache: one pass over the sinks, the Full windows (bf16 or
// fp16 rows, or the records of a quantized top tier), the Quantized windows (INT2, INT4 or INT8
// codes dequantized in registers; keys quantized before RoPE are rotated in registers at their
// positions, keys quantized after RoPE are used as they are) and the recent region, with each
// window's attention mass as a by-product.
//
// Work list. Every (sequence, layer) — a lane — has one compact window list per routing unit
// (CSR-style: a fixed stride per list and a count) of (window index, slot) entries for its Full
// and Quantized windows. A unit is the whole layer (selection::per_layer: one list) or one KV head
// (selection::per_kv_head: each KV head keeps its own windows, in Full slots and ledger records
// of its own). The kernel sees one virtual list of "items" of 8 tokens per lane and KV head:
//   [the sink group] [the listed windows' items] [the recent region's items]
// (a window of W >= 8 tokens is W/8 items; with W < 8 an item gathers 8/W listed Full windows, or
// holds one ledger record: decode_layout::record_entries).
// A CTA serves one (sequence, KV head, chunk of items) and the whole GQA group of that KV head;
// each of its four warps takes two items at a time and streams its own items through shared
// memory: 16-byte cp.async copies (zero-filled where a token does not exist) into XOR-swizzled
// rows (token_row_chunk), `stages` item pairs per warp, so that the next pair is in flight while
// one is computed. Pairs of two ledger records take a loop of their own with compact record
// slots, up to four pairs per warp in flight or in use (record_slots): routing lists the Full
// windows first, so most chunks hold records only, and in the others the run of record pairs
// takes that loop after the general loop has served the sink group, the Full windows and the
// recent items.
//
// Tensor cores (mma.m16n8k16, the cache's 16-bit type in — bf16 or fp16 — fp32 accumulate):
//   S = Q K^T per item:  A = the group's queries (rows 0-7: high part, rows 8-15: the low part,
//                        so the query keeps 16 or 22 bits), B = the item's 8 keys (ldmatrix).
//   O^T += V^T P^T per two items: A = 16 channels x 16 tokens of values (ldmatrix.trans; for a
//                        record, over its value codes, which are stored in the order that makes
//                        each lane's register its fragment: record_value_fragments),
//                        B = probabilities (bf16: high and low part), whose C->B fragment
//                        layouts line up, so P never leaves registers. A group of at most 4
//                        heads takes both parts in one product: columns 4-7 carry the low parts
//                        (folds_low_part), 8 products per pair instead of 16 (keys used as
//                        stored or window-relative; keys rotated one by one keep both products).
// The queries reach the CTAs as fragments, prepared once per sequence and KV head (prepare_query):
// by prepare_queries_kernel before the attention kernel, or, when a launch has a single chunk per
// (sequence, KV head), by that chunk's CTA itself, so that no kernel runs before it.
// The contraction index is the channel in mma order: a thread owns channels
// 16s + {2t, 2t+1, 2t+8, 2t+9}, which holds both halves of every rotary pair.
//
// Value metadata is folded: a value's per-token scale multiplies its probability and its zero
// accumulates as sum(p * zero) per head, so value codes enter the tensor core as exact integers.
// Keys dequantize in fp32 (score_item), except that INT2 keys not rotated per key (stored after
// RoPE, or window-relative) take an fp16 path: each key element is one fp16 FMA of its code
// (placed in the mantissa of 1.0) with the channel's scale and zero, prepared once per window in
// shared memory; the query is an fp16 copy whose channels are ordered so that a thread's codes
// need no shuffling (the contraction order is free, as long as A and B agree).
//
// Split-K: each CTA writes its (unnormalised output, max, sum), and its warps write, per item
// window and head, log2 of the window's sum of 2^s as they go (the log domain needs no common
// maximum). The last CTA of a (sequence, KV head) to finish (a ticket per pair) forms each head's
// log-sum-exp and the output (merge_chunks); in a launch of one chunk per (sequence, KV head) each
// CTA finishes its pair alone (the output normalised in place, its log-sum-exps written directly).
// decode_mass_kernel then adds each window's mass = sum over heads of 2^(that value - the head's
// log-sum-exp) / H_q to its score. After a launch of several chunks a pair it starts under the
// decode grid's last wave, and each of its CTAs waits only until its own sequence's KV heads are
// merged (two counters a sequence); after a launch of one chunk a pair it waits for the whole grid.
// No per-token probability is written and K is read once.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "qevict/core/layout.hpp"
#include "qevict/kernels/check.cuh"
#include "qevict/kernels/dependent_launch.cuh"
#include "qevict/kernels/rope.cuh"
#include "qevict/kernels/split_k.hpp"
#include "qevict/kernels/warp_mma.cuh"
#include "qevict/policies/rope.hpp"

/// Resident CTAs per SM the decode kernel is compiled for (registers per thread follow from it).
#ifndef QEVICT_DECODE_MIN_BLOCKS
#define QEVICT_DECODE_MIN_BLOCKS 3
#endif

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

namespace detail {

constexpr int warps_per_cta = 4;
constexpr float log2e = 1.4426950408889634f;

/// 2^x on the special-function unit (relative error about 2^-22). Results below 2^-126 flush to
/// zero, which for a softmax weight relative to the running maximum changes nothing that float
/// sums would keep; it spares exp2f's range fix-up (a compare and two multiplies per call).
__device__ __forceinline__ float exp2_sfu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// How far (in log2 units) a score may exceed its row's reference maximum before the reference
/// is raised and the row's output rescaled. With bf16 values (Bf16) probabilities enter the tensor
/// cores as high and low bf16 parts (16 bits), and may grow to 2^8 between rescales, far from any
/// range limit. With fp16 values they enter as one fp16 part (11 bits), which must not overflow
/// once multiplied by a value's scale, and the row's largest probability must stay exactly 1, as
/// the host's softmax has it: the reference is then the row's running maximum (margin 0), raised
/// at every pair that passes it.
template <bool Bf16>
inline constexpr float rescale_margin = Bf16 ? 8.0f : 0.0f;

/// Whether the output product of a group takes its probabilities' high and low bf16 parts in one
/// tensor-core product: with bf16 values and at most 4 heads, the product's columns 4-7 (heads the
/// group lacks) carry the low parts of heads 0-3 beside their high parts in columns 0-3. The
/// query rows 4-7 then repeat rows 0-3 (query_fragments), so that lanes of rows g and g + 4 hold
/// the same scores and probabilities and each supplies its own column; the CTA merge adds column
/// g + 4 to column g. One product per 16 channels and pair instead of two. Not where keys are
/// rotated one by one (EachKey: records before RoPE), whose kernel measured slower folded
/// (docs/performance-history.md, v24c).
template <bool Bf16, bool EachKey>
inline constexpr bool may_fold_low_part = Bf16 && !EachKey;  ///< the part of folds_low_part known at compile time
template <bool Bf16, bool EachKey>
QEVICT_HOST_DEVICE constexpr bool folds_low_part(int group) { return may_fold_low_part<Bf16, EachKey> && group <= 4; }

/// log2(x) on the special-function unit (absolute error about 2^-22); 0 and values below 2^-126
/// give -inf.
__device__ __forceinline__ float log2_sfu(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// *p = v where `store`, as one predicated instruction: a branch around a store inside the decode
/// loops would split their instruction streams in two, which the scheduler then cannot interleave.
__device__ __forceinline__ void store_if(float* p, float v, bool store) {
  asm volatile("{\n .reg .pred s;\n setp.ne.b32 s, %2, 0;\n @s st.global.f32 [%0], %1;\n}" ::"l"(p), "f"(v), "r"(static_cast<int>(store))
               : "memory");
}

/// The first run of set bits in the mask m of 32 Words bits (bit i of word w is bit 32 w + i):
/// [x, y), or [0, 0) if no bit is set.
template <int Words>
__device__ __forceinline__ int2 first_run_of_ones(const std::uint32_t (&m)[Words]) {
  constexpr int bits = 32 * Words;
  // The words from the highest down, so that the lowest one that qualifies is kept.
  int first = bits;
#pragma unroll
  for (int w = Words - 1; w >= 0; --w)
    if (m[w] != 0) first = 32 * w + __ffs(static_cast<int>(m[w])) - 1;
  if (first == bits) return make_int2(0, 0);
  // The first clear bit at or after `first`.
  int end = bits;
#pragma unroll
  for (int w = Words - 1; w >= 0; --w) {
    const int from = first - 32 * w;  // bits of word w below it are not looked at
    const std::uint32_t looked_at = from <= 0 ? ~0u : from >= 32 ? 0u : ~0u << from;
    const std::uint32_t clear = ~m[w] & looked_at;
    if (clear != 0) end = 32 * w + __ffs(static_cast<int>(clear)) - 1;
  }
  return make_int2(first, end);
}

/// One item (8 tokens) as a warp sees it.
struct item_view {
  int kind;        // 0: empty, 1: token rows (sinks, Full, recent), 2: part of a ledger record (W < 8: all of it),
                   // 3: token rows gathered from the Full slots of 8/W windows (W < 8),
                   // 4: part of a Full slot's record (a quantized top tier)
  const std::uint8_t* base;  // rows: the block's base for this KV head; records: the record's head base
  int capacity;    // rows: rows per keys/values section
  int first_slot;  // rows: slot of token 0 (ring for the recent region)
  int valid;       // tokens that exist
  int window;      // window index (the first one for kind 3), -1 for the sink group
  int part;        // quantized: which 8 tokens of the window's record (W > 8)
};

/// Where this CTA's KV head starts in each section of its lane's region (computed once per CTA).
struct head_sections {
  const std::uint8_t* sinks;   // keys and values of the sink tokens
  const std::uint8_t* full;    // Full slot 0 (slot i at + i * full_window_bytes)
  const std::uint8_t* ledger;  // ledger record 0 (record i at + i * record_bytes)
  const std::uint8_t* recent;  // the recent ring
};

/// A Full slot and a ledger record hold the heads of one routing unit: KV head h is head
/// head_in_unit(h) there (h itself with per-layer selection, 0 with per-KV-head selection). A Full
/// slot holds each head's token rows, or its record when the top tier is quantized (FullBits != 0).
template <int ElementBytes, int FullBits>
__device__ __forceinline__ head_sections sections_of(const decode_layout& L, const std::uint8_t* region, int h) {
  const std::size_t d = static_cast<std::size_t>(L.head_dim) * ElementBytes;
  const int in_unit = L.head_in_unit(h);
  const std::size_t full_head = FullBits != 0 ? L.full_format.head_bytes : 2 * L.window * d;
  return head_sections{region + L.sink_offset + h * 2 * L.sinks * d, region + L.full_offset + in_unit * full_head,
                       region + L.ledger_offset + in_unit * L.ledger_format.head_bytes,
                       region + L.recent_offset + h * 2 * L.recent_capacity * d};
}

/// Item `item` of a lane (the virtual list [sink group][listed windows' items][recent items]).
/// For a kind-3 item, rows[r] receives the offset from the region of token r's key row. FullBits:
/// the code width of the Full slots' records (0: they hold token rows).
template <int W, int FullBits>
__device__ __forceinline__ item_view describe_item(const decode_layout& L, const head_sections& at, const std::uint8_t* region,
                                                   const lane_state& lane, const window_entry* entries, int n_entries,
                                                   int item, int n_items, std::uint32_t* rows) {
  item_view v{0, nullptr, 0, 0, 0, -1, 0};
  if (item >= n_items) return v;
  int i = item;
  if (L.sinks > 0) {
    if (i == 0) {
      v.kind = 1;
      v.capacity = L.sinks;
      v.base = at.sinks;
      v.valid = min(lane.tokens, L.sinks);
      return v;
    }
    --i;
  }
  const int listed = item_count::listed(W, n_entries);
  if (i < listed) {
    if constexpr (W >= 8) {
      const window_entry e = entries[i / (W / 8)];
      v.window = e.window;
      v.part = i % (W / 8);
      v.valid = 8;
      if (e.slot >= 0) {
        v.kind = FullBits ? 4 : 1;
        v.capacity = W;
        v.first_slot = 8 * v.part;
        v.base = at.full + static_cast<std::size_t>(e.slot) * L.full_window_bytes;
      } else {
        v.kind = 2;
        v.base = at.ledger + static_cast<std::size_t>(~e.slot) * L.record_bytes;
      }
    } else {
      // 8/W Full windows, gathered from their slots, or one ledger record of W tokens
      // (decode_layout::record_entries: the padding entries behind either have window -1).
      constexpr int per_item = 8 / W;
      const int first = i * per_item;
      const window_entry e0 = entries[first];
      v.window = e0.window;
      if (e0.slot < 0) {
        v.kind = 2;
        v.valid = W;
        v.base = at.ledger + static_cast<std::size_t>(~e0.slot) * L.record_bytes;
        return v;
      }
      int n = 0;
      for (int k = 0; k < min(per_item, n_entries - first); ++k)
        if (entries[first + k].window >= 0) n = k + 1;
      v.kind = 3;
      v.capacity = W;
      v.valid = n * W;
      for (int r = 0; r < n * W; ++r) {
        const window_entry e = entries[first + r / W];
        rows[r] = static_cast<std::uint32_t>(at.full + static_cast<std::size_t>(e.slot) * L.full_window_bytes +
                                             static_cast<std::size_t>(r % W) * L.head_dim * 2 - region);
      }
    }
    return v;
  }
  // Recent items: 8 consecutive tokens from the first token of window `aged` (a window boundary).
  const int k = i - listed;
  const int from = lane.aged * W + 8 * k;  // tokens after the sinks
  v.kind = 1;
  v.window = lane.aged + (W >= 8 ? 8 * k / W : k * (8 / W));
  v.capacity = L.recent_capacity;
  v.base = at.recent;
  v.first_slot = from % L.recent_capacity;
  v.valid = min(8, lane.tokens - L.sinks - from);
  return v;
}

/// An item as the copy and compute stages read it from shared memory (one 16-byte load), described
/// once per CTA by one thread rather than by every lane of the warp that streams it.
struct item_ref {
  std::uint32_t offset;      // of item_view::base from the lane's region
  std::uint32_t kind_valid;  // kind | valid << 8 | part << 16
  std::uint32_t ring;        // first_slot | capacity << 16
  std::int32_t window;

  __device__ static item_ref of(const item_view& v, const std::uint8_t* region) {
    return item_ref{v.base ? static_cast<std::uint32_t>(v.base - region) : 0u,
                    static_cast<std::uint32_t>(v.kind | v.valid << 8 | v.part << 16),
                    static_cast<std::uint32_t>(v.first_slot | v.capacity << 16), v.window};
  }
  __device__ int kind() const { return static_cast<int>(kind_valid & 0xff); }
  __device__ int valid() const { return static_cast<int>((kind_valid >> 8) & 0xff); }
  __device__ int part() const { return static_cast<int>(kind_valid >> 16); }
  __device__ item_view view(const std::uint8_t* region) const {
    return item_view{kind(), region + offset, static_cast<int>(ring >> 16), static_cast<int>(ring & 0xffff), valid(), window, part()};
  }
};

template <int W>
__device__ __forceinline__ int items_of(const decode_layout& L, const lane_state& lane, int n_entries) {
  return item_count::of_lane(W, L.sinks, n_entries, max(0, lane.tokens - L.sinks - lane.aged * W));
}

/// The window list of (lane, KV head h): its unit's.
__device__ __forceinline__ int list_of(const decode_layout& L, int lane_index, int h) {
  return lane_index * L.units + L.unit_of(h);
}

/// One item in shared memory: token rows of D elements (keys in rows 0-7, values in rows 8-15,
/// token_row_chunk), or a quantized record copied as is from the item's start.
template <int D>
constexpr int item_bytes = 16 * 2 * D;

/// Byte offset in a staged item of 16-byte chunk c of token row r. Rows are not padded; chunk c
/// of row r sits at chunk c ^ (r % 8) of its row. The eight rows that an ldmatrix reads at the same
/// chunk then fall in eight different groups of banks, and every 32-byte sector of a copied row
/// lands on one aligned 32-byte piece of shared memory. Rows padded by 16 bytes (the other way to
/// avoid bank conflicts) put every other row off that alignment, and the 16-byte copies of such
/// rows then asked L2 for about 1.5 times the sectors they needed.
template <int D>
__device__ __forceinline__ int token_row_chunk(int r, int c) {
  return r * (2 * D) + 16 * (c ^ (r & 7));
}

/// Items start on 256-byte boundaries (stage_alignment), so that a lane forms the shared address
/// `at` of its chunk c of a token row once per item and reaches chunk c ^ dc of the same row (which
/// is c + dc where the two share no set bits) with one XOR per load, rather than holding a
/// lane-dependent offset per load in registers across the loop over items.
__device__ __forceinline__ std::uint32_t chunk_step(std::uint32_t at, int dc) { return at ^ (16u * static_cast<unsigned>(dc)); }
constexpr int stage_alignment = 256;
/// Stages (item pairs in flight or in use) of each warp's copy pipeline.
#ifndef QEVICT_DECODE_STAGES
#define QEVICT_DECODE_STAGES 2
#endif
constexpr int stages = QEVICT_DECODE_STAGES;
template <int D>
constexpr int dynamic_smem_bytes = warps_per_cta * stages * 2 * item_bytes<D> + stage_alignment;

/// Where a quantized item's per-window key data sits in its slot, behind the record: e^{i t0 f_p}
/// (D/2 float2) for keys stored before RoPE, the fp16 scale/zero entries of stage_key_meta
/// (D/4 x 16 bytes) for keys stored after it.
template <int D>
constexpr int key_extra_offset = item_bytes<D> - (D / 2) * 8;
/// e^{i t0 f_p} of a window-relative record, in front of its staged key metadata.
template <int D>
constexpr int window_cs_offset = key_extra_offset<D> - (D / 2) * 8;

/// An 8-token record of Bits-bit codes with bf16 scale and zero (the only metadata the kernel
/// reads: backend/cuda/supports.hpp): the layout of every staged record, and the bytes of a window's
/// record when W = 8.
template <int D, int Bits>
inline constexpr quantizers::record_layout staged_record{8, 1, D, Bits, 2};

/// The compact slots of a chunk's run of ledger records (W = 8, 2-bit codes used as stored or
/// window-relative): each record item takes `bytes` (the record, the staged key metadata at
/// `meta`, and for window-relative records e^{i t0 f_p} at `cs`, all from the record's start)
/// instead of an item of token rows, so that a warp's stages hold `stages` pairs (at most 4)
/// rather than two. A record starts in its slot at the offset its global address has in a
/// 128-byte line (start), so that the lines it is read in land on lines of shared memory: the
/// records of a window's KV heads lie head_bytes apart (1056 bytes at head_dim 128, 32 bytes
/// past a line), so most records do not start on a line.
template <int D, bool QueryPerWindow>
struct record_slots {
  static constexpr int meta = static_cast<int>(staged_record<D, 2>.head_bytes() + 15) / 16 * 16;
  static constexpr int cs = meta + (D / 4) * 16;
  static constexpr int lead = 128 - 16;  // the largest start of a 16-byte aligned record in its slot
  static constexpr int bytes = (lead + cs + (QueryPerWindow ? (D / 2) * 8 : 0) + 127) / 128 * 128;
  static constexpr int stages = std::min(4, (detail::stages * 2 * item_bytes<D>) / (2 * bytes));
  static_assert(stages >= 2, "record_slots: the stages hold at least two pairs of records");
  /// Where the record copied from `src` starts in the 128-byte aligned slot `slot`.
  __device__ static std::uint8_t* start(std::uint8_t* slot, const std::uint8_t* src) {
    return slot + (reinterpret_cast<std::uintptr_t>(src) & 127u);
  }
};

/// Whether an item of `kind` is (part of) a record: a ledger record, or a Full slot's record
/// when the top tier is quantized (FullBits != 0).
template <int FullBits>
__device__ __forceinline__ bool is_record(int kind) {
  return kind == 2 || (FullBits != 0 && kind == 4);
}

/// The format of a record item: the Full slots' for kind 4, the ledger's otherwise.
template <int FullBits>
__device__ __forceinline__ const record_format& format_of(const decode_layout& L, int kind) {
  return FullBits != 0 && kind == 4 ? L.full_format : L.ledger_format;
}

/// A whole 8-token record of `Bytes` bytes (W = 8) from `src` to `dst`: its size is known at
/// compile time, so each lane copies its fixed 16-byte pieces (lane l: pieces l, l + 32, ...)
/// with no loop or bounds to compute.
template <int Bytes>
__device__ __forceinline__ void copy_record(std::uint8_t* dst, const std::uint8_t* src, int lane_id) {
  static_assert(Bytes % 16 == 0, "copy_record: records are whole 16-byte pieces");
  constexpr int pieces = Bytes / 16;
  const std::uint32_t to = warp::shared_address(dst) + 16 * lane_id;
  const std::uint8_t* from = src + 16 * lane_id;
#pragma unroll
  for (int r = 0; r < (pieces + 31) / 32; ++r)
    if ((r + 1) * 32 <= pieces || lane_id + 32 * r < pieces) warp::cp_async16(to + 512 * r, from + 512 * r, 16);
}

/// Asynchronous copy of one item's bytes for this KV head into its shared-memory slot. Token
/// rows that do not exist (and every row of an empty item) are zero-filled, so that a zero
/// probability never meets a stale NaN. `rows` holds a kind-3 item's key-row offsets.
template <int D, int W, int Bits, int FullBits>
__device__ __forceinline__ void copy_item(const decode_layout& L, const item_view& it, const std::uint32_t* rows,
                                          std::uint8_t* dst, const std::uint8_t* region, int lane_id) {
  if (is_record<FullBits>(it.kind)) {
    [[maybe_unused]] const record_format& f = format_of<FullBits>(L, it.kind);
    if constexpr (W == 8) {
      if constexpr (FullBits != 0) {
        if (it.kind == 4) return copy_record<staged_record<D, FullBits>.head_bytes()>(dst, it.base, lane_id);
      }
      copy_record<staged_record<D, Bits>.head_bytes()>(dst, it.base, lane_id);
    } else if constexpr (W < 8) {
      // A whole W-token record (decode_layout::record_entries), into the first W tokens of the
      // staged layout. Such records are 4-byte aligned only (580 bytes a head at head_dim 128 and
      // W = 1): key codes, key scales and zeros and value codes in 4-byte pieces, the value scales
      // and zeros (2 bytes a token) one by one. Tokens W..7 get scale and zero 0, so that their
      // zero probability meets no stale value; their stale codes are finite integers.
      const int codes = W * D * f.bits / 32;  // 4-byte pieces of the W tokens' codes
      constexpr int meta = 2 * D * 2 / 4;     // key scales and zeros, bf16
      for (int q = lane_id; q < 2 * codes + meta; q += 32) {
        std::size_t src, to;
        if (q < codes) src = to = 4 * static_cast<std::size_t>(q);
        else if (q < codes + meta) src = f.key_scale + 4 * (q - codes), to = f.staged_key_scale + 4 * (q - codes);
        else src = f.value_codes + 4 * (q - codes - meta), to = f.staged_value_codes + 4 * (q - codes - meta);
        warp::cp_async4(dst + to, it.base + src);
      }
      if (lane_id < 16) {
        const int j = lane_id & 7;
        const bool zero = lane_id >= 8;
        const std::uint16_t x = j < W ? *reinterpret_cast<const std::uint16_t*>(it.base + (zero ? f.value_zero : f.value_scale) + 2 * j) : 0;
        *reinterpret_cast<std::uint16_t*>(dst + (zero ? f.staged_value_zero : f.staged_value_scale) + 2 * j) = x;
      }
    } else {
      // Part `it.part` of a W-token record, into the staged 8-token layout: its key codes, the
      // window's key scales and zeros, its value codes, its 8 value scales and 8 value zeros.
      const int codes = D * f.bits / 16;  // 16-byte pieces of 8 tokens' codes
      constexpr int meta = 2 * D * 2 / 16;
      for (int q = lane_id; q < 2 * codes + meta + 2; q += 32) {
        std::size_t src;
        if (q < codes) src = static_cast<std::size_t>(it.part) * codes * 16 + 16 * q;
        else if (q < codes + meta) src = f.key_scale + 16 * (q - codes);
        else if (q < 2 * codes + meta) src = f.value_codes + static_cast<std::size_t>(it.part) * codes * 16 + 16 * (q - codes - meta);
        else if (q == 2 * codes + meta) src = f.value_scale + 16 * it.part;
        else src = f.value_zero + 16 * it.part;
        warp::cp_async16(dst + 16 * q, it.base + src, 16);
      }
    }
  } else {
    // Lane l copies 16-byte column l % per_row of token rows r = l / per_row + k * (32 / per_row)
    // (k < passes): the key row r and the value row 8 + r, whose sources differ by one section.
    // Row r0 + k * rows_per_pass is row r0 plus k * rows_per_pass rows, its chunks flipped by
    // k * rows_per_pass (token_row_chunk, chunk_step; r0 < rows_per_pass).
    constexpr int per_row = D * 2 / 16, rows_per_pass = 32 / per_row, passes = 8 / rows_per_pass;
    const int col = lane_id % per_row;
    const std::uint32_t at = warp::shared_address(dst) + token_row_chunk<D>(lane_id / per_row, col);
    const bool rows_kind = it.kind == 1 || (W < 8 && it.kind == 3);  // kind 3 only exists for W < 8
    const std::size_t section = W < 8 && it.kind == 3 ? static_cast<std::size_t>(W) * D * 2 : static_cast<std::size_t>(it.capacity) * D * 2;
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      const int r = lane_id / per_row + k * rows_per_pass;
      const bool ok = rows_kind && r < it.valid;
      const std::uint8_t* key = region;
      if (ok) {
        if (W < 8 && it.kind == 3) {
          key = region + rows[r] + col * 16;
        } else {
          int slot = it.first_slot + r;
          if (slot >= it.capacity) slot -= it.capacity;
          key = it.base + static_cast<unsigned>(slot * (D * 2) + col * 16);
        }
      }
      const std::uint32_t to = chunk_step(at, k * rows_per_pass) + k * rows_per_pass * (2 * D);
      warp::cp_async16(to, key, ok ? 16 : 0);
      warp::cp_async16(to + 8 * (2 * D), ok ? key + section : key, ok ? 16 : 0);
    }
  }
}

/// 32-bit code words of one token: D channels of Bits each.
template <int D, int Bits>
constexpr int code_words = D * Bits / 32;

/// One token's code words from shared memory (16-byte loads): word i holds channels
/// (32/Bits)·i onwards, Bits bits each, lowest channel in the lowest bits (the host's put_code).
template <int D, int Bits = 2>
__device__ __forceinline__ void load_code_words(const std::uint8_t* token_codes, std::uint32_t (&w)[code_words<D, Bits>]) {
  const uint4* p = reinterpret_cast<const uint4*>(token_codes);
#pragma unroll
  for (int i = 0; i < code_words<D, Bits> / 4; ++i) {
    const uint4 u = p[i];
    w[4 * i] = u.x;
    w[4 * i + 1] = u.y;
    w[4 * i + 2] = u.z;
    w[4 * i + 3] = u.w;
  }
}

/// The code words score_codes keeps of a token: all of them for 2- and 4-bit codes (8 or 16 at
/// head_dim 128), none for 8-bit codes (32), whose thread_codes reads its two words of a chunk
/// from shared memory instead of holding a whole row in registers.
template <int D, int Bits>
constexpr int held_code_words = Bits == 8 ? 1 : code_words<D, Bits>;

/// The codes of the thread's channels 16s + {2t, 2t+1, 2t+8, 2t+9}: from a token's code words
/// (cw, load_code_words) or, for 8-bit codes, from its codes in shared memory (token_codes).
template <int D, int Bits>
__device__ __forceinline__ void thread_codes(const std::uint8_t* token_codes, const std::uint32_t (&cw)[held_code_words<D, Bits>],
                                             int s, int t, std::uint32_t (&k)[4]) {
  if constexpr (Bits == 8) {  // words 4s..4s+3, a channel a byte: channels 2t, 2t+1 in word 4s + t/2
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(token_codes) + 4 * s + (t >> 1);
    const std::uint32_t a = w[0] >> (16 * (t & 1)), b = w[2] >> (16 * (t & 1));
    k[0] = a & 255u;
    k[1] = (a >> 8) & 255u;
    k[2] = b & 255u;
    k[3] = (b >> 8) & 255u;
  } else if constexpr (Bits == 2) {  // word s: channels 16s..16s+15
    const std::uint32_t w = cw[s] >> (4 * t);
    k[0] = w & 3u;
    k[1] = (w >> 2) & 3u;
    k[2] = (w >> 16) & 3u;
    k[3] = (w >> 18) & 3u;
  } else {  // words 2s and 2s+1: channels 16s..16s+7 and 16s+8..16s+15
    const std::uint32_t a = cw[2 * s] >> (8 * t), b = cw[2 * s + 1] >> (8 * t);
    k[0] = a & 15u;
    k[1] = (a >> 4) & 15u;
    k[2] = b & 15u;
    k[3] = (b >> 4) & 15u;
  }
}

/// score_item for a record of `Bits`-bit codes in format f: codes of token g, per-channel scale
/// and zero; dequantize in fp32, rotate to position t0 + g (keys stored before RoPE), split into
/// high and low parts.
template <int D, bool Bf16, int Bits, bool Rotate>
__device__ __forceinline__ void score_codes(rope_layout layout, const record_format& f, const std::uint8_t* s_item, int g,
                                            int t, const float2* cs_j, const float2* cs_t0,
                                            const std::uint32_t (&qa)[D / 16][4], float (&c)[4]) {
  const std::uint8_t* token_codes = s_item + g * (D * Bits / 8);
  std::uint32_t cw[held_code_words<D, Bits>];
  if constexpr (Bits != 8) load_code_words<D, Bits>(token_codes, cw);
  const std::uint8_t* ks = s_item + f.staged_key_scale;
  const std::uint8_t* kz = s_item + f.staged_key_zero;
  float x[D / 16][4];
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    std::uint32_t code[4];
    thread_codes<D, Bits>(token_codes, cw, s, t, code);
    const std::uint32_t sc0 = *reinterpret_cast<const std::uint32_t*>(ks + 32 * s + 4 * t);
    const std::uint32_t sc1 = *reinterpret_cast<const std::uint32_t*>(ks + 32 * s + 16 + 4 * t);
    const std::uint32_t ze0 = *reinterpret_cast<const std::uint32_t*>(kz + 32 * s + 4 * t);
    const std::uint32_t ze1 = *reinterpret_cast<const std::uint32_t*>(kz + 32 * s + 16 + 4 * t);
    const float k0 = warp::code_as_float(code[0]), k1 = warp::code_as_float(code[1]);
    const float k8 = warp::code_as_float(code[2]), k9 = warp::code_as_float(code[3]);
    x[s][0] = fmaf(__uint_as_float(sc0 << 16), k0, __uint_as_float(ze0 << 16));
    x[s][1] = fmaf(__uint_as_float(sc0 & 0xffff0000u), k1, __uint_as_float(ze0 & 0xffff0000u));
    x[s][2] = fmaf(__uint_as_float(sc1 << 16), k8, __uint_as_float(ze1 << 16));
    x[s][3] = fmaf(__uint_as_float(sc1 & 0xffff0000u), k9, __uint_as_float(ze1 & 0xffff0000u));
  }
  // e^{i (t0 + g) f_p} = e^{i t0 f_p} e^{i g f_p}; the second factor from the launch's table (L1).
  const float2* row = cs_j + g * (D / 2);
  auto rot = [&](float& a, float& b, int p) {
    const float2 u = cs_t0[p], v = row[p];  // not the read-only path: with own_query, written in this grid
    const float cr = u.x * v.x - u.y * v.y, ci = u.y * v.x + u.x * v.y;
    const float a0 = a, b0 = b;
    a = a0 * cr - b0 * ci;
    b = a0 * ci + b0 * cr;
  };
  if constexpr (Rotate) {
    if (layout == rope_layout::interleaved) {
#pragma unroll
      for (int s = 0; s < D / 16; ++s) {
        rot(x[s][0], x[s][1], 8 * s + t);
        rot(x[s][2], x[s][3], 8 * s + t + 4);
      }
    } else {
#pragma unroll
      for (int s = 0; s < D / 32; ++s) {
#pragma unroll
        for (int e = 0; e < 4; ++e) rot(x[s][e], x[s + D / 32][e], 16 * s + 2 * t + (e & 1) + 8 * (e >> 1));
      }
    }
  }
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    std::uint32_t h0, l0, h1, l1;
    warp::split_16<Bf16>(x[s][0], x[s][1], h0, l0);
    warp::split_16<Bf16>(x[s][2], x[s][3], h1, l1);
    warp::mma_16<Bf16>(c, qa[s][0], qa[s][1], qa[s][2], qa[s][3], h0, h1);
    warp::mma_16<Bf16>(c, qa[s][0], 0u, qa[s][2], 0u, l0, l1);
  }
}

/// Scores of one item for the thread: c[0], c[1] = head g's scores of tokens 2t, 2t+1 against the
/// query's high part, c[2], c[3] against its low part (their sum is the score).
/// The contraction index is the channel: chunk s holds channels 16s..16s+15 in mma order, so the
/// thread owns channels 16s + {2t, 2t+1, 2t+8, 2t+9}; both members of every rotary pair (c and
/// c + D/2, or 2m and 2m+1) then lie in one thread. A record's keys (codes of Bits in the ledger,
/// of FullBits in a quantized top tier's Full slots) are rotated to their positions when Rotate
/// (keys stored before RoPE) and used as they are otherwise.
template <int D, bool Bf16, int Bits, int FullBits, bool Rotate>
__device__ __forceinline__ void score_item(const decode_layout& L, int kind, const std::uint8_t* s_item,
                                           int g, int t, int lane_id, const float2* cs_j, const float2* cs_t0,
                                           const std::uint32_t (&qa)[D / 16][4], float (&c)[4]) {
  c[0] = c[1] = c[2] = c[3] = 0.f;
  if (!is_record<FullBits>(kind)) {
    // Keys as B fragments straight from shared memory: matrices (tokens 0-7) x (8 channels); lane
    // l points at token l % 8, chunk 2s + l / 8. Two accumulators, so that consecutive products
    // do not wait for each other.
    const std::uint32_t at = warp::shared_address(s_item) + token_row_chunk<D>(lane_id & 7, lane_id >> 3);
    float odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < D / 16; s += 2) {
      std::uint32_t b0, b1, b2, b3;
      warp::ldmatrix_x4(chunk_step(at, 2 * s), b0, b1, b2, b3);
      warp::mma_16<Bf16>(c, qa[s][0], qa[s][1], qa[s][2], qa[s][3], b0, b1);
      warp::mma_16<Bf16>(odd, qa[s + 1][0], qa[s + 1][1], qa[s + 1][2], qa[s + 1][3], b2, b3);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] += odd[e];
    return;
  }
  if constexpr (FullBits != 0) {
    if (kind == 4) return score_codes<D, Bf16, FullBits, Rotate>(L.layout, L.full_format, s_item, g, t, cs_j, cs_t0, qa, c);
  }
  score_codes<D, Bf16, Bits, Rotate>(L.layout, L.ledger_format, s_item, g, t, cs_j, cs_t0, qa, c);
}

/// Key metadata of a record whose keys are stored after RoPE, rearranged once per window for
/// score_record: for chunk s and thread column t, the fp16 pairs
///   scales {4 scale of channels (16s + t, 16s + t + 8), 4 scale of (16s + t + 4, 16s + t + 12)}
///          8 bytes at 32 s + 8 t,
///   zeros  {zero of (16s + t, 16s + t + 8), zero of (16s + t + 4, 16s + t + 12)}
///          8 bytes at 2 D + 32 s + 8 t:
/// the zeros are the two registers of the zero product's B operand, as the tensor core takes them.
/// One transposing matrix load hands every lane its pairs: its rows are the record's 16-byte
/// pieces of 8 scales, then of 8 zeros, so lane (g, t) receives channels 64m + 16t + g and
/// 64m + 16t + g + 8 of scale matrix m and of zero matrix m — pair g / 4 of entry (4m + t, g % 4) —
/// and stores each as one word; the 32 words of one store fill 128 contiguous bytes.
/// Both are exact in fp16: a bf16 value has 8 significant bits (fp16 has 11), for magnitudes in
/// fp16's range (scale <= 16376, |zero| <= 65504; below 2^-17 they round by under 2^-25).
/// zero_word(m, g, t) is where lane (g, t) puts its zero pair of matrix m (stage_key_meta_pair
/// places them elsewhere).
template <int D, int MetaOffset, class ZeroWord>
__device__ __forceinline__ void stage_key_meta_with(std::uint8_t* s_item, int lane_id, ZeroWord zero_word) {
  constexpr auto record = staged_record<D, 2>;
  static_assert(record.key_zero_offset() == record.key_scale_offset() + 2 * D,
                "stage_key_meta: the key zeros follow the key scales");
  constexpr int M = D / 64;  // 8x8 matrices of scales (and as many of zeros)
  std::uint32_t r[2 * M];
  // Lane i addresses piece i of the scales and zeros (D/4 pieces; with M = 1 lanes 16-31 are unused).
  warp::ldmatrix_trans<2 * M>(s_item + record.key_scale_offset() + 16 * (lane_id % (D / 4)), r);
  const int g = lane_id >> 2, t = lane_id & 3;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    // 4 scale: 2 added to both bf16 exponents, one integer addition for the pair (a scale of 0
    // becomes 2^-125, still 0 in fp16; scales of 2^126 and above, far outside fp16's range, would
    // carry into the sign).
    const std::uint32_t scale = r[m] + 0x01000100u, zero = r[M + m];
    std::uint32_t* at = reinterpret_cast<std::uint32_t*>(s_item + MetaOffset + 32 * (4 * m + t) + 8 * (g & 3) + 4 * (g >> 2));
    at[0] = warp::pack_half2(__uint_as_float(scale << 16), __uint_as_float(scale & 0xffff0000u));
    *zero_word(m, g, t) = warp::pack_half2(__uint_as_float(zero << 16), __uint_as_float(zero & 0xffff0000u));
  }
}

template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ void stage_key_meta(std::uint8_t* s_item, int lane_id) {
  stage_key_meta_with<D, MetaOffset>(s_item, lane_id, [=](int m, int g, int t) {
    return reinterpret_cast<std::uint32_t*>(s_item + MetaOffset + 2 * D + 32 * (4 * m + t) + 8 * (g & 3) + 4 * (g >> 2));
  });
}

/// Entry (s, t) of stage_key_meta_pair's zeros: 16 bytes at 64 (s mod D/32) + 16 t of item a's
/// zero area for s < D/32, of item b's for the others (together 4 D bytes, the two areas'). The
/// one place of that layout, for the stores and for paired_zeros' loads.
template <int D, int MetaOffset = key_extra_offset<D>, class Byte>
__device__ __forceinline__ Byte* paired_zero_entry(Byte* s_a, Byte* s_b, int s, int t) {
  return (s < D / 32 ? s_a : s_b) + MetaOffset + 2 * D + 64 * (s % (D / 32)) + 16 * t;
}

/// stage_key_meta for both records of a pair in the transposed product, whose zero product takes
/// the zeros of both as its A operand: the scales as stage_key_meta places them, the zeros of
/// chunk s and thread column t as one 16-byte entry {zero pair (t, t + 8) of item a, of item b,
/// pair (t + 4, t + 12) of item a, of item b} (A registers 0-3) at paired_zero_entry(s, t).
template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ void stage_key_meta_pair(std::uint8_t* s_a, std::uint8_t* s_b, int lane_id) {
  auto zero_words = [=](int item) {
    return [=](int m, int g, int t) {  // pair g / 4 of entry (4m + t, g % 4)
      return reinterpret_cast<std::uint32_t*>(paired_zero_entry<D, MetaOffset>(s_a, s_b, 4 * m + t, g & 3) + 8 * (g >> 2) + 4 * item);
    };
  };
  stage_key_meta_with<D, MetaOffset>(s_a, lane_id, zero_words(0));
  stage_key_meta_with<D, MetaOffset>(s_b, lane_id, zero_words(1));
}

/// Where stage_key_meta_pair put the zero product's A registers of chunk s for thread column t.
template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ uint4 paired_zeros(const std::uint8_t* s_a, const std::uint8_t* s_b, int s, int t) {
  return *reinterpret_cast<const uint4*>(paired_zero_entry<D, MetaOffset>(s_a, s_b, s, t));
}

/// Scores of a quantized item whose keys are stored after RoPE: c[0], c[1] = head g's scores of
/// tokens 2t, 2t+1 against the query's high part, c[2], c[3] against its low part.
/// In chunk s the contraction order is k = 2t, 2t+1 <-> channels 16s+t, 16s+t+8 and k = 2t+8, 2t+9
/// <-> channels 16s+t+4, 16s+t+12 (qf holds the query in that order): shifted right by 2t, token
/// g's code word has those channels at bits 0, 16, 8 and 24. A key is zero + scale * code, and
/// both products go through the tensor cores exactly: scale * code as one fp16 FMA of the code
/// placed in the mantissa of 1.0, (1 + code/4) * 4 scale - 4 scale (10 significant bits at most),
/// and the zero as a second product whose B columns all hold the zeros.
template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ void score_record(const std::uint8_t* s_item, int g, int t,
                                             const std::uint32_t (&qf)[D / 16][4], float (&c)[4]) {
  c[0] = c[1] = c[2] = c[3] = 0.f;
  std::uint32_t cw[D / 16];
  load_code_words<D>(s_item + g * (D / 4), cw);
  const uint2* scales = reinterpret_cast<const uint2*>(s_item + MetaOffset) + t;
  const uint2* zeros = reinterpret_cast<const uint2*>(s_item + MetaOffset + 2 * D) + t;
  // Two independent accumulators (even and odd chunks), each taking a chunk's code product and
  // then its zero product: with the two items of a pair interleaved, four chains hide the
  // tensor cores' latency, and the sum at the end is one addition per score.
  float acc[2][4] = {};
  const std::uint32_t one = 0x3C003C00u;  // 1.0 in both halves
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const uint2 sc = scales[4 * s], ze = zeros[4 * s];
    const std::uint32_t x = cw[s] >> (2 * t);
    const std::uint32_t k0 = warp::and_or<0x03000300u>(x << 8, one);  // 1 + code/4: channels t, t + 8
    const std::uint32_t k1 = warp::and_or<0x03000300u>(x, one);       // channels t + 4, t + 12
    warp::mma_f16(acc[s & 1], qf[s][0], qf[s][1], qf[s][2], qf[s][3], warp::fma_half2_minus(k0, sc.x),
                  warp::fma_half2_minus(k1, sc.y));
    warp::mma_f16(acc[s & 1], qf[s][0], qf[s][1], qf[s][2], qf[s][3], ze.x, ze.y);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] = acc[0][e] + acc[1][e];
}

/// score_record for both items of a pair of records whose keys are used as stored (the same
/// query): scores of head g, tokens 2t and 2t+1, into sa (item a) and sb (item b). The zero points
/// of both items go through one tensor-core product per chunk instead of one per item: its B
/// column n holds item a's zeros for even n and item b's for odd n, so that every lane receives
/// Z_a = q . zero_a in its even column and Z_b in its odd one, as the scores of its tokens need
/// them. The products are those of score_record; only the order of the additions differs.
template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ void score_record_pair(const std::uint8_t* s_a, const std::uint8_t* s_b, int g, int t,
                                                  const std::uint32_t (&qf)[D / 16][4], float (&sa)[2], float (&sb)[2]) {
  std::uint32_t cwa[D / 16], cwb[D / 16];
  load_code_words<D>(s_a + g * (D / 4), cwa);
  load_code_words<D>(s_b + g * (D / 4), cwb);
  // Entry (s, t) of stage_key_meta: scale pairs at 32 s + 8 t, zero pairs 2 D bytes further.
  const std::uint8_t* ma = s_a + MetaOffset + 8 * t;
  const std::uint8_t* mb = s_b + MetaOffset + 8 * t;
  const std::uint8_t* mz = ((g & 1) ? mb : ma) + 2 * D;  // column g of the zero product: item b's where g is odd
  // Two accumulators per item (even and odd chunks) and two for the zero product, so that no
  // chain of dependent tensor-core products is longer than D/32.
  float acc_a[2][4] = {}, acc_b[2][4] = {}, acc_z[2][4] = {};
  const std::uint32_t one = 0x3C003C00u;  // 1.0 in both halves
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const uint2 fa = *reinterpret_cast<const uint2*>(ma + 32 * s), fb = *reinterpret_cast<const uint2*>(mb + 32 * s);
    const uint2 z = *reinterpret_cast<const uint2*>(mz + 32 * s);
    const std::uint32_t xa = cwa[s] >> (2 * t), xb = cwb[s] >> (2 * t);
    warp::mma_f16(acc_z[s & 1], qf[s][0], qf[s][1], qf[s][2], qf[s][3], z.x, z.y);
    warp::mma_f16(acc_a[s & 1], qf[s][0], qf[s][1], qf[s][2], qf[s][3],
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xa << 8, one), fa.x),
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xa, one), fa.y));
    warp::mma_f16(acc_b[s & 1], qf[s][0], qf[s][1], qf[s][2], qf[s][3],
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xb << 8, one), fb.x),
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xb, one), fb.y));
  }
  // Rows 0-7 hold the query's high part, rows 8-15 its low part (c[0], c[1] and c[2], c[3]).
  const float za = (acc_z[0][0] + acc_z[1][0]) + (acc_z[0][2] + acc_z[1][2]);
  const float zb = (acc_z[0][1] + acc_z[1][1]) + (acc_z[0][3] + acc_z[1][3]);
  sa[0] = ((acc_a[0][0] + acc_a[1][0]) + (acc_a[0][2] + acc_a[1][2])) + za;
  sa[1] = ((acc_a[0][1] + acc_a[1][1]) + (acc_a[0][3] + acc_a[1][3])) + za;
  sb[0] = ((acc_b[0][0] + acc_b[1][0]) + (acc_b[0][2] + acc_b[1][2])) + zb;
  sb[1] = ((acc_b[0][1] + acc_b[1][1]) + (acc_b[0][3] + acc_b[1][3])) + zb;
}

/// Scores of a pair of records whose keys are used as stored, transposed (transposes_records):
/// the records are the A operand, rows g and g + 8 token g of items a and b, and the query the B
/// operand, qc from record_query::fp16_columns (column 2h: head h's high fp16 part, 2h + 1 its low
/// part). Lane (g, t) receives the high and low products of head t with token g of each item
/// (C columns 2t and 2t + 1) and sums them: sa, sb. The A operand's lane holds the same channels
/// as score_record's B operand (k = 2t, 2t+1 <-> channels t, t + 8; k = 2t+8, 2t+9 <-> t + 4,
/// t + 12), so the code words, the staged key scales and the exact fp16 keys are score_record's;
/// the zero product's A rows hold each item's zeros (stage_key_meta_pair), and it adds them to
/// the same scores.
template <int D, int MetaOffset = key_extra_offset<D>>
__device__ __forceinline__ void score_record_pair_transposed(const std::uint8_t* s_a, const std::uint8_t* s_b, int g, int t,
                                                             const std::uint32_t (&qc)[D / 16][4], float& sa, float& sb) {
  std::uint32_t cwa[D / 16], cwb[D / 16];
  load_code_words<D>(s_a + g * (D / 4), cwa);
  load_code_words<D>(s_b + g * (D / 4), cwb);
  // Entry (s, t) of stage_key_meta: scale pairs at 32 s + 8 t.
  const std::uint8_t* ma = s_a + MetaOffset + 8 * t;
  const std::uint8_t* mb = s_b + MetaOffset + 8 * t;
  // Even and odd chunks in accumulators of their own, codes and zeros apart: four chains of D/32
  // dependent products.
  float acc[2][4] = {}, acc_z[2][4] = {};
  const std::uint32_t one = 0x3C003C00u;  // 1.0 in both halves
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const uint2 fa = *reinterpret_cast<const uint2*>(ma + 32 * s), fb = *reinterpret_cast<const uint2*>(mb + 32 * s);
    const uint4 z = paired_zeros<D, MetaOffset>(s_a, s_b, s, t);
    const std::uint32_t xa = cwa[s] >> (2 * t), xb = cwb[s] >> (2 * t);
    warp::mma_f16(acc_z[s & 1], z.x, z.y, z.z, z.w, qc[s][0], qc[s][1]);
    warp::mma_f16(acc[s & 1], warp::fma_half2_minus(warp::and_or<0x03000300u>(xa << 8, one), fa.x),
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xb << 8, one), fb.x),
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xa, one), fa.y),
                  warp::fma_half2_minus(warp::and_or<0x03000300u>(xb, one), fb.y), qc[s][0], qc[s][1]);
  }
  sa = ((acc[0][0] + acc[1][0]) + (acc[0][1] + acc[1][1])) + ((acc_z[0][0] + acc_z[1][0]) + (acc_z[0][1] + acc_z[1][1]));
  sb = ((acc[0][2] + acc[1][2]) + (acc[0][3] + acc[1][3])) + ((acc_z[0][2] + acc_z[1][2]) + (acc_z[0][3] + acc_z[1][3]));
}

/// The query rotated back by a window's start, R(t0)^T q, as score_record's fp16 high/low A
/// fragments. qr holds the thread's query channels in score_record's order (qr[s] = channels
/// 16s + t, 16s + t + 8, 16s + t + 4, 16s + t + 12), cs = e^{i t0 f_p}. With rotate_half pairs
/// (p, p + D/2) both members lie in the thread (chunks s and s + D/32); with interleaved pairs
/// (2m, 2m + 1) the partner is in the neighbouring thread (t ^ 1).
template <int D>
__device__ __forceinline__ void query_for_window(const float (&qr)[D / 16][4], const float2* cs, rope_layout layout, int t,
                                                 std::uint32_t (&qf)[D / 16][4]) {
  constexpr int offset[4] = {0, 8, 4, 12};
  float x[D / 16][4];
  if (layout == rope_layout::rotate_half) {
#pragma unroll
    for (int s = 0; s < D / 32; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 r = cs[16 * s + t + offset[e]];
        const float a = qr[s][e], b = qr[s + D / 32][e];
        x[s][e] = a * r.x + b * r.y;
        x[s + D / 32][e] = b * r.x - a * r.y;
      }
  } else {
    const float sign = (t & 1) ? -1.0f : 1.0f;  // the first member of a pair gains, the second loses
#pragma unroll
    for (int s = 0; s < D / 16; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 r = cs[(16 * s + t + offset[e]) >> 1];
        const float partner = __shfl_xor_sync(0xffffffffu, qr[s][e], 1);
        x[s][e] = qr[s][e] * r.x + sign * partner * r.y;
      }
  }
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    warp::split_16<false>(x[s][0], x[s][1], qf[s][0], qf[s][1]);
    warp::split_16<false>(x[s][2], x[s][3], qf[s][2], qf[s][3]);
  }
}

/// Window-relative records of a group of at most 4 heads, two at a time: rows 0-3 of the query
/// fragments are rotated back by item a's window start and rows 4-7 (the same heads:
/// query_fragments) by item b's, so that one rotation serves both records and score_record_pair's
/// rows 0-3 score item a, rows 4-7 item b (its zero product gives each row the zeros of its own
/// item: even columns item a's, odd ones item b's). Lanes g and g + 4 (lane ids 16 apart) then
/// swap the scores the other one holds, so that every lane has both items' scores of head g % 4,
/// as score_record_pair gives them for records used as stored (rows 4-7 repeat rows 0-3, as
/// every row past the group holds values that the output and the masses never read).
template <int D, int Meta>
__device__ __forceinline__ void score_relative_pair(const float (&qr)[D / 16][4], const float2* cs_a, const float2* cs_b,
                                                    rope_layout layout, const std::uint8_t* s_a, const std::uint8_t* s_b,
                                                    int g, int t, std::uint32_t (&qf)[D / 16][4], float (&sa)[2],
                                                    float (&sb)[2]) {
  const bool rows_a = g < 4;
  query_for_window<D>(qr, rows_a ? cs_a : cs_b, layout, t, qf);
  score_record_pair<D, Meta>(s_a, s_b, g, t, qf, sa, sb);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float other = __shfl_xor_sync(0xffffffffu, rows_a ? sa[e] : sb[e], 16);
    if (rows_a) sb[e] = other;
    else sa[e] = other;
  }
}

/// Value code field Field (0 .. 16/Bits - 1) of each register of r into the A fragments of its
/// tile and row half (see record_value_fragments), for Field and every later field.
template <bool Bf16, int Bits, int D, int Pieces, bool Biased = false, int Field = 0>
__device__ __forceinline__ void value_code_fields(const std::uint32_t (&r)[Pieces], int h, std::uint32_t (&a)[D / 16][4]) {
  if constexpr (Field < 16 / Bits) {
    constexpr int tiles_per_piece = 128 / Bits / 16;
#pragma unroll
    for (int p = 0; p < Pieces; ++p)
      a[p * tiles_per_piece + Field / 2][2 * h + Field % 2] = warp::value_code_field<Bf16, Bits, Field, Biased>(r[p]);
    value_code_fields<Bf16, Bits, D, Pieces, Biased, Field + 1>(r, h, a);
  }
}

/// The bias 2^E that value_code_fields<..., Biased = true> leaves in fragment i: its rows 0-7
/// (half 0) hold field 2 (i mod tiles_per_piece) of their piece's registers, rows 8-15 the next
/// field (value_code_fields).
template <bool Bf16, int Bits>
__device__ __forceinline__ float value_code_bias(int i, int half) {
  constexpr int tiles_per_piece = 128 / Bits / 16;
  return static_cast<float>(1 << warp::value_code_exponent<Bf16, Bits>(2 * (i % tiles_per_piece) + half));
}

/// 16-byte pieces of one token's value codes (128/Bits channels each).
template <int D, int Bits>
constexpr int value_pieces = D * Bits / 128;

/// The transposing matrix loads of record_value_fragments alone (one per piece), so that a loop
/// can issue them well before it takes the fields apart.
template <int D, int Bits>
__device__ __forceinline__ void load_value_codes(const record_format& f, const std::uint8_t* s_item, int lane_id,
                                                 std::uint32_t (&r)[value_pieces<D, Bits>]) {
  constexpr int pieces = value_pieces<D, Bits>;
  static_assert(pieces == 1 || pieces == 2 || pieces == 4 || pieces == 8, "load_value_codes: 1, 2, 4 or 8 pieces of 16 bytes a token");
  constexpr int per_load = pieces < 4 ? pieces : 4;  // a matrix load takes at most 4 matrices
  // In load q, lane l addresses token l % 8 of piece per_load q + (l / 8) % per_load.
  const std::uint8_t* row = s_item + f.staged_value_codes + (lane_id & 7) * (D * Bits / 8);
#pragma unroll
  for (int q = 0; q < pieces / per_load; ++q)
    warp::ldmatrix_trans<per_load>(row + (per_load * q + (lane_id >> 3) % per_load) * 16, r + per_load * q);
}

/// A fragments of V^T of a record's tokens 2t and 2t+1 (codes of Bits in format f) into
/// a[i][2h], a[i][2h+1]: channels 16i + g and 16i + g + 8, as exact integers.
/// A token's value codes are 16-byte pieces of N = 128/Bits channels whose 16-bit element e holds
/// channels e, e + 8, e + 16, ... of the piece (record_layout::value_slot). One transposing matrix
/// load per piece, rows = the item's 8 tokens, hands lane (g, t) element g of tokens 2t and 2t+1 in
/// the low and high half of one register: field k of it is channel 8k + g of the piece, i.e. tile
/// N/16 * piece + k/2, row g (k even) or g + 8 (k odd) — no shuffling of codes between lanes or
/// within a register, one shift per few fields and one LOP3 and one subtraction per fragment.
template <int D, bool Bf16, int Bits>
__device__ __forceinline__ void record_value_fragments(const record_format& f, const std::uint8_t* s_item, int lane_id, int h,
                                                       std::uint32_t (&a)[D / 16][4]) {
  std::uint32_t r[value_pieces<D, Bits>];
  load_value_codes<D, Bits>(f, s_item, lane_id, r);
  value_code_fields<Bf16, Bits, D, value_pieces<D, Bits>>(r, h, a);
}

/// A fragments of V^T for an item pair: a[i][0] = (channel 16i + g, tokens 2t, 2t+1 of item a),
/// a[i][1] = (channel 16i + g + 8, same tokens), a[i][2], a[i][3] the same of item b. The four
/// registers of a[i] are one tensor-core operand; loading them together (one ldmatrix.x4 over both
/// items when both hold token rows) spares the register moves that assembling it would take.
template <int D, bool Bf16, int Bits, int FullBits>
__device__ __forceinline__ void value_fragments(const decode_layout& L, int kind_a, const std::uint8_t* s_a, int kind_b,
                                                const std::uint8_t* s_b, int g, int t, int lane_id,
                                                std::uint32_t (&a)[D / 16][4]) {
  // Lane l points at value row 8 + l % 8, chunk 2i + (l / 8) % 2 (of item b for l >= 16 when
  // both items are token rows).
  const int lane_chunk = token_row_chunk<D>(8 + (lane_id & 7), (lane_id >> 3) & 1);
  if (!is_record<FullBits>(kind_a) && !is_record<FullBits>(kind_b)) {
    const std::uint32_t at = warp::shared_address((lane_id & 16) ? s_b : s_a) + lane_chunk;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) warp::ldmatrix_trans<4>(chunk_step(at, 2 * i), a[i]);
    return;
  }
  auto one = [&](int kind, const std::uint8_t* s_item, int h) {
    if (!is_record<FullBits>(kind)) {
      const std::uint32_t at = warp::shared_address(s_item) + lane_chunk;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) warp::ldmatrix_trans<2>(chunk_step(at, 2 * i), a[i] + 2 * h);
      return;
    }
    if constexpr (FullBits != 0) {
      if (kind == 4) return record_value_fragments<D, Bf16, FullBits>(L.full_format, s_item, lane_id, h, a);
    }
    record_value_fragments<D, Bf16, Bits>(L.ledger_format, s_item, lane_id, h, a);
  };
  if (kind_a == 2 && kind_b == 2) {  // branch-free, so that the two items interleave
    one(2, s_a, 0);
    one(2, s_b, 1);
  } else {
    one(kind_a, s_a, 0);
    one(kind_b, s_b, 1);
  }
}

/// Value scale and zero of tokens (2t, 2t+1) of a record staged in format f.
__device__ __forceinline__ void record_value_meta(const record_format& f, const std::uint8_t* s_item, int t, float2& scale,
                                                  float2& zero) {
  const std::uint32_t s = *reinterpret_cast<const std::uint32_t*>(s_item + f.staged_value_scale + 4 * t);
  const std::uint32_t z = *reinterpret_cast<const std::uint32_t*>(s_item + f.staged_value_zero + 4 * t);
  scale = make_float2(__uint_as_float(s << 16), __uint_as_float(s & 0xffff0000u));
  zero = make_float2(__uint_as_float(z << 16), __uint_as_float(z & 0xffff0000u));
}

/// Value scale and zero of tokens (2t, 2t+1) of an item: a record's, or (1, 0) for token rows.
template <int FullBits>
__device__ __forceinline__ void value_meta(const decode_layout& L, int kind, const std::uint8_t* s_item, int t,
                                           float2& scale, float2& zero) {
  if (is_record<FullBits>(kind)) {
    record_value_meta(format_of<FullBits>(L, kind), s_item, t, scale, zero);
  } else {
    scale = make_float2(1.0f, 1.0f);
    zero = make_float2(0.0f, 0.0f);
  }
}

/// Value scale and zero of token g of a ledger record (the transposed record loop's lane holds one
/// token of each item).
__device__ __forceinline__ void value_meta_of_token(const record_format& f, const std::uint8_t* s_item, int g, float& scale,
                                                    float& zero) {
  scale = __uint_as_float(static_cast<std::uint32_t>(reinterpret_cast<const std::uint16_t*>(s_item + f.staged_value_scale)[g]) << 16);
  zero = __uint_as_float(static_cast<std::uint32_t>(reinterpret_cast<const std::uint16_t*>(s_item + f.staged_value_zero)[g]) << 16);
}

/// What the second half of a lane's query fragments holds for the records of a kernel: nothing
/// (their keys are dequantized in fp32 and go through the first half), the query in fp16 high
/// and low parts in score_record's channel order, that query in fp32 (rotated per window), or the
/// fp16 parts as the B columns of the transposed record product (transposes_records).
enum class record_query : int { none = 0, fp16_parts = 1, fp32 = 2, fp16_columns = 3 };

/// The record query of a kernel for `Records` and ledger codes of `Bits`. Ledger records whose keys
/// are not rotated per key take the exact fp16 path (score_record) when their codes have 2 bits;
/// 4-bit codes (5 significant bits in 1 + code/16, 13 in the product with a bf16 scale) would not
/// be exact in fp16 and take score_item's fp32 path, as do the records of a quantized top tier.
template <record_rotation Records, int Bits>
inline constexpr record_query record_query_of = Records == record_rotation::each_key || Bits != 2 ? record_query::none
                                                : Records == record_rotation::query_per_window   ? record_query::fp32
                                                                                                 : record_query::fp16_parts;

/// Whether the records' loop of a kernel takes the transposed product (score_record_pair_transposed):
/// pairs of 8-token ledger records of 2-bit codes whose keys are used as stored, in a kernel that
/// folds the low part (a group of at most 4 heads, bf16). The pair's 16 tokens are the rows of
/// the tensor cores' A operand and the group's 4 heads, high and low query parts, the 8 columns of
/// B: a k-step's codes of both records go through one product instead of two, each lane holds one
/// head's scores of one token of each record instead of four scores of which the group repeats half,
/// and the query takes 2 registers a k-step instead of 4. Its softmax state has its own layout
/// (lane (g, t) holds head t), which the kernel converts to once at the loop's start.
template <record_rotation Records, int W, int Bits, int FullBits, bool FoldLow>
inline constexpr bool transposes_records = FoldLow && Records == record_rotation::none && W == 8 && Bits == 2 && FullBits == 0;

/// The record query of a kernel (its prepare_query and the decode kernel agree through this).
template <record_rotation Records, int W, int Bits, int FullBits, bool FoldLow>
inline constexpr record_query kernel_record_query =
    transposes_records<Records, W, Bits, FullBits, FoldLow> ? record_query::fp16_columns : record_query_of<Records, Bits>;

/// Lane (g, t)'s query fragments for chunk s of one KV head's group (q: the group's rotated,
/// scaled queries, [G][D]; rows g >= G are zero):
///   first  = A fragment of head g in the cache's 16-bit type: rows 0-7 its high part, rows 8-15
///            its low part (channels 16s + 2t, 2t+1, 2t+8, 2t+9);
///   second = for records used as stored, the same in fp16 in score_record's channel order
///            (16s + t, t+8, t+4, t+12; 22 bits); for window-relative records those channels in
///            fp32, rotated per window by query_for_window (with at most 4 heads, rows 4-7 repeat
///            rows 0-3: paired_rotation); for the transposed record product (fp16_columns) the B
///            fragment of column g, head g / 2's high part (g even) or low part (g odd), in the
///            same channel order, in .x and .y.
template <int D, bool Bf16, record_query RecordQuery, bool EachKey>
__device__ __forceinline__ void query_fragments(const float* q, int G, int g, int t, int s, uint4& first, uint4& second) {
  // Head `head`'s channels 16s + c (0 for rows past the group).
  auto channels_of = [&](int head) {
    const float* row = q + min(head, G - 1) * D + 16 * s;
    return [=](int c) { return head < G ? row[c] : 0.0f; };
  };
  // Rows 4-7 repeat rows 0-3 where the output product folds the low part into them
  // (folds_low_part), and for window-relative records of at most 4 heads (paired_rotation).
  const auto at = channels_of(folds_low_part<Bf16, EachKey>(G) ? (g & 3) : g);
  warp::split_16<Bf16>(at(2 * t), at(2 * t + 1), first.x, first.y);
  warp::split_16<Bf16>(at(2 * t + 8), at(2 * t + 9), first.z, first.w);
  second = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (RecordQuery == record_query::fp16_parts) {
    warp::split_16<false>(at(t), at(t + 8), second.x, second.y);
    warp::split_16<false>(at(t + 4), at(t + 12), second.z, second.w);
  } else if constexpr (RecordQuery == record_query::fp16_columns) {
    const auto column = channels_of(g >> 1);
    std::uint32_t hi0, lo0, hi1, lo1;
    warp::split_16<false>(column(t), column(t + 8), hi0, lo0);
    warp::split_16<false>(column(t + 4), column(t + 12), hi1, lo1);
    second.x = (g & 1) ? lo0 : hi0;
    second.y = (g & 1) ? lo1 : hi1;
  } else if constexpr (RecordQuery == record_query::fp32) {
    // A group of at most 4 heads leaves rows 4-7 free: they repeat rows 0-3, so that the decode
    // kernel can rotate them by a second window's start (paired_rotation).
    const int gr = G <= 4 ? (g & 3) : g;
    const auto at_r = channels_of(gr);
    second = make_uint4(__float_as_uint(at_r(t)), __float_as_uint(at_r(t + 8)), __float_as_uint(at_r(t + 4)), __float_as_uint(at_r(t + 12)));
  }
}

/// Threads that prepare one (sequence, KV head)'s query: a block of prepare_queries_kernel, or a CTA
/// of the decode kernel.
constexpr int prepare_threads = warps_per_cta * 32;
/// Rotary pairs of a group of 8 heads that each thread takes.
template <int D>
constexpr int query_pairs_per_thread = 8 * (D / 2) / prepare_threads;

/// What prepare_query reads from global memory besides the position, loaded first and together so
/// that a CTA waits for memory once: thread i's pairs i, i + prepare_threads, ... of the group's
/// queries (pair e: head e / (D/2), rotary pair e % (D/2)) and inverse frequency i (i < D/2).
template <int D>
struct query_inputs {
  float2 x[query_pairs_per_thread<D>];
  double inv_freq;
};

template <int D>
__device__ __forceinline__ query_inputs<D> load_query_inputs(const decode_layout& L, const decode_arguments& A, int b, int h) {
  static_assert(D / 2 <= prepare_threads, "prepare_query: one thread per rotation angle");
  const int G = L.group;
  query_inputs<D> in;
  const float* q = A.q + (static_cast<std::size_t>(b) * L.kv_heads + h) * G * D;
#pragma unroll
  for (int k = 0; k < query_pairs_per_thread<D>; ++k) {
    const int e = threadIdx.x + k * prepare_threads;
    in.x[k] = make_float2(0.f, 0.f);
    if (e < G * (D / 2)) {
      int ia, ib;
      ::qevict::rope::rotary::pair(L.layout, D, e % (D / 2), ia, ib);
      in.x[k] = make_float2(q[(e / (D / 2)) * D + ia], q[(e / (D / 2)) * D + ib]);
    }
  }
  in.inv_freq = threadIdx.x < D / 2 ? A.inv_freq[threadIdx.x] : 0.0;
  return in;
}

/// Shared memory prepare_query works in: the group's rotated queries and the D/2 rotations.
template <int D>
constexpr int query_scratch_bytes = 8 * D * sizeof(float) + (D / 2) * sizeof(float2);

/// One (sequence b, KV head h)'s query, by prepare_threads threads: the group's queries rotated to
/// `position` and scaled by log2(e)/sqrt(D), turned into every lane's fragments (query_fragments)
/// at the pair's place in A.q_fragments; with keys rotated one by one (Table), e^{i j f_p} for
/// j < 8 at its place in A.cs_table. `scratch`: query_scratch_bytes<D> of shared memory, 16-byte
/// aligned. Every thread calls it; what it writes is the block's after its next barrier.
template <int D, bool Bf16, record_query RecordQuery, bool Table>
__device__ __forceinline__ void prepare_query(const decode_layout& L, const decode_arguments& A, int b, int h,
                                              const query_inputs<D>& in, long long position, std::uint8_t* scratch) {
  const int G = L.group;
  const std::size_t bh = static_cast<std::size_t>(b) * L.kv_heads + h;
  const float scale = log2e * rsqrtf(static_cast<float>(D));
  float(*q_s)[D] = reinterpret_cast<float(*)[D]>(scratch);  // the group, rotated and scaled
  float2* cs_s = reinterpret_cast<float2*>(scratch + 8 * D * sizeof(float));
  // Every query head turns by the same D/2 angles: each is computed once (a double-precision
  // reduction and sincosf) rather than once per head.
  if (threadIdx.x < D / 2) {
    float c, s;
    thread::rope_cos_sin(position, in.inv_freq, c, s);
    cs_s[threadIdx.x] = make_float2(c, s);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < query_pairs_per_thread<D>; ++k) {
    const int e = threadIdx.x + k * prepare_threads;
    if (e < G * (D / 2)) {
      const int hg = e / (D / 2), p = e % (D / 2);
      int ia, ib;
      ::qevict::rope::rotary::pair(L.layout, D, p, ia, ib);
      const float c = cs_s[p].x, s = cs_s[p].y;
      q_s[hg][ia] = (in.x[k].x * c - in.x[k].y * s) * scale;
      q_s[hg][ib] = (in.x[k].x * s + in.x[k].y * c) * scale;
    }
  }
  __syncthreads();
  // [load j][lane]: each of the decode kernel's loads reads 512 contiguous bytes.
  uint4* out = A.q_fragments + bh * (2 * D / 16) * 32;
  for (int e = threadIdx.x; e < 32 * (D / 16); e += prepare_threads) {
    const int l = e % 32, s = e / 32;
    uint4 first, second;
    query_fragments<D, Bf16, RecordQuery, Table>(&q_s[0][0], G, l >> 2, l & 3, s, first, second);
    out[s * 32 + l] = first;
    out[(D / 16 + s) * 32 + l] = second;
  }
  if constexpr (Table) {
    float2* table = A.cs_table + bh * 8 * (D / 2);
    for (int e = threadIdx.x; e < 8 * (D / 2); e += prepare_threads) {
      float c, s;
      thread::rope_cos_sin(e / (D / 2), A.inv_freq[e % (D / 2)], c, s);
      table[e] = make_float2(c, s);
    }
  }
}

/// One block per (sequence, KV head): prepare_query before a decode kernel of several chunks per
/// (sequence, KV head), whose CTAs then only load the fragments.
template <int D, bool Bf16, record_query RecordQuery, bool Table>
__global__ void __launch_bounds__(prepare_threads) prepare_queries_kernel(const decode_layout L, const decode_arguments A) {
  // The decode kernel's CTAs may start now: they describe their items until they need the query.
  grid::let_next_kernel_start();
  const int b = blockIdx.x, h = blockIdx.y;
  __shared__ __align__(16) std::uint8_t scratch[query_scratch_bytes<D>];
  const query_inputs<D> in = load_query_inputs<D>(L, A, b, h);
  const lane_state lane = A.lanes[A.batch_lanes[b]];
  prepare_query<D, Bf16, RecordQuery, Table>(L, A, b, h, in, lane.first_position + lane.tokens - 1, scratch);
}

/// ‖v‖ of the tokens 2t and 2t+1 of a staged item of token rows (values in rows 8-15), for
/// value-weighted window mass. Lane 4r + k sums the squares of token r's channels in quarter k.
template <int D, bool Bf16>
__device__ __forceinline__ float2 value_norms(const std::uint8_t* s_item, int lane_id, int t) {
  const int r = lane_id >> 2, k = lane_id & 3;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < D / 4; i += 8) {  // channels k D/4 + i .. + 7: chunk (k D/4 + i) / 8
    const uint4 x = *reinterpret_cast<const uint4*>(s_item + token_row_chunk<D>(8 + r, (k * (D / 4) + i) / 8));
    const std::uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = warp::unpack_16<Bf16>(w[j]);
      sq = fmaf(f.x, f.x, sq);
      sq = fmaf(f.y, f.y, sq);
    }
  }
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  sq += __shfl_xor_sync(0xffffffffu, sq, 2);
  return make_float2(sqrtf(__shfl_sync(0xffffffffu, sq, 8 * t)), sqrtf(__shfl_sync(0xffffffffu, sq, 8 * t + 4)));
}

/// A chunk's factor for its partial output of one query head, exp2(m_chunk - LSE): 0 for a chunk
/// that saw no token of that head (m_chunk = -inf).
__device__ __forceinline__ float chunk_factor(float m_chunk, float lse) { return m_chunk == -INFINITY ? 0.f : exp2_sfu(m_chunk - lse); }

/// A query head's log-sum-exp (log2 units) over its tokens, M + log2(l) for a running maximum M and
/// sum l of 2^(s - M), as decode_arguments::part_lse keeps it: 0 for a head without tokens, whose
/// window masses are all log2(0) = -inf, so that 2^(mass - LSE) is 0 rather than 2^(-inf + inf).
__device__ __forceinline__ float head_lse(float M, float l) { return l > 0.f ? M + log2f(l) : 0.f; }

/// The two counters of sequence b (decode_arguments::mass_signals): [0] its KV heads whose
/// log-sum-exps are written, [1] the mass kernel's CTAs of b that have seen all of them. After a
/// launch of several chunks a pair the mass kernel starts under the decode grid's last wave and its
/// CTAs wait for their own sequence only, so that the masses of the sequences that are done are
/// summed while the grid's last CTAs still run, instead of after the whole grid.
__device__ __forceinline__ unsigned* mass_signals(const decode_arguments& A, int b) { return A.mass_signals + 1 + 2 * b; }

/// The mass kernel's last act, by every thread of a CTA: the grid's last CTA to finish waits for the
/// decode grid to end before it exits. Its CTAs wait only for their own sequences' merges, and the
/// decode CTAs still write their outputs after that, so without this the mass kernel could end
/// before the decode kernel, and a kernel launched as its dependent would wait for the mass kernel
/// alone. The grid's last CTA resets the count for the next launch.
__device__ __forceinline__ void end_after_decode_grid(const decode_arguments& A) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(A.mass_signals, 1u) == gridDim.x * gridDim.y - 1) {
    A.mass_signals[0] = 0u;
    grid::wait_for_previous_kernel();
  }
}

/// Called by one thread of the CTA that wrote (sequence b, KV head)'s log-sum-exps, after a barrier
/// behind those writes. Release, cumulative over that barrier and over what the CTA acquired
/// through its ticket (the other chunks' masses): a mass CTA that acquires the count sees them all.
__device__ __forceinline__ void signal_lse_written(const decode_arguments& A, int b) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(mass_signals(A, b)) : "memory");
}

/// The mass kernel's wait for sequence b, by every thread of the CTA (one polls): returns once all
/// L.kv_heads log-sum-exps of b, and every mass of b, are written and visible. The sequence's last
/// CTA to pass sets both counters back to zero for the next launch: every CTA of b has then stopped
/// reading them, and the next launch is ordered after this one by the stream.
__device__ __forceinline__ void wait_for_lse_written(const decode_layout& L, const decode_arguments& A, int b) {
  if (threadIdx.x == 0) {
    unsigned* s = mass_signals(A, b);
    // Polled with relaxed loads, then one acquire fence: an acquire empties the SM's L1, under
    // the decode CTAs that still run there.
    for (;;) {
      unsigned n;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(s) : "memory");
      if (n >= static_cast<unsigned>(L.kv_heads)) break;
      __nanosleep(256);
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire
    if (atomicAdd(s + 1, 1u) == gridDim.x - 1) {
      s[0] = 0u;
      s[1] = 0u;
    }
  }
  __syncthreads();
}

/// The merge of one (sequence b, KV head h)'s `n_chunks` partials by one CTA of the decode kernel:
/// each query head's log-sum-exp over the chunks (EmitMass: into part_lse, for decode_mass_kernel),
/// and its output, the chunks' partials weighted by their factors exp2(m_chunk - LSE). factor_s: n_chunks * group
/// floats of shared memory (decode_attention checks that they fit). Partials are read from L2
/// (ld.global.cg): other SMs wrote them.
template <int D, bool EmitMass>
__device__ __forceinline__ void merge_chunks(const decode_layout& L, const decode_arguments& A, int b, int h, int n_chunks,
                                             float* factor_s) {
  const int G = L.group;
  const std::size_t row0 = (static_cast<std::size_t>(b) * L.kv_heads + h) * A.max_chunks;
  // Log-sum-exp: 16 lanes per head, each over every 16th chunk, so that the loads of all chunks
  // are in flight at once; the chunk maxima wait in factor_s for their factors.
  {
    constexpr int span = 16;
    const int hg = static_cast<int>(threadIdx.x) / span, sub = threadIdx.x & (span - 1);
    const bool head = hg < G;
    float M = -INFINITY, S = 0.f;  // running (max, sum of exp2(m - max) * l)
    auto add = [&](float m, float l) {
      if (m == -INFINITY) return;
      if (m > M) {
        S = S * exp2_sfu(M - m) + l;
        M = m;
      } else {
        S += l * exp2_sfu(m - M);
      }
    };
    if (head)
      for (int c = sub; c < n_chunks; c += span) {
        const float2 ml = __ldcg(A.part_ml + (row0 + c) * G + hg);
        factor_s[c * G + hg] = ml.x;
        add(ml.x, ml.y);
      }
#pragma unroll
    for (int o = span / 2; o > 0; o >>= 1) {
      const float m = __shfl_xor_sync(0xffffffffu, M, o), l = __shfl_xor_sync(0xffffffffu, S, o);
      add(m, l);
    }
    const float lse = M + log2f(S);
    if (head) {
      if (EmitMass && sub == 0) A.part_lse[(static_cast<std::size_t>(b) * L.kv_heads + h) * G + hg] = head_lse(M, S);
      for (int c = sub; c < n_chunks; c += span) {
        const float m = factor_s[c * G + hg];
        factor_s[c * G + hg] = chunk_factor(m, lse);
      }
    }
  }
  __syncthreads();
  if (EmitMass && threadIdx.x == 0) signal_lse_written(A, b);
  // Output: four channels of one head per thread and step.
  const float4* part = reinterpret_cast<const float4*>(A.part_o + row0 * G * D);
  float4* out = reinterpret_cast<float4*>(A.out + (static_cast<std::size_t>(b) * L.kv_heads + h) * G * D);
  for (int e = threadIdx.x; e < G * D / 4; e += blockDim.x) {
    const int hg = e / (D / 4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int c = 0; c < n_chunks; ++c) {
      const float4 p = __ldcg(part + static_cast<std::size_t>(c) * G * D / 4 + e);
      const float f = factor_s[c * G + hg];
      acc.x += p.x * f, acc.y += p.y * f, acc.z += p.z * f, acc.w += p.w * f;
    }
    out[e] = acc;
  }
}

/// Bits: the ledger's code width. FullBits: the Full slots' code width when the top tier is
/// quantized (full_tier::quantized_as), 0 when they hold token rows.
template <int D, element_type E, bool EmitMass, record_rotation Records, int W, int Bits, int FullBits = 0,
          bool ValueWeighted = false, bool FoldLow = false>
__global__ void __launch_bounds__(warps_per_cta * 32, QEVICT_DECODE_MIN_BLOCKS)
    decode_attention_kernel(const decode_layout L, const decode_arguments A) {
  constexpr int chunk_capacity = max_items_per_chunk(W);  // items a chunk of this kernel can hold
  constexpr bool RotateRecords = Records == record_rotation::each_key;
  constexpr bool QueryPerWindow = Records == record_rotation::query_per_window;
  // Ledger records on the exact fp16 path (record_query_of).
  constexpr bool Fp16Records = record_query_of<Records, Bits> != record_query::none;
  static_assert(Bits == 2 || !QueryPerWindow, "decode_attention: window-relative keys need 2-bit codes");
  static_assert(FullBits == 0 || (W >= 8 && !QueryPerWindow),
                "decode_attention: a quantized top tier needs windows of at least 8 tokens and keys before or after RoPE");
  static_assert(D == 64 || D == 128, "decode_attention: head_dim must be 64 or 128");
  constexpr bool Bf16 = E == element_type::bf16;
  // KV heads vary fastest in the grid: the CTAs of one chunk's heads run together, and since a Full
  // slot or a ledger record holds all heads of its window side by side, they read it as one block.
  const int h = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z;
  // A launch of one chunk per (sequence, KV head) has no query kernel before it: each CTA prepares
  // its own query, whose inputs it loads first (they need nothing else).
  const bool own_query = gridDim.y == 1;
  // In a launch of several chunks the mass kernel may launch once every CTA of this grid has
  // started, that is under its last wave: its CTAs wait for their own sequence's log-sum-exps
  // (wait_for_lse_written), not for the whole grid. A launch of one chunk per (sequence, KV head)
  // is a single wave whose CTAs end together: there it launches once every CTA is past its copies,
  // and waits for the grid (decode_mass_kernel).
  if (!own_query) grid::let_next_kernel_start();
  const query_inputs<D> query_in = own_query ? load_query_inputs<D>(L, A, b, h) : query_inputs<D>{};
  const int lane_index = A.batch_lanes[b];
  const lane_state lane = A.lanes[lane_index];
  const int list = list_of(L, lane_index, h);
  const int n_entries = A.entry_counts[list];
  const int n_items = items_of<W>(L, lane, n_entries);
  const int first_item = chunk * A.items_per_chunk;
  // Chunk 0 always runs, so that every (sequence, KV head) is merged (to zeros if it has no items).
  if (chunk > 0 && first_item >= n_items) return;
  const int chunk_items = min(A.items_per_chunk, n_items - first_item);

  const int lane_id = threadIdx.x & 31, warp_id = threadIdx.x >> 5;
  const int g = lane_id >> 2, t = lane_id & 3;
  const int G = L.group;
  // Columns 4-7 of the output hold low parts: chosen at launch (folds_low_part), so that the loops
  // carry no branch on the group size.
  static_assert(!FoldLow || Bf16, "decode_attention: only bf16 probabilities have a low part to fold");
  // Pairs of records through the transposed product (transposes_records). Its query fragments are
  // B columns, so that ledger records outside the records' loop take score_item's fp32 path.
  constexpr bool Transposed = transposes_records<Records, W, Bits, FullBits, FoldLow>;
  constexpr record_query RecordQuery = kernel_record_query<Records, W, Bits, FullBits, FoldLow>;
  constexpr bool GeneralFp16 = Fp16Records && !Transposed;  // the general loop's records on score_record

  // Windows per item (W < 8: each has its own mass).
  constexpr int S = item_count::windows_per_item(W);
  extern __shared__ __align__(128) std::uint8_t dynamic_s[];
  // [warp][stage][2 items][item_bytes], from a stage_alignment boundary (chunk_step)
  std::uint8_t* const stage_s = dynamic_s + (-warp::shared_address(dynamic_s) & (stage_alignment - 1));
  __shared__ float3 mlz_s[warps_per_cta][8];
  __shared__ item_ref items_s[chunk_capacity];  // this chunk's items, pairs padded with empty ones
  __shared__ std::uint32_t rows_s[W < 8 ? chunk_capacity : 1][8];  // kind-3 items' key-row offsets

  const std::uint8_t* region = reinterpret_cast<const std::uint8_t*>(A.arena) + lane.region;
  // The threads describe the items, thread i items i, i + 128, ..., and the warp's ballot marks
  // the items of its pairs of two ledger records: bit l of record_pairs_s[4 r + w] is item
  // 128 r + 32 w + l.
  constexpr int description_rounds = (chunk_capacity + warps_per_cta * 32 - 1) / (warps_per_cta * 32);
  __shared__ std::uint32_t record_pairs_s[description_rounds * warps_per_cta];
  {
    const head_sections at = sections_of<2, FullBits>(L, region, h);
    const window_entry* entries = A.entries + static_cast<std::size_t>(list) * L.entries_per_lane;
    const int described = 2 * ((chunk_items + 1) / 2);
#pragma unroll
    for (int r = 0; r < description_rounds; ++r) {
      const int li = r * warps_per_cta * 32 + static_cast<int>(threadIdx.x);
      bool record = false;
      if (li < described) {
        const item_view v = describe_item<W, FullBits>(L, at, region, lane, entries, n_entries, first_item + li,
                                                       first_item + chunk_items, rows_s[W < 8 ? li : 0]);
        record = v.kind == 2;
        items_s[li] = item_ref::of(v, region);
      }
      // Pairs are items (2p, 2p + 1): lanes 2p and 2p + 1 of a warp. Every lane takes part in the
      // shuffle (not behind `record &&`: a full-mask shuffle waits for all 32 lanes).
      const bool partner_record = __shfl_xor_sync(0xffffffffu, record, 1);
      const bool pair_of_records = record && partner_record;
      const std::uint32_t pairs = __ballot_sync(0xffffffffu, pair_of_records);
      if (lane_id == 0) record_pairs_s[r * warps_per_cta + warp_id] = pairs;
    }
  }

  // The query of head g (query_fragments): qa for token rows (and records dequantized in fp32),
  // qf for records used as stored, qr for window-relative records (rotated per window into qf).
  std::uint32_t qa[D / 16][4];
  std::uint32_t qf[D / 16][4];
  float qr[QueryPerWindow ? D / 16 : 1][4];
  // The query fragments and the e^{i j f} table are prepare_queries_kernel's output
  // (launch_dependent), or this CTA's own (own_query); everything else this kernel reads was
  // written before that kernel started. Each loop below waits for it once its first pairs' copies
  // are in flight, so that those copies overlap the end of that kernel.
  // The (sequence, KV head) index, formed from the block's indices where it is used.
  auto pair_index = [&] { return static_cast<std::size_t>(b) * L.kv_heads + h; };
  // The window masses go straight to part_mass as the loops form them: for item li of this chunk,
  // window j of the item and head hg, part_mass[mass_at + (li * S + j) * G + hg] = log2 of the sum of 2^s over
  // the window's tokens (s: the head's scores in log2 units). That needs no maximum known only at
  // the end, so nothing waits in shared memory: the mass kernel subtracts each head's log-sum-exp.
  // A 32-bit index (decode_attention checks that it fits), so that a store is one multiply-add
  // from it and part_mass, a kernel parameter, rather than a 64-bit address kept across the loops.
  const int mass_at = EmitMass ? static_cast<int>((pair_index() * L.max_items + first_item) * S * G) : 0;
  auto load_query = [&] {
    grid::wait_for_previous_kernel();  // nothing to wait for with own_query: an ordinary launch
    const uint4* frag = A.q_fragments + pair_index() * (2 * D / 16) * 32 + lane_id;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const uint4 x = frag[s * 32];
      qa[s][0] = x.x, qa[s][1] = x.y, qa[s][2] = x.z, qa[s][3] = x.w;
      if constexpr (Fp16Records) {
        const uint4 y = frag[(D / 16 + s) * 32];
        if constexpr (QueryPerWindow) {
          qr[s][0] = __uint_as_float(y.x), qr[s][1] = __uint_as_float(y.y), qr[s][2] = __uint_as_float(y.z), qr[s][3] = __uint_as_float(y.w);
        } else {
          qf[s][0] = y.x, qf[s][1] = y.y, qf[s][2] = y.z, qf[s][3] = y.w;
        }
      }
    }
  };
  // Pairs of two ledger records take the records' own loop; the others (the sink group, Full
  // windows, recent items, a record paired with any of them) the general loop. Routing lists the
  // Full windows first, so a chunk's pairs of records are one run (in most chunks, every pair):
  // the first run, [record_first, record_last), takes the records' loop, and any pair outside it
  // the general one, which serves every kind.
  constexpr bool RecordLoop = Fp16Records && W == 8 && FullBits == 0;
  __syncthreads();  // items_s and record_pairs_s are written
  if (own_query) {
    // In the stages, before the first copy: the fragments are the CTA's after the barrier.
    static_assert(query_scratch_bytes<D> <= warps_per_cta * stages * 2 * item_bytes<D>, "the stages hold prepare_query's scratch");
    prepare_query<D, Bf16, RecordQuery, RotateRecords>(L, A, b, h, query_in,
                                                                         lane.first_position + lane.tokens - 1, stage_s);
    __syncthreads();
  }
  const int n_pairs = (chunk_items + 1) / 2;
  int record_first = 0, record_last = 0;
  if constexpr (RecordLoop) {
    const int2 run = first_run_of_ones(record_pairs_s);
    record_first = run.x / 2, record_last = run.y / 2;
  }
  const int n_record_pairs = record_last - record_first, n_general_pairs = n_pairs - n_record_pairs;

  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f, z_run = 0.0f;

  auto first_position = [&](int window) { return lane.first_position + L.sinks + static_cast<long long>(window) * W; };
  // Pairs of a run of n that warp warp_id takes (pairs warp_id, warp_id + warps_per_cta, ...).
  auto pairs_of_warp = [&](int n) { return n > warp_id ? (n - warp_id + warps_per_cta - 1) / warps_per_cta : 0; };
  std::uint8_t* my_stages = stage_s + warp_id * stages * 2 * item_bytes<D>;
  // e^{i t0 f_p} for the D/2 frequencies into the slots of the pair's items that need it (a
  // record whose keys are rotated from t0, or whose query is rotated back by t0).
  auto store_rotations = [&](long long t0_a, long long t0_b, float2* cs_a, float2* cs_b, bool need_a, bool need_b) {
    for (int p = lane_id; p < D / 2; p += 32) {
      const double f = A.inv_freq[p];
      float c, s;
      if (need_a) { thread::rope_cos_sin_approx(t0_a, f, c, s); cs_a[p] = make_float2(c, s); }
      if (need_b) { thread::rope_cos_sin_approx(t0_b, f, c, s); cs_b[p] = make_float2(c, s); }
    }
  };

  // Scores of two window-relative records (ca, cb as score_record's c): the query rotated back by
  // each window's start, then that record's products. Meta: the offset of the staged key metadata
  // in each item's slot.
  auto score_relative_records = [&](auto meta, const std::uint8_t* s_a, const std::uint8_t* s_b, const float2* cs_a,
                                    const float2* cs_b, float (&ca)[4], float (&cb)[4]) {
    if constexpr (QueryPerWindow) {  // qr holds the query only for such records
      constexpr int Meta = decltype(meta)::value;
      query_for_window<D>(qr, cs_a, L.layout, t, qf);
      score_record<D, Meta>(s_a, g, t, qf, ca);
      query_for_window<D>(qr, cs_b, L.layout, t, qf);
      score_record<D, Meta>(s_b, g, t, qf, cb);
    }
  };

  // One pair's scores into the output, the softmax state and the window masses: sa, sb are the
  // scores of tokens 2t, 2t+1 of items li_a and li_a + 1 for head g, (vs, vz) their values' scale
  // and zero, and load_values(v) writes the pair's V^T fragments.
  auto absorb = [&](int li_a, const float (&sa)[2], const float (&sb)[2], float2 vs_a, float2 vz_a, float2 vs_b, float2 vz_b,
                    const std::uint8_t* s_a, const std::uint8_t* s_b, auto&& load_values) {
    [[maybe_unused]] const int li_b = li_a + 1;
    // Online softmax, row = head g; the four threads of a row hold two tokens of each item. The
    // row's reference m_run moves only when a score exceeds it by more than rescale_margin
    // (every lane tests its own scores; one vote for the warp): probabilities then stay at most
    // 2^rescale_margin, and the row maximum (two shuffles), the rescale factor and the rescaling
    // of the output are needed only at the pairs that raise a row.
    float mx = fmaxf(fmaxf(sa[0], sa[1]), fmaxf(sb[0], sb[1]));
    float alpha = 1.0f;
    if (__any_sync(0xffffffffu, mx > m_run + rescale_margin<Bf16>)) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      alpha = m_new == -INFINITY ? 1.0f : exp2_sfu(m_run - m_new);  // 0 when m_run was -inf
      m_run = m_new;
      // Output columns are heads 2t and 2t+1: their rescale factors live on rows 2t and 2t+1.
      const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t), al1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        o[i][0] *= al0;
        o[i][1] *= al1;
        o[i][2] *= al0;
        o[i][3] *= al1;
      }
    }
    // A row that has seen no token yet (m_run = -inf) has only -inf scores: probability 0.
    const float m_ref = m_run == -INFINITY ? 0.0f : m_run;
    const float pa0 = exp2_sfu(sa[0] - m_ref), pa1 = exp2_sfu(sa[1] - m_ref);
    const float pb0 = exp2_sfu(sb[0] - m_ref), pb1 = exp2_sfu(sb[1] - m_ref);
    l_run = l_run * alpha + (pa0 + pa1) + (pb0 + pb1);
    z_run = z_run * alpha + (pa0 * vz_a.x + pa1 * vz_a.y) + (pb0 * vz_b.x + pb1 * vz_b.y);
    // B fragments of P^T (tokens x heads); a value's scale rides on its probability. With bf16
    // values, P goes in as a high and a low bf16 part (16 bits, like fp16 has 11).
    std::uint32_t p_hi_a, p_lo_a, p_hi_b, p_lo_b;
    warp::split_16<Bf16>(pa0 * vs_a.x, pa1 * vs_a.y, p_hi_a, p_lo_a);
    warp::split_16<Bf16>(pb0 * vs_b.x, pb1 * vs_b.y, p_hi_b, p_lo_b);
    // The window masses. Folded (FoldLow), before the value operands are formed, whose instructions
    // hide the shuffles' latency (as v24c was measured); otherwise after the output's products,
    // whose issue hides it, as before v24c: the kernel for keys rotated one by one measured 1.9 %
    // slower at 32x32K / 20 % with the masses first (docs/performance-history.md, v24c).
    auto emit_mass = [&] {
      // Row g's threads hold tokens (2t, 2t+1): sum over each window's tokens, each weighted by
      // ‖v‖ for a value-weighted scorer (token rows only: such caches keep no records). Rows of
      // heads past the group (g >= G) and, with the low parts folded, rows 4-7 (copies of rows
      // 0-3) write nothing; nor does item b of a chunk's last pair where it does not exist (its
      // word is the next chunk's first item).
      float2 wa = make_float2(1.f, 1.f), wb = wa;
      if constexpr (ValueWeighted) {
        wa = value_norms<D, Bf16>(s_a, lane_id, t);
        wb = value_norms<D, Bf16>(s_b, lane_id, t);
      }
      // log2(0) = -inf, and -inf + m_ref stays -inf.
      auto log_mass = [&](float sum) { return log2_sfu(sum) + m_ref; };
      auto store = [&](int li, int j, float lm) {
        store_if(A.part_mass + (mass_at + (li * S + j) * G + g), lm, g < G && li < chunk_items);
      };
      if constexpr (W == 1) {
        store(li_a, 2 * t, log_mass(pa0 * wa.x));
        store(li_a, 2 * t + 1, log_mass(pa1 * wa.y));
        store(li_b, 2 * t, log_mass(pb0 * wb.x));
        store(li_b, 2 * t + 1, log_mass(pb1 * wb.y));
      } else if constexpr (W >= 8) {
        // One butterfly for both items: after the first exchange even lanes hold half of item a's
        // sum and odd lanes half of item b's; after the second, lanes 0 and 2 hold item a's sum,
        // lanes 1 and 3 item b's (li_b = li_a + 1); lanes 0 and 1 store them.
        const int odd = t & 1;
        const float ma = pa0 * wa.x + pa1 * wa.y, mb = pb0 * wb.x + pb1 * wb.y;
        float x = odd ? mb : ma;
        x += __shfl_xor_sync(0xffffffffu, odd ? ma : mb, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const float lm = log_mass(x);
        if (t < 2) store(li_a + odd, 0, lm);
      } else {
        constexpr int threads_per_window = W / 2;  // 8/W windows of W tokens in an item
        float ma = pa0 * wa.x + pa1 * wa.y, mb = pb0 * wb.x + pb1 * wb.y;
#pragma unroll
        for (int o = 1; o < threads_per_window; o <<= 1) {
          ma += __shfl_xor_sync(0xffffffffu, ma, o);
          mb += __shfl_xor_sync(0xffffffffu, mb, o);
        }
        if (t % threads_per_window == 0) {
          store(li_a, t / threads_per_window, log_mass(ma));
          store(li_b, t / threads_per_window, log_mass(mb));
        }
      }
    };
    if constexpr (EmitMass && FoldLow) emit_mass();
    std::uint32_t v[D / 16][4];
    load_values(v);
    if constexpr (FoldLow) {
      // Column g of P^T: the high part in rows 0-3, the low part in rows 4-7 (folds_low_part).
      const bool low = g >= 4;
      const std::uint32_t p_a = low ? p_lo_a : p_hi_a, p_b = low ? p_lo_b : p_hi_b;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) warp::mma_16<Bf16>(o[i], v[i][0], v[i][1], v[i][2], v[i][3], p_a, p_b);
    } else {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        warp::mma_16<Bf16>(o[i], v[i][0], v[i][1], v[i][2], v[i][3], p_hi_a, p_hi_b);
        if constexpr (Bf16) warp::mma_16<Bf16>(o[i], v[i][0], v[i][1], v[i][2], v[i][3], p_lo_a, p_lo_b);
      }
    }
    if constexpr (EmitMass && !FoldLow) emit_mass();
  };

  if (n_general_pairs > 0) {
    // Each warp streams its own pairs (the general pairs warp_id + k * warps): pair k + stages - 1
    // is in flight while pair k is computed.
    const int my_pairs = pairs_of_warp(n_general_pairs);
    // The k-th pair outside the run of records.
    auto general_pair = [&](int k) { return k < record_first ? k : k + n_record_pairs; };
    auto issue = [&](int k) {
      if (k < my_pairs) {
        const int pair = general_pair(warp_id + k * warps_per_cta);
        std::uint8_t* dst = my_stages + (k % stages) * 2 * item_bytes<D>;
        const item_ref ra = items_s[2 * pair], rb = items_s[2 * pair + 1];
        if (W == 8 && ra.kind() == 2 && rb.kind() == 2) {
          // Two ledger records: both copies without a branch on their kinds.
          copy_record<staged_record<D, Bits>.head_bytes()>(dst, region + ra.offset, lane_id);
          copy_record<staged_record<D, Bits>.head_bytes()>(dst + item_bytes<D>, region + rb.offset, lane_id);
        } else {
          copy_item<D, W, Bits, FullBits>(L, ra.view(region), rows_s[W < 8 ? 2 * pair : 0], dst, region, lane_id);
          copy_item<D, W, Bits, FullBits>(L, rb.view(region), rows_s[W < 8 ? 2 * pair + 1 : 0], dst + item_bytes<D>, region, lane_id);
        }
      }
      warp::cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < stages - 1; ++k) issue(k);
    load_query();

    for (int k = 0; k < my_pairs; ++k) {
      issue(k + stages - 1);
      const int pair = general_pair(warp_id + k * warps_per_cta);
      const int li_a = 2 * pair, li_b = 2 * pair + 1;
      const item_ref ra = items_s[li_a], rb = items_s[li_b];
      const int kind_a = ra.kind(), kind_b = rb.kind(), valid_a = ra.valid(), valid_b = rb.valid();
      std::uint8_t* s_a = my_stages + (k % stages) * 2 * item_bytes<D>;
      std::uint8_t* s_b = s_a + item_bytes<D>;
      // e^{i t0 f_p} of a quantized item, stored in its slot behind the record (window-relative
      // records: in front of the key metadata that stage_key_meta writes there).
      constexpr int cs_offset = QueryPerWindow ? window_cs_offset<D> : key_extra_offset<D>;
      float2* cs_a = reinterpret_cast<float2*>(s_a + cs_offset);
      float2* cs_b = reinterpret_cast<float2*>(s_b + cs_offset);
      const bool record_a = is_record<FullBits>(kind_a), record_b = is_record<FullBits>(kind_b);
      if ((RotateRecords || QueryPerWindow) && (record_a || record_b)) {
        // Keys rotated one by one: from the item's first token; the query rotated per window: by
        // the window's first token, the frame of the whole record.
        store_rotations(first_position(ra.window) + (RotateRecords ? 8 * ra.part() : 0),
                        first_position(rb.window) + (RotateRecords ? 8 * rb.part() : 0), cs_a, cs_b, record_a, record_b);
      }
      warp::cp_async_wait<stages - 1>();
      __syncwarp();
      // Pairs of two records (keys after RoPE) take branch-free work below, so that the two
      // items' independent instruction streams interleave.
      const bool two_records = GeneralFp16 && kind_a == 2 && kind_b == 2;
      if constexpr (GeneralFp16) {
        if (two_records) {
          stage_key_meta<D>(s_a, lane_id);
          stage_key_meta<D>(s_b, lane_id);
        } else {
          if (kind_a == 2) stage_key_meta<D>(s_a, lane_id);
          if (kind_b == 2) stage_key_meta<D>(s_b, lane_id);
        }
        __syncwarp();
      }

      float sa[2], sb[2];
      {
        float ca[4], cb[4];
        if (two_records) {
          if constexpr (QueryPerWindow) {
            score_relative_records(std::integral_constant<int, key_extra_offset<D>>{}, s_a, s_b, cs_a, cs_b, ca, cb);
          } else {
            score_record<D>(s_a, g, t, qf, ca);
            score_record<D>(s_b, g, t, qf, cb);
          }
        } else {
          auto score = [&](int kind, const std::uint8_t* s_item, const float2* cs_t0, float (&c)[4]) {
            if (GeneralFp16 && kind == 2) {
              if constexpr (QueryPerWindow) query_for_window<D>(qr, cs_t0, L.layout, t, qf);
              score_record<D>(s_item, g, t, qf, c);
            } else {
              score_item<D, Bf16, Bits, FullBits, RotateRecords>(L, kind, s_item, g, t, lane_id, A.cs_table + pair_index() * 8 * (D / 2),
                                                                 cs_t0, qa, c);
            }
          };
          score(kind_a, s_a, cs_a, ca);
          score(kind_b, s_b, cs_b, cb);
        }
        sa[0] = 2 * t < valid_a ? ca[0] + ca[2] : -INFINITY;
        sa[1] = 2 * t + 1 < valid_a ? ca[1] + ca[3] : -INFINITY;
        sb[0] = 2 * t < valid_b ? cb[0] + cb[2] : -INFINITY;
        sb[1] = 2 * t + 1 < valid_b ? cb[1] + cb[3] : -INFINITY;
      }
      float2 vs_a, vz_a, vs_b, vz_b;
      value_meta<FullBits>(L, kind_a, s_a, t, vs_a, vz_a);
      value_meta<FullBits>(L, kind_b, s_b, t, vs_b, vz_b);
      absorb(li_a, sa, sb, vs_a, vz_a, vs_b, vz_b, s_a, s_b, [&](std::uint32_t (&v)[D / 16][4]) {
        value_fragments<D, Bf16, Bits, FullBits>(L, kind_a, s_a, kind_b, s_b, g, t, lane_id, v);
      });
      __syncwarp();  // the stage and cs_t0 are rewritten by later pairs
    }
  }
  if constexpr (RecordLoop) {
    // After the general loop, whose copies have all landed and whose stages are read: the
    // records' slots take the same memory.
    if (n_record_pairs > 0) {
      // The run of pairs of ledger records (lists hold the Full windows first, so in most chunks,
      // every pair): compact slots (the record, its staged key metadata, e^{i t0 f_p} for
      // window-relative records) let the warp keep slots::stages pairs in its stages instead of
      // two, and the loop has no branch on item kinds. Every item has its 8 tokens.
      using slots = record_slots<D, QueryPerWindow>;
      // The launcher requires these records to be 8-token records of Bits-bit codes with bf16
      // metadata (staged_record), so their offsets are constants rather than loads from L.
      constexpr record_format staged = record_format::of(staged_record<D, Bits>);
      const int my_pairs = pairs_of_warp(n_record_pairs);
      constexpr int RS = slots::stages;
      // Window-relative records of a group of at most 4 heads: one query rotation per pair.
      [[maybe_unused]] const bool paired_rotation = QueryPerWindow && G <= 4;
      // Item a of the warp's k-th pair of records (item b follows it).
      auto record_item = [&](int k) { return 2 * (record_first + warp_id + k * warps_per_cta); };
      // The region offsets of the warp's k-th pair of records (zeros past its last pair). A pair's
      // slots start where its records' addresses put them (record_slots::start): the loops load
      // these offsets one pair ahead, so that the shared-memory round trip that reads them is not
      // the head of the pair's chain (copies, slot addresses, staged metadata, scores).
      auto record_offsets = [&](int k) {
        const int li = record_item(k);
        return k < my_pairs ? make_uint2(items_s[li].offset, items_s[li + 1].offset) : make_uint2(0u, 0u);
      };
      // Where the warp's k-th pair of records, copied from offsets.x and offsets.y of the region,
      // starts in its stage (record_slots::start): the one place of the ring's layout.
      struct pair_starts {
        std::uint8_t* a;
        std::uint8_t* b;
      };
      auto starts_of_pair = [&](int k, uint2 offsets) {
        std::uint8_t* const slot = my_stages + (k % RS) * 2 * slots::bytes;
        return pair_starts{slots::start(slot, region + offsets.x), slots::start(slot + slots::bytes, region + offsets.y)};
      };
      auto issue = [&](int k) {
        if (k < my_pairs) {
          const uint2 offsets = record_offsets(k);
          const pair_starts at = starts_of_pair(k, offsets);
          copy_record<staged_record<D, Bits>.head_bytes()>(at.a, region + offsets.x, lane_id);
          copy_record<staged_record<D, Bits>.head_bytes()>(at.b, region + offsets.y, lane_id);
        }
        warp::cp_async_commit();
      };
      // The transposed loop scores a pair one iteration before it absorbs it, so its stages take
      // all RS pairs; the other loop scores and absorbs a pair in the same iteration.
#pragma unroll
      for (int k = 0; k < (Transposed ? RS : RS - 1); ++k) issue(k);
      if (n_general_pairs == 0) load_query();  // else the general loop has loaded it
      if constexpr (Transposed) {
        // The general loop's state into the transposed loop's layout: lane (g, t) then holds head
        // t, its maximum, its partial sums over tokens g, and output rows g, g + 8 of columns 2t
        // (head t's high part) and 2t + 1 (its low part). Before, lane (g, t) held head g & 3
        // (rows g and g + 4 alike), sums over tokens 2t, 2t + 1, and columns 2t, 2t + 1 of the
        // folded product (column n: head n's high part for n < 4, head n - 4's low part else).
        // Untouched state is the same in both layouts.
        if (n_general_pairs > 0) {
          m_run = __shfl_sync(0xffffffffu, m_run, 4 * t);
          l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
          l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
          z_run += __shfl_xor_sync(0xffffffffu, z_run, 1);
          z_run += __shfl_xor_sync(0xffffffffu, z_run, 2);
          const float l_head = __shfl_sync(0xffffffffu, l_run, 4 * t), z_head = __shfl_sync(0xffffffffu, z_run, 4 * t);
          l_run = g == 0 ? l_head : 0.f;
          z_run = g == 0 ? z_head : 0.f;
          const int high_from = 4 * g + (t >> 1), low_from = 4 * g + 2 + (t >> 1);
          const bool second = t & 1;
#pragma unroll
          for (int i = 0; i < D / 16; ++i)
#pragma unroll
            for (int r = 0; r < 4; r += 2) {
              const float h0 = __shfl_sync(0xffffffffu, o[i][r], high_from), h1 = __shfl_sync(0xffffffffu, o[i][r + 1], high_from);
              const float l0 = __shfl_sync(0xffffffffu, o[i][r], low_from), l1 = __shfl_sync(0xffffffffu, o[i][r + 1], low_from);
              o[i][r] = second ? h1 : h0;
              o[i][r + 1] = second ? l1 : l0;
            }
        }
      }
      // The value codes go into the output product biased (2^E + code, value_code_bias): the
      // subtraction of 2^E leaves the loop, and one product of the same Pᵀ with rows of ones sums
      // each column's probabilities (p_sums, rescaled with the output), so that the output loses
      // 2^E times those sums once, after the loop.
      [[maybe_unused]] float p_sums[4] = {0.f, 0.f, 0.f, 0.f};
      // A pair of the transposed product once scored: head t's scores sa, sb of token g of items
      // li_a and li_a + 1, those tokens' value scale and zero (vs, vz), and their value codes.
      struct scored_pair {
        int li_a;
        float sa, sb, vs_a, vz_a, vs_b, vz_b;
        std::uint32_t codes_a[value_pieces<D, Bits>], codes_b[value_pieces<D, Bits>];
      };
      // absorb for the transposed product, in two steps: rescale raises the running maximum where a
      // score of the pair exceeds it (the one branch), accumulate adds the pair to the sums, the
      // mass and the output. Online softmax as in absorb; head t's tokens lie across the eight rows g.
      [[maybe_unused]] auto rescale_transposed = [&](const scored_pair& p) {
        float mx = fmaxf(p.sa, p.sb);
        if (__any_sync(0xffffffffu, mx > m_run + rescale_margin<Bf16>)) {
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(m_run, mx);
          const float alpha = m_new == -INFINITY ? 1.0f : exp2_sfu(m_run - m_new);
          m_run = m_new;
          // The lane's output columns are head t's: its own factor.
#pragma unroll
          for (int i = 0; i < D / 16; ++i) {
            o[i][0] *= alpha;
            o[i][1] *= alpha;
            o[i][2] *= alpha;
            o[i][3] *= alpha;
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) p_sums[e] *= alpha;
          l_run *= alpha;
          z_run *= alpha;
        }
      };
      [[maybe_unused]] auto accumulate_transposed = [&](const scored_pair& p) {
        const float m_ref = m_run == -INFINITY ? 0.0f : m_run;
        const float pa = exp2_sfu(p.sa - m_ref), pb = exp2_sfu(p.sb - m_ref);
        l_run += pa + pb;
        z_run += pa * p.vz_a + pb * p.vz_b;
        if constexpr (EmitMass) {
          // One butterfly over the rows for both items: even rows end with item a's sum, odd rows
          // with item b's.
          const int odd = g & 1;
          float x = odd ? pb : pa;
          x += __shfl_xor_sync(0xffffffffu, odd ? pa : pb, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          // Rows 0 and 1 store them (both items of a pair of records exist).
          store_if(A.part_mass + (mass_at + (p.li_a + odd) * G + t), log2_sfu(x) + m_ref, g < 2 && t < G);
        }
        // Row g of each item's P (tokens x columns): columns 2t, 2t + 1 = head t's value-scaled
        // probability, high and low bf16 parts; transposed, the B fragment of P^T.
        std::uint32_t hi, lo;
        warp::split_16<true>(pa * p.vs_a, pb * p.vs_b, hi, lo);
        const std::uint32_t p_a = warp::transpose_8x8(__byte_perm(hi, lo, 0x5410));
        const std::uint32_t p_b = warp::transpose_8x8(__byte_perm(hi, lo, 0x7632));
        std::uint32_t v[D / 16][4];
        value_code_fields<Bf16, Bits, D, value_pieces<D, Bits>, true>(p.codes_a, 0, v);
        value_code_fields<Bf16, Bits, D, value_pieces<D, Bits>, true>(p.codes_b, 1, v);
#pragma unroll
        for (int i = 0; i < D / 16; ++i) warp::mma_16<Bf16>(o[i], v[i][0], v[i][1], v[i][2], v[i][3], p_a, p_b);
        constexpr std::uint32_t ones = 0x3F803F80u;  // bf16 1.0 in both halves
        warp::mma_16<Bf16>(p_sums, ones, ones, ones, ones, p_a, p_b);
      };
      if constexpr (Transposed) {
        // A software pipeline: iteration k scores pair k + 1 and absorbs pair k, two chains with no
        // dependence between them, so that each hides the other's latency. The copies of RS - 1
        // pairs are in flight behind the pair being scored.
        // The k-th pair, its copies issued RS - 1 groups ago: staged key metadata, value codes,
        // scores and value metadata. `offsets` are record_offsets(k).
        auto score_pair = [&](int k, uint2 offsets) {
          scored_pair p;
          p.li_a = record_item(k);
          const pair_starts at = starts_of_pair(k, offsets);
          std::uint8_t* const s_a = at.a;
          std::uint8_t* const s_b = at.b;
          warp::cp_async_wait<RS - 1>();
          __syncwarp();
          stage_key_meta_pair<D, slots::meta>(s_a, s_b, lane_id);
          // The value codes' matrix loads go out before the scores, which hide their latency.
          load_value_codes<D, Bits>(staged, s_a, lane_id, p.codes_a);
          load_value_codes<D, Bits>(staged, s_b, lane_id, p.codes_b);
          __syncwarp();
          score_record_pair_transposed<D, slots::meta>(s_a, s_b, g, t, qf, p.sa, p.sb);
          value_meta_of_token(staged, s_a, g, p.vs_a, p.vz_a);
          value_meta_of_token(staged, s_b, g, p.vs_b, p.vz_b);
          return p;
        };
        if (my_pairs > 0) {
          scored_pair current = score_pair(0, record_offsets(0));
          uint2 next_offsets = record_offsets(1);
          for (int k = 0; k + 1 < my_pairs; ++k) {
            __syncwarp();    // every lane has read pair k's slot,
            issue(k + RS);   // which takes pair k + RS
            const uint2 offsets = next_offsets;
            next_offsets = record_offsets(k + 2);
            rescale_transposed(current);
            const scored_pair next = score_pair(k + 1, offsets);
            accumulate_transposed(current);
            current = next;
          }
          rescale_transposed(current);
          accumulate_transposed(current);
        }
      } else {
        uint2 next_offsets = record_offsets(0);
        for (int k = 0; k < my_pairs; ++k) {
          issue(k + RS - 1);
          const int li_a = record_item(k);
          const uint2 offsets = next_offsets;
          next_offsets = record_offsets(k + 1);
          const pair_starts at = starts_of_pair(k, offsets);
          std::uint8_t* const s_a = at.a;
          std::uint8_t* const s_b = at.b;
          float2* cs_a = reinterpret_cast<float2*>(s_a + slots::cs);
          float2* cs_b = reinterpret_cast<float2*>(s_b + slots::cs);
          if constexpr (QueryPerWindow)
            store_rotations(first_position(items_s[li_a].window), first_position(items_s[li_a + 1].window), cs_a, cs_b, true, true);
          warp::cp_async_wait<RS - 1>();
          __syncwarp();
          stage_key_meta<D, slots::meta>(s_a, lane_id);
          stage_key_meta<D, slots::meta>(s_b, lane_id);
          // The value codes' matrix loads go out before the scores, which hide their latency.
          std::uint32_t codes_a[value_pieces<D, Bits>], codes_b[value_pieces<D, Bits>];
          load_value_codes<D, Bits>(staged, s_a, lane_id, codes_a);
          load_value_codes<D, Bits>(staged, s_b, lane_id, codes_b);
          __syncwarp();
          float sa[2], sb[2];
          if constexpr (QueryPerWindow) {
            if (paired_rotation) {
              score_relative_pair<D, slots::meta>(qr, cs_a, cs_b, L.layout, s_a, s_b, g, t, qf, sa, sb);
            } else {
              float ca[4], cb[4];
              score_relative_records(std::integral_constant<int, slots::meta>{}, s_a, s_b, cs_a, cs_b, ca, cb);
              sa[0] = ca[0] + ca[2], sa[1] = ca[1] + ca[3], sb[0] = cb[0] + cb[2], sb[1] = cb[1] + cb[3];
            }
          } else {
            score_record_pair<D, slots::meta>(s_a, s_b, g, t, qf, sa, sb);
          }
          float2 vs_a, vz_a, vs_b, vz_b;
          record_value_meta(staged, s_a, t, vs_a, vz_a);
          record_value_meta(staged, s_b, t, vs_b, vz_b);
          absorb(li_a, sa, sb, vs_a, vz_a, vs_b, vz_b, s_a, s_b, [&](std::uint32_t (&v)[D / 16][4]) {
            value_code_fields<Bf16, Bits, D, value_pieces<D, Bits>>(codes_a, 0, v);
            value_code_fields<Bf16, Bits, D, value_pieces<D, Bits>>(codes_b, 1, v);
          });
          __syncwarp();  // the stage is rewritten by later pairs
        }
      }
      if constexpr (Transposed) {
        // The biases out of the output (p_sums): rows g and g + 8 of every fragment, columns 2t, 2t + 1.
#pragma unroll
        for (int i = 0; i < D / 16; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[i][e] -= value_code_bias<Bf16, Bits>(i, e / 2) * p_sums[e];
      }
    }
  }
  warp::cp_async_wait<0>();
  __syncwarp();
  if (own_query) grid::let_next_kernel_start();

  // Warp partials -> shared memory (the warp's own stages, now idle): rows o_of(w)[n] are the
  // output's columns n, the folded product's high parts in rows 0-3 and low parts in rows 4-7.
  using o_row = float[D + 1];
  auto o_of = [&](int w) { return reinterpret_cast<o_row*>(stage_s + w * stages * 2 * item_bytes<D>); };
  static_assert(8 * (D + 1) * 4 <= stages * 2 * item_bytes<D>, "the warp's stages hold its output partial");
  o_row* os = o_of(warp_id);
  if (Transposed && n_record_pairs > 0) {  // the transposed loop's layout: lane (g, t) holds head t
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 4);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 8);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 16);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, 4);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, 8);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, 16);
    if (g == 0) mlz_s[warp_id][t] = make_float3(m_run, l_run, z_run);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      os[t][16 * i + g] = o[i][0];
      os[t + 4][16 * i + g] = o[i][1];
      os[t][16 * i + g + 8] = o[i][2];
      os[t + 4][16 * i + g + 8] = o[i][3];
    }
  } else {
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, 1);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, 2);
    if (t == 0) mlz_s[warp_id][g] = make_float3(m_run, l_run, z_run);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      os[2 * t][16 * i + g] = o[i][0];
      os[2 * t + 1][16 * i + g] = o[i][1];
      os[2 * t][16 * i + g + 8] = o[i][2];
      os[2 * t + 1][16 * i + g + 8] = o[i][3];
    }
  }
  __syncthreads();

  // CTA merge: common max per head, then this chunk's partial (output, max, sum). In a launch of
  // one chunk per (sequence, KV head) — the launches without the query kernel — every CTA holds
  // its pair's whole: it writes the output normalised and, for the mass kernel, its heads'
  // log-sum-exps, and nothing is merged (no partials go through global memory and back). In a launch
  // of several chunks, a short lane's single chunk writes its partial and merges it itself, as
  // before v23 (finishing it alone there too measured slower: docs/performance-history.md, v23c).
  const bool alone = own_query;  // one chunk per (sequence, KV head) in this launch
  const std::size_t bh = pair_index();
  const std::size_t chunk_row = bh * A.max_chunks + chunk;
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int hg = e / D, c = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < warps_per_cta; ++w) M = fmaxf(M, mlz_s[w][hg].x);
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < warps_per_cta; ++w) {
      const float3 mlz = mlz_s[w][hg];
      const float f = mlz.x == -INFINITY ? 0.f : exp2_sfu(mlz.x - M);
      // Folded, column hg + 4 holds head hg's low part (no addition of 0 otherwise: x + 0 is not x for x = -0).
      const float o_w = FoldLow ? o_of(w)[hg][c] + o_of(w)[hg + 4][c] : o_of(w)[hg][c];
      acc += f * (o_w + mlz.z);
      l += f * mlz.y;
    }
    if (alone) {
      A.out[bh * G * D + e] = l > 0.f ? acc / l : 0.f;  // a head without tokens: zeros, as merged
      if (EmitMass && c == 0) A.part_lse[bh * G + hg] = head_lse(M, l);
    } else {
      A.part_o[chunk_row * G * D + e] = acc;
      if (c == 0) A.part_ml[chunk_row * G + hg] = make_float2(M, l);
    }
  }
  if (alone) return;  // the output is written (the mass kernel waits for the whole grid)

  // Split-K merge, in the CTA that finishes its (sequence, KV head) last: each chunk takes a ticket
  // once its partials are written, and the one that draws the last merges them, while the other
  // CTAs of the grid still run; a separate merge kernel would wait for the whole grid, then load
  // the partials in a chain of dependent round trips. A single chunk (a short lane of a launch of
  // several chunks) merges itself, without a ticket.
  const int n_chunks = (n_items + A.items_per_chunk - 1) / A.items_per_chunk;
  __shared__ bool merges_s;
  __syncthreads();  // every thread's partials are written; the stages (o_of) are read
  if (n_chunks > 1) {
    if (threadIdx.x == 0) {
      // Release (cumulative over the barrier above): this CTA's partials are visible to the CTA
      // that draws the last ticket, which acquires them. Only that one fences after the ticket:
      // an acquire also empties the SM's L1, under the CTAs that still run there.
      unsigned drawn;
      asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(drawn) : "l"(A.tickets + bh) : "memory");
      const bool last = drawn == static_cast<unsigned>(n_chunks - 1);
      if (last) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire
        A.tickets[bh] = 0;  // for the next launch, which the stream orders after this one
      }
      merges_s = last;
    }
    __syncthreads();
    if (!merges_s) return;
  }
  merge_chunks<D, EmitMass>(L, A, b, h, n_chunks, reinterpret_cast<float*>(stage_s));
}

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

}  // namespace detail

/// Launches attention for `args.batch` sequences on `stream`. `max_items` bounds the items of any
/// lane in this batch (it sizes the grid; CTAs past a lane's items return at once).
template <int D, element_type E, bool EmitMass, record_rotation Records, class Scorer, int W, int Bits, int FullBits = 0>
void decode_attention(const decode_layout& L, const decode_arguments& args, int max_items, cudaStream_t stream) {
  static_assert(W == 1 || W == 2 || W == 4 || W == 8 || W == 16 || W == 32,
                "decode_attention: the window must be 1, 2, 4, 8, 16 or 32 tokens");
  qevict::detail::require(L.group >= 1 && L.group <= 8, "decode_attention: the GQA group (q_heads / kv_heads) must be 1..8");
  qevict::detail::require(L.window == W, "decode_attention: the layout's window differs from the kernel's");
  qevict::detail::require(L.ledger_format.bits == Bits && L.full_format.bits == FullBits,
                          "decode_attention: the layout's code widths differ from the kernel's");
  qevict::detail::require(L.sinks <= 8, "decode_attention: at most 8 sink tokens");
  qevict::detail::require(args.items_per_chunk >= 0 && args.items_per_chunk % 8 == 0 && args.items_per_chunk <= max_items_per_chunk(W),
                          [&] {
                            return "decode_attention: items_per_chunk must be 0 (automatic) or a multiple of 8, at most " +
                                   std::to_string(max_items_per_chunk(W)) + " with windows of " + std::to_string(W) + " tokens, got " +
                                   std::to_string(args.items_per_chunk);
                          });
  // Rows and records are read in 16-byte pieces: every section of every region must be 16-byte
  // aligned. The window table (12 bytes a window) breaks this unless max_windows is a multiple of
  // 4, e.g. limits::max_tokens a power of two >= 32 with 5 sinks.
  qevict::detail::require((L.region_bytes | L.sink_offset | L.recent_offset | L.full_offset | L.ledger_offset | L.sequence_stride |
                           L.layer_offset) % 16 == 0 &&
                              reinterpret_cast<std::uintptr_t>(args.arena) % 16 == 0,
                          "decode_attention: regions are not 16-byte aligned; choose limits::max_tokens so that "
                          "(max_tokens - sinks + window - 1) / window is a multiple of 4");
  // Items are kept as 32-bit offsets into their region, with 16-bit ring positions.
  qevict::detail::require(L.region_bytes <= 0xffffffffu && L.recent_capacity < 0x10000,
                          "decode_attention: a (sequence, layer) region must be below 4 GiB, its recent region below 65536 tokens");
  // W = 8: a window's record is copied whole, at its compile-time size (copy_record).
  qevict::detail::require(W != 8 || (L.ledger_format.head_bytes == detail::staged_record<D, Bits>.head_bytes() &&
                                     (FullBits == 0 || L.full_format.head_bytes == detail::staged_record<D, FullBits>.head_bytes())),
                          "decode_attention: a record's size differs from an 8-token record with bf16 scale and zero");
  qevict::detail::require(std::max(L.ledger_format.staged_bytes, L.full_format.staged_bytes) <=
                              static_cast<std::size_t>(detail::window_cs_offset<D>),
                          "decode_attention: a quantized record does not fit its shared-memory slot");
  if (args.batch == 0) return;
  qevict::detail::require(!EmitMass || static_cast<std::size_t>(args.batch) * L.kv_heads * L.max_items * L.windows_per_item() * L.group <
                                           (std::size_t{1} << 31),
                          "decode_attention: the window masses of this batch exceed 2^31 values; attend in smaller batches");
  static constexpr int smem_bytes = detail::dynamic_smem_bytes<D>;
  // A value-weighted scorer's mass weighs each token by ‖v‖ (token rows only: no records).
  constexpr bool value_weighted = Scorer::token_signal == scorers::signal::value_weighted_attention;
  // Groups of at most 4 heads with bf16 values take the kernel whose output product folds the
  // probabilities' low parts into columns 4-7 (folds_low_part), unless keys are rotated one by one.
  // Returns the launch's arguments, with its automatic chunk chosen (the mass kernel reads it).
  const auto launch = [&]<bool Fold>() {
    constexpr auto kernel = detail::decode_attention_kernel<D, E, EmitMass, Records, W, Bits, FullBits, value_weighted, Fold>;
    // CTAs of this kernel the GPU holds at once, asked once per kernel (on the device current at its
    // first launch; it only steers the automatic chunk), when its shared memory is set.
    static const int resident_ctas = [] {
      QEVICT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
      int device = 0, sms = 0, per_sm = 0;
      QEVICT_CUDA_CHECK(cudaGetDevice(&device));
      QEVICT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      QEVICT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, detail::warps_per_cta * 32, smem_bytes));
      return sms * per_sm;
    }();
    decode_arguments a = args;
    if (a.items_per_chunk == 0)
      a.items_per_chunk = decode_chunk(a.batch, L.kv_heads, max_items, resident_ctas, a.max_chunks, max_items_per_chunk(W));
    const int chunks = std::max(1, (max_items + a.items_per_chunk - 1) / a.items_per_chunk);
    qevict::detail::require(chunks <= a.max_chunks, "decode_attention: workspace holds fewer chunks than the batch needs");
    qevict::detail::require(chunks <= 65535, "decode_attention: more than 65535 chunks a lane (raise items_per_chunk)");
    // The CTA that merges a (sequence, KV head) keeps a factor per chunk and query head in its stages.
    qevict::detail::require(static_cast<std::size_t>(chunks) * L.group * sizeof(float) <= detail::dynamic_smem_bytes<D> - detail::stage_alignment,
                            "decode_attention: too many chunks to merge in one CTA (raise items_per_chunk)");
    // The kernels after the first start while the kernel before them ends (kernels/dependent_launch.cuh):
    // at batch 1 and short contexts the launch gaps are a good part of the step. With one chunk per
    // (sequence, KV head) the decode kernel's CTAs prepare their queries themselves (own_query) and
    // it is the first kernel: an ordinary launch, since it reads what the calls before it wrote.
    const dim3 grid(static_cast<unsigned>(L.kv_heads), static_cast<unsigned>(chunks), static_cast<unsigned>(a.batch));
    if (chunks == 1) {
      kernel<<<grid, dim3(detail::warps_per_cta * 32), smem_bytes, stream>>>(L, a);
      QEVICT_CUDA_CHECK_LAUNCH("decode_attention_kernel");
    } else {
      detail::prepare_queries_kernel<D, E == element_type::bf16, detail::kernel_record_query<Records, W, Bits, FullBits, Fold>,
                                     Records == record_rotation::each_key>
          <<<dim3(static_cast<unsigned>(a.batch), static_cast<unsigned>(L.kv_heads)), detail::prepare_threads, 0, stream>>>(L, a);
      QEVICT_CUDA_CHECK_LAUNCH("prepare_queries_kernel");
      launch_dependent("decode_attention_kernel", kernel, grid, dim3(detail::warps_per_cta * 32), smem_bytes, stream, L, a);
    }
    return a;
  };
  constexpr bool bf16 = E == element_type::bf16, each_key = Records == record_rotation::each_key;
  const decode_arguments a = [&] {
    if constexpr (detail::may_fold_low_part<bf16, each_key>)
      if (detail::folds_low_part<bf16, each_key>(L.group)) return launch.template operator()<true>();
    return launch.template operator()<false>();
  }();
  if constexpr (EmitMass) {
    // A launch of several chunks a (sequence, KV head) signals each merge (its grid's CTAs end
    // over its last wave); one of a single chunk ends together, and its mass kernel waits for it.
    const bool several_chunks = max_items > a.items_per_chunk;
    // One thread for every window of the longest lane (max_items items hold at most
    // max_items * 8 / W windows for W < 8).
    const int max_windows = max_items * item_count::windows_per_item(W);
    const auto mass_kernel = L.group <= 4 ? detail::decode_mass_kernel<W, Scorer, 4> : detail::decode_mass_kernel<W, Scorer, 8>;
    launch_dependent("decode_mass_kernel", mass_kernel,
                     dim3(static_cast<unsigned>((max_windows + detail::mass_threads - 1) / detail::mass_threads), static_cast<unsigned>(a.batch)),
                     dim3(detail::mass_threads), 0, stream, L, a, several_chunks);
  }
}

/// f.template operator()<D, E>() for a cache's head_dim D (64 or 128) and element type E (bf16 or
/// f16): the one place that maps the two to the kernels' instantiations. `who` names the caller in
/// the error for any other value.
template <class F>
void with_head_dim_and_element(const char* who, int head_dim, element_type e, F&& f) {
  qevict::detail::require(e == element_type::bf16 || e == element_type::f16,
                          [&] { return std::string(who) + ": the cache element type must be bf16 or f16"; });
  const bool bf16 = e == element_type::bf16;
  if (head_dim == 128) bf16 ? f.template operator()<128, element_type::bf16>() : f.template operator()<128, element_type::f16>();
  else if (head_dim == 64) bf16 ? f.template operator()<64, element_type::bf16>() : f.template operator()<64, element_type::f16>();
  else throw error(std::string(who) + ": head_dim must be 64 or 128");
}

/// Runtime dispatch over head_dim, element type and key frame; the window size W and the code widths
/// (Bits: the ledger's; FullBits: a quantized top tier's, 0 for token rows) are the cache's.
template <bool EmitMass, class Scorer, int W = 8, int Bits = 2, int FullBits = 0>
void decode_attention(element_type e, const decode_layout& L, const decode_arguments& args, int max_items,
                      cudaStream_t stream) {
  const auto with_frame = [&]<int D, element_type E>() {
    switch (L.records) {
      case record_rotation::each_key: decode_attention<D, E, EmitMass, record_rotation::each_key, Scorer, W, Bits, FullBits>(L, args, max_items, stream); break;
      case record_rotation::none: decode_attention<D, E, EmitMass, record_rotation::none, Scorer, W, Bits, FullBits>(L, args, max_items, stream); break;
      case record_rotation::query_per_window:
        if constexpr (Bits == 2 && FullBits == 0) decode_attention<D, E, EmitMass, record_rotation::query_per_window, Scorer, W, Bits>(L, args, max_items, stream);
        else throw error("decode_attention: window-relative keys need 2-bit codes and a top tier of token rows");
        break;
    }
  };
  with_head_dim_and_element("decode_attention", L.head_dim, e, with_frame);
}

}  // namespace qevict::kernels

#pragma once
// Items: the 8-token units the decode kernel streams. What an item is (the sink group, a Full
// window's tokens, a ledger record, recent tokens), where it lies in a lane's region, and its
// copy into a warp's shared-memory stages (swizzled token rows, compact record slots).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/warp_mma.cuh"

namespace qevict::kernels::detail {

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

}  // namespace qevict::kernels::detail

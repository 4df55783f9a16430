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
//
// The parts, in reading order (kernels/decode/):
//   layout.cuh            what the kernels read of a cache: lanes, window lists, record formats,
//                         decode_layout, decode_arguments and the launch's workspace
//   common.cuh            SFU exp2/log2, the rescale margin, the low-part fold, a predicated store
//   items.cuh             items: what each is, where it lies, its copy into a warp's stages
//   keys.cuh              scores: key codes and token rows against the queries (fp32 and fp16 paths)
//   values.cuh            value fragments, value scales and zeros, ‖v‖
//   queries.cuh           query fragments and prepare_queries_kernel
//   merge.cuh             the split-K merge and the signals to the mass kernel
//   attention_kernel.cuh  decode_attention_kernel: the loops over a chunk's items
//   mass_kernel.cuh       decode_mass_kernel: window masses into the scores
// This file launches them (decode_attention).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "qevict/kernels/check.cuh"
#include "qevict/kernels/decode/attention_kernel.cuh"
#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/items.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/decode/mass_kernel.cuh"
#include "qevict/kernels/decode/queries.cuh"
#include "qevict/kernels/split_k.hpp"

namespace qevict::kernels {

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

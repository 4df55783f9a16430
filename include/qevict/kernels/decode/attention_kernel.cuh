#pragma once
// The fused decode-attention kernel: one CTA per (sequence, KV head, chunk of items) and the whole
// GQA group. It describes its items, streams them through its warps' stages (a general loop for
// every kind of item, a loop of its own for pairs of ledger records), keeps an online softmax per
// query head, writes the window masses' logarithms as it goes, and merges the chunks
// (decode_attention.cuh describes the whole).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/items.cuh"
#include "qevict/kernels/decode/keys.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/decode/merge.cuh"
#include "qevict/kernels/decode/queries.cuh"
#include "qevict/kernels/decode/values.cuh"
#include "qevict/kernels/dependent_launch.cuh"
#include "qevict/kernels/rope.cuh"
#include "qevict/kernels/split_k.hpp"
#include "qevict/kernels/warp_mma.cuh"

/// Resident CTAs per SM the decode kernel is compiled for (registers per thread follow from it).
#ifndef QEVICT_DECODE_MIN_BLOCKS
#define QEVICT_DECODE_MIN_BLOCKS 3
#endif

namespace qevict::kernels::detail {

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

}  // namespace qevict::kernels::detail

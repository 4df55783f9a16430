#pragma once
// Queries: which form a kernel's record products take them in (record_query), each lane's query
// fragments, and their preparation once per (sequence, KV head): by prepare_queries_kernel ahead
// of the attention kernel, or by a CTA that serves its pair alone.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/dependent_launch.cuh"
#include "qevict/kernels/rope.cuh"
#include "qevict/kernels/warp_mma.cuh"

namespace qevict::kernels::detail {

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

}  // namespace qevict::kernels::detail

#pragma once
// Values: the A fragments of the output product (token rows by ldmatrix, record codes as exact
// integers placed in their registers), each token's value scale and zero, and ‖v‖ for
// value-weighted window masses.

#include <cuda_runtime.h>

#include <cstdint>

#include "qevict/kernels/decode/items.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/warp_mma.cuh"

namespace qevict::kernels::detail {

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

}  // namespace qevict::kernels::detail

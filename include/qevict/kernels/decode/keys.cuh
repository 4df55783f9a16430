#pragma once
// Scores: a staged item's keys against the group's queries. Token rows and codes dequantized in
// fp32 (score_item, with keys rotated at their positions where they are stored before RoPE), and
// the exact fp16 path of 2-bit ledger records (staged key metadata, score_record and its pair
// and transposed forms, the query rotated back for window-relative records).

#include <cuda_runtime.h>

#include <cstdint>

#include "qevict/kernels/decode/items.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/rope.cuh"
#include "qevict/kernels/warp_mma.cuh"

namespace qevict::kernels::detail {

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

}  // namespace qevict::kernels::detail

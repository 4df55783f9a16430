#pragma once
// Quantizer policies: how a window's keys and values become integer codes plus scale/zero
// metadata, and the exact bytes that costs.
//
// The paper's scheme (asymmetric min-max, as in KIVI): keys are grouped per channel across the
// window's tokens (keys have per-channel outliers), values per token across channels. Keys are
// quantized before RoPE (key_frame::before_rope); the positions live in the window table and RoPE
// is re-applied after dequantization. key_frame::after_rope quantizes the keys as attention sees
// them (KIVI's own cache does this), so that attention reads the codes without rotating them.
//
// Record layout of one quantized window, repeated for each KV head h (sizes in bytes; code
// sections are padded to 4 bytes so that metadata stays aligned):
//   key codes   [tokens][head_dim] packed, token-major   round_up(tokens*head_dim*bits/8, 4)
//   key scale   [head_dim] Meta                           head_dim * sizeof(Meta)
//   key zero    [head_dim] Meta                           head_dim * sizeof(Meta)
//   value codes [tokens][head_dim] packed, token-major   round_up(tokens*head_dim*bits/8, 4)
//   value scale [tokens] Meta                             tokens * sizeof(Meta)
//   value zero  [tokens] Meta                             tokens * sizeof(Meta)
// Code slot e sits in byte e*bits/8 at bit (e % (8/bits))*bits, little end first. Key code (t, c)
// is slot t*head_dim + c. Value code (t, c) is slot t*head_dim + value_slot(c): within each 16-byte
// piece of a token's value codes (N = 128/bits channels), channel c of the piece sits in 16-bit
// element c % 8 as its field c / 8, so that one 16-bit element holds channels e, e+8, e+16, ...
// (record_layout::value_slot; channels past the last whole piece keep their natural order). A
// transposing 8x8 matrix load of the piece then hands each tensor-core lane exactly the channels
// its output rows need (docs/architecture.md, "Value codes in the tensor-core layout").
// Dequantized value = zero + scale * code.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qevict/core/numeric.hpp"

namespace qevict {

/// Encodings of scale/zero metadata. Each rounds in a chosen direction so that the quantizer can
/// guarantee the round-trip bound |x - x̂| <= scale/2 for every element.
namespace meta {
struct bf16 {
  using storage = std::uint16_t;
  static constexpr const char* name = "bf16";
  QEVICT_HOST_DEVICE static storage encode(float x) { return numeric::float_to_bf16(x); }
  QEVICT_HOST_DEVICE static float decode(storage s) { return numeric::bf16_to_float(s); }
  QEVICT_HOST_DEVICE static storage next_up(storage s) {
    if (s == 0x8000u || s == 0u) return 0x0001u;
    return (s & 0x8000u) ? static_cast<storage>(s - 1u) : static_cast<storage>(s + 1u);
  }
  QEVICT_HOST_DEVICE static storage next_down(storage s) {
    if (s == 0x8000u || s == 0u) return 0x8001u;
    return (s & 0x8000u) ? static_cast<storage>(s + 1u) : static_cast<storage>(s - 1u);
  }
};
struct f32 {
  using storage = float;
  static constexpr const char* name = "f32";
  QEVICT_HOST_DEVICE static storage encode(float x) { return x; }
  QEVICT_HOST_DEVICE static float decode(storage s) { return s; }
  QEVICT_HOST_DEVICE static storage next_up(storage s) {
    std::uint32_t u = numeric::float_bits(s);
    if ((u & 0x7fffffffu) == 0) return numeric::bits_float(1u);
    return numeric::bits_float((u & 0x80000000u) ? u - 1u : u + 1u);
  }
  QEVICT_HOST_DEVICE static storage next_down(storage s) {
    std::uint32_t u = numeric::float_bits(s);
    if ((u & 0x7fffffffu) == 0) return numeric::bits_float(0x80000001u);
    return numeric::bits_float((u & 0x80000000u) ? u + 1u : u - 1u);
  }
};
}  // namespace meta

namespace quantizers {

/// The frame a window's keys are quantized in. Both frames cost the same bytes.
namespace key_frame {
/// Before RoPE (the paper; KVQuant): a channel's outliers stay in that channel, so per-channel
/// groups fit them; attention rotates every dequantized key to its position.
struct before_rope {
  static constexpr bool rotated = false;
  static constexpr const char* name = "pre-RoPE";
  /// The rotation (as a position) attention applies to a dequantized key of `position` in a
  /// window starting at `window_start`.
  QEVICT_HOST_DEVICE static constexpr long long read_rotation(long long /*window_start*/, long long position) {
    return position;
  }
};
/// After RoPE, at each token's own position (KIVI's cache): attention uses the dequantized key as
/// it is, which takes the rotation (about half of the arithmetic per quantized key) out of the
/// decode kernel. Within a window of W tokens the rotation relative to the window's first token is
/// the same in both frames; the window's common rotation mixes the two channels of each rotary
/// pair, which widens a per-channel group only where a pair holds an outlier channel and has
/// turned far (the low-frequency pairs, where outliers tend to live, turn least).
struct after_rope {
  static constexpr bool rotated = true;
  static constexpr const char* name = "post-RoPE";
  QEVICT_HOST_DEVICE static constexpr long long read_rotation(long long, long long) { return 0; }
};
/// Relative to the window's first token, k_rel = R(t - t0) k: the rotation within the window is
/// the same as after RoPE, but the window's common rotation R(t0) is not applied, so a rotary
/// pair's outlier channel stays in its channel. Attention applies R(t0) once per window, to the
/// query: q . R(t0) k_rel = (R(t0)^T q) . k_rel.
struct window_relative {
  static constexpr bool rotated = false;
  static constexpr const char* name = "window-relative";
  QEVICT_HOST_DEVICE static constexpr long long read_rotation(long long window_start, long long) { return window_start; }
};
}  // namespace key_frame

/// Byte offsets of one window's record; computed once per cache, shared by both backends.
struct record_layout {
  int tokens = 0, heads = 0, head_dim = 0, bits = 0;
  std::size_t meta_bytes = 0;

  QEVICT_HOST_DEVICE static constexpr std::size_t round_up4(std::size_t n) { return (n + 3u) & ~std::size_t{3}; }
  QEVICT_HOST_DEVICE constexpr std::size_t code_section() const {
    return round_up4(static_cast<std::size_t>(tokens) * head_dim * bits / 8u);
  }
  QEVICT_HOST_DEVICE constexpr std::size_t key_scale_offset() const { return code_section(); }
  QEVICT_HOST_DEVICE constexpr std::size_t key_zero_offset() const { return key_scale_offset() + head_dim * meta_bytes; }
  QEVICT_HOST_DEVICE constexpr std::size_t value_codes_offset() const { return key_zero_offset() + head_dim * meta_bytes; }
  QEVICT_HOST_DEVICE constexpr std::size_t value_scale_offset() const { return value_codes_offset() + code_section(); }
  QEVICT_HOST_DEVICE constexpr std::size_t value_zero_offset() const { return value_scale_offset() + tokens * meta_bytes; }
  QEVICT_HOST_DEVICE constexpr std::size_t head_bytes() const { return value_zero_offset() + tokens * meta_bytes; }
  QEVICT_HOST_DEVICE constexpr std::size_t window_bytes() const { return head_bytes() * heads; }
  /// Channels in one 16-byte piece of a token's value codes.
  QEVICT_HOST_DEVICE constexpr int value_piece_channels() const { return 128 / bits; }
  /// Slot of value channel c within its token's codes: in a whole piece of N channels, channel
  /// j*N + r sits at slot j*N + (r % 8) * (N / 8) + r / 8 (16-bit element r % 8, field r / 8).
  QEVICT_HOST_DEVICE constexpr int value_slot(int c) const {
    const int n = value_piece_channels();
    if (c >= head_dim / n * n) return c;
    const int r = c % n;
    return c - r + (r % 8) * (n / 8) + r / 8;
  }
  /// The channel whose value code sits at slot s: the inverse of value_slot.
  QEVICT_HOST_DEVICE constexpr int value_channel(int s) const {
    const int n = value_piece_channels();
    if (s >= head_dim / n * n) return s;
    const int r = s % n;
    return s - r + (r % (n / 8)) * 8 + r / (n / 8);
  }
  QEVICT_HOST_DEVICE constexpr std::size_t code_bytes() const { return 2 * code_section() * heads; }
  QEVICT_HOST_DEVICE constexpr std::size_t metadata_bytes() const { return window_bytes() - code_bytes(); }
};

/// Asymmetric min-max quantization with `Bits` per code (2, 4 or 8), `Meta` scale/zero, keys in
/// `KeyFrame` (key_frame::before_rope, key_frame::after_rope or key_frame::window_relative).
template <int Bits, class Meta = meta::bf16, class KeyFrame = key_frame::before_rope>
struct asymmetric {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8,
                "qevict::quantizers::asymmetric<Bits>: Bits must be 2, 4 or 8");
  static_assert(std::is_same_v<KeyFrame, key_frame::before_rope> || std::is_same_v<KeyFrame, key_frame::after_rope> ||
                    std::is_same_v<KeyFrame, key_frame::window_relative>,
                "qevict::quantizers::asymmetric<Bits, Meta, KeyFrame>: KeyFrame must be key_frame::before_rope, "
                "key_frame::after_rope or key_frame::window_relative");
  using meta_type = Meta;
  using key_frame = KeyFrame;
  using meta_storage = typename Meta::storage;
  static constexpr int bits = Bits;
  static constexpr int max_code = (1 << Bits) - 1;
  static constexpr const char* name = Bits == 2 ? "int2" : Bits == 4 ? "int4" : "int8";

  static constexpr record_layout layout(int tokens, int heads, int head_dim) {
    return record_layout{tokens, heads, head_dim, Bits, sizeof(meta_storage)};
  }

  /// Scale and zero of a group with range [lo, hi]: zero rounds down and scale rounds up, so
  /// every x in [lo, hi] lies in [zero, zero + scale*max_code] and rounds to within scale/2.
  QEVICT_HOST_DEVICE static void choose_scale_zero(float lo, float hi, meta_storage& scale, meta_storage& zero) {
    zero = Meta::encode(lo);
    while (Meta::decode(zero) > lo) zero = Meta::next_down(zero);
    const float z = Meta::decode(zero);
    scale = Meta::encode((hi - z) / static_cast<float>(max_code));
    while (Meta::decode(scale) < 0.0f) scale = Meta::next_up(scale);
    while (z + Meta::decode(scale) * static_cast<float>(max_code) < hi) scale = Meta::next_up(scale);
  }

  QEVICT_HOST_DEVICE static int code_of(float x, float scale, float zero) {
    if (!(scale > 0.0f)) return 0;
    float c = (x - zero) / scale + 0.5f;
    c = c < 0.0f ? 0.0f : c;
    int code = static_cast<int>(c);
    return code > max_code ? max_code : code;
  }

  QEVICT_HOST_DEVICE static void put_code(std::uint8_t* codes, std::size_t e, int code) {
    constexpr int per_byte = 8 / Bits;
    const int shift = static_cast<int>(e % per_byte) * Bits;
    std::uint8_t& b = codes[e / per_byte];
    b = static_cast<std::uint8_t>((b & ~(max_code << shift)) | (code << shift));
  }
  QEVICT_HOST_DEVICE static int get_code(const std::uint8_t* codes, std::size_t e) {
    constexpr int per_byte = 8 / Bits;
    return (codes[e / per_byte] >> (static_cast<int>(e % per_byte) * Bits)) & max_code;
  }

  QEVICT_HOST_DEVICE static meta_storage load_meta(const std::uint8_t* p, std::size_t i) {
    meta_storage m;
    std::memcpy(&m, p + i * sizeof(meta_storage), sizeof m);
    return m;
  }
  QEVICT_HOST_DEVICE static void store_meta(std::uint8_t* p, std::size_t i, meta_storage m) {
    std::memcpy(p + i * sizeof(meta_storage), &m, sizeof m);
  }

  /// Quantize one window. `keys` (in the key frame: before or after RoPE) and `values` are float
  /// [tokens][heads][head_dim] (the order tokens arrive in); `record` receives
  /// layout(...).window_bytes() bytes.
  QEVICT_HOST_DEVICE static void quantize(const record_layout& L, const float* keys, const float* values,
                                          std::uint8_t* record) {
    const std::size_t row = static_cast<std::size_t>(L.heads) * L.head_dim;
    for (int h = 0; h < L.heads; ++h) {
      std::uint8_t* rec = record + h * L.head_bytes();
      std::uint8_t* key_codes = rec;
      std::uint8_t* value_codes = rec + L.value_codes_offset();
      for (std::size_t i = 0; i < L.code_section(); ++i) key_codes[i] = value_codes[i] = 0;
      // Keys: one group per channel, across the window's tokens.
      for (int c = 0; c < L.head_dim; ++c) {
        float lo = keys[h * L.head_dim + c], hi = lo;
        for (int t = 1; t < L.tokens; ++t) {
          const float x = keys[t * row + h * L.head_dim + c];
          lo = x < lo ? x : lo;
          hi = x > hi ? x : hi;
        }
        meta_storage s, z;
        choose_scale_zero(lo, hi, s, z);
        store_meta(rec + L.key_scale_offset(), c, s);
        store_meta(rec + L.key_zero_offset(), c, z);
        for (int t = 0; t < L.tokens; ++t)
          put_code(key_codes, static_cast<std::size_t>(t) * L.head_dim + c,
                   code_of(keys[t * row + h * L.head_dim + c], Meta::decode(s), Meta::decode(z)));
      }
      // Values: one group per token, across channels.
      for (int t = 0; t < L.tokens; ++t) {
        const float* v = values + t * row + h * L.head_dim;
        float lo = v[0], hi = v[0];
        for (int c = 1; c < L.head_dim; ++c) {
          lo = v[c] < lo ? v[c] : lo;
          hi = v[c] > hi ? v[c] : hi;
        }
        meta_storage s, z;
        choose_scale_zero(lo, hi, s, z);
        store_meta(rec + L.value_scale_offset(), t, s);
        store_meta(rec + L.value_zero_offset(), t, z);
        for (int c = 0; c < L.head_dim; ++c)
          put_code(value_codes, static_cast<std::size_t>(t) * L.head_dim + L.value_slot(c),
                   code_of(v[c], Meta::decode(s), Meta::decode(z)));
      }
    }
  }

  /// Key of token t, head h (in the key frame), into out[head_dim].
  QEVICT_HOST_DEVICE static void dequantize_key(const record_layout& L, const std::uint8_t* record, int h, int t,
                                                float* out) {
    const std::uint8_t* rec = record + h * L.head_bytes();
    for (int c = 0; c < L.head_dim; ++c) {
      const float s = Meta::decode(load_meta(rec + L.key_scale_offset(), c));
      const float z = Meta::decode(load_meta(rec + L.key_zero_offset(), c));
      out[c] = z + s * static_cast<float>(get_code(rec, static_cast<std::size_t>(t) * L.head_dim + c));
    }
  }

  /// Value of token t, head h, into out[head_dim].
  QEVICT_HOST_DEVICE static void dequantize_value(const record_layout& L, const std::uint8_t* record, int h, int t,
                                                  float* out) {
    const std::uint8_t* rec = record + h * L.head_bytes();
    const float s = Meta::decode(load_meta(rec + L.value_scale_offset(), t));
    const float z = Meta::decode(load_meta(rec + L.value_zero_offset(), t));
    const std::uint8_t* codes = rec + L.value_codes_offset();
    for (int c = 0; c < L.head_dim; ++c)
      out[c] = z + s * static_cast<float>(get_code(codes, static_cast<std::size_t>(t) * L.head_dim + L.value_slot(c)));
  }
};

}  // namespace quantizers
}  // namespace qevict

#pragma once
// Independent references for the host tests: a double-precision dense causal attention with its
// own RoPE, a decoder of quantized window records written from the documented layout, random
// inputs, and small comparison helpers. Nothing here calls into the library's math, so a test that
// compares the cache against these can fail when the cache is wrong.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include <qevict/core/geometry.hpp>

namespace qevict_test {

// ---- random inputs -----------------------------------------------------------------------------
struct rng {
  std::mt19937_64 engine;
  explicit rng(std::uint64_t seed) : engine(seed) {}
  float normal(float sigma = 1.0f) { return std::normal_distribution<float>(0.0f, sigma)(engine); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine); }  // [lo, hi]
  std::vector<float> normals(std::size_t n, float sigma = 1.0f) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(sigma);
    return x;
  }
};

// ---- RoPE in double -----------------------------------------------------------------------------
struct rope_spec {
  double theta = 10000.0;
  qevict::rope_layout layout = qevict::rope_layout::rotate_half;
};

/// Rotates x[d] to `position`: pair i turns by position * theta^(-2i/d).
inline void rope_rotate(const rope_spec& r, int d, double* x, long long position) {
  for (int i = 0; i < d / 2; ++i) {
    const double inv = std::pow(r.theta, -2.0 * i / d);
    const double angle = static_cast<double>(position) * inv;
    const int a = r.layout == qevict::rope_layout::interleaved ? 2 * i : i;
    const int b = r.layout == qevict::rope_layout::interleaved ? 2 * i + 1 : i + d / 2;
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
    x[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
  }
}

// ---- dense reference ----------------------------------------------------------------------------
/// Every token one (sequence, layer) ever received, pre-RoPE, in arrival order.
struct history {
  int kv_heads = 0, head_dim = 0;
  long long first_position = 0;
  std::vector<float> keys, values;  // [n][kv_heads][head_dim]

  history() = default;
  history(int hkv, int d, long long p0) : kv_heads(hkv), head_dim(d), first_position(p0) {}
  std::size_t row() const { return static_cast<std::size_t>(kv_heads) * head_dim; }
  int size() const { return static_cast<int>(keys.size() / row()); }
  void push(const float* k, const float* v) {
    keys.insert(keys.end(), k, k + row());
    values.insert(values.end(), v, v + row());
  }
};

/// Softmax attention of one query (pre-RoPE, [q_heads][head_dim]) over the first `n` tokens of
/// `h`, at position first_position + n - 1, all in double. `probs` (if given) receives each
/// token's probability averaged over query heads.
inline void dense_attend(const history& h, int q_heads, const rope_spec& r, const float* q_pre, int n,
                         std::vector<double>& out, std::vector<double>* probs = nullptr) {
  const int d = h.head_dim, group = q_heads / h.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  out.assign(static_cast<std::size_t>(q_heads) * d, 0.0);
  if (probs) probs->assign(static_cast<std::size_t>(n), 0.0);
  std::vector<double> keys(static_cast<std::size_t>(n) * d), logits(static_cast<std::size_t>(n)), q(d);
  for (int kvh = 0; kvh < h.kv_heads; ++kvh) {
    for (int j = 0; j < n; ++j) {
      double* k = &keys[static_cast<std::size_t>(j) * d];
      for (int c = 0; c < d; ++c) k[c] = h.keys[j * h.row() + kvh * d + c];
      rope_rotate(r, d, k, h.first_position + j);
    }
    for (int g = 0; g < group; ++g) {
      const int qh = kvh * group + g;
      for (int c = 0; c < d; ++c) q[c] = q_pre[qh * d + c];
      rope_rotate(r, d, q.data(), h.first_position + n - 1);
      double m = -INFINITY;
      for (int j = 0; j < n; ++j) {
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += q[c] * keys[static_cast<std::size_t>(j) * d + c];
        logits[j] = dot * scale;
        m = std::max(m, logits[j]);
      }
      double sum = 0.0;
      for (int j = 0; j < n; ++j) sum += (logits[j] = std::exp(logits[j] - m));
      for (int j = 0; j < n; ++j) {
        const double p = logits[j] / sum;
        if (probs) (*probs)[j] += p / q_heads;
        for (int c = 0; c < d; ++c) out[static_cast<std::size_t>(qh) * d + c] += p * h.values[j * h.row() + kvh * d + c];
      }
    }
  }
}

/// max |a - b| / max |b|: one relative error for a whole output vector.
template <class A, class B>
double relative_error(const A& a, const B& b) {
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return ref > 0.0 ? diff / ref : diff;
}

// ---- quantized record decoder ---------------------------------------------------------------------
/// bf16 bits to float: the 16 high bits of a float.
inline float bf16_bits_to_float(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// One window decoded from its record bytes, following the layout documented in quantizers.hpp:
/// per head: key codes [T][d], key scale [d], key zero [d], value codes [T][d], value scale [T],
/// value zero [T]; code sections padded to 4 bytes; codes little end first. A token's value codes
/// come in 16-byte pieces of 128/bits channels: channel r of a piece is in its 16-bit element r % 8,
/// at bit (r / 8) * bits of that element; channels past the last whole piece are in channel order.
struct decoded_window {
  int tokens = 0, heads = 0, head_dim = 0;
  std::vector<float> keys, values;              // [T][heads][d], dequantized (keys pre-RoPE)
  std::vector<float> key_scale, value_scale;    // [heads][d] and [heads][T]
};

inline decoded_window decode_record(std::span<const std::uint8_t> rec, int tokens, int heads, int d, int bits,
                                    bool meta_is_f32) {
  decoded_window w{tokens, heads, d, {}, {}, {}, {}};
  const std::size_t meta = meta_is_f32 ? 4 : 2;
  const std::size_t codes = (static_cast<std::size_t>(tokens) * d * bits / 8 + 3) / 4 * 4;
  const std::size_t head_bytes = 2 * codes + 2 * d * meta + 2 * tokens * meta;
  auto read_meta = [&](std::size_t offset) {
    if (meta_is_f32) {
      float f;
      std::memcpy(&f, rec.data() + offset, 4);
      return f;
    }
    std::uint16_t b;
    std::memcpy(&b, rec.data() + offset, 2);
    return bf16_bits_to_float(b);
  };
  auto code_at = [&](std::size_t base, std::size_t bit) { return (rec[base + bit / 8] >> (bit % 8)) & ((1 << bits) - 1); };
  auto code = [&](std::size_t base, std::size_t e) { return code_at(base, e * bits); };
  const int piece = 128 / bits;  // channels in 16 bytes of value codes
  auto value_code = [&](std::size_t base, int t, int c) {
    std::size_t bit = (static_cast<std::size_t>(t) * d + c) * bits;
    if (c < d / piece * piece) {
      const int r = c % piece;
      bit = static_cast<std::size_t>(t) * d * bits + static_cast<std::size_t>(c / piece) * 128 + (r % 8) * 16 + (r / 8) * bits;
    }
    return code_at(base, bit);
  };
  w.keys.resize(static_cast<std::size_t>(tokens) * heads * d);
  w.values.resize(w.keys.size());
  w.key_scale.resize(static_cast<std::size_t>(heads) * d);
  w.value_scale.resize(static_cast<std::size_t>(heads) * tokens);
  for (int h = 0; h < heads; ++h) {
    const std::size_t base = h * head_bytes;
    const std::size_t key_scale = base + codes, key_zero = key_scale + d * meta;
    const std::size_t value_codes = key_zero + d * meta, value_scale = value_codes + codes;
    const std::size_t value_zero = value_scale + tokens * meta;
    for (int c = 0; c < d; ++c) w.key_scale[h * d + c] = read_meta(key_scale + c * meta);
    for (int t = 0; t < tokens; ++t) w.value_scale[h * tokens + t] = read_meta(value_scale + t * meta);
    for (int t = 0; t < tokens; ++t)
      for (int c = 0; c < d; ++c) {
        const std::size_t e = static_cast<std::size_t>(t) * d + c;
        const std::size_t out = (static_cast<std::size_t>(t) * heads + h) * d + c;
        w.keys[out] = read_meta(key_zero + c * meta) + read_meta(key_scale + c * meta) * static_cast<float>(code(base, e));
        w.values[out] = read_meta(value_zero + t * meta) +
                        read_meta(value_scale + t * meta) * static_cast<float>(value_code(value_codes, t, c));
      }
  }
  return w;
}

}  // namespace qevict_test

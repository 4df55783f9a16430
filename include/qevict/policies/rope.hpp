#pragma once
// Rotary position embedding policies. The cache applies RoPE itself, so that it can quantize
// keys before rotation and rotate them again (exactly, from the stored positions) on promotion.

#include <cmath>
#include <cstddef>
#include <vector>

#include "qevict/core/geometry.hpp"

namespace qevict::rope {

/// Standard rotary embedding with either pair layout and optional Llama-3 frequency scaling.
struct rotary {
  static constexpr const char* name = "rotary";
  static constexpr bool rotates = true;

  /// Inverse frequencies θ^(-2i/d), i < d/2, after Llama-3 scaling when configured.
  static std::vector<double> inverse_frequencies(const rope_params& p, int head_dim) {
    std::vector<double> f(static_cast<std::size_t>(head_dim / 2));
    const double two_pi = 6.283185307179586;
    for (std::size_t i = 0; i < f.size(); ++i) {
      double inv = std::pow(static_cast<double>(p.theta), -2.0 * static_cast<double>(i) / head_dim);
      if (p.llama3_factor > 1.0f) {
        const double orig = p.llama3_original_max_position;
        const double low_wavelen = orig / p.llama3_low_freq_factor;
        const double high_wavelen = orig / p.llama3_high_freq_factor;
        const double wavelen = two_pi / inv;
        if (wavelen > low_wavelen) {
          inv /= p.llama3_factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (orig / wavelen - p.llama3_low_freq_factor) /
                                (p.llama3_high_freq_factor - p.llama3_low_freq_factor);
          inv = (1.0 - smooth) * inv / p.llama3_factor + smooth * inv;
        }
      }
      f[i] = inv;
    }
    return f;
  }

  /// Index of the two members of rotary pair i.
  QEVICT_HOST_DEVICE static void pair(rope_layout layout, int head_dim, int i, int& a, int& b) {
    if (layout == rope_layout::interleaved) {
      a = 2 * i;
      b = 2 * i + 1;
    } else {
      a = i;
      b = i + head_dim / 2;
    }
  }

  /// Rotate x[head_dim] in place to `position` (sign = +1) or back from it (sign = -1).
  /// Angles are formed in T (double on the host) so that long positions keep their precision.
  template <class T>
  static void rotate(rope_layout layout, const double* inv_freq, int head_dim, T* x, long long position,
                     int sign = +1) {
    for (int i = 0; i < head_dim / 2; ++i) {
      const double angle = static_cast<double>(position) * inv_freq[i];
      const double c = std::cos(angle), s = sign * std::sin(angle);
      int a, b;
      pair(layout, head_dim, i, a, b);
      const double x0 = x[a], x1 = x[b];
      x[a] = static_cast<T>(x0 * c - x1 * s);
      x[b] = static_cast<T>(x0 * s + x1 * c);
    }
  }
};

/// No positional rotation (models without RoPE, or tests that isolate other effects).
struct none {
  static constexpr const char* name = "none";
  static constexpr bool rotates = false;
  static std::vector<double> inverse_frequencies(const rope_params&, int head_dim) {
    return std::vector<double>(static_cast<std::size_t>(head_dim / 2), 0.0);
  }
  template <class T>
  static void rotate(rope_layout, const double*, int, T*, long long, int = +1) {}
};

}  // namespace qevict::rope

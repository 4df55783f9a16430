#pragma once
// What the engine tells the cache at construction: the model's attention geometry, the byte
// budget and the limits that size every pool up front (nothing is allocated after that).

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "qevict/core/numeric.hpp"

namespace qevict {

/// How the two halves of each rotary pair are laid out in a head vector.
enum class rope_layout : std::uint8_t {
  rotate_half,  ///< pairs (x[i], x[i + d/2]) — Hugging Face / NeoX style
  interleaved   ///< pairs (x[2i], x[2i+1]) — Meta / llama.cpp "normal" style
};

struct rope_params {
  float theta = 10000.0f;
  rope_layout layout = rope_layout::rotate_half;
  /// Llama-3 frequency scaling ("rope_type": "llama3"); off when factor <= 1.
  float llama3_factor = 1.0f;
  float llama3_low_freq_factor = 1.0f;
  float llama3_high_freq_factor = 4.0f;
  int llama3_original_max_position = 8192;
};

struct geometry {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  element_type element = element_type::f32;  ///< how sink, recent and Full tokens are stored
  rope_params rope{};

  /// Bytes of one token's keys and values in one layer at full precision.
  constexpr std::size_t token_bytes() const {
    return 2u * static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(head_dim) * element_bytes(element);
  }
};

/// Pool sizes: at most `max_batch` sequences at once, each at most `max_tokens` long.
struct limits {
  int max_batch = 1;
  int max_tokens = 4096;
  /// The most tokens a sequence may hold (token counts and window indices are ints).
  static constexpr int largest_max_tokens = 1 << 30;
  /// The largest arena (max_batch sequences of every layer's region) a cache plans, 2^62 bytes:
  /// far beyond any memory, and every byte offset into it stays a valid size_t and ptrdiff_t.
  static constexpr std::size_t largest_arena_bytes = std::size_t{1} << 62;
};

/// The byte budget of one sequence in one layer.
class budget {
 public:
  enum class kind : std::uint8_t { fraction, bytes, everything };

  /// A fraction of the full-precision cache of `limits::max_tokens` tokens.
  static budget fraction(double f) { return budget{kind::fraction, f, 0}; }
  /// The most bytes bytes_per_sequence_layer accepts (2^48).
  static constexpr std::size_t largest_bytes = std::size_t{1} << 48;
  /// An absolute number of bytes per sequence per layer, at most largest_bytes.
  static budget bytes_per_sequence_layer(std::size_t b) { return budget{kind::bytes, 0.0, b}; }
  /// Exactly enough for every window to be kept at its best tier under the configured allocator
  /// (the uncompressed reference, with the same accounting).
  static budget everything() { return budget{kind::everything, 0.0, 0}; }

  /// Splits the same total over layers in proportion to `shares` (one positive value per layer):
  /// layer l gets budget × layers × shares[l] / Σ shares.
  budget with_layer_shares(std::vector<double> shares) const {
    budget b = *this;
    b.shares_ = std::move(shares);
    return b;
  }

  kind what() const { return kind_; }
  double fraction_value() const { return fraction_; }
  std::size_t bytes_value() const { return bytes_; }
  const std::vector<double>& layer_shares() const { return shares_; }

 private:
  budget(kind k, double f, std::size_t b) : kind_(k), fraction_(f), bytes_(b) {}
  kind kind_;
  double fraction_;
  std::size_t bytes_;
  std::vector<double> shares_;
};

enum class routing_mode : std::uint8_t {
  automatic,  ///< each (sequence, layer) routes after every Ω-th attend
  manual      ///< only when route() is called
};

/// Run-time options that do not change the data layout.
struct options {
  int observation_window = 32;  ///< prefill queries whose attention gives the initial scores
  routing_mode routing = routing_mode::automatic;
};

}  // namespace qevict

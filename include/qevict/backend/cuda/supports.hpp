#pragma once
// Which configurations the CUDA backend runs, answerable by any C++ compiler (no CUDA needed):
//
//   static_assert(qevict::backend::cuda_supports<qevict::presets::h2o::config_type>);
//
// cuda_cache<Config> static_asserts each condition below with a message that names the policy;
// this header is the one place the conditions are written. A preset or configuration that fails
// one runs on the host backend only.

#include <type_traits>

#include "qevict/config.hpp"

namespace qevict::backend {

namespace cuda_detail {
/// INT2 codes in any key frame, INT4 and INT8 codes with keys before or after RoPE (the
/// window-relative frame's exact fp16 path needs 2-bit codes), bf16 scale and zero.
template <class Q>
struct kernel_quantizer : std::false_type {};
template <int Bits, class Frame>
struct kernel_quantizer<quantizers::asymmetric<Bits, meta::bf16, Frame>>
    : std::bool_constant<Bits == 2 || !std::is_same_v<Frame, quantizers::key_frame::window_relative>> {};
}  // namespace cuda_detail

/// The CUDA backend's condition on each policy of Config.
template <class Config>
struct cuda_support {
  /// The sinks are one item of 8 tokens.
  static constexpr bool sinks = Config::window_policy::sinks <= 8;
  using full_quantizer = typename Config::full_tier_policy::quantizer;  // void: token rows
  static constexpr bool quantized_top = Config::full_tier_policy::quantized;
  /// The code width of the top tier's records; 0 for token rows.
  static constexpr int full_bits = [] {
    if constexpr (quantized_top) return full_quantizer::bits;
    else return 0;
  }();
  /// Every window size of the window policy (1, 2, 4, 8, 16, 32) maps onto items of 8 tokens:
  /// windows shorter than an item are gathered from Full slots of token rows, or read one ledger
  /// record per item; a quantized top tier needs windows of at least 8 tokens.
  static constexpr bool short_windows = Config::window_policy::size >= 8 || !quantized_top;
  /// INT2, INT4 or INT8 codes with bf16 scale and zero (INT4 and INT8 not in the window-relative frame).
  static constexpr bool quantizer = cuda_detail::kernel_quantizer<typename Config::quantizer>::value;
  /// Token rows, or records of a kernel quantizer in the ledger's key frame, not window-relative
  /// (one key rotation per record for both tiers; the window-relative query path reads 2-bit
  /// ledger records only).
  static constexpr bool full_tier = [] {
    if constexpr (!quantized_top) {
      return true;
    } else {
      using frame = typename Config::quantizer::key_frame;
      return cuda_detail::kernel_quantizer<full_quantizer>::value && std::is_same_v<typename full_quantizer::key_frame, frame> &&
             !std::is_same_v<frame, quantizers::key_frame::window_relative>;
    }
  }();
  /// The decode kernel weighs a token's probability by ‖v‖ for a value-weighted scorer from the
  /// token's row in shared memory: such a cache must keep no quantized records.
  static constexpr bool scorer = Config::scorer::token_signal != scorers::signal::value_weighted_attention ||
                                 (Config::allocator::quantized_percent == 0 && !quantized_top);
  static constexpr bool all = sinks && short_windows && quantizer && full_tier && scorer;
};

/// Whether cache<Config, backend::cuda> compiles.
template <class Config>
inline constexpr bool cuda_supports = cuda_support<Config>::all;

}  // namespace qevict::backend

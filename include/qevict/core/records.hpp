#pragma once
// Reading a quantized record back as attention sees it. Both backends' read_window, and the host
// backend's migrations (promotion, demotion from a quantized top tier), go through this one
// function, so the dequantization and the key frame's rotation are written once.

#include <cstddef>
#include <cstdint>

#include "qevict/core/geometry.hpp"
#include "qevict/policies/quantizers.hpp"

namespace qevict {

/// Keys after RoPE and values of one routing unit's record of quantizer Q (layout: its tokens and
/// heads), for a window whose first token sits at `window_start`: Q's dequantization, then each key
/// rotated by Q's key frame's read rotation with the RoPE policy Rope (`pairs`, `inv_freq`: the
/// cache's pair layout and inverse frequencies). k_post and v receive [tokens][heads][head_dim].
template <class Q, class Rope>
void dequantize_window(const quantizers::record_layout& layout, const std::uint8_t* record, rope_layout pairs,
                       const double* inv_freq, long long window_start, float* k_post, float* v) {
  const int d = layout.head_dim, heads = layout.heads;
  for (int j = 0; j < layout.tokens; ++j)
    for (int hl = 0; hl < heads; ++hl) {
      const std::size_t at = (static_cast<std::size_t>(j) * heads + hl) * d;
      Q::dequantize_key(layout, record, hl, j, k_post + at);
      Q::dequantize_value(layout, record, hl, j, v + at);
      if constexpr (!Q::key_frame::rotated)
        Rope::rotate(pairs, inv_freq, d, k_post + at, Q::key_frame::read_rotation(window_start, window_start + j));
    }
}

}  // namespace qevict

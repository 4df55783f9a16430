#pragma once
// Full-tier policies: how the top tier stores a window. The paper keeps it at the cache's element
// precision; a quantized top tier gives a two-precision quantization cache (ZipCache: salient
// windows at 4 bits, the rest at 2) under the same routing.

namespace qevict::full_tier {

/// Top-tier windows keep the cache's element type (bf16, fp16 or f32) — the paper.
struct full_precision {
  static constexpr const char* name = "full_precision";
  static constexpr bool quantized = false;
  using quantizer = void;  ///< no records: token rows
};

/// Top-tier windows are stored as `Quantizer` records (keys pre-RoPE, like the ledger). A window
/// promoted from the ledger is re-encoded from its dequantized ledger values.
template <class Quantizer>
struct quantized_as {
  static constexpr const char* name = "quantized";
  static constexpr bool quantized = true;
  using quantizer = Quantizer;
};

}  // namespace qevict::full_tier

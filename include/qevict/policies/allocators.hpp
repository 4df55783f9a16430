#pragma once
// Allocator policies: the tier capacities K_f and K_q from the historical byte budget (Eq. 3).

#include <cstddef>
#include <cstdint>

namespace qevict {

struct capacities {
  std::size_t full = 0;       ///< K_f: Full windows
  std::size_t quantized = 0;  ///< K_q: quantized records (the ledger's size)
};

namespace allocators {

/// Eq. 3 with q = QPercent / 100: K_f = ⌊(1−q)·B_hist / M_f⌋, K_q = ⌊q·B_hist / M_q⌋.
/// Integer arithmetic, so the floors are exact.
template <int QPercent = 70>
struct three_tier {
  static_assert(QPercent >= 0 && QPercent <= 100, "qevict::allocators::three_tier<QPercent>: QPercent must be in [0, 100]");
  static constexpr const char* name = QPercent == 0 ? "two_tier" : "three_tier";
  static constexpr int quantized_percent = QPercent;
  /// Whether the method is defined only when nothing is ever evicted.
  static constexpr bool keeps_everything = false;
  static constexpr capacities split(std::size_t hist_bytes, std::size_t full_window_bytes,
                                    std::size_t quantized_window_bytes, std::size_t /*units*/ = 0) {
    capacities c;
    c.full = (static_cast<std::uint64_t>(100 - QPercent) * hist_bytes) / (100u * full_window_bytes);
    c.quantized = quantized_window_bytes == 0
                      ? 0
                      : (static_cast<std::uint64_t>(QPercent) * hist_bytes) / (100u * quantized_window_bytes);
    return c;
  }
  /// The smallest historical budget that gives K_f >= windows.
  static constexpr std::size_t bytes_for_all_full(std::size_t windows, std::size_t full_window_bytes) {
    if constexpr (QPercent == 100) {
      return 0;
    } else {
      const std::size_t need = windows * full_window_bytes * 100u;
      return (need + (100u - QPercent) - 1u) / (100u - QPercent);
    }
  }
  /// The smallest historical budget that keeps every window (used by budget::everything()).
  static constexpr std::size_t bytes_to_keep_all(std::size_t windows, std::size_t full_window_bytes, std::size_t) {
    return bytes_for_all_full(windows, full_window_bytes);
  }
};

/// Full precision plus eviction only (the paper's ablation R2): q = 0.
using two_tier = three_tier<0>;

/// Every window outside the sinks and the recent region is quantized and nothing is evicted
/// (KIVI, KVQuant). The budget must hold a record for every window the sequence can have.
struct quantize_all {
  static constexpr const char* name = "quantize_all";
  static constexpr int quantized_percent = 100;
  static constexpr bool keeps_everything = true;
  static constexpr capacities split(std::size_t hist_bytes, std::size_t, std::size_t quantized_window_bytes,
                                    std::size_t /*units*/ = 0) {
    return capacities{0, quantized_window_bytes ? hist_bytes / quantized_window_bytes : 0};
  }
  static constexpr std::size_t bytes_to_keep_all(std::size_t windows, std::size_t, std::size_t quantized_window_bytes) {
    return windows * quantized_window_bytes;
  }
};

/// Two precisions, nothing evicted (ZipCache): every one of the `units` windows a sequence can
/// have gets a record in the quantized pool (K_q = units), and what the budget has left buys
/// top-tier windows (K_f), which the ranking gives to the most salient windows.
struct mixed_precision {
  static constexpr const char* name = "mixed_precision";
  static constexpr int quantized_percent = 100;
  static constexpr bool keeps_everything = true;
  static constexpr capacities split(std::size_t hist_bytes, std::size_t full_window_bytes,
                                    std::size_t quantized_window_bytes, std::size_t units = 0) {
    const std::size_t all = units * quantized_window_bytes;
    if (hist_bytes < all) return capacities{0, quantized_window_bytes ? hist_bytes / quantized_window_bytes : 0};
    return capacities{(hist_bytes - all) / full_window_bytes, units};
  }
  static constexpr std::size_t bytes_to_keep_all(std::size_t windows, std::size_t full_window_bytes,
                                                 std::size_t quantized_window_bytes) {
    return windows * (quantized_window_bytes + full_window_bytes);
  }
};

}  // namespace allocators
}  // namespace qevict

#pragma once
// Where a window (or a token) lives. One type for the cache, its reports and the diagnostics.

#include <cstdint>

namespace qevict {

enum class tier : std::uint8_t {
  sink,       ///< one of the first S tokens, always kept in full precision
  recent,     ///< in the recent region, not routed yet
  full,       ///< routed, kept in the top tier
  quantized,  ///< routed, kept as ledger codes, still attended
  evicted     ///< routed out for good
};

inline const char* to_string(tier t) {
  switch (t) {
    case tier::sink: return "sink";
    case tier::recent: return "recent";
    case tier::full: return "full";
    case tier::quantized: return "quantized";
    case tier::evicted: return "evicted";
  }
  return "?";
}

}  // namespace qevict

#pragma once
// Algorithm 1's decision, free of any storage: rank the candidates and split them into Full,
// Quantized and Evicted. Both backends call this (the CUDA backend for its host-side checks and
// its tests; its kernels implement the same order).

#include <algorithm>
#include <cstdint>
#include <span>

#include "qevict/core/layout.hpp"
#include "qevict/policies/allocators.hpp"

namespace qevict {

struct routing_candidate {
  std::int32_t window = 0;  ///< window index (its identity)
  float score = 0.0f;       ///< cumulative score S̄_t(w)
  bool has_ledger = false;  ///< holds ledger codes from an earlier demotion
  tier next = tier::evicted;  ///< output: the tier it moves to
};

/// Ranking order: higher score first; equal scores go to the older window (lower index), so
/// that routing is deterministic and identical on every backend.
QEVICT_HOST_DEVICE constexpr bool ranks_before(const routing_candidate& a, const routing_candidate& b) {
  return a.score > b.score || (a.score == b.score && a.window < b.window);
}

/// Eq. 4–5 with the ledger counted honestly. F = the top K_f candidates. A Full window that still
/// holds its ledger record occupies one slot of the quantized pool (the pool is the ledger), so the
/// Quantized tier takes the next K_q − |F ∩ ledger| candidates; the rest are evicted. Without
/// ledger copies this is exactly Eq. 5. Returns the candidates sorted in ranking order.
inline void assign_tiers(std::span<routing_candidate> candidates, capacities caps) {
  std::sort(candidates.begin(), candidates.end(), ranks_before);
  const std::size_t n = candidates.size();
  const std::size_t n_full = std::min(caps.full, n);
  std::size_t ledger_kept_by_full = 0;
  for (std::size_t i = 0; i < n_full; ++i) {
    candidates[i].next = tier::full;
    ledger_kept_by_full += candidates[i].has_ledger ? 1u : 0u;
  }
  // ledger_kept_by_full <= K_q: those records already fit in the pool before this event.
  const std::size_t quantized_room = caps.quantized > ledger_kept_by_full ? caps.quantized - ledger_kept_by_full : 0;
  const std::size_t n_quantized = std::min(quantized_room, n - n_full);
  for (std::size_t i = n_full; i < n_full + n_quantized; ++i) candidates[i].next = tier::quantized;
  for (std::size_t i = n_full + n_quantized; i < n; ++i) candidates[i].next = tier::evicted;
}

}  // namespace qevict

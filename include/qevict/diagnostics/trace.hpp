#pragma once
// The vocabulary every diagnostic speaks: the tiers a compressed run assigned at its routing
// events (a history of tier snapshots) and the attention of the uncompressed reference run
// (a trace of attention steps). Both runs see the same tokens, so token i means the same
// token in both.
//
// Token layout of a sequence (S sinks, windows of W tokens):
//   [0, S)                      sinks, always kept
//   [S + jW, S + (j+1)W)        window j, for every routed window j < window_count
//   [S + window_count·W, n)     recent region: tokens not yet in a routed window
//
// Step convention: a snapshot with `step = s` holds the tiers chosen by the routing event that
// ran at the end of decode step s. It governs attention at every step τ > s until the next
// snapshot; "evicted by step t" means evicted in a snapshot with step ≤ t.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "qevict/core/tier.hpp"

namespace qevict::diagnostics {

// The cache's own tier type; a routed window is full, quantized or evicted (validate_history
// refuses the others).
using qevict::tier;

// Where sinks end and how wide a window is; window j covers [begin(j), end(j)).
struct window_layout {
    std::size_t sinks = 0;        // S
    std::size_t window_size = 1;  // W

    [[nodiscard]] constexpr std::size_t begin(std::size_t window) const noexcept {
        return sinks + window * window_size;
    }
    [[nodiscard]] constexpr std::size_t end(std::size_t window) const noexcept {
        return begin(window + 1);
    }
    friend constexpr bool operator==(const window_layout&, const window_layout&) = default;
};

// The tiers of every routed window right after one routing event.
struct tier_snapshot {
    std::size_t step = 0;      // decode step whose routing event produced these tiers
    window_layout layout{};
    std::vector<tier> tiers;   // tiers[j] is the tier of window j

    [[nodiscard]] std::size_t window_count() const noexcept { return tiers.size(); }
    // The recent region starts right after the last routed window, so it is derived rather than
    // stored: a stored copy could disagree with the window count.
    [[nodiscard]] std::size_t recent_begin() const noexcept { return layout.begin(tiers.size()); }
};

// One decode step of the reference (uncompressed) run: per-token attention probabilities,
// averaged over query heads, for tokens 0..probs.size()-1. The span does not own the data, so an
// engine can hand over its buffers without copying.
struct attention_step {
    std::size_t step = 0;
    std::span<const float> probs;
};

namespace detail {

// Every check reports the function that failed and what was wrong, so a caller sees which of
// its inputs to fix without reading the library.
inline void require(bool ok, const char* where, const std::string& what) {
    if (!ok) throw std::invalid_argument(std::string("qevict::diagnostics::") + where + ": " + what);
}

inline double total_mass(const attention_step& s, const char* where) {
    double total = 0.0;
    for (float p : s.probs) total += p;
    require(total > 0.0, where,
            "attention step " + std::to_string(s.step) + " has no positive mass to normalise by");
    return total;
}

}  // namespace detail

// Checks what every diagnostic over a history assumes: steps strictly increase, every snapshot
// shares one layout with W ≥ 1, windows are never removed, and eviction is permanent.
inline void validate_history(std::span<const tier_snapshot> history) {
    constexpr const char* where = "validate_history";
    for (std::size_t r = 0; r < history.size(); ++r) {
        const tier_snapshot& now = history[r];
        detail::require(now.layout.window_size >= 1, where,
                        "snapshot " + std::to_string(r) + " has window_size 0");
        for (std::size_t j = 0; j < now.window_count(); ++j) {
            const tier t = now.tiers[j];
            detail::require(t == tier::full || t == tier::quantized || t == tier::evicted, where,
                            "window " + std::to_string(j) + " of snapshot " + std::to_string(r) +
                                " is not routed (a snapshot holds full, quantized or evicted windows)");
        }
        if (r == 0) continue;
        const tier_snapshot& before = history[r - 1];
        detail::require(now.step > before.step, where,
                        "snapshot steps must strictly increase (snapshot " + std::to_string(r) +
                            " has step " + std::to_string(now.step) + " after step " +
                            std::to_string(before.step) + ")");
        detail::require(now.layout == before.layout, where,
                        "snapshot " + std::to_string(r) + " changes the sinks or window size");
        detail::require(now.window_count() >= before.window_count(), where,
                        "snapshot " + std::to_string(r) + " has fewer windows (" +
                            std::to_string(now.window_count()) + ") than the one before (" +
                            std::to_string(before.window_count()) + ")");
        for (std::size_t j = 0; j < before.window_count(); ++j) {
            detail::require(before.tiers[j] != tier::evicted || now.tiers[j] == tier::evicted, where,
                            "window " + std::to_string(j) + " returns from eviction in snapshot " +
                                std::to_string(r) + " (eviction is permanent)");
        }
    }
}

// Checks a reference trace: steps strictly increase and probabilities are finite and ≥ 0.
inline void validate_trace(std::span<const attention_step> trace) {
    constexpr const char* where = "validate_trace";
    for (std::size_t k = 0; k < trace.size(); ++k) {
        if (k > 0) {
            detail::require(trace[k].step > trace[k - 1].step, where,
                            "reference steps must strictly increase (entry " + std::to_string(k) +
                                " has step " + std::to_string(trace[k].step) + ")");
        }
        for (float p : trace[k].probs) {
            detail::require(std::isfinite(p) && p >= 0.0f, where,
                            "attention step " + std::to_string(trace[k].step) +
                                " holds a negative or non-finite probability");
        }
    }
}

// The snapshot in force at the end of decode step t (latest with step ≤ t), or nullptr when no
// routing event has run yet. The history must be sorted by step.
[[nodiscard]] inline const tier_snapshot* snapshot_at(std::span<const tier_snapshot> history,
                                                      std::size_t t) noexcept {
    auto after = std::upper_bound(history.begin(), history.end(), t,
                                  [](std::size_t s, const tier_snapshot& x) { return s < x.step; });
    return after == history.begin() ? nullptr : &*(after - 1);
}

// The snapshot whose tiers the compressed run attended with at step τ (latest with step < τ).
[[nodiscard]] inline const tier_snapshot* snapshot_governing(std::span<const tier_snapshot> history,
                                                             std::size_t tau) noexcept {
    return tau == 0 ? nullptr : snapshot_at(history, tau - 1);
}

}  // namespace qevict::diagnostics

#pragma once
// Window sets per routing event — the common input of Global LIR and Selection Churn. Both
// metrics only ask "which windows could have been kept (candidates), and which were (kept)",
// so they run unchanged on the deployed cache's tiers and on a hindsight oracle.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_mass.hpp>

namespace qevict::diagnostics {

// One routing event's view: window indices, sorted ascending, without duplicates, and
// kept ⊆ candidates.
struct window_set {
    std::vector<std::size_t> candidates;  // windows ranked at this event
    std::vector<std::size_t> kept;        // windows the policy kept
};

// Which tiers count as "kept".
enum class kept_tiers {
    full,                // the full-precision set F_t (Global LIR)
    full_and_quantized,  // everything still attended, F_t ∪ Q_t
};

[[nodiscard]] constexpr bool is_kept(tier t, kept_tiers kept) noexcept {
    return t == tier::full || (kept == kept_tiers::full_and_quantized && t == tier::quantized);
}

namespace detail {

inline bool strictly_sorted(std::span<const std::size_t> v) {
    return std::adjacent_find(v.begin(), v.end(), std::greater_equal<>{}) == v.end();
}

}  // namespace detail

// Checks the window_set invariants; `where` names the caller in the message.
inline void validate_window_set(const window_set& s, const char* where = "validate_window_set") {
    detail::require(detail::strictly_sorted(s.candidates), where,
                    "candidates must be sorted ascending without duplicates");
    detail::require(detail::strictly_sorted(s.kept), where,
                    "kept windows must be sorted ascending without duplicates");
    detail::require(std::includes(s.candidates.begin(), s.candidates.end(), s.kept.begin(), s.kept.end()),
                    where, "every kept window must also be a candidate");
}

// The deployed sets of a tier history. Candidates at event r follow Eq. 4: every window routed at
// r except those already evicted at r−1 — a window evicted *at* r was still ranked at r, so it is
// a candidate there and never again. For the first snapshot every window is a candidate.
[[nodiscard]] inline std::vector<window_set> window_sets_from_history(std::span<const tier_snapshot> history,
                                                                      kept_tiers kept) {
    validate_history(history);
    std::vector<window_set> sets(history.size());
    for (std::size_t r = 0; r < history.size(); ++r) {
        const tier_snapshot& now = history[r];
        for (std::size_t j = 0; j < now.window_count(); ++j) {
            const bool evicted_before =
                r > 0 && j < history[r - 1].window_count() && history[r - 1].tiers[j] == tier::evicted;
            if (evicted_before) continue;
            sets[r].candidates.push_back(j);
            if (is_kept(now.tiers[j], kept)) sets[r].kept.push_back(j);
        }
    }
    return sets;
}

// Top-k windows of `scores` (all windows 0..n-1 are candidates). Ties go to the lower index so
// the oracle is deterministic.
[[nodiscard]] inline window_set top_k_set(std::span<const double> scores, std::size_t k) {
    window_set s;
    s.candidates.resize(scores.size());
    std::iota(s.candidates.begin(), s.candidates.end(), std::size_t{0});
    std::vector<std::size_t> order = s.candidates;
    const std::size_t take = std::min(k, scores.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(take), order.end(),
                      [&](std::size_t a, std::size_t b) {
                          return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
                      });
    s.kept.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(take));
    std::sort(s.kept.begin(), s.kept.end());
    return s;
}

// What the oracle ranks windows by at a routing event at step t.
enum class oracle_scoring {
    future,     // reference mass over the steps τ with t < τ ≤ t + horizon (all τ > t if horizon = 0)
    hindsight,  // reference mass over the whole trace, past and future
};

struct oracle_options {
    std::size_t k_full = 0;                          // K_f: windows the oracle keeps
    oracle_scoring scoring = oracle_scoring::future;
    std::size_t horizon = 0;                         // future steps looked at; 0 = to the trace's end
};

// The oracle's full-precision set at every routing event of `history`: top-K_f of the windows
// routed at that event, ranked by reference window mass. The oracle never evicts, so all routed
// windows are its candidates. Only the event steps and window counts of `history` are used.
[[nodiscard]] inline std::vector<window_set> oracle_sets(std::span<const tier_snapshot> history,
                                                         std::span<const attention_step> trace,
                                                         const oracle_options& options) {
    validate_history(history);
    validate_trace(trace);
    std::vector<window_set> sets;
    sets.reserve(history.size());
    for (const tier_snapshot& event : history) {
        const std::size_t n = event.window_count();
        std::vector<double> score(n, 0.0);
        for (const attention_step& s : trace) {
            if (options.scoring == oracle_scoring::future) {
                if (s.step <= event.step) continue;
                if (options.horizon != 0 && s.step - event.step > options.horizon) break;
            }
            // Under hindsight a step may predate some windows; they simply get no mass from it.
            const std::size_t covered =
                s.probs.size() <= event.layout.sinks
                    ? 0
                    : std::min(n, (s.probs.size() - event.layout.sinks) / event.layout.window_size);
            if (options.scoring == oracle_scoring::future) {
                detail::require(covered == n, "oracle_sets",
                                "reference step " + std::to_string(s.step) + " has " +
                                    std::to_string(s.probs.size()) + " tokens, fewer than the " +
                                    std::to_string(event.recent_begin()) + " the routed windows cover");
            }
            const std::vector<double> m = window_mass(event.layout, covered, s.probs);
            for (std::size_t j = 0; j < covered; ++j) score[j] += m[j];
        }
        sets.push_back(top_k_set(score, options.k_full));
    }
    return sets;
}

}  // namespace qevict::diagnostics

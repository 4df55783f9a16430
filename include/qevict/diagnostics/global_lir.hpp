#pragma once
// Global LIR (Long-term Importance Revival): how often a window that has stayed out of the kept
// (full-precision) set for a sustained period comes back into it. Eviction assumes "once
// unimportant, always unimportant"; a non-trivial revival rate falsifies that assumption.
//
// Over a sequence of routing events r = 0..R−1 with candidates C_r and kept sets K_r, a window w
// is *eligible* at event r when
//   w ∈ C_r, and w ∈ C_e \ K_e for every e in r−k..r−1   (out of the kept set, while still a
//                                                        candidate, for the k events before r)
//   [origin = since_exit only] w ∈ K_e for some e < r−k   (it was kept once, so it "re-enters")
// and it *revives* at r when it is eligible and w ∈ K_r. Then
//
//   LIR = Σ_r #{w revives at r} / Σ_r #{w eligible at r}
//
// i.e. the per-event probability that a long-absent window is taken back. Counting per event
// (rather than per absence spell) keeps windows that are evicted or that the trace ends on from
// biasing the rate: they stop contributing as soon as they stop being candidates. An absence run
// is broken when the window stops being a candidate. With no eligible window the rate is 0.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_sets.hpp>

namespace qevict::diagnostics {

// Where an absence run may start.
enum class lir_origin {
    since_candidate,  // any absence counts, including a window never kept since it became a candidate
    since_exit,       // only absence after the window had been kept at least once (strict re-entry)
};

struct revival_stats {
    std::size_t revivals = 0;       // numerator
    std::size_t opportunities = 0;  // denominator: eligible (window, event) pairs

    [[nodiscard]] double rate() const noexcept {
        return opportunities == 0 ? 0.0 : static_cast<double>(revivals) / static_cast<double>(opportunities);
    }
};

// LIR over any sequence of window sets (deployed: window_sets_from_history(h, kept_tiers::full);
// oracle: oracle_sets(h, trace, {K_f})). `min_absence` is k ≥ 1.
[[nodiscard]] inline revival_stats global_lir(std::span<const window_set> events, std::size_t min_absence,
                                              lir_origin origin = lir_origin::since_candidate) {
    detail::require(min_absence >= 1, "global_lir", "min_absence (k) must be at least 1");
    std::size_t windows = 0;
    for (std::size_t r = 0; r < events.size(); ++r) {
        validate_window_set(events[r], "global_lir");
        if (!events[r].candidates.empty()) windows = std::max(windows, events[r].candidates.back() + 1);
    }

    std::vector<std::size_t> absent_run(windows, 0);  // consecutive candidate-but-not-kept events up to r−1
    std::vector<bool> ever_kept(windows, false);
    revival_stats stats;
    for (const window_set& e : events) {
        std::vector<bool> candidate_now(windows, false);
        std::vector<bool> kept_now(windows, false);
        for (std::size_t w : e.candidates) candidate_now[w] = true;
        for (std::size_t w : e.kept) kept_now[w] = true;

        for (std::size_t w = 0; w < windows; ++w) {
            if (!candidate_now[w]) {
                absent_run[w] = 0;  // not ranked at all: the absence run is broken
                continue;
            }
            // A window that was not a candidate at r−1 has absent_run 0 already (reset above, or
            // never set), so runs only span consecutive candidate events.
            const bool eligible =
                absent_run[w] >= min_absence && (origin == lir_origin::since_candidate || ever_kept[w]);
            if (eligible) {
                ++stats.opportunities;
                if (kept_now[w]) ++stats.revivals;
            }
            if (kept_now[w]) {
                absent_run[w] = 0;
                ever_kept[w] = true;
            } else {
                ++absent_run[w];
            }
        }
    }
    return stats;
}

}  // namespace qevict::diagnostics

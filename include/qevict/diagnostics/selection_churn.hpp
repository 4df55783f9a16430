#pragma once
// Selection Churn: how much the kept set changes from one routing event to the next — the
// instability of the policy's notion of "what matters".
//
// For consecutive events r−1, r with candidates C and kept sets K, compare only windows that
// were candidates at both events, U = C_{r−1} ∩ C_r, so that a window that has just aged out of
// the recent region (a newcomer, not a change of mind) is not counted as churn:
//
//   A = K_{r−1} ∩ U,  B = K_r ∩ U
//   d_r = 1 − |A ∩ B| / |A ∪ B|        (d_r = 0 when A ∪ B is empty: nothing kept, nothing changed)
//   churn = (1 / (R−1)) Σ_{r=1}^{R−1} d_r     (0 for fewer than two events)
//
// A window evicted at r was a candidate at r (see window_sets_from_history), so losing it counts.

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <span>
#include <vector>

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_sets.hpp>

namespace qevict::diagnostics {

// Jaccard distance 1 − |a ∩ b| / |a ∪ b| of two sorted, duplicate-free index sets; 0 when both are
// empty (two empty selections agree).
[[nodiscard]] inline double jaccard_distance(std::span<const std::size_t> a, std::span<const std::size_t> b) {
    detail::require(detail::strictly_sorted(a) && detail::strictly_sorted(b), "jaccard_distance",
                    "index sets must be sorted ascending without duplicates");
    std::vector<std::size_t> common;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
    const std::size_t united = a.size() + b.size() - common.size();
    if (united == 0) return 0.0;
    return 1.0 - static_cast<double>(common.size()) / static_cast<double>(united);
}

// d_r between two consecutive events, restricted to their common candidates.
[[nodiscard]] inline double churn_between(const window_set& before, const window_set& after) {
    validate_window_set(before, "churn_between");
    validate_window_set(after, "churn_between");
    std::vector<std::size_t> common;
    std::set_intersection(before.candidates.begin(), before.candidates.end(), after.candidates.begin(),
                          after.candidates.end(), std::back_inserter(common));
    std::vector<std::size_t> a, b;
    std::set_intersection(before.kept.begin(), before.kept.end(), common.begin(), common.end(),
                          std::back_inserter(a));
    std::set_intersection(after.kept.begin(), after.kept.end(), common.begin(), common.end(),
                          std::back_inserter(b));
    return jaccard_distance(a, b);
}

// d_r for r = 1..R−1, one value per consecutive pair of events.
[[nodiscard]] inline std::vector<double> selection_churn_curve(std::span<const window_set> events) {
    std::vector<double> curve;
    for (std::size_t r = 1; r < events.size(); ++r) curve.push_back(churn_between(events[r - 1], events[r]));
    return curve;
}

// The mean of selection_churn_curve.
[[nodiscard]] inline double selection_churn(std::span<const window_set> events) {
    const std::vector<double> curve = selection_churn_curve(events);
    if (curve.empty()) return 0.0;
    double sum = 0.0;
    for (double d : curve) sum += d;
    return sum / static_cast<double>(curve.size());
}

}  // namespace qevict::diagnostics

#pragma once
// Token probabilities → window masses. Window mass is the attention probability summed over a
// window's tokens (design.md §2); every window-level diagnostic is built on it, so the token
// layout rule lives in exactly one place.
//
//   mass_τ(j) = Σ_{i = S + jW}^{S + (j+1)W − 1} a_τ(i)

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <qevict/diagnostics/trace.hpp>

namespace qevict::diagnostics {

// Mass of windows 0..window_count-1 at one step. Throws std::invalid_argument when the step
// holds fewer tokens than those windows cover: such a step predates the windows it is asked about.
[[nodiscard]] inline std::vector<double> window_mass(const window_layout& layout,
                                                     std::size_t window_count,
                                                     std::span<const float> probs) {
    detail::require(layout.window_size >= 1, "window_mass", "window_size must be at least 1");
    detail::require(probs.size() >= layout.begin(window_count), "window_mass",
                    std::to_string(window_count) + " windows need " +
                        std::to_string(layout.begin(window_count)) + " tokens but the step has " +
                        std::to_string(probs.size()));
    std::vector<double> mass(window_count, 0.0);
    for (std::size_t j = 0; j < window_count; ++j) {
        for (std::size_t i = layout.begin(j); i < layout.end(j); ++i) mass[j] += probs[i];
    }
    return mass;
}

// Σ over the given steps of window_mass — the cumulative score of Eq. 1 for the reference run
// (raw probabilities, not renormalised, exactly as the scorer accumulates them).
[[nodiscard]] inline std::vector<double> accumulate_window_mass(const window_layout& layout,
                                                                std::size_t window_count,
                                                                std::span<const attention_step> steps) {
    std::vector<double> total(window_count, 0.0);
    for (const attention_step& s : steps) {
        const std::vector<double> m = window_mass(layout, window_count, s.probs);
        for (std::size_t j = 0; j < window_count; ++j) total[j] += m[j];
    }
    return total;
}

// Mass on the sinks [0, S) (clipped to the tokens the step has).
[[nodiscard]] inline double sink_mass(const window_layout& layout, std::span<const float> probs) noexcept {
    double m = 0.0;
    for (std::size_t i = 0; i < layout.sinks && i < probs.size(); ++i) m += probs[i];
    return m;
}

// Mass on the recent region [recent_begin, n): tokens newer than every routed window.
[[nodiscard]] inline double recent_mass(std::size_t recent_begin, std::span<const float> probs) noexcept {
    double m = 0.0;
    for (std::size_t i = recent_begin; i < probs.size(); ++i) m += probs[i];
    return m;
}

}  // namespace qevict::diagnostics

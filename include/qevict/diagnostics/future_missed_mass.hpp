#pragma once
// Future Missed Mass (FMM): how much of the attention the uncompressed model pays at future steps
// lands on tokens the compressed policy has already given up. A high FMM means the compressed run
// is blind to information the reference is using.
//
// For a decode step t, let E_t be the windows missing in the snapshot at t (the latest with
// step ≤ t). For a reference step τ with distribution a_τ over its tokens,
//
//   missed_τ(E_t) = Σ_{j ∈ E_t} mass_τ(j) / Σ_i a_τ(i)
//   FMM(t)        = (1 / |T_{>t}|) Σ_{τ ∈ T_{>t}} missed_τ(E_t)
//
// where T_{>t} are the reference steps after t. Sinks and the recent region at t are never
// missing. Missing means evicted, or — for the "quantized tier disabled" variant — evicted or
// quantized. Before the first routing event nothing is missing, so FMM(t) = 0.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_mass.hpp>

namespace qevict::diagnostics {

enum class missing_tiers {
    evicted,                // the policy as deployed
    evicted_and_quantized,  // quantized tier disabled: what the quantized windows are worth later
};

[[nodiscard]] constexpr bool is_missing(tier t, missing_tiers missing) noexcept {
    return t == tier::evicted || (missing == missing_tiers::evicted_and_quantized && t == tier::quantized);
}

// One value of a curve over decode steps.
struct curve_point {
    std::size_t step = 0;
    double value = 0.0;
};

// missed_τ: fraction of the reference mass at one step that lies on windows missing in `snapshot`.
[[nodiscard]] inline double missed_mass(const tier_snapshot& snapshot, const attention_step& reference,
                                        missing_tiers missing = missing_tiers::evicted) {
    const std::vector<double> mass = window_mass(snapshot.layout, snapshot.window_count(), reference.probs);
    double missed = 0.0;
    for (std::size_t j = 0; j < mass.size(); ++j) {
        if (is_missing(snapshot.tiers[j], missing)) missed += mass[j];
    }
    return missed / detail::total_mass(reference, "missed_mass");
}

// The per-τ curve behind one FMM(t): missed_τ(E_t) for every reference step τ > t.
[[nodiscard]] inline std::vector<curve_point> future_missed_mass_profile(
    std::span<const tier_snapshot> history, std::span<const attention_step> trace, std::size_t t,
    missing_tiers missing = missing_tiers::evicted) {
    validate_history(history);
    validate_trace(trace);
    const tier_snapshot* at_t = snapshot_at(history, t);
    std::vector<curve_point> profile;
    for (const attention_step& s : trace) {
        if (s.step <= t) continue;
        profile.push_back({s.step, at_t ? missed_mass(*at_t, s, missing) : 0.0});
    }
    return profile;
}

// FMM(t) for every reference step t that has at least one later reference step.
[[nodiscard]] inline std::vector<curve_point> future_missed_mass_curve(
    std::span<const tier_snapshot> history, std::span<const attention_step> trace,
    missing_tiers missing = missing_tiers::evicted) {
    validate_history(history);
    validate_trace(trace);
    std::vector<curve_point> curve;
    if (trace.size() < 2) return curve;
    curve.reserve(trace.size() - 1);

    // E_t only changes at routing events, so missed_τ is computed once per snapshot for every
    // later τ and FMM(t) read off suffix sums: O(events · steps · tokens) instead of O(steps² · tokens).
    const tier_snapshot* current = nullptr;
    std::vector<double> suffix;  // suffix[k] = Σ_{k' ≥ k} missed_τ_{k'}(E) for the current snapshot
    for (std::size_t k = 0; k + 1 < trace.size(); ++k) {
        const tier_snapshot* at_t = snapshot_at(history, trace[k].step);
        if (at_t != current || suffix.empty()) {
            current = at_t;
            suffix.assign(trace.size() + 1, 0.0);
            if (current) {
                for (std::size_t m = trace.size(); m-- > k + 1;) {
                    suffix[m] = suffix[m + 1] + missed_mass(*current, trace[m], missing);
                }
            }
        }
        const double future_steps = static_cast<double>(trace.size() - (k + 1));
        curve.push_back({trace[k].step, suffix[k + 1] / future_steps});
    }
    return curve;
}

// Scalar FMM: the mean of the curve over its steps (0 when the trace has fewer than two steps).
[[nodiscard]] inline double future_missed_mass(std::span<const tier_snapshot> history,
                                               std::span<const attention_step> trace,
                                               missing_tiers missing = missing_tiers::evicted) {
    const std::vector<curve_point> curve = future_missed_mass_curve(history, trace, missing);
    if (curve.empty()) return 0.0;
    double sum = 0.0;
    for (const curve_point& p : curve) sum += p.value;
    return sum / static_cast<double>(curve.size());
}

}  // namespace qevict::diagnostics

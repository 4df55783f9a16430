#pragma once
// Attention-mass split: where the reference model's attention at a step falls, by the tier the
// compressed run gave each token. It shows how much useful mass each tier preserves at a budget
// (two-tier keeps less in Full but evicts far more than three-tier).
//
// With the snapshot governing step τ (latest with step < τ) and total = Σ_i a_τ(i):
//   full      = Σ_{j: Full}      mass_τ(j) / total
//   quantized = Σ_{j: Quantized} mass_τ(j) / total
//   evicted   = Σ_{j: Evicted}   mass_τ(j) / total
//   sink      = Σ_{i < S} a_τ(i) / total
//   recent    = Σ_{i ≥ recent_begin} a_τ(i) / total
// and full + quantized + evicted + sink + recent = 1.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <qevict/diagnostics/trace.hpp>
#include <qevict/diagnostics/window_mass.hpp>

namespace qevict::diagnostics {

struct mass_split {
    double full = 0.0;
    double quantized = 0.0;
    double evicted = 0.0;
    double sink = 0.0;
    double recent = 0.0;

    // Sinks and the recent region together: the always-kept share.
    [[nodiscard]] double protected_share() const noexcept { return sink + recent; }
};

// The split of one reference step under the tiers of `snapshot`.
[[nodiscard]] inline mass_split split_attention_mass(const tier_snapshot& snapshot, const attention_step& reference) {
    const std::vector<double> mass = window_mass(snapshot.layout, snapshot.window_count(), reference.probs);
    const double total = detail::total_mass(reference, "split_attention_mass");
    mass_split s;
    for (std::size_t j = 0; j < mass.size(); ++j) {
        switch (snapshot.tiers[j]) {
            case tier::full: s.full += mass[j]; break;
            case tier::quantized: s.quantized += mass[j]; break;
            case tier::evicted: s.evicted += mass[j]; break;
            default: break;  // validate_history admits no other tier
        }
    }
    s.sink = sink_mass(snapshot.layout, reference.probs);
    s.recent = recent_mass(snapshot.recent_begin(), reference.probs);
    s.full /= total;
    s.quantized /= total;
    s.evicted /= total;
    s.sink /= total;
    s.recent /= total;
    return s;
}

// The split averaged over every reference step that some routing event governs (steps before
// the first event have no tiers and are skipped). Throws when no step is governed.
[[nodiscard]] inline mass_split mean_attention_mass_split(std::span<const tier_snapshot> history,
                                                          std::span<const attention_step> trace) {
    validate_history(history);
    validate_trace(trace);
    mass_split sum;
    std::size_t steps = 0;
    for (const attention_step& s : trace) {
        const tier_snapshot* governing = snapshot_governing(history, s.step);
        if (!governing) continue;
        const mass_split one = split_attention_mass(*governing, s);
        sum.full += one.full;
        sum.quantized += one.quantized;
        sum.evicted += one.evicted;
        sum.sink += one.sink;
        sum.recent += one.recent;
        ++steps;
    }
    detail::require(steps > 0, "mean_attention_mass_split",
                    "no reference step comes after a routing event, so no step has tiers");
    const double n = static_cast<double>(steps);
    return {sum.full / n, sum.quantized / n, sum.evicted / n, sum.sink / n, sum.recent / n};
}

}  // namespace qevict::diagnostics

#pragma once
// Scorer policies: what a window's importance is and how it accumulates into the score that
// routing ranks by. The mass of a window at one step is its attention probability summed over
// its tokens and averaged over query heads (Eq. 1's two inner sums and 1/H_q).
//
// A scorer answers five questions, all at compile time:
//   signal            what one attended token contributes: its probability, its probability
//                     times the norm of its value vector, or nothing (position-only scorers)
//   aggregation       how the prefill's observation queries combine: summed (Eq. 1) or the
//                     maximum over queries (a worst-case estimate)
//   pooling           max-pooling width over neighbouring windows, applied to prefill scores
//   initial_score(w)  the score a window starts with
//   accumulate / after_routing   how step masses add up, and what a routing event does to them

#include "qevict/core/platform.hpp"

namespace qevict::scorers {

enum class signal { attention, value_weighted_attention, none };
enum class aggregation { sum, max };

/// Defaults every scorer inherits; a scorer overrides what it changes.
struct scorer_defaults {
  static constexpr signal token_signal = signal::attention;
  static constexpr aggregation prefill_aggregation = aggregation::sum;
  static constexpr int prefill_pooling = 1;
  QEVICT_HOST_DEVICE static float initial_score(int /*window*/) { return 0.0f; }
  QEVICT_HOST_DEVICE static float accumulate(float score, float step_mass) { return score + step_mass; }
  QEVICT_HOST_DEVICE static float after_routing(float score) { return score; }
};

/// Eq. 1: the plain sum over every step since the window appeared; never decays.
struct cumulative_mass : scorer_defaults {
  static constexpr const char* name = "cumulative_mass";
};

/// Like cumulative_mass, but every routing event multiplies the history by Permille/1000, so
/// attention from long ago counts less than recent attention.
template <int Permille = 900>
struct decaying_mass : scorer_defaults {
  static_assert(Permille > 0 && Permille <= 1000, "qevict::scorers::decaying_mass<Permille>: Permille must be in (0, 1000]");
  static constexpr const char* name = "decaying_mass";
  static constexpr float decay = static_cast<float>(Permille) / 1000.0f;
  QEVICT_HOST_DEVICE static float after_routing(float score) { return score * decay; }
};

/// Newer windows rank higher, whatever the attention (StreamingLLM's sliding window).
struct recency : scorer_defaults {
  static constexpr const char* name = "recency";
  static constexpr signal token_signal = signal::none;
  QEVICT_HOST_DEVICE static float initial_score(int window) { return static_cast<float>(window) + 1.0f; }
  QEVICT_HOST_DEVICE static float accumulate(float score, float) { return score; }
};

/// Observation-window scores max-pooled over `Pooling` neighbouring windows (SnapKV's clustering
/// of selected tokens), cumulative afterwards.
template <int Pooling = 7>
struct pooled_observation : scorer_defaults {
  static_assert(Pooling >= 1 && Pooling % 2 == 1, "qevict::scorers::pooled_observation<Pooling>: Pooling must be odd and >= 1");
  static constexpr const char* name = "pooled_observation";
  static constexpr int prefill_pooling = Pooling;
};

/// Attention weighted by the norm of the attended value vector (CriticalKV's value-aware score,
/// ‖W_o^(h) v‖ per query head h when the cache was given the layer's output projection W_o —
/// cache::set_output_projection — and ‖v‖ otherwise).
struct value_weighted_mass : scorer_defaults {
  static constexpr const char* name = "value_weighted_mass";
  static constexpr signal token_signal = signal::value_weighted_attention;
};

/// Prefill scores take each window's worst case (largest mass) over the observation queries
/// instead of their sum, hedging against queries that attend differently later (DefensiveKV's
/// robust aggregation, simplified).
struct defensive_mass : scorer_defaults {
  static constexpr const char* name = "defensive_mass";
  static constexpr aggregation prefill_aggregation = aggregation::max;
};

/// The prefill's aggregation: one observation query's mass of a window folded into the window's
/// prefill mass so far (which starts at 0): their sum (Eq. 1) or the larger of the two.
template <class Scorer>
QEVICT_HOST_DEVICE constexpr double aggregate_observation(double so_far, double query_mass) {
  if constexpr (Scorer::prefill_aggregation == aggregation::max) return query_mass > so_far ? query_mass : so_far;
  else return so_far + query_mass;
}

/// The prefill's pooling: window w's prefill mass after max-pooling over the windows within
/// prefill_pooling / 2 of it, among the `windows` windows the prompt started. `mass[x * stride]`
/// is window x's aggregated mass (masses are non-negative).
template <class Scorer>
QEVICT_HOST_DEVICE constexpr double pooled_prefill_mass(const double* mass, int stride, int w, int windows) {
  const int r = Scorer::prefill_pooling / 2;
  const int first = w - r > 0 ? w - r : 0, last = w + r < windows - 1 ? w + r : windows - 1;
  double m = 0.0;
  for (int x = first; x <= last; ++x) {
    const double a = mass[static_cast<long long>(x) * stride];
    m = a > m ? a : m;
  }
  return m;
}

}  // namespace qevict::scorers

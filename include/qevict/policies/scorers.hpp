#pragma once
// Scorer policies: how a window's per-step attention mass accumulates into the score that
// routing ranks by. The mass of a window at one step is its attention probability summed over
// its tokens and averaged over query heads (Eq. 1's two inner sums and 1/H_q).

#include "qevict/core/platform.hpp"

namespace qevict::scorers {

/// Eq. 1: the plain sum over every step since the window appeared; never decays.
struct cumulative_mass {
  static constexpr const char* name = "cumulative_mass";
  QEVICT_HOST_DEVICE static float accumulate(float score, float step_mass) { return score + step_mass; }
  QEVICT_HOST_DEVICE static float after_routing(float score) { return score; }
};

/// Like cumulative_mass, but every routing event multiplies the history by Permille/1000, so
/// attention from long ago counts less than recent attention.
template <int Permille = 900>
struct decaying_mass {
  static_assert(Permille > 0 && Permille <= 1000, "qevict::scorers::decaying_mass<Permille>: Permille must be in (0, 1000]");
  static constexpr const char* name = "decaying_mass";
  static constexpr float decay = static_cast<float>(Permille) / 1000.0f;
  QEVICT_HOST_DEVICE static float accumulate(float score, float step_mass) { return score + step_mass; }
  QEVICT_HOST_DEVICE static float after_routing(float score) { return score * decay; }
};

}  // namespace qevict::scorers

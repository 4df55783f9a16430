#pragma once
// The window policy: routing unit size W and the two protected regions.

namespace qevict {

/// Windows of `W` tokens after `Sinks` pinned tokens; the newest `Recent` tokens are never routed.
template <int W = 8, int Sinks = 5, int Recent = 32>
struct window {
  static_assert(W == 1 || W == 2 || W == 4 || W == 8 || W == 16 || W == 32,
                "qevict::window<W>: W must be one of 1, 2, 4, 8, 16, 32");
  static_assert(Sinks >= 0, "qevict::window<W, Sinks>: Sinks must be >= 0");
  static_assert(Recent >= 0, "qevict::window<W, Sinks, Recent>: Recent must be >= 0");
  static constexpr int size = W;
  static constexpr int sinks = Sinks;
  static constexpr int recent = Recent;
};

}  // namespace qevict

#pragma once
// The policy bundle. Every component of the algorithm is a compile-time policy; the defaults are
// the paper's configuration (W = 8, 5 sinks, 32 recent tokens, INT2, q = 0.70, Ω = 8, Algorithm 1
// ranking of whole windows, full-precision top tier). Change one policy with a with_* alias:
//
//   using r1 = qevict::config<>::with_window<qevict::window<1, 5, 32>>;

#include "qevict/policies/allocators.hpp"
#include "qevict/policies/full_tier.hpp"
#include "qevict/policies/quantizers.hpp"
#include "qevict/policies/rope.hpp"
#include "qevict/policies/routing.hpp"
#include "qevict/policies/scorers.hpp"
#include "qevict/policies/window.hpp"

namespace qevict {

template <class Scorer = scorers::cumulative_mass,
          class Quantizer = quantizers::asymmetric<2>,
          class Window = window<8, 5, 32>,
          class Allocator = allocators::three_tier<70>,
          class Rope = rope::rotary,
          int RoutingInterval = 8,
          class Routing = routing::ranked,
          class Selection = selection::per_layer,
          class FullTier = full_tier::full_precision>
struct config {
  static_assert(RoutingInterval >= 1, "qevict::config<..., RoutingInterval>: the routing interval Ω must be >= 1");
  using scorer = Scorer;
  using quantizer = Quantizer;
  using window_policy = Window;
  using allocator = Allocator;
  using rope = Rope;
  static constexpr int routing_interval = RoutingInterval;
  using routing_policy = Routing;
  using selection_policy = Selection;
  using full_tier_policy = FullTier;

  template <class S> using with_scorer = config<S, Quantizer, Window, Allocator, Rope, RoutingInterval, Routing, Selection, FullTier>;
  template <class Q> using with_quantizer = config<Scorer, Q, Window, Allocator, Rope, RoutingInterval, Routing, Selection, FullTier>;
  template <class W> using with_window = config<Scorer, Quantizer, W, Allocator, Rope, RoutingInterval, Routing, Selection, FullTier>;
  template <class A> using with_allocator = config<Scorer, Quantizer, Window, A, Rope, RoutingInterval, Routing, Selection, FullTier>;
  template <class R> using with_rope = config<Scorer, Quantizer, Window, Allocator, R, RoutingInterval, Routing, Selection, FullTier>;
  template <int Omega> using with_routing_interval = config<Scorer, Quantizer, Window, Allocator, Rope, Omega, Routing, Selection, FullTier>;
  template <class R> using with_routing = config<Scorer, Quantizer, Window, Allocator, Rope, RoutingInterval, R, Selection, FullTier>;
  template <class S> using with_selection = config<Scorer, Quantizer, Window, Allocator, Rope, RoutingInterval, Routing, S, FullTier>;
  template <class F> using with_full_tier = config<Scorer, Quantizer, Window, Allocator, Rope, RoutingInterval, Routing, Selection, F>;
};

/// The paper's configuration.
using paper_config = config<>;

}  // namespace qevict

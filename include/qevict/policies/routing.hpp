#pragma once
// Routing policies: which windows a routing event may move, and what a routing unit is.

namespace qevict {
namespace routing {

/// Algorithm 1: every event re-ranks Full ∪ Quantized ∪ newly aged windows; promotions and
/// demotions in both directions, eviction for the rest.
struct ranked {
  static constexpr const char* name = "ranked";
  static constexpr bool rerank_after_first_event = true;
};

/// The first event (normally the prefill's) ranks as Algorithm 1 does; afterwards the kept set
/// never changes. Newly aged windows take free Full slots, then free quantized slots, best score
/// first, and are evicted when none is left (SnapKV: selection once, at prefill).
struct frozen_after_prefill {
  static constexpr const char* name = "frozen_after_prefill";
  static constexpr bool rerank_after_first_event = false;
};

}  // namespace routing

namespace selection {

/// One routing decision per window for all KV heads of a layer (the paper: scores averaged over
/// the query heads).
struct per_layer {
  static constexpr const char* name = "per_layer";
  static constexpr bool splits_heads = false;
};

/// Each KV head routes its own windows, ranked together against the other heads' windows for
/// one shared layer budget, so heads that need more get more (AdaKV). Scores are averaged over
/// the query heads of each KV head's group.
struct per_kv_head {
  static constexpr const char* name = "per_kv_head";
  static constexpr bool splits_heads = true;
};

}  // namespace selection
}  // namespace qevict

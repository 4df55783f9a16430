#pragma once
// The byte plan of one (sequence, layer): how the budget splits into sinks, recent region,
// window table, Full pool and quantized pool (the ledger), and where each lives in the region.
// Every size here is exact and every term is reported; both backends use this one plan.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "qevict/config.hpp"
#include "qevict/core/geometry.hpp"
#include "qevict/core/tier.hpp"

namespace qevict {

/// One entry of the window table. A window keeps its entry (and so its identity and score)
/// across every move; its tier follows from the slots it holds (see tier_of).
struct window_record {
  float score = 0.0f;
  std::int32_t full_slot = -1;    ///< index in the Full pool, or -1
  std::int32_t ledger_slot = -1;  ///< index in the quantized pool (ledger), or -1
};

/// A window that has not yet aged out of the recent region is `recent`; after that it is Full
/// while it holds a Full slot (it may also keep its ledger copy), quantized while it holds only
/// ledger codes, and evicted when it holds neither.
QEVICT_HOST_DEVICE constexpr tier tier_of(const window_record& w, bool aged) {
  if (!aged) return tier::recent;
  if (w.full_slot >= 0) return tier::full;
  if (w.ledger_slot >= 0) return tier::quantized;
  return tier::evicted;
}

/// Windows of `window` tokens after `sinks` sinks that hold at least one of `tokens` tokens
/// (complete or not). The kernels call it with their compile-time window size.
QEVICT_HOST_DEVICE constexpr int windows_started(int tokens, int sinks, int window) {
  return tokens > sinks ? (tokens - sinks + window - 1) / window : 0;
}

/// Bytes by term; used both for what a region reserves and for what it currently holds.
struct byte_terms {
  std::size_t sink = 0;
  std::size_t recent = 0;
  std::size_t full = 0;                ///< Full windows
  std::size_t quantized_codes = 0;     ///< codes of Quantized windows
  std::size_t quantized_metadata = 0;  ///< scale/zero of Quantized windows
  std::size_t ledger_copies = 0;       ///< ledger records kept by Full (promoted) windows
  std::size_t tables = 0;              ///< window table and scores
  constexpr std::size_t total() const {
    return sink + recent + full + quantized_codes + quantized_metadata + ledger_copies + tables;
  }
  byte_terms& operator+=(const byte_terms& o) {
    sink += o.sink; recent += o.recent; full += o.full; quantized_codes += o.quantized_codes;
    quantized_metadata += o.quantized_metadata; ledger_copies += o.ledger_copies; tables += o.tables;
    return *this;
  }
};

/// n rounded up to a multiple of 16 bytes: the device kernels copy 16 bytes at a time, so every
/// section and every region starts on such a boundary.
constexpr std::size_t padded16(std::size_t n) { return (n + 15u) & ~std::size_t{15}; }

/// The plan shared by every (sequence, layer) of a cache.
struct region_plan {
  // geometry
  int kv_heads = 0, q_heads = 0, head_dim = 0;
  element_type element = element_type::f32;
  // window policy and routing
  int window = 0, sinks = 0, recent = 0, routing_interval = 0;
  int units = 1;            ///< routing units per window: 1, or kv_heads with selection::per_kv_head
  int heads_per_unit = 0;   ///< KV heads one unit covers
  int recent_capacity = 0;  ///< tokens: recent + window - 1 + Ω (the most the region holds)
  int max_tokens = 0;
  int max_windows = 0;
  // sizes in bytes
  std::size_t token_bytes = 0;        ///< one token, keys and values, all KV heads
  std::size_t full_window_bytes = 0;  ///< M_f of one routing unit (a window, or one KV head of it)
  quantizers::record_layout record{};  ///< ledger record of one unit; M_q = record.window_bytes()
  quantizers::record_layout full_record{};  ///< top-tier record when the full tier is quantized
  std::size_t budget_bytes = 0;       ///< B_total
  std::size_t hist_bytes = 0;         ///< B_hist = B_total − B_sink − B_local − tables
  capacities caps{};                  ///< K_f, K_q
  // offsets of each section inside a region
  std::size_t table_offset = 0, sink_offset = 0, recent_offset = 0, full_offset = 0, ledger_offset = 0;
  std::size_t region_bytes = 0;

  constexpr std::size_t sink_bytes() const { return static_cast<std::size_t>(sinks) * token_bytes; }
  constexpr std::size_t recent_bytes() const { return static_cast<std::size_t>(recent_capacity) * token_bytes; }
  constexpr std::size_t table_entries() const { return static_cast<std::size_t>(max_windows) * units; }
  /// Padded to 16 bytes so that every later section starts 16-byte aligned (device kernels load
  /// 16 bytes at a time); the padding is counted here, in the tables term.
  constexpr std::size_t table_bytes() const { return padded16(table_entries() * sizeof(window_record)); }
  /// Where the ledger ends; the region ends at the next multiple of 16 bytes.
  constexpr std::size_t ledger_end() const { return ledger_offset + caps.quantized * quantized_window_bytes(); }
  /// Regions lie end to end (sequence-major, then layer), so a region is a multiple of 16 bytes too:
  /// records of windows shorter than 8 tokens (e.g. 580 bytes a head at head_dim 128 and W = 1)
  /// can leave a tail of up to 12 bytes, counted in the tables term with the table's own padding.
  constexpr std::size_t tail_padding_bytes() const { return region_bytes - ledger_end(); }
  /// The tables term: the window table and both paddings.
  constexpr std::size_t table_term_bytes() const { return table_bytes() + tail_padding_bytes(); }
  constexpr std::size_t quantized_window_bytes() const { return record.window_bytes(); }
  /// Windows that hold at least one of `tokens` tokens (complete or not).
  constexpr int windows_started(int tokens) const { return qevict::windows_started(tokens, sinks, window); }

  /// What the region reserves, by term (ledger copies share the quantized pool).
  byte_terms reserved() const {
    byte_terms t;
    t.sink = sink_bytes();
    t.recent = recent_bytes();
    t.tables = table_term_bytes();
    t.full = caps.full * full_window_bytes;
    t.quantized_codes = caps.quantized * record.code_bytes();
    t.quantized_metadata = caps.quantized * record.metadata_bytes();
    return t;
  }
};

/// Builds the plan for `Config`, or throws qevict::error naming what does not fit.
template <class Config>
region_plan make_region_plan(const geometry& g, const budget& b, const limits& lim, int layer = 0) {
  using W = typename Config::window_policy;
  using Q = typename Config::quantizer;
  using A = typename Config::allocator;
  using F = typename Config::full_tier_policy;
  detail::require(g.layers > 0 && g.q_heads > 0 && g.kv_heads > 0 && g.head_dim > 0,
                  "geometry: layers, q_heads, kv_heads and head_dim must all be positive");
  detail::require(g.q_heads % g.kv_heads == 0,
                  "geometry: q_heads (" + std::to_string(g.q_heads) + ") must be a multiple of kv_heads (" +
                      std::to_string(g.kv_heads) + ")");
  detail::require(g.head_dim % 8 == 0, "geometry: head_dim (" + std::to_string(g.head_dim) + ") must be a multiple of 8");
  detail::require(g.head_dim <= 512, "geometry: head_dim (" + std::to_string(g.head_dim) + ") must be at most 512");
  detail::require(g.rope.theta > 0.0f && numeric::is_finite(g.rope.theta), "geometry: rope.theta must be positive and finite");
  const rope_params& r = g.rope;
  detail::require(numeric::is_finite(r.llama3_factor), "geometry: rope.llama3_factor must be finite (<= 1: no scaling)");
  if (r.llama3_factor > 1.0f)
    detail::require(r.llama3_low_freq_factor > 0.0f && numeric::is_finite(r.llama3_high_freq_factor) &&
                        r.llama3_high_freq_factor > r.llama3_low_freq_factor && r.llama3_original_max_position > 0,
                    "geometry: with rope.llama3_factor > 1, rope.llama3_low_freq_factor must be positive, "
                    "rope.llama3_high_freq_factor finite and larger than it, and rope.llama3_original_max_position "
                    "positive");
  detail::require(lim.max_batch > 0, "limits: max_batch must be positive");
  detail::require(lim.max_tokens > 0, "limits: max_tokens must be positive");
  // Token counts, window indices and table sizes are ints: 2^30 tokens leaves them room.
  detail::require(lim.max_tokens <= limits::largest_max_tokens,
                  "limits: max_tokens (" + std::to_string(lim.max_tokens) + ") must be at most " +
                      std::to_string(limits::largest_max_tokens));

  region_plan p;
  p.kv_heads = g.kv_heads;
  p.q_heads = g.q_heads;
  p.head_dim = g.head_dim;
  p.element = g.element;
  p.window = W::size;
  p.sinks = W::sinks;
  p.recent = W::recent;
  p.routing_interval = Config::routing_interval;
  p.recent_capacity = W::recent + W::size - 1 + Config::routing_interval;
  p.max_tokens = lim.max_tokens;
  p.max_windows = lim.max_tokens > W::sinks ? (lim.max_tokens - W::sinks + W::size - 1) / W::size : 0;
  p.units = Config::selection_policy::splits_heads ? g.kv_heads : 1;
  p.heads_per_unit = g.kv_heads / p.units;
  p.token_bytes = g.token_bytes();
  p.record = Q::layout(W::size, p.heads_per_unit, g.head_dim);
  if constexpr (F::quantized) {
    p.full_record = F::quantizer::layout(W::size, p.heads_per_unit, g.head_dim);
    p.full_window_bytes = p.full_record.window_bytes();
  } else {
    p.full_window_bytes = static_cast<std::size_t>(W::size) * p.token_bytes / p.units;
  }

  const std::size_t fixed = p.sink_bytes() + p.recent_bytes() + p.table_bytes();
  const std::vector<double>& shares = b.layer_shares();
  double share = 1.0;  // this layer's share, normalised so that the shares average 1
  if (!shares.empty()) {
    detail::require(shares.size() == static_cast<std::size_t>(g.layers),
                    "budget::with_layer_shares: " + std::to_string(shares.size()) + " shares for " + std::to_string(g.layers) +
                        " layers");
    double sum = 0.0;
    for (double x : shares) {
      detail::require(x > 0.0 && x < 1e300, "budget::with_layer_shares: every share must be positive and finite");
      sum += x;
    }
    share = shares[static_cast<std::size_t>(layer)] * static_cast<double>(g.layers) / sum;
  }
  switch (b.what()) {
    case budget::kind::fraction: {
      const double f = b.fraction_value();
      detail::require(f > 0.0 && f <= 1.0, "budget::fraction(" + std::to_string(f) + "): the fraction must be in (0, 1]");
      const double bytes = share * f * static_cast<double>(lim.max_tokens) * static_cast<double>(p.token_bytes);
      // The bound of bytes_per_sequence_layer, checked before the conversion (beyond size_t's
      // range it would be undefined).
      detail::require(bytes <= static_cast<double>(budget::largest_bytes), [&] {
        char text[160];
        std::snprintf(text, sizeof text,
                      "budget::fraction(%g) comes to %.4g bytes per sequence in layer %d, more than 2^48", f, bytes,
                      layer);
        return std::string(text);
      });
      p.budget_bytes = static_cast<std::size_t>(bytes);
      break;
    }
    case budget::kind::bytes:
      // A bound far above any real budget keeps every product of the byte report (budget times
      // layers times sequences) and the shares' doubles exact and in range.
      detail::require(b.bytes_value() <= budget::largest_bytes,
                      "budget::bytes_per_sequence_layer(" + std::to_string(b.bytes_value()) + "): at most " +
                          std::to_string(budget::largest_bytes) + " bytes (2^48) per sequence and layer");
      p.budget_bytes = static_cast<std::size_t>(share * static_cast<double>(b.bytes_value()));
      break;
    case budget::kind::everything:
      p.budget_bytes = fixed + A::bytes_to_keep_all(p.table_entries(), p.full_window_bytes, p.quantized_window_bytes());
      break;
  }
  detail::require(p.budget_bytes >= fixed,
                  "budget of " + std::to_string(p.budget_bytes) + " bytes per sequence in layer " + std::to_string(layer) +
                      " cannot hold the " +
                      std::to_string(W::sinks) + " sinks (" + std::to_string(p.sink_bytes()) + " B), the recent region of " +
                      std::to_string(p.recent_capacity) + " tokens (" + std::to_string(p.recent_bytes()) +
                      " B) and the window table (" + std::to_string(p.table_bytes()) + " B): at least " +
                      std::to_string(fixed) + " bytes are needed");
  p.hist_bytes = p.budget_bytes - fixed;
  p.caps = A::split(p.hist_bytes, p.full_window_bytes, p.quantized_window_bytes(), p.table_entries());
  // Never reserve more than the windows that can exist.
  p.caps.full = std::min(p.caps.full, p.table_entries());
  p.caps.quantized = std::min(p.caps.quantized, p.table_entries());
  // The region ends on a multiple of 16 bytes (tail_padding_bytes). Where that padding does not fit,
  // everything() grows by it and any other budget keeps a record (or a Full window) less.
  const auto padded_end = [&] { return padded16(fixed + p.caps.full * p.full_window_bytes + p.caps.quantized * p.quantized_window_bytes()); };
  if (padded_end() > p.budget_bytes) {
    if (b.what() == budget::kind::everything) {
      p.budget_bytes = padded_end();
      p.hist_bytes = p.budget_bytes - fixed;
    }
    while (padded_end() > p.budget_bytes) {
      if (p.caps.quantized > 0) --p.caps.quantized;
      else --p.caps.full;
    }
  }
  if constexpr (A::keeps_everything) {
    if (p.caps.full + p.caps.quantized < p.table_entries()) {
      // The least history the allocator's own split turns into a tier for every window.
      // bytes_to_keep_all is enough but can be more (mixed_precision: every window in the top tier).
      const std::size_t windows = p.table_entries();
      std::size_t lo = 0, hi = A::bytes_to_keep_all(windows, p.full_window_bytes, p.quantized_window_bytes());
      while (lo < hi) {
        const std::size_t mid = lo + (hi - lo) / 2;
        const capacities c = A::split(mid, p.full_window_bytes, p.quantized_window_bytes(), windows);
        if (std::min(c.full, windows) + std::min(c.quantized, windows) >= windows) hi = mid;
        else lo = mid + 1;
      }
      detail::require(false, std::string("budget of ") + std::to_string(p.budget_bytes) +
                                 " bytes per sequence per layer: allocator " + A::name +
                                 " never evicts, so it needs at least " + std::to_string(fixed + lo) + " bytes for " +
                                 std::to_string(lim.max_tokens) + " tokens");
    }
  }

  p.table_offset = 0;
  p.sink_offset = p.table_offset + p.table_bytes();
  p.recent_offset = p.sink_offset + p.sink_bytes();
  p.full_offset = p.recent_offset + p.recent_bytes();
  p.ledger_offset = p.full_offset + p.caps.full * p.full_window_bytes;
  p.region_bytes = padded16(p.ledger_end());
  detail::require(p.region_bytes <= p.budget_bytes, "internal: region plan exceeds its budget");
  return p;
}

/// Where every (sequence slot, layer) region lies in one arena: slot after slot, each slot holding
/// every layer's region in layer order (each its own size with budget::with_layer_shares).
struct arena_plan {
  std::vector<std::size_t> layer_offset;  ///< of each layer's region within a slot
  std::size_t sequence_stride = 0;        ///< bytes of one slot: every layer's region
  std::size_t bytes = 0;                  ///< the arena: max_batch slots

  std::size_t region_offset(int slot, int layer) const {
    return static_cast<std::size_t>(slot) * sequence_stride + layer_offset[static_cast<std::size_t>(layer)];
  }
};

/// The arena of the layers' region plans for `lim.max_batch` slots; refuses one beyond
/// limits::largest_arena_bytes, which is checked as the sum grows, so that no size wraps around.
inline arena_plan make_arena_plan(const std::vector<region_plan>& plans, const limits& lim) {
  arena_plan a;
  const std::size_t most = limits::largest_arena_bytes;
  auto too_large = [&](const std::string& what) { return "limits: " + what + " would exceed 2^62 bytes"; };
  for (const region_plan& p : plans) {
    // Each region is at most budget::largest_bytes (2^48), so the sum cannot wrap before the check.
    a.layer_offset.push_back(a.sequence_stride);
    a.sequence_stride += p.region_bytes;
    detail::require(a.sequence_stride <= most, [&] {
      return too_large("the regions of one sequence's " + std::to_string(plans.size()) + " layers");
    });
  }
  detail::require(a.sequence_stride <= most / static_cast<std::size_t>(lim.max_batch), [&] {
    return too_large("an arena of max_batch = " + std::to_string(lim.max_batch) + " sequences of " +
                     std::to_string(a.sequence_stride) + " bytes each");
  });
  a.bytes = a.sequence_stride * static_cast<std::size_t>(lim.max_batch);
  return a;
}

/// The region plan of every layer (never empty: layer 0's plan checks that there are layers).
template <class Config>
std::vector<region_plan> make_region_plans(const geometry& g, const budget& b, const limits& lim) {
  std::vector<region_plan> plans{make_region_plan<Config>(g, b, lim, 0)};
  for (int l = 1; l < g.layers; ++l) plans.push_back(make_region_plan<Config>(g, b, lim, l));
  return plans;
}

}  // namespace qevict

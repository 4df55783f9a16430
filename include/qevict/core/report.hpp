#pragma once
// The budget report: every byte term per layer and in total, what is reserved and what is held,
// and the tier counts. Its to_string() is what examples print.

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "qevict/core/layout.hpp"

namespace qevict {

struct tier_counts {
  std::size_t sink_tokens = 0;
  std::size_t recent_tokens = 0;
  std::size_t full = 0;       ///< Full windows
  std::size_t quantized = 0;  ///< Quantized windows
  std::size_t evicted = 0;    ///< Evicted windows
  std::size_t ledger_copies = 0;  ///< Full windows that keep their ledger record
  tier_counts& operator+=(const tier_counts& o) {
    sink_tokens += o.sink_tokens; recent_tokens += o.recent_tokens; full += o.full;
    quantized += o.quantized; evicted += o.evicted; ledger_copies += o.ledger_copies;
    return *this;
  }
};

struct layer_report {
  byte_terms used;      ///< bytes holding data now
  byte_terms reserved;  ///< bytes set aside for the active sequences
  std::size_t budget_bytes = 0;      ///< B_total × active sequences
  std::size_t full_cache_bytes = 0;  ///< what an uncompressed cache would hold for the same tokens
  tier_counts counts;
};

/// Adds one (sequence, layer) with tier counts `c` and `tokens` tokens to its layer's report:
/// what it holds by term, what its region reserves, its budget, and what an uncompressed cache
/// would hold for the same tokens. Every backend builds its report with this.
inline void add_lane(layer_report& lr, const region_plan& p, const tier_counts& c, int tokens) {
  lr.counts += c;
  lr.used.sink += c.sink_tokens * p.token_bytes;
  lr.used.recent += c.recent_tokens * p.token_bytes;
  lr.used.full += c.full * p.full_window_bytes;
  lr.used.quantized_codes += c.quantized * p.record.code_bytes();
  lr.used.quantized_metadata += c.quantized * p.record.metadata_bytes();
  lr.used.ledger_copies += c.ledger_copies * p.quantized_window_bytes();
  lr.used.tables += p.table_term_bytes();
  lr.reserved += p.reserved();
  lr.budget_bytes += p.budget_bytes;
  lr.full_cache_bytes += static_cast<std::size_t>(tokens) * p.token_bytes;
}

/// Device memory a device backend (backend::cuda) allocated at construction, by part: the bytes
/// asked of the allocator, which it may round up. It allocates nothing after construction.
struct device_memory {
  std::size_t arena = 0;             ///< the budgeted regions (required_bytes); 0 with external storage
  std::size_t tables = 0;            ///< lane states, window lists and their counts, free-slot lists,
                                     ///< routing's task lists, rotary frequencies, the error slot
  std::size_t decode_workspace = 0;  ///< split-K partials, window masses and factors, tickets and mass
                                     ///< signals, query fragments
  std::size_t total() const { return arena + tables + decode_workspace; }
};

struct budget_report {
  std::vector<layer_report> layers;
  std::size_t sequences = 0;
  std::size_t units = 1;  ///< routing units per window (KV heads with per-KV-head selection)
  std::size_t budget_per_sequence_layer = 0;
  capacities caps;
  std::size_t full_window_bytes = 0;
  std::size_t quantized_window_bytes = 0;

  byte_terms used_total() const { byte_terms t; for (auto& l : layers) t += l.used; return t; }
  byte_terms reserved_total() const { byte_terms t; for (auto& l : layers) t += l.reserved; return t; }
  std::size_t budget_total() const { std::size_t b = 0; for (auto& l : layers) b += l.budget_bytes; return b; }
  std::size_t full_cache_total() const { std::size_t b = 0; for (auto& l : layers) b += l.full_cache_bytes; return b; }
  tier_counts counts_total() const { tier_counts c; for (auto& l : layers) c += l.counts; return c; }

  std::string to_string() const {
    std::string s;
    char line[256];
    auto row = [&](const char* name, std::size_t used, std::size_t reserved) {
      std::snprintf(line, sizeof line, "  %-22s %14zu %14zu\n", name, used, reserved);
      s += line;
    };
    std::snprintf(line, sizeof line,
                  "qevict budget report: %zu sequence(s), %zu layer(s), K_f = %zu, K_q = %zu, M_f = %zu B, M_q = %zu B%s\n",
                  sequences, layers.size(), caps.full, caps.quantized, full_window_bytes, quantized_window_bytes,
                  units > 1 ? " (per KV head)" : "");
    s += line;
    const byte_terms u = used_total(), r = reserved_total();
    std::snprintf(line, sizeof line, "  %-22s %14s %14s\n", "term (all layers)", "held [B]", "reserved [B]");
    s += line;
    row("sinks", u.sink, r.sink);
    row("recent region", u.recent, r.recent);
    row("full windows", u.full, r.full);
    row("quantized codes", u.quantized_codes, r.quantized_codes);
    row("quantized metadata", u.quantized_metadata, r.quantized_metadata);
    row("ledger copies", u.ledger_copies, 0);
    row("window tables+scores", u.tables, r.tables);
    row("total", u.total(), r.total());
    std::snprintf(line, sizeof line, "  budget %zu B; held %.2f%% of it; uncompressed cache of the same tokens %zu B\n",
                  budget_total(), budget_total() ? 100.0 * static_cast<double>(u.total()) / static_cast<double>(budget_total()) : 0.0,
                  full_cache_total());
    s += line;
    const tier_counts c = counts_total();
    std::snprintf(line, sizeof line, "  windows: %zu full (%zu with ledger copy), %zu quantized, %zu evicted; %zu sink + %zu recent tokens\n",
                  c.full, c.ledger_copies, c.quantized, c.evicted, c.sink_tokens, c.recent_tokens);
    s += line;
    return s;
  }
};

/// One window as introspection shows it.
struct window_info {
  int index = 0;
  long long first_position = 0;
  tier where = tier::recent;
  float score = 0.0f;
  bool has_ledger = false;
  int unit = 0;  ///< routing unit: 0, or the KV head with selection::per_kv_head
};

/// Tier counts of one (sequence, layer) from its window table: sink and recent tokens, and the
/// routing units (windows, or window-heads with per-KV-head selection) of its `aged` windows. Both
/// backends report through this.
inline tier_counts count_tiers(const region_plan& p, const window_record* table, int tokens, int aged) {
  tier_counts c;
  c.sink_tokens = static_cast<std::size_t>(std::min(tokens, p.sinks));
  c.recent_tokens = static_cast<std::size_t>(std::max(0, tokens - p.sinks - aged * p.window));
  for (int e = 0; e < aged * p.units; ++e) {
    switch (tier_of(table[e], true)) {
      case tier::full: ++c.full; c.ledger_copies += table[e].ledger_slot >= 0 ? 1u : 0u; break;
      case tier::quantized: ++c.quantized; break;
      default: ++c.evicted; break;
    }
  }
  return c;
}

/// One window_info per started window and routing unit, oldest window first. `first_position`
/// is the position of the sequence's first token.
inline std::vector<window_info> describe_windows(const region_plan& p, const window_record* table, int tokens, int aged,
                                                 long long first_position) {
  std::vector<window_info> out;
  for (int w = 0; w < p.windows_started(tokens); ++w)
    for (int u = 0; u < p.units; ++u) {
      const window_record& rec = table[w * p.units + u];
      out.push_back(window_info{w, first_position + p.sinks + static_cast<long long>(w) * p.window, tier_of(rec, w < aged),
                                rec.score, rec.ledger_slot >= 0, u});
    }
  return out;
}

}  // namespace qevict

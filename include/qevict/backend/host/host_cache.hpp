#pragma once
// The host backend: the whole algorithm in plain, scalar C++. It is a real backend for CPU
// engines and the oracle every other backend is tested against, so it favours clarity and
// accuracy (double accumulation) over speed.
//
// Memory: one arena, cut into one region per (sequence slot, layer) by region_plan. A region
// holds the window table, the sink tokens, the recent region (a ring), the Full pool and the
// quantized pool (the ledger). Nothing is allocated after construction.
//
// Token storage inside a block of capacity C (sinks, recent ring, one Full window):
//   for each KV head h: keys [C][head_dim], then values [C][head_dim], in the element type.
// Keys are stored after RoPE (so attention over full-precision tokens is a plain dot product);
// the quantized records hold keys before RoPE.
//
// Routing units: with selection::per_layer a window is one unit (all KV heads move together);
// with selection::per_kv_head each KV head of a window is its own unit, with its own table entry
// (index window * units + head), Full slot and ledger record. Everything below works on units.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "qevict/concepts/storage.hpp"
#include "qevict/core/layout.hpp"
#include "qevict/core/records.hpp"
#include "qevict/core/report.hpp"
#include "qevict/core/routing.hpp"
#include "qevict/core/sequences.hpp"

namespace qevict {

/// One attended token, as the optional attend() observer sees it.
struct attention_event {
  int batch_index = 0;  ///< position of the sequence in the attend() call
  int token = 0;        ///< token index in the sequence (0 = first token)
  int window = -1;      ///< window index, or -1 for a sink token
  tier where = tier::sink;
  int unit = 0;              ///< routing unit: 0, or the KV head with selection::per_kv_head
  /// Attention probability summed over the unit's query heads, divided by all query heads, so
  /// that the events of one step sum to 1 over every token and unit.
  double probability = 0.0;
};

/// The observer used when none is given.
struct no_observer {
  void operator()(const attention_event&) const {}
};

namespace backend {

template <class Config>
class host_cache;

/// Backend tag: scalar host code.
struct host {
  static constexpr const char* name = "host";
  template <class Config>
  using engine = host_cache<Config>;
};

template <class Config>
class host_cache {
  using quantizer = typename Config::quantizer;
  using scorer = typename Config::scorer;
  using rope = typename Config::rope;
  using full_tier = typename Config::full_tier_policy;
  static constexpr bool rerank = Config::routing_policy::rerank_after_first_event;

 public:
  host_cache(const geometry& g, const budget& b, const limits& lim, const options& opt, std::byte* external,
             std::size_t external_bytes)
      : host_cache(g, b, lim, opt, nullptr, 0, no_arena{}) {
    // One arena (the cache's own, or the engine's range): the regions of one sequence lie back
    // to back.
    const std::size_t need = required_bytes();
    std::byte* arena = external;
    if (external != nullptr) {
      detail::require(external_bytes >= need, "external storage of " + std::to_string(external_bytes) +
                                                  " bytes is smaller than the " + std::to_string(need) + " bytes required");
      detail::require(reinterpret_cast<std::uintptr_t>(external) % 16 == 0, "external storage must be 16-byte aligned");
    } else {
      owned_.resize(need);
      arena = owned_.data();
    }
    for (int s = 0; s < lim.max_batch; ++s)
      for (int l = 0; l < g.layers; ++l) regions_.push_back(arena + arena_.region_offset(s, l));
    initialise();
  }

  /// Regions from the engine's allocator, one per (sequence slot, layer).
  host_cache(const geometry& g, const budget& b, const limits& lim, const options& opt, const storage::regions& from)
      : host_cache(g, b, lim, opt, nullptr, 0, no_arena{}) {
    detail::require(static_cast<bool>(from.provide), "storage::regions: no provide function");
    for (int s = 0; s < lim.max_batch; ++s)
      for (int l = 0; l < g.layers; ++l) {
        void* p = from.provide(s, l, plan(l).region_bytes);
        detail::require(p != nullptr, "storage::regions: provide(" + std::to_string(s) + ", " + std::to_string(l) +
                                          ") returned null");
        detail::require(reinterpret_cast<std::uintptr_t>(p) % 16 == 0,
                        "storage::regions: the region of slot " + std::to_string(s) + ", layer " + std::to_string(l) +
                            " is not 16-byte aligned");
        regions_.push_back(static_cast<std::byte*>(p));
      }
    initialise();
  }

 private:
  struct no_arena {};
  /// Plans only: the regions come later. Layers share everything but their budget
  /// (budget::with_layer_shares): each gets its own capacities and region size.
  host_cache(const geometry& g, const budget& b, const limits& lim, const options& opt, std::byte*, std::size_t,
             no_arena)
      : geo_(g),
        lim_(lim),
        opt_(opt),
        plans_(make_region_plans<Config>(g, b, lim)),
        plan_(plans_.front()),
        arena_(make_arena_plan(plans_, lim)),
        sequences_(lim.max_batch) {
    detail::require(opt.observation_window >= 1, "options: observation_window must be >= 1");
  }

  /// Everything but the regions: lanes, sequences and scratch buffers.
  void initialise() {
    const geometry& g = geo_;
    const limits& lim = lim_;
    inv_freq_ = rope::inverse_frequencies(g.rope, g.head_dim);
    lanes_.resize(static_cast<std::size_t>(lim.max_batch) * g.layers);
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      const region_plan& p = plans_[i % static_cast<std::size_t>(g.layers)];
      lanes_[i].free_full.reserve(p.caps.full);
      lanes_[i].free_ledger.reserve(p.caps.quantized);
    }
    capacities most{};
    for (const region_plan& p : plans_) {
      most.full = std::max(most.full, p.caps.full);
      most.quantized = std::max(most.quantized, p.caps.quantized);
    }
    const std::size_t d = static_cast<std::size_t>(g.head_dim);
    const std::size_t max_access = static_cast<std::size_t>(plan_.sinks) +
                                   (most.full + most.quantized) * plan_.window +
                                   static_cast<std::size_t>(plan_.recent_capacity);
    keys_.resize(max_access * d);
    values_.resize(max_access * d);
    logits_.resize(max_access);
    token_mass_.resize(max_access);
    token_score_.resize(max_access);
    token_index_.resize(max_access);
    window_mass_.resize(static_cast<std::size_t>(plan_.max_windows) + 1);
    query_.resize(d);
    head_out_.resize(d);
    const std::size_t window_floats = std::max(static_cast<std::size_t>(plan_.window) * plan_.heads_per_unit,
                                               static_cast<std::size_t>(g.kv_heads)) * d;
    window_keys_.resize(window_floats);
    window_values_.resize(window_floats);
    candidates_.resize(plan_.table_entries());
    gram_.resize(static_cast<std::size_t>(g.layers));
  }

 public:

  // ---- sizes -------------------------------------------------------------------------------
  const region_plan& plan() const { return plan_; }
  const region_plan& plan(int layer) const { return plans_[static_cast<std::size_t>(layer)]; }
  const geometry& geo() const { return geo_; }
  const limits& lim() const { return lim_; }
  const options& opts() const { return opt_; }
  std::size_t required_bytes() const { return arena_.bytes; }

  // ---- sequences ---------------------------------------------------------------------------
  sequence_id add_sequence(long long first_position) {
    const sequence_id s = sequences_.take(first_position);
    for (int l = 0; l < geo_.layers; ++l) reset_lane(s, l);
    return s;
  }
  void remove_sequence(sequence_id s) { sequences_.release(s); }
  bool is_active(sequence_id s) const { return sequences_.active(s); }
  int tokens(sequence_id s, int layer) const { return lane_of(s, layer).tokens; }
  long long first_position(sequence_id s) const { return sequences_.first_position(s); }
  /// Whether an append to (s, layer) needs a routing event first to make room in the recent ring.
  bool recent_full(sequence_id s, int layer) const {
    const lane_state& lane = lane_of(s, layer);
    return lane.tokens >= plan_.sinks && recent_count(lane) >= plan_.recent_capacity;
  }

  // ---- prefill -----------------------------------------------------------------------------
  /// Inputs were validated by cache<>: the lane is empty, shapes match, values are finite.
  /// `q` holds the queries of the last `q_rows` prompt tokens (q_rows == n when `out` is given);
  /// without `out` only those queries are attended, for the observation-window scores.
  void prefill(int layer, sequence_id s, const float* q, int q_rows, const float* k, const float* v, float* out, int n) {
    const int d = geo_.head_dim, hkv = geo_.kv_heads, hq = geo_.q_heads;
    const std::size_t krow = static_cast<std::size_t>(hkv) * d, qrow = static_cast<std::size_t>(hq) * d;
    const long long p0 = first_position(s);
    // RoPE on copies of the prompt's keys and queries.
    const int q0 = n - q_rows;  // token index of the first given query
    prefill_keys_.assign(k, k + static_cast<std::size_t>(n) * krow);
    prefill_queries_.assign(q, q + static_cast<std::size_t>(q_rows) * qrow);
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < hkv; ++h) rope::rotate(geo_.rope.layout, inv_freq_.data(), d, &prefill_keys_[i * krow + h * d], p0 + i);
    for (int i = 0; i < q_rows; ++i)
      for (int h = 0; h < hq; ++h)
        rope::rotate(geo_.rope.layout, inv_freq_.data(), d, &prefill_queries_[i * qrow + h * d], p0 + q0 + i);
    // Exact causal attention over the prompt; the last `observation_window` queries score windows:
    // each query's window masses (per unit) are combined by the scorer's aggregation.
    const int first_observer = std::max(q0, n - opt_.observation_window);
    const int U = plan_.units, started = windows_started(n);
    const double unit_queries = static_cast<double>(hq) / U;
    std::vector<double> mass(static_cast<std::size_t>(started) * U, 0.0), query_mass(mass.size());
    std::vector<double> logits(static_cast<std::size_t>(n));
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const int group = hq / hkv;
    for (int i = out ? q0 : first_observer; i < n; ++i) {
      const bool observer = i >= first_observer;
      std::fill(query_mass.begin(), query_mass.end(), 0.0);
      for (int h = 0; h < hq; ++h) {
        const int kvh = h / group, u = kvh / plan_.heads_per_unit;
        const float* qi = &prefill_queries_[(i - q0) * qrow + h * d];
        double m = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const float* kj = &prefill_keys_[j * krow + kvh * d];
          double dot = 0.0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * kj[c];
          logits[static_cast<std::size_t>(j)] = dot * scale;
          m = std::max(m, logits[static_cast<std::size_t>(j)]);
        }
        double sum = 0.0;
        for (int j = 0; j <= i; ++j) sum += (logits[static_cast<std::size_t>(j)] = std::exp(logits[static_cast<std::size_t>(j)] - m));
        for (int c = 0; c < d; ++c) head_out_[static_cast<std::size_t>(c)] = 0.0;
        for (int j = 0; j <= i; ++j) {
          const double p = logits[static_cast<std::size_t>(j)] / sum;
          const float* vj = &v[j * krow + kvh * d];
          for (int c = 0; c < d; ++c) head_out_[static_cast<std::size_t>(c)] += p * vj[c];
          if (observer && j >= plan_.sinks)
            query_mass[static_cast<std::size_t>((j - plan_.sinks) / plan_.window * U + u)] += token_weight(vj, layer, h) * p / unit_queries;
        }
        if (out)
          for (int c = 0; c < d; ++c) out[i * qrow + h * d + c] = static_cast<float>(head_out_[static_cast<std::size_t>(c)]);
      }
      if (observer)
        for (std::size_t e = 0; e < mass.size(); ++e)
          mass[e] = scorers::aggregate_observation<scorer>(mass[e], query_mass[e]);
    }
    // Initial scores: the scorer's max-pooling over neighbouring windows of the same unit.
    lane_state& lane = lane_of(s, layer);
    std::byte* region = region_of(s, layer);
    window_record* table = table_of(region);
    for (int e = 0; e < started * U; ++e) {
      const double m = scorers::pooled_prefill_mass<scorer>(mass.data() + e % U, U, e / U, started);
      table[e].score = scorer::accumulate(scorer::initial_score(e / U), static_cast<float>(m));
    }
    // Place the tokens: sinks, then the recent ring, then route the aged windows.
    lane.tokens = n;
    const int aged_after = aged_windows_for(n);
    for (int i = 0; i < n; ++i) {
      if (i < plan_.sinks || i >= plan_.sinks + aged_after * plan_.window)
        store_token(region, i, &prefill_keys_[i * krow], &v[i * krow]);
    }
    route_lane(s, layer, [&](int w, int u, float* kw, float* vw) {
      const int hu = plan_.heads_per_unit;
      for (int j = 0; j < plan_.window; ++j) {
        const std::size_t row = static_cast<std::size_t>(plan_.sinks + w * plan_.window + j) * krow + static_cast<std::size_t>(u) * hu * d;
        std::copy_n(&prefill_keys_[row], static_cast<std::size_t>(hu) * d, kw + static_cast<std::size_t>(j) * hu * d);
        std::copy_n(&v[row], static_cast<std::size_t>(hu) * d, vw + static_cast<std::size_t>(j) * hu * d);
      }
    });
  }

  // ---- decode ------------------------------------------------------------------------------
  /// Appends one token (pre-RoPE key, value: [kv_heads][head_dim]) to (s, layer).
  void append(int layer, sequence_id s, const float* k_pre, const float* v) {
    if (recent_full(s, layer)) route_lane(s, layer, recent_source(s, layer));
    lane_state& lane = lane_of(s, layer);
    const int d = geo_.head_dim, hkv = geo_.kv_heads;
    const std::size_t row = static_cast<std::size_t>(hkv) * d;
    std::copy_n(k_pre, row, window_keys_.data());
    for (int h = 0; h < hkv; ++h)
      rope::rotate(geo_.rope.layout, inv_freq_.data(), d, &window_keys_[static_cast<std::size_t>(h) * d],
                   first_position(s) + lane.tokens);
    std::byte* region = region_of(s, layer);
    store_token(region, lane.tokens, window_keys_.data(), v);
    const int i = lane.tokens;
    if (i >= plan_.sinks && (i - plan_.sinks) % plan_.window == 0) {  // first token of a new window
      const int w = (i - plan_.sinks) / plan_.window;
      for (int u = 0; u < plan_.units; ++u) table_of(region)[w * plan_.units + u].score = scorer::initial_score(w);
    }
    ++lane.tokens;
  }

  /// Attention of one query (pre-RoPE, [q_heads][head_dim]) at the sequence's newest position.
  template <class Observer>
  void attend(int layer, sequence_id s, int batch_index, const float* q_pre, float* out, Observer&& observe) {
    lane_state& lane = lane_of(s, layer);
    window_record* table = table_of(region_of(s, layer));
    const int d = geo_.head_dim, hq = geo_.q_heads, group = hq / geo_.kv_heads;
    const int U = plan_.units, hu = plan_.heads_per_unit;
    const double unit_queries = static_cast<double>(hq) / U;
    const long long position = first_position(s) + lane.tokens - 1;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const int touched = windows_started(lane.tokens);
    // Units attend over their own token sets (they differ with per-KV-head selection); the heads
    // of one unit share it, so probabilities and masses are summed per unit.
    for (int u = 0; u < U; ++u) {
      int count = 0;
      for (int hl = 0; hl < hu; ++hl) {
        const int h = u * hu + hl;
        count = gather_head(s, layer, h);
        if (hl == 0) {
          std::fill_n(token_mass_.begin(), count, 0.0);
          std::fill_n(token_score_.begin(), count, 0.0);
        }
        for (int g = 0; g < group; ++g) {
          const int qh = h * group + g;
          for (int c = 0; c < d; ++c) query_[static_cast<std::size_t>(c)] = q_pre[qh * d + c];
          rope::rotate(geo_.rope.layout, inv_freq_.data(), d, query_.data(), position);
          double m = -INFINITY;
          for (int t = 0; t < count; ++t) {
            const double* kt = &keys_[static_cast<std::size_t>(t) * d];
            double dot = 0.0;
            for (int c = 0; c < d; ++c) dot += query_[static_cast<std::size_t>(c)] * kt[c];
            logits_[static_cast<std::size_t>(t)] = dot * scale;
            m = std::max(m, logits_[static_cast<std::size_t>(t)]);
          }
          double sum = 0.0;
          for (int t = 0; t < count; ++t) sum += (logits_[static_cast<std::size_t>(t)] = std::exp(logits_[static_cast<std::size_t>(t)] - m));
          std::fill(head_out_.begin(), head_out_.end(), 0.0);
          for (int t = 0; t < count; ++t) {
            const double p = logits_[static_cast<std::size_t>(t)] / sum;
            const double* vt = &values_[static_cast<std::size_t>(t) * d];
            token_mass_[static_cast<std::size_t>(t)] += p / hq;
            token_score_[static_cast<std::size_t>(t)] += token_weight(vt, layer, qh) * p / unit_queries;
            for (int c = 0; c < d; ++c) head_out_[static_cast<std::size_t>(c)] += p * vt[c];
          }
          for (int c = 0; c < d; ++c) out[qh * d + c] = static_cast<float>(head_out_[static_cast<std::size_t>(c)]);
        }
      }
      // Window mass of this unit: the step's probability summed over each window's tokens.
      std::fill_n(window_mass_.begin(), touched, 0.0);
      for (int t = 0; t < count; ++t) {
        const int i = token_index_[static_cast<std::size_t>(t)];
        const int w = i < plan_.sinks ? -1 : (i - plan_.sinks) / plan_.window;
        if (w >= 0) window_mass_[static_cast<std::size_t>(w)] += token_score_[static_cast<std::size_t>(t)];
        observe(attention_event{batch_index, i, w, where_is(lane, table, i, u), u, token_mass_[static_cast<std::size_t>(t)]});
      }
      for (int w = 0; w < touched; ++w) {
        window_record& rec = table[w * U + u];
        if (tier_of(rec, w < lane.aged) != tier::evicted)
          rec.score = scorer::accumulate(rec.score, static_cast<float>(window_mass_[static_cast<std::size_t>(w)]));
      }
    }
    ++lane.steps_since_route;
    if (opt_.routing == routing_mode::automatic && lane.steps_since_route >= Config::routing_interval)
      route_lane(s, layer, recent_source(s, layer));
  }

  /// A routing event for (s, layer) now (Algorithm 1).
  void route(sequence_id s, int layer) { route_lane(s, layer, recent_source(s, layer)); }

  // ---- introspection -----------------------------------------------------------------------
  /// One entry per window and routing unit, oldest window first.
  std::vector<window_info> windows(sequence_id s, int layer) const {
    const lane_state& lane = lane_of(s, layer);
    return describe_windows(plan_, table_of(region_of(s, layer)), lane.tokens, lane.aged, first_position(s));
  }

  /// Tier counts in routing units (windows, or window-heads with per-KV-head selection).
  tier_counts counts(sequence_id s, int layer) const {
    const lane_state& lane = lane_of(s, layer);
    return count_tiers(plan_, table_of(region_of(s, layer)), lane.tokens, lane.aged);
  }

  budget_report report() const {
    budget_report r;
    r.caps = plan_.caps;  // layer 0's; budget::with_layer_shares gives each layer its own
    r.units = static_cast<std::size_t>(plan_.units);
    r.budget_per_sequence_layer = plan_.budget_bytes;
    r.full_window_bytes = plan_.full_window_bytes;
    r.quantized_window_bytes = plan_.quantized_window_bytes();
    r.layers.resize(static_cast<std::size_t>(geo_.layers));
    for (sequence_id s = 0; s < sequences_.size(); ++s) {
      if (!sequences_.active(s)) continue;
      ++r.sequences;
      for (int l = 0; l < geo_.layers; ++l) {
        add_lane(r.layers[static_cast<std::size_t>(l)], plan(l), counts(s, l), lane_of(s, l).tokens);
      }
    }
    return r;
  }

  /// Keys (after RoPE) and values of window w exactly as attention sees them, each
  /// [window][kv_heads][head_dim]. Throws if any unit of the window is evicted.
  void read_window(sequence_id s, int layer, int w, float* k_post, float* v) const {
    const lane_state& lane = lane_of(s, layer);
    const std::byte* region = region_of(s, layer);
    const int d = geo_.head_dim, hkv = geo_.kv_heads, hu = plan_.heads_per_unit;
    std::vector<float> kw(static_cast<std::size_t>(plan_.window) * hu * d), vw(kw.size());
    for (int u = 0; u < plan_.units; ++u) {
      const window_record& rec = table_of(region)[w * plan_.units + u];
      const tier t = tier_of(rec, w < lane.aged);
      detail::require(t != tier::evicted, "read_window: window " + std::to_string(w) + " is evicted");
      if (t == tier::full) {
        load_full(s, w, region, rec, kw.data(), vw.data());
      } else if (t == tier::quantized) {
        dequantize_rotated(s, w, ledger_of(layer, region, rec.ledger_slot), plan_.record, kw.data(), vw.data());
      } else {
        detail::require(plan_.sinks + (w + 1) * plan_.window <= lane.tokens,
                        "read_window: window " + std::to_string(w) + " is not complete yet");
        load_recent(s, layer, w, u, kw.data(), vw.data());
      }
      for (int j = 0; j < plan_.window; ++j)
        for (int hl = 0; hl < hu; ++hl) {
          const std::size_t from = (static_cast<std::size_t>(j) * hu + hl) * d;
          const std::size_t to = (static_cast<std::size_t>(j) * hkv + u * hu + hl) * d;
          std::copy_n(&kw[from], d, k_post + to);
          std::copy_n(&vw[from], d, v + to);
        }
    }
  }

  /// The bytes of the ledger record of window w, unit `unit` (empty when it has none).
  std::span<const std::uint8_t> ledger_record(sequence_id s, int layer, int w, int unit = 0) const {
    const std::byte* region = region_of(s, layer);
    const window_record& rec = table_of(region)[w * plan_.units + unit];
    if (rec.ledger_slot < 0) return {};
    return {ledger_of(layer, region, rec.ledger_slot), plan_.quantized_window_bytes()};
  }

  /// Replace window w's cumulative score, of one unit or (unit < 0) of all its units (for
  /// external importance signals and experiments).
  void set_score(sequence_id s, int layer, int w, float score, int unit = -1) {
    window_record* table = table_of(region_of(s, layer));
    for (int u = 0; u < plan_.units; ++u)
      if (unit < 0 || unit == u) table[w * plan_.units + u].score = score;
  }

  int windows_started(int tokens) const { return plan_.windows_started(tokens); }
  int aged(sequence_id s, int layer) const { return lane_of(s, layer).aged; }

  /// Keeps, for each query head h, the Gram matrix G_h = W_o^(h)ᵀ W_o^(h) of the layer's output
  /// projection (w_o: [hidden][q_heads * head_dim], validated by cache<>), so that
  /// ‖W_o^(h) v‖ = sqrt(vᵀ G_h v) costs head_dim² per token rather than hidden · head_dim.
  void set_output_projection(int layer, const float* w_o, int hidden) {
    const int d = geo_.head_dim, hq = geo_.q_heads;
    const std::size_t columns = static_cast<std::size_t>(hq) * d;
    std::vector<double> gram(static_cast<std::size_t>(hq) * d * d, 0.0);
    for (int h = 0; h < hq; ++h) {
      double* g = gram.data() + static_cast<std::size_t>(h) * d * d;
      for (int r = 0; r < hidden; ++r) {
        const float* row = w_o + static_cast<std::size_t>(r) * columns + static_cast<std::size_t>(h) * d;
        for (int a = 0; a < d; ++a)
          for (int b = 0; b < d; ++b) g[static_cast<std::size_t>(a) * d + b] += static_cast<double>(row[a]) * row[b];
      }
    }
    gram_[static_cast<std::size_t>(layer)] = std::move(gram);
  }

 private:
  struct lane_state {
    int tokens = 0;             ///< tokens appended to this (sequence, layer)
    int aged = 0;               ///< windows that have left the recent region
    int steps_since_route = 0;  ///< attend() calls since the last routing event
    bool routed = false;        ///< at least one routing event happened
    std::vector<std::int32_t> free_full, free_ledger;
  };

  /// A block of token rows in the element type: [heads][keys C | values C][head_dim].
  struct block {
    const void* base;
    int capacity, head_dim;
    element_type e;
    std::size_t key_index(int h, int slot, int c) const {
      return (static_cast<std::size_t>(2 * h) * capacity + slot) * head_dim + c;
    }
    std::size_t value_index(int h, int slot, int c) const {
      return (static_cast<std::size_t>(2 * h + 1) * capacity + slot) * head_dim + c;
    }
    float key(int h, int slot, int c) const { return numeric::load(e, base, key_index(h, slot, c)); }
    float value(int h, int slot, int c) const { return numeric::load(e, base, value_index(h, slot, c)); }
    void put(int h, int slot, const float* k, const float* v) const {
      void* b = const_cast<void*>(base);
      for (int c = 0; c < head_dim; ++c) {
        numeric::store(e, b, key_index(h, slot, c), k[c]);
        numeric::store(e, b, value_index(h, slot, c), v[c]);
      }
    }
  };

  lane_state& lane_of(sequence_id s, int layer) { return lanes_[static_cast<std::size_t>(s) * geo_.layers + layer]; }
  const lane_state& lane_of(sequence_id s, int layer) const {
    return lanes_[static_cast<std::size_t>(s) * geo_.layers + layer];
  }
  std::byte* region_of(sequence_id s, int layer) {
    return regions_[static_cast<std::size_t>(s) * geo_.layers + layer];
  }
  const std::byte* region_of(sequence_id s, int layer) const {
    return regions_[static_cast<std::size_t>(s) * geo_.layers + layer];
  }
  static window_record* table_of(std::byte* region) { return reinterpret_cast<window_record*>(region); }
  static const window_record* table_of(const std::byte* region) { return reinterpret_cast<const window_record*>(region); }
  block sink_block(const std::byte* region) const {
    return block{region + plan_.sink_offset, plan_.sinks, geo_.head_dim, geo_.element};
  }
  block recent_block(const std::byte* region) const {
    return block{region + plan_.recent_offset, plan_.recent_capacity, geo_.head_dim, geo_.element};
  }
  const std::byte* full_slot_of(const std::byte* region, int slot) const {
    return region + plan_.full_offset + static_cast<std::size_t>(slot) * plan_.full_window_bytes;
  }
  /// A Full slot of the full-precision tier: one unit's heads, `window` tokens.
  block full_block(const std::byte* region, int slot) const {
    return block{full_slot_of(region, slot), plan_.window, geo_.head_dim, geo_.element};
  }
  std::uint8_t* ledger_of(int layer, std::byte* region, int slot) const {
    return reinterpret_cast<std::uint8_t*>(region + plan(layer).ledger_offset +
                                           static_cast<std::size_t>(slot) * plan_.quantized_window_bytes());
  }
  const std::uint8_t* ledger_of(int layer, const std::byte* region, int slot) const {
    return reinterpret_cast<const std::uint8_t*>(region + plan(layer).ledger_offset +
                                                 static_cast<std::size_t>(slot) * plan_.quantized_window_bytes());
  }

  long long window_first_position(sequence_id s, int w) const {
    return first_position(s) + plan_.sinks + static_cast<long long>(w) * plan_.window;
  }
  /// Complete windows whose tokens are all older than the newest `recent` tokens.
  int aged_windows_for(int tokens) const {
    const int span = tokens - plan_.sinks - plan_.recent;
    return span > 0 ? span / plan_.window : 0;
  }
  int recent_count(const lane_state& lane) const {
    return std::max(0, lane.tokens - plan_.sinks - lane.aged * plan_.window);
  }
  tier where_is(const lane_state& lane, const window_record* table, int i, int unit) const {
    if (i < plan_.sinks) return tier::sink;
    const int w = (i - plan_.sinks) / plan_.window;
    return tier_of(table[w * plan_.units + unit], w < lane.aged);
  }
  /// What one attended token contributes to its window's score, per unit of probability from query
  /// head qh: 1 for attention mass; for value-weighted attention ‖W_o^(qh) v‖ = sqrt(vᵀ G_qh v)
  /// when the layer's output projection was given, else ‖v‖; 0 for position-only scorers.
  template <class T>
  double token_weight(const T* value, int layer, int qh) const {
    if constexpr (scorer::token_signal == scorers::signal::value_weighted_attention) {
      const int d = geo_.head_dim;
      double sq = 0.0;
      const std::vector<double>& gram = gram_[static_cast<std::size_t>(layer)];
      if (gram.empty()) {
        for (int c = 0; c < d; ++c) sq += static_cast<double>(value[c]) * value[c];
      } else {
        const double* g = gram.data() + static_cast<std::size_t>(qh) * d * d;
        for (int a = 0; a < d; ++a) {
          double row = 0.0;
          for (int b = 0; b < d; ++b) row += g[static_cast<std::size_t>(a) * d + b] * static_cast<double>(value[b]);
          sq += static_cast<double>(value[a]) * row;
        }
        sq = std::max(sq, 0.0);  // a Gram form is >= 0; rounding may dip below
      }
      return std::sqrt(sq);
    } else if constexpr (scorer::token_signal == scorers::signal::none) {
      (void)value;
      return 0.0;
    } else {
      (void)value;
      return 1.0;
    }
  }

  void reset_lane(int s, int layer) {
    lane_state& lane = lane_of(s, layer);
    lane.tokens = lane.aged = lane.steps_since_route = 0;
    lane.routed = false;
    lane.free_full.clear();
    lane.free_ledger.clear();
    for (int i = static_cast<int>(plan(layer).caps.full) - 1; i >= 0; --i) lane.free_full.push_back(i);
    for (int i = static_cast<int>(plan(layer).caps.quantized) - 1; i >= 0; --i) lane.free_ledger.push_back(i);
    window_record* table = table_of(region_of(s, layer));
    for (std::size_t e = 0; e < plan_.table_entries(); ++e) table[e] = window_record{};
  }

  /// Stores token i (post-RoPE key, value; [kv_heads][head_dim]) in the sinks or the recent ring.
  void store_token(std::byte* region, int i, const float* k_post, const float* v) {
    const int d = geo_.head_dim;
    const block b = i < plan_.sinks ? sink_block(region) : recent_block(region);
    const int slot = i < plan_.sinks ? i : (i - plan_.sinks) % plan_.recent_capacity;
    for (int h = 0; h < geo_.kv_heads; ++h) b.put(h, slot, k_post + h * d, v + h * d);
  }

  /// Dequantizes a record (one unit's heads) into post-RoPE keys and values, [window][hu][d].
  template <class Q = quantizer>
  void dequantize_rotated(sequence_id s, int w, const std::uint8_t* record, const quantizers::record_layout& layout,
                          float* k_post, float* v) const {
    dequantize_window<Q, rope>(layout, record, geo_.rope.layout, inv_freq_.data(), window_first_position(s, w), k_post, v);
  }

  /// Rotates a dequantized key of token j of window w by quantizer Q's read rotation (direction
  /// +1), or a post-RoPE key back into Q's key frame (direction -1), in place.
  template <class Q, class T>
  void read_rotate(sequence_id s, int w, int j, T* k, int direction = +1) const {
    if constexpr (!Q::key_frame::rotated) {
      const long long t0 = window_first_position(s, w);
      rope::rotate(geo_.rope.layout, inv_freq_.data(), geo_.head_dim, k, Q::key_frame::read_rotation(t0, t0 + j), direction);
    }
  }

  /// Rotates post-RoPE keys [window][hu][d] of window w into quantizer Q's key frame, in place.
  template <class Q>
  void to_key_frame(sequence_id s, int w, float* k) const {
    const int d = geo_.head_dim, hu = plan_.heads_per_unit;
    for (int j = 0; j < plan_.window; ++j)
      for (int hl = 0; hl < hu; ++hl) read_rotate<Q>(s, w, j, k + (static_cast<std::size_t>(j) * hu + hl) * d, -1);
  }

  /// Copies the accessible keys (post-RoPE) and values of KV head h into keys_/values_ in token
  /// order: sinks, aged Full and Quantized windows, recent region. Returns the count.
  int gather_head(sequence_id s, int layer, int h) {
    const lane_state& lane = lane_of(s, layer);
    const std::byte* region = region_of(s, layer);
    const window_record* table = table_of(region);
    const int d = geo_.head_dim, hu = plan_.heads_per_unit, u = h / hu, hl = h % hu;
    int n = 0;
    auto push = [&](int token, auto&& key_of, auto&& value_of) {
      for (int c = 0; c < d; ++c) {
        keys_[static_cast<std::size_t>(n) * d + c] = key_of(c);
        values_[static_cast<std::size_t>(n) * d + c] = value_of(c);
      }
      token_index_[static_cast<std::size_t>(n)] = token;
      ++n;
    };
    const block sinks = sink_block(region);
    for (int i = 0; i < std::min(lane.tokens, plan_.sinks); ++i)
      push(i, [&](int c) { return sinks.key(h, i, c); }, [&](int c) { return sinks.value(h, i, c); });
    float kq[512], vq[512];  // one quantized token's head vector (head_dim <= 512)
    double kr[512];
    auto push_quantized = [&](int w, auto q_tag, const std::uint8_t* r, const quantizers::record_layout& layout) {
      using Q = typename decltype(q_tag)::type;
      const int first = plan_.sinks + w * plan_.window;
      for (int j = 0; j < plan_.window; ++j) {
        Q::dequantize_key(layout, r, hl, j, kq);
        Q::dequantize_value(layout, r, hl, j, vq);
        for (int c = 0; c < d; ++c) kr[c] = kq[c];
        read_rotate<Q>(s, w, j, kr);
        push(first + j, [&](int c) { return kr[c]; }, [&](int c) { return static_cast<double>(vq[c]); });
      }
    };
    for (int w = 0; w < lane.aged; ++w) {
      const window_record& rec = table[w * plan_.units + u];
      const tier t = tier_of(rec, true);
      if (t == tier::full) {
        if constexpr (full_tier::quantized) {
          push_quantized(w, type_tag<typename full_tier::quantizer>{},
                         reinterpret_cast<const std::uint8_t*>(full_slot_of(region, rec.full_slot)), plan_.full_record);
        } else {
          const block b = full_block(region, rec.full_slot);
          const int first = plan_.sinks + w * plan_.window;
          for (int j = 0; j < plan_.window; ++j)
            push(first + j, [&](int c) { return b.key(hl, j, c); }, [&](int c) { return b.value(hl, j, c); });
        }
      } else if (t == tier::quantized) {
        push_quantized(w, type_tag<quantizer>{}, ledger_of(layer, region, rec.ledger_slot), plan_.record);
      }
    }
    const block recent = recent_block(region);
    for (int i = plan_.sinks + lane.aged * plan_.window; i < lane.tokens; ++i) {
      const int slot = (i - plan_.sinks) % plan_.recent_capacity;
      push(i, [&](int c) { return recent.key(h, slot, c); }, [&](int c) { return recent.value(h, slot, c); });
    }
    return n;
  }

  template <class T>
  struct type_tag {
    using type = T;
  };

  /// Tokens of window w, unit u, from the recent ring: post-RoPE keys and values [window][hu][d].
  void load_recent(sequence_id s, int layer, int w, int u, float* kw, float* vw) const {
    const block b = recent_block(region_of(s, layer));
    const int d = geo_.head_dim, hu = plan_.heads_per_unit;
    for (int j = 0; j < plan_.window; ++j) {
      const int slot = (w * plan_.window + j) % plan_.recent_capacity;
      for (int hl = 0; hl < hu; ++hl)
        for (int c = 0; c < d; ++c) {
          kw[(static_cast<std::size_t>(j) * hu + hl) * d + c] = b.key(u * hu + hl, slot, c);
          vw[(static_cast<std::size_t>(j) * hu + hl) * d + c] = b.value(u * hu + hl, slot, c);
        }
    }
  }

  /// The source of a newly aged window's tokens during decode: the recent ring.
  auto recent_source(sequence_id s, int layer) {
    return [this, s, layer](int w, int u, float* kw, float* vw) { load_recent(s, layer, w, u, kw, vw); };
  }

  /// Quantizes window w (post-RoPE keys, values; [window][hu][d]) into a new ledger record.
  void quantize_into_ledger(sequence_id s, int layer, std::byte* region, lane_state& lane, window_record& rec, int w,
                            float* k_post, const float* v) {
    to_key_frame<quantizer>(s, w, k_post);
    rec.ledger_slot = lane.free_ledger.back();
    lane.free_ledger.pop_back();
    quantizer::quantize(plan_.record, k_post, v, ledger_of(layer, region, rec.ledger_slot));
  }

  /// Takes a Full slot for window w and stores its keys (post-RoPE) and values there.
  void store_full(sequence_id s, int w, std::byte* region, lane_state& lane, window_record& rec, float* k_post,
                  const float* v) {
    rec.full_slot = lane.free_full.back();
    lane.free_full.pop_back();
    std::byte* slot = region + plan_.full_offset + static_cast<std::size_t>(rec.full_slot) * plan_.full_window_bytes;
    if constexpr (full_tier::quantized) {
      to_key_frame<typename full_tier::quantizer>(s, w, k_post);
      full_tier::quantizer::quantize(plan_.full_record, k_post, v, reinterpret_cast<std::uint8_t*>(slot));
    } else {
      const int d = geo_.head_dim, hu = plan_.heads_per_unit;
      const block b{slot, plan_.window, d, geo_.element};
      for (int j = 0; j < plan_.window; ++j)
        for (int hl = 0; hl < hu; ++hl)
          b.put(hl, j, k_post + (static_cast<std::size_t>(j) * hu + hl) * d, v + (static_cast<std::size_t>(j) * hu + hl) * d);
    }
  }

  /// Keys (post-RoPE) and values of a Full window, [window][hu][d].
  void load_full(sequence_id s, int w, const std::byte* region, const window_record& rec, float* k_post, float* v) const {
    if constexpr (full_tier::quantized) {
      dequantize_rotated<typename full_tier::quantizer>(
          s, w, reinterpret_cast<const std::uint8_t*>(full_slot_of(region, rec.full_slot)), plan_.full_record, k_post, v);
    } else {
      const int d = geo_.head_dim, hu = plan_.heads_per_unit;
      const block b = full_block(region, rec.full_slot);
      for (int j = 0; j < plan_.window; ++j)
        for (int hl = 0; hl < hu; ++hl)
          for (int c = 0; c < d; ++c) {
            k_post[(static_cast<std::size_t>(j) * hu + hl) * d + c] = b.key(hl, j, c);
            v[(static_cast<std::size_t>(j) * hu + hl) * d + c] = b.value(hl, j, c);
          }
    }
  }

  /// Algorithm 1 for one (sequence, layer). `source(w, u, k_post, v)` yields the tokens of a
  /// window that is aging out of the recent region now.
  template <class Source>
  void route_lane(sequence_id s, int layer, Source&& source) {
    lane_state& lane = lane_of(s, layer);
    std::byte* region = region_of(s, layer);
    window_record* table = table_of(region);
    const int U = plan_.units;
    const int aged_before = lane.aged;
    const int aged_after = std::max(aged_before, aged_windows_for(lane.tokens));
    // A frozen selection only places the newly aged windows, into the slots still free.
    const bool frozen = !rerank && lane.routed;
    const capacities caps = frozen ? capacities{lane.free_full.size(), lane.free_ledger.size()} : plan(layer).caps;

    // Eq. 4: candidates = Full ∪ Quantized ∪ newly aged units.
    std::size_t n = 0;
    for (int e = (frozen ? aged_before : 0) * U; e < aged_after * U; ++e) {
      const tier t = tier_of(table[e], e / U < aged_before);
      if (t == tier::evicted) continue;
      candidates_[n++] = routing_candidate{e, table[e].score, table[e].ledger_slot >= 0, tier::evicted};
    }
    assign_tiers(std::span(candidates_.data(), n), caps);

    // Migrations, frees before allocations so that every pool stays within its capacity.
    float* kw = window_keys_.data();
    float* vw = window_values_.data();
    auto previous = [&](const routing_candidate& c) { return tier_of(table[c.window], c.window / U < aged_before); };
    for (std::size_t i = 0; i < n; ++i) {  // 1. evict
      window_record& rec = table[candidates_[i].window];
      if (candidates_[i].next != tier::evicted) continue;
      if (rec.full_slot >= 0) lane.free_full.push_back(rec.full_slot);
      if (rec.ledger_slot >= 0) lane.free_ledger.push_back(rec.ledger_slot);
      rec.full_slot = rec.ledger_slot = -1;
    }
    for (std::size_t i = 0; i < n; ++i) {  // 2. demote Full → Quantized (quantize only the first time)
      const routing_candidate& c = candidates_[i];
      window_record& rec = table[c.window];
      if (c.next != tier::quantized || previous(c) != tier::full) continue;
      if (rec.ledger_slot < 0) {
        load_full(s, c.window / U, region, rec, kw, vw);
        quantize_into_ledger(s, layer, region, lane, rec, c.window / U, kw, vw);
      }
      lane.free_full.push_back(rec.full_slot);
      rec.full_slot = -1;
    }
    for (std::size_t i = 0; i < n; ++i) {  // 3. newly aged → Quantized
      const routing_candidate& c = candidates_[i];
      if (c.next != tier::quantized || previous(c) != tier::recent) continue;
      source(c.window / U, c.window % U, kw, vw);
      quantize_into_ledger(s, layer, region, lane, table[c.window], c.window / U, kw, vw);
    }
    for (std::size_t i = 0; i < n; ++i) {  // 4. promote Quantized → Full (dequantize, re-apply RoPE)
      const routing_candidate& c = candidates_[i];
      window_record& rec = table[c.window];
      if (c.next != tier::full || previous(c) != tier::quantized) continue;
      dequantize_rotated(s, c.window / U, ledger_of(layer, region, rec.ledger_slot), plan_.record, kw, vw);
      store_full(s, c.window / U, region, lane, rec, kw, vw);
    }
    for (std::size_t i = 0; i < n; ++i) {  // 5. newly aged → Full
      const routing_candidate& c = candidates_[i];
      if (c.next != tier::full || previous(c) != tier::recent) continue;
      source(c.window / U, c.window % U, kw, vw);
      store_full(s, c.window / U, region, lane, table[c.window], kw, vw);
    }
    // A routing event acts on the history of every live window, the recent ones included: a
    // decaying scorer must discount the mass a window gathered while it was still recent, or that
    // window would out-rank older windows with the same attention at the same age.
    for (int e = 0; e < windows_started(lane.tokens) * U; ++e)
      if (tier_of(table[e], e / U < aged_after) != tier::evicted) table[e].score = scorer::after_routing(table[e].score);
    lane.aged = aged_after;
    lane.steps_since_route = 0;
    lane.routed = true;
  }

  geometry geo_;
  limits lim_;
  options opt_;
  std::vector<region_plan> plans_;
  region_plan plan_;  ///< layer 0's plan; every field but the budget-derived ones holds for all layers
  arena_plan arena_;
  std::vector<double> inv_freq_;
  std::vector<std::byte> owned_;
  std::vector<std::byte*> regions_;  ///< one per (sequence slot, layer)
  std::vector<lane_state> lanes_;
  sequence_slots sequences_;
  // Scratch, sized at construction.
  std::vector<double> keys_, values_, logits_, token_mass_, token_score_, window_mass_, query_, head_out_;
  std::vector<int> token_index_;
  std::vector<float> window_keys_, window_values_;
  std::vector<routing_candidate> candidates_;
  std::vector<std::vector<double>> gram_;  ///< per layer: G_h per query head, or empty (‖v‖)
  std::vector<float> prefill_keys_, prefill_queries_;
};

}  // namespace backend
}  // namespace qevict

#pragma once
// qevict::cache — the integrator's entry point.
//
//   using cfg = qevict::config<>;   // the paper's policies; see config.hpp
//   qevict::cache<cfg> kv(geometry, qevict::budget::fraction(0.20), qevict::limits{.max_batch = 8, .max_tokens =
//   32768}); auto seq = kv.add_sequence(); for each layer: kv.prefill(layer, seq, q, k, v, out);          // whole
//   prompt, pre-RoPE q/k each decode step, for each layer:
//     kv.append(layer, seqs, k, v);                                  // new tokens, pre-RoPE keys
//     kv.attend(layer, seqs, q, out);                                // routes itself every Ω steps
//   kv.report().to_string();                                         // every byte term
//
// Layouts (row-major float): keys and values [tokens][kv_heads][head_dim]; queries and outputs
// [tokens][q_heads][head_dim]. The cache applies RoPE to queries and keys itself, at positions
// first_position, first_position + 1, ... of each sequence.
//
// Every call checks its input before it changes anything: on error it throws qevict::error and
// the cache is exactly as it was.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "qevict/backend/host/host_cache.hpp"
#include "qevict/concepts/policies.hpp"
#include "qevict/concepts/storage.hpp"
#include "qevict/config.hpp"
#include "qevict/core/report.hpp"

namespace qevict {

template <class Config, class Backend = backend::host>
class cache {
  static_assert(scorer_policy<typename Config::scorer>,
                "qevict::cache: Config::scorer does not model qevict::scorer_policy "
                "(derive from scorers::scorer_defaults; needs name, token_signal, prefill_aggregation, "
                "prefill_pooling, initial_score(int), accumulate(float, float), after_routing(float))");
  static_assert(quantizer_policy<typename Config::quantizer>,
                "qevict::cache: Config::quantizer does not model qevict::quantizer_policy "
                "(needs bits, key_frame (rotated, read_rotation), layout(tokens, heads, dim), quantize, dequantize_key, "
                "dequantize_value)");
  static_assert(
      window_policy<typename Config::window_policy>,
      "qevict::cache: Config::window_policy does not model qevict::window_policy (needs size >= 1, sinks, recent)");
  static_assert(
      allocator_policy<typename Config::allocator>,
      "qevict::cache: Config::allocator does not model qevict::allocator_policy "
      "(needs name, keeps_everything, capacities split(hist, M_f, M_q, units) and bytes_to_keep_all(units, M_f, M_q))");
  static_assert(routing_policy<typename Config::routing_policy>,
                "qevict::cache: Config::routing_policy does not model qevict::routing_policy (needs name, "
                "rerank_after_first_event)");
  static_assert(
      selection_policy<typename Config::selection_policy>,
      "qevict::cache: Config::selection_policy does not model qevict::selection_policy (needs name, splits_heads)");
  static_assert(
      full_tier_policy<typename Config::full_tier_policy>,
      "qevict::cache: Config::full_tier_policy does not model qevict::full_tier_policy (needs name, quantized)");
  static_assert(
      rope_policy<typename Config::rope>,
      "qevict::cache: Config::rope does not model qevict::rope_policy (needs rotates, inverse_frequencies, rotate)");

  using engine_type = typename Backend::template engine<Config>;
  /// Backends whose inputs are device pointers (backend::cuda) check finiteness on the device and
  /// report it at their next synchronizing call; the host never reads those spans.
  static constexpr bool inputs_on_device = requires { Backend::inputs_on_device; };

 public:
  using config_type = Config;
  using backend_type = Backend;

  cache(const geometry& g, const budget& b, const limits& lim, const options& opt = {})
      : engine_(g, b, lim, opt, nullptr, 0) {}

  /// Bytes in the engine's memory: one range (storage::external, or any contiguous_storage), at
  /// least required_bytes(...) long, or one region per (sequence slot, layer) (storage::regions).
  template <contiguous_storage Storage>
  cache(const geometry& g, const budget& b, const limits& lim, Storage storage, const options& opt = {})
      : engine_(g, b, lim, opt, arena_of(storage), storage.size_bytes()) {}
  cache(const geometry& g, const budget& b, const limits& lim, const storage::regions& storage, const options& opt = {})
      : engine_(g, b, lim, opt, storage) {}
  cache(const geometry& g, const budget& b, const limits& lim, storage::owned, const options& opt = {})
      : engine_(g, b, lim, opt, nullptr, 0) {}

  /// Backends with run-time settings of their own (backend::cuda: its stream), owned arena or one
  /// contiguous range.
  template <class B = Backend>
  requires requires { typename B::settings; }
  cache(const geometry& g, const budget& b, const limits& lim, const typename B::settings& set, const options& opt = {})
      : engine_(g, b, lim, opt, nullptr, 0, set) {}
  template <class Storage, class B = Backend>
  requires requires(const Storage& s) {
    typename B::settings;
    s.data();
    s.size_bytes();
  }
  cache(const geometry& g, const budget& b, const limits& lim, Storage storage, const typename B::settings& set,
        const options& opt = {})
      : engine_(g, b, lim, opt, arena_of(storage), storage.size_bytes(), set) {}

  /// Bytes of the arena for this geometry, budget and limits (for external storage).
  static std::size_t required_bytes(const geometry& g, const budget& b, const limits& lim) {
    return make_arena_plan(make_region_plans<Config>(g, b, lim), lim).bytes;
  }

  const geometry& geo() const { return engine_.geo(); }
  /// The byte plan of layer 0 (every layer's, unless budget::with_layer_shares was used).
  const region_plan& plan() const { return engine_.plan(); }
  /// The byte plan of one layer.
  const region_plan& plan(int layer) const {
    check_layer("plan", layer);
    return engine_.plan(layer);
  }

  /// The layer's attention output projection W_o, for value-weighted scorers (CriticalKV): a
  /// token then weighs its attention probability from query head h by ‖W_o^(h) v‖, where W_o^(h)
  /// is the slice of W_o that head h's output passes through, instead of by ‖v‖. `w_o` is
  /// row-major [hidden][q_heads * head_dim], as models store o_proj; it is copied (as one
  /// head_dim × head_dim Gram matrix per query head). Applies to the masses of later prefills and
  /// attends; a layer without it keeps ‖v‖. Host backend only.
  void set_output_projection(int layer, std::span<const float> w_o, int hidden) {
    check_layer("set_output_projection", layer);
    detail::require(Config::scorer::token_signal == scorers::signal::value_weighted_attention, [&] {
      return std::string("set_output_projection: the scorer ") + Config::scorer::name +
             " does not weigh values (only value-weighted scorers, e.g. presets::criticalkv, use W_o)";
    });
    if constexpr (!requires { engine_.set_output_projection(layer, w_o.data(), hidden); }) {
      // Refused before w_o is read: no W_o could be used.
      detail::require(false, [&] { return std::string("set_output_projection: not supported by backend::") + Backend::name; });
    } else {
      const std::size_t columns = static_cast<std::size_t>(engine_.geo().q_heads) * engine_.geo().head_dim;
      detail::require(hidden > 0,
                      [&] { return "set_output_projection: hidden must be positive, got " + std::to_string(hidden); });
      check_size("set_output_projection", "w_o", w_o.size(), static_cast<std::size_t>(hidden) * columns);
      check_finite("set_output_projection", "w_o", w_o);
      check_projection_norms(w_o, hidden);
      engine_.set_output_projection(layer, w_o.data(), hidden);
    }
  }

  // ---- sequences ---------------------------------------------------------------------------
  /// Starts a sequence whose first token sits at `first_position`.
  sequence_id add_sequence(long long first_position = 0) {
    detail::require(first_position >= 0, [&] { return "add_sequence: first_position must be >= 0"; });
    // Positions are first_position + token index, as long long.
    const long long room = std::numeric_limits<long long>::max() - engine_.plan().max_tokens;
    detail::require(first_position <= room, [&] {
      return "add_sequence: first_position " + std::to_string(first_position) + " leaves no room for limits::max_tokens = " +
             std::to_string(engine_.plan().max_tokens) + " positions (at most " + std::to_string(room) + ")";
    });
    return engine_.add_sequence(first_position);
  }
  /// Frees a sequence's slot; the other sequences are untouched.
  void remove_sequence(sequence_id s) {
    check_sequence("remove_sequence", s);
    engine_.remove_sequence(s);
  }
  bool contains(sequence_id s) const { return engine_.is_active(s); }
  int tokens(sequence_id s, int layer) const {
    check_sequence("tokens", s);
    check_layer("tokens", layer);
    return engine_.tokens(s, layer);
  }

  // ---- prefill -----------------------------------------------------------------------------
  /// The whole prompt of `s` for one layer: exact causal attention into `out`, initial window
  /// scores from the last options::observation_window queries, and a first routing event that
  /// fits the budget. The sequence must be empty in this layer.
  ///
  /// An engine that computes the prompt's attention itself passes an empty `out` and, in `q`,
  /// only the queries of the last few prompt tokens (at least one): the cache then attends just
  /// those, for the initial scores, and ingests k and v.
  void prefill(int layer, sequence_id s, std::span<const float> q, std::span<const float> k, std::span<const float> v,
               std::span<float> out = {}) {
    const char* call = "prefill";
    check_layer(call, layer);
    check_sequence(call, s);
    const std::size_t krow = kv_row(), qrow = q_row();
    detail::require(!k.empty() && k.size() % krow == 0, [&] {
      return std::string(call) + ": k has " + std::to_string(k.size()) +
             " floats, not a positive multiple of kv_heads*head_dim = " + std::to_string(krow);
    });
    const std::size_t n = k.size() / krow;
    check_size(call, "v", v.size(), n * krow);
    if (out.empty()) {
      detail::require(!q.empty() && q.size() % qrow == 0 && q.size() <= n * qrow, [&] {
        return std::string(call) + ": q has " + std::to_string(q.size()) +
               " floats; without out it must hold the queries of 1 to " + std::to_string(n) +
               " last prompt tokens (multiples of q_heads*head_dim = " + std::to_string(qrow) + ")";
      });
    } else {
      check_size(call, "q", q.size(), n * qrow);
      check_size(call, "out", out.size(), n * qrow);
    }
    detail::require(engine_.tokens(s, layer) == 0, [&] {
      return std::string(call) + ": sequence " + std::to_string(s) + " already holds " +
             std::to_string(engine_.tokens(s, layer)) + " tokens in layer " + std::to_string(layer) +
             "; use append() to extend it";
    });
    detail::require(n <= static_cast<std::size_t>(engine_.plan().max_tokens), [&] {
      return std::string(call) + ": prompt of " + std::to_string(n) +
             " tokens exceeds limits::max_tokens = " + std::to_string(engine_.plan().max_tokens);
    });
    if constexpr (!inputs_on_device) {
      check_input(call, numeric::input::query, q);
      check_input(call, numeric::input::key, k);
      check_input(call, numeric::input::value, v);
    }
    engine_.prefill(layer, s, q.data(), static_cast<int>(q.size() / qrow), k.data(), v.data(),
                    out.empty() ? nullptr : out.data(), static_cast<int>(n));
  }

  // ---- decode ------------------------------------------------------------------------------
  /// Appends one token to each listed sequence. `positions`, if given, must be each sequence's
  /// next position (its previous one plus one).
  void append(int layer, std::span<const sequence_id> seqs, std::span<const float> k, std::span<const float> v,
              std::span<const long long> positions = {}) {
    const char* call = "append";
    check_batch(call, layer, seqs);
    check_size(call, "k", k.size(), seqs.size() * kv_row());
    check_size(call, "v", v.size(), seqs.size() * kv_row());
    detail::require(positions.empty() || positions.size() == seqs.size(), [&] {
      return std::string(call) + ": positions has " + std::to_string(positions.size()) + " entries for " +
             std::to_string(seqs.size()) + " sequences";
    });
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const sequence_id s = seqs[b];
      const int n = engine_.tokens(s, layer);
      detail::require(n < engine_.plan().max_tokens, [&] {
        return std::string(call) + ": sequence " + std::to_string(s) +
               " reached limits::max_tokens = " + std::to_string(engine_.plan().max_tokens) + " in layer " +
               std::to_string(layer);
      });
      if (!positions.empty()) {
        const long long expected = engine_.first_position(s) + n;
        detail::require(positions[b] == expected, [&] {
          return std::string(call) + ": position " + std::to_string(positions[b]) + " of sequence " +
                 std::to_string(s) + " in layer " + std::to_string(layer) + " is not the next position " +
                 std::to_string(expected) + " (positions must increase by one per token)";
        });
      }
      detail::require(options_routing() == routing_mode::automatic || !engine_.recent_full(s, layer), [&] {
        return std::string(call) + ": the recent region of sequence " + std::to_string(s) + " in layer " +
               std::to_string(layer) + " is full; with routing_mode::manual call route() first";
      });
    }
    if constexpr (inputs_on_device) {
      engine_.append_batch(layer, seqs, k.data(), v.data());
    } else {
      check_input(call, numeric::input::key, k);
      check_input(call, numeric::input::value, v);
      for (std::size_t b = 0; b < seqs.size(); ++b)
        engine_.append(layer, seqs[b], k.data() + b * kv_row(), v.data() + b * kv_row());
    }
  }

  /// Attention of each listed sequence's newest query over everything its cache still holds
  /// (sinks, Full and Quantized windows, recent region); adds each window's mass to its score
  /// and, with routing_mode::automatic, routes every Ω-th call. `observe(attention_event)` sees
  /// every attended token's probability (host backend).
  template <class Observer = no_observer>
  void attend(int layer, std::span<const sequence_id> seqs, std::span<const float> q, std::span<float> out,
              Observer&& observe = {}) {
    const char* call = "attend";
    check_batch(call, layer, seqs);
    check_size(call, "q", q.size(), seqs.size() * q_row());
    check_size(call, "out", out.size(), seqs.size() * q_row());
    for (sequence_id s : seqs)
      detail::require(engine_.tokens(s, layer) > 0, [&] {
        return std::string(call) + ": sequence " + std::to_string(s) + " has no tokens in layer " +
               std::to_string(layer) + "; append() its token first";
      });
    if constexpr (inputs_on_device) {
      static_assert(std::is_same_v<std::remove_cvref_t<Observer>, no_observer>,
                    "qevict::cache::attend: per-token observers need the host backend");
      engine_.attend_batch(layer, seqs, q.data(), out.data());
    } else {
      check_input(call, numeric::input::query, q);
      for (std::size_t b = 0; b < seqs.size(); ++b)
        engine_.attend(layer, seqs[b], static_cast<int>(b), q.data() + b * q_row(), out.data() + b * q_row(), observe);
    }
  }

  /// A routing event now for every layer of `s` (on demand; Algorithm 1).
  void route(sequence_id s) {
    check_sequence("route", s);
    for (int l = 0; l < engine_.geo().layers; ++l) engine_.route(s, l);
  }
  /// A routing event now for every active sequence and layer.
  void route() {
    for (sequence_id s = 0; s < static_cast<sequence_id>(max_batch()); ++s)
      if (engine_.is_active(s)) route(s);
  }

  // ---- reports and introspection -----------------------------------------------------------
  /// Waits for the backend's queued work and throws qevict::error for a bad input it found there
  /// (device backends; a no-op on the host, which checks every input before it acts).
  void check() const {
    if constexpr (requires { engine_.check(); }) engine_.check();
  }
  budget_report report() const { return engine_.report(); }
  /// Device memory the backend allocated at construction, by part (device backends only): the
  /// arena the budget fills, and outside it the tables and the decode workspace.
  device_memory device_bytes() const
  requires requires(const engine_type& e) { e.device_bytes(); }
  {
    return engine_.device_bytes();
  }
  std::vector<window_info> windows(sequence_id s, int layer) const {
    check_sequence("windows", s);
    check_layer("windows", layer);
    return engine_.windows(s, layer);
  }
  tier_counts counts(sequence_id s, int layer) const {
    check_sequence("counts", s);
    check_layer("counts", layer);
    return engine_.counts(s, layer);
  }
  /// Keys (after RoPE) and values of window w as attention sees them: [window][kv_heads][head_dim].
  void read_window(sequence_id s, int layer, int w, std::span<float> k_post, std::span<float> v) const {
    check_window("read_window", s, layer, w);
    const std::size_t n = static_cast<std::size_t>(engine_.plan().window) * kv_row();
    check_size("read_window", "k_post", k_post.size(), n);
    check_size("read_window", "v", v.size(), n);
    engine_.read_window(s, layer, w, k_post.data(), v.data());
  }
  /// The bytes of window w's ledger record of routing unit `unit` (the KV head with
  /// selection::per_kv_head, else 0); empty if it was never quantized.
  std::span<const std::uint8_t> ledger_record(sequence_id s, int layer, int w, int unit = 0) const {
    check_window("ledger_record", s, layer, w);
    check_unit("ledger_record", unit, false);
    return engine_.ledger_record(s, layer, w, unit);
  }
  /// Overrides window w's cumulative score (external importance signals, experiments): of routing
  /// unit `unit`, or of all its units when unit is -1.
  void set_score(sequence_id s, int layer, int w, float score, int unit = -1) {
    check_window("set_score", s, layer, w);
    check_unit("set_score", unit, true);
    detail::require(numeric::is_finite(score), [&] { return "set_score: score must be finite"; });
    engine_.set_score(s, layer, w, score, unit);
  }

 private:
  template <class Storage>
  static std::byte* arena_of(const Storage& s) {
    detail::require(s.data() != nullptr, [&] { return "external storage: null pointer"; });
    return static_cast<std::byte*>(s.data());
  }

  std::size_t kv_row() const { return static_cast<std::size_t>(engine_.geo().kv_heads) * engine_.geo().head_dim; }
  std::size_t q_row() const { return static_cast<std::size_t>(engine_.geo().q_heads) * engine_.geo().head_dim; }
  std::size_t max_batch() const { return static_cast<std::size_t>(engine_.lim().max_batch); }
  routing_mode options_routing() const { return engine_.opts().routing; }

  void check_layer(const char* call, int layer) const {
    detail::require(layer >= 0 && layer < engine_.geo().layers, [&] {
      return std::string(call) + ": layer " + std::to_string(layer) + " is out of range [0, " +
             std::to_string(engine_.geo().layers) + ")";
    });
  }
  void check_sequence(const char* call, sequence_id s) const {
    detail::require(engine_.is_active(s),
                    [&] { return std::string(call) + ": sequence " + std::to_string(s) + " is not in the cache"; });
  }
  void check_window(const char* call, sequence_id s, int layer, int w) const {
    check_sequence(call, s);
    check_layer(call, layer);
    detail::require(w >= 0 && w < engine_.windows_started(engine_.tokens(s, layer)), [&] {
      return std::string(call) + ": window " + std::to_string(w) + " does not exist in sequence " + std::to_string(s) +
             ", layer " + std::to_string(layer);
    });
  }
  void check_unit(const char* call, int unit, bool all_allowed) const {
    const int units = engine_.plan().units;
    detail::require((all_allowed && unit == -1) || (unit >= 0 && unit < units), [&] {
      return std::string(call) + ": unit " + std::to_string(unit) + " does not exist (the cache has " + std::to_string(units) +
             " routing unit" + (units == 1 ? "" : "s") + " per window" + (all_allowed ? "; -1 means all of them)" : ")");
    });
  }
  void check_batch(const char* call, int layer, std::span<const sequence_id> seqs) const {
    check_layer(call, layer);
    detail::require(!seqs.empty(), [&] { return std::string(call) + ": the batch lists no sequence"; });
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      check_sequence(call, seqs[i]);
      for (std::size_t j = 0; j < i; ++j)
        detail::require(seqs[j] != seqs[i], [&] {
          return std::string(call) + ": sequence " + std::to_string(seqs[i]) + " is listed twice in one batch";
        });
    }
  }
  static void check_size(const char* call, const char* what, std::size_t got, std::size_t want) {
    detail::require(got == want, [&] {
      return std::string(call) + ": " + what + " has " + std::to_string(got) + " floats, expected " +
             std::to_string(want);
    });
  }
  /// Every element of x within `limit`; `problem(v)` words what is wrong with one that is not.
  template <class Problem>
  static void check_elements(const char* call, const char* what, std::span<const float> x, float limit,
                             Problem&& problem) {
    for (std::size_t i = 0; i < x.size(); ++i)
      detail::require(numeric::within(x[i], limit), [&] {
        return std::string(call) + ": " + what + "[" + std::to_string(i) + "] " + problem(x[i]) +
               "; the cache is unchanged";
      });
  }
  /// Every element of input x within its limit, numeric::largest_magnitude(in).
  static void check_input(const char* call, numeric::input in, std::span<const float> x) {
    check_elements(call, numeric::to_string(in), x, numeric::largest_magnitude(in),
                   [in](float v) { return numeric::input_problem(v, in); });
  }
  /// Every element of x finite.
  static void check_finite(const char* call, const char* what, std::span<const float> x) {
    check_elements(call, what, x, numeric::largest_float, numeric::non_finite_problem);
  }

  /// Each query head's slice W_o^(h) small enough that no value within its limit gets a weight
  /// ‖W_o^(h) v‖ beyond numeric::largest_token_weight: ‖W_o^(h) v‖ <= ‖W_o^(h)‖_F · ‖v‖, and ‖v‖
  /// is at most √head_dim · largest_magnitude(value). Finite elements alone can still overflow the
  /// float scores (an element of 1e37 weighs a value of 2^14 by more than float's largest).
  void check_projection_norms(std::span<const float> w_o, int hidden) const {
    const int d = engine_.geo().head_dim, hq = engine_.geo().q_heads;
    const std::size_t columns = static_cast<std::size_t>(hq) * d;
    const double value_limit = numeric::largest_magnitude(numeric::input::value);
    const double largest_value_norm = std::sqrt(static_cast<double>(d)) * value_limit;
    for (int h = 0; h < hq; ++h) {
      double squares = 0.0;  // fewer than 2^64 squares, each below 2^256: finite in double
      for (int r = 0; r < hidden; ++r)
        for (int c = 0; c < d; ++c) {
          const double x = w_o[static_cast<std::size_t>(r) * columns + static_cast<std::size_t>(h) * d + c];
          squares += x * x;
        }
      const double norm = std::sqrt(squares), weight = norm * largest_value_norm;
      detail::require(weight <= numeric::largest_token_weight, [&] {
        char text[320];
        std::snprintf(text, sizeof text,
                      "set_output_projection: query head %d's slice of w_o has Frobenius norm %.4g, so a value within "
                      "±%.0f could be weighed by up to %.4g, beyond 2^%.0f, the largest token weight the window scores "
                      "take; the cache is unchanged",
                      h, norm, value_limit, weight, std::log2(numeric::largest_token_weight));
        return std::string(text);
      });
    }
  }

  engine_type engine_;
};

}  // namespace qevict

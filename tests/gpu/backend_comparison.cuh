// Shared by the GPU tests that run qevict::cache<Config, backend::cuda> against the host backend
// (the oracle) on the same fresh random inputs: prefill, >= 256 decode steps with a routing event
// every Ω steps, ragged lengths, sequences removed and added mid-run.
//
// What must agree:
//   - attention outputs (prefill and every decode step): relative L2 error per head <= 2e-3;
//   - window scores after every prefill and before every routing event: relative L1 per sequence
//     <= 1e-3;
//   - routing: identical window tables (tier, Full slot, ledger slot of every window) after every
//     event. The device's scores carry float rounding (~1e-6 relative), so two windows whose
//     scores are that close could rank differently; to compare routing itself on identical inputs,
//     the device's scores are copied into the host cache before each event (the score error is
//     checked just before);
//   - the arenas, byte for byte, at the end (scores aside): the sinks, the recent ring's tokens
//     not routed yet, the Full windows and ledger records in use (bytes the cache never wrote,
//     such as ring slots of tokens a prefill routed straight into their windows, are not compared).
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_support.cuh"
#include "qevict/backend/cuda.cuh"
#include "qevict/cache.hpp"
#include "qevict/presets.hpp"

namespace gpu_test {

inline bool quick() {
  const char* q = std::getenv("QEVICT_GPU_QUICK");
  return q && q[0] == '1';
}

/// Inputs at their limits (numeric::largest_magnitude) in every other token: with `keys_values`,
/// the first rotary pair of every KV head's key at ±the key limit (the sign alternating between
/// such tokens, so that a window's channel spans both) and one value channel at −the value limit,
/// the queries 1000 times smaller than usual so that the scores stay moderate (the decode outputs'
/// bound is then 5e-3: run_case says why); with `queries`, one channel of every query head at ±the
/// query limit. Scores of a query at its limit are so large that float's rounding decides between
/// near ties, so that case asserts finite outputs and scores, identical routing and identical
/// arenas, not the error bounds.
struct input_extremes {
  bool keys_values = false;
  bool queries = false;
};

struct case_spec {
  int head_dim, group, batch;
  qevict::element_type element;
  qevict::budget b;
  int max_prompt;
  int steps = 256;
  int layers = 1;
  qevict::rope_layout layout = qevict::rope_layout::rotate_half;
  bool churn = false;
  int items_per_chunk = 0;  ///< the CUDA backend's decode split-K chunk (cuda_settings; 0: its default, per call)
  int max_tokens = 2048;    ///< limits::max_tokens (the table's windows: routing's sort size)
  input_extremes extremes = {};
};

/// The CUDA backend's settings with a given decode split-K chunk (the default stream).
inline qevict::backend::cuda::settings with_chunk(int items_per_chunk) {
  qevict::backend::cuda::settings set;
  set.items_per_chunk = items_per_chunk;
  return set;
}

struct worst_error {
  double out = 0, prefill_out = 0, score = 0;
  long long routing_events = 0, tables_compared = 0;
};

inline double rel_error(const std::vector<float>& got, const std::vector<float>& ref, int d) {
  double worst = 0.0;
  for (std::size_t hv = 0; hv < ref.size() / d; ++hv) {
    double num = 0.0, den = 0.0;
    for (int c = 0; c < d; ++c) {
      const double r = ref[hv * d + c], o = got[hv * d + c];
      num += (o - r) * (o - r);
      den += r * r;
    }
    if (!std::isfinite(num)) return INFINITY;
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

/// The same cache on both backends, each in an arena of its own that the test can read.
template <class Cfg>
struct twin {
  qevict::geometry g;
  qevict::budget b;
  qevict::limits lim;
  std::size_t bytes;
  std::vector<std::byte> host_arena;
  std::byte* host_base;
  device_buffer<std::byte> dev_arena;
  qevict::cache<Cfg> host;
  qevict::cache<Cfg, qevict::backend::cuda> dev;
  std::mt19937 rng;
  input_extremes extremes;
  long long extreme_rows = 0;  ///< rows of each input given so far (every other one at the limits)

  static std::byte* aligned(std::vector<std::byte>& v) {
    return reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t{63});
  }
  twin(const qevict::geometry& g_, const qevict::budget& b_, const qevict::limits& l_, const qevict::options& opt,
       unsigned seed, int items_per_chunk = 0)
      : g(g_),
        b(b_),
        lim(l_),
        bytes(qevict::cache<Cfg>::required_bytes(g_, b_, l_)),
        host_arena(bytes + 64),
        host_base(aligned(host_arena)),
        dev_arena(bytes),
        host(g_, b_, l_, qevict::storage::external{host_base, bytes}, opt),
        dev(g_, b_, l_, qevict::storage::external{dev_arena.ptr, bytes}, with_chunk(items_per_chunk), opt),
        rng(seed) {}

  std::size_t krow() const { return static_cast<std::size_t>(g.kv_heads) * g.head_dim; }
  std::size_t qrow() const { return static_cast<std::size_t>(g.q_heads) * g.head_dim; }
  std::vector<float> keys(std::size_t rows) {
    std::vector<float> k = normal(rng, rows * krow());
    std::uniform_real_distribution<float> u(0.5f, 2.5f);
    for (std::size_t r = 0; r < rows; ++r) {
      const float spread = u(rng);
      for (std::size_t i = 0; i < krow(); ++i) k[r * krow() + i] *= spread;
    }
    if (extremes.keys_values) {
      // Channel 0 and its rotary partner.
      const int partner = g.rope.layout == qevict::rope_layout::rotate_half ? g.head_dim / 2 : 1;
      const float x = qevict::numeric::largest_magnitude(qevict::numeric::input::key);
      at_the_limits(k, rows, g.kv_heads,
                    [&](float* head, long long i) { head[0] = head[partner] = i % 4 == 0 ? x : -x; });
    }
    return k;
  }
  std::vector<float> values(std::size_t rows) {
    std::vector<float> v = normal(rng, rows * krow());
    if (extremes.keys_values) {
      const float x = qevict::numeric::largest_magnitude(qevict::numeric::input::value);
      at_the_limits(v, rows, g.kv_heads, [&](float* head, long long) { head[1] = -x; });
    }
    return v;
  }
  std::vector<float> queries(std::size_t rows) {
    std::vector<float> q = normal(rng, rows * qrow(), extremes.keys_values ? 1.5e-3f : 1.5f);
    if (extremes.queries) {
      const float x = qevict::numeric::largest_magnitude(qevict::numeric::input::query);
      at_the_limits(q, rows, g.q_heads, [&](float* head, long long i) { head[0] = i % 4 == 0 ? -x : x; });
    }
    return q;
  }
  /// set(head, i) on every head of every other row of x (rows of `heads` heads), i counting the
  /// rows of all inputs given so far.
  template <class Set>
  void at_the_limits(std::vector<float>& x, std::size_t rows, int heads, Set set) {
    for (std::size_t r = 0; r < rows; ++r, ++extreme_rows)
      if (extreme_rows % 2 == 0)
        for (int h = 0; h < heads; ++h) set(&x[(r * heads + h) * g.head_dim], extreme_rows);
  }

  qevict::sequence_id add(long long first) {
    const qevict::sequence_id a = host.add_sequence(first), d = dev.add_sequence(first);
    REQUIRE(a == d);
    return a;
  }

  /// Prefill of n tokens in every layer; returns the worst output error (0 without outputs).
  double prefill(qevict::sequence_id s, int n, bool with_out) {
    double worst = 0.0;
    for (int l = 0; l < g.layers; ++l) {
      const std::vector<float> k = keys(n), v = values(n);
      const int q_rows = with_out ? n : std::min(n, 1 + static_cast<int>(rng() % 40));
      const std::vector<float> q = queries(q_rows);
      std::vector<float> out_h(with_out ? q.size() : 0);
      host.prefill(l, s, q, k, v, out_h);
      device_buffer<float> dq(q), dk(k), dv(v), dout(std::max<std::size_t>(out_h.size(), 1));
      dev.prefill(l, s, std::span<const float>(dq.ptr, q.size()), std::span<const float>(dk.ptr, k.size()),
                  std::span<const float>(dv.ptr, v.size()),
                  std::span<float>(with_out ? dout.ptr : nullptr, out_h.size()));
      dev.check();
      if (with_out) worst = std::max(worst, rel_error(dout.download(), out_h, g.head_dim));
    }
    return worst;
  }

  /// Offset of the region of (s, l) in either arena: sequence-major, then layer, each layer's
  /// region its own size (budget::with_layer_shares).
  std::size_t region_offset(qevict::sequence_id s, int l) const {
    std::size_t stride = 0, offset = 0;
    for (int k = 0; k < g.layers; ++k) {
      if (k == l) offset = stride;
      stride += host.plan(k).region_bytes;
    }
    return static_cast<std::size_t>(s) * stride + offset;
  }
  std::vector<qevict::window_record> device_table(qevict::sequence_id s, int l) {
    std::vector<qevict::window_record> t(host.plan().table_entries());
    QEVICT_CUDA_CHECK(cudaMemcpy(t.data(), dev_arena.ptr + region_offset(s, l), t.size() * sizeof(qevict::window_record),
                                 cudaMemcpyDeviceToHost));
    return t;
  }
  const qevict::window_record* host_table(qevict::sequence_id s, int l) const {
    return reinterpret_cast<const qevict::window_record*>(host_base + region_offset(s, l));
  }

  /// Tiers and slots of every table entry (window, or window and KV head with per-KV-head
  /// selection) identical on both sides.
  void compare_tables(qevict::sequence_id s, int l, const char* when) {
    const auto dt = device_table(s, l);
    const qevict::window_record* ht = host_table(s, l);
    const int entries = host.windows(s, l).size();
    int mismatches = 0;
    std::ostringstream first;  // the first few differing entries, for the report
    for (int e = 0; e < entries; ++e)
      if (dt[e].full_slot != ht[e].full_slot || dt[e].ledger_slot != ht[e].ledger_slot) {
        if (++mismatches <= 4)
          first << " [entry " << e << ": host full " << ht[e].full_slot << " ledger " << ht[e].ledger_slot << " score "
                << std::setprecision(9) << ht[e].score << "; device full " << dt[e].full_slot << " ledger " << dt[e].ledger_slot
                << " score " << dt[e].score << "]";
      }
    CHECK_MESSAGE(mismatches == 0, when << ": sequence " << s << " layer " << l << ": " << mismatches << " of "
                                        << entries << " table entries differ in tier or slot" << first.str());
    const auto hw = host.windows(s, l), dw = dev.windows(s, l);
    REQUIRE(hw.size() == dw.size());
    for (std::size_t i = 0; i < hw.size(); ++i) REQUIRE(hw[i].where == dw[i].where);
  }

  /// Relative L1 of the device's scores against the host's, then hands the device's scores to the
  /// host so that routing is compared on identical inputs.
  double sync_scores(qevict::sequence_id s, int l) {
    const auto hw = host.windows(s, l), dw = dev.windows(s, l);
    REQUIRE(hw.size() == dw.size());
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < hw.size(); ++i) {
      num += std::abs(static_cast<double>(dw[i].score) - hw[i].score);
      den += std::abs(static_cast<double>(hw[i].score));
      if (hw[i].where != qevict::tier::evicted) host.set_score(s, l, hw[i].index, dw[i].score, hw[i].unit);
    }
    if (!std::isfinite(num) || !std::isfinite(den)) return INFINITY;  // a NaN would pass std::max unseen
    return den > 0.0 ? num / den : 0.0;
  }

  /// Byte-for-byte arena comparison (scores aside); returns differing bytes.
  std::size_t arena_differences(const std::vector<qevict::sequence_id>& seqs, std::size_t& compared) {
    std::size_t diff = 0;
    compared = 0;
    // Compares `rows` runs of `run` bytes, `pitch` apart from arena offset `at`. Only the compared
    // ranges are read back: the rest of the arena may never have been written (compute-sanitizer
    // initcheck reports a copy of such bytes).
    const auto compare_rows = [&](std::size_t at, std::size_t run, int rows, std::size_t pitch) {
      std::vector<std::byte> d(rows * run);
      QEVICT_CUDA_CHECK(cudaMemcpy2D(d.data(), run, dev_arena.ptr + at, pitch, run, rows, cudaMemcpyDeviceToHost));
      compared += d.size();
      for (int r = 0; r < rows; ++r)
        for (std::size_t i = 0; i < run; ++i) diff += host_base[at + r * pitch + i] != d[r * run + i];
    };
    for (qevict::sequence_id s : seqs)
      for (int l = 0; l < g.layers; ++l) {
        const qevict::region_plan& p = host.plan(l);
        const std::size_t base = region_offset(s, l);
        const int tokens = host.tokens(s, l);
        // Window table without scores (one entry per window and routing unit).
        const auto ht = host_table(s, l);
        const std::vector<qevict::window_info> windows = host.windows(s, l);
        const int entries = static_cast<int>(windows.size());
        const auto dt = device_table(s, l);
        for (int e = 0; e < entries; ++e) {
          compared += 8;
          diff += (ht[e].full_slot != dt[e].full_slot) + (ht[e].ledger_slot != dt[e].ledger_slot);
        }
        // Sinks, the recent ring's tokens not routed yet, Full and ledger slots in use.
        auto cmp = [&](std::size_t off, std::size_t n) { compare_rows(base + off, n, 1, n); };
        if (tokens >= p.sinks) cmp(p.sink_offset, p.sink_bytes());
        if (tokens >= p.sinks + p.recent_capacity) {
          // The ring is 2 x kv_heads rows (keys and values of each head) of recent_capacity slots;
          // token t (after the sinks) sits in slot t % recent_capacity. Only the slots of tokens
          // past the aged windows are compared: a slot of a routed token may never have been
          // written (a prefill stores the tokens it routes straight into their windows).
          int aged = 0;
          for (const qevict::window_info& w : windows)
            if (w.where != qevict::tier::recent) aged = std::max(aged, w.index + 1);
          const int rows = 2 * g.kv_heads, capacity = p.recent_capacity;
          const int first = aged * p.window, live = tokens - p.sinks - first;
          const std::size_t slot_bytes = p.token_bytes / rows, row_bytes = capacity * slot_bytes;
          auto cmp_slots = [&](int slot, int n) {
            compare_rows(base + p.recent_offset + slot * slot_bytes, n * slot_bytes, rows, row_bytes);
          };
          CHECK_MESSAGE(live <= capacity, "sequence " << s << " layer " << l << ": " << live << " tokens not routed yet, "
                                                      << "more than the recent ring's " << capacity << " slots");
          if (live > 0 && live <= capacity) {
            const int start = first % capacity, before_end = std::min(live, capacity - start);
            cmp_slots(start, before_end);
            if (before_end < live) cmp_slots(0, live - before_end);
          }
        }
        for (int e = 0; e < entries; ++e) {
          if (ht[e].full_slot >= 0) cmp(p.full_offset + ht[e].full_slot * p.full_window_bytes, p.full_window_bytes);
          if (ht[e].ledger_slot >= 0)
            cmp(p.ledger_offset + ht[e].ledger_slot * p.quantized_window_bytes(), p.quantized_window_bytes());
        }
      }
    return diff;
  }
};

/// Which routing event a policy check is called after.
enum class routing_event { prefill, decode };

/// The check run_case makes by default after each event: none beyond the comparison.
struct no_policy_check {
  template <class Twin>
  void operator()(Twin&, qevict::sequence_id, int, routing_event) const {}
};

/// Runs one case and checks the agreement above; `after_event(twin, sequence, layer, event)` is
/// called after every routing event of every (sequence, layer), once its tables were compared.
template <class Cfg, class PolicyCheck = no_policy_check>
worst_error run_case(const case_spec& spec, unsigned seed, PolicyCheck&& after_event = {}) {
  using qevict::sequence_id;
  qevict::geometry g;
  g.layers = spec.layers;
  g.kv_heads = 2;
  g.q_heads = 2 * spec.group;
  g.head_dim = spec.head_dim;
  g.element = spec.element;
  g.rope.theta = 500000.0f;
  g.rope.layout = spec.layout;
  const qevict::limits lim{.max_batch = spec.batch, .max_tokens = spec.max_tokens};
  qevict::options opt;
  opt.routing = qevict::routing_mode::manual;  // routing every Ω steps by route(), on both sides
  twin<Cfg> t(g, spec.b, lim, opt, seed, spec.items_per_chunk);
  t.extremes = spec.extremes;
  worst_error e;
  std::uniform_int_distribution<int> len_d(1, spec.max_prompt);
  std::uniform_int_distribution<long long> pos_d(0, 200000);
  std::vector<sequence_id> seqs;
  auto start = [&](int i) {
    const sequence_id s = t.add(i % 3 == 0 ? 0 : pos_d(t.rng));
    const int n = i == 1 ? 3 : len_d(t.rng);  // one shorter than the sinks
    e.prefill_out = std::max(e.prefill_out, t.prefill(s, n, n <= 400));
    for (int l = 0; l < g.layers; ++l) {
      t.compare_tables(s, l, "after prefill");
      e.score = std::max(e.score, t.sync_scores(s, l));
      after_event(t, s, l, routing_event::prefill);
    }
    return s;
  };
  for (int i = 0; i < spec.batch; ++i) seqs.push_back(start(i));

  const int omega = Cfg::routing_interval;
  for (int step = 1; step <= spec.steps; ++step) {
    if (spec.churn && step == spec.steps / 2 && seqs.size() > 2) {
      // Free slot 1 and reuse it for a new sequence.
      const sequence_id gone = seqs[1];
      t.host.remove_sequence(gone);
      t.dev.remove_sequence(gone);
      seqs.erase(seqs.begin() + 1);
      seqs.push_back(start(1000 + step));
    }
    for (int l = 0; l < g.layers; ++l) {
      const std::vector<float> k = t.keys(seqs.size()), v = t.values(seqs.size());
      const std::vector<float> q = t.queries(seqs.size());
      std::vector<float> out_h(q.size());
      t.host.append(l, seqs, k, v);
      t.host.attend(l, seqs, q, out_h);
      device_buffer<float> dk(k), dv(v), dq(q), dout(q.size());
      t.dev.append(l, seqs, std::span<const float>(dk.ptr, k.size()), std::span<const float>(dv.ptr, v.size()));
      t.dev.attend(l, seqs, std::span<const float>(dq.ptr, q.size()), std::span<float>(dout.ptr, q.size()));
      t.dev.check();
      e.out = std::max(e.out, rel_error(dout.download(), out_h, g.head_dim));
    }
    if (step % omega == 0) {
      for (sequence_id s : seqs)
        for (int l = 0; l < g.layers; ++l) e.score = std::max(e.score, t.sync_scores(s, l));
      t.host.route();
      t.dev.route();
      ++e.routing_events;
      for (sequence_id s : seqs)
        for (int l = 0; l < g.layers; ++l) {
          t.compare_tables(s, l, "after a routing event");
          ++e.tables_compared;
          after_event(t, s, l, routing_event::decode);
        }
    }
  }
  // read_window decodes each window as attention sees it, on both backends from the same bytes:
  // the floats must be identical, and a window one backend refuses (evicted, not complete) the
  // other refuses too.
  long long windows_read = 0, window_mismatches = 0;
  {
    const std::size_t n = static_cast<std::size_t>(Cfg::window_policy::size) * g.kv_heads * g.head_dim;
    std::vector<float> kh(n), vh(n), kd(n), vd(n);
    for (sequence_id s : seqs)
      for (int l = 0; l < g.layers; ++l)
        for (int w = 0; w * Cfg::window_policy::size + Cfg::window_policy::sinks < t.host.tokens(s, l); ++w) {
          bool host_ok = true, dev_ok = true;
          try {
            t.host.read_window(s, l, w, kh, vh);
          } catch (const qevict::error&) {
            host_ok = false;
          }
          try {
            t.dev.read_window(s, l, w, kd, vd);
          } catch (const qevict::error&) {
            dev_ok = false;
          }
          if (host_ok != dev_ok || (host_ok && (kh != kd || vh != vd))) ++window_mismatches;
          windows_read += host_ok;
        }
  }
  CHECK(window_mismatches == 0);
  CHECK(windows_read > 0);
  std::size_t compared = 0;
  const std::size_t diff = t.arena_differences(seqs, compared);
  qevict::tier_counts c;
  for (sequence_id s : seqs)
    for (int l = 0; l < g.layers; ++l) c += t.dev.counts(s, l);
  const std::string element = spec.element == qevict::element_type::bf16 ? "bf16" : "f16";
  MESSAGE("d=" << spec.head_dim << " G=" << spec.group << " batch=" << spec.batch << " " << element << " K_f="
               << t.host.plan().caps.full << " K_q=" << t.host.plan().caps.quantized << " layers=" << spec.layers
               << ": " << spec.steps << " steps, " << e.routing_events << " routing events, " << e.tables_compared
               << " tables identical; windows now " << c.full << " full / " << c.quantized << " quantized / "
               << c.evicted << " evicted; worst output error " << e.out << ", prefill output " << e.prefill_out
               << ", score L1 " << e.score << "; arena bytes differing " << diff << " of " << compared << "; "
               << windows_read << " windows read back identically");
  if (spec.extremes.queries) {
    CHECK(std::isfinite(e.out));  // rel_error is infinite where an output is not finite
    CHECK(std::isfinite(e.prefill_out));
    CHECK(std::isfinite(e.score));
  } else {
    // With keys and values at their limits, an f16 cache's output products round each probability
    // times its value scale (about 2^14/3 here) to fp16's 11 bits beside values of order 1, so the
    // decode outputs' error relative to their norm is larger than with ordinary inputs (2.1e-3 at
    // worst in the runs of these cases).
    CHECK(e.out <= (spec.extremes.keys_values ? 5e-3 : 2e-3));
    CHECK(e.prefill_out <= 2e-3);
    CHECK(e.score <= 1e-3);
  }
  CHECK(diff <= compared / 100000);
  return e;
}

}  // namespace gpu_test

// The fused decode-attention kernel against the host backend (double precision) on the same
// cache bytes: the host backend builds a cache (sinks, Full, Quantized and Evicted windows,
// a partly filled recent ring), the arena is copied to the GPU as is, and one decode step is
// attended on both sides. Outputs and window masses must agree.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "gpu_support.cuh"
#include "qevict/cache.hpp"
#include "qevict/kernels/decode_attention.cuh"
#include "qevict/presets.hpp"

namespace {

using namespace qevict;
using cfg = qevict::config<>;
/// The same cache with keys quantized after RoPE (attention reads them without rotating).
using cfg_post_rope = presets::qevict_post_rope::config_type;
/// Keys quantized relative to their window's start (attention rotates the query once per window).
using cfg_window_relative = presets::qevict_window_relative::config_type;
using gpu_test::device_buffer;

struct case_spec {
  int head_dim, group, batch;
  element_type element;
  budget b;
  rope_layout layout = rope_layout::rotate_half;
  int max_len = 2000;
  int items_per_chunk = 32;  ///< split-K chunk (several chunks per lane at these lengths)
  /// Window lists as the routing kernel writes them (the Full windows, then the Quantized ones),
  /// or in window order, the two tiers interleaved (pairs of a record and token rows).
  bool tiers_apart = true;
  /// Scales the queries: large scales spread the scores over many powers of two, so that a row's
  /// reference maximum is raised again and again while the kernel runs through its items.
  float query_scale = 1.0f;
  /// Requires every lane to fit one chunk: the launch then has no query kernel, and each CTA
  /// prepares its own query and writes its output without a merge.
  bool one_chunk = false;
  int kv_heads = 2;  ///< q_heads = kv_heads * group
};

struct built_cache {
  std::vector<std::byte> arena;
  std::vector<kernels::lane_state> lanes;
  std::vector<kernels::window_entry> entries;
  std::vector<int> entry_counts;  ///< per lane (one routing unit)
  int max_items = 0;
};

/// Reads the lane states and window lists out of a host-backend arena.
template <class Config>
built_cache lanes_of(const cache<Config>& kv, const std::vector<std::byte>& arena, const std::vector<sequence_id>& seqs,
                     const std::vector<long long>& first, const kernels::decode_layout& L, bool tiers_apart) {
  built_cache out;
  out.arena = arena;
  const region_plan& p = kv.plan();
  out.lanes.resize(seqs.size());
  out.entry_counts.resize(seqs.size());
  out.entries.assign(seqs.size() * static_cast<std::size_t>(L.entries_per_lane), kernels::window_entry{0, 0});
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const auto ws = kv.windows(seqs[b], 0);
    int aged = 0;
    while (aged < static_cast<int>(ws.size()) && ws[static_cast<std::size_t>(aged)].where != tier::recent) ++aged;
    const auto* table = reinterpret_cast<const window_record*>(arena.data() + b * p.region_bytes);
    int n = 0;
    for (int pass = 0; pass < (tiers_apart ? 2 : 1); ++pass)
      for (int w = 0; w < aged; ++w) {
        const bool full = table[w].full_slot >= 0, quantized = !full && table[w].ledger_slot >= 0;
        if (tiers_apart && (pass == 0 ? !full : !quantized)) continue;
        if (full) out.entries[b * L.entries_per_lane + n++] = {w, table[w].full_slot};
        else if (quantized) out.entries[b * L.entries_per_lane + n++] = {w, ~table[w].ledger_slot};
      }
    kernels::lane_state& s = out.lanes[b];
    s.tokens = kv.tokens(seqs[b], 0);
    s.aged = aged;
    out.entry_counts[b] = n;
    s.first_position = first[b];
    s.region = static_cast<long long>(L.region_offset(static_cast<int>(b)));
    const int items = (p.sinks > 0 ? 1 : 0) + n + (static_cast<int>(ws.size()) - aged);
    out.max_items = std::max(out.max_items, items);
  }
  return out;
}

template <class Config = cfg>
void run_case(const case_spec& spec, unsigned seed) {
  std::mt19937 rng(seed);
  geometry g;
  g.layers = 1;
  g.kv_heads = spec.kv_heads;
  g.q_heads = spec.kv_heads * spec.group;
  g.head_dim = spec.head_dim;
  g.element = spec.element;
  g.rope.theta = 500000.0f;
  g.rope.layout = spec.layout;
  const limits lim{.max_batch = spec.batch, .max_tokens = 4096};
  options opt;
  opt.routing = routing_mode::manual;
  std::vector<std::byte> arena(cache<Config>::required_bytes(g, spec.b, lim) + 64);
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(arena.data()) + 63) & ~std::uintptr_t{63});
  cache<Config> kv(g, spec.b, lim, storage::external{base, cache<Config>::required_bytes(g, spec.b, lim)}, opt);
  const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
  const std::size_t qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;

  // Ragged lengths, some shorter than the sinks, one at the limit of the recent ring.
  std::uniform_int_distribution<int> len_d(1, spec.max_len);
  std::uniform_int_distribution<int> pos_d(0, 100000);
  std::uniform_real_distribution<float> score_d(0.0f, 1.0f);
  std::vector<sequence_id> seqs;
  std::vector<long long> first;
  std::vector<int> lengths;
  for (int b = 0; b < spec.batch; ++b) {
    first.push_back(b % 3 == 0 ? 0 : pos_d(rng));
    seqs.push_back(kv.add_sequence(first.back()));
    lengths.push_back(b == 1 ? 3 : b == 2 ? 6 : len_d(rng));
  }
  for (int b = 0; b < spec.batch; ++b) {
    const sequence_id s = seqs[static_cast<std::size_t>(b)];
    for (int i = 0; i < lengths[static_cast<std::size_t>(b)]; ++i) {
      if (kv.plan().sinks <= kv.tokens(s, 0) &&
          kv.tokens(s, 0) - kv.plan().sinks - static_cast<int>(kv.counts(s, 0).full + kv.counts(s, 0).quantized +
                                                               kv.counts(s, 0).evicted) * 8 >= kv.plan().recent_capacity) {
        // Random scores make routing move windows both ways (demotions, promotions, evictions).
        for (const auto& w : kv.windows(s, 0)) kv.set_score(s, 0, w.index, score_d(rng));
        kv.route(s);
      }
      // Keys with a per-token norm spread, so that attention is not uniform.
      std::vector<float> k = gpu_test::normal(rng, krow), v = gpu_test::normal(rng, krow);
      const float spread = 0.5f + 2.0f * score_d(rng);
      for (auto& x : k) x *= spread;
      const sequence_id one[1] = {s};
      kv.append(0, one, k, v);
    }
  }
  for (const sequence_id s : seqs)
    for (const auto& w : kv.windows(s, 0)) kv.set_score(s, 0, w.index, 0.0f);

  const kernels::decode_layout L = kernels::decode_layout::for_config<Config>(kv.plan(), g.rope.layout);
  const std::vector<std::byte> snapshot(base, base + cache<Config>::required_bytes(g, spec.b, lim));
  const built_cache built = lanes_of(kv, snapshot, seqs, first, L, spec.tiers_apart);

  // Host reference.
  const std::vector<float> q = gpu_test::normal(rng, qrow * spec.batch, 1.5f * spec.query_scale);
  std::vector<float> ref(q.size());
  kv.attend(0, seqs, q, ref);

  // Kernel on the same bytes.
  std::vector<int> batch_lanes(static_cast<std::size_t>(spec.batch));
  for (int b = 0; b < spec.batch; ++b) batch_lanes[static_cast<std::size_t>(b)] = b;
  device_buffer<std::byte> d_arena(built.arena);
  device_buffer<kernels::lane_state> d_lanes(built.lanes);
  device_buffer<kernels::window_entry> d_entries(built.entries);
  device_buffer<int> d_counts(built.entry_counts);
  device_buffer<int> d_batch(batch_lanes);
  device_buffer<float> d_q(q);
  device_buffer<float> d_out(q.size());
  const auto inv = rope::rotary::inverse_frequencies(g.rope, g.head_dim);
  device_buffer<double> d_inv(inv);
  const int ipc = spec.items_per_chunk;
  if (spec.one_chunk) REQUIRE((ipc > 0 && built.max_items <= ipc));
  const auto ws = kernels::decode_workspace::sizes(L, spec.batch, ipc);
  device_buffer<std::byte> d_workspace(ws.bytes());
  QEVICT_CUDA_CHECK(cudaMemset(d_workspace.ptr, 0, ws.bytes()));
  kernels::decode_arguments a;
  a.arena = d_arena.ptr;
  a.lanes = d_lanes.ptr;
  a.entries = d_entries.ptr;
  a.entry_counts = d_counts.ptr;
  a.batch_lanes = d_batch.ptr;
  a.batch = spec.batch;
  a.q = d_q.ptr;
  a.out = d_out.ptr;
  a.inv_freq = d_inv.ptr;
  ws.bind(d_workspace.ptr, a);
  a.items_per_chunk = ipc;
  a.max_chunks = kernels::decode_workspace::chunks_for(L, ipc);
  kernels::decode_attention<true, scorers::cumulative_mass>(spec.element, L, a, built.max_items, nullptr);
  QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> out = d_out.download();
  const std::vector<std::byte> arena_after = d_arena.download();
  // The CTA that merges a (sequence, KV head) set its ticket back to zero: a second launch on the
  // same workspace, from the same scores, merges the same chunks in the same order whichever CTA
  // comes last, and adds the same masses.
  std::vector<unsigned> tickets(ws.tickets / sizeof(unsigned), 1u);
  QEVICT_CUDA_CHECK(cudaMemcpy(tickets.data(), a.tickets, ws.tickets, cudaMemcpyDeviceToHost));
  REQUIRE(tickets == std::vector<unsigned>(tickets.size(), 0u));
  // So did the last mass CTA of each sequence with its two counters (the KV heads merged, the mass
  // CTAs that saw them), and the mass grid's last CTA with its count of finished CTAs: the second
  // launch's mass kernel waits for that launch's merges, not the first one's.
  std::vector<unsigned> signals(ws.signals / sizeof(unsigned), 1u);
  QEVICT_CUDA_CHECK(cudaMemcpy(signals.data(), a.mass_signals, ws.signals, cudaMemcpyDeviceToHost));
  REQUIRE(signals == std::vector<unsigned>(signals.size(), 0u));
  d_arena.upload(built.arena);
  kernels::decode_attention<true, scorers::cumulative_mass>(spec.element, L, a, built.max_items, nullptr);
  QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(d_out.download() == out);
  CHECK(d_arena.download() == arena_after);

  // Output: relative L2 error of every head's vector.
  double worst = 0.0;
  for (std::size_t hv = 0; hv < q.size() / g.head_dim; ++hv) {
    double num = 0.0, den = 0.0;
    for (int c = 0; c < g.head_dim; ++c) {
      const double r = ref[hv * g.head_dim + c], o = out[hv * g.head_dim + c];
      num += (o - r) * (o - r);
      den += r * r;
    }
    REQUIRE(std::isfinite(num));
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  CHECK_MESSAGE(worst <= 2e-3, "worst output relative error " << worst);

  // Window mass: relative L1 per sequence.
  double worst_mass = 0.0;
  for (int b = 0; b < spec.batch; ++b) {
    const auto* table = reinterpret_cast<const window_record*>(arena_after.data() + static_cast<std::size_t>(b) * kv.plan().region_bytes);
    double num = 0.0, den = 0.0;
    for (const auto& w : kv.windows(seqs[static_cast<std::size_t>(b)], 0)) {
      num += std::abs(static_cast<double>(table[w.index].score) - w.score);
      den += std::abs(static_cast<double>(w.score));
    }
    if (den > 0.0) worst_mass = std::max(worst_mass, num / den);
  }
  CHECK_MESSAGE(worst_mass <= 1e-3, "worst window-mass relative L1 error " << worst_mass);
  MESSAGE("d=" << spec.head_dim << " G=" << spec.group << " batch=" << spec.batch << std::string(spec.element == element_type::bf16 ? " bf16" : " f16")
               << " K_f=" << kv.plan().caps.full << " K_q=" << kv.plan().caps.quantized << ": output " << worst
               << ", mass " << worst_mass);
}

}  // namespace

namespace {
/// Every head_dim x GQA ratio x batch x element type x budget, rotate_half pairs.
template <class Config>
void run_grid(std::initializer_list<budget> budgets, unsigned seed) {
  for (int d : {64, 128})
    for (int group : {1, 4, 8})
      for (int batch : {1, 7, 32})
        for (element_type e : {element_type::bf16, element_type::f16})
          for (const budget& b : budgets) {
            CAPTURE(d);
            CAPTURE(group);
            CAPTURE(batch);
            CAPTURE(static_cast<int>(e));
            CAPTURE(static_cast<int>(b.what()));
            CAPTURE(b.fraction_value());
            run_case<Config>(case_spec{d, group, batch, e, b, rope_layout::rotate_half, batch == 32 ? 1200 : 3000}, seed++);
          }
}
}  // namespace

TEST_CASE("decode attention matches the host backend") {
  run_grid<cfg>({budget::everything(), budget::fraction(1.0), budget::fraction(0.20), budget::fraction(0.05)}, 1);
}

TEST_CASE("decode attention with interleaved rotary pairs") {
  for (int d : {64, 128}) run_case(case_spec{d, 4, 7, element_type::bf16, budget::fraction(0.2), rope_layout::interleaved, 2500}, 1000u + d);
}

TEST_CASE("decode attention over keys quantized after RoPE matches the host backend") {
  run_grid<cfg_post_rope>({budget::fraction(0.20), budget::fraction(0.05)}, 5000);
  for (int d : {64, 128})
    run_case<cfg_post_rope>(case_spec{d, 4, 7, element_type::bf16, budget::fraction(0.2), rope_layout::interleaved, 2500}, 6000u + d);
}

TEST_CASE("decode attention over window-relative keys matches the host backend") {
  // Both rotary layouts (the query's rotation per window pairs channels differently), one batch
  // and budget per GQA ratio.
  unsigned seed = 7000;
  for (int d : {64, 128})
    for (int group : {1, 4, 8})
      for (element_type e : {element_type::bf16, element_type::f16})
        for (rope_layout layout : {rope_layout::rotate_half, rope_layout::interleaved}) {
          const int batch = group == 4 ? 32 : 7;
          CAPTURE(d);
          CAPTURE(group);
          CAPTURE(static_cast<int>(e));
          CAPTURE(static_cast<int>(layout));
          run_case<cfg_window_relative>(case_spec{d, group, batch, e, budget::fraction(group == 8 ? 0.05 : 0.20), layout,
                                                  batch == 32 ? 1200 : 3000},
                                        seed++);
        }
}

TEST_CASE("decode attention with every split-K chunk size") {
  // From 8 items (dozens of chunks per lane) to the longest chunk (one or two), and the launch's
  // own choice (0), for every key frame: each chunk's masses and partial outputs must meet in the
  // merge whichever chunk wrote them.
  unsigned seed = 9000;
  for (int ipc : {8, 16, 64, 128, kernels::max_items_per_chunk(8), 0}) {
    CAPTURE(ipc);
    run_case(case_spec{128, 4, 7, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 3000, ipc}, seed++);
    run_case<cfg_post_rope>(case_spec{64, 8, 7, element_type::f16, budget::fraction(0.05), rope_layout::rotate_half, 3000, ipc}, seed++);
    run_case<cfg_window_relative>(case_spec{128, 1, 32, element_type::bf16, budget::fraction(0.2), rope_layout::interleaved, 1200, ipc}, seed++);
    run_case(case_spec{64, 4, 1, element_type::f16, budget::everything(), rope_layout::rotate_half, 3000, ipc}, seed++);
  }
}

TEST_CASE("decode attention with one chunk per lane: each CTA prepares its own query") {
  // Lanes of at most 128 items in chunks of 128, and lanes of more than 128 items in the longest
  // chunk (described by the CTA's threads in two or three rounds): the grid has one chunk per (sequence,
  // KV head), and its CTAs rotate and split their queries themselves (with the paper's records,
  // also the per-key rotation table), for every key frame, group and head_dim.
  unsigned seed = 9500;
  auto one = [](case_spec c, int chunk = 128) {
    c.items_per_chunk = chunk;
    c.one_chunk = true;
    return c;
  };
  run_case(one(case_spec{128, 4, 7, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 700}), seed++);
  run_case(one(case_spec{64, 8, 3, element_type::f16, budget::fraction(0.2), rope_layout::interleaved, 700}), seed++);
  run_case<cfg_post_rope>(one(case_spec{128, 4, 32, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 700}), seed++);
  run_case<cfg_window_relative>(one(case_spec{128, 1, 7, element_type::bf16, budget::fraction(0.2), rope_layout::interleaved, 700}), seed++);
  run_case(one(case_spec{64, 4, 1, element_type::f16, budget::everything(), rope_layout::rotate_half, 900}), seed++);
  constexpr int longest = kernels::max_items_per_chunk(8);
  static_assert(longest > 128, "the cases below need chunks of more than 128 items");
  run_case(one(case_spec{128, 4, 7, element_type::bf16, budget::everything(), rope_layout::rotate_half, 1300}, longest), seed++);
  run_case<cfg_post_rope>(one(case_spec{128, 4, 32, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 1400}, longest), seed++);
  run_case<cfg_window_relative>(one(case_spec{64, 8, 3, element_type::f16, budget::fraction(0.2), rope_layout::interleaved, 1400}, longest), seed++);
  run_case(one(case_spec{128, 1, 3, element_type::f16, budget::fraction(0.2), rope_layout::interleaved, 1400}, longest), seed++);
  // Lanes of more than 256 items in the longest chunk: three rounds of descriptions.
  static_assert(longest > 256, "the cases below need chunks of more than 256 items");
  run_case<cfg_post_rope>(one(case_spec{128, 4, 7, element_type::bf16, budget::everything(), rope_layout::rotate_half, 2900}, longest), seed++);
  run_case(one(case_spec{64, 8, 3, element_type::f16, budget::everything(), rope_layout::interleaved, 2900}, longest), seed++);
  // More KV heads than the other cases' 2: 8 (Llama-3's) and 16, for whose masses the mass
  // kernel sums over as many CTAs' values.
  auto heads = [](case_spec c, int kv_heads) {
    c.kv_heads = kv_heads;
    return c;
  };
  run_case<cfg_post_rope>(one(heads(case_spec{128, 4, 7, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 1400}, 8), longest), seed++);
  run_case(one(heads(case_spec{64, 2, 3, element_type::f16, budget::everything(), rope_layout::interleaved, 900}, 8)), seed++);
  run_case<cfg_window_relative>(one(heads(case_spec{128, 1, 3, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 1400}, 16), longest), seed++);
  run_case(one(heads(case_spec{64, 1, 7, element_type::bf16, budget::fraction(0.05), rope_layout::rotate_half, 3000}, 16), longest), seed++);
}

TEST_CASE("decode attention over window lists with the tiers interleaved") {
  // Window order, as a list may hold them: most pairs then mix a record with token rows.
  unsigned seed = 9500;
  for (int d : {64, 128})
    for (element_type e : {element_type::bf16, element_type::f16}) {
      CAPTURE(d);
      CAPTURE(static_cast<int>(e));
      case_spec spec{d, 4, 7, e, budget::fraction(0.2), rope_layout::rotate_half, 3000};
      spec.tiers_apart = false;
      run_case(spec, seed++);
      run_case<cfg_post_rope>(spec, seed++);
      run_case<cfg_window_relative>(spec, seed++);
    }
}

TEST_CASE("decode attention with scores spread over many powers of two") {
  // Queries 6 and 12 times larger: a row's scores then span dozens of log2 units, so that its
  // reference maximum is raised past the rescale margin at later items, not only the first pair,
  // and most probabilities underflow. With keys after RoPE or window-relative, groups of 1, 2 and 4
  // heads take the output product whose columns 4-7 hold the probabilities' low parts
  // (folds_low_part); 8 heads, and keys rotated one by one, the one without. With keys after RoPE
  // also in chunks of 128 items, where a warp's run of pairs of records is up to 16 pairs long
  // (4 in the default chunks of 32): the maximum is then raised far into the transposed loop.
  unsigned seed = 9700;
  for (float scale : {6.0f, 12.0f})
    for (int group : {1, 2, 4, 8}) {
      CAPTURE(scale);
      CAPTURE(group);
      case_spec spec{128, group, 7, element_type::bf16, budget::fraction(0.2), rope_layout::rotate_half, 3000};
      spec.query_scale = scale;
      run_case(spec, seed++);
      run_case<cfg_post_rope>(spec, seed++);
      run_case<cfg_window_relative>(spec, seed++);
      spec.items_per_chunk = 128;
      run_case<cfg_post_rope>(spec, seed++);
    }
}

// The baseline policies on the CUDA backend, against the host backend (the oracle): frozen
// selection (routing::frozen_after_prefill, SnapKV), nothing in the top tier and nothing evicted
// (allocators::quantize_all, KIVI-like), every window kept at two precisions
// (allocators::mixed_precision), and the observation-window prefill scorers
// (scorers::pooled_observation, SnapKV's pooling; scorers::defensive_mass, DefensiveKV's maximum).
//
// Each configuration runs the comparison of backend_comparison.cuh (outputs, scores, routing
// tables after every event, arenas) and, after every routing event, checks the policy's defining
// behaviour on the device's own tables:
//   - frozen selection: no window that had aged changes tier or slot after the prefill's event;
//     later events only give newly aged windows the slots still free, or evict them;
//   - quantize_all: no window is Full and none is evicted;
//   - mixed_precision: none is evicted, at most K_f are Full.
// The prefill scorers are also checked against each other on the device: on the same prompt, a
// pooled score is the largest summed score within the pooling radius, and a maximum over the
// observation queries lies between their mean and their sum.
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "backend_comparison.cuh"

namespace {

using namespace qevict;
using gpu_test::case_spec;
using gpu_test::device_buffer;
using gpu_test::quick;
using gpu_test::routing_event;
using gpu_test::run_case;

using frozen = config<>::with_routing<routing::frozen_after_prefill>;
using frozen_two_tier = frozen::with_allocator<allocators::two_tier>;
/// SnapKV's policies at W = 8: pooled observation scores, one selection at prefill, no quantization.
using snapkv_like = frozen_two_tier::with_scorer<scorers::pooled_observation<7>>;
/// DefensiveKV's policies with one selection per layer, at W = 8.
using defensive_like = frozen_two_tier::with_scorer<scorers::defensive_mass>;
using quantize_all = config<>::with_allocator<allocators::quantize_all>;
using mixed_precision = config<>::with_allocator<allocators::mixed_precision>;
using pooled = config<>::with_scorer<scorers::pooled_observation<7>>;
using pooled_narrow = config<>::with_scorer<scorers::pooled_observation<3>>;
using defensive = config<>::with_scorer<scorers::defensive_mass>;

/// Two shapes per configuration: head_dim 64 with one query head per KV head, and head_dim 128
/// with GQA groups of 4 over two layers; ragged prompts, a sequence replaced halfway.
std::vector<case_spec> cases_at(const budget& b) {
  const int steps = quick() ? 24 : 256;
  return {{64, 1, 7, element_type::bf16, b, 900, steps, 1, rope_layout::rotate_half, true},
          {128, 4, 5, element_type::f16, b, 700, steps, 2, rope_layout::interleaved, true}};
}

template <class Cfg, class PolicyCheck = gpu_test::no_policy_check>
void run_cases(const budget& b, unsigned seed, PolicyCheck&& check = {}) {
  for (const case_spec& c : cases_at(b)) {
    CAPTURE(c.head_dim);
    CAPTURE(c.group);
    run_case<Cfg>(c, seed++, check);
  }
}

/// Windows that have aged out of the recent region (their tier is no longer `recent`).
int aged_windows(const std::vector<window_info>& windows) {
  int aged = 0;
  while (aged < static_cast<int>(windows.size()) && windows[static_cast<std::size_t>(aged)].where != tier::recent)
    ++aged;
  return aged;
}

/// routing::frozen_after_prefill: the windows aged at one event keep their tier and slots at every
/// later event of the same sequence; newly aged windows are placed or evicted.
struct frozen_selection_check {
  struct snapshot {
    int aged = 0;
    std::vector<window_record> table;
  };
  std::map<std::pair<sequence_id, int>, snapshot> last;
  long long placed_after_prefill = 0, evicted_after_prefill = 0;

  template <class Twin>
  void operator()(Twin& t, sequence_id s, int layer, routing_event event) {
    const std::vector<window_info> windows = t.dev.windows(s, layer);
    snapshot now{aged_windows(windows), t.device_table(s, layer)};
    if (event == routing_event::decode) {
      const snapshot& before = last.at({s, layer});
      int changed = 0;
      for (int w = 0; w < before.aged; ++w) {
        const window_record& a = before.table[static_cast<std::size_t>(w)];
        const window_record& b = now.table[static_cast<std::size_t>(w)];
        changed += a.full_slot != b.full_slot || a.ledger_slot != b.ledger_slot;
      }
      CHECK_MESSAGE(changed == 0, "sequence " << s << " layer " << layer << ": " << changed << " of " << before.aged
                                              << " windows chosen earlier changed tier or slot");
      for (int w = before.aged; w < now.aged; ++w)
        ++(windows[static_cast<std::size_t>(w)].where == tier::evicted ? evicted_after_prefill : placed_after_prefill);
    }
    last[{s, layer}] = std::move(now);
  }

  /// The full runs age enough windows after the prefill (the 3-token prompt's, at least) to see
  /// both outcomes; the reduced set may not.
  void require_both_outcomes() const {
    MESSAGE("windows aged after the prefill's event: " << placed_after_prefill << " placed in free slots, "
                                                       << evicted_after_prefill << " evicted");
    if (quick()) return;
    CHECK(placed_after_prefill > 0);
    CHECK(evicted_after_prefill > 0);
  }
};

/// allocators::quantize_all: every aged window is Quantized.
struct everything_quantized_check {
  template <class Twin>
  void operator()(Twin& t, sequence_id s, int layer, routing_event) const {
    const tier_counts c = t.dev.counts(s, layer);
    const int aged = aged_windows(t.dev.windows(s, layer));
    CHECK(c.full == 0);
    CHECK(c.evicted == 0);
    CHECK(c.ledger_copies == 0);
    CHECK(c.quantized == static_cast<std::size_t>(aged));
  }
};

/// allocators::mixed_precision: every aged window is kept, at most K_f of them Full.
struct nothing_evicted_check {
  template <class Twin>
  void operator()(Twin& t, sequence_id s, int layer, routing_event) const {
    const tier_counts c = t.dev.counts(s, layer);
    const int aged = aged_windows(t.dev.windows(s, layer));
    CHECK(c.evicted == 0);
    CHECK(c.full <= t.dev.plan().caps.full);
    CHECK(c.full + c.quantized == static_cast<std::size_t>(aged));
  }
};

}  // namespace

TEST_CASE("CUDA backend: frozen selection (routing::frozen_after_prefill)") {
  // 5% of the cache holds about 15 windows: long prompts fill every slot at prefill, so later
  // windows are evicted as they age, while the 3-token prompt leaves slots free for them.
  SUBCASE("three tiers") {
    frozen_selection_check check;
    run_cases<frozen>(budget::fraction(0.05), 101, check);
    run_cases<frozen>(budget::fraction(0.20), 103, check);
    check.require_both_outcomes();
  }
  SUBCASE("SnapKV-like: pooled observation scores, two tiers") {
    frozen_selection_check check;
    run_cases<snapkv_like>(budget::fraction(0.05), 107, check);
    check.require_both_outcomes();
  }
  SUBCASE("DefensiveKV-like: maximum over observation queries, two tiers") {
    frozen_selection_check check;
    run_cases<defensive_like>(budget::fraction(0.10), 109, check);
    check.require_both_outcomes();
  }
}

TEST_CASE("CUDA backend: quantize_all keeps every window quantized") {
  run_cases<quantize_all>(budget::everything(), 201, everything_quantized_check{});
  run_cases<quantize_all>(budget::fraction(0.35), 203, everything_quantized_check{});
}

TEST_CASE("CUDA backend: two_tier and three_tier<100> at the extremes of the split") {
  run_cases<config<>::with_allocator<allocators::two_tier>>(budget::fraction(0.10), 211);
  run_cases<config<>::with_allocator<allocators::three_tier<100>>>(budget::fraction(0.10), 213);
}

TEST_CASE("CUDA backend: mixed_precision keeps every window, the most attended in full precision") {
  run_cases<mixed_precision>(budget::fraction(0.45), 301, nothing_evicted_check{});
}

TEST_CASE("CUDA backend: prefill scorers (pooled observation, maximum over queries)") {
  run_cases<pooled>(budget::fraction(0.10), 401);
  run_cases<pooled_narrow>(budget::fraction(0.20), 403);
  run_cases<defensive>(budget::fraction(0.10), 405);
}

TEST_CASE("CUDA backend: prefill scores pool and aggregate as the scorers define") {
  for (const int head_dim : {64, 128})
    for (const int group : {1, 4}) {
      CAPTURE(head_dim);
      CAPTURE(group);
      geometry g;
      g.layers = 1;
      g.kv_heads = 2;
      g.q_heads = 2 * group;
      g.head_dim = head_dim;
      g.element = element_type::bf16;
      const limits lim{.max_batch = 1, .max_tokens = 2048};
      options opt;
      opt.routing = routing_mode::manual;
      const budget b = budget::fraction(0.2);
      cache<config<>, backend::cuda> summed(g, b, lim, backend::cuda::settings{}, opt);
      cache<pooled, backend::cuda> pooled_cache(g, b, lim, backend::cuda::settings{}, opt);
      cache<defensive, backend::cuda> max_cache(g, b, lim, backend::cuda::settings{}, opt);
      std::mt19937 rng(static_cast<unsigned>(17 * head_dim + group));
      const int n = 700, observers = opt.observation_window;
      const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * head_dim;
      const std::size_t q_size = static_cast<std::size_t>(observers) * g.q_heads * head_dim;
      const device_buffer<float> q(gpu_test::normal(rng, q_size, 1.5f)), k(gpu_test::normal(rng, n * krow)),
          v(gpu_test::normal(rng, n * krow));
      auto prefill = [&](auto& kv) {
        const sequence_id s = kv.add_sequence(0);
        kv.prefill(0, s, std::span<const float>(q.ptr, q.n), std::span<const float>(k.ptr, k.n),
                   std::span<const float>(v.ptr, v.n), std::span<float>());
        return kv.windows(s, 0);
      };
      const std::vector<window_info> sums = prefill(summed), pools = prefill(pooled_cache), maxima = prefill(max_cache);
      REQUIRE(sums.size() == pools.size());
      REQUIRE(sums.size() == maxima.size());
      const int windows = static_cast<int>(sums.size()), radius = scorers::pooled_observation<7>::prefill_pooling / 2;
      int pooled_wrong = 0, max_outside = 0, max_below_sum = 0;
      for (int w = 0; w < windows; ++w) {
        float expected = 0.0f;
        for (int x = std::max(0, w - radius); x <= std::min(windows - 1, w + radius); ++x)
          expected = std::max(expected, sums[static_cast<std::size_t>(x)].score);
        const float got = pools[static_cast<std::size_t>(w)].score, s = sums[static_cast<std::size_t>(w)].score,
                    m = maxima[static_cast<std::size_t>(w)].score;
        pooled_wrong += std::abs(got - expected) > 1e-6f * expected + 1e-12f;
        max_outside += m > s * (1 + 1e-6f) + 1e-12f || m < s / observers * (1 - 1e-6f) - 1e-12f;
        max_below_sum += m < s * (1 - 1e-3f);
      }
      CHECK_MESSAGE(pooled_wrong == 0, pooled_wrong << " of " << windows
                                                    << " pooled scores are not the largest summed score within "
                                                    << radius << " windows");
      CHECK_MESSAGE(max_outside == 0,
                    max_outside << " of " << windows << " maxima over the observation queries lie outside [mean, sum]");
      CHECK_MESSAGE(max_below_sum > windows / 2,
                    "the maximum equals the sum for " << windows - max_below_sum << " of " << windows << " windows");
    }
}

// Every preset the CUDA backend supports (backend::cuda_supports), on the CUDA backend against the
// host backend (the oracle), with backend_comparison.cuh's checks: outputs, window scores, routing
// tables identical after every event, arenas byte for byte. Since the host backend's presets are
// tested for their defining behaviour (tests/presets), identical tables carry that behaviour over.
//
// The window sizes the decode kernel handles differently are all covered: W = 1 (h2o, snapkv: one
// item gathers 8 windows from their Full slots), W = 32 (r4 with records before RoPE, kivi2 with
// records after RoPE: a window is 4 items, its record staged part by part), and W = 2, 4 and 16 in
// configurations of their own; so are 4-bit codes (kivi4 after RoPE at W = 32, kvquant_like
// before RoPE at W = 8, and three-tier INT4 caches whose records are promoted and demoted).
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "backend_comparison.cuh"

namespace {

using namespace qevict;
using gpu_test::case_spec;
using gpu_test::quick;
using gpu_test::run_case;

/// A budget the preset is defined for: everything for methods that never evict (and for full_kv),
/// 20% of the full cache for the others.
template <class Preset>
budget budget_for() {
  if constexpr (Preset::allocator::keeps_everything) return budget::everything();
  else if (std::string_view{Preset::name} == "full_kv") return budget::everything();
  else return budget::fraction(0.20);
}

/// head_dim 64 with one query head per KV head (bf16, rotate_half), and head_dim 128 with GQA
/// groups of 4 over two layers (fp16, interleaved); ragged prompts, a sequence replaced halfway.
std::vector<case_spec> shapes(const budget& b) {
  const int steps = quick() ? 24 : 256;
  return {{64, 1, 7, element_type::bf16, b, 900, steps, 1, rope_layout::rotate_half, true},
          {128, 4, 5, element_type::f16, b, 700, steps, 2, rope_layout::interleaved, true}};
}

template <class Cfg>
void run_shapes(const budget& b, unsigned seed) {
  for (const case_spec& c : shapes(b)) {
    CAPTURE(c.head_dim);
    CAPTURE(c.group);
    run_case<Cfg>(c, seed++);
  }
}

}  // namespace

TEST_CASE("CUDA backend: every supported preset against the host backend") {
  std::vector<std::string> ran, host_only;
  unsigned seed = 1001;
  presets::for_each([&]<class Preset>(std::string_view name) {
    using cfg = typename Preset::config_type;
    if constexpr (backend::cuda_supports<cfg>) {
      CAPTURE(name);
      run_shapes<cfg>(budget_for<Preset>(), seed);
      ran.emplace_back(name);
    } else {
      host_only.emplace_back(name);
    }
    seed += 10;
  });
  std::string ran_list, host_list;
  for (const std::string& n : ran) ran_list += " " + n;
  for (const std::string& n : host_only) host_list += " " + n;
  MESSAGE("on the CUDA backend:" << ran_list << "; host backend only:" << host_list);
  // The presets with W = 1 and W = 32 are among them (the kernel's item mapping differs for them).
  const auto has = [&](std::string_view n) {
    for (const std::string& r : ran)
      if (r == n) return true;
    return false;
  };
  CHECK(has("h2o"));
  CHECK(has("snapkv"));
  CHECK(has("r4"));
  CHECK(has("kivi2"));
  // 4-bit codes, after RoPE (kivi4, W = 32) and before it (kvquant_like, W = 8).
  CHECK(has("kivi4"));
  CHECK(has("kvquant_like"));
}

TEST_CASE("CUDA backend: 4-bit records that are promoted, demoted and evicted (three tiers)") {
  using int4 = config<>::with_quantizer<quantizers::asymmetric<4>>;
  using int4_post = config<>::with_quantizer<quantizers::asymmetric<4, meta::bf16, quantizers::key_frame::after_rope>>;
  run_shapes<int4>(budget::fraction(0.20), 3001);
  run_shapes<int4_post>(budget::fraction(0.10), 3011);
}

TEST_CASE("CUDA backend: windows of 2, 4 and 16 tokens") {
  using two = config<>::with_window<window<2, 8, 32>>::with_allocator<allocators::two_tier>;
  using four = config<>::with_window<window<4, 3, 32>>::with_allocator<allocators::two_tier>;
  using sixteen = config<>::with_window<window<16, 5, 32>>;
  using sixteen_relative = sixteen::with_quantizer<quantizers::asymmetric<2, meta::bf16, quantizers::key_frame::window_relative>>;
  static_assert(backend::cuda_supports<two> && backend::cuda_supports<four> && backend::cuda_supports<sixteen>);
  run_shapes<two>(budget::fraction(0.20), 2001);
  run_shapes<four>(budget::fraction(0.10), 2011);
  run_shapes<sixteen>(budget::fraction(0.20), 2021);
  run_shapes<sixteen_relative>(budget::fraction(0.10), 2031);
}

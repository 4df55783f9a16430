#pragma once
// Every method the QEvict paper compares against, and its ablations, as compositions of qevict's
// policies. They share one byte accounting (core/layout.hpp) and one backend, so a comparison at
// a given budget_per_sequence_layer is fair by construction. Switching methods is one line:
//
//   qevict::cache<qevict::presets::snapkv> kv(geometry, budget, limits);
//
// Each preset is a config with three strings: its name, its source, and what this composition
// simplifies relative to the original method. docs/policies.md has the table.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "qevict/config.hpp"
#include "qevict/core/layout.hpp"

namespace qevict::presets {

namespace detail {
/// A preset: a config plus its documentation.
template <class Config>
struct preset : Config {
  using config_type = Config;
};
}  // namespace detail

// ---- the paper and its ablations (review §3) ---------------------------------------------------

/// QEvict: windows of 8, three tiers (q = 0.70), cumulative scores, Algorithm 1 every 8 steps.
struct qevict : detail::preset<config<>> {
  static constexpr const char* name = "qevict";
  static constexpr const char* source = "QEvict, arXiv 2608.05326 (Algorithm 1, Eq. 1-5)";
  static constexpr const char* simplified = "nothing: the paper's configuration";
};
/// QEvict whose records keep the keys after RoPE, the frame KIVI's cache quantizes in: the same
/// bytes, tiers and routing; attention uses the quantized keys without rotating them (the CUDA
/// kernel's cheapest INT2 path).
struct qevict_post_rope
    : detail::preset<config<>::with_quantizer<quantizers::asymmetric<2, meta::bf16, quantizers::key_frame::after_rope>>> {
  static constexpr const char* name = "qevict_post_rope";
  static constexpr const char* source = "QEvict, arXiv 2608.05326, with KIVI's post-RoPE key frame (arXiv 2402.02750)";
  static constexpr const char* simplified = "keys are quantized after RoPE, not before it";
};
/// QEvict whose records keep the keys relative to their window's first token, k_rel = R(t - t0) k:
/// the same bytes, tiers and routing; attention rotates the query once per window instead of every
/// key (the design notes' window-relative frame). A rotary pair's outlier channel stays in its
/// channel, as before RoPE.
struct qevict_window_relative
    : detail::preset<config<>::with_quantizer<quantizers::asymmetric<2, meta::bf16, quantizers::key_frame::window_relative>>> {
  static constexpr const char* name = "qevict_window_relative";
  static constexpr const char* source = "QEvict, arXiv 2608.05326, with keys quantized relative to their window's start";
  static constexpr const char* simplified = "keys are quantized in the window-relative frame, not before RoPE";
};
/// R1: token-level routing (W = 1).
struct r1 : detail::preset<config<>::with_window<window<1, 5, 32>>> {
  static constexpr const char* name = "r1";
  static constexpr const char* source = "QEvict ablation R1 (token-level routing, W = 1)";
  static constexpr const char* simplified = "nothing";
};
/// R2: two tiers, Full + evicted (q = 0).
struct r2 : detail::preset<config<>::with_allocator<allocators::two_tier>> {
  static constexpr const char* name = "r2";
  static constexpr const char* source = "QEvict ablation R2 (two tiers: full precision + eviction)";
  static constexpr const char* simplified = "nothing";
};
/// R3: the three-tier policy with W = 8 (identical to qevict).
struct r3 : detail::preset<config<>> {
  static constexpr const char* name = "r3";
  static constexpr const char* source = "QEvict ablation R3 (three tiers, W = 8)";
  static constexpr const char* simplified = "nothing";
};
/// R4: coarse windows (W = 32).
struct r4 : detail::preset<config<>::with_window<window<32, 5, 32>>> {
  static constexpr const char* name = "r4";
  static constexpr const char* source = "QEvict ablation R4 (W = 32)";
  static constexpr const char* simplified = "nothing";
};

// ---- no compression ------------------------------------------------------------------------------

/// The uncompressed reference under the same accounting: use it with budget::everything().
struct full_kv : detail::preset<config<>::with_allocator<allocators::two_tier>> {
  static constexpr const char* name = "full_kv";
  static constexpr const char* source = "uncompressed KV cache";
  static constexpr const char* simplified = "needs budget::everything(); a smaller budget makes it R2";
};

// ---- eviction methods --------------------------------------------------------------------------

/// StreamingLLM: sinks plus a sliding window of the newest tokens. The budget beyond the 4 sinks
/// and the recent region buys more recent windows (ranked by recency), never old ones.
struct streaming_llm : detail::preset<config<scorers::recency, quantizers::asymmetric<2>, window<8, 4, 32>,
                                             allocators::two_tier>> {
  static constexpr const char* name = "streaming_llm";
  static constexpr const char* source = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024";
  static constexpr const char* simplified = "the sliding window advances in steps of 8 tokens at routing events (every 8 steps)";
};

/// H2O: token-level heavy hitters by cumulative attention plus the recent tokens, re-ranked
/// every step.
struct h2o : detail::preset<config<scorers::cumulative_mass, quantizers::asymmetric<2>, window<1, 0, 32>,
                                   allocators::two_tier, rope::rotary, 1>> {
  static constexpr const char* name = "h2o";
  static constexpr const char* source = "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference, NeurIPS 2023";
  static constexpr const char* simplified =
      "the recent part is a fixed 32 tokens and heavy hitters take the rest of the budget (H2O splits it evenly); "
      "scores averaged over query heads (one selection per layer)";
};

/// SnapKV's scorer: observation-window attention, max-pooled over 7 neighbouring tokens.
using snapkv_scorer = scorers::pooled_observation<7>;

/// SnapKV: tokens chosen once at prefill from the observation window's pooled attention; the
/// selection does not change during decode.
struct snapkv : detail::preset<config<snapkv_scorer, quantizers::asymmetric<2>, window<1, 0, 32>, allocators::two_tier,
                                      rope::rotary, 8, routing::frozen_after_prefill>> {
  static constexpr const char* name = "snapkv";
  static constexpr const char* source = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024";
  static constexpr const char* simplified =
      "one selection per layer (scores averaged over query heads); decode tokens past the recent region are kept "
      "while prompt evictions left room, then dropped, so the budget holds";
};

/// AdaKV: SnapKV's scores, but each KV head selects its own tokens from one shared layer budget,
/// so heads with concentrated attention give room to heads with spread attention.
struct adakv : detail::preset<config<snapkv_scorer, quantizers::asymmetric<2>, window<1, 0, 32>, allocators::two_tier,
                                     rope::rotary, 8, routing::frozen_after_prefill, selection::per_kv_head>> {
  static constexpr const char* name = "adakv";
  static constexpr const char* source = "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation, 2024";
  static constexpr const char* simplified = "per-KV-head selection (GQA groups share one choice); no guaranteed per-head floor";
};

/// CriticalKV's scorer: attention weighted by the attended value's norm, pooled like SnapKV.
struct critical_mass : scorers::value_weighted_mass {
  static constexpr const char* name = "critical_mass";
  static constexpr int prefill_pooling = 7;
};

/// CriticalKV: AdaKV with value-aware scores.
struct criticalkv : detail::preset<config<critical_mass, quantizers::asymmetric<2>, window<1, 0, 32>, allocators::two_tier,
                                          rope::rotary, 8, routing::frozen_after_prefill, selection::per_kv_head>> {
  static constexpr const char* name = "criticalkv";
  static constexpr const char* source = "Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective, 2025";
  static constexpr const char* simplified =
      "‖W_o^(h) v‖ when the layer's output projection is given (cache::set_output_projection, host backend), else ‖v‖";
};

/// DefensiveKV: AdaKV whose prefill scores take each token's worst case over the observation
/// queries rather than their mean.
struct defensivekv : detail::preset<config<scorers::defensive_mass, quantizers::asymmetric<2>, window<1, 0, 32>,
                                           allocators::two_tier, rope::rotary, 8, routing::frozen_after_prefill,
                                           selection::per_kv_head>> {
  static constexpr const char* name = "defensivekv";
  static constexpr const char* source = "Feng et al., Taming the Fragility of KV Cache Eviction in LLM Inference (DefensiveKV), 2025";
  static constexpr const char* simplified = "robust aggregation is the maximum over observation queries (no adaptive prior-risk correction)";
};

/// Layer-DefensiveKV: DefensiveKV with a budget per layer: give it budget.with_layer_shares({...}),
/// one share per layer (e.g. from each layer's attention concentration on a calibration run).
struct layer_defensivekv : detail::preset<defensivekv::config_type> {
  static constexpr const char* name = "layer_defensivekv";
  static constexpr const char* source = "Feng et al., DefensiveKV (layer-level budget allocation), 2025";
  static constexpr const char* simplified = "layer shares are fixed at construction (from a calibration run), not re-decided per prompt";
};

// ---- quantization methods ----------------------------------------------------------------------

/// KIVI: everything outside the full-precision residual (128 tokens) quantized in groups of 32
/// tokens, keys per channel and values per token; nothing evicted.
template <int Bits>
struct kivi : detail::preset<config<scorers::cumulative_mass, quantizers::asymmetric<Bits, meta::bf16, quantizers::key_frame::after_rope>,
                                    window<32, 0, 128>, allocators::quantize_all>> {
  static constexpr const char* name = Bits == 2 ? "kivi2" : "kivi4";
  static constexpr const char* source = "Liu et al., KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache, ICML 2024";
  static constexpr const char* simplified =
      "the full-precision residual advances in groups of 32 tokens at routing events (every 8 steps), so it holds 128 to 167 tokens";
};
using kivi2 = kivi<2>;
using kivi4 = kivi<4>;

/// KVQuant-like: pre-RoPE per-channel keys, per-token values, one full-precision sink, every
/// window kept quantized.
struct kvquant_like : detail::preset<config<scorers::cumulative_mass, quantizers::asymmetric<4>, window<8, 1, 32>,
                                            allocators::quantize_all>> {
  static constexpr const char* name = "kvquant_like";
  static constexpr const char* source = "Hooper et al., KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization, NeurIPS 2024";
  static constexpr const char* simplified = "uniform 4-bit codes; no non-uniform datatype, no dense-and-sparse outliers";
};

/// ZipCache-like: saliency (cumulative attention) chooses which windows are kept at 4 bits; the
/// rest are 2-bit; nothing is evicted.
struct zipcache_like
    : detail::preset<config<scorers::cumulative_mass, quantizers::asymmetric<2>, window<8, 5, 32>, allocators::mixed_precision,
                            rope::rotary, 8, routing::ranked, selection::per_layer,
                            full_tier::quantized_as<quantizers::asymmetric<4>>>> {
  static constexpr const char* name = "zipcache_like";
  static constexpr const char* source = "He et al., ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token Identification, NeurIPS 2024";
  static constexpr const char* simplified =
      "saliency is cumulative attention (not ZipCache's normalized score); windows of 8 tokens; uniform asymmetric codes";
};

// ---- iteration and budget matching ------------------------------------------------------------

/// Calls f.template operator()<Preset>(Preset::name) for every preset, in the order of docs/policies.md.
template <class F>
void for_each(F&& f) {
  f.template operator()<qevict>(std::string_view{qevict::name});
  f.template operator()<qevict_post_rope>(std::string_view{qevict_post_rope::name});
  f.template operator()<qevict_window_relative>(std::string_view{qevict_window_relative::name});
  f.template operator()<full_kv>(std::string_view{full_kv::name});
  f.template operator()<streaming_llm>(std::string_view{streaming_llm::name});
  f.template operator()<h2o>(std::string_view{h2o::name});
  f.template operator()<snapkv>(std::string_view{snapkv::name});
  f.template operator()<adakv>(std::string_view{adakv::name});
  f.template operator()<criticalkv>(std::string_view{criticalkv::name});
  f.template operator()<defensivekv>(std::string_view{defensivekv::name});
  f.template operator()<layer_defensivekv>(std::string_view{layer_defensivekv::name});
  f.template operator()<kivi2>(std::string_view{kivi2::name});
  f.template operator()<kivi4>(std::string_view{kivi4::name});
  f.template operator()<kvquant_like>(std::string_view{kvquant_like::name});
  f.template operator()<zipcache_like>(std::string_view{zipcache_like::name});
  f.template operator()<r1>(std::string_view{r1::name});
  f.template operator()<r2>(std::string_view{r2::name});
  f.template operator()<r3>(std::string_view{r3::name});
  f.template operator()<r4>(std::string_view{r4::name});
}

/// What one preset gets from a budget, under the common accounting.
struct matched_budget {
  std::string name;
  bool fits = false;
  std::string why_not;            ///< the error when it does not fit
  std::size_t budget_bytes = 0;   ///< B_total per sequence per layer (the same for every preset)
  std::size_t reserved_bytes = 0; ///< what its region actually reserves (<= budget_bytes)
  capacities caps;                ///< K_f, K_q in its routing units
  std::size_t units = 1;
};

/// One row per preset for the same budget: who fits, what each reserves.
inline std::vector<matched_budget> match_budgets(const geometry& g, const budget& b, const limits& lim) {
  std::vector<matched_budget> rows;
  for_each([&]<class Preset>(std::string_view) {
    matched_budget m;
    m.name = Preset::name;
    try {
      const region_plan p = make_region_plan<Preset>(g, b, lim);
      m.fits = true;
      m.budget_bytes = p.budget_bytes;
      m.reserved_bytes = p.region_bytes;
      m.caps = p.caps;
      m.units = static_cast<std::size_t>(p.units);
    } catch (const error& e) {
      m.why_not = e.what();
    }
    rows.push_back(m);
  });
  return rows;
}

}  // namespace qevict::presets

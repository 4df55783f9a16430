#pragma once
// One concept per policy. cache<> checks each with a static_assert that names the concept, so a
// wrong configuration fails with one readable line.

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "qevict/core/geometry.hpp"
#include "qevict/policies/allocators.hpp"
#include "qevict/policies/quantizers.hpp"
#include "qevict/policies/scorers.hpp"

namespace qevict {

template <class S>
concept scorer_policy = requires(float score, float mass, int window) {
  { S::name } -> std::convertible_to<const char*>;
  { S::token_signal } -> std::convertible_to<scorers::signal>;
  { S::prefill_aggregation } -> std::convertible_to<scorers::aggregation>;
  { S::prefill_pooling } -> std::convertible_to<int>;
  { S::initial_score(window) } -> std::same_as<float>;
  { S::accumulate(score, mass) } -> std::same_as<float>;
  { S::after_routing(score) } -> std::same_as<float>;
};

template <class Q>
concept quantizer_policy = requires(const quantizers::record_layout& L, const float* x, std::uint8_t* rec,
                                    const std::uint8_t* crec, float* out, int i) {
  { Q::bits } -> std::convertible_to<int>;
  { Q::key_frame::rotated } -> std::convertible_to<bool>;
  { Q::key_frame::read_rotation(0LL, 0LL) } -> std::convertible_to<long long>;
  { Q::layout(i, i, i) } -> std::same_as<quantizers::record_layout>;
  Q::quantize(L, x, x, rec);
  Q::dequantize_key(L, crec, i, i, out);
  Q::dequantize_value(L, crec, i, i, out);
};

template <class W>
concept window_policy = requires {
  { W::size } -> std::convertible_to<int>;
  { W::sinks } -> std::convertible_to<int>;
  { W::recent } -> std::convertible_to<int>;
} && (W::size >= 1) && (W::sinks >= 0) && (W::recent >= 0);

template <class A>
concept allocator_policy = requires(std::size_t n) {
  { A::name } -> std::convertible_to<const char*>;
  { A::keeps_everything } -> std::convertible_to<bool>;
  { A::split(n, n, n, n) } -> std::same_as<capacities>;
  { A::bytes_to_keep_all(n, n, n) } -> std::convertible_to<std::size_t>;
};

template <class R>
concept routing_policy = requires {
  { R::name } -> std::convertible_to<const char*>;
  { R::rerank_after_first_event } -> std::convertible_to<bool>;
};

template <class S>
concept selection_policy = requires {
  { S::name } -> std::convertible_to<const char*>;
  { S::splits_heads } -> std::convertible_to<bool>;
};

template <class F>
concept full_tier_policy = requires {
  { F::name } -> std::convertible_to<const char*>;
  { F::quantized } -> std::convertible_to<bool>;
};

template <class R>
concept rope_policy = requires(const rope_params& p, double* x, const double* f) {
  { R::rotates } -> std::convertible_to<bool>;
  R::inverse_frequencies(p, 8);
  R::rotate(rope_layout::rotate_half, f, 8, x, 0LL, 1);
};

}  // namespace qevict

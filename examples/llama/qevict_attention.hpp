#pragma once
// The engine's attention routed to qevict::cache (host backend), for one sequence.
//
// The model already produces what the cache wants: pre-RoPE q, k, v rows laid out
// [token][heads][head_dim]. Prefill hands the whole prompt of a layer over at once, so the cache
// can score windows from the last queries and route to its budget; decode appends one token and
// attends, and the cache routes on its own every Ω steps.

#include <cstddef>
#include <functional>
#include <span>
#include <string>

#include <qevict/cache.hpp>

#include "attention.hpp"
#include "model.hpp"

namespace llama {

// The geometry qevict needs, read from the model's hyperparameters.
inline qevict::geometry qevict_geometry(const hyperparams& p) {
    return qevict::geometry{
        .layers = static_cast<int>(p.layers),
        .q_heads = static_cast<int>(p.q_heads),
        .kv_heads = static_cast<int>(p.kv_heads),
        .head_dim = static_cast<int>(p.head_dim),
        .element = qevict::element_type::f32,
        .rope = {.theta = p.rope_theta,
                 .layout = p.rope == rope_layout::interleaved ? qevict::rope_layout::interleaved
                                                              : qevict::rope_layout::rotate_half}};
}

template <class Config = qevict::config<>>
class qevict_attention final : public attention {
public:
    using cache_type = qevict::cache<Config, qevict::backend::host>;

    qevict_attention(const hyperparams& p, qevict::budget budget, std::size_t max_tokens)
        : cache_(qevict_geometry(p), budget, qevict::limits{.max_batch = 1, .max_tokens = static_cast<int>(max_tokens)}),
          sequence_(cache_.add_sequence()), q_heads_(p.q_heads), kv_heads_(p.kv_heads), head_dim_(p.head_dim) {}

    void prefill(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                 std::span<float> out, std::size_t n) override {
        const std::size_t qw = q_heads_ * head_dim_, kvw = kv_heads_ * head_dim_;
        cache_.prefill(static_cast<int>(layer), sequence_, q.first(n * qw), k.first(n * kvw), v.first(n * kvw),
                       out.first(n * qw));
    }

    void decode(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                std::span<float> out) override {
        const std::span<const qevict::sequence_id> one(&sequence_, 1);
        cache_.append(static_cast<int>(layer), one, k, v);
        if (observer_) {
            cache_.attend(static_cast<int>(layer), one, q, out,
                          [&](const qevict::attention_event& e) { observer_(layer, e); });
        } else {
            cache_.attend(static_cast<int>(layer), one, q, out);
        }
    }

    // Sees every token each decode step attends to (its tier and head-averaged probability), for
    // diagnostics that compare what the compressed cache attended with the reference.
    using observer = std::function<void(std::size_t layer, const qevict::attention_event&)>;
    void set_observer(observer o) { observer_ = std::move(o); }

    [[nodiscard]] std::size_t kv_bytes() const override { return cache_.report().used_total().total(); }
    [[nodiscard]] std::string name() const override { return "qevict"; }

    [[nodiscard]] cache_type& cache() { return cache_; }
    [[nodiscard]] const cache_type& cache() const { return cache_; }
    [[nodiscard]] qevict::sequence_id sequence() const { return sequence_; }

private:
    cache_type cache_;
    qevict::sequence_id sequence_;
    std::size_t q_heads_, kv_heads_, head_dim_;
    observer observer_;
};

}  // namespace llama

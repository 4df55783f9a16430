#pragma once
// The seam between the model and its KV cache.
//
// The model computes q, k and v projections *before* RoPE and hands them to an `attention`
// object, which owns the KV cache: it rotates, stores, attends and writes the attention output.
// Two implementations exist:
//   dense_cache       this file: every token's key and value in float32, exact attention; the
//                     reference path, and the source of per-token attention probabilities.
//   qevict_attention  qevict_attention.hpp: the same calls routed to qevict::cache.
//
// Handing over pre-RoPE keys is what lets qevict quantize keys before rotation (their channels
// have stable ranges there) and re-rotate them at their stored positions.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace llama {

// How RoPE pairs the channels of a head. llama.cpp's "llama" architecture (and Meta's original
// checkpoints, and llama2.c) rotate adjacent pairs (x[2i], x[2i+1]); HF-style checkpoints rotate
// (x[i], x[i + d/2]).
enum class rope_layout { interleaved, half };

struct attention_shape {
    std::size_t layers = 0;
    std::size_t q_heads = 0;
    std::size_t kv_heads = 0;
    std::size_t head_dim = 0;
    float rope_theta = 10000.f;
    rope_layout rope = rope_layout::interleaved;

    [[nodiscard]] std::size_t q_width() const { return q_heads * head_dim; }
    [[nodiscard]] std::size_t kv_width() const { return kv_heads * head_dim; }
};

// Rotates one head's vector to absolute position `position`. Pair i turns by position·θ^(−2i/d).
// The angle is formed in double: at positions in the thousands a float product loses the low
// bits of the angle, and the reference implementation keeps them.
inline void apply_rope(std::span<float> head, std::size_t position, float theta, rope_layout layout) {
    const std::size_t d = head.size();
    for (std::size_t i = 0; i < d / 2; ++i) {
        const double freq = std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(d));
        const double angle = static_cast<double>(position) * freq;
        const auto c = static_cast<float>(std::cos(angle));
        const auto s = static_cast<float>(std::sin(angle));
        const std::size_t a = layout == rope_layout::interleaved ? 2 * i : i;
        const std::size_t b = layout == rope_layout::interleaved ? 2 * i + 1 : i + d / 2;
        const float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

class attention {
public:
    virtual ~attention() = default;

    // The first `n` tokens of one layer (positions 0..n-1). q is [n][q_heads][head_dim], k and v
    // are [n][kv_heads][head_dim], all pre-RoPE; writes causal attention output [n][q_heads][head_dim].
    virtual void prefill(std::size_t layer, std::span<const float> q, std::span<const float> k,
                         std::span<const float> v, std::span<float> out, std::size_t n) = 0;

    // One new token of one layer, at the next position: q [q_heads][head_dim], k and v
    // [kv_heads][head_dim] pre-RoPE; writes out [q_heads][head_dim].
    virtual void decode(std::size_t layer, std::span<const float> q, std::span<const float> k,
                        std::span<const float> v, std::span<float> out) = 0;

    // Bytes the KV storage holds now, over all layers.
    [[nodiscard]] virtual std::size_t kv_bytes() const = 0;
    [[nodiscard]] virtual std::string name() const = 0;
};

// Softmax-weighted sum over `n_keys` cached keys/values for one query head. keys and values are
// [token][kv_heads][head_dim] (keys already rotated). Leaves the probabilities in `scores`.
inline void attend_one_head(std::span<const float> q_head, std::span<const float> keys, std::span<const float> values,
                            std::size_t n_keys, std::size_t kv_head, std::size_t kv_heads, std::span<float> out_head,
                            std::vector<float>& scores) {
    const std::size_t d = q_head.size();
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    scores.resize(n_keys);
    float max_score = -INFINITY;
    for (std::size_t t = 0; t < n_keys; ++t) {
        const float* key = keys.data() + (t * kv_heads + kv_head) * d;
        float dot = 0;
        for (std::size_t i = 0; i < d; ++i) dot += q_head[i] * key[i];
        scores[t] = dot * scale;
        max_score = std::max(max_score, scores[t]);
    }
    float sum = 0;
    for (std::size_t t = 0; t < n_keys; ++t) {
        scores[t] = std::exp(scores[t] - max_score);
        sum += scores[t];
    }
    std::fill(out_head.begin(), out_head.end(), 0.f);
    for (std::size_t t = 0; t < n_keys; ++t) {
        scores[t] /= sum;
        const float* value = values.data() + (t * kv_heads + kv_head) * d;
        for (std::size_t i = 0; i < d; ++i) out_head[i] += scores[t] * value[i];
    }
}

// The reference KV cache: float32, every token kept, exact softmax attention.
class dense_cache final : public attention {
public:
    dense_cache(const attention_shape& shape, std::size_t max_tokens)
        : shape_(shape), max_tokens_(max_tokens), keys_(shape.layers), values_(shape.layers),
          probabilities_(shape.layers) {}

    // When on, every call keeps the attention probabilities of its last query:
    // probabilities(layer) is [q_heads][tokens], each row summing to one.
    void record_probabilities(bool on) { record_ = on; }
    [[nodiscard]] std::span<const float> probabilities(std::size_t layer) const { return probabilities_.at(layer); }
    // The same averaged over query heads: one distribution over the cached tokens, the form
    // qevict::diagnostics::attention_step takes.
    [[nodiscard]] std::vector<float> head_averaged_probabilities(std::size_t layer) const {
        const auto& p = probabilities_.at(layer);
        std::vector<float> mean(p.size() / shape_.q_heads, 0.f);
        for (std::size_t h = 0; h < shape_.q_heads; ++h)
            for (std::size_t t = 0; t < mean.size(); ++t) mean[t] += p[h * mean.size() + t];
        for (auto& m : mean) m /= static_cast<float>(shape_.q_heads);
        return mean;
    }

    [[nodiscard]] std::size_t tokens(std::size_t layer = 0) const { return keys_.at(layer).size() / shape_.kv_width(); }
    // Rotated keys and values of a layer, [token][kv_heads][head_dim].
    [[nodiscard]] std::span<const float> keys(std::size_t layer) const { return keys_.at(layer); }
    [[nodiscard]] std::span<const float> values(std::size_t layer) const { return values_.at(layer); }

    void prefill(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                 std::span<float> out, std::size_t n) override {
        for (std::size_t i = 0; i < n; ++i) step(layer, row(q, i, shape_.q_width()), row(k, i, shape_.kv_width()),
                                                 row(v, i, shape_.kv_width()), row(out, i, shape_.q_width()),
                                                 /*keep probabilities*/ i + 1 == n);
    }

    void decode(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                std::span<float> out) override {
        step(layer, q, k, v, out, true);
    }

    [[nodiscard]] std::size_t kv_bytes() const override {
        std::size_t bytes = 0;
        for (std::size_t l = 0; l < shape_.layers; ++l) bytes += (keys_[l].size() + values_[l].size()) * sizeof(float);
        return bytes;
    }
    [[nodiscard]] std::string name() const override { return "dense f32"; }

private:
    template <class T>
    static std::span<T> row(std::span<T> all, std::size_t i, std::size_t width) {
        return all.subspan(i * width, width);
    }

    // Causal attention for one token: append its rotated key and value, then attend over all.
    void step(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
              std::span<float> out, bool keep_probabilities) {
        const std::size_t position = tokens(layer);
        if (position >= max_tokens_)
            throw std::length_error("dense_cache: more than " + std::to_string(max_tokens_) + " tokens");
        const std::size_t d = shape_.head_dim;
        auto& keys = keys_[layer];
        keys.insert(keys.end(), k.begin(), k.begin() + static_cast<std::ptrdiff_t>(shape_.kv_width()));
        for (std::size_t h = 0; h < shape_.kv_heads; ++h)
            apply_rope(std::span<float>(keys).subspan(position * shape_.kv_width() + h * d, d), position,
                       shape_.rope_theta, shape_.rope);
        values_[layer].insert(values_[layer].end(), v.begin(), v.begin() + static_cast<std::ptrdiff_t>(shape_.kv_width()));

        const std::size_t n_keys = position + 1;
        const std::size_t group = shape_.q_heads / shape_.kv_heads;  // query heads sharing one KV head (GQA)
        const bool keep = record_ && keep_probabilities;
        if (keep) probabilities_[layer].assign(shape_.q_heads * n_keys, 0.f);
        std::vector<float> q_head(d);
        for (std::size_t h = 0; h < shape_.q_heads; ++h) {
            std::copy_n(q.begin() + static_cast<std::ptrdiff_t>(h * d), d, q_head.begin());
            apply_rope(q_head, position, shape_.rope_theta, shape_.rope);
            attend_one_head(q_head, keys, values_[layer], n_keys, h / group, shape_.kv_heads, out.subspan(h * d, d), scores_);
            if (keep) std::copy(scores_.begin(), scores_.end(), probabilities_[layer].begin() + static_cast<std::ptrdiff_t>(h * n_keys));
        }
    }

    attention_shape shape_;
    std::size_t max_tokens_;
    std::vector<std::vector<float>> keys_, values_, probabilities_;
    std::vector<float> scores_;
    bool record_ = false;
};

}  // namespace llama

#pragma once
// A Llama-architecture transformer in float32, read from a GGUF file.
//
//   x = token_embd[token]
//   per layer:  h = rmsnorm(x)·attn_norm;  q,k,v = Wq h, Wk h, Wv h        (pre-RoPE)
//               a = attention(q, k, v)      <- the `attention` object: RoPE, KV cache, softmax
//               x += Wo a
//               h = rmsnorm(x)·ffn_norm;    x += Wdown (silu(Wgate h) ⊙ Wup h)
//   logits = output · (rmsnorm(x)·output_norm)          (output = token_embd when tied)
//
// A forward call processes a block of tokens layer by layer, so a prompt reaches the cache as
// one prefill per layer, the way qevict::cache::prefill expects it.

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "attention.hpp"
#include "gguf.hpp"
#include "tokenizer.hpp"

namespace llama {

struct hyperparams {
    std::size_t dim = 0;
    std::size_t layers = 0;
    std::size_t q_heads = 0;
    std::size_t kv_heads = 0;
    std::size_t head_dim = 0;
    std::size_t ffn = 0;
    std::size_t vocab = 0;
    std::size_t context_length = 0;  // as the file states it; RoPE itself has no limit
    float rms_eps = 1e-5f;
    float rope_theta = 10000.f;
    rope_layout rope = rope_layout::interleaved;

    [[nodiscard]] attention_shape attention() const {
        return {.layers = layers, .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = head_dim,
                .rope_theta = rope_theta, .rope = rope};
    }
};

class model {
public:
    static model load(const std::filesystem::path& path) {
        model m(gguf::file::open(path));
        return m;
    }

    [[nodiscard]] const hyperparams& params() const { return p_; }
    [[nodiscard]] const tokenizer& vocab() const { return tokenizer_; }
    [[nodiscard]] const gguf::file& file() const { return file_; }

    // Runs `tokens` through the model at the positions following what `attn` already holds.
    // With `first == true` the block goes to attention::prefill (it must be the first block);
    // otherwise each token is decoded one at a time. Returns the logits of the last token, or of
    // every token ([n][vocab]) when `all_logits`.
    std::vector<float> prefill(std::span<const token_id> tokens, attention& attn, bool all_logits = false) const {
        return forward(tokens, attn, /*prefill*/ true, all_logits);
    }
    std::vector<float> decode(token_id token, attention& attn) const {
        return forward(std::span<const token_id>(&token, 1), attn, /*prefill*/ false, false);
    }

    // q, k, v projections (pre-RoPE) of `n` normalized rows `h` [n][dim] for one layer: the part of
    // attention that belongs to the model rather than to the cache.
    void project_qkv(std::size_t layer, std::span<const float> h, std::size_t n, std::span<float> q, std::span<float> k,
                     std::span<float> v) const {
        const auto& w = layers_[layer];
        matmul(w.wq, h, n, p_.dim, p_.q_heads * p_.head_dim, q);
        matmul(w.wk, h, n, p_.dim, p_.kv_heads * p_.head_dim, k);
        matmul(w.wv, h, n, p_.dim, p_.kv_heads * p_.head_dim, v);
    }

    // The attention output projection of one layer, [dim][q_heads * head_dim] row-major: what
    // value-weighted scorers (qevict::presets::criticalkv) take as W_o.
    [[nodiscard]] std::span<const float> output_projection(std::size_t layer) const { return layers_[layer].wo; }

private:
    struct layer_weights {
        std::span<const float> attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
    };

    // The architecture is checked before anything else is read, so a file of another model family
    // is reported as such rather than as a missing llama key.
    explicit model(gguf::file f) : file_(check_architecture(std::move(f))), tokenizer_(tokenizer::from_gguf(file_)) {
        read_hyperparams();
        bind_tensors();
    }

    static gguf::file check_architecture(gguf::file f) {
        const auto arch = f.get_string("general.architecture");
        if (arch != "llama")
            throw load_error(load_errc::unsupported_architecture,
                             f.path() + ": unsupported architecture '" + arch + "' (only 'llama' is supported)");
        return f;
    }

    void read_hyperparams() {
        auto size = [&](const char* key) { return static_cast<std::size_t>(file_.get_int(key)); };
        p_.dim = size("llama.embedding_length");
        p_.layers = size("llama.block_count");
        p_.q_heads = size("llama.attention.head_count");
        p_.kv_heads = static_cast<std::size_t>(file_.get_int("llama.attention.head_count_kv", static_cast<std::int64_t>(p_.q_heads)));
        p_.ffn = size("llama.feed_forward_length");
        p_.context_length = static_cast<std::size_t>(file_.get_int("llama.context_length", 0));
        p_.rms_eps = static_cast<float>(file_.get_number("llama.attention.layer_norm_rms_epsilon", 1e-5));
        p_.rope_theta = static_cast<float>(file_.get_number("llama.rope.freq_base", 10000.0));
        p_.vocab = tokenizer_.size();
        if (p_.q_heads == 0 || p_.kv_heads == 0 || p_.dim % p_.q_heads != 0 || p_.q_heads % p_.kv_heads != 0)
            throw load_error(load_errc::bad_metadata, file_.path() + ": inconsistent head counts");
        p_.head_dim = p_.dim / p_.q_heads;
        if (static_cast<std::size_t>(file_.get_int("llama.rope.dimension_count", static_cast<std::int64_t>(p_.head_dim))) != p_.head_dim)
            throw load_error(load_errc::bad_metadata, file_.path() + ": partial rotary embeddings are not supported");
        // llama.cpp converts every "llama" checkpoint to adjacent-pair rotation (its ROPE_TYPE_NORM).
        p_.rope = rope_layout::interleaved;
    }

    void bind_tensors() {
        std::set<std::string> used;
        auto get = [&](const std::string& name, std::vector<std::uint64_t> dims) {
            used.insert(name);
            return file_.tensor(name, std::move(dims)).data;
        };
        const std::uint64_t dim = p_.dim, q = p_.q_heads * p_.head_dim, kv = p_.kv_heads * p_.head_dim, ffn = p_.ffn,
                            vocab = p_.vocab;
        token_embd_ = get("token_embd.weight", {dim, vocab});
        output_norm_ = get("output_norm.weight", {dim});
        // Tied embeddings: a file without output.weight reuses token_embd.
        output_ = file_.find_tensor("output.weight") ? get("output.weight", {dim, vocab}) : token_embd_;
        for (std::size_t l = 0; l < p_.layers; ++l) {
            const std::string b = "blk." + std::to_string(l) + ".";
            layers_.push_back({.attn_norm = get(b + "attn_norm.weight", {dim}),
                               .wq = get(b + "attn_q.weight", {dim, q}),
                               .wk = get(b + "attn_k.weight", {dim, kv}),
                               .wv = get(b + "attn_v.weight", {dim, kv}),
                               .wo = get(b + "attn_output.weight", {q, dim}),
                               .ffn_norm = get(b + "ffn_norm.weight", {dim}),
                               .w_gate = get(b + "ffn_gate.weight", {dim, ffn}),
                               .w_up = get(b + "ffn_up.weight", {dim, ffn}),
                               .w_down = get(b + "ffn_down.weight", {ffn, dim})});
        }
        // A tensor this engine does not know (rope scaling factors, biases...) would be silently
        // ignored and give wrong results: refuse the file instead.
        for (const auto& t : file_.tensors())
            if (!used.contains(t.name))
                throw load_error(load_errc::unknown_tensor, file_.path() + ": unknown tensor '" + t.name + "'");
    }

    // y[r][o] = Σ_i W[o][i] x[r][i] for n rows; W is [out][in] (GGUF dims {in, out}).
    static void matmul(std::span<const float> w, std::span<const float> x, std::size_t n, std::size_t in, std::size_t out,
                       std::span<float> y) {
        for (std::size_t r = 0; r < n; ++r) {
            const float* xr = x.data() + r * in;
            for (std::size_t o = 0; o < out; ++o) {
                const float* wo = w.data() + o * in;
                float acc = 0;
                for (std::size_t i = 0; i < in; ++i) acc += wo[i] * xr[i];
                y[r * out + o] = acc;
            }
        }
    }

    void rmsnorm(std::span<const float> x, std::span<const float> weight, std::span<float> y, std::size_t n) const {
        for (std::size_t r = 0; r < n; ++r) {
            float ss = 0;
            for (std::size_t i = 0; i < p_.dim; ++i) ss += x[r * p_.dim + i] * x[r * p_.dim + i];
            const float inv = 1.0f / std::sqrt(ss / static_cast<float>(p_.dim) + p_.rms_eps);
            for (std::size_t i = 0; i < p_.dim; ++i) y[r * p_.dim + i] = x[r * p_.dim + i] * inv * weight[i];
        }
    }

    std::vector<float> forward(std::span<const token_id> tokens, attention& attn, bool as_prefill, bool all_logits) const {
        const std::size_t n = tokens.size(), dim = p_.dim;
        const std::size_t qw = p_.q_heads * p_.head_dim, kvw = p_.kv_heads * p_.head_dim;
        std::vector<float> x(n * dim), h(n * dim), q(n * qw), k(n * kvw), v(n * kvw), a(n * qw), proj(n * dim),
            gate(n * p_.ffn), up(n * p_.ffn);

        for (std::size_t r = 0; r < n; ++r) {
            const auto t = static_cast<std::size_t>(tokens[r]);
            if (t >= p_.vocab) throw std::out_of_range("token id " + std::to_string(t) + " outside the vocabulary");
            std::copy_n(token_embd_.begin() + static_cast<std::ptrdiff_t>(t * dim), dim, x.begin() + static_cast<std::ptrdiff_t>(r * dim));
        }

        for (std::size_t l = 0; l < p_.layers; ++l) {
            const auto& w = layers_[l];
            rmsnorm(x, w.attn_norm, h, n);
            project_qkv(l, h, n, q, k, v);
            if (as_prefill) {
                attn.prefill(l, q, k, v, a, n);
            } else {
                for (std::size_t r = 0; r < n; ++r)
                    attn.decode(l, std::span<const float>(q).subspan(r * qw, qw), std::span<const float>(k).subspan(r * kvw, kvw),
                                std::span<const float>(v).subspan(r * kvw, kvw), std::span<float>(a).subspan(r * qw, qw));
            }
            matmul(w.wo, a, n, qw, dim, proj);
            for (std::size_t i = 0; i < n * dim; ++i) x[i] += proj[i];

            rmsnorm(x, w.ffn_norm, h, n);
            matmul(w.w_gate, h, n, dim, p_.ffn, gate);
            matmul(w.w_up, h, n, dim, p_.ffn, up);
            for (std::size_t i = 0; i < n * p_.ffn; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // SwiGLU
            matmul(w.w_down, gate, n, p_.ffn, dim, proj);
            for (std::size_t i = 0; i < n * dim; ++i) x[i] += proj[i];
        }

        const std::size_t first = all_logits ? 0 : n - 1, rows = n - first;
        std::span<const float> last(x.data() + first * dim, rows * dim);
        rmsnorm(last, output_norm_, h, rows);
        std::vector<float> logits(rows * p_.vocab);
        matmul(output_, h, rows, dim, p_.vocab, logits);
        return logits;
    }

    gguf::file file_;
    tokenizer tokenizer_;
    hyperparams p_;
    std::span<const float> token_embd_, output_norm_, output_;
    std::vector<layer_weights> layers_;
};

}  // namespace llama

#pragma once
// Greedy generation and teacher-forced comparison on top of model + attention.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "attention.hpp"
#include "model.hpp"

namespace llama {

inline token_id argmax(std::span<const float> logits) {
    return static_cast<token_id>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

struct generate_options {
    std::size_t max_new_tokens = 200;
    bool stop_at_eos = true;
    // Called after each generated token (e.g. to print it as it appears); may be empty.
    std::function<void(token_id)> on_token = {};
};

// Prefills `prompt` (it must not be empty; it usually starts with BOS), then picks the most
// likely token step by step. Returns only the new tokens. `attn` must be fresh.
inline std::vector<token_id> generate_greedy(const model& m, attention& attn, std::span<const token_id> prompt,
                                             const generate_options& options = {}) {
    std::vector<token_id> out;
    if (options.max_new_tokens == 0) return out;
    std::vector<float> logits = m.prefill(prompt, attn);
    for (;;) {
        const token_id next = argmax(logits);
        if (options.stop_at_eos && next == m.vocab().eos()) break;
        out.push_back(next);
        if (options.on_token) options.on_token(next);
        if (out.size() == options.max_new_tokens) break;
        logits = m.decode(next, attn);
    }
    return out;
}

// Teacher forcing: feeds `prompt` then `continuation` through the model with `attn` and reports,
// for every continuation token, the logits that predicted it. The result is
// [continuation.size()][vocab]; row i is the distribution over continuation[i].
inline std::vector<float> teacher_forced_logits(const model& m, attention& attn, std::span<const token_id> prompt,
                                                std::span<const token_id> continuation) {
    const std::size_t vocab = m.params().vocab;
    std::vector<float> rows;
    rows.reserve(continuation.size() * vocab);
    if (continuation.empty()) return rows;
    std::vector<float> logits = m.prefill(prompt, attn);
    for (std::size_t i = 0; i < continuation.size(); ++i) {
        rows.insert(rows.end(), logits.begin(), logits.end());
        if (i + 1 < continuation.size()) logits = m.decode(continuation[i], attn);
    }
    return rows;
}

}  // namespace llama

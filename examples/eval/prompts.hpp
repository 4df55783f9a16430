#pragma once
// Prompts for the evaluation: a context of P tokens cut from one of the shared texts, followed
// by the real continuation of the text, which every method is fed token by token (teacher
// forcing), so the reference and the compressed runs see exactly the same tokens.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../llama/tokenizer.hpp"

namespace qevict_eval {

namespace fs = std::filesystem;

// A text the evaluation can cut prompts from: its short name (CSV, command line) and file.
struct text_source {
    std::string name;
    std::string file;
};

inline const std::vector<text_source>& known_texts() {
    static const std::vector<text_source> texts = {
        {"tinystories", "tinystories-lowercase.txt"},  // the model's own domain
        {"pride", "pride_and_prejudice.txt"},          // out of domain
    };
    return texts;
}

inline const text_source& find_text(std::string_view name) {
    for (const auto& t : known_texts())
        if (t.name == name) return t;
    throw std::invalid_argument("unknown text '" + std::string(name) + "' (known: tinystories, pride)");
}

inline std::string read_file(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + p.string());
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// One evaluation case: the prompt (BOS first) and decode_tokens + 1 continuation tokens.
// Decode step τ = 1..D feeds continuation[τ-1]; its logits predict continuation[τ].
struct prompt_case {
    std::string text;
    std::size_t context = 0;  // prompt tokens, BOS included
    std::size_t index = 0;    // which prompt of this text and context
    std::size_t char_offset = 0;
    std::vector<llama::token_id> prompt;
    std::vector<llama::token_id> continuation;
};

// Where prompt `index` of `count` starts: the text is divided into `count` equal parts and each
// prompt starts at the first paragraph boundary of its part. Pride and Prejudice starts at
// "Chapter 1" (the title lines are not prose).
inline std::size_t prompt_offset(const std::string& body, std::string_view text_name, std::size_t index, std::size_t count) {
    std::size_t begin = 0;
    if (text_name == "pride") {
        const auto c = body.find("Chapter 1");
        if (c != std::string::npos) begin = c;
    }
    std::size_t offset = begin + (body.size() - begin) / (count == 0 ? 1 : count) * index;
    if (offset > begin) {
        const auto p = body.find("\n\n", offset);
        if (p != std::string::npos) offset = p + 2;
    }
    return offset;
}

// Cuts `context` prompt tokens and `decode_tokens` + 1 continuation tokens from the text.
inline prompt_case cut_prompt(const llama::tokenizer& vocab, const std::string& body, std::string_view text_name,
                              std::size_t context, std::size_t decode_tokens, std::size_t index, std::size_t count) {
    if (context < 2) throw std::invalid_argument("a context needs at least 2 tokens (BOS and one more)");
    const std::size_t need = context + decode_tokens + 1;
    const std::size_t offset = prompt_offset(body, text_name, index, count);
    std::size_t chars = need * 4 + 256;
    std::vector<llama::token_id> tokens;
    for (;;) {
        const std::size_t take = std::min(chars, body.size() - offset);
        tokens = vocab.encode(std::string_view(body).substr(offset, take), /*add_bos*/ true);
        // The last token of a cut may be a piece of a longer one: keep a margin.
        if (tokens.size() >= need + 8 || take == body.size() - offset) break;
        chars *= 2;
    }
    if (tokens.size() < need)
        throw std::runtime_error("text '" + std::string(text_name) + "' is too short for " + std::to_string(need) +
                                 " tokens from offset " + std::to_string(offset));
    prompt_case c;
    c.text = std::string(text_name);
    c.context = context;
    c.index = index;
    c.char_offset = offset;
    c.prompt.assign(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(context));
    c.continuation.assign(tokens.begin() + static_cast<std::ptrdiff_t>(context),
                          tokens.begin() + static_cast<std::ptrdiff_t>(need));
    return c;
}

}  // namespace qevict_eval

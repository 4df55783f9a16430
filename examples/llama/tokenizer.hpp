#pragma once
// SentencePiece-style (BPE with scores) tokenizer built from a GGUF vocabulary, as llama.cpp and
// llama2.c run it for Llama models:
//
//   encode: spaces become '▁' (U+2581) and one '▁' is prepended (SentencePiece's dummy prefix);
//           the text is split into UTF-8 characters; repeatedly the adjacent pair whose
//           concatenation is in the vocabulary with the best score is merged (leftmost on ties);
//           a symbol left that is not in the vocabulary is spelled with byte tokens <0xXX>.
//   decode: pieces are concatenated, '▁' becomes a space, byte tokens become their byte; the
//           leading space the dummy prefix produced is dropped from the first piece.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "gguf.hpp"

namespace llama {

using token_id = std::int32_t;

class tokenizer {
public:
    // SentencePiece token types as GGUF stores them (tokenizer.ggml.token_type).
    enum class token_type : std::int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

    static tokenizer from_gguf(const gguf::file& f) {
        const auto& tokens = f.get_array("tokenizer.ggml.tokens");
        const auto& scores = f.get_array("tokenizer.ggml.scores");
        const auto* types = f.find("tokenizer.ggml.token_type");
        if (scores.size() != tokens.size() || (types && types->as_array().size() != tokens.size()))
            throw load_error(load_errc::bad_metadata, f.path() + ": tokenizer arrays have different lengths");

        tokenizer t;
        t.pieces_.reserve(tokens.size());
        for (std::size_t i = 0; i < tokens.size(); ++i) {
            const auto id = static_cast<token_id>(i);
            t.pieces_.push_back(tokens[i].as_string());
            t.scores_.push_back(static_cast<float>(scores[i].as_double()));
            t.types_.push_back(types ? static_cast<token_type>(types->as_array()[i].as_int()) : token_type::normal);
            t.ids_.emplace(t.pieces_.back(), id);
            if (auto byte = parse_byte_piece(t.pieces_.back())) t.byte_ids_[*byte] = id;
        }
        t.bos_ = static_cast<token_id>(f.get_int("tokenizer.ggml.bos_token_id", 1));
        t.eos_ = static_cast<token_id>(f.get_int("tokenizer.ggml.eos_token_id", 2));
        for (std::size_t b = 0; b < 256; ++b)
            if (t.byte_ids_[b] < 0)
                throw load_error(load_errc::bad_metadata, f.path() + ": vocabulary lacks byte fallback token for byte " +
                                                              std::to_string(b));
        return t;
    }

    [[nodiscard]] std::size_t size() const { return pieces_.size(); }
    [[nodiscard]] token_id bos() const { return bos_; }
    [[nodiscard]] token_id eos() const { return eos_; }
    [[nodiscard]] const std::string& piece(token_id id) const { return pieces_.at(static_cast<std::size_t>(id)); }
    [[nodiscard]] float score(token_id id) const { return scores_.at(static_cast<std::size_t>(id)); }

    [[nodiscard]] std::optional<token_id> find(std::string_view piece) const {
        auto it = ids_.find(std::string(piece));
        if (it == ids_.end()) return std::nullopt;
        return it->second;
    }

    // Tokens of `text`, optionally preceded by BOS. An empty text gets no dummy prefix.
    [[nodiscard]] std::vector<token_id> encode(std::string_view text, bool add_bos = true) const {
        std::vector<token_id> out;
        if (add_bos) out.push_back(bos_);
        if (text.empty()) return out;

        std::string normalized = std::string(space_marker);
        for (char c : text) {
            if (c == ' ') normalized += space_marker;
            else normalized += c;
        }

        // Symbols are byte ranges of `normalized` in a linked list; merging a pair grows the left
        // symbol and empties the right one. Candidate pairs wait in a queue ordered by score, then
        // by position (leftmost first, as SentencePiece breaks ties); an entry whose symbols have
        // changed since it was queued is stale and skipped. O(n log n), like llama.cpp.
        struct symbol {
            std::size_t begin, length;
            std::ptrdiff_t prev, next;
        };
        std::vector<symbol> symbols;
        for (std::size_t i = 0; i < normalized.size();) {
            const std::size_t n = std::min(utf8_length(static_cast<unsigned char>(normalized[i])), normalized.size() - i);
            const auto index = static_cast<std::ptrdiff_t>(symbols.size());
            symbols.push_back({i, n, index - 1, index + 1});
            i += n;
        }
        symbols.back().next = -1;

        struct pair {
            float score;
            std::ptrdiff_t left, right;
            std::size_t length;
            bool operator<(const pair& o) const { return score < o.score || (score == o.score && left > o.left); }
        };
        std::priority_queue<pair> queue;
        auto consider = [&](std::ptrdiff_t left, std::ptrdiff_t right) {
            if (left < 0 || right < 0) return;
            const auto& l = symbols[static_cast<std::size_t>(left)];
            const auto& r = symbols[static_cast<std::size_t>(right)];
            auto id = find(std::string_view(normalized.data() + l.begin, l.length + r.length));
            if (!id || types_[static_cast<std::size_t>(*id)] != token_type::normal) return;
            queue.push({score(*id), left, right, l.length + r.length});
        };
        for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
            consider(static_cast<std::ptrdiff_t>(i), static_cast<std::ptrdiff_t>(i + 1));

        while (!queue.empty()) {
            const pair top = queue.top();
            queue.pop();
            auto& l = symbols[static_cast<std::size_t>(top.left)];
            auto& r = symbols[static_cast<std::size_t>(top.right)];
            if (l.length == 0 || r.length == 0 || l.length + r.length != top.length) continue;  // stale
            l.length += r.length;
            r.length = 0;
            l.next = r.next;
            if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = top.left;
            consider(l.prev, top.left);
            consider(top.left, l.next);
        }

        for (const auto& s : symbols) {
            if (s.length == 0) continue;  // merged into its left neighbour
            const std::string_view piece_text(normalized.data() + s.begin, s.length);
            if (auto id = find(piece_text)) {
                out.push_back(*id);
            } else {
                for (unsigned char byte : piece_text) out.push_back(byte_ids_[byte]);
            }
        }
        return out;
    }

    // Text of one token. Control tokens (BOS, EOS, unknown) have no text.
    [[nodiscard]] std::string decode(token_id id) const {
        const auto index = static_cast<std::size_t>(id);
        switch (types_.at(index)) {
            case token_type::control:
            case token_type::unknown:
            case token_type::unused: return {};
            case token_type::byte: return std::string(1, static_cast<char>(*parse_byte_piece(pieces_[index])));
            default: break;
        }
        std::string text;
        const std::string& p = pieces_[index];
        for (std::size_t i = 0; i < p.size();) {
            if (p.compare(i, space_marker.size(), space_marker) == 0) {
                text += ' ';
                i += space_marker.size();
            } else {
                text += p[i++];
            }
        }
        return text;
    }

    // Text of a token sequence, as SentencePiece decodes it: the leading space that the dummy
    // prefix put on the first text piece is dropped. A continuation of earlier text keeps it
    // (drop_leading_space = false).
    [[nodiscard]] std::string decode(std::span<const token_id> ids, bool drop_leading_space = true) const {
        std::string text;
        bool first = drop_leading_space;
        for (token_id id : ids) {
            std::string piece_text = decode(id);
            if (piece_text.empty()) continue;
            if (first && piece_text.front() == ' ') piece_text.erase(0, 1);
            first = false;
            text += piece_text;
        }
        return text;
    }

private:
    static constexpr std::string_view space_marker = "\xE2\x96\x81";  // U+2581 '▁'

    static std::size_t utf8_length(unsigned char lead) {
        if (lead < 0x80) return 1;
        if ((lead >> 5) == 0x6) return 2;
        if ((lead >> 4) == 0xE) return 3;
        if ((lead >> 3) == 0x1E) return 4;
        return 1;  // a stray continuation byte: its own symbol, spelled by byte fallback
    }

    // "<0x41>" -> 0x41
    static std::optional<unsigned char> parse_byte_piece(std::string_view p) {
        if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return std::nullopt;
        auto hex = [](char c) -> int {
            if (c >= '0' && c <= '9') return c - '0';
            if (c >= 'A' && c <= 'F') return c - 'A' + 10;
            if (c >= 'a' && c <= 'f') return c - 'a' + 10;
            return -1;
        };
        const int hi = hex(p[3]), lo = hex(p[4]);
        if (hi < 0 || lo < 0) return std::nullopt;
        return static_cast<unsigned char>(hi * 16 + lo);
    }

    tokenizer() { byte_ids_.fill(-1); }

    std::vector<std::string> pieces_;
    std::vector<float> scores_;
    std::vector<token_type> types_;
    std::unordered_map<std::string, token_id> ids_;
    std::array<token_id, 256> byte_ids_{};
    token_id bos_ = 1;
    token_id eos_ = 2;
};

}  // namespace llama

// qevict_demo: generate text with a Llama GGUF model twice, once with a full KV cache and once
// with qevict::cache under a byte budget, and show both texts, the memory each used, how far the
// tokens agree and the cache's budget report.
//
//   qevict_demo [--prompt TEXT] [--tokens N] [--budget F] [--max-tokens N]
//               [--data DIR] [--model FILE]
//
// The budget is a fraction of a full-precision cache of --max-tokens tokens (qevict sizes every
// pool up front from it), so --max-tokens defaults to exactly what the run needs: the prompt plus
// the tokens to generate.

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "generate.hpp"
#include "model.hpp"
#include "qevict_attention.hpp"

namespace {

struct options {
    std::filesystem::path data_dir = QEVICT_DATA_DIR;
    std::optional<std::filesystem::path> model;
    std::string prompt;
    std::size_t new_tokens = 1000;
    double budget = 0.20;
    std::size_t max_tokens = 0;  // 0: prompt + new tokens
};

constexpr int usage_error = 2;

[[noreturn]] void fail(const std::string& message) {
    std::cerr << "qevict_demo: " << message << "\n";
    std::exit(usage_error);
}

void print_help() {
    std::cout << "usage: qevict_demo [options]\n"
                 "  --prompt TEXT     text to continue (default: start from BOS alone)\n"
                 "  --tokens N        tokens to generate (default 1000)\n"
                 "  --budget F        qevict byte budget, a fraction of the full-precision cache of\n"
                 "                    --max-tokens tokens (default 0.20)\n"
                 "  --max-tokens N    most tokens the sequence may hold, prompt included\n"
                 "                    (default: prompt + --tokens)\n"
                 "  --data DIR        folder with stories260K.gguf (default " QEVICT_DATA_DIR ")\n"
                 "  --model FILE      a Llama GGUF float32 model (default DIR/stories260K.gguf)\n";
}

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
    T value{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size())
        fail("'" + std::string(text) + "' is not a valid number for " + std::string(flag));
    return value;
}

options parse_args(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string_view flag = argv[i];
        if (flag == "--help" || flag == "-h") {
            print_help();
            std::exit(0);
        }
        if (i + 1 >= argc) fail("unknown option or missing value: " + std::string(flag) + " (see --help)");
        const std::string_view value = argv[++i];
        if (flag == "--prompt") o.prompt = value;
        else if (flag == "--tokens") o.new_tokens = parse_number<std::size_t>(flag, value);
        else if (flag == "--budget") o.budget = parse_number<double>(flag, value);
        else if (flag == "--max-tokens") {
            o.max_tokens = parse_number<std::size_t>(flag, value);
            if (o.max_tokens == 0) fail("--max-tokens must be positive");
        }
        else if (flag == "--data") o.data_dir = value;
        else if (flag == "--model") o.model = value;
        else fail("unknown option " + std::string(flag) + " (see --help)");
    }
    if (!(o.budget > 0.0 && o.budget <= 1.0)) fail("--budget must be in (0, 1]");
    return o;
}

void print_text(const std::string& title, const std::string& text) {
    std::cout << "---- " << title << " ----\n" << text << "\n\n";
}

}  // namespace

int main(int argc, char** argv) {
    const options opt = parse_args(argc, argv);
    const auto model_path = opt.model.value_or(opt.data_dir / "stories260K.gguf");

    std::optional<llama::model> loaded;
    try {
        loaded.emplace(llama::model::load(model_path));
    } catch (const llama::load_error& e) {
        std::cerr << "qevict_demo: " << e.what() << "\n";
        return 1;
    }
    const llama::model& m = *loaded;
    const auto& p = m.params();

    const auto prompt = m.vocab().encode(opt.prompt);
    const std::size_t max_tokens = opt.max_tokens ? opt.max_tokens : prompt.size() + opt.new_tokens;
    if (prompt.size() > max_tokens)
        fail("the prompt is " + std::to_string(prompt.size()) + " tokens long, more than --max-tokens " +
             std::to_string(max_tokens));
    std::size_t new_tokens = opt.new_tokens;
    if (prompt.size() + new_tokens > max_tokens) {
        new_tokens = max_tokens - prompt.size();
        std::cerr << "qevict_demo: generating only " << new_tokens << " tokens to stay within --max-tokens\n";
    }

    std::cout << "model: " << model_path.string() << " (" << p.layers << " layers, width " << p.dim << ", " << p.q_heads
              << " query / " << p.kv_heads << " KV heads of " << p.head_dim << ", vocabulary " << p.vocab << ")\n"
              << "prompt: " << prompt.size() << " tokens (BOS included); generating " << new_tokens
              << " tokens greedily; qevict budget " << opt.budget * 100 << "% of a full cache of " << max_tokens
              << " tokens\n\n";

    // The uncompressed reference.
    const llama::generate_options generation{.max_new_tokens = new_tokens, .stop_at_eos = false};
    llama::dense_cache full(p.attention(), max_tokens);
    const auto full_tokens = llama::generate_greedy(m, full, prompt, generation);

    // The same model with qevict's paper configuration: once free-running, once fed the reference
    // tokens (teacher forcing) so that each step's choice is compared on the same history.
    using config = qevict::config<>;
    const auto budget = qevict::budget::fraction(opt.budget);
    std::optional<llama::qevict_attention<config>> compressed, forced;
    try {
        compressed.emplace(p, budget, max_tokens);
        forced.emplace(p, budget, max_tokens);
    } catch (const qevict::error& e) {
        fail(std::string("qevict cannot be configured this way: ") + e.what() +
             "\n(the budget is a fraction of --max-tokens tokens: raise --budget, --tokens or --max-tokens)");
    }
    const auto qevict_tokens = llama::generate_greedy(m, *compressed, prompt, generation);
    const auto forced_logits = llama::teacher_forced_logits(m, *forced, prompt, full_tokens);

    const bool continuation = !opt.prompt.empty();
    print_text("full cache (" + full.name() + ")", opt.prompt + m.vocab().decode(full_tokens, !continuation));
    char title[96];
    std::snprintf(title, sizeof title, "qevict (paper configuration, budget %g%%)", opt.budget * 100);
    print_text(title,
               opt.prompt + m.vocab().decode(qevict_tokens, !continuation));

    // Agreement, three ways: how long the free-running texts stay identical, how many positions
    // hold the same token, and how often qevict picks the reference's next token given the same
    // history (the fairest one: it does not punish a single early divergence twice).
    std::size_t prefix = 0, same = 0, forced_same = 0;
    while (prefix < full_tokens.size() && prefix < qevict_tokens.size() && full_tokens[prefix] == qevict_tokens[prefix])
        ++prefix;
    for (std::size_t i = 0; i < std::min(full_tokens.size(), qevict_tokens.size()); ++i) same += full_tokens[i] == qevict_tokens[i];
    for (std::size_t i = 0; i < full_tokens.size(); ++i)
        forced_same += llama::argmax(std::span<const float>(forced_logits).subspan(i * p.vocab, p.vocab)) == full_tokens[i];

    const auto report = compressed->cache().report();
    const std::size_t n = full_tokens.size();
    auto percent = [](std::size_t a, std::size_t b) { return b ? 100.0 * static_cast<double>(a) / static_cast<double>(b) : 0.0; };
    std::printf("memory (KV cache, all %zu layers, float32 elements)\n", p.layers);
    std::printf("  full cache     %10zu B for %zu tokens\n", full.kv_bytes(), full.tokens());
    std::printf("  qevict         %10zu B held (%.1f%% of the full cache), %zu B reserved, budget %zu B\n",
                report.used_total().total(), percent(report.used_total().total(), full.kv_bytes()),
                report.reserved_total().total(), report.budget_total());
    std::printf("token agreement over %zu generated tokens\n", n);
    std::printf("  identical prefix          %zu tokens\n", prefix);
    std::printf("  same token, same position %zu (%.1f%%)\n", same, percent(same, n));
    std::printf("  teacher-forced top-1      %zu (%.1f%%)\n\n", forced_same, percent(forced_same, n));
    std::cout << report.to_string();
    return 0;
}

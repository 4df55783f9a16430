// qevict_demo: generate text with a Llama GGUF model twice, once with a full KV cache and once
// with qevict::cache under a byte budget, and show both texts, the memory each used and how far
// the tokens agree.
//
//   qevict_demo [--prompt TEXT] [--tokens N] [--budget F] [--max-tokens N]
//               [--data DIR] [--model FILE]

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

namespace {

struct options {
    std::filesystem::path data_dir = QEVICT_DATA_DIR;
    std::optional<std::filesystem::path> model;
    std::string prompt;
    std::size_t new_tokens = 256;
    double budget = 0.20;
    std::size_t max_tokens = 4096;
};

constexpr int usage_error = 2;

[[noreturn]] void fail(const std::string& message) {
    std::cerr << "qevict_demo: " << message << "\n";
    std::exit(usage_error);
}

void print_help() {
    std::cout << "usage: qevict_demo [options]\n"
                 "  --prompt TEXT     text to continue (default: start from BOS alone)\n"
                 "  --tokens N        tokens to generate (default 256)\n"
                 "  --budget F        qevict byte budget as a fraction of the full cache (default 0.20)\n"
                 "  --max-tokens N    most tokens a sequence may hold, prompt included (default 4096)\n"
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
        else if (flag == "--max-tokens") o.max_tokens = parse_number<std::size_t>(flag, value);
        else if (flag == "--data") o.data_dir = value;
        else if (flag == "--model") o.model = value;
        else fail("unknown option " + std::string(flag) + " (see --help)");
    }
    if (!(o.budget > 0.0 && o.budget <= 1.0)) fail("--budget must be in (0, 1]");
    if (o.max_tokens == 0) fail("--max-tokens must be positive");
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
    if (prompt.size() > opt.max_tokens)
        fail("the prompt is " + std::to_string(prompt.size()) + " tokens long, more than --max-tokens " +
             std::to_string(opt.max_tokens));
    std::size_t new_tokens = opt.new_tokens;
    if (prompt.size() + new_tokens > opt.max_tokens) {
        new_tokens = opt.max_tokens - prompt.size();
        std::cerr << "qevict_demo: generating only " << new_tokens << " tokens to stay within --max-tokens\n";
    }

    std::cout << "model: " << model_path.string() << " (" << p.layers << " layers, width " << p.dim << ", " << p.q_heads
              << " query / " << p.kv_heads << " KV heads of " << p.head_dim << ", vocabulary " << p.vocab << ")\n"
              << "prompt: " << prompt.size() << " tokens; generating " << new_tokens << " greedily\n\n";

    llama::dense_cache full(p.attention(), opt.max_tokens);
    const auto full_tokens = llama::generate_greedy(m, full, prompt, {.max_new_tokens = new_tokens, .stop_at_eos = false});
    print_text("full cache (" + full.name() + ")", opt.prompt + m.vocab().decode(full_tokens, opt.prompt.empty()));
    std::cout << "full cache: " << full.kv_bytes() << " bytes for " << full.tokens() << " tokens\n";
    return 0;
}

// qevict_eval: accuracy per byte of qevict::cache and its ablations against the full cache on
// a real model (stories260K), with the diagnostics of the QEvict paper. See docs/evaluation.md.
//
//   qevict_eval [--contexts 512,1024,2048,4096] [--budgets 20%,10%,5%] [--methods qevict,r1,...]
//               [--texts tinystories,pride] [--decode-tokens 256] [--prompts 1] [--out DIR]
//               [--data DIR] [--no-plots] [--quick]

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "evaluate.hpp"
#include "report.hpp"

namespace {

constexpr int usage_error = 2;

[[noreturn]] void fail(const std::string& message) {
    std::cerr << "qevict_eval: " << message << "\n";
    std::exit(usage_error);
}

std::vector<std::string> split(std::string_view s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= s.size()) {
        const std::size_t comma = s.find(',', start);
        const std::size_t end = comma == std::string_view::npos ? s.size() : comma;
        if (end > start) out.emplace_back(s.substr(start, end - start));
        if (comma == std::string_view::npos) break;
        start = comma + 1;
    }
    return out;
}

std::size_t parse_size(std::string_view flag, std::string_view text) {
    std::size_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size() || value == 0)
        fail("'" + std::string(text) + "' is not a positive integer for " + std::string(flag));
    return value;
}

void print_help() {
    std::string methods;
    for (const auto& m : qevict_eval::method_names()) methods += (methods.empty() ? "" : ",") + m;
    std::cout << "usage: qevict_eval [options]\n"
                 "  --contexts LIST      prompt lengths in tokens (default 512,1024,2048,4096)\n"
                 "  --budgets LIST       byte budgets: fractions of the full cache of prompt + decode tokens,\n"
                 "                       as 20% or 0.2; 'all' keeps everything (default 20%,10%,5%)\n"
                 "  --methods LIST       among "
              << methods
              << " (r3 = qevict; default: all)\n"
                 "  --texts LIST         tinystories,pride (default both)\n"
                 "  --decode-tokens N    teacher-forced continuation tokens (default 256)\n"
                 "  --prompts N          prompts per text and context (default 1)\n"
                 "  --out DIR            output folder (default eval-out)\n"
                 "  --data DIR           folder with stories260K.gguf and the texts (default " QEVICT_DATA_DIR ")\n"
                 "  --no-plots           CSV only\n"
                 "  --quick              tiny run: tinystories, one 512-token context, 32 decode tokens,\n"
                 "                       qevict and r2, 20% (other options given after it still apply)\n";
}

}  // namespace

int main(int argc, char** argv) {
    qevict_eval::eval_options opt;
    opt.data_dir = QEVICT_DATA_DIR;
    opt.progress = &std::cerr;
    qevict_eval::fs::path out_dir = "eval-out";
    bool plots = true;
    try {
        for (int i = 1; i < argc; ++i) {
            const std::string_view flag = argv[i];
            if (flag == "--help" || flag == "-h") {
                print_help();
                return 0;
            }
            if (flag == "--quick") {
                opt = qevict_eval::quick_options(opt);
                continue;
            }
            if (flag == "--no-plots") {
                plots = false;
                continue;
            }
            if (i + 1 >= argc) fail("unknown option or missing value: " + std::string(flag) + " (see --help)");
            const std::string_view value = argv[++i];
            if (flag == "--contexts") {
                opt.contexts.clear();
                for (const auto& c : split(value)) opt.contexts.push_back(parse_size(flag, c));
            } else if (flag == "--budgets") {
                opt.budgets.clear();
                for (const auto& b : split(value)) opt.budgets.push_back(qevict_eval::parse_budget(b));
            } else if (flag == "--methods") {
                opt.methods = split(value);
            } else if (flag == "--texts") {
                opt.texts = split(value);
                for (const auto& t : opt.texts) (void)qevict_eval::find_text(t);
            } else if (flag == "--decode-tokens") {
                opt.decode_tokens = parse_size(flag, value);
            } else if (flag == "--prompts") {
                opt.prompts = parse_size(flag, value);
            } else if (flag == "--out") {
                out_dir = std::string(value);
            } else if (flag == "--data") {
                opt.data_dir = std::string(value);
            } else {
                fail("unknown option " + std::string(flag) + " (see --help)");
            }
        }
        if (opt.contexts.empty() || opt.budgets.empty() || opt.texts.empty()) fail("empty --contexts, --budgets or --texts");
        for (const auto& m : opt.methods) {
            const auto known = qevict_eval::method_names();
            if (std::find(known.begin(), known.end(), qevict_eval::canonical_method(m)) == known.end())
                fail("unknown method '" + m + "' (see --help)");
        }
    } catch (const std::invalid_argument& e) {
        fail(e.what());
    }

    try {
        const auto model = llama::model::load(opt.data_dir / "stories260K.gguf");
        qevict_eval::fs::create_directories(out_dir);
        // Rows are appended as they come, so a long run that is stopped keeps what it finished.
        std::ofstream partial(out_dir / "results.partial.csv");
        partial << qevict_eval::csv_header() << "\n" << std::flush;
        const auto results = qevict_eval::run_evaluation(model, opt, [&](const qevict_eval::method_result& r) {
            partial << qevict_eval::csv_row(r) << "\n" << std::flush;
        });
        qevict_eval::write_csv(results, out_dir / "results.csv");
        qevict_eval::write_fmm_curves(results, out_dir / "fmm_curves.csv");
        partial.close();
        qevict_eval::fs::remove(out_dir / "results.partial.csv");
        std::cerr << "wrote " << (out_dir / "results.csv").string() << " (" << results.size() << " rows) and "
                  << (out_dir / "fmm_curves.csv").string() << "\n";
        if (plots && qevict_eval::write_plots(results, out_dir, &std::cerr))
            std::cerr << "wrote the plots (PNG) in " << out_dir.string() << "\n";
    } catch (const llama::load_error& e) {
        std::cerr << "qevict_eval: " << e.what() << "\n";
        return usage_error;
    } catch (const std::exception& e) {
        std::cerr << "qevict_eval: " << e.what() << "\n";
        return 1;
    }
    return 0;
}

// The evaluation tool (examples/eval) on its tiny configuration: the CSV has the expected rows
// and columns, the metrics are finite and in range, a budget that keeps everything agrees with
// the full cache, and a budget too small for the protected regions is recorded, not fatal.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/eval/evaluate.hpp"
#include "../../examples/eval/report.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path data_dir = QEVICT_DATA_DIR;

bool have_data() {
    if (fs::exists(data_dir / "stories260K.gguf") && fs::exists(data_dir / "tinystories-lowercase.txt")) return true;
    MESSAGE("skipped: no model data at '" << data_dir.string() << "' (set QEVICT_DATA_DIR)");
    return false;
}

const llama::model& stories() {
    static const llama::model m = llama::model::load(data_dir / "stories260K.gguf");
    return m;
}

qevict_eval::eval_options quick() {
    qevict_eval::eval_options o;
    o.data_dir = data_dir;
    return qevict_eval::quick_options(o);
}

std::vector<std::string> split_csv_line(const std::string& line) {
    std::vector<std::string> out;
    std::string cell;
    bool quoted = false;
    for (char c : line) {
        if (c == '"') quoted = !quoted;
        else if (c == ',' && !quoted) {
            out.push_back(cell);
            cell.clear();
        } else cell += c;
    }
    out.push_back(cell);
    return out;
}

void check_sane(const qevict_eval::method_result& r) {
    INFO(r.method << " " << r.budget_label);
    REQUIRE(r.fits);
    CHECK(r.decode_steps == 32);
    CHECK(r.max_tokens == 512 + 32);
    CHECK(r.top1 >= 0.0);
    CHECK(r.top1 <= 1.0);
    CHECK(std::isfinite(r.kl));
    CHECK(r.kl >= 0.0);
    CHECK(std::isfinite(r.ppl_full));
    CHECK(r.ppl_full > 1.0);
    CHECK(std::isfinite(r.ppl_ratio));
    CHECK(r.ppl_ratio > 0.0);
    CHECK(r.used_bytes > 0);
    CHECK(r.used_bytes <= r.budget_bytes);
    CHECK(r.full_cache_bytes == 5u * 544u * 2u * 4u * 8u * 4u);  // layers · tokens · (k,v) · kv_heads · head_dim · f32
    for (double x : {r.fmm, r.fmm_no_quant, r.churn, r.churn_full, r.mass_full, r.mass_quantized, r.mass_evicted,
                     r.mass_protected}) {
        CHECK(std::isfinite(x));
        CHECK(x >= 0.0);
        CHECK(x <= 1.0 + 1e-9);
    }
    CHECK(r.fmm <= r.fmm_no_quant + 1e-12);  // disabling the quantized tier can only miss more
    CHECK(r.mass_full + r.mass_quantized + r.mass_evicted + r.mass_protected == doctest::Approx(1.0).epsilon(1e-6));
    CHECK(r.fmm_curve.size() == 31);  // FMM(t) for t = 1..31: every step with a later one
}

}  // namespace

TEST_CASE("budget labels and parsing") {
    CHECK(qevict_eval::parse_budget("20%").label() == "20%");
    CHECK(qevict_eval::parse_budget("0.05").label() == "5%");
    CHECK(qevict_eval::parse_budget("all").everything());
    CHECK(qevict_eval::parse_budget("12.5%").label() == "12.5%");
    CHECK_THROWS_AS((void)qevict_eval::parse_budget("x"), std::invalid_argument);
    CHECK_THROWS_AS((void)qevict_eval::parse_budget("-1"), std::invalid_argument);
    CHECK(qevict_eval::canonical_method("r3") == "qevict");
    const auto names = qevict_eval::method_names();
    CHECK(names.front() == "qevict");
}

TEST_CASE("tiny configuration: CSV rows and sane metrics") {
    if (!have_data()) return;
    const auto opt = quick();
    const auto results = qevict_eval::run_evaluation(stories(), opt);
    REQUIRE(results.size() == 3);
    // The reference row comes first: the dense cache itself.
    const auto& full = results[0];
    CHECK(full.method == "full");
    CHECK(full.top1 == 1.0);
    CHECK(full.kl == 0.0);
    CHECK(full.ppl_ratio == 1.0);
    CHECK(full.used_bytes == full.full_cache_bytes);
    CHECK(results[1].method == "qevict");
    CHECK(results[2].method == "r2");
    for (std::size_t i = 1; i < results.size(); ++i) {
        const auto& r = results[i];
        CHECK(r.text == "tinystories");
        CHECK(r.context == 512);
        CHECK(r.budget_label == "20%");
        check_sane(r);
        // Every run is judged against the one reference.
        CHECK(r.ppl_full == doctest::Approx(full.ppl_method).epsilon(1e-12));
        CHECK(r.full_cache_bytes == full.used_bytes);
        CHECK(r.used_bytes < full.used_bytes / 4);
    }
    const auto results_q = std::vector<qevict_eval::method_result>(results.begin() + 1, results.end());
    // The three-tier cache keeps quantized windows and scores them; the two-tier one has none.
    CHECK(results_q[0].k_quantized > 0);
    CHECK(results_q[0].mass_quantized > 0.0);
    CHECK(std::isfinite(results_q[0].score_agreement));
    CHECK(results_q[0].score_agreement > 0.5);
    CHECK(results_q[0].score_agreement <= 1.0 + 1e-9);
    CHECK(results_q[1].k_quantized == 0);
    CHECK(results_q[1].mass_quantized == 0.0);
    CHECK(std::isnan(results_q[1].score_agreement));
    CHECK(results_q[1].fmm == doctest::Approx(results_q[1].fmm_no_quant));

    const fs::path dir = fs::temp_directory_path() / "qevict_test_eval";
    fs::create_directories(dir);
    qevict_eval::write_csv(results, dir / "results.csv");
    std::ifstream in(dir / "results.csv");
    std::string line;
    std::vector<std::vector<std::string>> rows;
    while (std::getline(in, line)) rows.push_back(split_csv_line(line));
    REQUIRE(rows.size() == 4);
    const auto& header = rows[0];
    for (const auto& row : rows) CHECK(row.size() == header.size());
    auto column = [&](const std::string& name) {
        for (std::size_t i = 0; i < header.size(); ++i)
            if (header[i] == name) return i;
        FAIL("no column " << name);
        return std::size_t{0};
    };
    CHECK(rows[1][column("method")] == "full");
    CHECK(rows[2][column("method")] == "qevict");
    CHECK(rows[3][column("method")] == "r2");
    CHECK(rows[2][column("fits")] == "1");
    CHECK(std::stod(rows[2][column("top1")]) == doctest::Approx(results_q[0].top1));
    CHECK(std::stod(rows[3][column("kl")]) == doctest::Approx(results_q[1].kl).epsilon(1e-5));
    CHECK(rows[3][column("score_agreement")] == "nan");
    fs::remove_all(dir);
}

TEST_CASE("a budget that keeps everything agrees with the full cache") {
    if (!have_data()) return;
    auto opt = quick();
    opt.methods = {"qevict"};
    opt.budgets = {qevict_eval::parse_budget("all")};
    const auto results = qevict_eval::run_evaluation(stories(), opt);
    REQUIRE(results.size() == 2);
    const auto& r = results[1];
    check_sane(r);
    CHECK(r.top1 == 1.0);
    CHECK(r.kl < 1e-6);
    CHECK(r.ppl_ratio == doctest::Approx(1.0).epsilon(1e-4));
    CHECK(r.fmm == 0.0);
    CHECK(r.mass_evicted == 0.0);
    CHECK(r.mass_quantized == 0.0);
}

TEST_CASE("a budget too small for the protected regions is recorded as not fitting") {
    if (!have_data()) return;
    auto opt = quick();
    opt.methods = {"qevict"};
    opt.budgets = {qevict_eval::parse_budget("1%")};
    const auto results = qevict_eval::run_evaluation(stories(), opt);
    REQUIRE(results.size() == 2);
    CHECK_FALSE(results[1].fits);
    CHECK(results[1].note.find("qevict:") != std::string::npos);
    CHECK(std::isnan(results[1].top1));
    const std::string row = qevict_eval::csv_row(results[1]);
    CHECK(row.find(",0,") != std::string::npos);
    CHECK(row.find("does not fit") != std::string::npos);
}

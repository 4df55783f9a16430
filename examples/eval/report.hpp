#pragma once
// Output of the evaluation: results.csv (one row per text/context/prompt/method/budget),
// fmm_curves.csv (layer-averaged FMM(t) of every run), and gnuplot data, scripts and PNGs:
//   accuracy.png    top-1 agreement and KL(full ‖ method) against the budget, one column per context
//   fmm.png         FMM over decode steps for R1, R2, R3 (= qevict), R4; R3 with its quantized
//                   tier disabled dashed (the paper's Fig. 1a)
//   mass_split.png  reference attention mass on Full / Quantized / Evicted / sinks+recent for R2
//                   and R3 at each context (the paper's Fig. 1b)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "evaluate.hpp"

namespace qevict_eval {

namespace detail {

inline std::string num(double x, const char* fmt = "%.6g") {
    if (!std::isfinite(x)) return "nan";
    char buf[64];
    std::snprintf(buf, sizeof buf, fmt, x);
    return buf;
}

inline std::string csv_quote(const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
        if (c == '"') q += "\"\"";
        else if (c == '\n') q += ' ';
        else q += c;
    }
    return q + "\"";
}

inline std::ofstream open_out(const fs::path& p) {
    std::ofstream out(p);
    if (!out) throw std::runtime_error("cannot write " + p.string());
    return out;
}

}  // namespace detail

inline const char* csv_header() {
    return "text,context,prompt,method,budget,budget_fraction,fits,decode_tokens,max_tokens,budget_bytes,used_bytes,"
           "full_cache_bytes,used_vs_full,k_full,k_quantized,top1,kl,ppl_full,ppl_method,ppl_ratio,fmm,fmm_no_quant,"
           "lir_deployed,lir_oracle,churn,churn_full,mass_full,mass_quantized,mass_evicted,mass_protected,"
           "score_agreement,seconds,note";
}

inline std::string csv_row(const method_result& r) {
    using detail::num;
    std::string s;
    auto add = [&](const std::string& x) { s += (s.empty() ? "" : ",") + x; };
    add(r.text);
    add(std::to_string(r.context));
    add(std::to_string(r.prompt_index));
    add(r.method);
    add(r.budget_label);
    add(num(r.budget_fraction));
    add(r.fits ? "1" : "0");
    add(std::to_string(r.decode_steps));
    add(std::to_string(r.max_tokens));
    add(std::to_string(r.budget_bytes));
    add(std::to_string(r.used_bytes));
    add(std::to_string(r.full_cache_bytes));
    add(r.fits && r.full_cache_bytes ? num(static_cast<double>(r.used_bytes) / static_cast<double>(r.full_cache_bytes)) : "nan");
    add(std::to_string(r.k_full));
    add(std::to_string(r.k_quantized));
    for (double x : {r.top1, r.kl, r.ppl_full, r.ppl_method, r.ppl_ratio, r.fmm, r.fmm_no_quant, r.lir_deployed,
                     r.lir_oracle, r.churn, r.churn_full, r.mass_full, r.mass_quantized, r.mass_evicted, r.mass_protected,
                     r.score_agreement})
        add(num(x));
    add(num(r.seconds, "%.2f"));
    std::string note = r.note;
    if (!r.fits) note = r.note.rfind("error:", 0) == 0 ? r.note : (r.note.empty() ? "does not fit" : "does not fit: " + r.note);
    add(detail::csv_quote(note));
    return s;
}

inline void write_csv(const std::vector<method_result>& results, const fs::path& path) {
    auto out = detail::open_out(path);
    out << csv_header() << "\n";
    for (const auto& r : results) out << csv_row(r) << "\n";
}

inline void write_fmm_curves(const std::vector<method_result>& results, const fs::path& path) {
    auto out = detail::open_out(path);
    out << "text,context,prompt,method,budget,step,fmm,fmm_no_quant\n";
    for (const auto& r : results) {
        if (!r.fits) continue;
        for (std::size_t i = 0; i < r.fmm_curve.size(); ++i)
            out << r.text << "," << r.context << "," << r.prompt_index << "," << r.method << "," << r.budget_label << ","
                << r.fmm_curve[i].step << "," << detail::num(r.fmm_curve[i].value) << ","
                << detail::num(i < r.fmm_curve_no_quant.size() ? r.fmm_curve_no_quant[i].value : not_applicable) << "\n";
    }
}

// Which (context, budget) the figures that reproduce the paper's Fig. 1 use: the paper's setting
// (512-token prefill, 20 %) when it was run, else the smallest context and the largest budget.
struct figure_setting {
    std::size_t context = 0;
    std::string budget;
};

inline figure_setting pick_figure_setting(const std::vector<method_result>& results) {
    figure_setting f;
    double best_fraction = -1;
    for (const auto& r : results) {
        if (!r.fits || r.budget_fraction <= 0 || r.method == "full") continue;
        if (f.context == 0 || r.context < f.context) f.context = r.context;
    }
    for (const auto& r : results) {
        if (!r.fits || r.budget_fraction <= 0 || r.method == "full" || r.context != f.context) continue;
        const bool paper = std::abs(r.budget_fraction - 0.20) < 1e-9;
        if (paper || (best_fraction != 0.20 && r.budget_fraction > best_fraction)) {
            best_fraction = paper ? 0.20 : r.budget_fraction;
            f.budget = r.budget_label;
        }
    }
    return f;
}

// Writes the plot data and plots.gp into `dir`, then runs gnuplot there. Returns false (and says
// why on `log`) when gnuplot is missing or fails; the CSVs are written either way.
inline bool write_plots(const std::vector<method_result>& results, const fs::path& dir, std::ostream* log) {
    using detail::num;
    std::vector<std::string> methods;
    std::vector<std::size_t> contexts;
    for (const auto& r : results) {
        if (r.method != "full" && std::find(methods.begin(), methods.end(), r.method) == methods.end()) methods.push_back(r.method);
        if (std::find(contexts.begin(), contexts.end(), r.context) == contexts.end()) contexts.push_back(r.context);
    }
    std::sort(contexts.begin(), contexts.end());

    // accuracy: acc_<method>_<context>.dat — budget %, mean top1, mean KL over texts and prompts.
    std::vector<std::string> acc_files;
    for (const auto& m : methods)
        for (std::size_t ctx : contexts) {
            std::map<double, std::vector<const method_result*>> by_budget;
            for (const auto& r : results)
                if (r.fits && r.budget_fraction > 0 && r.method == m && r.context == ctx) by_budget[r.budget_fraction].push_back(&r);
            const std::string name = "acc_" + m + "_" + std::to_string(ctx) + ".dat";
            if (!by_budget.empty()) acc_files.push_back(name);
            auto out = detail::open_out(dir / name);
            out << "# budget_percent top1 kl (means over texts and prompts)\n";
            for (const auto& [fraction, rows] : by_budget) {
                double top1 = 0, kl = 0;
                for (const auto* r : rows) {
                    top1 += r->top1;
                    kl += r->kl;
                }
                const auto n = static_cast<double>(rows.size());
                out << num(fraction * 100) << " " << num(top1 / n) << " " << num(std::max(kl / n, 1e-6)) << "\n";
            }
        }

    const figure_setting fig = pick_figure_setting(results);
    auto find_method = [&](const std::string& n) { return std::find(methods.begin(), methods.end(), n) != methods.end(); };

    // FMM curves of R1..R4 at the figure setting, averaged over texts and prompts.
    struct curve_spec {
        std::string method, title;
    };
    const std::vector<curve_spec> ablations = {{"r1", "R1 (W=1)"}, {"r2", "R2 (two tiers)"}, {"qevict", "R3 (QEvict)"}, {"r4", "R4 (W=32)"}};
    std::vector<curve_spec> fmm_curves;
    for (const auto& a : ablations) {
        if (!find_method(a.method)) continue;
        std::map<std::size_t, std::pair<double, double>> sum;
        std::map<std::size_t, int> count;
        for (const auto& r : results) {
            if (!r.fits || r.method != a.method || r.context != fig.context || r.budget_label != fig.budget) continue;
            for (std::size_t i = 0; i < r.fmm_curve.size(); ++i) {
                sum[r.fmm_curve[i].step].first += r.fmm_curve[i].value;
                sum[r.fmm_curve[i].step].second += i < r.fmm_curve_no_quant.size() ? r.fmm_curve_no_quant[i].value : 0.0;
                ++count[r.fmm_curve[i].step];
            }
        }
        if (sum.empty()) continue;
        auto out = detail::open_out(dir / ("fmm_" + a.method + ".dat"));
        out << "# step fmm fmm_no_quant (layer-averaged, mean over texts and prompts)\n";
        for (const auto& [step, s] : sum) {
            const double n = count[step];
            out << step << " " << num(s.first / n) << " " << num(s.second / n) << "\n";
        }
        fmm_curves.push_back(a);
    }

    // Mass split of R2 and R3 at the figure budget, one pair of bars per context.
    std::size_t split_bars = 0;
    {
        auto out = detail::open_out(dir / "mass_split.dat");
        out << "# label full quantized evicted sinks+recent (reference mass shares, mean over texts and prompts)\n";
        for (std::size_t ctx : contexts)
            for (const auto& [m, label] : {std::pair<std::string, std::string>{"r2", "R2"}, {"qevict", "R3"}}) {
                double f = 0, q = 0, e = 0, p = 0;
                int n = 0;
                for (const auto& r : results)
                    if (r.fits && r.method == m && r.context == ctx && r.budget_label == fig.budget) {
                        f += r.mass_full;
                        q += r.mass_quantized;
                        e += r.mass_evicted;
                        p += r.mass_protected;
                        ++n;
                    }
                if (n == 0) continue;
                ++split_bars;
                out << "\"" << label << " " << ctx << "\" " << num(f / n) << " " << num(q / n) << " " << num(e / n) << " "
                    << num(p / n) << "\n";
            }
    }

    // plots.gp
    {
        auto gp = detail::open_out(dir / "plots.gp");
        gp << "# Written by qevict_eval; run `gnuplot plots.gp` in this folder.\n"
              "set datafile missing 'nan'\n"
              "set terminal pngcairo size "
           << 360 * std::max<std::size_t>(contexts.size(), 1) + 120
           << ",760 font 'sans,10'\n"
              "set output 'accuracy.png'\n"
              "set multiplot layout 2,"
           << std::max<std::size_t>(contexts.size(), 1)
           << " title 'stories260K: next-token agreement with the full cache (teacher-forced)'\n"
              "set grid\nset key bottom right font ',8'\nset logscale x\nset xrange [*:*]\n";
        auto plot_line = [&](std::size_t ctx, int column) {
            std::string s = "plot ";
            bool first = true;
            for (std::size_t i = 0; i < methods.size(); ++i) {
                const std::string file = "acc_" + methods[i] + "_" + std::to_string(ctx) + ".dat";
                if (std::find(acc_files.begin(), acc_files.end(), file) == acc_files.end()) continue;
                s += std::string(first ? "" : ", ") + "'" + file + "' using 1:" +
                     std::to_string(column) + " with linespoints lw 2 pt " + std::to_string(5 + static_cast<int>(i)) + " title '" +
                     (methods[i] == "qevict" ? std::string("qevict (R3)") : methods[i]) + "'";
                first = false;
            }
            return first ? std::string("set multiplot next\n") : s + "\n";  // nothing fits in this context
        };
        for (std::size_t ctx : contexts)
            gp << "set title 'context " << ctx << "'\nset xlabel 'budget (% of full cache)'\nset ylabel 'top-1 agreement'\n"
               << "set yrange [*:1]\nunset logscale y\n" << plot_line(ctx, 2);
        for (std::size_t ctx : contexts)
            gp << "set title 'context " << ctx << "'\nset xlabel 'budget (% of full cache)'\nset ylabel 'KL(full || method) [nats]'\n"
               << "set yrange [*:*]\nset logscale y\n" << plot_line(ctx, 3);
        gp << "unset multiplot\nunset logscale\n";

        if (!fmm_curves.empty()) {
            gp << "set terminal pngcairo size 720,460 font 'sans,10'\nset output 'fmm.png'\n"
                  "set title 'Future Missed Mass, context "
               << fig.context << ", budget " << fig.budget
               << "'\nset xlabel 'decode step t'\nset ylabel 'FMM(t)'\nset yrange [0:*]\nset xrange [0:*]\nset key top right\n"
                  "plot ";
            bool first = true;
            int lt = 1;
            for (const auto& c : fmm_curves) {
                gp << (first ? "" : ", ") << "'fmm_" << c.method << ".dat' using 1:2 with lines lw 2 lc " << lt << " title '"
                   << c.title << "'";
                if (c.method == "qevict")
                    gp << ", 'fmm_qevict.dat' using 1:3 with lines lw 2 dt 2 lc " << lt << " title 'R3, quantized tier disabled'";
                first = false;
                ++lt;
            }
            gp << "\n";
        }
        if (split_bars > 0)
            gp << "set terminal pngcairo size " << std::max<std::size_t>(560, 260 + 90 * 2 * contexts.size())
           << ",460 font 'sans,10'\nset output 'mass_split.png'\n"
              "set title 'Reference attention mass by tier, budget "
           << fig.budget
           << "'\nset style data histograms\nset style histogram rowstacked\nset style fill solid 0.85 border -1\n"
              "set boxwidth 0.7\nset yrange [0:1]\nset xrange [*:*]\nunset xlabel\nset ylabel 'share of attention mass'\n"
              "set key outside right\nset xtics rotate by -30\n"
              "plot 'mass_split.dat' using 2:xtic(1) title 'Full' lc rgb '#1f77b4', '' using 3 title 'Quantized' lc rgb "
              "'#ff7f0e', '' using 4 title 'Evicted' lc rgb '#d62728', '' using 5 title 'sinks + recent' lc rgb '#7f7f7f'\n";
    }

    if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) {
        if (log) *log << "gnuplot not found: wrote the plot data and " << (dir / "plots.gp").string() << " only\n";
        return false;
    }
    const std::string cmd = "cd '" + dir.string() + "' && gnuplot plots.gp";
    if (std::system(cmd.c_str()) != 0) {
        if (log) *log << "gnuplot failed on " << (dir / "plots.gp").string() << "\n";
        return false;
    }
    return true;
}

}  // namespace qevict_eval

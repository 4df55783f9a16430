#pragma once
// The evaluation proper: one reference run (dense, uncompressed cache) per prompt, then every
// method at every budget fed the same tokens, compared step by step with the reference.
//
// Per prompt:
//   1. The dense cache runs the prompt once (model::prefill). A recording seam keeps each layer's
//      pre-RoPE k and v for the whole prompt and q for its last observation_window tokens.
//   2. The dense cache decodes the D continuation tokens; each step keeps the next-token logits
//      and, per layer, the head-averaged attention probabilities over all cached tokens (the
//      diagnostics' reference trace).
//   3. Each method builds a qevict::cache, ingests the prompt per layer with
//      cache.prefill(layer, seq, q_last, k, v) (no output: the prompt's attention is exact and
//      already computed, so the logits after the prompt are the reference's), then decodes the
//      same D tokens through the cache. Its layer inputs depart from the reference's as soon as
//      the cache drops or quantizes something: that is what is measured.
//
// Decode step τ = 1..D feeds continuation[τ-1]; its logits predict continuation[τ]. Every metric
// is over these D steps.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <qevict/diagnostics/diagnostics.hpp>

#include "../llama/attention.hpp"
#include "../llama/generate.hpp"
#include "../llama/model.hpp"
#include "../llama/qevict_attention.hpp"
#include "methods.hpp"
#include "prompts.hpp"

namespace qevict_eval {

namespace dx = qevict::diagnostics;

inline constexpr double not_applicable = std::numeric_limits<double>::quiet_NaN();

// ---- budgets -----------------------------------------------------------------------------------

// A byte budget per sequence and layer: a fraction of the full-precision cache of the run's
// max tokens (prompt + decode tokens), or everything (every window kept Full: the reference
// with qevict's own accounting).
struct budget_spec {
    double fraction = 0.20;  // <= 0: everything
    [[nodiscard]] bool everything() const { return fraction <= 0.0; }
    [[nodiscard]] qevict::budget to_budget() const {
        return everything() ? qevict::budget::everything() : qevict::budget::fraction(fraction);
    }
    [[nodiscard]] std::string label() const {
        if (everything()) return "all";
        const double pct = fraction * 100.0;
        char buf[32];
        if (std::abs(pct - std::round(pct)) < 1e-9) std::snprintf(buf, sizeof buf, "%.0f%%", pct);
        else std::snprintf(buf, sizeof buf, "%g%%", pct);
        return buf;
    }
};

// "20%", "0.2" or "all".
inline budget_spec parse_budget(std::string_view s) {
    if (s == "all" || s == "everything") return {0.0};
    std::string t(s);
    bool percent = false;
    if (!t.empty() && t.back() == '%') {
        percent = true;
        t.pop_back();
    }
    std::size_t used = 0;
    double v = 0;
    try {
        v = std::stod(t, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != t.size() || t.empty() || !(v > 0)) throw std::invalid_argument("bad budget '" + std::string(s) + "'");
    if (percent || v > 1.0) v /= 100.0;
    return {v};
}

// ---- options -----------------------------------------------------------------------------------

struct eval_options {
    fs::path data_dir;
    std::vector<std::string> texts = {"tinystories", "pride"};
    std::vector<std::size_t> contexts = {512, 1024, 2048, 4096};
    std::vector<budget_spec> budgets = {{0.20}, {0.10}, {0.05}};
    std::vector<std::string> methods;  // empty: every method
    std::size_t decode_tokens = 256;
    std::size_t prompts = 1;           // prompts per text and context
    std::size_t lir_min_absence = 4;   // routing events out of the Full set before a return counts
    std::ostream* progress = nullptr;  // progress lines, or none
};

// The tiny configuration: one 512-token context of one text, 32 decode tokens, 2 methods, 1 budget.
inline eval_options quick_options(eval_options o) {
    o.texts = {"tinystories"};
    o.contexts = {512};
    o.decode_tokens = 32;
    o.methods = {"qevict", "r2"};
    o.budgets = {{0.20}};
    return o;
}

// Every method name for_each_method offers, in its order.
inline std::vector<std::string> method_names() {
    std::vector<std::string> names;
    for_each_method([&]<class Config>(std::string_view name) { names.emplace_back(name); });
    return names;
}

// ---- the reference run ---------------------------------------------------------------------------

// The dense cache behind a seam that keeps what each method's prefill needs.
class recording_attention final : public llama::attention {
public:
    recording_attention(llama::dense_cache& dense, const llama::hyperparams& p, std::size_t observation_window)
        : dense_(dense), p_(p), observation_window_(observation_window), q_last_(p.layers), k_(p.layers), v_(p.layers) {}

    void prefill(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                 std::span<float> out, std::size_t n) override {
        const std::size_t qw = p_.q_heads * p_.head_dim, kvw = p_.kv_heads * p_.head_dim;
        const std::size_t rows = std::min(n, observation_window_);
        q_last_[layer].assign(q.begin() + static_cast<std::ptrdiff_t>((n - rows) * qw), q.begin() + static_cast<std::ptrdiff_t>(n * qw));
        k_[layer].assign(k.begin(), k.begin() + static_cast<std::ptrdiff_t>(n * kvw));
        v_[layer].assign(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n * kvw));
        dense_.prefill(layer, q, k, v, out, n);
    }
    void decode(std::size_t layer, std::span<const float> q, std::span<const float> k, std::span<const float> v,
                std::span<float> out) override {
        dense_.decode(layer, q, k, v, out);
    }
    [[nodiscard]] std::size_t kv_bytes() const override { return dense_.kv_bytes(); }
    [[nodiscard]] std::string name() const override { return "dense f32 (recording)"; }

    std::vector<std::vector<float>>& q_last() { return q_last_; }
    std::vector<std::vector<float>>& k() { return k_; }
    std::vector<std::vector<float>>& v() { return v_; }

private:
    llama::dense_cache& dense_;
    const llama::hyperparams& p_;
    std::size_t observation_window_;
    std::vector<std::vector<float>> q_last_, k_, v_;
};

struct reference_run {
    std::size_t prompt_tokens = 0;
    std::size_t decode_steps = 0;
    std::size_t vocab = 0;
    std::vector<std::vector<float>> q_last, k, v;        // per layer, pre-RoPE
    std::vector<float> logits;                           // [D][vocab]; row τ-1 predicts continuation[τ]
    std::vector<std::vector<std::vector<float>>> probs;  // [layer][τ-1][token]: head-averaged, P + τ tokens
    std::size_t kv_bytes = 0;                            // the dense cache's bytes after the last step
    double seconds = 0;
};

inline reference_run run_reference(const llama::model& m, const prompt_case& c, std::size_t decode_tokens,
                                   std::size_t observation_window) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto& p = m.params();
    const std::size_t P = c.prompt.size(), D = decode_tokens;
    if (c.continuation.size() < D + 1) throw std::invalid_argument("run_reference: continuation shorter than decode_tokens + 1");
    llama::dense_cache dense(p.attention(), P + D);
    recording_attention rec(dense, p, observation_window);
    (void)m.prefill(c.prompt, rec);

    reference_run r;
    r.prompt_tokens = P;
    r.decode_steps = D;
    r.vocab = p.vocab;
    r.q_last = std::move(rec.q_last());
    r.k = std::move(rec.k());
    r.v = std::move(rec.v());
    r.probs.assign(p.layers, {});
    r.logits.reserve(D * p.vocab);
    dense.record_probabilities(true);
    for (std::size_t t = 1; t <= D; ++t) {
        const std::vector<float> logits = m.decode(c.continuation[t - 1], dense);
        r.logits.insert(r.logits.end(), logits.begin(), logits.end());
        for (std::size_t l = 0; l < p.layers; ++l) r.probs[l].push_back(dense.head_averaged_probabilities(l));
    }
    r.kv_bytes = dense.kv_bytes();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

// ---- one method at one budget ---------------------------------------------------------------------

struct method_result {
    std::string text;
    std::size_t context = 0;
    std::size_t prompt_index = 0;
    std::string method;
    std::string budget_label;
    double budget_fraction = 0;  // 0 for "all"
    bool fits = false;
    std::string note;            // why it does not fit

    std::size_t decode_steps = 0;
    std::size_t max_tokens = 0;        // prompt + decode tokens: what the budget fraction refers to
    std::size_t budget_bytes = 0;      // B_total, all layers
    std::size_t used_bytes = 0;        // bytes held after the last step, all layers
    std::size_t full_cache_bytes = 0;  // an uncompressed cache of the same tokens, all layers
    std::size_t k_full = 0, k_quantized = 0;  // tier capacities per layer

    // Next-token accuracy against the full cache over the D decode steps.
    double top1 = not_applicable;        // argmax agreement
    double kl = not_applicable;          // mean KL(full ‖ method), nats
    double ppl_full = not_applicable;    // perplexity of the continuation, full cache
    double ppl_method = not_applicable;  // same, this method
    double ppl_ratio = not_applicable;   // ppl_method / ppl_full

    // Diagnostics against the reference attention, averaged over layers.
    double fmm = not_applicable;             // Future Missed Mass (missing = evicted)
    double fmm_no_quant = not_applicable;    // the same with the quantized tier disabled
    double lir_deployed = not_applicable;    // Global LIR of the deployed Full set
    double lir_oracle = not_applicable;      // Global LIR of the oracle Full set (top-K_f by future mass)
    double churn = not_applicable;           // Selection Churn of the retained set (Full ∪ Quantized)
    double churn_full = not_applicable;      // Selection Churn of the Full set
    double mass_full = not_applicable, mass_quantized = not_applicable, mass_evicted = not_applicable,
           mass_protected = not_applicable;  // reference attention-mass split (protected = sinks + recent)
    double score_agreement = not_applicable; // cosine, quantized-tier scores vs full-precision masses

    double seconds = 0;
    std::vector<dx::curve_point> fmm_curve, fmm_curve_no_quant;  // FMM(t), layer-averaged
};

namespace detail {

inline dx::tier to_diagnostic(qevict::tier t) {
    switch (t) {
        case qevict::tier::full: return dx::tier::full;
        case qevict::tier::quantized: return dx::tier::quantized;
        default: return dx::tier::evicted;
    }
}

// log-softmax in double.
inline void log_softmax(std::span<const float> logits, std::vector<double>& out) {
    out.resize(logits.size());
    double m = -INFINITY;
    for (float x : logits) m = std::max(m, static_cast<double>(x));
    double s = 0;
    for (float x : logits) s += std::exp(static_cast<double>(x) - m);
    const double lse = m + std::log(s);
    for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

// Mean of the finite values; NaN when there is none.
inline double finite_mean(const std::vector<double>& xs) {
    double s = 0;
    std::size_t n = 0;
    for (double x : xs)
        if (std::isfinite(x)) {
            s += x;
            ++n;
        }
    return n ? s / static_cast<double>(n) : not_applicable;
}

// Layer-average of per-layer curves that share their steps.
inline std::vector<dx::curve_point> mean_curve(const std::vector<std::vector<dx::curve_point>>& per_layer) {
    std::vector<dx::curve_point> out;
    if (per_layer.empty()) return out;
    out = per_layer.front();
    for (std::size_t l = 1; l < per_layer.size(); ++l)
        for (std::size_t i = 0; i < out.size() && i < per_layer[l].size(); ++i) out[i].value += per_layer[l][i].value;
    for (auto& p : out) p.value /= static_cast<double>(per_layer.size());
    return out;
}

}  // namespace detail

template <class Config>
method_result run_method(const llama::model& m, const prompt_case& c, const reference_run& ref, std::string_view method,
                         const budget_spec& b, const eval_options& opt) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto& p = m.params();
    const std::size_t P = ref.prompt_tokens, D = ref.decode_steps, V = ref.vocab, L = p.layers;
    constexpr std::size_t S = Config::window_policy::sinks, W = Config::window_policy::size;

    method_result r;
    r.text = c.text;
    r.context = c.context;
    r.prompt_index = c.index;
    r.method = std::string(method);
    r.budget_label = b.label();
    r.budget_fraction = b.everything() ? 0.0 : b.fraction;
    r.decode_steps = D;
    r.max_tokens = P + D;

    std::unique_ptr<llama::qevict_attention<Config>> kv;
    try {
        kv = std::make_unique<llama::qevict_attention<Config>>(p, b.to_budget(), P + D);
    } catch (const qevict::error& e) {
        r.fits = false;
        r.note = e.what();
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return r;
    }
    r.fits = true;
    auto& cache = kv->cache();
    const qevict::sequence_id seq = kv->sequence();
    // A value-weighted scorer (CriticalKV) weighs attention by ‖W_o^(h) v‖: give it the model's W_o.
    if constexpr (Config::scorer::token_signal == qevict::scorers::signal::value_weighted_attention)
        for (std::size_t l = 0; l < L; ++l)
            cache.set_output_projection(static_cast<int>(l), m.output_projection(l), static_cast<int>(p.dim));
    for (std::size_t l = 0; l < L; ++l) cache.prefill(static_cast<int>(l), seq, ref.q_last[l], ref.k[l], ref.v[l]);

    // Score agreement: per layer and window, the mass the compressed run gave a window while it
    // was Quantized (scores from INT2 keys) and the reference's mass of that window at the same steps.
    std::size_t step = 0;
    std::vector<std::vector<double>> score_int2(L), score_full(L);
    std::vector<std::vector<std::size_t>> marked(L);
    std::vector<std::vector<int>> quantized_now(L);
    kv->set_observer([&](std::size_t layer, const qevict::attention_event& e) {
        if (e.where != qevict::tier::quantized || e.window < 0) return;
        const auto w = static_cast<std::size_t>(e.window);
        if (score_int2[layer].size() <= w) {
            score_int2[layer].resize(w + 1, 0.0);
            score_full[layer].resize(w + 1, 0.0);
            marked[layer].resize(w + 1, 0);
        }
        score_int2[layer][w] += e.probability;
        if (marked[layer][w] != step) {
            marked[layer][w] = step;
            quantized_now[layer].push_back(e.window);
        }
    });

    // Tier history per layer: a snapshot after the prefill's routing (step 0), after every Ω-th
    // step and whenever the tiers changed.
    const dx::window_layout layout{S, W};
    std::vector<std::vector<dx::tier_snapshot>> history(L);
    // A method that routes each KV head's copy of a window on its own (per-KV-head units) has no
    // single tier per window: the window diagnostics do not apply and are left out.
    const bool per_head = cache.plan().units > 1;
    if (per_head) r.note = "routes per KV head: window diagnostics not computed";
    auto snapshot = [&](std::size_t at, bool force) {
        if (per_head) return;
        for (std::size_t l = 0; l < L; ++l) {
            std::vector<dx::tier> tiers;
            for (const auto& w : cache.windows(seq, static_cast<int>(l))) {
                if (w.where == qevict::tier::recent || w.where == qevict::tier::sink) break;
                tiers.push_back(detail::to_diagnostic(w.where));
            }
            if (force || history[l].empty() || tiers != history[l].back().tiers)
                history[l].push_back(dx::tier_snapshot{at, layout, std::move(tiers)});
        }
    };
    snapshot(0, true);

    std::size_t agree = 0;
    double kl_sum = 0, nll_full = 0, nll_method = 0;
    std::vector<double> lp_full, lp_method;
    for (step = 1; step <= D; ++step) {
        const std::vector<float> logits = m.decode(c.continuation[step - 1], *kv);
        const std::span<const float> ref_logits(ref.logits.data() + (step - 1) * V, V);
        detail::log_softmax(ref_logits, lp_full);
        detail::log_softmax(logits, lp_method);
        if (llama::argmax(ref_logits) == llama::argmax(logits)) ++agree;
        double kl = 0;
        for (std::size_t i = 0; i < V; ++i) kl += std::exp(lp_full[i]) * (lp_full[i] - lp_method[i]);
        kl_sum += std::max(0.0, kl);
        const auto next = static_cast<std::size_t>(c.continuation[step]);
        nll_full -= lp_full[next];
        nll_method -= lp_method[next];

        for (std::size_t l = 0; l < L; ++l) {
            const std::vector<float>& probs = ref.probs[l][step - 1];
            for (int w : quantized_now[l]) {
                const std::size_t begin = S + static_cast<std::size_t>(w) * W;
                double mass = 0;
                for (std::size_t i = begin; i < begin + W && i < probs.size(); ++i) mass += probs[i];
                score_full[l][static_cast<std::size_t>(w)] += mass;
            }
            quantized_now[l].clear();
        }
        snapshot(step, step % static_cast<std::size_t>(Config::routing_interval) == 0);
    }
    kv->set_observer({});

    const double Dd = static_cast<double>(D);
    r.top1 = static_cast<double>(agree) / Dd;
    r.kl = kl_sum / Dd;
    r.ppl_full = std::exp(nll_full / Dd);
    r.ppl_method = std::exp(nll_method / Dd);
    r.ppl_ratio = r.ppl_method / r.ppl_full;

    const qevict::budget_report rep = cache.report();
    r.budget_bytes = rep.budget_total();
    r.used_bytes = rep.used_total().total();
    r.full_cache_bytes = rep.full_cache_total();
    r.k_full = rep.caps.full;
    r.k_quantized = rep.caps.quantized;

    // Diagnostics per layer, then the layer mean.
    std::vector<double> fmm(L), fmm_nq(L), lir_d(L), lir_o(L), churn(L), churn_f(L), mf(L), mq(L), me(L), mp(L), agreement(L);
    std::vector<std::vector<dx::curve_point>> curve(L), curve_nq(L);
    for (std::size_t l = 0; l < L && !per_head; ++l) {
        std::vector<dx::attention_step> trace;
        trace.reserve(D);
        for (std::size_t t = 1; t <= D; ++t) trace.push_back({t, ref.probs[l][t - 1]});
        const auto& h = history[l];
        curve[l] = dx::future_missed_mass_curve(h, trace, dx::missing_tiers::evicted);
        curve_nq[l] = dx::future_missed_mass_curve(h, trace, dx::missing_tiers::evicted_and_quantized);
        fmm[l] = dx::future_missed_mass(h, trace, dx::missing_tiers::evicted);
        fmm_nq[l] = dx::future_missed_mass(h, trace, dx::missing_tiers::evicted_and_quantized);
        const auto split = dx::mean_attention_mass_split(h, trace);
        mf[l] = split.full;
        mq[l] = split.quantized;
        me[l] = split.evicted;
        mp[l] = split.protected_share();
        const auto full_sets = dx::window_sets_from_history(h, dx::kept_tiers::full);
        const auto kept_sets = dx::window_sets_from_history(h, dx::kept_tiers::full_and_quantized);
        const auto deployed = dx::global_lir(full_sets, opt.lir_min_absence);
        lir_d[l] = deployed.opportunities ? deployed.rate() : not_applicable;
        const auto oracle = dx::global_lir(dx::oracle_sets(h, trace, {.k_full = r.k_full}), opt.lir_min_absence);
        lir_o[l] = oracle.opportunities ? oracle.rate() : not_applicable;
        churn[l] = dx::selection_churn(kept_sets);
        churn_f[l] = dx::selection_churn(full_sets);
        bool any = false;
        for (double x : score_int2[l]) any = any || x > 0;
        agreement[l] = any ? dx::score_agreement(std::span<const double>(score_int2[l]), std::span<const double>(score_full[l]))
                           : not_applicable;
    }
    if (per_head) {
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return r;
    }
    r.fmm = detail::finite_mean(fmm);
    r.fmm_no_quant = detail::finite_mean(fmm_nq);
    r.lir_deployed = detail::finite_mean(lir_d);
    r.lir_oracle = detail::finite_mean(lir_o);
    r.churn = detail::finite_mean(churn);
    r.churn_full = detail::finite_mean(churn_f);
    r.mass_full = detail::finite_mean(mf);
    r.mass_quantized = detail::finite_mean(mq);
    r.mass_evicted = detail::finite_mean(me);
    r.mass_protected = detail::finite_mean(mp);
    r.score_agreement = detail::finite_mean(agreement);
    r.fmm_curve = detail::mean_curve(curve);
    r.fmm_curve_no_quant = detail::mean_curve(curve_nq);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

// The reference itself as a row: method "full", budget "full" (the dense float32 cache).
inline method_result full_cache_row(const prompt_case& c, const reference_run& ref) {
    method_result r;
    r.text = c.text;
    r.context = c.context;
    r.prompt_index = c.index;
    r.method = "full";
    r.budget_label = "full";
    r.budget_fraction = 1.0;
    r.fits = true;
    r.decode_steps = ref.decode_steps;
    r.max_tokens = ref.prompt_tokens + ref.decode_steps;
    r.budget_bytes = r.used_bytes = r.full_cache_bytes = ref.kv_bytes;
    double nll = 0;
    std::vector<double> lp;
    for (std::size_t t = 1; t <= ref.decode_steps; ++t) {
        detail::log_softmax(std::span<const float>(ref.logits.data() + (t - 1) * ref.vocab, ref.vocab), lp);
        nll -= lp[static_cast<std::size_t>(c.continuation[t])];
    }
    r.top1 = 1.0;
    r.kl = 0.0;
    r.ppl_full = r.ppl_method = std::exp(nll / static_cast<double>(ref.decode_steps));
    r.ppl_ratio = 1.0;
    r.seconds = ref.seconds;
    return r;
}

// ---- the whole evaluation -------------------------------------------------------------------------

// Runs every (text, prompt, context, method, budget) of `opt` and returns one result each, in
// that order, each (text, prompt, context) led by its full-cache row (full_cache_row).
// `on_result` (optional) sees each result as soon as it exists.
inline std::vector<method_result> run_evaluation(const llama::model& m, const eval_options& opt,
                                                 const std::function<void(const method_result&)>& on_result = {}) {
    // Which methods, in for_each_method's order.
    const std::vector<std::string> known = method_names();
    std::vector<std::string> wanted;
    for (const auto& name : opt.methods) {
        const std::string c = canonical_method(name);
        if (std::find(known.begin(), known.end(), c) == known.end()) {
            std::string list;
            for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
            throw std::invalid_argument("unknown method '" + name + "' (known: " + list + ", r3 = qevict)");
        }
        if (std::find(wanted.begin(), wanted.end(), c) == wanted.end()) wanted.push_back(c);
    }
    auto selected = [&](std::string_view name) {
        if (opt.methods.empty()) return !on_request_only(name);
        return std::find(wanted.begin(), wanted.end(), name) != wanted.end();
    };
    std::size_t method_count = 0;
    for (const auto& k : known) method_count += selected(k) ? 1 : 0;

    for (const auto& t : opt.texts) (void)find_text(t);
    const std::size_t total = opt.texts.size() * opt.prompts * opt.contexts.size() * method_count * opt.budgets.size();
    const std::size_t observation_window = static_cast<std::size_t>(qevict::options{}.observation_window);

    std::vector<method_result> results;
    std::size_t done = 0;
    for (const auto& text_name : opt.texts) {
        const std::string body = read_file(opt.data_dir / find_text(text_name).file);
        for (std::size_t pi = 0; pi < opt.prompts; ++pi) {
            for (std::size_t ctx : opt.contexts) {
                const prompt_case c = cut_prompt(m.vocab(), body, text_name, ctx, opt.decode_tokens, pi, opt.prompts);
                const reference_run ref = run_reference(m, c, opt.decode_tokens, observation_window);
                if (opt.progress)
                    *opt.progress << "reference " << text_name << " " << ctx << " (prompt " << pi << "): "
                                  << ref.seconds << " s\n"
                                  << std::flush;
                {
                    method_result full = full_cache_row(c, ref);
                    if (on_result) on_result(full);
                    results.push_back(std::move(full));
                }
                for_each_method([&]<class Config>(std::string_view name) {
                    if (!selected(name)) return;
                    for (const auto& b : opt.budgets) {
                        ++done;
                        if (opt.progress)
                            *opt.progress << "[" << done << "/" << total << "] " << text_name << " " << ctx << " " << name << " "
                                          << b.label() << " ..." << std::flush;
                        method_result r;
                        try {
                            r = run_method<Config>(m, c, ref, name, b, opt);
                        } catch (const std::exception& e) {
                            // A method that fails after it was constructed is a finding, not a reason
                            // to lose the rest of the evaluation.
                            r = method_result{};
                            r.text = c.text;
                            r.context = c.context;
                            r.prompt_index = c.index;
                            r.method = std::string(name);
                            r.budget_label = b.label();
                            r.budget_fraction = b.everything() ? 0.0 : b.fraction;
                            r.decode_steps = opt.decode_tokens;
                            r.max_tokens = c.prompt.size() + opt.decode_tokens;
                            r.note = std::string("error: ") + e.what();
                        }
                        if (opt.progress) {
                            if (r.fits) {
                                char line[160];
                                std::snprintf(line, sizeof line, " top1 %.3f  KL %.4f  FMM %.3f  %.1f s\n", r.top1, r.kl, r.fmm,
                                              r.seconds);
                                *opt.progress << line;
                            } else {
                                *opt.progress << (r.note.rfind("error:", 0) == 0 ? " " + r.note : std::string(" does not fit")) << "\n";
                            }
                            *opt.progress << std::flush;
                        }
                        if (on_result) on_result(r);
                        results.push_back(std::move(r));
                    }
                });
            }
        }
    }
    return results;
}

}  // namespace qevict_eval

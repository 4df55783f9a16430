// Diagnostics on a hand-made trace whose every expected value is worked out in the comments.
//
// Layout: S = 1 sink, W = 2, four windows, one recent token — ten tokens per reference step:
//   token:   0     1  2    3  4    5  6    7  8    9
//   region:  sink  w0      w1      w2      w3      recent
//
// Reference (FullKV) window masses per decode step, each window's mass split evenly over its
// two tokens; every step sums to 1:
//   step   sink   w0    w1    w2    w3    recent
//   1      .1     .2    .1    .3    .1    .2
//   2      .1     .1    .2    .2    .2    .2
//   3      .2     .1    .1    .1    .3    .2
//   4      .1     .3    .2    .0    .2    .2
//   5      .1     .1    .4    .2    .0    .2
//
// Compressed run, three routing events (F = full, Q = quantized, E = evicted):
//   h0 (step 0):  w0 F   w1 Q   w2 E   w3 Q
//   h1 (step 2):  w0 Q   w1 F   w2 E   w3 Q     (w1 promoted, w0 demoted)
//   h2 (step 4):  w0 Q   w1 F   w2 E   w3 E     (w3 evicted)
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <qevict/diagnostics/diagnostics.hpp>

#include <array>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace dx = qevict::diagnostics;
using dx::tier;

namespace {

constexpr dx::window_layout layout{1, 2};

// Tokens of one step from its region masses (sink, w0..w3, recent).
std::vector<float> tokens(float sink, float w0, float w1, float w2, float w3, float recent) {
    return {sink, w0 / 2, w0 / 2, w1 / 2, w1 / 2, w2 / 2, w2 / 2, w3 / 2, w3 / 2, recent};
}

struct fixture {
    std::vector<std::vector<float>> probs{
        tokens(.1f, .2f, .1f, .3f, .1f, .2f), tokens(.1f, .1f, .2f, .2f, .2f, .2f),
        tokens(.2f, .1f, .1f, .1f, .3f, .2f), tokens(.1f, .3f, .2f, .0f, .2f, .2f),
        tokens(.1f, .1f, .4f, .2f, .0f, .2f)};
    std::vector<dx::attention_step> trace;
    std::vector<dx::tier_snapshot> history{
        {0, layout, {tier::full, tier::quantized, tier::evicted, tier::quantized}},
        {2, layout, {tier::quantized, tier::full, tier::evicted, tier::quantized}},
        {4, layout, {tier::quantized, tier::full, tier::evicted, tier::evicted}}};

    fixture() {
        for (std::size_t k = 0; k < probs.size(); ++k) trace.push_back({k + 1, probs[k]});
    }
};

// The message of the std::invalid_argument `f` throws, or "" when it throws nothing.
std::string invalid_argument_message(const std::function<void()>& f) {
    try {
        f();
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
    return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("window mass aggregates each window's tokens") {
    const fixture f;
    // Step 1: w0 = .1 + .1 = .2, w1 = .05 + .05 = .1.
    const std::vector<double> two = dx::window_mass(layout, 2, f.probs[0]);
    REQUIRE(two.size() == 2);
    CHECK(two[0] == doctest::Approx(.2));
    CHECK(two[1] == doctest::Approx(.1));
    // Steps 1 + 2: w0 .2+.1 = .3, w1 .1+.2 = .3, w2 .3+.2 = .5, w3 .1+.2 = .3.
    const std::vector<double> sum = dx::accumulate_window_mass(layout, 4, std::span(f.trace).first(2));
    CHECK(sum[0] == doctest::Approx(.3));
    CHECK(sum[1] == doctest::Approx(.3));
    CHECK(sum[2] == doctest::Approx(.5));
    CHECK(sum[3] == doctest::Approx(.3));
    CHECK(dx::sink_mass(layout, f.probs[0]) == doctest::Approx(.1));
    CHECK(dx::recent_mass(9, f.probs[0]) == doctest::Approx(.2));
    // Five windows need 1 + 5·2 = 11 tokens; the step has 10.
    CHECK(contains(invalid_argument_message([&] { (void)dx::window_mass(layout, 5, f.probs[0]); }),
                   "need 11 tokens but the step has 10"));
}

TEST_CASE("future missed mass: curve, scalar and per-step profile") {
    const fixture f;
    // Evicted only. FMM(t) uses the snapshot at t (latest with step ≤ t):
    //   t=1: h0, E={w2}: w2 at τ=2..5 = .2, .1, .0, .2       → .5/4 = .125
    //   t=2: h1, E={w2}: τ=3..5 = .1, .0, .2                 → .3/3 = .1
    //   t=3: h1, E={w2}: τ=4..5 = .0, .2                     → .2/2 = .1
    //   t=4: h2, E={w2,w3}: τ=5 = .2 + .0                    → .2
    //   t=5 has no future step and is not on the curve.
    const auto curve = dx::future_missed_mass_curve(f.history, f.trace);
    REQUIRE(curve.size() == 4);
    const std::array<double, 4> expected{.125, .1, .1, .2};
    for (std::size_t k = 0; k < 4; ++k) {
        CHECK(curve[k].step == k + 1);
        CHECK(curve[k].value == doctest::Approx(expected[k]));
    }
    // Mean: (.125 + .1 + .1 + .2) / 4 = .525 / 4 = .13125.
    CHECK(dx::future_missed_mass(f.history, f.trace) == doctest::Approx(.13125));

    // Profile of t = 1 (h0, E={w2}): τ=2 .2, τ=3 .1, τ=4 .0, τ=5 .2.
    const auto profile = dx::future_missed_mass_profile(f.history, f.trace, 1);
    REQUIRE(profile.size() == 4);
    CHECK(profile[0].step == 2);
    CHECK(profile[0].value == doctest::Approx(.2));
    CHECK(profile[1].value == doctest::Approx(.1));
    CHECK(profile[2].value == doctest::Approx(0.0));
    CHECK(profile[3].value == doctest::Approx(.2));
}

TEST_CASE("future missed mass with the quantized tier disabled") {
    const fixture f;
    // Missing = evicted ∪ quantized.
    //   t=1: h0 missing {w1,w2,w3}: τ2 .2+.2+.2=.6, τ3 .1+.1+.3=.5, τ4 .2+0+.2=.4, τ5 .4+.2+0=.6
    //        → 2.1/4 = .525
    //   t=2: h1 missing {w0,w2,w3}: τ3 .1+.1+.3=.5, τ4 .3+0+.2=.5, τ5 .1+.2+0=.3 → 1.3/3 = .43333
    //   t=3: h1: τ4 .5, τ5 .3 → .4
    //   t=4: h2 missing {w0,w2,w3}: τ5 .1+.2+0 = .3
    const auto curve = dx::future_missed_mass_curve(f.history, f.trace, dx::missing_tiers::evicted_and_quantized);
    REQUIRE(curve.size() == 4);
    CHECK(curve[0].value == doctest::Approx(.525));
    CHECK(curve[1].value == doctest::Approx(1.3 / 3));
    CHECK(curve[2].value == doctest::Approx(.4));
    CHECK(curve[3].value == doctest::Approx(.3));
    // Mean: (.525 + .43333 + .4 + .3) / 4 = 1.658333 / 4 = .4145833.
    CHECK(dx::future_missed_mass(f.history, f.trace, dx::missing_tiers::evicted_and_quantized) ==
          doctest::Approx((.525 + 1.3 / 3 + .4 + .3) / 4));
    // Disabling the quantized tier can only add missing windows.
    for (std::size_t k = 0; k < curve.size(); ++k) {
        CHECK(curve[k].value >= dx::future_missed_mass_curve(f.history, f.trace)[k].value);
    }
}

TEST_CASE("future missed mass is zero without evictions and before the first routing event") {
    fixture f;
    for (auto& s : f.history) {
        for (auto& t : s.tiers) {
            if (t == tier::evicted) t = tier::quantized;
        }
    }
    CHECK(dx::future_missed_mass(f.history, f.trace) == doctest::Approx(0.0));
    for (const auto& p : dx::future_missed_mass_curve(f.history, f.trace)) CHECK(p.value == 0.0);

    // A single routing event at step 3 with w2 evicted: t=1,2 precede it (0); t=3: τ4 .0, τ5 .2 → .1;
    // t=4: τ5 → .2. Mean (0 + 0 + .1 + .2)/4 = .075.
    const std::vector<dx::tier_snapshot> late{{3, layout, {tier::full, tier::full, tier::evicted, tier::full}}};
    const fixture g;
    const auto curve = dx::future_missed_mass_curve(late, g.trace);
    REQUIRE(curve.size() == 4);
    CHECK(curve[0].value == 0.0);
    CHECK(curve[1].value == 0.0);
    CHECK(curve[2].value == doctest::Approx(.1));
    CHECK(curve[3].value == doctest::Approx(.2));
    CHECK(dx::future_missed_mass(late, g.trace) == doctest::Approx(.075));

    // A trace with one step has no future: empty curve, scalar 0.
    CHECK(dx::future_missed_mass_curve(g.history, std::span(g.trace).first(1)).empty());
    CHECK(dx::future_missed_mass(g.history, std::span(g.trace).first(1)) == 0.0);
}

TEST_CASE("missed mass normalises by the step's total mass") {
    // The same step scaled by 2 (e.g. summed rather than averaged over heads) gives the same fraction:
    // step 1 under h0, E={w2}: .3 (or .6 / 2).
    const fixture f;
    std::vector<float> doubled = f.probs[0];
    for (float& p : doubled) p *= 2;
    CHECK(dx::missed_mass(f.history[0], {1, doubled}) == doctest::Approx(.3));
    const std::vector<float> zeros(10, 0.0f);
    CHECK(contains(invalid_argument_message([&] { (void)dx::missed_mass(f.history[0], {7, zeros}); }),
                   "attention step 7 has no positive mass"));
}

TEST_CASE("attention-mass split of one step and averaged over the trace") {
    const fixture f;
    // Step 3 is governed by h1 (latest with step < 3): w0 Q, w1 F, w2 E, w3 Q.
    //   full = w1 = .1, quantized = w0 + w3 = .1 + .3 = .4, evicted = w2 = .1, sink .2, recent .2.
    const dx::mass_split s = dx::split_attention_mass(f.history[1], f.trace[2]);
    CHECK(s.full == doctest::Approx(.1));
    CHECK(s.quantized == doctest::Approx(.4));
    CHECK(s.evicted == doctest::Approx(.1));
    CHECK(s.sink == doctest::Approx(.2));
    CHECK(s.recent == doctest::Approx(.2));
    CHECK(s.protected_share() == doctest::Approx(.4));
    CHECK(s.full + s.quantized + s.evicted + s.sink + s.recent == doctest::Approx(1.0));

    // Governing snapshots: steps 1, 2 → h0; 3, 4 → h1; 5 → h2.
    //   step  full  quant          evicted     sink  recent
    //   1     .2    .1+.1=.2       .3          .1    .2       (h0: w0 F, w1 Q, w2 E, w3 Q)
    //   2     .1    .2+.2=.4       .2          .1    .2       (h0)
    //   3     .1    .1+.3=.4       .1          .2    .2       (h1: w0 Q, w1 F, w2 E, w3 Q)
    //   4     .2    .3+.2=.5       .0          .1    .2       (h1)
    //   5     .4    .1             .2+.0=.2    .1    .2       (h2: w0 Q, w1 F, w2 E, w3 E)
    //   mean  1.0/5=.2  1.6/5=.32  .8/5=.16    .6/5=.12  .2   (sum 1)
    const dx::mass_split m = dx::mean_attention_mass_split(f.history, f.trace);
    CHECK(m.full == doctest::Approx(.2));
    CHECK(m.quantized == doctest::Approx(.32));
    CHECK(m.evicted == doctest::Approx(.16));
    CHECK(m.sink == doctest::Approx(.12));
    CHECK(m.recent == doctest::Approx(.2));

    // No step comes after a routing event at step 9.
    const std::vector<dx::tier_snapshot> late{{9, layout, {tier::full, tier::full, tier::full, tier::full}}};
    CHECK(contains(invalid_argument_message([&] { (void)dx::mean_attention_mass_split(late, f.trace); }),
                   "no reference step comes after a routing event"));
}

TEST_CASE("window sets from a tier history follow Eq. 4 candidates") {
    const fixture f;
    // h0: all four windows are candidates. h1, h2: w2 was evicted at h0, so it is never ranked again.
    const auto all = dx::window_sets_from_history(f.history, dx::kept_tiers::full_and_quantized);
    REQUIRE(all.size() == 3);
    CHECK(all[0].candidates == std::vector<std::size_t>{0, 1, 2, 3});
    CHECK(all[0].kept == std::vector<std::size_t>{0, 1, 3});
    CHECK(all[1].candidates == std::vector<std::size_t>{0, 1, 3});
    CHECK(all[1].kept == std::vector<std::size_t>{0, 1, 3});
    CHECK(all[2].candidates == std::vector<std::size_t>{0, 1, 3});  // w3 evicted at h2: still ranked there
    CHECK(all[2].kept == std::vector<std::size_t>{0, 1});
    const auto full = dx::window_sets_from_history(f.history, dx::kept_tiers::full);
    CHECK(full[0].kept == std::vector<std::size_t>{0});
    CHECK(full[1].kept == std::vector<std::size_t>{1});
    CHECK(full[2].kept == std::vector<std::size_t>{1});
}

TEST_CASE("selection churn") {
    const fixture f;
    // Kept = Full ∪ Quantized, common candidates U = {0,1,3} for both pairs:
    //   h0→h1: A = {0,1,3}, B = {0,1,3}            → d = 0
    //   h1→h2: A = {0,1,3}, B = {0,1}              → d = 1 − 2/3 = 1/3
    //   churn = (0 + 1/3) / 2 = 1/6
    const auto all = dx::window_sets_from_history(f.history, dx::kept_tiers::full_and_quantized);
    const auto curve = dx::selection_churn_curve(all);
    REQUIRE(curve.size() == 2);
    CHECK(curve[0] == doctest::Approx(0.0));
    CHECK(curve[1] == doctest::Approx(1.0 / 3));
    CHECK(dx::selection_churn(all) == doctest::Approx(1.0 / 6));
    // Kept = Full only: h0→h1 {0} vs {1} → 1 − 0/2 = 1; h1→h2 {1} vs {1} → 0; churn = .5.
    CHECK(dx::selection_churn(dx::window_sets_from_history(f.history, dx::kept_tiers::full)) ==
          doctest::Approx(.5));

    const dx::window_set a{{0, 1, 2, 3}, {0, 1}};
    const dx::window_set b{{0, 1, 2, 3}, {2, 3}};
    CHECK(dx::churn_between(a, a) == 0.0);                               // identical → 0
    CHECK(dx::churn_between(a, b) == doctest::Approx(1.0));              // disjoint → 1
    const std::vector<dx::window_set> same{a, a, a};
    CHECK(dx::selection_churn(same) == 0.0);
    // A newly aged window (2, not a candidate before) is not churn: U = {0,1}, A = B = {0,1} → 0.
    // Counting it would give 1 − 2/3.
    CHECK(dx::churn_between({{0, 1}, {0, 1}}, {{0, 1, 2}, {0, 1, 2}}) == 0.0);
    // Fewer than two events: no pair, churn 0.
    CHECK(dx::selection_churn(std::span(same).first(1)) == 0.0);
    // Plain Jaccard distance: {1,2,3} vs {2,3,4}: 1 − 2/4 = .5; two empty sets agree.
    const std::vector<std::size_t> x{1, 2, 3}, y{2, 3, 4}, none{};
    CHECK(dx::jaccard_distance(x, y) == doctest::Approx(.5));
    CHECK(dx::jaccard_distance(none, none) == 0.0);
    // A kept window that is not a candidate is rejected.
    CHECK(contains(invalid_argument_message([&] { (void)dx::churn_between(a, {{0, 1}, {0, 5}}); }),
                   "every kept window must also be a candidate"));
    CHECK(contains(invalid_argument_message([&] { (void)dx::jaccard_distance(y, std::vector<std::size_t>{3, 1}); }),
                   "sorted ascending"));
}

TEST_CASE("global LIR on a hand-made kept-set sequence") {
    // Four windows, all candidates at every event; kept (full) sets:
    //   r:     0      1      2      3      4      5
    //   kept:  {0,1}  {0,2}  {0,2}  {1,2}  {0,3}  {1,3}
    const std::vector<std::size_t> c{0, 1, 2, 3};
    const std::vector<dx::window_set> events{{c, {0, 1}}, {c, {0, 2}}, {c, {0, 2}},
                                             {c, {1, 2}}, {c, {0, 3}}, {c, {1, 3}}};
    // k = 2. Absence run before each event (candidate and not kept), * = eligible (run ≥ 2):
    //   w0: runs 0,0,0,0,1,0   → never eligible
    //   w1: runs 0,1,2*,... at r3 run=2 → eligible and kept → revival; then r4 → 1, r5 run 1
    //       → 1 opportunity, 1 revival (it had been kept at r0)
    //   w2: runs 1,0,0,0,0,1   → never eligible
    //   w3: runs 0,1,2*,3*,4* → r2 out, r3 out, r4 kept → 3 opportunities, 1 revival (never kept before)
    // since_candidate: (1 + 1) / (1 + 3) = 2/4 = .5
    const dx::revival_stats any = dx::global_lir(events, 2);
    CHECK(any.revivals == 2);
    CHECK(any.opportunities == 4);
    CHECK(any.rate() == doctest::Approx(.5));
    // since_exit: w3 had never been kept, so only w1 counts: 1/1 = 1.
    const dx::revival_stats exit = dx::global_lir(events, 2, dx::lir_origin::since_exit);
    CHECK(exit.revivals == 1);
    CHECK(exit.opportunities == 1);
    CHECK(exit.rate() == doctest::Approx(1.0));
    // k = 1: w0 1/1 (r4), w1 2/3 (r2 out; r3, r5 in), w2 1/2 (r1 in, r5 out), w3 1/4 (r1..r3 out, r4 in)
    //   → 5/10 = .5
    const dx::revival_stats k1 = dx::global_lir(events, 1);
    CHECK(k1.revivals == 5);
    CHECK(k1.opportunities == 10);

    // Leaving the candidate pool breaks an absence run: w1 is out at r0, not ranked at r1, out at
    // r2, so at r3 its run is 1 < 2 and its return is not a revival. 0 opportunities → rate 0.
    const std::vector<dx::window_set> broken{{{0, 1}, {0}}, {{0}, {0}}, {{0, 1}, {0}}, {{0, 1}, {1}}};
    const dx::revival_stats none = dx::global_lir(broken, 2);
    CHECK(none.opportunities == 0);
    CHECK(none.rate() == 0.0);

    CHECK(contains(invalid_argument_message([&] { (void)dx::global_lir(events, 0); }), "must be at least 1"));
}

TEST_CASE("global LIR of the deployed set and of the oracle set") {
    const fixture f;
    // Deployed full sets: h0 {0} of {0,1,2,3}; h1 {1} of {0,1,3}; h2 {1} of {0,1,3}. k = 1:
    //   w0: kept at h0, out at h1 (run 1), eligible at h2 and out      → 1 opportunity
    //   w1: out at h0, eligible at h1 and kept                          → 1 opportunity, 1 revival
    //   w2: out at h0, not a candidate afterwards                       → 0
    //   w3: out at h0; eligible at h1 (out) and h2 (out — evicted there) → 2 opportunities
    //   → 1/4 = .25
    const auto deployed = dx::window_sets_from_history(f.history, dx::kept_tiers::full);
    const dx::revival_stats d = dx::global_lir(deployed, 1);
    CHECK(d.revivals == 1);
    CHECK(d.opportunities == 4);
    CHECK(d.rate() == doctest::Approx(.25));

    // Oracle, K_f = 1, future mass over all later steps:
    //   h0 (step 0), τ=1..5: w0 .8, w1 1.0, w2 .8, w3 .8 → {1}
    //   h1 (step 2), τ=3..5: w0 .5, w1 .7, w2 .3, w3 .5 → {1}
    //   h2 (step 4), τ=5:    w0 .1, w1 .4, w2 .2, w3 0  → {1}
    // The oracle never changes its mind here: no revival, LIR 0 (w0, w2, w3 are eligible from h1 on:
    // 3 at h1 + 3 at h2 = 6 opportunities).
    const auto oracle = dx::oracle_sets(f.history, f.trace, {.k_full = 1});
    REQUIRE(oracle.size() == 3);
    for (const auto& e : oracle) {
        CHECK(e.candidates == std::vector<std::size_t>{0, 1, 2, 3});
        CHECK(e.kept == std::vector<std::size_t>{1});
    }
    const dx::revival_stats o = dx::global_lir(oracle, 1);
    CHECK(o.revivals == 0);
    CHECK(o.opportunities == 6);
    CHECK(o.rate() == 0.0);

    // K_f = 2: ties go to the lower index. h0: 1.0 then .8 ×3 → {0,1}; h1: .7 then .5 ×2 → {0,1};
    // h2: .4, .2 → {1,2}.
    const auto two = dx::oracle_sets(f.history, f.trace, {.k_full = 2});
    CHECK(two[0].kept == std::vector<std::size_t>{0, 1});
    CHECK(two[1].kept == std::vector<std::size_t>{0, 1});
    CHECK(two[2].kept == std::vector<std::size_t>{1, 2});

    // Horizon 1 (only step t+1): h0 → τ1 {w2 .3}; h1 → τ3 {w3 .3}; h2 → τ5 {w1 .4}.
    const auto next = dx::oracle_sets(f.history, f.trace, {.k_full = 1, .horizon = 1});
    CHECK(next[0].kept == std::vector<std::size_t>{2});
    CHECK(next[1].kept == std::vector<std::size_t>{3});
    CHECK(next[2].kept == std::vector<std::size_t>{1});

    // Hindsight (whole trace): w1 has the most mass overall (1.0) at every event.
    const auto hind = dx::oracle_sets(f.history, f.trace, {.k_full = 1, .scoring = dx::oracle_scoring::hindsight});
    for (const auto& e : hind) CHECK(e.kept == std::vector<std::size_t>{1});

    // top_k_set keeps at most the number of windows.
    const std::vector<double> scores{.5, .1};
    CHECK(dx::top_k_set(scores, 5).kept == std::vector<std::size_t>{0, 1});
}

TEST_CASE("score agreement is cosine similarity with defined zero cases") {
    // (1,2,2)·(2,1,2) = 2 + 2 + 4 = 8; both norms 3 → 8/9.
    const std::vector<double> a{1, 2, 2}, b{2, 1, 2}, minus{-1, -2, -2}, zero{0, 0, 0};
    CHECK(dx::score_agreement(a, b) == doctest::Approx(8.0 / 9));
    CHECK(dx::score_agreement(a, a) == doctest::Approx(1.0));
    CHECK(dx::score_agreement(a, minus) == doctest::Approx(-1.0));
    CHECK(dx::score_agreement(zero, zero) == 1.0);  // both zero: nothing to disagree on
    CHECK(dx::score_agreement(a, zero) == 0.0);     // one zero: no agreement
    CHECK(dx::score_agreement(std::vector<double>{}, std::vector<double>{}) == 1.0);
    const std::vector<float> af{1, 2, 2}, bf{2, 1, 2};
    CHECK(dx::score_agreement(af, bf) == doctest::Approx(8.0 / 9));
    const std::vector<double> shorter{1, 2};
    CHECK(contains(invalid_argument_message([&] { (void)dx::score_agreement(a, shorter); }),
                   "score vectors differ in size (3 vs 2)"));
}

TEST_CASE("malformed inputs are rejected with a message naming the problem") {
    const fixture f;
    auto h = f.history;
    h[1].step = 0;
    CHECK(contains(invalid_argument_message([&] { (void)dx::future_missed_mass(h, f.trace); }),
                   "snapshot steps must strictly increase"));
    h = f.history;
    h[2].tiers[2] = tier::full;  // w2 was evicted at h0 and h1
    CHECK(contains(invalid_argument_message([&] { (void)dx::future_missed_mass(h, f.trace); }),
                   "window 2 returns from eviction in snapshot 2"));
    h = f.history;
    h[1].layout.window_size = 4;
    CHECK(contains(invalid_argument_message([&] { dx::validate_history(h); }), "changes the sinks or window size"));
    h = f.history;
    h[2].tiers.pop_back();
    CHECK(contains(invalid_argument_message([&] { dx::validate_history(h); }), "fewer windows"));

    auto trace = f.trace;
    std::swap(trace[0], trace[1]);
    CHECK(contains(invalid_argument_message([&] { (void)dx::future_missed_mass(f.history, trace); }),
                   "reference steps must strictly increase"));
    std::vector<float> negative = f.probs[0];
    negative[3] = -0.1f;
    trace = f.trace;
    trace[0].probs = negative;
    CHECK(contains(invalid_argument_message([&] { (void)dx::future_missed_mass(f.history, trace); }),
                   "negative or non-finite probability"));
    // A reference step with fewer tokens than the routed windows cover.
    trace = f.trace;
    trace[3].probs = std::span(f.probs[3]).first(6);
    CHECK(contains(invalid_argument_message([&] { (void)dx::future_missed_mass(f.history, trace); }),
                   "need 9 tokens but the step has 6"));
    CHECK(contains(invalid_argument_message([&] { (void)dx::oracle_sets(f.history, trace, {.k_full = 1}); }),
                   "fewer than the 9 the routed windows cover"));
}

TEST_CASE("snapshot lookup follows the step convention") {
    const fixture f;
    // h0 step 0, h1 step 2, h2 step 4. At the end of step 3 the tiers are h1's; attention at step 2
    // still ran with h0's (h1 is chosen after step 2).
    CHECK(dx::snapshot_at(f.history, 3) == &f.history[1]);
    CHECK(dx::snapshot_at(f.history, 2) == &f.history[1]);
    CHECK(dx::snapshot_governing(f.history, 2) == &f.history[0]);
    CHECK(dx::snapshot_governing(f.history, 0) == nullptr);
    CHECK(dx::snapshot_at(std::span(f.history).subspan(1), 1) == nullptr);
}

TEST_CASE("random traces: the FMM curve equals its definition and the split sums to 1") {
    // A growing sequence (one token per step) with routing every 4 steps, random tiers that keep
    // eviction permanent, and random reference attention.
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    const dx::window_layout lay{3, 4};
    std::vector<std::vector<float>> probs;
    std::vector<dx::attention_step> trace;
    std::vector<dx::tier_snapshot> history;
    std::size_t tokens = 20;
    for (std::size_t step = 1; step <= 40; ++step, ++tokens) {
        std::vector<float> p(tokens);
        for (float& x : p) x = unit(rng) * unit(rng);
        probs.push_back(std::move(p));
        if (step % 4 == 0) {
            dx::tier_snapshot s{step, lay, history.empty() ? std::vector<tier>{} : history.back().tiers};
            s.tiers.resize((tokens - lay.sinks) / lay.window_size - 2, tier::full);  // leave a recent region
            for (tier& t : s.tiers) {
                if (t == tier::evicted) continue;
                const float u = unit(rng);
                t = u < 0.2f ? tier::evicted : (u < 0.6f ? tier::quantized : tier::full);
            }
            history.push_back(std::move(s));
        }
    }
    for (std::size_t k = 0; k < probs.size(); ++k) trace.push_back({k + 1, probs[k]});

    for (const auto missing : {dx::missing_tiers::evicted, dx::missing_tiers::evicted_and_quantized}) {
        const auto curve = dx::future_missed_mass_curve(history, trace, missing);
        REQUIRE(curve.size() == trace.size() - 1);
        for (const dx::curve_point& p : curve) {
            const auto profile = dx::future_missed_mass_profile(history, trace, p.step, missing);
            double mean = 0.0;
            for (const auto& q : profile) mean += q.value;
            mean /= static_cast<double>(profile.size());
            CHECK(p.value == doctest::Approx(mean));
        }
    }
    for (const dx::attention_step& s : trace) {
        const dx::tier_snapshot* h = dx::snapshot_governing(history, s.step);
        if (!h) continue;
        const dx::mass_split m = dx::split_attention_mass(*h, s);
        CHECK(m.full + m.quantized + m.evicted + m.sink + m.recent == doctest::Approx(1.0));
        // The evicted share is the missed mass of the governing snapshot.
        CHECK(m.evicted == doctest::Approx(dx::missed_mass(*h, s)));
    }
    // Churn and LIR stay within [0, 1].
    const auto sets = dx::window_sets_from_history(history, dx::kept_tiers::full);
    const double churn = dx::selection_churn(sets);
    CHECK(churn >= 0.0);
    CHECK(churn <= 1.0);
    const double lir = dx::global_lir(sets, 2).rate();
    CHECK(lir >= 0.0);
    CHECK(lir <= 1.0);
}

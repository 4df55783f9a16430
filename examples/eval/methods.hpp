#pragma once
// The methods the evaluation compares with the full cache. Each is a qevict::config<...>; the
// evaluation visits them with `for_each_method(visitor)`, which calls
// `visitor.template operator()<Config>(name)` once per method.
//
//   qevict   the paper's configuration, config<> (W = 8, 5 sinks, 32 recent, INT2, q = 0.70).
//            It is also the paper's ablation R3; "r3" on the command line selects it.
//
// When include/qevict/presets.hpp is available its presets follow, in its order (the presets
// qevict and r3, whose config is config<> itself, are not run twice; full_kv, the uncompressed
// cache under qevict's accounting, runs only when named, e.g. --methods full_kv --budgets all,
// since at a smaller budget it is R2). Otherwise the paper's ablations and one baseline are
// expressed directly:
//   r1       token-level routing: window<1, 5, 32>
//   r2       two tiers, Full + eviction: allocators::two_tier (q = 0)
//   r4       coarse windows: window<32, 5, 32>
//   kivi2    every window quantized to INT2, nothing evicted: allocators::quantize_all

#include <concepts>
#include <string>
#include <string_view>

#include <qevict/config.hpp>

#if __has_include(<qevict/presets.hpp>)
#include <qevict/presets.hpp>
#define QEVICT_EVAL_HAVE_PRESETS 1
#else
#define QEVICT_EVAL_HAVE_PRESETS 0
#endif

namespace qevict_eval {

using qevict_config = qevict::config<>;

// Names that select an existing method under another name.
inline std::string canonical_method(std::string_view name) {
    if (name == "full") return "full_kv";
    if (name == "r3") return "qevict";
    return std::string(name);
}

// Methods left out of the default selection (run only when named).
inline bool on_request_only(std::string_view name) { return name == "full_kv"; }

template <class Visitor>
void for_each_method(Visitor&& visit) {
    visit.template operator()<qevict_config>(std::string_view("qevict"));
#if QEVICT_EVAL_HAVE_PRESETS
    qevict::presets::for_each([&]<class Preset>(std::string_view name) {
        if constexpr (!std::same_as<typename Preset::config_type, qevict_config>) visit.template operator()<Preset>(name);
    });

#else
    visit.template operator()<qevict_config::with_window<qevict::window<1, 5, 32>>>(std::string_view("r1"));
    visit.template operator()<qevict_config::with_allocator<qevict::allocators::two_tier>>(std::string_view("r2"));
    visit.template operator()<qevict_config::with_window<qevict::window<32, 5, 32>>>(std::string_view("r4"));
    visit.template operator()<qevict_config::with_allocator<qevict::allocators::quantize_all>>(std::string_view("kivi2"));
#endif
}

}  // namespace qevict_eval

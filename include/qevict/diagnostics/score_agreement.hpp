#pragma once
// Score agreement: cosine similarity between two vectors of window scores, e.g. the scores a
// quantized tier produces against those of full precision. A value near 1 means the cheap tier
// still ranks windows the way full precision would, so routing on it is sound.
//
//   agreement(a, b) = Σ a_j b_j / (‖a‖ ‖b‖)
//
// Zero vectors have no direction, so the convention is: both zero (or both empty) → 1, the two
// "say the same thing"; exactly one zero → 0, no agreement. Sizes must match.

#include <cmath>
#include <cstddef>
#include <span>
#include <string>

#include <qevict/diagnostics/trace.hpp>

namespace qevict::diagnostics {

namespace detail {

template <class T>
double cosine(std::span<const T> a, std::span<const T> b) {
    require(a.size() == b.size(), "score_agreement",
            "score vectors differ in size (" + std::to_string(a.size()) + " vs " + std::to_string(b.size()) + ")");
    double dot = 0.0, aa = 0.0, bb = 0.0;
    for (std::size_t j = 0; j < a.size(); ++j) {
        const double x = static_cast<double>(a[j]);
        const double y = static_cast<double>(b[j]);
        require(std::isfinite(x) && std::isfinite(y), "score_agreement",
                "score " + std::to_string(j) + " is not finite");
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    if (aa == 0.0 && bb == 0.0) return 1.0;
    if (aa == 0.0 || bb == 0.0) return 0.0;
    return dot / (std::sqrt(aa) * std::sqrt(bb));
}

}  // namespace detail

[[nodiscard]] inline double score_agreement(std::span<const double> a, std::span<const double> b) {
    return detail::cosine(a, b);
}
[[nodiscard]] inline double score_agreement(std::span<const float> a, std::span<const float> b) {
    return detail::cosine(a, b);
}

}  // namespace qevict::diagnostics

// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/score_agreement.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/score_agreement.hpp>

#include <qevict/diagnostics/score_agreement.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = decltype(qevict::diagnostics::score_agreement(std::span<const double>{}, std::span<const double>{}));
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

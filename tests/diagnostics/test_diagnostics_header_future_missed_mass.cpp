// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/future_missed_mass.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/future_missed_mass.hpp>

#include <qevict/diagnostics/future_missed_mass.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = decltype(&qevict::diagnostics::future_missed_mass_curve);
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

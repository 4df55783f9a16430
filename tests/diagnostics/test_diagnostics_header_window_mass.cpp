// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/window_mass.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/window_mass.hpp>

#include <qevict/diagnostics/window_mass.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = decltype(&qevict::diagnostics::accumulate_window_mass);
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/diagnostics.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/diagnostics.hpp>

#include <qevict/diagnostics/diagnostics.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = qevict::diagnostics::revival_stats;
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

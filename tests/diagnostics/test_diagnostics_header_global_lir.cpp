// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/global_lir.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/global_lir.hpp>

#include <qevict/diagnostics/global_lir.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = qevict::diagnostics::revival_stats;
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

// Each public header compiles on its own: this translation unit includes
// <qevict/diagnostics/trace.hpp> before anything else, so a missing include in that header fails here.
#include <qevict/diagnostics/trace.hpp>

#include <qevict/diagnostics/trace.hpp>  // and #pragma once makes a second include harmless

int main() {
    // Name something the header must provide, so it is not compiled as an empty file.
    using probe = qevict::diagnostics::tier_snapshot;
    [[maybe_unused]] probe* unused = nullptr;
    return 0;
}

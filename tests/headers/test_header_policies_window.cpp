// <qevict/policies/window.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/window.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/window.hpp stands alone: qevict::window") {
  CHECK(qevict::window<8, 5, 32>::recent == 32);
}

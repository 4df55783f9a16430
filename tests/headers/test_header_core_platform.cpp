// <qevict/core/platform.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/platform.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/platform.hpp stands alone: qevict::error") {
  CHECK_THROWS_AS(qevict::detail::require(false, "x"), qevict::error);
}

// <qevict/policies/scorers.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/scorers.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/scorers.hpp stands alone: qevict::scorers::cumulative_mass") {
  CHECK(qevict::scorers::cumulative_mass::accumulate(1.0f, 2.0f) == 3.0f);
}

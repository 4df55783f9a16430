// <qevict/core/routing.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/routing.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/routing.hpp stands alone: qevict::assign_tiers") {
  qevict::routing_candidate c[1] = {{0, 1.0f, false}};
  qevict::assign_tiers(c, qevict::capacities{1, 0});
  CHECK(c[0].next == qevict::tier::full);
}

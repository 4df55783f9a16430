// <qevict/policies/allocators.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/allocators.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/allocators.hpp stands alone: qevict::allocators::three_tier") {
  CHECK(qevict::allocators::three_tier<70>::split(1000, 100, 10).full == 3);
}

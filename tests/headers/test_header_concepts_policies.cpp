// <qevict/concepts/policies.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/concepts/policies.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/concepts/policies.hpp stands alone: the policy concepts") {
  CHECK(qevict::quantizer_policy<qevict::quantizers::asymmetric<2>>);
  CHECK(qevict::allocator_policy<qevict::allocators::two_tier>);
}

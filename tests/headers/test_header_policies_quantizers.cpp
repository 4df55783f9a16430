// <qevict/policies/quantizers.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/quantizers.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/quantizers.hpp stands alone: qevict::quantizers::asymmetric") {
  CHECK(qevict::quantizers::asymmetric<2>::layout(8, 1, 128).window_bytes() == 1056);
}

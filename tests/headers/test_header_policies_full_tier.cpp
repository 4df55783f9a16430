// <qevict/policies/full_tier.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/full_tier.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

struct some_quantizer {};

TEST_CASE("qevict/policies/full_tier.hpp stands alone: full-tier policies") {
  CHECK_FALSE(qevict::full_tier::full_precision::quantized);
  CHECK(qevict::full_tier::quantized_as<some_quantizer>::quantized);
}

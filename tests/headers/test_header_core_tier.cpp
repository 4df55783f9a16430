// <qevict/core/tier.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/tier.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

TEST_CASE("qevict/core/tier.hpp stands alone: qevict::tier") {
  CHECK(std::string(qevict::to_string(qevict::tier::quantized)) == "quantized");
}

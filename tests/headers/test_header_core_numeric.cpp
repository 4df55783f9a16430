// <qevict/core/numeric.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/numeric.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/numeric.hpp stands alone: qevict::numeric") {
  CHECK(qevict::numeric::float_to_bf16(1.0f) == 0x3F80);
}

// <qevict/policies/rope.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/rope.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/rope.hpp stands alone: qevict::rope::rotary") {
  CHECK(qevict::rope::rotary::inverse_frequencies(qevict::rope_params{}, 8).size() == 4);
}

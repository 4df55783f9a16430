// <qevict/presets.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/presets.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

TEST_CASE("qevict/presets.hpp stands alone: every preset has a name") {
  int n = 0;
  qevict::presets::for_each([&]<class Preset>(std::string_view name) {
    CHECK(std::string(name) == Preset::name);
    ++n;
  });
  CHECK(n == 19);
}

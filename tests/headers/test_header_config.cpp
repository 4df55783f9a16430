// <qevict/config.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/config.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/config.hpp stands alone: qevict::paper_config") {
  CHECK(qevict::paper_config::routing_interval == 8);
  CHECK(qevict::paper_config::window_policy::size == 8);
}

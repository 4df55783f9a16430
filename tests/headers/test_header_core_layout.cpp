// <qevict/core/layout.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/layout.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/layout.hpp stands alone: qevict::make_region_plan") {
  const qevict::geometry g{.layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  CHECK(qevict::make_region_plan<qevict::paper_config>(g, qevict::budget::everything(), qevict::limits{}).token_bytes == 64);
}

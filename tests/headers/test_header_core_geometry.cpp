// <qevict/core/geometry.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/geometry.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/geometry.hpp stands alone: qevict::geometry") {
  const qevict::geometry g{.layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  CHECK(g.token_bytes() == 64);
}

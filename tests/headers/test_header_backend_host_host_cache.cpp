// <qevict/backend/host/host_cache.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/backend/host/host_cache.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/backend/host/host_cache.hpp stands alone: qevict::backend::host_cache") {
  const qevict::geometry g{.layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  qevict::backend::host_cache<qevict::paper_config> e(g, qevict::budget::everything(), qevict::limits{}, qevict::options{}, nullptr, 0);
  CHECK(e.add_sequence(0) == 0);
}

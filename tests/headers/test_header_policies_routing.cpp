// <qevict/policies/routing.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/policies/routing.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/policies/routing.hpp stands alone: routing and selection policies") {
  CHECK(qevict::routing::ranked::rerank_after_first_event);
  CHECK_FALSE(qevict::routing::frozen_after_prefill::rerank_after_first_event);
  CHECK(qevict::selection::per_kv_head::splits_heads);
}

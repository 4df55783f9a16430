// <qevict/core/report.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/report.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/report.hpp stands alone: qevict::budget_report") {
  qevict::budget_report r;
  CHECK(r.budget_total() == 0);
}

TEST_CASE("qevict::device_memory: the total is the sum of its parts") {
  const qevict::device_memory m{.arena = 1000, .tables = 24, .decode_workspace = 512};
  CHECK(m.total() == 1536);
  CHECK(qevict::device_memory{}.total() == 0);
}

// <qevict/core/report.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/core/report.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/core/report.hpp stands alone: qevict::budget_report") {
  qevict::budget_report r;
  CHECK(r.budget_total() == 0);
}

// <qevict/concepts/storage.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/concepts/storage.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/concepts/storage.hpp stands alone: qevict::kv_storage") {
  CHECK(qevict::kv_storage<qevict::storage::external>);
  CHECK(qevict::kv_storage<qevict::storage::owned>);
}

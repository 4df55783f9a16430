// <qevict/core/sequences.hpp> compiles on its own: it is the first thing this translation unit
// includes. The slots every backend keeps: the lowest free slot first, a clear error when none is
// free (and nothing changed), released slots reused.
#include <qevict/core/sequences.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

TEST_CASE("qevict/core/sequences.hpp stands alone: sequence_slots") {
  qevict::sequence_slots slots(3);
  CHECK(slots.size() == 3);
  CHECK(slots.take(100) == 0);
  CHECK(slots.take(200) == 1);
  CHECK(slots.take(300) == 2);
  CHECK(slots.first_position(1) == 200);
  try {
    slots.take(400);
    FAIL("a fourth sequence in three slots did not throw");
  } catch (const qevict::error& e) {
    CHECK(std::string(e.what()).find("all 3 sequence slots") != std::string::npos);
  }
  CHECK(slots.active(0));
  CHECK(slots.active(2));
  slots.release(1);
  CHECK_FALSE(slots.active(1));
  CHECK(slots.first_position(2) == 300);  // the failed take changed nothing
  CHECK(slots.take(500) == 1);            // the lowest free slot
  CHECK(slots.first_position(1) == 500);
  CHECK_FALSE(slots.active(-1));
  CHECK_FALSE(slots.active(3));
}

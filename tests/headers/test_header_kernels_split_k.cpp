// <qevict/kernels/split_k.hpp> compiles on its own, without CUDA: it is the first thing this
// translation unit includes.
#include <qevict/kernels/split_k.hpp>

#include <limits>
#include <random>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

using qevict::kernels::decode_chunk;

TEST_CASE("decode_chunk: the busiest CTA slot of nearly equal chunks, counted by hand") {
  // decode_chunk(batch, kv_heads, max_items, resident CTAs, workspace chunks); 396 = 132 SMs x 3
  // CTAs. A slot's length is waves x (items of a chunk + 24).
  // One 32K sequence at 20 % (2451 items, 8 KV heads): 20 chunks of 123 -> 128 items make 160 CTAs
  // (1 wave x 152); 44 of 56 make 352 CTAs (1 x 80); 52 of 48 make 416 (2 x 72 = 144).
  CHECK(decode_chunk(1, 8, 2451, 396, 1000) == 56);
  // 32 sequences of 293 items: three chunks of 98 -> 104 (768 CTAs, 2 x 128 = 256) against three
  // of up to 128 (2 x 152) or four of 80 (1024 CTAs, 3 x 104 = 312).
  CHECK(decode_chunk(32, 8, 293, 396, 1000) == 104);
  // 32 x 32K at 20 %: 5120 CTAs of 128 (13 x 152 = 1976) against 5376 of 120 (14 x 144 = 2016).
  CHECK(decode_chunk(32, 8, 2451, 396, 1000) == 128);
  // 32 lanes of 82 items: one chunk (256 CTAs, 1 x (82 + 24) = 106) against three of 32 (768 CTAs,
  // 2 x 56 = 112).
  CHECK(decode_chunk(32, 8, 82, 396, 1000) == 88);
  // One sequence of 599 items: 19 chunks of 32 (152 CTAs, one wave of 56; 16 items are not
  // considered), unless the workspace holds only 10 chunks a lane: then 10 of 60 -> 64 (80 CTAs,
  // 1 x 88).
  CHECK(decode_chunk(1, 8, 599, 396, 1000) == 32);
  CHECK(decode_chunk(1, 8, 599, 396, 10) == 64);
  // No resident CTA reported (one slot): the fewest CTAs, 256 x 152 = 38912 against 288 x 136.
  CHECK(decode_chunk(4, 8, 1000, 0, 1000) == 128);
  // A lane of 10 items is one chunk whatever its length; the shortest such is 16.
  CHECK(decode_chunk(1, 1, 10, 396, 1000) == 16);
  // No chunk fits a workspace of no chunks: the longest (the launch then reports the workspace).
  CHECK(decode_chunk(32, 8, 2451, 396, 0) == 128);
}

TEST_CASE("decode_chunk: a chunk the kernel supports, within the workspace where one fits, for any launch") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> batch_d(1, 64), heads_d(1, 32), items_d(1, 20000), slots_d(0, 1000);
  for (int i = 0; i < 20000; ++i) {
    const int batch = batch_d(rng), heads = heads_d(rng), items = items_d(rng), slots = slots_d(rng);
    // The workspace of an automatic launch (chunks of min_automatic_chunk items over a layout's
    // longest lane, which is at least this launch's), or one a user sized for fewer chunks.
    const int layout_items = items + std::uniform_int_distribution<int>(0, 5000)(rng);
    const int automatic = (layout_items + qevict::kernels::min_automatic_chunk - 1) / qevict::kernels::min_automatic_chunk;
    const bool smaller = i % 4 == 0;
    const int max_chunks = smaller ? std::uniform_int_distribution<int>(0, automatic)(rng) : automatic;
    const int c = decode_chunk(batch, heads, items, slots, max_chunks);
    CAPTURE(batch);
    CAPTURE(heads);
    CAPTURE(items);
    CAPTURE(slots);
    REQUIRE(c % 8 == 0);
    REQUIRE(c >= 8);
    REQUIRE(c <= qevict::kernels::max_items_per_chunk);
    // It fits the workspace whenever a chunk of at most 128 items can: always for the automatic
    // workspace; else the launch reports that the workspace is too small.
    const int fewest = (items + qevict::kernels::max_items_per_chunk - 1) / qevict::kernels::max_items_per_chunk;
    // The automatic workspace never narrows the choice: it is the choice without any bound.
    if (!smaller) REQUIRE(c == decode_chunk(batch, heads, items, slots, std::numeric_limits<int>::max()));
    if (fewest <= max_chunks) REQUIRE((items + c - 1) / c <= max_chunks);
    else REQUIRE(c == qevict::kernels::max_items_per_chunk);
    // Never more chunks than chunks of min_automatic_chunk items would make.
    const int most = (items + qevict::kernels::min_automatic_chunk - 1) / qevict::kernels::min_automatic_chunk;
    REQUIRE((items + c - 1) / c <= most);
  }
}

// <qevict/kernels/split_k.hpp> compiles on its own, without CUDA: it is the first thing this
// translation unit includes.
#include <qevict/kernels/split_k.hpp>

#include <limits>
#include <random>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

using qevict::kernels::decode_chunk;
using qevict::kernels::max_items_per_chunk;

TEST_CASE("max_items_per_chunk: 384 items for windows of at least 8 tokens, 128 below") {
  for (int w : {8, 16, 32}) CHECK(max_items_per_chunk(w) == 384);
  for (int w : {1, 2, 4}) CHECK(max_items_per_chunk(w) == 128);
}

TEST_CASE("decode_chunk: the longest chunks in a busy grid, else the busiest CTA slot of nearly equal chunks, counted by hand") {
  // decode_chunk(batch, kv_heads, max_items, resident CTAs, workspace chunks, longest chunk); 396 =
  // 132 SMs x 3 CTAs, chunks of up to 192 items (windows of 8 tokens). A slot's length is waves x
  // (items of a chunk + 24), plus 32 where a lane has more than one chunk.
  constexpr int longest = 192;
  // One 32K sequence at 20 % (2451 items, 8 KV heads): 44 chunks of 56 make 352 CTAs (1 wave x 80
  // + 32 = 112); 39 of 64 make 312 (1 x 88 + 32 = 120); 13 of 192 make 104 (1 x 216 + 32).
  CHECK(decode_chunk(1, 8, 2451, 396, 1000, longest) == 56);
  // 32 sequences of 293 items: three chunks of 98 -> 104 (768 CTAs, 2 x 128 + 32 = 288) against
  // two of 152 (512 CTAs, 2 x 176 + 32 = 384) or four of 80 (1024 CTAs, 3 x 104 + 32 = 344).
  CHECK(decode_chunk(32, 8, 293, 396, 1000, longest) == 104);
  // 32 x 32K at 20 %: 13 chunks of 192 make 3328 CTAs, 8.4 waves, at least busy_grid_waves (4):
  // the longest is taken, although counting whole waves would put 3840 CTAs of 168 (10 x 192 + 32
  // = 1952) before it (9 x 216 + 32 = 1976). With chunks of at most 128 items, 20 of 128 (5120
  // CTAs). With 8 lanes, 104 CTAs of 192 are not a busy grid: the slot count decides (56 above).
  CHECK(decode_chunk(32, 8, 2451, 396, 1000, longest) == 192);
  CHECK(decode_chunk(32, 8, 2451, 396, 1000, 128) == 128);
  // With chunks of up to 384 items (max_items_per_chunk for windows of 8 tokens): 7 chunks of 351
  // -> 352 make 1792 CTAs, 4.5 waves: taken outright.
  CHECK(decode_chunk(32, 8, 2451, 396, 1000, max_items_per_chunk(8)) == 352);
  // Just below 4 waves the slot count decides: 32 x 8K all Full (1029 items) makes 6 chunks of 176,
  // 1536 CTAs (3.9 waves), and 176 wins on whole waves too (4 x 200 + 32 = 832 against 5 x 176
  // + 32 = 912 for 7 chunks of 152); 32 x 32K at 10 % (1230 items), 7 chunks of 176 (4.5 waves):
  // taken outright.
  CHECK(decode_chunk(32, 8, 1029, 396, 1000, longest) == 176);
  CHECK(decode_chunk(32, 8, 1230, 396, 1000, longest) == 176);
  // 32 lanes of 82 items: one chunk (256 CTAs, 1 x (82 + 24) = 106) against three of 32 (768 CTAs,
  // 2 x 56 + 32 = 144).
  CHECK(decode_chunk(32, 8, 82, 396, 1000, longest) == 88);
  // 32 lanes of 161 items (1280 tokens, all Full): one chunk of 168 (256 CTAs, 1 x 185) against
  // three of 56 (768 CTAs, 2 x 80 + 32 = 192); at 16 lanes three chunks of 56 are one wave
  // (384 CTAs, 80 + 32 = 112) and win.
  CHECK(decode_chunk(32, 8, 161, 396, 1000, longest) == 168);
  CHECK(decode_chunk(16, 8, 161, 396, 1000, longest) == 56);
  // One sequence of 599 items: 19 chunks of 32 (152 CTAs, one wave of 56 + 32; 16 items are not
  // considered), unless the workspace holds only 10 chunks a lane: then 10 of 60 -> 64 (80 CTAs,
  // 1 x 88 + 32).
  CHECK(decode_chunk(1, 8, 599, 396, 1000, longest) == 32);
  CHECK(decode_chunk(1, 8, 599, 396, 10, longest) == 64);
  // No resident CTA reported (one slot): the fewest CTAs, 192 x 192 = 36864 (+ 32) against 224 x 168.
  CHECK(decode_chunk(4, 8, 1000, 0, 1000, longest) == 168);
  // A lane of 10 items is one chunk whatever its length; the shortest such is 16.
  CHECK(decode_chunk(1, 1, 10, 396, 1000, longest) == 16);
  // No chunk fits a workspace of no chunks: the longest (the launch then reports the workspace).
  CHECK(decode_chunk(32, 8, 2451, 396, 0, longest) == 192);
  CHECK(decode_chunk(32, 8, 2451, 396, 0, 128) == 128);
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
    const int longest = max_items_per_chunk(i % 3 == 0 ? 4 : 8);
    const int c = decode_chunk(batch, heads, items, slots, max_chunks, longest);
    CAPTURE(batch);
    CAPTURE(heads);
    CAPTURE(items);
    CAPTURE(slots);
    REQUIRE(c % 8 == 0);
    REQUIRE(c >= 8);
    CAPTURE(longest);
    REQUIRE(c <= longest);
    // It fits the workspace whenever a chunk of at most `longest` items can: always for the
    // automatic workspace; else the launch reports that the workspace is too small.
    const int fewest = (items + longest - 1) / longest;
    // The automatic workspace never narrows the choice: it is the choice without any bound.
    if (!smaller) REQUIRE(c == decode_chunk(batch, heads, items, slots, std::numeric_limits<int>::max(), longest));
    if (fewest <= max_chunks) REQUIRE((items + c - 1) / c <= max_chunks);
    else REQUIRE(c == longest);
    // Never more chunks than chunks of min_automatic_chunk items would make.
    const int most = (items + qevict::kernels::min_automatic_chunk - 1) / qevict::kernels::min_automatic_chunk;
    REQUIRE((items + c - 1) / c <= most);
  }
}

#pragma once
// How the decode kernel splits each (sequence, KV head)'s items into chunks (split-K), answerable
// by any C++ compiler (no CUDA needed): the chunk lengths the kernel supports, and the one an
// automatic launch (decode_arguments::items_per_chunk = 0) takes.
//
//   const int chunk = qevict::kernels::decode_chunk(batch, kv_heads, max_items, resident_ctas, max_chunks,
//                                                   qevict::kernels::max_items_per_chunk(window));
//
// An item is 8 tokens (kernels/decode/items.cuh); a CTA serves one chunk of one
// (sequence, KV head), and the last CTA of a (sequence, KV head) to finish merges its chunks.

#include <algorithm>
#include <limits>

namespace qevict::kernels {

/// The longest split-K chunk the decode kernel supports for windows of `window` tokens. Its 128
/// threads describe a chunk's items (one per thread and round) into shared memory, 16 bytes an
/// item, where the descriptions stay while the CTA runs: 384 items (6 KiB) fit beside three CTAs
/// per SM. With W < 8 an item also keeps the offsets of the 8/W windows it gathers (32 bytes), and
/// chunks stay at 128 items. Chunks are multiples of 8 items (a warp takes two items at a time, a
/// CTA has four warps).
inline constexpr int max_items_per_chunk(int window) { return window >= 8 ? 384 : 128; }
/// The shortest chunk an automatic launch considers (a lane shorter than that is one chunk), and
/// the chunk length its workspace is sized for over the layout's longest lane
/// (decode_workspace::chunks_for), so that every automatic choice fits. In the chunk sweeps of
/// docs/performance-history.md (v18, v19), chunks of 16 or 24 items were the fastest only at one sequence of 32K
/// tokens at a 5 % budget, and where a lane is one chunk either way.
inline constexpr int min_automatic_chunk = 32;
/// A CTA's fixed cost in items' worth of work (describing its items, the first pair's latency,
/// merging its warps, writing its partial), fitted to the H200 chunk sweeps of docs/performance-history.md (v18, v19).
inline constexpr int chunk_fixed_cost = 24;
/// What a launch of several chunks per (sequence, KV head) costs beyond one of a single chunk, in
/// the same units: the query kernel that runs before its attention kernel and the merge of its
/// partials (a single chunk prepares its own query and merges itself). Set by the H200 at 32
/// sequences of 161 items (all Full) and of 139 (5 %), where one chunk a lane measured 9 % and
/// 7 to 19 % faster than three (docs/performance-history.md, v22): any value of at least 25 chooses one chunk
/// there, and the same chunks at every point of the benchmark table.
inline constexpr int several_chunks_cost = 32;
/// From how many waves of the longest chunks (their CTAs over the resident ones) an automatic
/// launch takes them without weighing shorter ones. Counting whole waves charges the last one in
/// full, as if the CTAs ran in lockstep; a grid of many waves does not, and a CTA that leaves an SM
/// early speeds up the ones still there (the kernel waits on its instructions). Set by the H200 at
/// 32 sequences of 32K tokens (8.4 waves of 192 items at a 20 % budget), where the step got faster
/// with every longer chunk up to the longest, in every key frame (docs/performance-history.md, "One point at f22cc2b");
/// with chunks of up to 384 items the rule takes 352 there (4.5 waves), measured 2.3 % faster than
/// 192 (docs/performance-history.md, "One point at 9d313a6").
inline constexpr int busy_grid_waves = 4;

/// The split-K chunk of an automatic launch for `batch` sequences of at most `max_items` items per
/// (sequence, KV head), on a GPU that holds `resident_ctas` decode CTAs at once, with a workspace
/// for at most `max_chunks` chunks per (sequence, KV head), and chunks of at most `longest` items
/// (max_items_per_chunk of the cache's window).
///
/// Each candidate splits a lane of max_items items into k nearly equal chunks, rounded up to a
/// multiple of 8: ceil(max_items / k) for k = 1, 2, ..., ceil(max_items / min_automatic_chunk), at
/// most `longest`. Equal chunks matter: with a fixed 128, a lane of 293 items ends in a chunk of 37
/// while the others run 128; three chunks of 104 take the same CTAs and end sooner. A
/// candidate's cost is its busiest CTA slot: waves = ceil(CTAs / resident_ctas), each as long as
/// one chunk plus the fixed cost, plus several_chunks_cost where a lane has more than one chunk.
/// The cheapest wins; on a tie, the longer chunk (fewer CTAs, fewer partials to merge). Where the
/// longest candidate fills at least busy_grid_waves waves (and fits the workspace), it is taken
/// outright. Where no candidate fits the workspace, `longest` (the launch then reports that the
/// workspace is too small).
inline int decode_chunk(int batch, int kv_heads, int max_items, int resident_ctas, int max_chunks, int longest) {
  const long long slots = std::max(1, resident_ctas);
  const long long lanes = static_cast<long long>(std::max(1, batch)) * std::max(1, kv_heads);
  const int items = std::max(1, max_items);
  // Chunks of at most c items, evened out: k = ceil(items / c) chunks of ceil(items / k) items,
  // rounded up to a multiple of 8 (at most c, for c a multiple of 8).
  const auto evened = [items](int c) {
    const int k = (items + c - 1) / c;
    return ((items + k - 1) / k + 7) / 8 * 8;
  };
  int best = longest;
  long long best_cost = std::numeric_limits<long long>::max();
  // Chunks of at most c items, evened, for every multiple of 8 from the longest: every k whose even
  // chunk is in range is reached this way, and the even chunks come out longest first.
  const int first = longest / 8 * 8;
  for (int c = first; c >= min_automatic_chunk; c -= 8) {
    const int chunk = evened(c);
    const long long chunks = (items + chunk - 1) / chunk;
    if (chunks > max_chunks) continue;
    // The longest candidate in a busy grid is taken outright.
    if (c == first && lanes * chunks >= busy_grid_waves * slots) return chunk;
    const long long waves = (lanes * chunks + slots - 1) / slots;
    const long long cost = waves * (std::min(chunk, items) + chunk_fixed_cost) + (chunks > 1 ? several_chunks_cost : 0);
    if (cost < best_cost) {
      best = chunk;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace qevict::kernels

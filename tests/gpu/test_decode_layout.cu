// The decode kernel's view of the byte plan (kernels::decode_layout), for every window size,
// code width and head_dim the CUDA backend supports. These are the invariants its 16-byte copies
// and its shared-memory slots rely on, which the launcher would otherwise only find on a GPU:
//   - every section of a region, every Full slot and ledger record, and every 16-byte piece of a
//     record part that copy_item stages, is 16-byte aligned (4-byte pieces of records shorter
//     than 8 tokens: 4-byte aligned);
//   - an item's staged record (8 tokens) fits its shared-memory slot, in front of the per-window
//     key data the kernel writes behind it;
//   - the staged offsets are those of an 8-token record, and the window offsets those of the
//     window's record, for the ledger's records and a quantized top tier's;
//   - a lane's items are counted the same way for the workspace (max_items) and at run time, and
//     a window list has room for any split of its windows between Full slots and records;
//   - each KV head maps to its routing unit and its place in the unit's slots and records;
//   - with a budget per layer, each layer's regions lie where the host backend puts them.
// No kernel is launched: this program runs on machines without a GPU too.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>

#include "qevict/backend/cuda/supports.hpp"
#include "qevict/cache.hpp"
#include "qevict/kernels/decode_attention.cuh"
#include "qevict/presets.hpp"

namespace {

using namespace qevict;

template <class Config>
void check_layouts(int head_dim, const budget& b) {
  CAPTURE(head_dim);
  static_assert(backend::cuda_supports<Config>);
  geometry g;
  g.layers = 1;
  g.q_heads = 16;
  g.kv_heads = 4;
  g.head_dim = head_dim;
  g.element = element_type::bf16;
  const limits lim{.max_batch = 2, .max_tokens = 4096};
  const region_plan p = make_region_plan<Config>(g, b, lim);
  const kernels::decode_layout L = kernels::decode_layout::for_config<Config>(p, rope_layout::rotate_half);
  const int W = Config::window_policy::size;
  CAPTURE(W);

  // Sections and slots.
  CHECK((L.region_bytes | L.sink_offset | L.recent_offset | L.full_offset | L.ledger_offset) % 16 == 0);
  CHECK(L.full_window_bytes % 16 == 0);
  // Each record format (the ledger's, and a quantized top tier's): the staged record is an 8-token
  // record, the window offsets are the window's record's.
  const int cs_offset = head_dim == 128 ? kernels::detail::window_cs_offset<128> : kernels::detail::window_cs_offset<64>;
  const auto check_format = [&]<class Q>(const kernels::record_format& f) {
    CAPTURE(Q::bits);
    const quantizers::record_layout staged = Q::layout(8, 1, head_dim);
    const quantizers::record_layout window = Q::layout(W, 1, head_dim);
    CHECK(f.bits == Q::bits);
    CHECK(f.head_bytes == window.head_bytes());
    CHECK(f.staged_key_scale == staged.key_scale_offset());
    CHECK(f.staged_key_zero == staged.key_zero_offset());
    CHECK(f.staged_value_codes == staged.value_codes_offset());
    CHECK(f.staged_value_scale == staged.value_scale_offset());
    CHECK(f.staged_value_zero == staged.value_zero_offset());
    CHECK(f.staged_bytes == staged.head_bytes());
    CHECK(f.key_scale == window.key_scale_offset());
    CHECK(f.value_codes == window.value_codes_offset());
    CHECK(f.value_scale == window.value_scale_offset());
    CHECK(f.value_zero == window.value_zero_offset());
    // Records of W >= 8 tokens: each KV head's record is 16-byte aligned, and copy_item's pieces
    // of part k (key codes, key scales and zeros, value codes, value scales, value zeros) are whole
    // 16-byte pieces at 16-byte aligned offsets. Records of W < 8 tokens are copied in 4-byte
    // pieces (the value scales and zeros 2 bytes at a time): each piece is 4-byte aligned.
    if (W < 8) {
      CHECK(f.head_bytes % 4 == 0);
      CHECK(static_cast<std::size_t>(W) * head_dim * Q::bits / 8 % 4 == 0);
      CHECK(f.key_scale % 4 == 0);
      CHECK(f.value_codes % 4 == 0);
      CHECK(f.staged_key_scale % 4 == 0);
      CHECK(f.staged_value_codes % 4 == 0);
      CHECK(f.value_zero == f.value_scale + 2 * static_cast<std::size_t>(W));
    } else {
      CHECK(f.head_bytes % 16 == 0);
      const std::size_t part_codes = 8 * static_cast<std::size_t>(head_dim) * Q::bits / 8;
      CHECK(part_codes % 16 == 0);
      for (int k = 0; k < W / 8; ++k) {
        CHECK((k * part_codes) % 16 == 0);
        CHECK((f.value_codes + k * part_codes) % 16 == 0);
        CHECK((f.value_scale + 16 * k) % 16 == 0);
        CHECK((f.value_zero + 16 * k) % 16 == 0);
      }
      CHECK(f.key_scale % 16 == 0);
      CHECK(2 * staged.head_dim * staged.meta_bytes % 16 == 0);  // scales and zeros together
    }
    // record_value_fragments reads a staged item's value codes with transposing 8x8 matrix loads:
    // every token row's 16-byte pieces start on 16-byte boundaries, and a piece holds 128/bits
    // channels of which head_dim has a whole number.
    CHECK(f.staged_value_codes % 16 == 0);
    CHECK(static_cast<std::size_t>(head_dim) * Q::bits / 8 % 16 == 0);
    CHECK(head_dim % staged.value_piece_channels() == 0);
    // The staged record fits in front of the per-window key data written behind it.
    CHECK(f.staged_bytes <= static_cast<std::size_t>(cs_offset));
  };
  check_format.template operator()<typename Config::quantizer>(L.ledger_format);
  using full_tier = typename Config::full_tier_policy;
  if constexpr (full_tier::quantized) {
    check_format.template operator()<typename full_tier::quantizer>(L.full_format);
    CHECK(L.full_window_bytes == p.full_record.window_bytes());
  } else {
    CHECK(L.full_format.bits == 0);
    CHECK(L.full_window_bytes == static_cast<std::size_t>(W) * L.heads_per_unit * 2 * head_dim * 2);
  }
  // Items: the workspace's bound is the run-time count at the fullest state.
  CHECK(L.max_items == L.items_for(L.entries_per_lane, p.recent_capacity));
  CHECK(L.listed_items(L.entries_per_lane) == (W >= 8 ? L.entries_per_lane * (W / 8) : (L.entries_per_lane + 8 / W - 1) / (8 / W)));
  CHECK(L.items_for(0, 0) == (p.sinks > 0 ? 1 : 0));
  // A list holds any split of its windows between the tiers: with W < 8 and records, the Full
  // windows padded to whole items and one item per record (decode_layout::record_entries).
  const int S = W >= 8 ? 1 : 8 / W;
  CHECK(L.record_entries == (W < 8 && p.caps.quantized > 0 ? S : 1));
  const int n_full = static_cast<int>(std::min<std::size_t>(p.caps.full, p.max_windows));
  const int n_records = static_cast<int>(std::min<std::size_t>(p.caps.quantized, p.max_windows - n_full));
  const int needed = L.record_entries == 1 ? n_full + n_records : (n_full + S - 1) / S * S + S * n_records;
  CHECK(needed <= L.entries_per_lane);
  CHECK(L.listed_items(needed) == (L.record_entries == 1 ? L.listed_items(n_full + n_records) : (n_full + S - 1) / S + n_records));
  CHECK(L.listed_items(L.max_entries_for(n_full + n_records)) >= L.listed_items(needed));
  // Workspace: partial outputs for every chunk of the shortest automatic chunk (32 items) or of a
  // fixed one; window masses per item (8/W windows an item for W < 8), whatever the chunk.
  for (int ipc : {0, 8, 64, 128}) {
    CAPTURE(ipc);
    const int chunk = ipc == 0 ? 32 : ipc;
    const std::size_t chunks = static_cast<std::size_t>((L.max_items + chunk - 1) / chunk), bh = 3 * static_cast<std::size_t>(g.kv_heads);
    const int group = g.q_heads / g.kv_heads;
    const auto ws = kernels::decode_workspace::sizes(L, 3, ipc);
    CHECK(kernels::decode_workspace::chunks_for(L, ipc) == static_cast<int>(chunks));
    CHECK(ws.o == bh * chunks * group * head_dim * sizeof(float));
    CHECK(ws.ml == bh * chunks * group * 2 * sizeof(float));
    CHECK(ws.mass == bh * L.max_items * S * group * sizeof(float));
    // A log-sum-exp per query head, whatever the chunks; a ticket per (sequence, KV head); the mass
    // kernel's count of finished CTAs and two mass signals per sequence.
    CHECK(ws.lse == bh * group * sizeof(float));
    CHECK(ws.tickets == bh * sizeof(unsigned));
    CHECK(ws.signals == (1 + 3 * 2) * sizeof(unsigned));
    // Query fragments: per (sequence, KV head), 2 * head_dim / 16 loads of 16 bytes for each of 32
    // lanes; with keys rotated one by one, e^{i j f_p} (j < 8, D/2 frequencies) per (sequence, KV head).
    CHECK(ws.q == bh * 32 * (2 * head_dim / 16) * 16);
    CHECK(ws.table == (L.records == kernels::record_rotation::each_key ? bh * 8 * (head_dim / 2) * 8 : 0));
  }
  // Routing units: the whole layer, or one KV head each.
  CHECK(L.units == p.units);
  CHECK(L.units * L.heads_per_unit == g.kv_heads);
  for (int h = 0; h < g.kv_heads; ++h) {
    CHECK(L.unit_of(h) * L.heads_per_unit + L.head_in_unit(h) == h);
    CHECK(L.unit_of(h) < L.units);
    CHECK(L.head_in_unit(h) < L.heads_per_unit);
  }
}

}  // namespace

TEST_CASE("decode_layout: alignment, staged records and item counts for every window size and code width") {
  using namespace quantizers;
  for (const int d : {64, 128}) {
    check_layouts<config<>>(d, budget::fraction(0.2));
    check_layouts<config<>::with_quantizer<asymmetric<4>>>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<16, 5, 32>>>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<16, 5, 32>>::with_quantizer<asymmetric<4, meta::bf16, key_frame::after_rope>>>(
        d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<32, 5, 32>>>(d, budget::fraction(0.2));
    check_layouts<presets::kivi2::config_type>(d, budget::everything());
    check_layouts<presets::kivi4::config_type>(d, budget::everything());
    check_layouts<presets::kvquant_like::config_type>(d, budget::everything());
    check_layouts<presets::h2o::config_type>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<2, 8, 32>>::with_allocator<allocators::two_tier>>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<4, 3, 32>>::with_allocator<allocators::two_tier>>(d, budget::fraction(0.2));
    // Records of windows shorter than 8 tokens: r1 (W = 1), and three tiers at W = 2 and 4.
    check_layouts<presets::r1::config_type>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<2, 8, 32>>>(d, budget::fraction(0.2));
    check_layouts<presets::r1::config_type::with_selection<selection::per_kv_head>>(d, budget::fraction(0.2));  // tail padding
    check_layouts<config<>::with_window<window<4, 3, 32>>::with_selection<selection::per_kv_head>>(d, budget::fraction(0.2));
    check_layouts<presets::adakv::config_type>(d, budget::fraction(0.2));
    check_layouts<presets::criticalkv::config_type>(d, budget::fraction(0.2));
    check_layouts<config<>::with_selection<selection::per_kv_head>>(d, budget::fraction(0.2));
    check_layouts<presets::zipcache_like::config_type>(d, budget::fraction(0.3));
    check_layouts<config<>::with_full_tier<full_tier::quantized_as<asymmetric<4>>>>(d, budget::fraction(0.2));
    check_layouts<config<>::with_window<window<16, 5, 32>>::with_quantizer<asymmetric<2, meta::bf16, key_frame::after_rope>>::
                      with_full_tier<full_tier::quantized_as<asymmetric<4, meta::bf16, key_frame::after_rope>>>>(d, budget::fraction(0.2));
  }
}

TEST_CASE("decode_layout: regions of a cache with a budget per layer, in the host backend's order") {
  using cfg = presets::layer_defensivekv::config_type;
  geometry g;
  g.layers = 3;
  g.q_heads = 8;
  g.kv_heads = 2;
  g.head_dim = 64;
  g.element = element_type::bf16;
  const budget b = budget::fraction(0.5).with_layer_shares({1.0, 2.0, 4.0});
  const limits lim{.max_batch = 3, .max_tokens = 1024};
  std::size_t stride = 0, offsets[3];
  for (int l = 0; l < 3; ++l) {
    offsets[l] = stride;
    stride += make_region_plan<cfg>(g, b, lim, l).region_bytes;
  }
  CHECK(stride == cache<cfg>::required_bytes(g, b, lim) / lim.max_batch);
  for (int l = 0; l < 3; ++l) {
    kernels::decode_layout L = kernels::decode_layout::for_config<cfg>(make_region_plan<cfg>(g, b, lim, l), rope_layout::rotate_half);
    L.layers = 3;
    L.sequence_stride = stride;
    L.layer_offset = offsets[l];
    for (int s = 0; s < lim.max_batch; ++s) CHECK(L.region_offset(s * 3 + l) == s * stride + offsets[l]);
  }
  // The layers' regions differ in size (otherwise this would not test much).
  CHECK(offsets[1] - offsets[0] < offsets[2] - offsets[1]);
}

// qevict::cache<Config, backend::cuda> against the host backend (the oracle) for the paper's
// configuration, the two-tier allocator and the two other key frames of the records: outputs, scores, routing tables
// after every event and the arenas must agree (backend_comparison.cuh says how closely). The decide kernel's sort of up
// to 1024 candidates is checked alone against a stable sort, on scores that tie. A NaN on the device is reported by the
// next check() and leaves the cache as it was; inputs at their limits still match the host. Decode steps captured in
// CUDA graphs give what the same calls give when made directly.
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend_comparison.cuh"

namespace {

using namespace qevict;
using gpu_test::case_spec;
using gpu_test::device_buffer;
using gpu_test::input_extremes;
using gpu_test::quick;
using gpu_test::rel_error;
using gpu_test::run_case;
using gpu_test::twin;
using paper = qevict::config<>;
using two_tier = qevict::config<>::with_allocator<allocators::two_tier>;
using post_rope = presets::qevict_post_rope::config_type;
using window_relative = presets::qevict_window_relative::config_type;

/// One layer, 2 KV heads of 64 channels, GQA 4, bf16: small enough for single-purpose cases.
geometry small_layer() { return geometry{.layers = 1, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .element = element_type::bf16}; }

/// The decide kernel's sort of at most one candidate a thread, alone: thread t brings score[t] and
/// entry[t] for t < n (packed in entry order, as the kernel packs them) and the kernel's padding
/// behind them; out[t] is the entry of rank t, out_keys[t] its key.
__global__ void sort_candidates_kernel(const float* score, const int* entry, int n, int* out, std::uint32_t* out_keys) {
  __shared__ unsigned long long buffer[2 * kernels::detail::route_threads];
  const int t = static_cast<int>(threadIdx.x);
  std::uint32_t key = t < n ? kernels::detail::descending_score_key(score[t]) : kernels::detail::not_a_candidate;
  int e = t < n ? entry[t] : 0;
  kernels::detail::bitonic_sort_block(key, e, buffer);
  out[t] = e;
  out_keys[t] = key;
}

}  // namespace

TEST_CASE("CUDA backend matches the host backend") {
  const budget all = budget::everything(), b20 = budget::fraction(0.20), b5 = budget::fraction(0.05);
  const element_type bf = element_type::bf16, f16 = element_type::f16;
  std::vector<case_spec> cases = {
      {64, 1, 1, bf, all, 900},
      {64, 4, 7, f16, b20, 600, 256, 1, rope_layout::rotate_half, true},
      {64, 8, 32, bf, b5, 300, 256, 1, rope_layout::rotate_half, true},
      {128, 1, 7, bf, b5, 900, 256, 1, rope_layout::rotate_half, true},
      {128, 4, 32, f16, all, 100},
      {128, 8, 1, bf, b20, 1500},
      {128, 4, 7, bf, b20, 700, 256, 2, rope_layout::interleaved, true},
      {128, 8, 7, f16, b5, 500, 256, 1, rope_layout::rotate_half, true},
      {64, 1, 32, f16, b20, 200},
  };
  if (quick()) cases = {{64, 4, 7, bf, b5, 300, 40, 2, rope_layout::rotate_half, true}, {128, 8, 3, f16, b20, 300, 24}};
  unsigned seed = 11;
  for (const case_spec& c : cases) {
    CAPTURE(c.head_dim);
    CAPTURE(c.group);
    CAPTURE(c.batch);
    run_case<paper>(c, seed++);
  }
}

TEST_CASE("CUDA backend: routing events over thousands of windows (tables of 4 and 16 entries a decide-kernel thread)") {
  // Up to 1024 table entries the decide kernel reads one per thread; these tables need 4 (12000
  // tokens: 1500 windows) and 16 (40000 tokens: 5000 windows) per thread, and the prompts fill
  // hundreds to over a thousand windows, so the candidates packed for the sort come from many
  // threads, several to a thread, and the window lists' prefix counts cross threads and warps.
  // The prefill's event ranks each backend's own observation scores, which agree only to float
  // rounding: thousands of windows have near-ties that rounding orders either way (two of 3022
  // windows did: 0.0063813780 above 0.0063813427 on the host, 0.0063813925 above 0.0063813860 on
  // the device), which swaps their slots. These prompts are long enough to fill the tables and
  // short enough to have none; every decode event is then compared on identical scores
  // (sync_scores).
  const element_type bf = element_type::bf16;
  const int steps = quick() ? 16 : 64;
  const std::vector<case_spec> cases = {
      {64, 4, 3, bf, budget::fraction(0.20), 11000, steps, 1, rope_layout::rotate_half, false, 0, 12000},
      {64, 2, 3, bf, budget::fraction(0.05), 6000, steps, 1, rope_layout::rotate_half, false, 0, 40000},
  };
  unsigned seed = 301;
  for (const case_spec& c : cases) {
    CAPTURE(c.max_tokens);
    run_case<paper>(c, seed++);
  }
}

TEST_CASE("CUDA backend: the decide kernel's sort of up to 1024 candidates ranks equal scores by table entry") {
  // Scores drawn from a handful of values (+0 and -0 among them, which rank as equal) tie
  // everywhere; the order must be the host's ranks_before: score descending, then entry ascending,
  // i.e. a stable sort of the candidates in entry order. Counts around warp and power-of-two edges.
  std::mt19937 rng(404);
  const std::vector<float> values = {0.0f, -0.0f, 0.25f, 1.0f, 3.5f, 1e-30f, -2.0f};
  for (const int n : {0, 1, 2, 31, 32, 33, 540, 1000, 1023, 1024}) {
    CAPTURE(n);
    for (int round = 0; round < 4; ++round) {
      std::vector<float> score(std::max(n, 1));
      std::vector<int> entry(std::max(n, 1));
      int at = 0;
      for (int i = 0; i < n; ++i) {
        // Rounds 0-1 tie everywhere; rounds 2-3 mix ties with distinct random scores.
        score[i] = round < 2 || rng() % 2 ? values[rng() % values.size()] : std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
        at += 1 + static_cast<int>(rng() % 5);  // increasing entries with gaps, as packed
        entry[i] = at;
      }
      std::vector<int> expected(n);
      for (int i = 0; i < n; ++i) expected[i] = i;
      std::stable_sort(expected.begin(), expected.end(), [&](int a, int b) { return score[a] > score[b]; });
      device_buffer<float> ds(score);
      device_buffer<int> de(entry), dout(kernels::detail::route_threads);
      device_buffer<std::uint32_t> dkeys(kernels::detail::route_threads);
      sort_candidates_kernel<<<1, kernels::detail::route_threads>>>(ds.ptr, de.ptr, n, dout.ptr, dkeys.ptr);
      QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<int> got = dout.download();
      const std::vector<std::uint32_t> keys = dkeys.download();
      int wrong = 0;
      for (int r = 0; r < n; ++r) wrong += got[r] != entry[expected[r]];
      CHECK(wrong == 0);
      int misplaced_padding = 0;
      for (int r = n; r < kernels::detail::route_threads; ++r) misplaced_padding += keys[r] != kernels::detail::not_a_candidate;
      CHECK(misplaced_padding == 0);
    }
  }
}

TEST_CASE("CUDA backend: two-tier allocator") {
  run_case<two_tier>(case_spec{128, 4, 7, element_type::bf16, budget::fraction(0.05), 500, quick() ? 24 : 256, 1,
                               rope_layout::rotate_half, true},
                     77);
}

namespace {
/// The same three runs for a config whose records keep their keys in another key frame; the quick
/// set takes one case, with `quick_layout`.
template <class Config>
void run_key_frame_cases(unsigned seed, rope_layout quick_layout) {
  const element_type bf = element_type::bf16, f16 = element_type::f16;
  std::vector<case_spec> cases = {
      {128, 4, 7, bf, budget::fraction(0.20), 700, 256, 1, rope_layout::rotate_half, true},
      {64, 8, 32, f16, budget::fraction(0.05), 300, 256, 1, rope_layout::rotate_half, true},
      {128, 1, 7, bf, budget::fraction(0.05), 900, 256, 2, rope_layout::interleaved, true},
  };
  if (quick()) cases = {{64, 4, 7, bf, budget::fraction(0.05), 300, 40, 2, quick_layout, true}};
  for (const case_spec& c : cases) {
    CAPTURE(c.head_dim);
    CAPTURE(c.group);
    CAPTURE(c.batch);
    run_case<Config>(c, seed++);
  }
}
}  // namespace

TEST_CASE("CUDA backend: records with keys quantized after RoPE") { run_key_frame_cases<post_rope>(91, rope_layout::rotate_half); }

TEST_CASE("CUDA backend: records with window-relative keys") { run_key_frame_cases<window_relative>(191, rope_layout::interleaved); }

TEST_CASE("CUDA backend: inputs at their limits, in every key frame of the records") {
  // numeric::largest_magnitude keeps every fp16 operand of the decode kernel in range (the fp16
  // keys and queries of an f16 cache, and the fp16 path of INT2 keys stored after RoPE or
  // window-relative in every element type): at the limits the CUDA backend still matches the host.
  const element_type bf = element_type::bf16, f16 = element_type::f16;
  unsigned seed = 401;
  for (const input_extremes x : {input_extremes{.keys_values = true}, input_extremes{.queries = true}}) {
    std::vector<case_spec> cases = {
        {128, 4, 7, bf, budget::fraction(0.20), 500, 128, 1, rope_layout::rotate_half, false, 0, 2048, x},
        {64, 8, 7, f16, budget::fraction(0.05), 300, 128, 1, rope_layout::interleaved, false, 0, 2048, x},
    };
    if (quick())
      cases = {{64, 4, 3, f16, budget::fraction(0.10), 200, 24, 1, rope_layout::rotate_half, false, 0, 2048, x}};
    for (const case_spec& c : cases) {
      CAPTURE(x.keys_values);
      CAPTURE(c.head_dim);
      run_case<paper>(c, seed++);
      run_case<post_rope>(c, seed++);
      run_case<window_relative>(c, seed++);
    }
  }
}

/// scan_input on one block, the form the attend prologue and the append kernel use.
__global__ void scan_on_one_block(const float* x, std::size_t n, float limit, kernels::device_error* e) {
  kernels::detail::scan_input(x, n, limit, e, 2, 0);
}

TEST_CASE("CUDA backend: the input scan finds one NaN, infinity or value beyond its limit wherever it is, aligned or not") {
  // Every element of x is within the limit but one; the scan must record that one (its kind, value
  // and index), in both forms (one block, a grid), whether x is 16-byte aligned (loads of 4
  // elements, and the elements past the last whole piece) or not (loads of one element), for
  // lengths around the loads in flight, and record nothing where every element is within it (the
  // limit itself included).
  constexpr float limit = 100.0f;
  const std::vector<std::size_t> lengths = {1, 3, 4, 5, 31, 4096, 4099, 33 * 1024 + 7, 131072};
  device_buffer<float> x(131072 + 4);
  device_buffer<kernels::device_error> e(1);
  int cases = 0;
  for (std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{2}})
    for (std::size_t n : lengths)
      for (int form = 0; form < 2; ++form) {
        std::vector<std::size_t> where = {n, 0, n - 1, n / 2, n / 3 + 1};  // n: none
        if (n > 4) where.push_back(n / 4 * 4);                              // the first element past the whole pieces
        for (std::size_t bad : where)
          for (float value : {NAN, INFINITY, -INFINITY, 100.5f, -1e30f}) {
            if (bad == n && !(value != value)) continue;  // the all-good case once (with the NaN)
            std::vector<float> host(offset + n, 1.5f);
            host[offset + (bad + 1) % n] = -limit;  // at the limit: accepted
            if (bad < n) host[offset + bad] = value;
            x.upload(host);
            QEVICT_CUDA_CHECK(cudaMemset(e.ptr, 0, sizeof(kernels::device_error)));
            if (form == 0)
              scan_on_one_block<<<1, 1024>>>(x.ptr + offset, n, limit, e.ptr);
            else
              kernels::detail::scan_input_kernel<<<3, 256>>>(x.ptr + offset, n, limit, e.ptr, 2, 0);
            QEVICT_CUDA_CHECK(cudaDeviceSynchronize());
            const kernels::device_error got = e.download()[0];
            INFO("offset ", offset, ", n ", n, ", form ", form, ", bad ", bad, ", value ", value);
            if (bad == n) {
              CHECK(got.code == 0);
            } else {
              CHECK(got.code == (value != value ? 1 : std::isinf(value) ? 2 : 3));
              CHECK(got.index == static_cast<long long>(bad));
              if (value == value) CHECK(got.value == value);
              CHECK(got.call == 2);
            }
            ++cases;
          }
      }
  MESSAGE(cases, " scans");
}

TEST_CASE("CUDA backend: a NaN on the device is reported and changes nothing") {
  const geometry g = small_layer();
  options opt;
  opt.routing = routing_mode::manual;
  twin<paper> t(g, budget::fraction(0.2), limits{.max_batch = 2, .max_tokens = 2048}, opt, 5);
  std::vector<sequence_id> seqs = {t.add(0), t.add(17)};
  for (sequence_id s : seqs) t.prefill(s, 300, true);
  const std::size_t kn = seqs.size() * t.krow(), qn = seqs.size() * t.qrow();
  std::vector<float> k = t.keys(seqs.size()), v = gpu_test::normal(t.rng, kn), q = gpu_test::normal(t.rng, qn);
  auto dev_step = [&](const std::vector<float>& kk, const std::vector<float>& vv, const std::vector<float>& qq) {
    device_buffer<float> dk(kk), dv(vv), dq(qq), dout(qn);
    t.dev.append(0, seqs, std::span<const float>(dk.ptr, kn), std::span<const float>(dv.ptr, kn));
    t.dev.attend(0, seqs, std::span<const float>(dq.ptr, qn), std::span<float>(dout.ptr, qn));
    QEVICT_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the buffers are freed next
  };
  const auto before = t.dev.windows(seqs[0], 0);
  const int tokens_before = t.dev.tokens(seqs[0], 0);

  std::vector<float> bad_v = v;
  bad_v[kn - 3] = NAN;
  dev_step(k, bad_v, q);  // the append fails on the device, its attend is skipped
  CHECK(t.dev.tokens(seqs[0], 0) == tokens_before + 1);  // the host mirror does not know yet
  try {
    t.dev.check();
    FAIL("check() did not report the NaN");
  } catch (const qevict::error& err) {
    const std::string m = err.what();
    CHECK_MESSAGE(m.find("append: v[" + std::to_string(kn - 3) + "] is NaN") != std::string::npos, m);
  }
  CHECK(t.dev.tokens(seqs[0], 0) == tokens_before);
  // A finite key beyond its limit (numeric::largest_magnitude), the same.
  std::vector<float> big_k = k;
  big_k[7] = -2 * numeric::largest_magnitude(numeric::input::key);
  dev_step(big_k, v, q);
  try {
    t.dev.check();
    FAIL("check() did not report the key beyond the limit");
  } catch (const qevict::error& err) {
    const std::string m = err.what();
    CHECK_MESSAGE(m.find("append: k[7] = ") != std::string::npos, m);
    CHECK_MESSAGE(m.find("is beyond ±") != std::string::npos, m);
  }
  CHECK(t.dev.tokens(seqs[0], 0) == tokens_before);
  std::vector<float> bad_q = q;
  bad_q[5] = INFINITY;
  dev_step(k, v, bad_q);  // the append succeeds, the attend fails
  CHECK_THROWS_WITH_AS(t.dev.report(), doctest::Contains("attend: q[5] is infinite"), qevict::error);
  // The append before the bad attend stands; the attend changed no score.
  const auto after = t.dev.windows(seqs[0], 0);
  CHECK(t.dev.tokens(seqs[0], 0) == tokens_before + 1);
  REQUIRE(after.size() >= before.size());
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(after[i].score == before[i].score);
  // The host does the same good append; a good attend now agrees.
  t.host.append(0, seqs, k, v);
  std::vector<float> out_h(qn);
  const std::vector<float> q2 = gpu_test::normal(t.rng, qn);
  t.host.attend(0, seqs, q2, out_h);
  device_buffer<float> dq(q2), dout(qn);
  t.dev.attend(0, seqs, std::span<const float>(dq.ptr, qn), std::span<float>(dout.ptr, qn));
  t.dev.check();
  CHECK(rel_error(dout.download(), out_h, g.head_dim) <= 2e-3);
}

TEST_CASE("CUDA backend: the decode kernel's split-K chunk setting, and the device memory it takes") {
  const geometry g = small_layer();
  const limits lim{.max_batch = 2, .max_tokens = 2048};
  auto make = [&](int items_per_chunk) { qevict::cache<paper, backend::cuda> kv(g, budget::fraction(0.2), lim, gpu_test::with_chunk(items_per_chunk)); };
  // The paper's windows of 8 tokens: chunks of up to 384 items.
  CHECK_THROWS_WITH_AS(make(12), doctest::Contains("items_per_chunk must be 0 (automatic) or a multiple of 8 in [8, 384], got 12"),
                       qevict::error);
  CHECK_THROWS_WITH_AS(make(392), doctest::Contains("got 392"), qevict::error);
  CHECK_THROWS_WITH_AS(make(-8), doctest::Contains("got -8"), qevict::error);
  CHECK_NOTHROW(make(8));
  CHECK_NOTHROW(make(384));
  // Device memory by part. The arena is required_bytes, or nothing with external storage; the
  // setting changes the workspace only; an automatic chunk's workspace is that of chunks of 32
  // items (the most chunks an automatic launch makes), and longer fixed chunks need less.
  using cache_t = qevict::cache<paper, backend::cuda>;
  const std::size_t required = cache_t::required_bytes(g, budget::fraction(0.2), lim);
  auto memory_of = [&](int items_per_chunk) {
    return cache_t(g, budget::fraction(0.2), lim, gpu_test::with_chunk(items_per_chunk)).device_bytes();
  };
  const qevict::device_memory automatic = memory_of(0), of_32 = memory_of(32), of_128 = memory_of(128);
  CHECK(automatic.arena == required);
  CHECK(automatic.tables > 0);
  CHECK(automatic.decode_workspace == of_32.decode_workspace);
  CHECK(of_128.decode_workspace < automatic.decode_workspace);
  CHECK(of_128.tables == automatic.tables);
  CHECK(automatic.total() == automatic.arena + automatic.tables + automatic.decode_workspace);
  {
    device_buffer<std::byte> arena(required);
    const cache_t kv(g, budget::fraction(0.2), lim, storage::external{arena.ptr, required}, gpu_test::with_chunk(0));
    const qevict::device_memory external = kv.device_bytes();
    CHECK(external.arena == 0);
    CHECK(external.tables == automatic.tables);
    CHECK(external.decode_workspace == automatic.decode_workspace);
  }
  // The shortest chunk (dozens per lane) and the longest against the host, through routing events;
  // the default (0: chosen per call) is what every other case runs.
  for (int ipc : {8, 128}) {
    CAPTURE(ipc);
    case_spec c{64, 4, 7, element_type::bf16, budget::fraction(0.2), 700, quick() ? 24 : 64, 1, rope_layout::rotate_half, true};
    c.items_per_chunk = ipc;
    run_case<paper>(c, 308);
  }
}

TEST_CASE("CUDA backend: a construction that runs out of device memory part-way frees what it took") {
  // The arena is the constructor's first allocation and the decode workspace its last: with all but
  // half the workspace taken by another allocation, the arena and the tables succeed and the
  // workspace fails. The cache must then give back the arena and the tables, and leave no CUDA
  // error behind for the next launch check. (Free memory is read from the device: run this case
  // while no other process allocates on it.)
  const geometry g = small_layer();
  const limits lim{.max_batch = 128, .max_tokens = 65536};
  using cache_t = qevict::cache<paper, backend::cuda>;
  auto construct = [&] { return cache_t(g, budget::fraction(0.2), lim, gpu_test::with_chunk(8)); };
  const qevict::device_memory need = construct().device_bytes();
  REQUIRE(need.arena >= (std::size_t{256} << 20));
  REQUIRE(need.decode_workspace >= (std::size_t{32} << 20));
  std::size_t free_before = 0, total = 0;
  QEVICT_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  const std::size_t leave = need.arena + need.tables + need.decode_workspace / 2;
  REQUIRE(free_before > leave);
  device_buffer<std::byte> blocker(free_before - leave);
  std::size_t free_blocked = 0;
  QEVICT_CUDA_CHECK(cudaMemGetInfo(&free_blocked, &total));
  CHECK_THROWS_WITH_AS(construct(), doctest::Contains("out of memory"), qevict::error);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::size_t free_after = 0;
  QEVICT_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  // Allocation granularity aside, everything the failed construction took is free again (a leak
  // would keep the arena: hundreds of MB).
  CHECK(free_after + (std::size_t{16} << 20) >= free_blocked);
  // And a cache built next works.
  {
    case_spec c{64, 4, 2, element_type::bf16, budget::fraction(0.2), 300, 16, 1, rope_layout::rotate_half, true};
    run_case<paper>(c, 417);
  }
}

TEST_CASE("CUDA backend: decode steps captured in CUDA graphs match the same steps run directly") {
  // Two caches with the same inputs, each on a stream of its own: one runs append + attend
  // directly, the other captures the same calls into a graph per step and replays it once. Every
  // Ω-th attend routes (routing_mode::automatic), so the graphs hold routing events too. A call
  // that synchronized or allocated would fail the capture; a dependent launch that read its
  // predecessor's output too early would change the output.
  const geometry g{.layers = 1, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .element = element_type::bf16};
  const limits lim{.max_batch = 3, .max_tokens = 2048};
  cudaStream_t direct_stream, graph_stream;
  QEVICT_CUDA_CHECK(cudaStreamCreateWithFlags(&direct_stream, cudaStreamNonBlocking));
  QEVICT_CUDA_CHECK(cudaStreamCreateWithFlags(&graph_stream, cudaStreamNonBlocking));
  backend::cuda::settings direct_set, graph_set;
  direct_set.stream = direct_stream;
  graph_set.stream = graph_stream;
  {
    qevict::cache<paper, backend::cuda> direct(g, budget::fraction(0.2), lim, direct_set);
    qevict::cache<paper, backend::cuda> graphed(g, budget::fraction(0.2), lim, graph_set);
    std::mt19937 rng(7);
    const std::size_t krow = static_cast<std::size_t>(g.kv_heads) * g.head_dim, qrow = static_cast<std::size_t>(g.q_heads) * g.head_dim;
    std::vector<sequence_id> seqs;
    for (int i = 0; i < 3; ++i) {
      const sequence_id a = direct.add_sequence(13 * i), b = graphed.add_sequence(13 * i);
      REQUIRE(a == b);
      seqs.push_back(a);
      const int n = 400 + 90 * i;  // ragged
      const std::vector<float> k = gpu_test::normal(rng, n * krow), v = gpu_test::normal(rng, n * krow),
                               q = gpu_test::normal(rng, 8 * qrow);
      device_buffer<float> dk(k), dv(v), dq(q);
      for (auto* kv : {&direct, &graphed})
        kv->prefill(0, a, std::span<const float>(dq.ptr, q.size()), std::span<const float>(dk.ptr, k.size()),
                    std::span<const float>(dv.ptr, v.size()), std::span<float>());
      direct.check();
      graphed.check();
    }
    const std::size_t kn = seqs.size() * krow, qn = seqs.size() * qrow;
    device_buffer<float> out_direct(qn), out_graphed(qn);
    std::vector<std::size_t> nodes_per_step;
    for (int step = 0; step < 3 * paper::routing_interval; ++step) {
      CAPTURE(step);
      const std::vector<float> k = gpu_test::normal(rng, kn), v = gpu_test::normal(rng, kn), q = gpu_test::normal(rng, qn, 1.5f);
      device_buffer<float> dk(k), dv(v), dq(q);
      const std::span<const float> sk(dk.ptr, kn), sv(dv.ptr, kn), sq(dq.ptr, qn);
      direct.append(0, seqs, sk, sv);
      direct.attend(0, seqs, sq, std::span<float>(out_direct.ptr, qn));

      cudaGraph_t graph;
      cudaGraphExec_t exec;
      QEVICT_CUDA_CHECK(cudaStreamBeginCapture(graph_stream, cudaStreamCaptureModeThreadLocal));
      graphed.append(0, seqs, sk, sv);
      graphed.attend(0, seqs, sq, std::span<float>(out_graphed.ptr, qn));
      QEVICT_CUDA_CHECK(cudaStreamEndCapture(graph_stream, &graph));
      std::size_t nodes = 0;
      QEVICT_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
      nodes_per_step.push_back(nodes);
      QEVICT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      QEVICT_CUDA_CHECK(cudaGraphLaunch(exec, graph_stream));
      direct.check();
      graphed.check();
      QEVICT_CUDA_CHECK(cudaGraphExecDestroy(exec));
      QEVICT_CUDA_CHECK(cudaGraphDestroy(graph));

      // Same kernels on the same inputs: the outputs agree to float rounding at most.
      const double err = rel_error(out_graphed.download(), out_direct.download(), g.head_dim);
      CHECK_MESSAGE(err <= 1e-6, "graph replay against direct calls: relative error " << err);
      for (sequence_id s : seqs) {
        const auto wd = direct.windows(s, 0), wg = graphed.windows(s, 0);
        REQUIRE(wd.size() == wg.size());
        for (std::size_t i = 0; i < wd.size(); ++i) {
          REQUIRE(wd[i].where == wg[i].where);
          CHECK(std::abs(wd[i].score - wg[i].score) <= 1e-6 * std::max(1.0, std::abs(static_cast<double>(wd[i].score))));
        }
      }
    }
    // Steps that route capture the event's launches on top of append and attend.
    const auto [fewest, most] = std::minmax_element(nodes_per_step.begin(), nodes_per_step.end());
    CHECK(*fewest >= 4);
    CHECK(*most > *fewest);
    const auto counts = direct.counts(seqs[0], 0);
    CHECK(counts.quantized > 0);  // the steps ran over Quantized windows
  }
  QEVICT_CUDA_CHECK(cudaStreamDestroy(direct_stream));
  QEVICT_CUDA_CHECK(cudaStreamDestroy(graph_stream));
}

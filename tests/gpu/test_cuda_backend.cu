// qevict::cache<Config, backend::cuda> against the host backend (the oracle) for the paper's
// configuration, the two-tier allocator and the two other key frames of the records: outputs, scores, routing tables after every event and
// the arenas must agree (backend_comparison.cuh says how closely). A NaN on the device is reported
// by the next check() and leaves the cache as it was.
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend_comparison.cuh"

namespace {

using namespace qevict;
using gpu_test::case_spec;
using gpu_test::device_buffer;
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

TEST_CASE("CUDA backend: the decode kernel's split-K chunk setting") {
  const geometry g = small_layer();
  const limits lim{.max_batch = 2, .max_tokens = 2048};
  auto make = [&](int items_per_chunk) { qevict::cache<paper, backend::cuda> kv(g, budget::fraction(0.2), lim, gpu_test::with_chunk(items_per_chunk)); };
  CHECK_THROWS_WITH_AS(make(12), doctest::Contains("items_per_chunk must be 0 (automatic) or a multiple of 8 in [8, 128], got 12"),
                       qevict::error);
  CHECK_THROWS_WITH_AS(make(136), doctest::Contains("got 136"), qevict::error);
  CHECK_THROWS_WITH_AS(make(-8), doctest::Contains("got -8"), qevict::error);
  CHECK_NOTHROW(make(8));
  CHECK_NOTHROW(make(128));
  // The shortest chunk (dozens per lane) and the longest against the host, through routing events;
  // the default (0: chosen per call) is what every other case runs.
  for (int ipc : {8, 128}) {
    CAPTURE(ipc);
    case_spec c{64, 4, 7, element_type::bf16, budget::fraction(0.2), 700, quick() ? 24 : 64, 1, rope_layout::rotate_half, true};
    c.items_per_chunk = ipc;
    run_case<paper>(c, 308);
  }
}

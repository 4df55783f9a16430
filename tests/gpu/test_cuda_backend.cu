// qevict::cache<Config, backend::cuda> against the host backend (the oracle) on the same fresh
// random inputs: prefill, ≥ 256 decode steps with a routing event every Ω steps, ragged lengths,
// sequences removed and added mid-run.
//
// What must agree:
//   - attention outputs (prefill and every decode step): relative L2 error per head <= 2e-3;
//   - window scores before every routing event: relative L1 per sequence <= 1e-3;
//   - routing: identical window tables (tier, Full slot, ledger slot of every window) after every
//     event. The device's scores carry float rounding (~1e-6 relative), so two windows whose
//     scores are that close could rank differently; to compare routing itself on identical inputs,
//     the device's scores are copied into the host cache before each event (the score error is
//     checked just before);
//   - the arenas, byte for byte, at the end (scores aside): token rows, Full windows, ledger codes.
// A NaN on the device is reported by the next check() and leaves the cache as it was.
//
// QEVICT_GPU_QUICK=1 runs a reduced set (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_support.cuh"
#include "qevict/backend/cuda.cuh"
#include "qevict/cache.hpp"

namespace {

using namespace qevict;
using gpu_test::device_buffer;
using paper = qevict::config<>;
using two_tier = qevict::config<>::with_allocator<allocators::two_tier>;

bool quick() {
  const char* q = std::getenv("QEVICT_GPU_QUICK");
  return q && q[0] == '1';
}

struct case_spec {
  int head_dim, group, batch;
  element_type element;
  budget b;
  int max_prompt;
  int steps = 256;
  int layers = 1;
  rope_layout layout = rope_layout::rotate_half;
  bool churn = false;
};

struct worst_error {
  double out = 0, prefill_out = 0, score = 0;
  long long routing_events = 0, tables_compared = 0;
};

double rel_error(const std::vector<float>& got, const std::vector<float>& ref, int d) {
  double worst = 0.0;
  for (std::size_t hv = 0; hv < ref.size() / d; ++hv) {
    double num = 0.0, den = 0.0;
    for (int c = 0; c < d; ++c) {
      const double r = ref[hv * d + c], o = got[hv * d + c];
      num += (o - r) * (o - r);
      den += r * r;
    }
    if (!std::isfinite(num)) return INFINITY;
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

template <class Cfg>
struct twin {
  geometry g;
  budget b;
  limits lim;
  std::size_t bytes;
  std::vector<std::byte> host_arena;
  std::byte* host_base;
  device_buffer<std::byte> dev_arena;
  cache<Cfg> host;
  cache<Cfg, backend::cuda> dev;
  std::mt19937 rng;

  static std::byte* aligned(std::vector<std::byte>& v) {
    return reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t{63});
  }
  twin(const geometry& g_, const budget& b_, const limits& l_, const options& opt, unsigned seed)
      : g(g_), b(b_), lim(l_), bytes(cache<Cfg>::required_bytes(g_, b_, l_)), host_arena(bytes + 64), host_base(aligned(host_arena)),
        dev_arena(bytes), host(g_, b_, l_, storage::external{host_base, bytes}, opt),
        dev(g_, b_, l_, storage::external{dev_arena.ptr, bytes}, backend::cuda::settings{}, opt), rng(seed) {}

  std::size_t krow() const { return static_cast<std::size_t>(g.kv_heads) * g.head_dim; }
  std::size_t qrow() const { return static_cast<std::size_t>(g.q_heads) * g.head_dim; }
  std::vector<float> keys(std::size_t rows) {
    std::vector<float> k = gpu_test::normal(rng, rows * krow());
    std::uniform_real_distribution<float> u(0.5f, 2.5f);
    for (std::size_t r = 0; r < rows; ++r) {
      const float spread = u(rng);
      for (std::size_t i = 0; i < krow(); ++i) k[r * krow() + i] *= spread;
    }
    return k;
  }

  sequence_id add(long long first) {
    const sequence_id a = host.add_sequence(first), d = dev.add_sequence(first);
    REQUIRE(a == d);
    return a;
  }

  /// Prefill of n tokens in every layer; returns the worst output error (0 without outputs).
  double prefill(sequence_id s, int n, bool with_out) {
    double worst = 0.0;
    for (int l = 0; l < g.layers; ++l) {
      const std::vector<float> k = keys(n), v = gpu_test::normal(rng, n * krow());
      const int q_rows = with_out ? n : std::min(n, 1 + static_cast<int>(rng() % 40));
      const std::vector<float> q = gpu_test::normal(rng, q_rows * qrow(), 1.5f);
      std::vector<float> out_h(with_out ? q.size() : 0);
      host.prefill(l, s, q, k, v, out_h);
      device_buffer<float> dq(q), dk(k), dv(v), dout(std::max<std::size_t>(out_h.size(), 1));
      dev.prefill(l, s, std::span<const float>(dq.ptr, q.size()), std::span<const float>(dk.ptr, k.size()),
                  std::span<const float>(dv.ptr, v.size()), std::span<float>(with_out ? dout.ptr : nullptr, out_h.size()));
      dev.check();
      if (with_out) worst = std::max(worst, rel_error(dout.download(), out_h, g.head_dim));
    }
    return worst;
  }

  std::vector<window_record> device_table(sequence_id s, int l) {
    std::vector<window_record> t(static_cast<std::size_t>(host.plan().max_windows));
    const std::size_t region = host.plan().region_bytes;
    QEVICT_CUDA_CHECK(cudaMemcpy(t.data(), dev_arena.ptr + (static_cast<std::size_t>(s) * g.layers + l) * region,
                                 t.size() * sizeof(window_record), cudaMemcpyDeviceToHost));
    return t;
  }
  const window_record* host_table(sequence_id s, int l) const {
    return reinterpret_cast<const window_record*>(host_base + (static_cast<std::size_t>(s) * g.layers + l) * host.plan().region_bytes);
  }

  /// Tiers and slots of every window identical on both sides.
  void compare_tables(sequence_id s, int l, const char* when) {
    const auto dt = device_table(s, l);
    const window_record* ht = host_table(s, l);
    const int started = host.windows(s, l).size();
    int mismatches = 0;
    for (int w = 0; w < started; ++w)
      if (dt[w].full_slot != ht[w].full_slot || dt[w].ledger_slot != ht[w].ledger_slot) ++mismatches;
    CHECK_MESSAGE(mismatches == 0, when << ": sequence " << s << " layer " << l << ": " << mismatches << " of " << started
                                        << " windows differ in tier or slot");
    const auto hw = host.windows(s, l), dw = dev.windows(s, l);
    REQUIRE(hw.size() == dw.size());
    for (std::size_t i = 0; i < hw.size(); ++i) REQUIRE(hw[i].where == dw[i].where);
  }

  /// Relative L1 of the device's scores against the host's, then hands the device's scores to the
  /// host so that routing is compared on identical inputs.
  double sync_scores(sequence_id s, int l) {
    const auto hw = host.windows(s, l), dw = dev.windows(s, l);
    REQUIRE(hw.size() == dw.size());
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < hw.size(); ++i) {
      num += std::abs(static_cast<double>(dw[i].score) - hw[i].score);
      den += std::abs(static_cast<double>(hw[i].score));
      if (hw[i].where != tier::evicted) host.set_score(s, l, static_cast<int>(i), dw[i].score);
    }
    return den > 0.0 ? num / den : 0.0;
  }

  /// Byte-for-byte arena comparison (scores aside); returns differing bytes.
  std::size_t arena_differences(const std::vector<sequence_id>& seqs, std::size_t& compared) {
    const std::vector<std::byte> d = dev_arena.download();
    const region_plan& p = host.plan();
    std::size_t diff = 0;
    compared = 0;
    for (sequence_id s : seqs)
      for (int l = 0; l < g.layers; ++l) {
        const std::size_t base = (static_cast<std::size_t>(s) * g.layers + l) * p.region_bytes;
        const int tokens = host.tokens(s, l);
        // Window table without scores.
        const auto ht = host_table(s, l);
        const auto* dt = reinterpret_cast<const window_record*>(d.data() + base);
        for (int w = 0; w < host.windows(s, l).size(); ++w) {
          compared += 8;
          diff += (ht[w].full_slot != dt[w].full_slot) + (ht[w].ledger_slot != dt[w].ledger_slot);
        }
        // Sinks and the recent ring (only slots that hold tokens), Full and ledger slots in use.
        auto cmp = [&](std::size_t off, std::size_t n) {
          compared += n;
          for (std::size_t i = 0; i < n; ++i) diff += host_base[base + off + i] != d[base + off + i];
        };
        if (tokens >= p.sinks) cmp(p.sink_offset, p.sink_bytes());
        if (tokens >= p.sinks + p.recent_capacity) cmp(p.recent_offset, p.recent_bytes());
        for (int w = 0; w < host.windows(s, l).size(); ++w) {
          if (ht[w].full_slot >= 0) cmp(p.full_offset + ht[w].full_slot * p.full_window_bytes, p.full_window_bytes);
          if (ht[w].ledger_slot >= 0)
            cmp(p.ledger_offset + ht[w].ledger_slot * p.quantized_window_bytes(), p.quantized_window_bytes());
        }
      }
    return diff;
  }
};

template <class Cfg>
void run_case(const case_spec& spec, unsigned seed) {
  geometry g;
  g.layers = spec.layers;
  g.kv_heads = 2;
  g.q_heads = 2 * spec.group;
  g.head_dim = spec.head_dim;
  g.element = spec.element;
  g.rope.theta = 500000.0f;
  g.rope.layout = spec.layout;
  const limits lim{.max_batch = spec.batch, .max_tokens = 2048};
  options opt;
  opt.routing = routing_mode::manual;  // routing every Ω steps by route(), on both sides
  twin<Cfg> t(g, spec.b, lim, opt, seed);
  worst_error e;
  std::uniform_int_distribution<int> len_d(1, spec.max_prompt);
  std::uniform_int_distribution<long long> pos_d(0, 200000);
  std::vector<sequence_id> seqs;
  auto start = [&](int i) {
    const sequence_id s = t.add(i % 3 == 0 ? 0 : pos_d(t.rng));
    const int n = i == 1 ? 3 : len_d(t.rng);  // one shorter than the sinks
    e.prefill_out = std::max(e.prefill_out, t.prefill(s, n, n <= 400));
    for (int l = 0; l < g.layers; ++l) t.compare_tables(s, l, "after prefill");
    return s;
  };
  for (int i = 0; i < spec.batch; ++i) seqs.push_back(start(i));

  const int omega = Cfg::routing_interval;
  for (int step = 1; step <= spec.steps; ++step) {
    if (spec.churn && step == spec.steps / 2 && seqs.size() > 2) {
      // Free slot 1 and reuse it for a new sequence.
      const sequence_id gone = seqs[1];
      t.host.remove_sequence(gone);
      t.dev.remove_sequence(gone);
      seqs.erase(seqs.begin() + 1);
      seqs.push_back(start(1000 + step));
    }
    for (int l = 0; l < g.layers; ++l) {
      const std::vector<float> k = t.keys(seqs.size()), v = gpu_test::normal(t.rng, seqs.size() * t.krow());
      const std::vector<float> q = gpu_test::normal(t.rng, seqs.size() * t.qrow(), 1.5f);
      std::vector<float> out_h(q.size());
      t.host.append(l, seqs, k, v);
      t.host.attend(l, seqs, q, out_h);
      device_buffer<float> dk(k), dv(v), dq(q), dout(q.size());
      t.dev.append(l, seqs, std::span<const float>(dk.ptr, k.size()), std::span<const float>(dv.ptr, v.size()));
      t.dev.attend(l, seqs, std::span<const float>(dq.ptr, q.size()), std::span<float>(dout.ptr, q.size()));
      t.dev.check();
      e.out = std::max(e.out, rel_error(dout.download(), out_h, g.head_dim));
    }
    if (step % omega == 0) {
      for (sequence_id s : seqs)
        for (int l = 0; l < g.layers; ++l) e.score = std::max(e.score, t.sync_scores(s, l));
      t.host.route();
      t.dev.route();
      ++e.routing_events;
      for (sequence_id s : seqs)
        for (int l = 0; l < g.layers; ++l) {
          t.compare_tables(s, l, "after a routing event");
          ++e.tables_compared;
        }
    }
  }
  std::size_t compared = 0;
  const std::size_t diff = t.arena_differences(seqs, compared);
  tier_counts c;
  for (sequence_id s : seqs)
    for (int l = 0; l < g.layers; ++l) c += t.dev.counts(s, l);
  const std::string element = spec.element == element_type::bf16 ? "bf16" : "f16";
  MESSAGE("d=" << spec.head_dim << " G=" << spec.group << " batch=" << spec.batch << " " << element << " K_f=" << t.host.plan().caps.full
               << " K_q=" << t.host.plan().caps.quantized << " layers=" << spec.layers << ": " << spec.steps << " steps, "
               << e.routing_events << " routing events, " << e.tables_compared << " tables identical; windows now "
               << c.full << " full / " << c.quantized << " quantized / " << c.evicted << " evicted; worst output error "
               << e.out << ", prefill output " << e.prefill_out << ", score L1 " << e.score << "; arena bytes differing "
               << diff << " of " << compared);
  CHECK(e.out <= 2e-3);
  CHECK(e.prefill_out <= 2e-3);
  CHECK(e.score <= 1e-3);
  CHECK(diff <= compared / 100000);
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

TEST_CASE("CUDA backend: two-tier allocator") {
  run_case<two_tier>(case_spec{128, 4, 7, element_type::bf16, budget::fraction(0.05), 500, quick() ? 24 : 256, 1,
                               rope_layout::rotate_half, true},
                     77);
}

TEST_CASE("CUDA backend: a NaN on the device is reported and changes nothing") {
  geometry g;
  g.layers = 1;
  g.kv_heads = 2;
  g.q_heads = 8;
  g.head_dim = 64;
  g.element = element_type::bf16;
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

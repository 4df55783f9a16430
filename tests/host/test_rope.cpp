// RoPE policy: Llama-3 frequency scaling against hand-computed values, the rotation's algebra
// (inverse, norm, relative positions, the two pair layouts), and a cache with Llama-3 scaling
// against a dense attention whose rotation is written here independently.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include <qevict/cache.hpp>

#include "support/reference.hpp"

using qevict::rope::rotary;
using qevict_test::rng;

namespace {

const qevict::rope_params llama3{.theta = 500000.0f, .layout = qevict::rope_layout::rotate_half, .llama3_factor = 8.0f,
                                 .llama3_low_freq_factor = 1.0f, .llama3_high_freq_factor = 4.0f,
                                 .llama3_original_max_position = 8192};

/// Llama-3 scaling as its reference implementation states it, written without the library.
double scaled_frequency(int i, int d) {
  const double pi = 3.14159265358979323846;
  const double f = std::pow(500000.0, -2.0 * i / d);
  const double wavelen = 2 * pi / f;
  if (wavelen < 8192.0 / 4.0) return f;
  if (wavelen > 8192.0 / 1.0) return f / 8.0;
  const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
  return (1 - smooth) * f / 8.0 + smooth * f;
}

}  // namespace

TEST_CASE("Llama-3 frequency scaling against hand-computed values") {
  const std::vector<double> f = rotary::inverse_frequencies(llama3, 128);
  REQUIRE(f.size() == 64);
  // i = 0: wavelength 2π, far below 8192/4: unscaled.
  CHECK(f[0] == doctest::Approx(1.0).epsilon(1e-12));
  // i = 63: 500000^(-126/128) = 2.4e-6, wavelength 2.6e6 > 8192: divided by the factor 8.
  CHECK(f[63] == doctest::Approx(std::pow(500000.0, -126.0 / 128.0) / 8.0).epsilon(1e-12));
  // i = 30: 500000^(-30/64) = 0.0021333, wavelength 2945.3, in the smooth band:
  // smooth = (8192/2945.3 - 1)/3 = 0.59377; f' = f·((1 - 0.59377)/8 + 0.59377) = 0.64455·f.
  CHECK(f[30] == doctest::Approx(0.64455 * std::pow(500000.0, -30.0 / 64.0)).epsilon(2e-4));
  for (int i = 0; i < 64; ++i) CHECK(f[static_cast<std::size_t>(i)] == doctest::Approx(scaled_frequency(i, 128)).epsilon(1e-12));
  // Without scaling: θ^(-2i/d).
  const std::vector<double> plain = rotary::inverse_frequencies(qevict::rope_params{.theta = 10000.0f}, 8);
  CHECK(plain[1] == doctest::Approx(0.1).epsilon(1e-12));   // 10000^(-2/8)
  CHECK(plain[3] == doctest::Approx(0.001).epsilon(1e-12));  // 10000^(-6/8)
}

TEST_CASE("rotation: inverse, norm, relative positions, pair layouts") {
  rng r(5);
  const int d = 16;
  const std::vector<double> f = rotary::inverse_frequencies(qevict::rope_params{.theta = 10000.0f}, d);
  for (qevict::rope_layout layout : {qevict::rope_layout::rotate_half, qevict::rope_layout::interleaved}) {
    std::vector<double> x(d), y(d);
    for (double& v : x) v = r.normal();
    y = x;
    rotary::rotate(layout, f.data(), d, y.data(), 1234);
    const double nx = std::inner_product(x.begin(), x.end(), x.begin(), 0.0);
    const double ny = std::inner_product(y.begin(), y.end(), y.begin(), 0.0);
    CHECK(ny == doctest::Approx(nx).epsilon(1e-12));
    rotary::rotate(layout, f.data(), d, y.data(), 1234, -1);
    for (int c = 0; c < d; ++c) CHECK(y[static_cast<std::size_t>(c)] == doctest::Approx(x[static_cast<std::size_t>(c)]).epsilon(1e-12));
    // <R(m) q, R(n) k> depends on m − n only.
    std::vector<double> q(d), k(d);
    for (double& v : q) v = r.normal();
    for (double& v : k) v = r.normal();
    auto score = [&](long long m, long long n) {
      std::vector<double> a = q, b = k;
      rotary::rotate(layout, f.data(), d, a.data(), m);
      rotary::rotate(layout, f.data(), d, b.data(), n);
      return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
    };
    CHECK(score(100, 90) == doctest::Approx(score(17, 7)).epsilon(1e-10));
  }
  // The layouts differ only by where pair members sit: interleaved(x) = P(rotate_half(P⁻¹ x)),
  // with P moving element i to 2i and element i + d/2 to 2i + 1.
  std::vector<double> x(d), half(d), inter(d);
  for (double& v : x) v = r.normal();
  for (int i = 0; i < d / 2; ++i) {
    half[static_cast<std::size_t>(i)] = x[static_cast<std::size_t>(2 * i)];
    half[static_cast<std::size_t>(i + d / 2)] = x[static_cast<std::size_t>(2 * i + 1)];
  }
  inter = x;
  rotary::rotate(qevict::rope_layout::rotate_half, f.data(), d, half.data(), 77);
  rotary::rotate(qevict::rope_layout::interleaved, f.data(), d, inter.data(), 77);
  for (int i = 0; i < d / 2; ++i) {
    CHECK(inter[static_cast<std::size_t>(2 * i)] == doctest::Approx(half[static_cast<std::size_t>(i)]).epsilon(1e-12));
    CHECK(inter[static_cast<std::size_t>(2 * i + 1)] == doctest::Approx(half[static_cast<std::size_t>(i + d / 2)]).epsilon(1e-12));
  }
}

TEST_CASE("a cache with Llama-3 scaling equals a dense attention with independently scaled RoPE") {
  const qevict::geometry g{.layers = 1, .q_heads = 4, .kv_heads = 2, .head_dim = 32, .rope = llama3};
  qevict::cache<qevict::config<>> kv(g, qevict::budget::everything(), qevict::limits{.max_batch = 1, .max_tokens = 300});
  const qevict::sequence_id s = kv.add_sequence(9000);  // positions past the original context
  rng r(11);
  const int d = 32, krow = 64, qrow = 128;
  std::vector<double> keys, values;  // rotated keys and values of every token, [token][kv head][d]
  auto rotate = [&](double* x, long long p) {
    for (int i = 0; i < d / 2; ++i) {
      const double a = static_cast<double>(p) * scaled_frequency(i, d), c = std::cos(a), sn = std::sin(a);
      const double x0 = x[i], x1 = x[i + d / 2];
      x[i] = x0 * c - x1 * sn;
      x[i + d / 2] = x0 * sn + x1 * c;
    }
  };
  double worst = 0.0;
  for (int t = 0; t < 200; ++t) {
    const auto k = r.normals(krow), v = r.normals(krow), q = r.normals(qrow, 2.0f);
    std::vector<float> out(qrow);
    kv.append(0, std::span(&s, 1), k, v);
    kv.attend(0, std::span(&s, 1), q, out);
    for (int c = 0; c < krow; ++c) {
      keys.push_back(k[static_cast<std::size_t>(c)]);
      values.push_back(v[static_cast<std::size_t>(c)]);
    }
    for (int h = 0; h < 2; ++h) rotate(&keys[static_cast<std::size_t>(t * krow + h * d)], 9000 + t);
    for (int qh = 0; qh < 4; ++qh) {
      std::vector<double> qr(q.begin() + qh * d, q.begin() + (qh + 1) * d);
      rotate(qr.data(), 9000 + t);
      const int h = qh / 2;
      std::vector<double> logit(static_cast<std::size_t>(t + 1));
      double m = -1e300;
      for (int j = 0; j <= t; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += qr[static_cast<std::size_t>(c)] * keys[static_cast<std::size_t>(j * krow + h * d + c)];
        logit[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
        m = std::max(m, logit[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - m));
      double err = 0, ref_norm = 0;
      for (int c = 0; c < d; ++c) {
        double o = 0;
        for (int j = 0; j <= t; ++j) o += logit[static_cast<std::size_t>(j)] / sum * values[static_cast<std::size_t>(j * krow + h * d + c)];
        err += (o - out[static_cast<std::size_t>(qh * d + c)]) * (o - out[static_cast<std::size_t>(qh * d + c)]);
        ref_norm += o * o;
      }
      worst = std::max(worst, std::sqrt(err / ref_norm));
    }
  }
  CHECK(worst <= 1e-5);
}

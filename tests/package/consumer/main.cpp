#include <qevict/cache.hpp>

#include <cstdio>
#include <vector>

int main() {
  qevict::geometry g{.layers = 1, .q_heads = 4, .kv_heads = 2, .head_dim = 16};
  qevict::cache<qevict::config<>> kv(g, qevict::budget::fraction(0.5), qevict::limits{.max_batch = 1, .max_tokens = 256});
  const auto s = kv.add_sequence();
  std::vector<float> k(32, 0.25f), v(32, 1.0f), q(64, 0.5f), out(64, 0.0f);
  kv.append(0, std::span(&s, 1), k, v);
  kv.attend(0, std::span(&s, 1), q, out);
  // One token: attention returns its value exactly.
  for (float x : out)
    if (x != 1.0f) return 1;
  std::puts("consumer: ok");
  return 0;
}

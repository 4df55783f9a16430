// <qevict/cache.hpp> compiles on its own: it is the first thing this translation unit includes.
#include <qevict/cache.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/cache.hpp stands alone: qevict::cache<qevict::paper_config>") {
  const qevict::geometry g{.layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8};
  qevict::cache<qevict::paper_config> kv(g, qevict::budget::everything(), qevict::limits{});
  CHECK(kv.add_sequence() == 0);
}

// device_bytes() belongs to device backends: the host cache has no such member, so calling it is a
// compile error rather than a zero.
template <class Cache>
constexpr bool has_device_bytes = requires(const Cache& c) { c.device_bytes(); };
static_assert(!has_device_bytes<qevict::cache<qevict::paper_config>>, "the host cache allocates no device memory");

#pragma once
// Where the cache's bytes live. By default the cache owns its arena; an engine can instead hand
// it a memory range of its own (for the host backend, host memory; for the CUDA backend, device
// memory), at least cache::required_bytes(...) long and 16-byte aligned, or one region per
// (sequence slot, layer) from its page allocator; the cache manages every tier inside them.

#include <concepts>
#include <cstddef>
#include <functional>

namespace qevict {
namespace storage {

/// The cache allocates and frees its own arena.
struct owned {};

/// A caller-owned range; the caller keeps it alive for the cache's lifetime.
struct external {
  void* pointer = nullptr;
  std::size_t bytes = 0;
  void* data() const { return pointer; }
  std::size_t size_bytes() const { return bytes; }
};

/// One region per (sequence slot, layer) from the engine's own allocator (a page allocator, a
/// memory pool): `provide(slot, layer, bytes)` returns 16-byte aligned memory of at least `bytes`
/// that stays valid for the cache's lifetime. It is called max_batch × layers times, at
/// construction only.
struct regions {
  std::function<void*(int slot, int layer, std::size_t bytes)> provide;
};

}  // namespace storage

/// One contiguous range (an engine's own allocator can model it).
template <class S>
concept contiguous_storage = requires(const S& s) {
  { s.data() } -> std::convertible_to<void*>;
  { s.size_bytes() } -> std::convertible_to<std::size_t>;
};

/// Where a cache can keep its bytes: its own arena, one contiguous range, or per-region memory.
template <class S>
concept kv_storage = std::same_as<S, storage::owned> || std::same_as<S, storage::regions> || contiguous_storage<S>;

}  // namespace qevict

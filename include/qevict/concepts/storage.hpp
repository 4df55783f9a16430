#pragma once
// Where the cache's bytes live. By default the cache owns its arena; an engine can instead hand
// it a memory range of its own (for the host backend, host memory; for the CUDA backend, device
// memory), at least cache::required_bytes(...) long and 16-byte aligned, and the cache manages
// every tier inside it.

#include <concepts>
#include <cstddef>

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

}  // namespace storage

/// Any type that exposes one contiguous range (an engine's own allocator can model it).
template <class S>
concept kv_storage = std::same_as<S, storage::owned> || requires(const S& s) {
  { s.data() } -> std::convertible_to<void*>;
  { s.size_bytes() } -> std::convertible_to<std::size_t>;
};

}  // namespace qevict

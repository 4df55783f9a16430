#pragma once
// The sequence slots of a cache, kept the same way by every backend: limits::max_batch slots, each
// free or holding one sequence and the position of its first token. A slot's regions are fixed
// (lane = slot * layers + layer), so a new sequence takes the lowest free slot and its id is that
// slot.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "qevict/core/platform.hpp"

namespace qevict {

using sequence_id = std::int32_t;

class sequence_slots {
 public:
  explicit sequence_slots(int capacity) : slots_(static_cast<std::size_t>(capacity)) {}

  /// The lowest free slot, now holding a sequence whose first token is at `first_position`.
  /// Throws qevict::error (and changes nothing) when every slot is in use.
  sequence_id take(long long first_position) {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s].active) continue;
      slots_[s] = slot{true, first_position};
      return static_cast<sequence_id>(s);
    }
    throw error("add_sequence: all " + std::to_string(slots_.size()) + " sequence slots (limits::max_batch) are in use");
  }
  void release(sequence_id s) { slots_[static_cast<std::size_t>(s)].active = false; }
  bool active(sequence_id s) const {
    return s >= 0 && static_cast<std::size_t>(s) < slots_.size() && slots_[static_cast<std::size_t>(s)].active;
  }
  long long first_position(sequence_id s) const { return slots_[static_cast<std::size_t>(s)].first_position; }
  /// Slots, free or not (the ids run from 0 to size() - 1).
  int size() const { return static_cast<int>(slots_.size()); }

 private:
  struct slot {
    bool active = false;
    long long first_position = 0;
  };
  std::vector<slot> slots_;
};

}  // namespace qevict

#pragma once
// Portability macros and the library's error type. Everything here compiles under g++ and nvcc.

#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define QEVICT_HOST_DEVICE __host__ __device__ inline
#else
#define QEVICT_HOST_DEVICE inline
#endif

namespace qevict {

/// Every error the library reports. The message names the call and the offending value; the
/// cache is left exactly as it was before the call that threw.
class error : public std::invalid_argument {
 public:
  explicit error(const std::string& what) : std::invalid_argument("qevict: " + what) {}
};

namespace detail {
inline void require(bool ok, const std::string& message) {
  if (!ok) throw error(message);
}
/// The form for hot paths: the message is only built when the check fails.
template <class MakeMessage>
  requires requires(MakeMessage f) { std::string(f()); }
inline void require(bool ok, MakeMessage&& make_message) {
  if (!ok) throw error(std::string(make_message()));
}
}  // namespace detail
}  // namespace qevict

#pragma once
// Error checking for CUDA calls and launches. Errors become qevict::error with the call site, so
// an engine sees one exception type from every backend.

#include <cuda_runtime.h>

#include <string>

#include "qevict/core/platform.hpp"

namespace qevict::kernels {

inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    // A failed call also leaves its error as the thread's last error; taken here, so that the next
    // launch check does not report it again as its own (sticky errors stay: the context is lost).
    (void)cudaGetLastError();
    throw error(std::string("CUDA error in ") + what + " (" + file + ":" + std::to_string(line) + "): " + cudaGetErrorString(e));
  }
}

}  // namespace qevict::kernels

/// Checks a CUDA runtime call.
#define QEVICT_CUDA_CHECK(call) ::qevict::kernels::check_cuda((call), #call, __FILE__, __LINE__)
/// Checks the launch just made (configuration errors surface here, not at the next sync).
#define QEVICT_CUDA_CHECK_LAUNCH(name) ::qevict::kernels::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)

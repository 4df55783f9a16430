#pragma once
// Shared by the GPU tests: skip (exit 77) without a GPU, device buffers, random inputs.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "qevict/kernels/check.cuh"

namespace gpu_test {

/// Runs before doctest's main: a machine without a usable GPU skips the whole program.
struct require_gpu {
  require_gpu() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      std::printf("no CUDA device: GPU tests skipped\n");
      std::exit(77);
    }
  }
};
inline const require_gpu gpu_present{};

template <class T>
struct device_buffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  device_buffer() = default;
  explicit device_buffer(std::size_t count) : n(count) {
    if (count) QEVICT_CUDA_CHECK(cudaMalloc(&ptr, count * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { if (ptr) cudaFree(ptr); }
  void upload(const std::vector<T>& host) {
    QEVICT_CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    QEVICT_CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

inline std::vector<float> normal(std::mt19937& rng, std::size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace gpu_test

#pragma once
// The CUDA backend (CUDA compiler only):
//
//   #include <qevict/cache.hpp>
//   #include <qevict/backend/cuda.cuh>
//   qevict::cache<qevict::config<>, qevict::backend::cuda> kv(geometry, qevict::budget::fraction(0.20),
//                                                             limits, qevict::backend::cuda::settings{stream});
//
// q, k, v and out of prefill/append/attend are device pointers; see backend/cuda/cuda_cache.cuh.

#include "qevict/backend/cuda/cuda_cache.cuh"
#include "qevict/cache.hpp"

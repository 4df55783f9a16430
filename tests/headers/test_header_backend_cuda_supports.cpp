// <qevict/backend/cuda/supports.hpp> compiles on its own, without CUDA: it is the first thing this
// translation unit includes.
#include <qevict/backend/cuda/supports.hpp>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

TEST_CASE("qevict/backend/cuda/supports.hpp stands alone: the paper's configuration runs on the CUDA backend") {
  CHECK(qevict::backend::cuda_supports<qevict::config<>>);
  CHECK(qevict::backend::cuda_supports<qevict::config<>::with_quantizer<qevict::quantizers::asymmetric<8>>>);
  CHECK_FALSE(qevict::backend::cuda_supports<qevict::config<>::with_quantizer<qevict::quantizers::asymmetric<2, qevict::meta::f32>>>);
}

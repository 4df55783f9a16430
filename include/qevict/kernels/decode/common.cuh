#pragma once
// Small device pieces that the parts of the decode kernels share: the CTA's warps, 2^x and log2
// on the special-function unit, the online softmax's rescale margin, whether a group folds its
// probabilities' low parts into one product, a predicated store and a bit-run search.

#include <cuda_runtime.h>

#include <cstdint>

#include "qevict/core/platform.hpp"

namespace qevict::kernels::detail {

constexpr int warps_per_cta = 4;
constexpr float log2e = 1.4426950408889634f;

/// 2^x on the special-function unit (relative error about 2^-22). Results below 2^-126 flush to
/// zero, which for a softmax weight relative to the running maximum changes nothing that float
/// sums would keep; it spares exp2f's range fix-up (a compare and two multiplies per call).
__device__ __forceinline__ float exp2_sfu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// How far (in log2 units) a score may exceed its row's reference maximum before the reference
/// is raised and the row's output rescaled. With bf16 values (Bf16) probabilities enter the tensor
/// cores as high and low bf16 parts (16 bits), and may grow to 2^8 between rescales, far from any
/// range limit. With fp16 values they enter as one fp16 part (11 bits), which must not overflow
/// once multiplied by a value's scale, and the row's largest probability must stay exactly 1, as
/// the host's softmax has it: the reference is then the row's running maximum (margin 0), raised
/// at every pair that passes it.
template <bool Bf16>
inline constexpr float rescale_margin = Bf16 ? 8.0f : 0.0f;

/// Whether the output product of a group takes its probabilities' high and low bf16 parts in one
/// tensor-core product: with bf16 values and at most 4 heads, the product's columns 4-7 (heads the
/// group lacks) carry the low parts of heads 0-3 beside their high parts in columns 0-3. The
/// query rows 4-7 then repeat rows 0-3 (query_fragments), so that lanes of rows g and g + 4 hold
/// the same scores and probabilities and each supplies its own column; the CTA merge adds column
/// g + 4 to column g. One product per 16 channels and pair instead of two. Not where keys are
/// rotated one by one (EachKey: records before RoPE), whose kernel measured slower folded
/// (docs/performance-history.md, v24c).
template <bool Bf16, bool EachKey>
inline constexpr bool may_fold_low_part = Bf16 && !EachKey;  ///< the part of folds_low_part known at compile time
template <bool Bf16, bool EachKey>
QEVICT_HOST_DEVICE constexpr bool folds_low_part(int group) { return may_fold_low_part<Bf16, EachKey> && group <= 4; }

/// log2(x) on the special-function unit (absolute error about 2^-22); 0 and values below 2^-126
/// give -inf.
__device__ __forceinline__ float log2_sfu(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// *p = v where `store`, as one predicated instruction: a branch around a store inside the decode
/// loops would split their instruction streams in two, which the scheduler then cannot interleave.
__device__ __forceinline__ void store_if(float* p, float v, bool store) {
  asm volatile("{\n .reg .pred s;\n setp.ne.b32 s, %2, 0;\n @s st.global.f32 [%0], %1;\n}" ::"l"(p), "f"(v), "r"(static_cast<int>(store))
               : "memory");
}

/// The first run of set bits in the mask m of 32 Words bits (bit i of word w is bit 32 w + i):
/// [x, y), or [0, 0) if no bit is set.
template <int Words>
__device__ __forceinline__ int2 first_run_of_ones(const std::uint32_t (&m)[Words]) {
  constexpr int bits = 32 * Words;
  // The words from the highest down, so that the lowest one that qualifies is kept.
  int first = bits;
#pragma unroll
  for (int w = Words - 1; w >= 0; --w)
    if (m[w] != 0) first = 32 * w + __ffs(static_cast<int>(m[w])) - 1;
  if (first == bits) return make_int2(0, 0);
  // The first clear bit at or after `first`.
  int end = bits;
#pragma unroll
  for (int w = Words - 1; w >= 0; --w) {
    const int from = first - 32 * w;  // bits of word w below it are not looked at
    const std::uint32_t looked_at = from <= 0 ? ~0u : from >= 32 ? 0u : ~0u << from;
    const std::uint32_t clear = ~m[w] & looked_at;
    if (clear != 0) end = 32 * w + __ffs(static_cast<int>(clear)) - 1;
  }
  return make_int2(first, end);
}

}  // namespace qevict::kernels::detail

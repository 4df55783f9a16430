#pragma once
// Warp-level pieces: the m16n8k16 tensor-core product (fp16 in, fp32 accumulate), half2 packing
// and the bf16 -> fp16 widening used to feed it.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major): reg0 = (row g,   col 2t..2t+1)   reg1 = (row g+8, col 2t..2t+1)
//                         reg2 = (row g,   col 2t+8..+9)   reg3 = (row g+8, col 2t+8..+9)
//   B (16x8, "col"):      reg0 = (row 2t..2t+1, col g)     reg1 = (row 2t+8..+9, col g)
//   C (16x8, fp32):       c0,c1 = (row g, col 2t, 2t+1)    c2,c3 = (row g+8, col 2t, 2t+1)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace qevict::kernels::warp {

__device__ __forceinline__ void mma_f16(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                        std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/// Two floats as one half2 register (round to nearest even); x in the low half.
__device__ __forceinline__ std::uint32_t pack_half2(float x, float y) {
  const __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

__device__ __forceinline__ float2 unpack_half2(std::uint32_t w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

/// Two bf16 in one word -> two fp16 in one word. Exact for |x| in [2^-14, 65504], which holds for
/// attention keys and values in practice; fp16 lets one tensor-core path serve both storage types.
__device__ __forceinline__ std::uint32_t bf16x2_to_half2(std::uint32_t w) {
  return pack_half2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

/// Two 2-bit codes (bits 0-1 and 16-17 of x, the rest ignored) as an exact half2 of integers.
__device__ __forceinline__ std::uint32_t codes_to_half2(std::uint32_t x) {
  // 0x6400 is 1024.0 in fp16; a code in its low mantissa bits is 1024 + code, and the subtraction is exact.
  const std::uint32_t biased = (x & 0x00030003u) | 0x64006400u;
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2half2(__ushort_as_half(0x6400)));
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

__device__ __forceinline__ float bf16_bits_to_float(std::uint32_t lo16) { return __uint_as_float(lo16 << 16); }

}  // namespace qevict::kernels::warp

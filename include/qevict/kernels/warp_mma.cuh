#pragma once
// Warp-level pieces: the m16n8k16 tensor-core product (fp16 or bf16 in, fp32 accumulate), 16-bit
// packing, exact code conversion, asynchronous copies into shared memory and ldmatrix.
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

/// a * b - b on two fp16 lanes, rounded once (one HFMA2: the negation is an operand modifier).
__device__ __forceinline__ std::uint32_t fma_half2_minus(std::uint32_t a, std::uint32_t b) {
  const __half2 hb = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), hb, __hneg2(hb));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

/// The same product with bf16 inputs.
__device__ __forceinline__ void mma_bf16(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                         std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/// Tensor-core product in the 16-bit type the cache stores (Bf16: bf16, else fp16).
template <bool Bf16>
__device__ __forceinline__ void mma_16(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                       std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  if constexpr (Bf16) mma_bf16(c, a0, a1, a2, a3, b0, b1);
  else mma_f16(c, a0, a1, a2, a3, b0, b1);
}

/// Two floats as one bf16x2 register (round to nearest even); x in the low half.
__device__ __forceinline__ std::uint32_t pack_bf162(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_bf162(std::uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <bool Bf16>
__device__ __forceinline__ std::uint32_t pack_16(float x, float y) {
  if constexpr (Bf16) return pack_bf162(x, y);
  else return pack_half2(x, y);
}
template <bool Bf16>
__device__ __forceinline__ float2 unpack_16(std::uint32_t w) {
  if constexpr (Bf16) return unpack_bf162(w);
  else return unpack_half2(w);
}
/// (x, y) as a high part and a low part (x - high, y - high): 2 x 8 bits (bf16) or 2 x 11 bits (fp16).
template <bool Bf16>
__device__ __forceinline__ void split_16(float x, float y, std::uint32_t& hi, std::uint32_t& lo) {
  hi = pack_16<Bf16>(x, y);
  const float2 back = unpack_16<Bf16>(hi);
  lo = pack_16<Bf16>(x - back.x, y - back.y);
}

/// A code (below 2^23) as an exact float: 2^23 + code, built by placing the code in the mantissa,
/// minus 2^23 — one LOP3 and one addition, full rate, instead of a conversion.
__device__ __forceinline__ float code_as_float(std::uint32_t code) {
  return __uint_as_float(0x4B000000u | code) - 8388608.0f;
}

/// (x & mask) | bits in one LOP3. Written out because the compiler, given two constants, emits
/// an AND and an OR; here `bits` lives in a register, which the loops that call this hoist.
template <std::uint32_t Mask>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t x, std::uint32_t bits) {
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(x), "n"(Mask), "r"(bits));
  return d;
}

/// Field `Field` of a register of value codes (Bits wide, at bit Field * Bits of each 16-bit half;
/// 16/Bits fields per half) as two exact integers in the 16-bit type. A field is moved into the
/// mantissa's low bits by a shift shared by a group of fields (the fields that fit below the
/// exponent: 3 per shift for 2-bit codes in bf16, 5 in fp16, 1 for 8-bit codes in fp16), and given
/// the exponent under which its lowest bit weighs 1: the half then holds 2^E + code exactly, and
/// one subtraction of 2^E leaves the code (Biased: the half is returned as 2^E + code,
/// value_code_exponent gives E). An 8-bit code does not fit below bf16's 7 mantissa bits (2^E + code
/// needs 9 significant bits, the code alone at most 8): in bf16 it goes through fp32 instead.
template <bool Bf16, int Bits>
__host__ __device__ constexpr int value_code_exponent(int field) {
  constexpr int mantissa = Bf16 ? 7 : 10;
  static_assert(Bits <= mantissa, "value_code_exponent: the codes do not fit below the exponent");
  return mantissa - field % (mantissa / Bits) * Bits;  // 2^E's last mantissa bit is the field's lowest
}

/// value_code_field for codes that fit below the exponent (all but 8-bit codes in bf16).
template <bool Bf16, int Bits, int Field, bool Biased>
__device__ __forceinline__ std::uint32_t value_code_field_below_exponent(std::uint32_t x) {
  constexpr int mantissa = Bf16 ? 7 : 10;
  constexpr int per_shift = mantissa / Bits;
  constexpr int shift = Field / per_shift * per_shift * Bits, position = Field % per_shift * Bits;
  constexpr int exponent = value_code_exponent<Bf16, Bits>(Field);
  constexpr std::uint32_t bias = Bf16 ? (exponent + 127u) << 7 : (exponent + 15u) << 10;
  constexpr std::uint32_t mask = ((1u << Bits) - 1u) << position;
  const std::uint32_t biased = and_or<mask * 0x00010001u>(x >> shift, bias * 0x00010001u);
  if constexpr (Biased) {
    return biased;
  } else if constexpr (Bf16) {
    const __nv_bfloat162 h = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased),
                                     __bfloat162bfloat162(__ushort_as_bfloat16(static_cast<unsigned short>(bias))));
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2half2(__ushort_as_half(static_cast<unsigned short>(bias))));
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

template <bool Bf16, int Bits, int Field, bool Biased = false>
__device__ __forceinline__ std::uint32_t value_code_field(std::uint32_t x) {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "value_code_field: 2-, 4- or 8-bit codes");
  if constexpr (Bf16 && Bits == 8) {
    static_assert(!Biased, "value_code_field: 8-bit codes in bf16 have no biased form");
    // Exact in fp32, then exact in bf16 (at most 8 significant bits).
    const std::uint32_t c = x >> (8 * Field);
    return pack_bf162(code_as_float(c & 0xffu), code_as_float((c >> 16) & 0xffu));
  } else {
    return value_code_field_below_exponent<Bf16, Bits, Field, Biased>(x);
  }
}

/// Shared-memory pieces: 16-byte asynchronous copies (zero-filled past src_bytes) and 8x8 matrix
/// loads, each addressed by a pointer or by its shared-window address (shared_address), which
/// address arithmetic such as an XOR swizzle works on.
__device__ __forceinline__ std::uint32_t shared_address(const void* smem) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
}
__device__ __forceinline__ void cp_async16(std::uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  cp_async16(shared_address(smem), gmem, src_bytes);
}
/// 4-byte asynchronous copy (for data that is only 4-byte aligned); cached in L1 as well, the only
/// form cp.async offers below 16 bytes.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t smem, std::uint32_t& r0, std::uint32_t& r1, std::uint32_t& r2,
                                            std::uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem) : "memory");
}
/// N (1, 2 or 4) transposed 8x8 matrices into r[0..N): matrix m's row addresses from lanes
/// 8m..8m+7.
template <int N>
__device__ __forceinline__ void ldmatrix_trans(std::uint32_t smem, std::uint32_t* r) {
  if constexpr (N == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem) : "memory");
  } else if constexpr (N == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem) : "memory");
  } else {
    static_assert(N == 4, "ldmatrix_trans: 1, 2 or 4 matrices");
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem) : "memory");
  }
}
template <int N>
__device__ __forceinline__ void ldmatrix_trans(const void* smem, std::uint32_t* r) {
  ldmatrix_trans<N>(shared_address(smem), r);
}

/// The transpose of an 8x8 matrix of 16-bit elements held in the warp as C-like fragments (lane l
/// holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1): lane l receives row l / 4 of the
/// transpose. A C fragment of rows (tokens) x columns becomes a B fragment of the same matrix.
__device__ __forceinline__ std::uint32_t transpose_8x8(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace qevict::kernels::warp

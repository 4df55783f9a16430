#pragma once
// Split-K: the merge of a (sequence, KV head)'s chunks into each query head's log-sum-exp and
// output, and the counters through which the window-mass kernel learns that a sequence's
// log-sum-exps are written.

#include <cuda_runtime.h>

#include <cstddef>

#include "qevict/kernels/decode/common.cuh"
#include "qevict/kernels/decode/layout.cuh"
#include "qevict/kernels/dependent_launch.cuh"

namespace qevict::kernels::detail {

/// A chunk's factor for its partial output of one query head, exp2(m_chunk - LSE): 0 for a chunk
/// that saw no token of that head (m_chunk = -inf).
__device__ __forceinline__ float chunk_factor(float m_chunk, float lse) { return m_chunk == -INFINITY ? 0.f : exp2_sfu(m_chunk - lse); }

/// A query head's log-sum-exp (log2 units) over its tokens, M + log2(l) for a running maximum M and
/// sum l of 2^(s - M), as decode_arguments::part_lse keeps it: 0 for a head without tokens, whose
/// window masses are all log2(0) = -inf, so that 2^(mass - LSE) is 0 rather than 2^(-inf + inf).
__device__ __forceinline__ float head_lse(float M, float l) { return l > 0.f ? M + log2f(l) : 0.f; }

/// The two counters of sequence b (decode_arguments::mass_signals): [0] its KV heads whose
/// log-sum-exps are written, [1] the mass kernel's CTAs of b that have seen all of them. After a
/// launch of several chunks a pair the mass kernel starts under the decode grid's last wave and its
/// CTAs wait for their own sequence only, so that the masses of the sequences that are done are
/// summed while the grid's last CTAs still run, instead of after the whole grid.
__device__ __forceinline__ unsigned* mass_signals(const decode_arguments& A, int b) { return A.mass_signals + 1 + 2 * b; }

/// The mass kernel's last act, by every thread of a CTA: the grid's last CTA to finish waits for the
/// decode grid to end before it exits. Its CTAs wait only for their own sequences' merges, and the
/// decode CTAs still write their outputs after that, so without this the mass kernel could end
/// before the decode kernel, and a kernel launched as its dependent would wait for the mass kernel
/// alone. The grid's last CTA resets the count for the next launch.
__device__ __forceinline__ void end_after_decode_grid(const decode_arguments& A) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(A.mass_signals, 1u) == gridDim.x * gridDim.y - 1) {
    A.mass_signals[0] = 0u;
    grid::wait_for_previous_kernel();
  }
}

/// Called by one thread of the CTA that wrote (sequence b, KV head)'s log-sum-exps, after a barrier
/// behind those writes. Release, cumulative over that barrier and over what the CTA acquired
/// through its ticket (the other chunks' masses): a mass CTA that acquires the count sees them all.
__device__ __forceinline__ void signal_lse_written(const decode_arguments& A, int b) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(mass_signals(A, b)) : "memory");
}

/// The mass kernel's wait for sequence b, by every thread of the CTA (one polls): returns once all
/// L.kv_heads log-sum-exps of b, and every mass of b, are written and visible. The sequence's last
/// CTA to pass sets both counters back to zero for the next launch: every CTA of b has then stopped
/// reading them, and the next launch is ordered after this one by the stream.
__device__ __forceinline__ void wait_for_lse_written(const decode_layout& L, const decode_arguments& A, int b) {
  if (threadIdx.x == 0) {
    unsigned* s = mass_signals(A, b);
    // Polled with relaxed loads, then one acquire fence: an acquire empties the SM's L1, under
    // the decode CTAs that still run there.
    for (;;) {
      unsigned n;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(s) : "memory");
      if (n >= static_cast<unsigned>(L.kv_heads)) break;
      __nanosleep(256);
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire
    if (atomicAdd(s + 1, 1u) == gridDim.x - 1) {
      s[0] = 0u;
      s[1] = 0u;
    }
  }
  __syncthreads();
}

/// The merge of one (sequence b, KV head h)'s `n_chunks` partials by one CTA of the decode kernel:
/// each query head's log-sum-exp over the chunks (EmitMass: into part_lse, for decode_mass_kernel),
/// and its output, the chunks' partials weighted by their factors exp2(m_chunk - LSE). factor_s: n_chunks * group
/// floats of shared memory (decode_attention checks that they fit). Partials are read from L2
/// (ld.global.cg): other SMs wrote them.
template <int D, bool EmitMass>
__device__ __forceinline__ void merge_chunks(const decode_layout& L, const decode_arguments& A, int b, int h, int n_chunks,
                                             float* factor_s) {
  const int G = L.group;
  const std::size_t row0 = (static_cast<std::size_t>(b) * L.kv_heads + h) * A.max_chunks;
  // Log-sum-exp: 16 lanes per head, each over every 16th chunk, so that the loads of all chunks
  // are in flight at once; the chunk maxima wait in factor_s for their factors.
  {
    constexpr int span = 16;
    const int hg = static_cast<int>(threadIdx.x) / span, sub = threadIdx.x & (span - 1);
    const bool head = hg < G;
    float M = -INFINITY, S = 0.f;  // running (max, sum of exp2(m - max) * l)
    auto add = [&](float m, float l) {
      if (m == -INFINITY) return;
      if (m > M) {
        S = S * exp2_sfu(M - m) + l;
        M = m;
      } else {
        S += l * exp2_sfu(m - M);
      }
    };
    if (head)
      for (int c = sub; c < n_chunks; c += span) {
        const float2 ml = __ldcg(A.part_ml + (row0 + c) * G + hg);
        factor_s[c * G + hg] = ml.x;
        add(ml.x, ml.y);
      }
#pragma unroll
    for (int o = span / 2; o > 0; o >>= 1) {
      const float m = __shfl_xor_sync(0xffffffffu, M, o), l = __shfl_xor_sync(0xffffffffu, S, o);
      add(m, l);
    }
    const float lse = M + log2f(S);
    if (head) {
      if (EmitMass && sub == 0) A.part_lse[(static_cast<std::size_t>(b) * L.kv_heads + h) * G + hg] = head_lse(M, S);
      for (int c = sub; c < n_chunks; c += span) {
        const float m = factor_s[c * G + hg];
        factor_s[c * G + hg] = chunk_factor(m, lse);
      }
    }
  }
  __syncthreads();
  if (EmitMass && threadIdx.x == 0) signal_lse_written(A, b);
  // Output: four channels of one head per thread and step.
  const float4* part = reinterpret_cast<const float4*>(A.part_o + row0 * G * D);
  float4* out = reinterpret_cast<float4*>(A.out + (static_cast<std::size_t>(b) * L.kv_heads + h) * G * D);
  for (int e = threadIdx.x; e < G * D / 4; e += blockDim.x) {
    const int hg = e / (D / 4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int c = 0; c < n_chunks; ++c) {
      const float4 p = __ldcg(part + static_cast<std::size_t>(c) * G * D / 4 + e);
      const float f = factor_s[c * G + hg];
      acc.x += p.x * f, acc.y += p.y * f, acc.z += p.z * f, acc.w += p.w * f;
    }
    out[e] = acc;
  }
}

}  // namespace qevict::kernels::detail

#pragma once
// Programmatic dependent launch: a kernel launched with launch_dependent may start while the kernel
// before it in the stream is still running, so that its launch latency and the part of its work
// that reads nothing the previous kernel writes overlap that kernel's tail. The dependent kernel
// calls grid::wait_for_previous_kernel() before its first access to the previous kernel's results
// (it returns once that kernel has completed and its writes are visible); the previous kernel may
// call grid::let_next_kernel_start() where the rest of its work no longer needs the SMs to itself.
// Both are no-ops for a kernel launched the ordinary way. Only the order between a dependent launch
// and the kernel right before it is relaxed (that kernel itself started after everything before
// it had finished); CUDA graphs captured from the stream keep the relation.

#include <cuda_runtime.h>

#include <cstddef>

#include "qevict/kernels/check.cuh"

namespace qevict::kernels::grid {

/// Waits until the previous kernel in the stream has completed and its memory is visible.
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

/// Allows the next kernel in the stream (if launched with launch_dependent) to start once every CTA
/// of this grid has called this or exited.
__device__ __forceinline__ void let_next_kernel_start() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

}  // namespace qevict::kernels::grid

namespace qevict::kernels {

/// Launches kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the
/// previous kernel in `stream`; `name` goes into the error of a failed launch.
template <class... Params, class... Args>
void launch_dependent(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...), name, __FILE__, __LINE__);
}

}  // namespace qevict::kernels

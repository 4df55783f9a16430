#pragma once
// Rotary angles on the device. Positions reach 10^5 and more, where a float angle is off by
// 10^-2 rad; the angle is formed and reduced modulo 2*pi in double (like the host backend forms it
// in double), and only the reduced angle goes to the float sine/cosine.

#include <cstdint>

namespace qevict::kernels::thread {

__device__ __forceinline__ double reduced_angle(long long position, double inv_freq) {
  const double a = static_cast<double>(position) * inv_freq;
  const double n = rint(a * 0.15915494309189535);
  double r = fma(-n, 6.283185307179586, a);     // 2*pi, high part
  return fma(-n, 2.4492935982947064e-16, r);    // 2*pi, low part
}

/// cos and sin of position * inv_freq, accurate to float rounding for any position.
__device__ __forceinline__ void rope_cos_sin(long long position, double inv_freq, float& c, float& s) {
  sincosf(static_cast<float>(reduced_angle(position, inv_freq)), &s, &c);
}

/// The same in double (migrations, where the host backend's double rotation is the reference).
__device__ __forceinline__ void rope_cos_sin(long long position, double inv_freq, double& c, double& s) {
  sincos(reduced_angle(position, inv_freq), &s, &c);
}

}  // namespace qevict::kernels::thread

namespace qevict::kernels::thread {

/// cos and sin of position * inv_freq through the hardware sine/cosine on the reduced angle
/// (|angle| <= pi, absolute error about 4e-7): for per-window rotations inside attention, where
/// the full-precision sincosf costs more than the rest of the window's key work.
__device__ __forceinline__ void rope_cos_sin_approx(long long position, double inv_freq, float& c, float& s) {
  __sincosf(static_cast<float>(reduced_angle(position, inv_freq)), &s, &c);
}

}  // namespace qevict::kernels::thread

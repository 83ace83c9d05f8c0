// Sixteen fp32 lanes as one value, with the few operations the CPU kernels need. GCC and Clang
// lower the type to the widest vectors the build target has (one AVX-512 register, two AVX
// ones). Every operation here has one defined result (fused multiply-adds round once, sums run
// in a fixed tree), so a kernel's output does not depend on how the compiler schedules it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace d3d {

constexpr int LANES = 16;
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ilanes __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float lanes4 __attribute__((vector_size(4 * sizeof(float))));
typedef float lanes2 __attribute__((vector_size(2 * sizeof(float))));

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

inline lanes splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes>(_mm512_set1_ps(x));
#else
  lanes v;
  for (int i = 0; i < LANES; ++i) v[i] = x;
  return v;
#endif
}

// a * b + c per lane, rounded once
inline lanes fma(lanes a, lanes b, lanes c) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
#elif defined(__FMA__) && defined(__AVX__)
  __m256 x[2], y[2], z[2];  // two AVX registers' worth
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  std::memcpy(z, &c, sizeof(c));
  for (int i = 0; i < 2; ++i) z[i] = _mm256_fmadd_ps(x[i], y[i], z[i]);
  lanes out;
  std::memcpy(&out, z, sizeof(out));
  return out;
#else
  lanes out;
  for (int i = 0; i < LANES; ++i) out[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return out;
#endif
}

// The lanes' sum in a fixed tree: halves added, then their halves, down to one
inline float hsum(lanes v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  const lanes8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const lanes4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const lanes2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
#else  // the same tree, lane by lane
  float part[LANES];
  std::memcpy(part, &v, sizeof(part));
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  return part[0];
#endif
}

}  // namespace d3d

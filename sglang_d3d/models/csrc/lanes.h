// Sixteen fp32 lanes as one value, with the few operations the CPU kernels need: one AVX-512
// register, two AVX ones (lanes 0-7 and 8-15, written out: GCC keeps a 64-byte vector type on
// the stack where the widest register is 32 bytes, and every operation then goes through
// memory), or the compiler's generic vectors elsewhere. Every operation here has one defined
// result (fused multiply-adds round once, sums run in a fixed tree), so a kernel's output does
// not depend on how the compiler schedules it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace d3d {

constexpr int LANES = 16;
constexpr float ROUNDER = 12582912.0f;  // 1.5 * 2^23: v + R - R is v rounded to even, |v| < 2^22

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
struct lanes {
  __m256 lo, hi;
};
struct ilanes {
  __m256i lo, hi;
};

inline lanes operator+(lanes a, lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline lanes operator*(lanes a, lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline lanes operator*(float s, lanes b) {
  const __m256 v = _mm256_set1_ps(s);
  return {_mm256_mul_ps(v, b.lo), _mm256_mul_ps(v, b.hi)};
}
inline lanes& operator+=(lanes& a, lanes b) { return a = a + b; }

inline lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline lanes to_float(ilanes v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }

// a * b + c per lane, rounded once
inline lanes fma(lanes a, lanes b, lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// The lanes' sum in a fixed tree: halves added, then their halves, down to one
inline float hsum(lanes v) {
  const __m256 a = _mm256_add_ps(v.lo, v.hi);  // v[i] + v[i + 8]
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // a[i] + a[i + 4]
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // b[i] + b[i + 2]
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));  // c[0] + c[1]
}
#else
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

inline lanes to_float(ilanes v) { return __builtin_convertvector(v, lanes); }

// a * b + c per lane, rounded once
inline lanes fma(lanes a, lanes b, lanes c) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
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
#endif

#if defined(__AVX512F__)
// hsum's last three rounds for 16 outputs at once (the scores of 16 keys; block_mm.cpp's
// panels, whose lanes hold 8 blocks): v holds output i's 8 lanes at v + 8 i, 64-byte aligned.
// The same additions as hsum's (lanes i and i + 4, then i and i + 2, then 0 and 1), each on the
// same two values, so the same bits; they run across outputs, 22 instructions for 16 outputs
// where one output's rounds take 6. The first `count` outputs go to y.
inline void hsum8_x16(const float* v, int count, float* y) {
  __m512 a[4], b[2];
  for (int k = 0; k < 4; ++k) {  // chunk j of a[k]: lanes i + i + 4 (i < 4) of output 4 k + j
    const __m512 u = _mm512_load_ps(v + 32 * k), w = _mm512_load_ps(v + 32 * k + 16);
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int k = 0; k < 2; ++k)  // chunk j of b[k]: outputs 8 k + j and 8 k + 4 + j, 2 lanes each
    b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4 j + l: output j + 4 l
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << count) - 1), _mm512_permutexvar_ps(order, t));
}
#endif

// e^x in fp32, for the softmax and SiLU: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts so
// that r is exact), e^r by Cephes' expf polynomial, times 2^n. On every 64th float in
// [-87, 88] it is within 1.3 ulp of e^x in double; x is clamped there (beyond, e^x is 0 or
// infinite in what follows). Fused multiply-adds round once and nothing is reassociated, so a
// vectorised loop gives the scalar loop's bits.
// Written here, not through ATen: inside a plain step of the default target, ATen's SiLU gate
// took 12.7 us a layer and its softmax 4.4, mostly the calls' own cost at one query's size.
inline float exp_fp32(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + ROUNDER) - ROUNDER;  // nearest integer, ties to even
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// sum a[i] * b[i] for n a multiple of LANES: LANES running sums, then the tree
inline float dot(const float* a, const float* b, int64_t n) {
  lanes acc = {};
  for (int64_t i = 0; i < n; i += LANES) acc += load(a + i) * load(b + i);
  return hsum(acc);
}

}  // namespace d3d

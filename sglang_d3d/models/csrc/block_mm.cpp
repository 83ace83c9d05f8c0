// Matrix products on a GGUF's own block weights: Q4_1 (w = d q + m: 4-bit q, fp16 d and m per
// block of 32 inputs) and Q8_0 (w = d q: int8 q, fp16 d per block), read as stored.
//
// Q4_1 (q4_mm), the target's projections: the products run on integers. Each input row is
// rounded per block of 32 to 14-bit integers (x ~ dx * xq, |xq| <= 16256 = 127 * 128, dx the
// block's largest magnitude / 16256, xq = x * (16256 / largest) rounded to even), split as
// xq = 128 h + l into two bytes, and each block's sum of q * xq is exact in int32: AVX-512
// VNNI byte dot products over two weight rows at once, AVX-VNNI ones over one, AVX2 byte
// multiply-adds through int16 (the AVX2 section says why they stay exact), or the same sums in
// plain C++. Per block, that sum times the fp32 product d * dx, plus m times the block's
// dx * sum(xq), accumulates in fp32 in a fixed order, so every path gives the same bits. The
// weights are the file's exactly, and the activations keep 14 bits of each block's range
// (bf16 keeps 8 of each value). Rounding inputs to 8 bits instead (one byte dot product per
// weight byte, not two) saved about 7% of SmolLM2-135M's layer time here, side by side, so
// the 14 bits stay for every pass whose outputs must equal a plain step's.
//
// `coarse` (a drafter's passes, whose outputs only propose): each 14-bit integer is rounded on
// to a multiple of 128 (h' = h + (l >= 64), l = 0), so xq keeps 8 bits of its block's range.
// The same sums then need no l products, and the AVX-512 pair kernel skips them; every other
// path multiplies the zero l bytes, so all paths still give the same bits.
//
// Q8_0 (q8_mm), the LM head: fp32 activations, each weight d q formed exactly in fp32, 16
// running fp32 sums (fused multiply-adds) added in a fixed tree.
//
// Nothing depends on which other rows share a call or on the thread count, so an output is
// bitwise the same for 1 row or 512. Rows share each weight block's decode in tiles, which is
// what makes a verify pass of several rows cheaper than as many single-row steps. With AVX-512,
// a panel's outputs are reduced 16 at a time at its end (lanes.h hsum8_x16): reducing each pair of
// weight rows as it finished took about 15% of the layers' products at 1 to 16 input rows.

#include "block_mm.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "lanes.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace d3d {
namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t OCTET = 8;  // blocks whose sums share one 8-lane register
constexpr int64_t OCTET_BYTES = OCTET * BLOCK / 2;  // one octet's 4-bit weights: 4 chunks of 32
constexpr int64_t XQ_BYTES = 4 * 4 * 32;  // one octet's activation bytes: 4 chunks of 4 parts
constexpr int XQ_MAX = 127 * 128;  // |xq|: h = xq >> 7 and l = xq & 127 both fit a signed byte
constexpr int TILE = 4;  // input rows that share one decode of a weight octet
constexpr int64_t GRAIN = 16;  // weight rows per parallel task, at least
constexpr int64_t SCALE_ROWS = 64;  // Q8_0 rows whose scales are converted to fp32 at once
constexpr int64_t PANEL = 16;  // weight rows (about 15 KB at K = 1536) that meet a tile of input rows in turn
constexpr int64_t PREFETCH = 2048;  // bytes of weights fetched ahead (1-16 KB measured alike; none is slower)

// ---------------------------------------------------------------------------------------
// Q4_1 weights, as q4_mm reads them (packed by models/q4_linear.py): each row's blocks in
// octets of 8. An octet is 4 chunks of 32 bytes; byte 4 j + i of chunk c is byte 4 c + i of
// block j (whose low nibble is input 4 c + i, high nibble input 16 + 4 c + i), so lane j of a
// chunk's byte dot product sums block j. The last octet may hold t < 8 blocks: its chunks are
// 4 t bytes long, and lanes t..7 meet zero activations. The d and m of all rows are arrays of
// their own; every array ends in zeros the kernel may read past the last row (block_mm.h).

// One input row, rounded for the integer products. bytes: per octet, each chunk's 4 parts of
// 32 (the h and l bytes of the inputs meeting the low nibbles, then of those meeting the high
// ones), laid out as the weight chunk, at part_at; dx [octets * 8] the blocks' scales and
// xs [octets * 8] dx * sum(xq) (zero past the last block).
struct Rounded {
  int8_t* bytes;
  float* dx;
  float* xs;
  int8_t* tail;  // a last octet of t <= 2 blocks, its 4 parts packed (tail_bytes)
};

constexpr int64_t TAIL_BYTES = 4 * 32;

// The rounded rows start on cache lines (their strides are whole lines), where std::vector's
// storage is only 16-byte aligned: the AVX-512 pair kernel loads their bytes 64 at a time, and
// a load that straddles two lines costs two
constexpr int64_t CACHE_LINE = 64;

template <typename T>
T* line_aligned(T* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>((at + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE);
}

// Whether a path reads Rounded::tail: q4 rows on AVX2 byte multiply-adds, and weight-row
// pairs on AVX-512 VNNI
#if (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVXVNNI__)) || \
    (defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__))
constexpr bool SHORT_TAILS = true;
#else
constexpr bool SHORT_TAILS = false;
#endif

// Where the AVX-512 pair kernel runs, an octet's input bytes go chunk pair by chunk pair: part p
// of chunks 2q and 2q + 1 side by side in one 64-byte line, so that one aligned load meets a
// 64-byte load of one weight row's two chunks. Against a 32-byte load broadcast to both halves
// of a register for two weight rows, the layer loop took 0.82-0.98x the time at 5 and 9 rows
// and the same at 1 (benchmarks/bench_layers_ab.py; docs/benchmarks.md, "Chunk pairs").
// Elsewhere each chunk's 4 parts follow one another. Every path reads the bytes through part_at.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool CHUNK_PAIRS = true;
#else
constexpr bool CHUNK_PAIRS = false;
#endif

// The offset of part p of chunk c within an octet's input bytes
constexpr int64_t part_at(int c, int p) { return CHUNK_PAIRS ? (c / 2) * 256 + p * 64 + (c % 2) * 32 : c * 128 + p * 32; }

// From a part to the next (an h byte to its l byte)
constexpr int64_t PART_STRIDE = part_at(0, 1) - part_at(0, 0);

// A last octet of t <= 2 blocks holds 4 t bytes a chunk, so its 4 chunks fill one 32-byte load
// of weights. tail part p (h and l bytes against low nibbles, then against high ones) is that
// octet's part p of chunks 0-3 side by side, 4 t bytes each, to meet that load; zeros after.
void tail_bytes(const int8_t* oct, int64_t t, int8_t* tail) {
  for (int part = 0; part < 4; ++part)
    for (int c = 0; c < 4; ++c) std::memcpy(tail + part * 32 + c * 4 * t, oct + part_at(c, part), 4 * t);
}

// Where block j of an octet keeps input i's h byte: part (chunk, nibble) at j's 4 bytes; the
// l byte lies PART_STRIDE bytes on
inline int64_t h_at(int i, int64_t j) {
  const int nib = i / 16, c = (i % 16) / 4, b = i % 4;  // high nibble?, chunk, byte
  return part_at(c, 2 * nib) + 4 * j + b;
}


// One block of 32 inputs -> its 14-bit integers in the octet's bytes; -> sum(xq), *amax
int32_t round_block_plain(const float* xb, int8_t* oct, int64_t j, float* amax_out) {
  float amax = 0.0f;
  for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float inv = amax > 0.0f ? static_cast<float>(XQ_MAX) / amax : 0.0f;
  int32_t sum = 0;
  for (int i = 0; i < BLOCK; ++i) {
    const float v = std::clamp(xb[i] * inv, -static_cast<float>(XQ_MAX), static_cast<float>(XQ_MAX));
    const int32_t xq = static_cast<int32_t>((v + ROUNDER) - ROUNDER);
    sum += xq;
    oct[h_at(i, j)] = static_cast<int8_t>(xq >> 7);  // h (arithmetic shift: floor)
    oct[h_at(i, j) + PART_STRIDE] = static_cast<int8_t>(xq & 127);  // l
  }
  *amax_out = amax;
  return sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// The same integers with AVX-512: the maximum and integer sum are exact in any order, the
// product and clamp are the same fp32 operations, and the conversion rounds to even as above
int32_t round_block(const float* xb, int8_t* oct, int64_t j, float* amax_out) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.0f ? static_cast<float>(XQ_MAX) / amax : 0.0f;
  const __m512 lim = _mm512_set1_ps(static_cast<float>(XQ_MAX)), neg = _mm512_set1_ps(-static_cast<float>(XQ_MAX));
  const __m512 vi = _mm512_set1_ps(inv);
  int32_t sum = 0;
  const __m512 halves[2] = {a, b};
  for (int nib = 0; nib < 2; ++nib) {  // inputs 16 nib .. 16 nib + 15: chunks 0-3 of one nibble
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(halves[nib], vi), neg), lim);
    const __m512i xq = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    sum += _mm512_reduce_add_epi32(xq);
    alignas(16) int8_t h[16], l[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(xq, 7)));
    _mm_store_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtepi32_epi8(_mm512_and_si512(xq, _mm512_set1_epi32(127))));
    for (int c = 0; c < 4; ++c) {
      std::memcpy(oct + h_at(16 * nib + 4 * c, j), h + 4 * c, 4);
      std::memcpy(oct + h_at(16 * nib + 4 * c, j) + PART_STRIDE, l + 4 * c, 4);
    }
  }
  *amax_out = amax;
  return sum;
}
#elif defined(__AVX2__)
// The same integers with AVX2, as the AVX-512 version says
inline float max8(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}

// 16 int32 (a: the first 8) in [-128, 127] -> 16 bytes, in order
inline __m128i bytes16(__m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

int32_t round_block(const float* xb, int8_t* oct, int64_t j, float* amax_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(xb + 8 * i);
  const float amax = max8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3]))));
  const float inv = amax > 0.0f ? static_cast<float>(XQ_MAX) / amax : 0.0f;
  const __m256 lim = _mm256_set1_ps(static_cast<float>(XQ_MAX)), neg = _mm256_set1_ps(-static_cast<float>(XQ_MAX));
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i xq[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x[i], vi), neg), lim);
    xq[i] = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    total = _mm256_add_epi32(total, xq[i]);
  }
  for (int nib = 0; nib < 2; ++nib) {  // inputs 16 nib .. 16 nib + 15: chunks 0-3 of one nibble
    const __m256i a = xq[2 * nib], b = xq[2 * nib + 1], low7 = _mm256_set1_epi32(127);
    alignas(16) int8_t h[16], l[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(h), bytes16(_mm256_srai_epi32(a, 7), _mm256_srai_epi32(b, 7)));
    _mm_store_si128(reinterpret_cast<__m128i*>(l), bytes16(_mm256_and_si256(a, low7), _mm256_and_si256(b, low7)));
    for (int c = 0; c < 4; ++c) {
      std::memcpy(oct + h_at(16 * nib + 4 * c, j), h + 4 * c, 4);
      std::memcpy(oct + h_at(16 * nib + 4 * c, j) + PART_STRIDE, l + 4 * c, 4);
    }
  }
  alignas(32) int32_t lanes8[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes8), total);
  int32_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += lanes8[i];
  *amax_out = amax;
  return sum;
}
#else
int32_t round_block(const float* xb, int8_t* oct, int64_t j, float* amax_out) {
  return round_block_plain(xb, oct, j, amax_out);
}
#endif

// A block's 14-bit integers (in its octet's bytes) -> multiples of 128: h' = h + (l >= 64)
// stays within [-127, 127] (|xq| <= 127 * 128, so h = 127 comes with l = 0), l' = 0;
// -> the new sum(xq)
int32_t coarsen_block(int8_t* oct, int64_t j) {
  int32_t sum = 0;
  for (int i = 0; i < BLOCK; ++i) {
    int8_t* h = oct + h_at(i, j);
    *h = static_cast<int8_t>(*h + (h[PART_STRIDE] >= 64 ? 1 : 0));
    h[PART_STRIDE] = 0;
    sum += 128 * static_cast<int32_t>(*h);
  }
  return sum;
}

// out's buffers arrive zeroed (q4_mm's vectors), so a last octet's missing blocks stay zero
void round_row(const float* x, int64_t groups, Rounded out, bool portable, bool coarse) {
  for (int64_t g = 0; g < groups; ++g) {
    int8_t* oct = out.bytes + (g / OCTET) * XQ_BYTES;
    float amax;
    int32_t sum = portable ? round_block_plain(x + g * BLOCK, oct, g % OCTET, &amax)
                           : round_block(x + g * BLOCK, oct, g % OCTET, &amax);
    if (coarse) sum = coarsen_block(oct, g % OCTET);
    out.dx[g] = amax / static_cast<float>(XQ_MAX);
    out.xs[g] = out.dx[g] * static_cast<float>(sum);  // the integer sum is exact in fp32 (< 2^24)
  }
  const int64_t t = groups % OCTET;
  if (SHORT_TAILS && !portable && t > 0 && t <= 2) tail_bytes(out.bytes + (groups / OCTET) * XQ_BYTES, t, out.tail);
}

// The 8 lanes' sum in a fixed tree (halves, quarters, then the last two), as hsum8 of the
// vector path computes it
inline float hsum8(const float* v) {
  float a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = v[i] + v[i + 4];
  for (int i = 0; i < 2; ++i) b[i] = a[i] + a[i + 2];
  return b[0] + b[1];
}

// Lane j of an octet accumulates total_j += float(sum of q * xq) * (d * dx) and
// mt_j += m * xs over the octets; the output is hsum8(total + mt). The portable path computes
// the same sums element by element.
void q4_row_portable(const Rounded* xr, int rows, const uint8_t* w, const at::Half* d, const at::Half* m,
                     int64_t groups, float* y, int64_t ldy) {
  const int64_t full = groups / OCTET, octets = (groups + OCTET - 1) / OCTET;
  for (int r = 0; r < rows; ++r) {
    float total[OCTET] = {}, mt[OCTET] = {};
    for (int64_t o = 0; o < octets; ++o) {
      const int64_t lanes_here = o < full ? OCTET : groups - full * OCTET, stride = 4 * lanes_here;
      const int8_t* xb = xr[r].bytes + o * XQ_BYTES;
      for (int64_t j = 0; j < lanes_here; ++j) {
        int32_t sum = 0;
        for (int c = 0; c < 4; ++c)
          for (int b = 0; b < 4; ++b) {
            const int32_t byte = w[o * OCTET_BYTES + c * stride + 4 * j + b];
            const int8_t* x = xb + 4 * j + b;
            sum += (byte & 15) * (128 * x[part_at(c, 0)] + x[part_at(c, 1)]) +
                   (byte >> 4) * (128 * x[part_at(c, 2)] + x[part_at(c, 3)]);
          }
        const int64_t g = o * OCTET + j;
        const float dw = static_cast<float>(d[g]), mw = static_cast<float>(m[g]);
        total[j] = std::fma(static_cast<float>(sum), dw * xr[r].dx[g], total[j]);
        mt[j] = std::fma(mw, xr[r].xs[g], mt[j]);
      }
    }
    for (int j = 0; j < OCTET; ++j) total[j] += mt[j];
    y[r * ldy] = hsum8(total);
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr bool VECTOR = true;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // v[i] + v[i + 4]
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // a[i] + a[i + 2]
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));  // b[0] + b[1]
}

// An empty instruction that "changes" v, so that the int16 sums below run in the order written:
// GCC otherwise reassociates them, forms all of an octet's products first and spills them to
// the stack
template <typename V>
inline void settle(V& v) {
  __asm__("" : "+x"(v));
}

inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m128 load_half4(const at::Half* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

#if defined(__AVXVNNI__)
// One weight row against R rounded input rows, with AVX-VNNI byte dot products (u8 nibbles
// times s8 h and l bytes, 4 products a lane summed into int32)
template <int R>
void q4_row_vec(const Rounded* xr, const uint8_t* w, const at::Half* d, const at::Half* m,
                int64_t groups, float* y, int64_t ldy) {
  const int64_t full = groups / OCTET, octets = (groups + OCTET - 1) / OCTET;
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 total[R], mt[R];
  for (int r = 0; r < R; ++r) total[r] = mt[r] = _mm256_setzero_ps();
  for (int64_t o = 0; o < octets; ++o) {
    const uint8_t* wo = w + o * OCTET_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(wo + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wo + PREFETCH + 64), _MM_HINT_T0);
    const int64_t stride = o < full ? 32 : 4 * (groups - full * OCTET);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(wo + c * stride);
      lo[c] = _mm256_and_si256(v, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    const __m256 dw = load_half8(d + o * OCTET), mw = load_half8(m + o * OCTET);
#pragma GCC unroll 4  // whole: a rolled loop keeps total and mt on the stack, each octet waiting on a store
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr[r].bytes + o * XQ_BYTES;
      __m256i acc[4] = {};  // four independent chains (h and l bytes against low and high nibbles)
      for (int c = 0; c < 4; ++c)
        for (int part = 0; part < 4; ++part)
          acc[part] = _mm256_dpbusd_avx_epi32(acc[part], part < 2 ? lo[c] : hi[c], load32(xb + part_at(c, part)));
      const __m256i ah = _mm256_add_epi32(acc[0], acc[2]), al = _mm256_add_epi32(acc[1], acc[3]);
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ah, 7), al));  // exact
      const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(xr[r].dx + o * OCTET));
      total[r] = _mm256_fmadd_ps(sum, scale, total[r]);
      mt[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xr[r].xs + o * OCTET), mt[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum8(_mm256_add_ps(total[r], mt[r]));
}
#else
// AVX2 has no byte dot product into int32: u8 x s8 pairs sum into int16 (maddubs), which stays
// exact here. A nibble is at most 15 and a byte at most 127 in magnitude (|h| <= 127, l in
// [0, 127]), so a pair is at most 3810 and the 8 pairs a lane meets per part (4 chunks, both
// nibbles) at most 30480 < 2^15: the int16 sums neither saturate nor wrap, and one multiply-add
// by ones then gives each 4-byte lane the same int32 as the VNNI path.
//
// P weight rows' Q4_1 operands, and their running fp32 sums against R input rows
template <int P, int R>
struct RowSums {
  const uint8_t* w[P];
  const at::Half* d[P];
  const at::Half* m[P];
  __m256 total[P][R], mt[P][R];
};

// Octet o of P weight rows (chunks `stride` bytes apart) against R rounded input rows, the same
// sums as with AVX-VNNI, added into total and mt: each chunk's nibbles are decoded once and
// meet every input row before the next chunk (all of an octet's nibbles at once, as the VNNI
// kernel holds them, do not fit the sixteen AVX registers beside the sums).
template <int P, int R>
__attribute__((always_inline)) inline void octet_avx2(const Rounded* xr, int64_t o, int64_t stride,
                                                      RowSums<P, R>& s) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i h[P][R], l[P][R];  // int16 sums of q * h and q * l
  for (int p = 0; p < P; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(s.w[p] + o * OCTET_BYTES + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s.w[p] + o * OCTET_BYTES + PREFETCH + 64), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) h[p][r] = l[p][r] = _mm256_setzero_si256();
  }
  for (int c = 0; c < 4; ++c) {
    __m256i lo[P], hi[P];
    for (int p = 0; p < P; ++p) {
      const __m256i v = load32(s.w[p] + o * OCTET_BYTES + c * stride);
      lo[p] = _mm256_and_si256(v, low4);
      hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xr[r].bytes + o * XQ_BYTES;
      const __m256i xh = load32(x + part_at(c, 0)), xl = load32(x + part_at(c, 1));
      const __m256i xh2 = load32(x + part_at(c, 2)), xl2 = load32(x + part_at(c, 3));
      for (int p = 0; p < P; ++p) {
        h[p][r] = _mm256_add_epi16(h[p][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xh),
                                                             _mm256_maddubs_epi16(hi[p], xh2)));
        l[p][r] = _mm256_add_epi16(l[p][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl),
                                                             _mm256_maddubs_epi16(hi[p], xl2)));
        settle(h[p][r]);
        settle(l[p][r]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const __m256 dw = load_half8(s.d[p] + o * OCTET), mw = load_half8(s.m[p] + o * OCTET);
    for (int r = 0; r < R; ++r) {
      const __m256i ah = _mm256_madd_epi16(h[p][r], ones), al = _mm256_madd_epi16(l[p][r], ones);
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ah, 7), al));  // exact
      const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(xr[r].dx + o * OCTET));
      s.total[p][r] = _mm256_fmadd_ps(sum, scale, s.total[p][r]);
      s.mt[p][r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xr[r].xs + o * OCTET), s.mt[p][r]);
    }
  }
}

// A last octet of t <= 2 blocks (o = the octet, its chunks 4 t bytes apart): all 4 chunks in
// one 32-byte register against the rows' tail bytes, a quarter of octet_avx2's work. A lane
// of 4 bytes then holds one chunk's sum for one block (chunk c, block j at lane c t + j); the
// integer sums over chunks are exact in any order, and lanes 0 .. t - 1 of total and mt take
// the same fp32 steps as in octet_avx2. Lanes t .. 7 are left as they are, where octet_avx2
// would add zero products to them (the plain loop skips them), so outputs differ at most in
// the sign of an exact zero.
template <int P, int R>
__attribute__((always_inline)) inline void short_tail_avx2(const Rounded* xr, int64_t o, int64_t t, RowSums<P, R>& s) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int p = 0; p < P; ++p) {
    const __m256i v = load32(s.w[p] + o * OCTET_BYTES);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m128 dw = load_half4(s.d[p] + o * OCTET), mw = load_half4(s.m[p] + o * OCTET);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xr[r].tail;
      const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(x)), _mm256_maddubs_epi16(hi, load32(x + 64)));
      const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(x + 32)), _mm256_maddubs_epi16(hi, load32(x + 96)));
      const __m256i a = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h, ones), 7), _mm256_madd_epi16(l, ones));
      __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));  // chunks c and c + 2
      b = _mm_add_epi32(b, _mm_unpackhi_epi64(b, b));  // t = 2: lanes 0 and 1 are the blocks' sums
      if (t == 1) b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 1));  // t = 1: lane 0
      const __m128 sum = _mm_cvtepi32_ps(b);
      const __m128 scale = _mm_mul_ps(dw, _mm_loadu_ps(xr[r].dx + o * OCTET));
      const __m128 tt = _mm_fmadd_ps(sum, scale, _mm256_castps256_ps128(s.total[p][r]));
      const __m128 u = _mm_fmadd_ps(mw, _mm_loadu_ps(xr[r].xs + o * OCTET), _mm256_castps256_ps128(s.mt[p][r]));
      if (t == 1) {
        s.total[p][r] = _mm256_blend_ps(s.total[p][r], _mm256_castps128_ps256(tt), 0x01);
        s.mt[p][r] = _mm256_blend_ps(s.mt[p][r], _mm256_castps128_ps256(u), 0x01);
      } else {
        s.total[p][r] = _mm256_blend_ps(s.total[p][r], _mm256_castps128_ps256(tt), 0x03);
        s.mt[p][r] = _mm256_blend_ps(s.mt[p][r], _mm256_castps128_ps256(u), 0x03);
      }
    }
  }
}

// P adjacent weight rows (row_bytes apart, their scales `groups` apart) against R rounded input
// rows -> y[r * ldy + p]
template <int P, int R>
void q4_block_avx2(const Rounded* xr, const uint8_t* w, int64_t row_bytes, const at::Half* d, const at::Half* m,
                   int64_t groups, float* y, int64_t ldy) {
  const int64_t full = groups / OCTET, tail = groups - full * OCTET;
  RowSums<P, R> s;
  for (int p = 0; p < P; ++p) {
    s.w[p] = w + p * row_bytes;
    s.d[p] = d + p * groups;
    s.m[p] = m + p * groups;
    for (int r = 0; r < R; ++r) s.total[p][r] = s.mt[p][r] = _mm256_setzero_ps();
  }
  for (int64_t o = 0; o < full; ++o) octet_avx2(xr, o, 32, s);
  if (tail > 2) octet_avx2(xr, full, 4 * tail, s);
  else if (tail > 0) short_tail_avx2(xr, full, tail, s);
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) y[r * ldy + p] = hsum8(_mm256_add_ps(s.total[p][r], s.mt[p][r]));
}

template <int R>
void q4_row_vec(const Rounded* xr, const uint8_t* w, const at::Half* d, const at::Half* m,
                int64_t groups, float* y, int64_t ldy) {
  q4_block_avx2<1, R>(xr, w, 0, d, m, groups, y, ldy);
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool PAIRS = true;
constexpr int PAIR_ROWS = 4 * TILE;  // input rows up to which weight rows go in pairs, tile by tile
// Input rows that share one decode of a weight-row pair's octet. Against tiles of 4 (and four
// chains a row), over the default target's 30 layers' projections at 1 thread, 0.96x / 0.93x /
// 0.92x the time at 5 / 9 / 16 rows and the same at 1 (benchmarks/bench_kernels_ab.py); rows
// 5-8 of a pass (a verify of 4 and its root, a drafter block) no longer pay a second decode.
constexpr int PAIR_TILE = 8;

// a's 32 bytes in the low half, b's in the high
inline __m512i pair32(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}

inline __m512 half_pair(const at::Half* a, const at::Half* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// A register of 4-bit weights as its low nibbles' bytes and its high ones'
struct Nibbles {
  __m512i lo, hi;
};

inline Nibbles nibbles(__m512i v) {
  const __m512i low4 = _mm512_set1_epi8(15);
  return {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
}

// One weight row's octet chunks c and c + 1 (`stride` bytes apart) in one register. line: w
// and chunk c + 1 lie in one cache line; elsewhere (a row of 576 inputs is 288 bytes, so every
// other one starts mid-line) two 32-byte loads, which never straddle two lines
inline Nibbles chunk_pair(const uint8_t* w, int64_t stride, bool line) {
  return nibbles(line ? _mm512_load_si512(w) : pair32(w, w + stride));
}

// A row's lanes for its two 32-byte halves (chunk 2q in lanes 0-7, 2q + 1 in 8-15) of weight
// rows a and b -> a's 8 block sums in lanes 0-7, b's in 8-15 (integers: exact in any order)
inline __m512i fold_halves(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

// The m * xs sums of weight rows a and b over the octets taken whole (lanes as in total), in the
// order the octets come: the same fp32 steps as beside each octet's products, in a loop of
// their own so that, past 4 input rows, the products' loop holds one running sum a row, not two
template <int R>
inline void min_sums(const Rounded* xr, const at::Half* ma, const at::Half* mb, int64_t octets, __m512* mt) {
  for (int64_t o = 0; o < octets; ++o) {
    const __m512 mw = half_pair(ma + o * OCTET, mb + o * OCTET);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      mt[r] = _mm512_fmadd_ps(mw, _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r].xs + o * OCTET)), mt[r]);
  }
}

// One input row's block sums (a's 8 blocks in lanes 0-7, b's in 8-15) for one octet of weight
// rows a and b held as chunk pairs: four independent chains, rows a and b each with its h and its
// l bytes' sums (coarse, l = 0: each its h bytes' sums against the low and the high nibbles)
template <bool COARSE>
inline __m512i pair_sums(const int8_t* xb, const Nibbles* a, const Nibbles* b) {
  __m512i ha = _mm512_setzero_si512(), la = ha, hb = ha, lb = ha;
  for (int q = 0; q < 2; ++q) {
    const int8_t* xq = xb + part_at(2 * q, 0);  // this chunk pair's 4 parts, a line each
    const __m512i hl = _mm512_loadu_si512(xq), hh = _mm512_loadu_si512(xq + part_at(0, 2));
    if (COARSE) {
      ha = _mm512_dpbusd_epi32(ha, a[q].lo, hl);
      la = _mm512_dpbusd_epi32(la, a[q].hi, hh);
      hb = _mm512_dpbusd_epi32(hb, b[q].lo, hl);
      lb = _mm512_dpbusd_epi32(lb, b[q].hi, hh);
    } else {
      const __m512i ll = _mm512_loadu_si512(xq + part_at(0, 1)), lh = _mm512_loadu_si512(xq + part_at(0, 3));
      ha = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ha, a[q].lo, hl), a[q].hi, hh);
      la = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(la, a[q].lo, ll), a[q].hi, lh);
      hb = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hb, b[q].lo, hl), b[q].hi, hh);
      lb = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lb, b[q].lo, ll), b[q].hi, lh);
    }
  }
  if (COARSE) return _mm512_slli_epi32(fold_halves(_mm512_add_epi32(ha, la), _mm512_add_epi32(hb, lb)), 7);
  return fold_halves(_mm512_add_epi32(_mm512_slli_epi32(ha, 7), la), _mm512_add_epi32(_mm512_slli_epi32(hb, 7), lb));
}

// pair_sums' result with the weights side by side (side[c]: chunk c of weight rows a and b in
// one register, a's in the low half) and each input part broadcast to both halves of a
// register: for 1 and 2 input rows, whose few loads gain little from chunk pairs, it spares the
// folding (chunk pairs were slightly slower there)
template <bool COARSE>
inline __m512i broadcast_sums(const int8_t* xb, const Nibbles* side) {
  __m512i h = _mm512_setzero_si512(), l = h;
  for (int c = 0; c < 4; ++c) {
    const auto part = [&](int p) { return _mm512_broadcast_i64x4(load32(xb + part_at(c, p))); };
    if (COARSE) {
      h = _mm512_dpbusd_epi32(h, side[c].lo, part(0));
      l = _mm512_dpbusd_epi32(l, side[c].hi, part(2));
    } else {
      h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(h, side[c].lo, part(0)), side[c].hi, part(2));
      l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(l, side[c].lo, part(1)), side[c].hi, part(3));
    }
  }
  return COARSE ? _mm512_slli_epi32(_mm512_add_epi32(h, l), 7) : _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
}

// Two adjacent weight rows a and b at once in AVX-512 registers: one register holds one row's
// chunks c and c + 1, and meets the input bytes of those two chunks (CHUNK_PAIRS: one aligned
// 64-byte load each, shared by both weight rows). Each lane sums one block's products within
// one chunk; the two halves' sums are folded (integers, exact in any order) into a's 8 blocks
// in lanes 0-7 and b's in 8-15, which then take the fp32 steps q4_row_vec's lanes take, so the
// outputs are the same bits. One or two input rows take broadcast_sums instead.
// A last octet of t <= 2 blocks (its chunks 4 t bytes apart) goes in one 32-byte half per row,
// against the rows' tail bytes: a quarter of a full octet's byte products. A lane of 4 bytes
// then holds one chunk's sum for one block (chunk c, block j at lane c t + j of its half), and
// the chunks' integer sums are exact in any order. Lanes 0 .. t - 1 of each half take the full
// octet's fp32 steps; the others are left as they are, where a full octet adds zero products
// to them, so outputs differ at most in the sign of an exact zero (as short_tail_avx2).
template <int R, bool COARSE>
void q4_pair_vnni(const Rounded* xr, const uint8_t* wa, const uint8_t* wb, const at::Half* da,
                  const at::Half* db, const at::Half* ma, const at::Half* mb, int64_t groups, float* lanes,
                  int64_t ld_lanes) {
  const int64_t full = groups / OCTET, tail = groups - full * OCTET;
  const int64_t octets = tail > 2 ? full + 1 : full;  // the octets taken whole
  const bool a_lines = reinterpret_cast<uintptr_t>(wa) % CACHE_LINE == 0;  // octets are 2 lines
  const bool b_lines = reinterpret_cast<uintptr_t>(wb) % CACHE_LINE == 0;
  constexpr bool BROADCAST = R <= 2;
  constexpr bool INLINE_MT = R <= 4;  // registers for both running sums of every row
  __m512 total[R], mt[R];
  for (int r = 0; r < R; ++r) total[r] = mt[r] = _mm512_setzero_ps();
  for (int64_t o = 0; o < octets; ++o) {
    const int64_t at = o * OCTET_BYTES, stride = o < full ? 32 : 4 * tail;
    _mm_prefetch(reinterpret_cast<const char*>(wa + at + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wa + at + PREFETCH + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + at + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + at + PREFETCH + 64), _MM_HINT_T0);
    const bool whole = o < full;
    Nibbles a[2], b[2], side[4];
    if (BROADCAST)
      for (int c = 0; c < 4; ++c) side[c] = nibbles(pair32(wa + at + c * stride, wb + at + c * stride));
    else
      for (int q = 0; q < 2; ++q) {
        a[q] = chunk_pair(wa + at + 2 * q * stride, stride, whole && a_lines);
        b[q] = chunk_pair(wb + at + 2 * q * stride, stride, whole && b_lines);
      }
    const __m512 dw = half_pair(da + o * OCTET, db + o * OCTET), mw = half_pair(ma + o * OCTET, mb + o * OCTET);
#pragma GCC unroll 8  // whole, as in q4_row_vec
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr[r].bytes + o * XQ_BYTES;
      const __m512i exact = BROADCAST ? broadcast_sums<COARSE>(xb, side) : pair_sums<COARSE>(xb, a, b);
      const __m512 sum = _mm512_cvtepi32_ps(exact);  // exact
      const __m512 scale = _mm512_mul_ps(dw, _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r].dx + o * OCTET)));
      total[r] = _mm512_fmadd_ps(sum, scale, total[r]);
      if (INLINE_MT) mt[r] = _mm512_fmadd_ps(mw, _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r].xs + o * OCTET)), mt[r]);
    }
  }
  if (!INLINE_MT) min_sums<R>(xr, ma, mb, octets, mt);
  if (tail > 0 && tail <= 2) {  // the short last octet
    const int64_t at = full * OCTET_BYTES, o = full;
    const auto [lo, hi] = nibbles(pair32(wa + at, wb + at));
    const __m512 dw = half_pair(da + o * OCTET, db + o * OCTET), mw = half_pair(ma + o * OCTET, mb + o * OCTET);
    const __mmask16 keep = tail == 1 ? 0x0101 : 0x0303;  // lanes 0 .. t - 1 of each row's half
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xr[r].tail;
      __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_broadcast_i64x4(load32(x)));
      h = _mm512_dpbusd_epi32(h, hi, _mm512_broadcast_i64x4(load32(x + 64)));
      __m512i l = _mm512_setzero_si512();
      if (!COARSE) {
        l = _mm512_dpbusd_epi32(l, lo, _mm512_broadcast_i64x4(load32(x + 32)));
        l = _mm512_dpbusd_epi32(l, hi, _mm512_broadcast_i64x4(load32(x + 96)));
      }
      __m512i a = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);  // exact
      a = _mm512_add_epi32(a, _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));  // chunks c and c + 2
      a = _mm512_add_epi32(a, _mm512_unpackhi_epi64(a, a));  // t = 2: lanes 0 and 1 of each half
      if (tail == 1) a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_BBBB));  // t = 1: lane 0
      const __m512 sum = _mm512_cvtepi32_ps(a);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r].dx + o * OCTET)));
      total[r] = _mm512_mask3_fmadd_ps(sum, scale, total[r], keep);
      mt[r] = _mm512_mask3_fmadd_ps(mw, _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r].xs + o * OCTET)), mt[r], keep);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_store_ps(lanes + r * ld_lanes, _mm512_add_ps(total[r], mt[r]));
}

// One pair of weight rows against up to PAIR_TILE input rows, its lanes into `lanes`
template <bool COARSE>
void q4_pair_tile(const Rounded* xr, int rows, const uint8_t* wa, int64_t row_bytes, const at::Half* da,
                  const at::Half* ma, int64_t groups, float* lanes, int64_t ld) {
  const uint8_t* wb = wa + row_bytes;
  const at::Half *db = da + groups, *mb = ma + groups;
  switch (rows) {
    case 1: return q4_pair_vnni<1, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 2: return q4_pair_vnni<2, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 3: return q4_pair_vnni<3, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 4: return q4_pair_vnni<4, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 5: return q4_pair_vnni<5, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 6: return q4_pair_vnni<6, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    case 7: return q4_pair_vnni<7, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
    default: return q4_pair_vnni<8, COARSE>(xr, wa, wb, da, db, ma, mb, groups, lanes, ld);
  }
}

// A panel of weight-row pairs against up to PAIR_ROWS input rows: each pair meets every tile
// of input rows in turn while it is in L1, and the weights stream on (prefetched ahead) while
// the later tiles compute. Against tile after tile over the whole panel, the layers' products
// took 11% less time at 5 rows (a verify block of 4 and its root) and 3% at 8 and 16. Each
// pair's lanes go to a buffer, and all outputs are reduced 16 at a time at the end.
void q4_panel_pairs(const Rounded* xr, int rows, const uint8_t* w, int64_t row_bytes, const at::Half* d,
                    const at::Half* m, int64_t groups, int64_t pairs, float* y, int64_t ldy, bool coarse) {
  constexpr int64_t LD = PANEL * OCTET;  // one input row's lanes: 8 per weight row
  alignas(64) float lanes[PAIR_ROWS * LD];
  if (2 * pairs < PANEL) std::memset(lanes, 0, sizeof lanes);  // the outputs past the panel's, unstored
  const auto tile = coarse ? q4_pair_tile<true> : q4_pair_tile<false>;
  for (int64_t p = 0; p < pairs; ++p)
    for (int r0 = 0; r0 < rows; r0 += PAIR_TILE)
      tile(xr + r0, std::min(PAIR_TILE, rows - r0), w + 2 * p * row_bytes, row_bytes, d + 2 * p * groups,
                   m + 2 * p * groups, groups, lanes + r0 * LD + 16 * p, LD);
  for (int r = 0; r < rows; ++r)
    for (int64_t o = 0; o < 2 * pairs; o += 16)
      hsum8_x16(lanes + r * LD + o * OCTET, static_cast<int>(std::min<int64_t>(16, 2 * pairs - o)), y + r * ldy + o);
}
#elif !defined(__AVXVNNI__)
// Two weight rows a step, for a single input row: two independent chains of sums, and each
// input byte loaded once for both
constexpr bool PAIRS = false;
constexpr int PAIR_ROWS = 1;

void q4_pairs(const Rounded* xr, int, const uint8_t* wa, int64_t row_bytes, const at::Half* da,
              const at::Half* ma, int64_t groups, float* y, int64_t ldy) {
  q4_block_avx2<2, 1>(xr, wa, row_bytes, da, ma, groups, y, ldy);
}

// A panel's weight-row pairs one after another (the builds whose pairs reduce their own
// outputs; coarse inputs' zero l bytes are multiplied as any others)
void q4_panel_pairs(const Rounded* xr, int rows, const uint8_t* w, int64_t row_bytes, const at::Half* d,
                    const at::Half* m, int64_t groups, int64_t pairs, float* y, int64_t ldy, bool) {
  for (int64_t p = 0; p < pairs; ++p)
    q4_pairs(xr, rows, w + 2 * p * row_bytes, row_bytes, d + 2 * p * groups, m + 2 * p * groups, groups, y + 2 * p, ldy);
}
#else
constexpr bool PAIRS = false;
constexpr int PAIR_ROWS = 0;

void q4_pairs(const Rounded*, int, const uint8_t*, int64_t, const at::Half*, const at::Half*, int64_t, float*,
              int64_t) {}

void q4_panel_pairs(const Rounded*, int, const uint8_t*, int64_t, const at::Half*, const at::Half*, int64_t, int64_t,
                    float*, int64_t, bool) {}
#endif

void q4_rows(const Rounded* xr, int rows, const uint8_t* w, const at::Half* d, const at::Half* m,
             int64_t groups, float* y, int64_t ldy, bool portable) {
  if (portable) return q4_row_portable(xr, rows, w, d, m, groups, y, ldy);
  switch (rows) {
    case 1: return q4_row_vec<1>(xr, w, d, m, groups, y, ldy);
    case 2: return q4_row_vec<2>(xr, w, d, m, groups, y, ldy);
    case 3: return q4_row_vec<3>(xr, w, d, m, groups, y, ldy);
    default: return q4_row_vec<4>(xr, w, d, m, groups, y, ldy);
  }
}
#else
constexpr bool VECTOR = false;
constexpr bool PAIRS = false;
constexpr int PAIR_ROWS = 0;

void q4_rows(const Rounded* xr, int rows, const uint8_t* w, const at::Half* d, const at::Half* m,
             int64_t groups, float* y, int64_t ldy, bool) {
  q4_row_portable(xr, rows, w, d, m, groups, y, ldy);
}

void q4_pairs(const Rounded*, int, const uint8_t*, int64_t, const at::Half*, const at::Half*, int64_t, float*,
              int64_t) {}

void q4_panel_pairs(const Rounded*, int, const uint8_t*, int64_t, const at::Half*, const at::Half*, int64_t, int64_t,
                    float*, int64_t, bool) {}
#endif

// ---------------------------------------------------------------------------------------
// Q8_0 weights: fp32 products

// 16 bytes -> 16 int32, sign-extended (with the CPU's widening instructions: GCC scalarises a
// vector-extension widening of bytes)
inline ilanes widen(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<ilanes>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && defined(__FMA__)
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
#else
  ilanes v;
  for (int i = 0; i < LANES; ++i) v[i] = p[i];
  return v;
#endif
}

// n fp16 values -> fp32 (exact), with the CPU's conversion instructions where it has them
void half_to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One Q8_0 weight row (qs: groups x 32 int8; d fp32 per block) against R input rows
// x[r * ldx ...] -> y[r * ldy]; two running sums a row (a block's halves), so that
// consecutive multiply-adds do not wait on each other
template <int R>
void q8_row(const float* x, int64_t ldx, const int8_t* qs, const float* d, int64_t groups, float* y,
            int64_t ldy) {
  lanes lo_acc[R] = {}, hi_acc[R] = {};
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 2 == 0) __builtin_prefetch(qs + g * BLOCK + PREFETCH);
    const lanes dv = splat(d[g]);
    const lanes lo = to_float(widen(qs + g * BLOCK)) * dv;  // exact: 8-bit q times fp16 d
    const lanes hi = to_float(widen(qs + g * BLOCK + LANES)) * dv;
    const float* xg = x + g * BLOCK;
    for (int r = 0; r < R; ++r) {
      lo_acc[r] = fma(lo, load(xg + r * ldx), lo_acc[r]);
      hi_acc[r] = fma(hi, load(xg + r * ldx + LANES), hi_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(lo_acc[r] + hi_acc[r]);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512F__)
// q8_row in AVX registers, written out: each 16-lane sum is two registers (lanes 0-7 and 8-15),
// so the operations and their order are q8_row's and the outputs the same bits. Two input rows
// at most: four sums a row and four weight registers fill the sixteen AVX registers.
constexpr bool Q8_AVX2 = true;
constexpr int Q8_TILE = 2;

template <int R>
void q8_row_avx2(const float* x, int64_t ldx, const int8_t* qs, const float* d, int64_t groups, float* y,
                 int64_t ldy) {
  __m256 acc[R][4];  // lo_acc lanes 0-7, 8-15, then hi_acc's
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* q = qs + g * BLOCK;
    if (g % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH), _MM_HINT_T0);
    const __m256 dv = _mm256_set1_ps(d[g]);
    __m256 w[4];  // exact: 8-bit q times fp16 d
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))), dv);
    const float* xg = x + g * BLOCK;
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + r * ldx + 8 * i), acc[r][i]);
  }
  for (int r = 0; r < R; ++r) {
    // hsum(lo + hi) over 16 lanes: lanes i and i + 8 first, then hsum8's tree
    const __m256 a = _mm256_add_ps(acc[r][0], acc[r][2]), b = _mm256_add_ps(acc[r][1], acc[r][3]);
    y[r * ldy] = hsum8(_mm256_add_ps(a, b));
  }
}

#else
constexpr bool Q8_AVX2 = false;
constexpr int Q8_TILE = TILE;

template <int R>
void q8_row_avx2(const float*, int64_t, const int8_t*, const float*, int64_t, float*, int64_t) {}
#endif

// W adjacent weight rows (k apart, scales `groups` apart) against one input row -> y[0 .. W):
// each row's sums are q8_row<1>'s, operation for operation (the same bits on either vector
// path), and the W rows' chains of multiply-adds are independent, so a plain step's head does
// not wait on one chain's latency
// With AVX-512, two rows at once made the head 14% faster (a Xeon, 1 thread; four: slower);
// on a Zen 2's AVX registers two were slower, so that path keeps one row at a time
#if defined(__AVX512F__)
constexpr int Q8_WROWS = 2;
#else
constexpr int Q8_WROWS = 1;
#endif

template <int W>
void q8_wrows(const float* x, const int8_t* qs, int64_t k, const float* d, int64_t groups, float* y) {
  lanes lo_acc[W] = {}, hi_acc[W] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const lanes xlo = load(x + g * BLOCK), xhi = load(x + g * BLOCK + LANES);
    for (int w = 0; w < W; ++w) {
      const int8_t* q = qs + w * k + g * BLOCK;
      if (g % 2 == 0) __builtin_prefetch(q + PREFETCH);
      const lanes dv = splat(d[w * groups + g]);
      lo_acc[w] = fma(to_float(widen(q)) * dv, xlo, lo_acc[w]);  // exact products, as q8_row
      hi_acc[w] = fma(to_float(widen(q + LANES)) * dv, xhi, hi_acc[w]);
    }
  }
  for (int w = 0; w < W; ++w) y[w] = hsum(lo_acc[w] + hi_acc[w]);
}

void q8_rows(const float* x, int64_t ldx, int rows, const int8_t* qs, const float* d, int64_t groups,
             float* y, int64_t ldy, bool portable) {
  if (Q8_AVX2 && !portable)
    return rows == 1 ? q8_row_avx2<1>(x, ldx, qs, d, groups, y, ldy) : q8_row_avx2<2>(x, ldx, qs, d, groups, y, ldy);
  switch (rows) {
    case 1: return q8_row<1>(x, ldx, qs, d, groups, y, ldy);
    case 2: return q8_row<2>(x, ldx, qs, d, groups, y, ldy);
    case 3: return q8_row<3>(x, ldx, qs, d, groups, y, ldy);
    default: return q8_row<4>(x, ldx, qs, d, groups, y, ldy);
  }
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % BLOCK == 0,
              "block products: x [M, K] float32, K a multiple of ", BLOCK);
}

}  // namespace

at::Tensor q4_mm(const at::Tensor& x0, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                 bool portable, bool coarse) {
  check_input(x0);
  const at::Tensor x = x0.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({rows, q4_checked_rows(qs, d, m, k)}, x.options());
  Q4Scratch scratch;
  q4_mm_into(x.data_ptr<float>(), rows, k, qs, d, m, y.data_ptr<float>(), scratch, portable, coarse);
  return y;
}

int64_t q4_checked_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t k) {
  const int64_t groups = k / BLOCK;
  const int64_t n = (d.numel() - OCTET) / groups;  // weight rows
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == n * k / 2 + Q4_PAD_BYTES,
              "q4_mm: qs [N * K / 2 + ", Q4_PAD_BYTES, "] uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() && m.is_contiguous() &&
                  d.numel() == n * groups + OCTET && m.numel() == d.numel(),
              "q4_mm: d and m [N * K / 32 + 8] fp16");
  return n;
}

void q4_mm_into(const float* xp, int64_t rows, int64_t k, const at::Tensor& qs, const at::Tensor& d,
                const at::Tensor& m, float* yp, Q4Scratch& scratch, bool portable, bool coarse) {
  const int64_t groups = k / BLOCK, octets = (groups + OCTET - 1) / OCTET;
  const int64_t n = (d.numel() - OCTET) / groups;  // weight rows
  // every input row rounded once, into zeroed buffers (a last octet's missing blocks stay zero)
  const int64_t row_bytes = octets * XQ_BYTES + TAIL_BYTES;
  scratch.bytes.assign(rows * row_bytes + CACHE_LINE, 0);
  scratch.dx.assign(rows * octets * OCTET + CACHE_LINE / sizeof(float), 0.0f);
  scratch.xs.assign(rows * octets * OCTET + CACHE_LINE / sizeof(float), 0.0f);
  int8_t* bytes = line_aligned(scratch.bytes.data());
  float *dx = line_aligned(scratch.dx.data()), *xs = line_aligned(scratch.xs.data());
  std::vector<Rounded> rounded(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* b = bytes + r * row_bytes;
    rounded[r] = {b, dx + r * octets * OCTET, xs + r * octets * OCTET, b + octets * XQ_BYTES};
  }
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) round_row(xp + r * k, groups, rounded[r], portable, coarse);
  });
  const uint8_t* wp = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  const int pair_rows = portable ? 0 : PAIR_ROWS;
  const int sweep = std::max(TILE, pair_rows);  // input rows that meet a panel in one pass over it
  // Panels of weight rows meet each tile of input rows in turn, so that both stay in L1 while
  // they meet (weight rows outermost re-read every input row from L2 for each pair of weight
  // rows, which bounded a 512-row prefill). An output's sums are the same in any order.
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t p0 = n0; p0 < n1; p0 += PANEL) {
      const int64_t p1 = std::min(p0 + PANEL, n1);
      for (int64_t r0 = 0; r0 < rows; r0 += sweep) {
        const int r = static_cast<int>(std::min<int64_t>(sweep, rows - r0));
        int64_t j = p0;
        if (r <= pair_rows) {  // the panel's weight rows in pairs, an odd last one alone
          const int64_t pairs = (p1 - p0) / 2;
          q4_panel_pairs(rounded.data() + r0, r, wp + j * k / 2, k / 2, dp + j * groups, mp + j * groups, groups,
                         pairs, yp + r0 * n + j, n, coarse);
          j += 2 * pairs;
        }
        for (; j < p1; ++j)
          for (int t = 0; t < r; t += TILE)
            q4_rows(rounded.data() + r0 + t, std::min(TILE, r - t), wp + j * k / 2, dp + j * groups, mp + j * groups,
                    groups, yp + (r0 + t) * n + j, n, portable || !VECTOR);
      }
    }
  });
}

at::Tensor q8_mm(const at::Tensor& x0, const at::Tensor& qs, const at::Tensor& d, bool portable) {
  check_input(x0);
  const at::Tensor x = x0.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = qs.size(0), groups = k / BLOCK;
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.size(1) == k, "q8_mm: qs [N, K] int8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == n && d.size(1) == groups,
              "q8_mm: d [N, K / 32] fp16");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    // the scales of SCALE_ROWS rows at a time, converted into one small buffer that stays in
    // cache (a task's whole share, 3.5 MB for a 49152-row head on one thread, was written and
    // read back every call)
    std::vector<float> ds(SCALE_ROWS * groups);
    for (int64_t c0 = n0; c0 < n1; c0 += SCALE_ROWS) {
      const int64_t c1 = std::min(c0 + SCALE_ROWS, n1);
      half_to_float(dp + c0 * groups, ds.data(), (c1 - c0) * groups);
      int64_t j = c0;
      if (rows == 1 && !portable && Q8_WROWS > 1)  // a plain step: weight rows side by side
        for (; j + Q8_WROWS <= c1; j += Q8_WROWS)
          q8_wrows<Q8_WROWS>(xp, qp + j * k, k, ds.data() + (j - c0) * groups, groups, yp + j);
      for (; j < c1; ++j)
        for (int64_t r0 = 0; r0 < rows;) {
          const int64_t tile = portable ? TILE : Q8_TILE;
          const int r = static_cast<int>(std::min<int64_t>(tile, rows - r0));
          q8_rows(xp + r0 * k, k, r, qp + j * k, ds.data() + (j - c0) * groups, groups, yp + r0 * n + j, n, portable);
          r0 += r;
        }
    }
  });
  return y;
}

// Which path q4_mm's products take on this build: "avx512-vnni" (weight rows in pairs),
// "avx-vnni", "avx2" or "portable"
std::string q4_path() {
  if (PAIRS) return "avx512-vnni";
#if defined(__AVXVNNI__)
  if (VECTOR) return "avx-vnni";
#endif
  return VECTOR ? "avx2" : "portable";
}

// How many threads at::parallel_for runs these kernels on (1 where the build lacks OpenMP)
int64_t kernel_threads() {
  std::vector<int> used(at::get_num_threads(), 0);
  at::parallel_for(0, 64 * static_cast<int64_t>(used.size()), 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

}  // namespace d3d

// The operators' namespace; tests build this file again for other CPUs' instruction sets under
// names of their own (tests/test_block_mm_paths.py)
#ifndef D3D_OPS
#define D3D_OPS d3d_cpu
#endif

TORCH_LIBRARY_FRAGMENT(D3D_OPS, m) {
  m.def("q4_mm(Tensor x, Tensor qs, Tensor d, Tensor m, bool portable=False, bool coarse=False) -> Tensor");
  m.impl("q4_mm", c10::DispatchKey::CPU, TORCH_FN(d3d::q4_mm));
  m.def("q8_mm(Tensor x, Tensor qs, Tensor d, bool portable=False) -> Tensor");
  m.impl("q8_mm", c10::DispatchKey::CPU, TORCH_FN(d3d::q8_mm));
  m.def("q4_path() -> str", TORCH_FN(d3d::q4_path));
  m.def("kernel_threads() -> int", TORCH_FN(d3d::kernel_threads));
}

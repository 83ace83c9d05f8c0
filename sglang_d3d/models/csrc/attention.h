// Attention of the C++ layer loop (exact_layers.cpp) over one layer's key-value cache: each
// query's scores, softmax and weighted sum of values run in one fixed order, so a query's
// result depends on its own inputs and keys only, not on which other queries run beside it.
// What runs beside it decides how often the cache is read:
// - the query heads that share a key-value head (HF repeat_kv) take each key and value they
//   see together, in tiles of up to four (their running sums in registers);
// - the rows of one slot (a verify block's chain or tree, a drafter's block) take the keys
//   they all see, the cache positions from 0 on (`shared`), together too, block by block, so a
//   prefix of 2000 tokens is read once a layer for a bundle of rows rather than once a row;
// - each row's own keys past the shared ones (its block's earlier rows, its tree path) follow
//   for that row alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace d3d {

constexpr int64_t MAX_HEAD = 256;  // head sizes up to this, in whole LANES
constexpr int TILE_QUERIES = 4;  // queries whose running sums share the registers
constexpr int64_t KEY_BLOCK = 64;  // shared keys a block: 16 KB of keys (or values) of 64 lanes stay in L1

// The largest of s [n], n >= 1, in 16 running maxima: the same value in any order, and not one
// chain of n comparisons each waiting on the last (with them, a 9-row pass's layer loop at 2000
// tokens took 0.93x the time, benchmarks/bench_layers_ab.py)
inline float largest(const float* s, int64_t n) {
  float tops[LANES];
  for (int j = 0; j < LANES; ++j) tops[j] = s[0];
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES)
    for (int j = 0; j < LANES; ++j) tops[j] = std::max(tops[j], s[t + j]);
  for (int j = 0; t < n; ++t, ++j) tops[j] = std::max(tops[j], s[t]);
  float top = tops[0];
  for (int j = 1; j < LANES; ++j) top = std::max(top, tops[j]);
  return top;
}

// G score rows of n each -> softmax in place: e^(s - max) over their sum, the sum in four
// running sums and then a fixed tree for each row. The G rows' sums run side by side: one
// row's four chains of n / 4 dependent additions wait on each other's latency.
template <int G>
void softmax_rows(float* const* s, int64_t n) {
  if (n == 0) return;
  for (int g = 0; g < G; ++g) {
    const float top = largest(s[g], n);
    for (int64_t t = 0; t < n; ++t) s[g][t] = exp_fp32(s[g][t] - top);
  }
  float part[G][4] = {};
  int64_t t = 0;
  for (; t + 4 <= n; t += 4)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) part[g][j] += s[g][t + j];
  for (int g = 0; g < G; ++g) {
    for (int64_t u = t, j = 0; u < n; ++u, ++j) part[g][j] += s[g][u];
    const float total = (part[g][0] + part[g][2]) + (part[g][1] + part[g][3]);
    for (int64_t i = 0; i < n; ++i) s[g][i] /= total;
  }
}

// One query: its vector, where its output goes, the cache positions it sees and its scores
struct Query {
  const float* q;  // [d], scaled
  float* out;  // [d]: the weighted sum, built up in place key block by key block
  const int64_t* seen;  // [n]
  int64_t n;
  float* sc;  // [n]
};

// One key-value head's cache: positions `stride` floats apart from k and v
struct HeadCache {
  const float* k;
  const float* v;
  int64_t stride, d;
};

// qs[g].sc[t] = dot(qs[g].q, key seen[t], d) for t in [t0, t1), where the G queries see the same
// positions there; the same bits as dot, each key's lanes loaded once for all G. With AVX-512,
// 16 keys at a time: each key's LANES running sums as dot forms them, then hsum's tree for the
// 16 together (its first round per key, its other three across keys in hsum8_x16). One hsum a
// key took about half the scores' time at a 1000-token context.
template <int G>
void scores_span(const Query* qs, const HeadCache& c, int64_t t0, int64_t t1) {
  const int64_t* seen = qs[0].seen;
  int64_t t = t0;
#if defined(__AVX512F__)
  alignas(64) float halves[G][LANES * 8];  // query g's key j's 8 lanes after hsum's first round, at 8 j
  for (; t + LANES <= t1; t += LANES) {
    for (int j = 0; j < LANES; j += 2) {
      lanes a[G] = {}, b[G] = {};
      const float *ka = c.k + seen[t + j] * c.stride, *kb = c.k + seen[t + j + 1] * c.stride;
      for (int64_t i = 0; i < c.d; i += LANES) {
        const lanes x = load(ka + i), y = load(kb + i);
        for (int g = 0; g < G; ++g) {
          a[g] += load(qs[g].q + i) * x;
          b[g] += load(qs[g].q + i) * y;
        }
      }
      for (int g = 0; g < G; ++g) {  // [lanes 0-7 of a | of b] + [lanes 8-15 of a | of b]: hsum's v[i] + v[i + 8]
        const __m512 va = reinterpret_cast<__m512>(a[g]), vb = reinterpret_cast<__m512>(b[g]);
        _mm512_store_ps(halves[g] + 8 * j, _mm512_add_ps(_mm512_shuffle_f32x4(va, vb, _MM_SHUFFLE(1, 0, 1, 0)),
                                                         _mm512_shuffle_f32x4(va, vb, _MM_SHUFFLE(3, 2, 3, 2))));
      }
    }
    for (int g = 0; g < G; ++g) hsum8_x16(halves[g], LANES, qs[g].sc + t);
  }
#endif
  for (; t < t1; ++t)
    for (int g = 0; g < G; ++g) qs[g].sc[t] = dot(qs[g].q, c.k + seen[t] * c.stride, c.d);
}

// qs[g].out += sum over t in [t0, t1) of sc[t] * value seen[t], t in order (out starts at zero
// where t0 is 0): each query's running sums take the values one by one from its first key to
// its last, whichever span they come in, so the bits do not depend on the spans. Each value's
// lanes are loaded once for all G, and G * DL sums run side by side.
template <int G, int DL>
void values_span(const Query* qs, const HeadCache& c, int64_t t0, int64_t t1) {
  lanes acc[G][DL];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < DL; ++j) acc[g][j] = t0 == 0 ? lanes{} : load(qs[g].out + j * LANES);
  const int64_t* seen = qs[0].seen;
  for (int64_t t = t0; t < t1; ++t) {
    const float* vt = c.v + seen[t] * c.stride;
    for (int j = 0; j < DL; ++j) {
      const lanes x = load(vt + j * LANES);
      for (int g = 0; g < G; ++g) acc[g][j] += qs[g].sc[t] * x;
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(qs[g].out, acc[g], DL * LANES * sizeof(float));
}

// The same for a head size without a written-out case, one query at a time
inline void query_values_span(const Query& q, const HeadCache& c, int64_t t0, int64_t t1) {
  lanes acc[MAX_HEAD / LANES];
  for (int64_t j = 0; j < c.d / LANES; ++j) acc[j] = t0 == 0 ? lanes{} : load(q.out + j * LANES);
  for (int64_t t = t0; t < t1; ++t) {
    const float* vt = c.v + q.seen[t] * c.stride;
    const float w = q.sc[t];
    for (int64_t j = 0; j < c.d / LANES; ++j) acc[j] += w * load(vt + j * LANES);
  }
  std::memcpy(q.out, acc, c.d * sizeof(float));
}

template <int G>
void values_tile(const Query* qs, const HeadCache& c, int64_t t0, int64_t t1) {
  if (c.d == 4 * LANES) return values_span<G, 4>(qs, c, t0, t1);
  if (c.d == 8 * LANES && G <= 2) return values_span<G, 8>(qs, c, t0, t1);
  for (int g = 0; g < G; ++g) query_values_span(qs[g], c, t0, t1);
}

// scores_span or values_tile for `count` <= TILE_QUERIES queries
inline void span(bool scores, const Query* qs, int count, const HeadCache& c, int64_t t0, int64_t t1) {
  switch (count) {
    case 1: return scores ? scores_span<1>(qs, c, t0, t1) : values_tile<1>(qs, c, t0, t1);
    case 2: return scores ? scores_span<2>(qs, c, t0, t1) : values_tile<2>(qs, c, t0, t1);
    case 3: return scores ? scores_span<3>(qs, c, t0, t1) : values_tile<3>(qs, c, t0, t1);
    default: return scores ? scores_span<4>(qs, c, t0, t1) : values_tile<4>(qs, c, t0, t1);
  }
}

// Queries of one key-value head, row by row (`per_row` heads a row, rows of one slot), whose
// rows all see positions [0, shared): scores (or values) over the shared keys block by block,
// every tile of queries meeting a block while it is in L1, then each row's own keys past them
inline void spans(bool scores, const Query* qs, int64_t count, int64_t per_row, int64_t shared, const HeadCache& c) {
  const int64_t tile = std::min<int64_t>(TILE_QUERIES, per_row);  // a tile within one row: its own keys too
  for (int64_t b0 = 0; b0 < shared; b0 += KEY_BLOCK)
    for (int64_t g = 0; g < count; g += tile)
      span(scores, qs + g, static_cast<int>(std::min(tile, count - g)), c, b0, std::min(b0 + KEY_BLOCK, shared));
  for (int64_t r0 = 0; r0 < count; r0 += per_row)
    for (int64_t g = r0; g < r0 + per_row; g += tile)
      span(scores, qs + g, static_cast<int>(std::min(tile, r0 + per_row - g)), c, shared, qs[g].n);
}

// softmax_rows for `count` <= TILE_QUERIES queries of one row (the same n)
inline void softmax_tile(const Query* qs, int count) {
  float* s[TILE_QUERIES];
  for (int g = 0; g < count; ++g) s[g] = qs[g].sc;
  switch (count) {
    case 1: return softmax_rows<1>(s, qs[0].n);
    case 2: return softmax_rows<2>(s, qs[0].n);
    case 3: return softmax_rows<3>(s, qs[0].n);
    default: return softmax_rows<4>(s, qs[0].n);
  }
}

// Every query's attention: scores, softmax, weighted sum -> each query's out
inline void attend_queries(const Query* qs, int64_t count, int64_t per_row, int64_t shared, const HeadCache& c) {
  spans(true, qs, count, per_row, shared, c);
  const int64_t tile = std::min<int64_t>(TILE_QUERIES, per_row);
  for (int64_t r0 = 0; r0 < count; r0 += per_row)
    for (int64_t g = r0; g < r0 + per_row; g += tile) softmax_tile(qs + g, static_cast<int>(std::min(tile, r0 + per_row - g)));
  spans(false, qs, count, per_row, shared, c);
}

// How many leading positions of `seen` are 0, 1, 2, ...: the slot's prefix a row sees whole
inline int64_t leading_run(const std::vector<int64_t>& seen) {
  int64_t t = 0;
  while (t < static_cast<int64_t>(seen.size()) && seen[t] == t) ++t;
  return t;
}

}  // namespace d3d

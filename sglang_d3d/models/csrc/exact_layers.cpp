// The 4-bit target's decode and verify layers, and its final norm, as one call
// (models/exact_pass.py says why each query runs alone); with low-rank deltas on the rows it is
// told are mask slots, the D3D drafter's pass on the same weights (models/exact_drafter.py);
// `coarse` rounds every projection's inputs to 8 bits instead of 14 (a drafter's passes, whose
// outputs only propose drafts: never a pass whose rows must equal a plain step's).
// The projections are the block products of block_mm.cpp on the file's own
// Q4_1 weights; what lies between them (RMS norms, RoPE, cache writes, one query's attention,
// the SiLU gate) is a loop here over one row at a time, in a fixed order, so a row's result
// depends on that row's inputs only.
//
// Precision: every value here is fp32 (block_mm.cpp says how a projection rounds its input);
// sums run in LANES running partial sums added in a fixed tree; e^x (softmax, SiLU) is
// exp_fp32's polynomial, the same bits on every build.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "block_mm.h"
#include "lanes.h"

namespace d3d {
namespace {

constexpr int64_t MAX_HEAD = 256;  // head sizes up to this, in whole LANES

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

// s [n] -> softmax(s) in place: e^(s - max) over their sum (four running sums, then a fixed tree)
void softmax_row(float* s, int64_t n) {
  if (n == 0) return;
  float top = s[0];
  for (int64_t t = 1; t < n; ++t) top = std::max(top, s[t]);
  for (int64_t t = 0; t < n; ++t) s[t] = exp_fp32(s[t] - top);
  float part[4] = {};
  int64_t t = 0;
  for (; t + 4 <= n; t += 4)
    for (int j = 0; j < 4; ++j) part[j] += s[t + j];
  for (int j = 0; t < n; ++t, ++j) part[j] += s[t];
  const float total = (part[0] + part[2]) + (part[1] + part[3]);
  for (int64_t i = 0; i < n; ++i) s[i] /= total;
}

// sum a[i] * b[i] for n a multiple of LANES: LANES running sums, then the tree
float dot(const float* a, const float* b, int64_t n) {
  lanes acc = {};
  for (int64_t i = 0; i < n; i += LANES) acc += load(a + i) * load(b + i);
  return hsum(acc);
}

// One row block's activations, [R, width] fp32, in buffers a pass reuses from layer to layer
// (a torch allocation per operation costs more than the operation at one query's size)
struct Rows {
  float* p;
  int64_t rows, width;
};

struct Workspace {
  std::vector<float> x, qkv, att, o, gu, act, down, q, delta;
  Q4Scratch scratch;

  static Rows take(std::vector<float>& buf, int64_t rows, int64_t width) {
    buf.resize(rows * width);
    return {buf.data(), rows, width};
  }
};

// h += y (where given), then out = h * rsqrt(mean(h^2) + eps) * w per row
void residual_rms(Rows h, const float* y, const float* w, double eps, Rows out) {
  if (y != nullptr)
    for (int64_t i = 0, n = h.rows * h.width; i < n; ++i) h.p[i] += y[i];
  for (int64_t r = 0; r < h.rows; ++r) {
    const float* x = h.p + r * h.width;
    const float inv = 1.0f / std::sqrt(dot(x, x, h.width) / static_cast<float>(h.width) + static_cast<float>(eps));
    for (int64_t i = 0; i < h.width; ++i) out.p[r * h.width + i] = x[i] * inv * w[i];
  }
}

// x -> y [R, N] through one projection's Q4_1 weights (qs, d, m) and its bias; coarse: inputs
// rounded to 8 bits a block (a drafter's pass, block_mm.cpp)
void project(Rows x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
             const std::optional<at::Tensor>& bias, Rows y, Q4Scratch& scratch, bool coarse) {
  q4_mm_into(x.p, x.rows, x.width, qs, d, m, y.p, scratch, false, coarse);
  if (!bias.has_value() || !bias->defined()) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t r = 0; r < y.rows; ++r)
    for (int64_t i = 0; i < y.width; ++i) y.p[r * y.width + i] += b[i];
}

struct Heads {
  int64_t hq, hkv, d;
};

// One projection's low-rank delta in its inference form (models/adapters.py StackedDelta):
// a [R, K] (the stacked A matrices) and bt [R, N] (the B matrices side by side, transposed,
// scale folded in)
struct Delta {
  const float* a;
  const float* bt;
  int64_t rank;
};

// y[r] += bt.T @ (a @ x[r]) for every row r flagged in `masked` (a mask slot of a drafter
// pass); other rows, and a whole target pass, are left as the projection gave them
void add_delta(Rows x, const Delta& dl, const std::vector<uint8_t>& masked, Rows y, std::vector<float>& tmp) {
  if (dl.a == nullptr) return;
  tmp.resize(y.width + dl.rank);
  float* t = tmp.data() + y.width;
  for (int64_t r = 0; r < x.rows; ++r) {
    if (!masked[r]) continue;
    const float* xr = x.p + r * x.width;
    for (int64_t j = 0; j < dl.rank; ++j) t[j] = dot(dl.a + j * x.width, xr, x.width);
    float* d = tmp.data();
    for (int64_t i = 0; i < y.width; ++i) d[i] = dl.bt[i] * t[0];
    for (int64_t j = 1; j < dl.rank; ++j) {
      const float* b = dl.bt + j * y.width;
      for (int64_t i = 0; i < y.width; ++i) d[i] = std::fma(b[i], t[j], d[i]);
    }
    float* yr = y.p + r * y.width;
    for (int64_t i = 0; i < y.width; ++i) yr[i] += d[i];
  }
}

// Per layer and projection (qkv, o, gate_up, down) its delta, from `deltas` (a and bt of each in
// that order, 8 a layer; empty: none), each checked against the projection's shape
std::vector<Delta> checked_deltas(at::TensorList deltas, int64_t layers, int64_t width,
                                  const std::vector<int64_t>& outputs, Heads hd) {
  std::vector<Delta> out(4 * layers, Delta{nullptr, nullptr, 0});
  if (deltas.empty()) return out;
  TORCH_CHECK(static_cast<int64_t>(deltas.size()) == 8 * layers,
              "exact_layers: deltas must give a and b for each of a layer's 4 projections");
  for (int64_t li = 0; li < layers; ++li) {
    const int64_t n_qkv = outputs[2 * li], n_gu = outputs[2 * li + 1];
    const int64_t ins[4] = {width, hd.hq * hd.d, width, n_gu / 2}, outs[4] = {n_qkv, width, n_gu, width};
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& a = deltas[8 * li + 2 * j];
      const at::Tensor& b = deltas[8 * li + 2 * j + 1];
      TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                      b.is_contiguous() && a.dim() == 2 && b.dim() == 2 && a.size(1) == ins[j] &&
                      b.size(1) == outs[j] && b.size(0) == a.size(0) && a.size(0) >= 1,
                  "exact_layers: a delta's a [R, K] and bt [R, N] must be contiguous fp32 of its projection's shape");
      out[4 * li + j] = {a.data_ptr<float>(), b.data_ptr<float>(), a.size(0)};
    }
  }
  return out;
}

// RoPE on one head: out[i] = x[i] cos[i] + x[(i + d/2) % d] sin[i] (sin signed), times scale
void rope(const float* x, const float* cos, const float* sin, int64_t d, float scale, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float xi = x[i], xr = x[(i + half) % d];
    out[i] = (xi * cos[i] + xr * sin[i]) * scale;
  }
}

using KeyLists = std::vector<std::vector<int64_t>>;

// Per row, the cache indices it sees: the first counts[r] entries, or paths[r] where
// counts[r] is -1 (the same in every layer, so resolved once a pass)
KeyLists key_lists(c10::IntArrayRef counts, at::TensorList paths) {
  KeyLists keys(counts.size());
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] >= 0) {
      keys[r].resize(counts[r]);
      for (int64_t t = 0; t < counts[r]; ++t) keys[r][t] = t;
    } else {
      const at::Tensor path = paths[r].to(at::kLong).contiguous();
      keys[r].assign(path.data_ptr<int64_t>(), path.data_ptr<int64_t>() + path.numel());
    }
  }
  return keys;
}

// One layer's keys and values: [S, max_len, Hkv, D] each, at these strides
struct LayerCache {
  float* k;
  float* v;
  int64_t slot_stride, pos_stride;
};

// G queries' scores against the same keys `seen` (cache positions `stride` floats apart from
// k): sc[g * n + t] = dot(qs[g], k + seen[t] * stride, d), the same bits as dot, each key's
// lanes loaded once for all G. With AVX-512, 16 keys at a time: each key's LANES running sums
// as dot forms them, then hsum's tree for the 16 together (its first round per key, its other
// three across keys in hsum8_x16). One hsum a key took about half the scores' time at a
// 1000-token context.
template <int G>
void group_key_scores(const float* const* qs, const float* k, const int64_t* seen, int64_t n, int64_t stride,
                      int64_t d, float* sc) {
  int64_t t = 0;
#if defined(__AVX512F__)
  alignas(64) float halves[G][LANES * 8];  // query g's key j's 8 lanes after hsum's first round, at 8 j
  for (; t + LANES <= n; t += LANES) {
    for (int j = 0; j < LANES; j += 2) {
      lanes a[G] = {}, b[G] = {};
      const float *ka = k + seen[t + j] * stride, *kb = k + seen[t + j + 1] * stride;
      for (int64_t i = 0; i < d; i += LANES) {
        const lanes x = load(ka + i), y = load(kb + i);
        for (int g = 0; g < G; ++g) {
          a[g] += load(qs[g] + i) * x;
          b[g] += load(qs[g] + i) * y;
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 va = reinterpret_cast<__m512>(a[g]), vb = reinterpret_cast<__m512>(b[g]);
        _mm512_store_ps(halves[g] + 8 * j, _mm512_add_ps(_mm512_shuffle_f32x4(va, vb, _MM_SHUFFLE(1, 0, 1, 0)),
                                                         _mm512_shuffle_f32x4(va, vb, _MM_SHUFFLE(3, 2, 3, 2))));
      }
    }
    for (int g = 0; g < G; ++g) hsum8_x16(halves[g], LANES, sc + g * n + t);
  }
#endif
  for (; t < n; ++t)
    for (int g = 0; g < G; ++g) sc[g * n + t] = dot(qs[g], k + seen[t] * stride, d);
}

// outs[g] [DL * LANES] = sum over t of sc[g, t] * v[seen[t]]: for each query the sums of
// query_values' loop, in its order; each value's lanes loaded once for all G, and G * DL
// running sums in registers rather than DL (one query's sums wait on each other's latency)
template <int G, int DL>
void group_values(const float* v, const int64_t* seen, int64_t n, int64_t stride, const float* sc,
                  float* const* outs) {
  lanes acc[G][DL] = {};
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v + seen[t] * stride;
    for (int j = 0; j < DL; ++j) {
      const lanes x = load(vt + j * LANES);
      for (int g = 0; g < G; ++g) acc[g][j] += sc[g * n + t] * x;
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(outs[g], acc[g], DL * LANES * sizeof(float));
}

// The same sums for a head size without a written-out case, one query at a time
void query_values(const float* v, const int64_t* seen, int64_t n, int64_t stride, int64_t d, const float* sc,
                  float* out) {
  lanes acc[MAX_HEAD / LANES] = {};
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v + seen[t] * stride;
    const float w = sc[t];
    for (int64_t j = 0; j < d / LANES; ++j) acc[j] += w * load(vt + j * LANES);
  }
  std::memcpy(out, acc, d * sizeof(float));
}

// G query heads that share one key-value head, for one row, over its keys `seen` (cache
// positions `stride` floats apart from k and v) -> outs[g] [d]: each query's scores, softmax
// and weighted sum in one order (a query's result does not depend on G), the keys and values
// read once for the G of them: a layer's cache is read from L2 or memory, not L1
template <int G>
void group_attention(const float* const* qs, const float* k, const float* v, const std::vector<int64_t>& seen,
                     int64_t stride, int64_t d, std::vector<float>& scores, float* const* outs) {
  const int64_t n = static_cast<int64_t>(seen.size());
  scores.resize(G * n);
  float* sc = scores.data();
  group_key_scores<G>(qs, k, seen.data(), n, stride, d, sc);
  for (int g = 0; g < G; ++g) softmax_row(sc + g * n, n);
  if (d == 4 * LANES) return group_values<G, 4>(v, seen.data(), n, stride, sc, outs);
  if (d == 8 * LANES) return group_values<G, 8>(v, seen.data(), n, stride, sc, outs);
  for (int g = 0; g < G; ++g) query_values(v, seen.data(), n, stride, d, sc + g * n, outs[g]);
}

// Query heads taken together against one key-value head (each run of them one task): as many
// as keep their running sums in registers (4 of 64 lanes, 2 of more) and as share a key-value
// head (`group`), but fewer where the tasks would not give every thread two (a plain step's 3
// tasks of 3 heads left one of 2 threads idle a third of the time)
int64_t heads_together(int64_t d, int64_t group, int64_t tasks_per_run) {
  int64_t together = std::min<int64_t>(d <= 4 * LANES ? 4 : 2, group);
  while (together > 1 && (group + together - 1) / together * tasks_per_run < 2 * at::get_num_threads()) --together;
  return together;
}

void heads_attention(int64_t count, const float* const* qs, const float* k, const float* v,
                     const std::vector<int64_t>& seen, int64_t stride, int64_t d, std::vector<float>& scores,
                     float* const* outs) {
  switch (count) {
    case 1: return group_attention<1>(qs, k, v, seen, stride, d, scores, outs);
    case 2: return group_attention<2>(qs, k, v, seen, stride, d, scores, outs);
    case 3: return group_attention<3>(qs, k, v, seen, stride, d, scores, outs);
    default: return group_attention<4>(qs, k, v, seen, stride, d, scores, outs);
  }
}

// Writes every row's key and value into the layer cache, then out [R, Hq * D]: row r's
// attention over the cache entries keys[r].
void attend(Rows qkv, const at::Tensor& cos, const at::Tensor& sin, LayerCache cache, c10::IntArrayRef slots,
            c10::IntArrayRef writes, const KeyLists& keys, Heads hd, Rows out, Workspace& ws) {
  const int64_t rows = qkv.rows, width = qkv.width, d = hd.d;
  const int64_t group = hd.hq / hd.hkv, slot_stride = cache.slot_stride, pos_stride = cache.pos_stride;
  const float* src = qkv.p;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = cache.k;
  float* vp = cache.v;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float>& q = ws.q;
  q.resize(rows * hd.hq * d);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * width;
    const float *c = cp + r * d, *s = sp + r * d;
    float* kdst = kp + slots[r] * slot_stride + writes[r] * pos_stride;
    float* vdst = vp + slots[r] * slot_stride + writes[r] * pos_stride;
    for (int64_t h = 0; h < hd.hq; ++h) rope(row + h * d, c, s, d, scale, q.data() + (r * hd.hq + h) * d);
    for (int64_t h = 0; h < hd.hkv; ++h) {
      rope(row + (hd.hq + h) * d, c, s, d, 1.0f, kdst + h * d);
      std::memcpy(vdst + h * d, row + (hd.hq + hd.hkv + h) * d, d * sizeof(float));
    }
  }
  // Tasks of a row and a run of query heads that share a key-value head (HF repeat_kv), in one
  // parallel region a layer: key-value head by head, every row of one in turn, so that its keys
  // and values stay in cache from row to row (the layer's whole cache is 1.5 MB at a
  // 1000-token context, past L2), and each run reads them once for all its heads
  float* op = out.p;
  const int64_t together = heads_together(d, group, hd.hkv * rows);
  const int64_t runs = (group + together - 1) / together;  // per key-value head
  at::parallel_for(0, hd.hkv * runs * rows, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;  // this task's, one run's at a time
    const float* qs[4];
    float* outs[4];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kvh = i / (runs * rows), run = i / rows % runs, r = i % rows;
      const int64_t h0 = kvh * group + run * together, count = std::min(together, (kvh + 1) * group - h0);
      for (int64_t g = 0; g < count; ++g) {
        qs[g] = q.data() + (r * hd.hq + h0 + g) * d;
        outs[g] = op + (r * hd.hq + h0 + g) * d;
      }
      const int64_t at = slots[r] * slot_stride + kvh * d;
      heads_attention(count, qs, kp + at, vp + at, keys[r], pos_stride, d, scores, outs);
    }
  });
}

// gate_up [R, 2I] -> out = silu(gate) * up [R, I], silu(g) = g / (1 + e^-g), elementwise
void silu_gate(Rows gu, Rows out) {
  const int64_t inter = out.width;
  for (int64_t r = 0; r < gu.rows; ++r) {
    const float *g = gu.p + r * 2 * inter, *u = g + inter;
    float* o = out.p + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + exp_fp32(-g[i])) * u[i];
  }
}

// Every projection's layout checked before any is read (q4_mm_into reads them unchecked);
// -> per layer its qkv and gate_up output widths
std::vector<int64_t> checked_widths(at::TensorList qs, at::TensorList ds, at::TensorList ms, int64_t layers,
                                    int64_t width, Heads hd) {
  std::vector<int64_t> outputs;
  for (int64_t li = 0; li < layers; ++li) {
    const int64_t p = 4 * li;
    const int64_t n_qkv = q4_checked_rows(qs[p], ds[p], ms[p], width);
    TORCH_CHECK(n_qkv == (hd.hq + 2 * hd.hkv) * hd.d, "exact_layers: qkv must give (hq + 2 hkv) d outputs");
    TORCH_CHECK(q4_checked_rows(qs[p + 1], ds[p + 1], ms[p + 1], hd.hq * hd.d) == width,
                "exact_layers: o must give the width");
    const int64_t n_gu = q4_checked_rows(qs[p + 2], ds[p + 2], ms[p + 2], width);
    TORCH_CHECK(q4_checked_rows(qs[p + 3], ds[p + 3], ms[p + 3], n_gu / 2) == width,
                "exact_layers: down must give the width");
    outputs.insert(outputs.end(), {n_qkv, n_gu});
  }
  return outputs;
}

at::Tensor exact_layers(const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin,
                        c10::IntArrayRef slots, c10::IntArrayRef writes, c10::IntArrayRef counts,
                        at::TensorList paths, at::TensorList qs, at::TensorList ds, at::TensorList ms,
                        const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                        const at::Tensor& final_norm, at::Tensor& kc, at::Tensor& vc, double eps,
                        double final_eps, int64_t hq, int64_t hkv, int64_t d, at::TensorList deltas,
                        c10::IntArrayRef masked, bool coarse) {
  TORCH_CHECK(d % LANES == 0 && d <= MAX_HEAD && h0.size(1) % LANES == 0,
              "exact_layers: head size a multiple of ", LANES, " up to ", MAX_HEAD, ", width a multiple of ", LANES);
  TORCH_CHECK(h0.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous(),
              "exact_layers: fp32 activations and contiguous fp32 caches");
  at::Tensor h = h0.contiguous().clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const Heads hd{hq, hkv, d};
  const KeyLists keys = key_lists(counts, paths);
  const int64_t rows = h.size(0), width = h.size(1);
  const Rows hr{h.data_ptr<float>(), rows, width};
  const std::vector<int64_t> outputs = checked_widths(qs, ds, ms, kc.size(0), width, hd);
  const std::vector<Delta> dls = checked_deltas(deltas, kc.size(0), width, outputs, hd);
  TORCH_CHECK(masked.empty() || static_cast<int64_t>(masked.size()) == rows, "exact_layers: one mask flag a row");
  std::vector<uint8_t> is_mask(rows, 0);
  for (size_t r = 0; r < masked.size(); ++r) is_mask[r] = masked[r] != 0;
  Workspace ws;
  const float* down = nullptr;  // the previous layer's MLP output, added at the next norm
  for (int64_t li = 0; li < kc.size(0); ++li) {
    const int64_t p = 4 * li;
    const int64_t n_qkv = outputs[2 * li], n_gu = outputs[2 * li + 1];
    const Rows x = Workspace::take(ws.x, rows, width);
    residual_rms(hr, down, norms[2 * li].data_ptr<float>(), eps, x);
    const Rows qkv = Workspace::take(ws.qkv, rows, n_qkv);
    project(x, qs[p], ds[p], ms[p], biases.get(p), qkv, ws.scratch, coarse);
    add_delta(x, dls[p], is_mask, qkv, ws.delta);
    const LayerCache layer{kc.data_ptr<float>() + li * kc.stride(0), vc.data_ptr<float>() + li * vc.stride(0),
                           kc.stride(1), kc.stride(2)};
    const Rows att = Workspace::take(ws.att, rows, hq * d);
    attend(qkv, c, s, layer, slots, writes, keys, hd, att, ws);
    const Rows o = Workspace::take(ws.o, rows, width);
    project(att, qs[p + 1], ds[p + 1], ms[p + 1], biases.get(p + 1), o, ws.scratch, coarse);
    add_delta(att, dls[p + 1], is_mask, o, ws.delta);
    residual_rms(hr, o.p, norms[2 * li + 1].data_ptr<float>(), eps, x);
    const Rows gu = Workspace::take(ws.gu, rows, n_gu);
    project(x, qs[p + 2], ds[p + 2], ms[p + 2], biases.get(p + 2), gu, ws.scratch, coarse);
    add_delta(x, dls[p + 2], is_mask, gu, ws.delta);
    const Rows act = Workspace::take(ws.act, rows, gu.width / 2);
    silu_gate(gu, act);
    const Rows dn = Workspace::take(ws.down, rows, width);
    project(act, qs[p + 3], ds[p + 3], ms[p + 3], biases.get(p + 3), dn, ws.scratch, coarse);
    add_delta(act, dls[p + 3], is_mask, dn, ws.delta);
    down = dn.p;
  }
  at::Tensor out = at::empty_like(h);
  residual_rms(hr, down, final_norm.data_ptr<float>(), final_eps, {out.data_ptr<float>(), rows, width});
  return out;  // the model's final norm: [R, H]
}

}  // namespace
}  // namespace d3d

TORCH_LIBRARY(d3d_cpu, m) {
  m.def("exact_layers(Tensor h, Tensor cos, Tensor sin, int[] slots, int[] writes, int[] counts, "
        "Tensor[] paths, Tensor[] qs, Tensor[] ds, Tensor[] ms, Tensor?[] biases, Tensor[] norms, "
        "Tensor final_norm, Tensor(a!) kc, Tensor(b!) vc, float eps, float final_eps, int hq, int hkv, "
        "int d, Tensor[] deltas, int[] masked, bool coarse=False) -> Tensor");
  m.impl("exact_layers", c10::DispatchKey::CPU, TORCH_FN(d3d::exact_layers));
}

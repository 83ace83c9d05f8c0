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

#include "attention.h"
#include "block_mm.h"
#include "lanes.h"

namespace d3d {
namespace {

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

// Rows of one slot whose attention runs as one task per key-value head (attention.h), and
// the cache positions 0 .. shared - 1 they all see
struct Bundle {
  std::vector<int64_t> rows;
  int64_t shared;
};

// The shared positions from which the rows of a slot read them together: below, each row's task
// found the previous row's keys and values in L2 (200 and 1000 tokens: the same time or up to
// 3% more together; 2000 tokens: 0.79-0.84x at 5 rows, benchmarks/bench_layers_ab.py)
constexpr int64_t SHARED_MIN = 1536;

// The pass's rows by slot, in order, with the positions 0 .. shared - 1 all of a slot's rows see
std::vector<Bundle> slot_bundles(c10::IntArrayRef slots, const KeyLists& keys) {
  std::vector<Bundle> bundles;
  for (int64_t r = 0; r < static_cast<int64_t>(slots.size()); ++r) {
    auto same = std::find_if(bundles.begin(), bundles.end(), [&](const Bundle& b) { return slots[b.rows[0]] == slots[r]; });
    if (same == bundles.end()) {
      bundles.push_back({{r}, leading_run(keys[r])});
    } else {
      same->rows.push_back(r);
      same->shared = std::min(same->shared, leading_run(keys[r]));
    }
  }
  return bundles;
}

// The rows of a slot that all see at least SHARED_MIN of its positions in one bundle, split in
// halves (the largest first) while the key-value heads times the bundles would not give every
// thread two tasks; every other row a bundle of its own, its keys in one span
std::vector<Bundle> row_bundles(c10::IntArrayRef slots, const KeyLists& keys, int64_t kv_heads) {
  std::vector<Bundle> out;
  for (Bundle& b : slot_bundles(slots, keys)) {
    if (b.rows.size() > 1 && b.shared >= SHARED_MIN) out.push_back(std::move(b));
    else
      for (int64_t r : b.rows) out.push_back({{r}, 0});
  }
  const int64_t wanted = 2 * at::get_num_threads();
  while (kv_heads * static_cast<int64_t>(out.size()) < wanted) {
    auto big = std::max_element(out.begin(), out.end(), [](const Bundle& a, const Bundle& b) { return a.rows.size() < b.rows.size(); });
    if (big->rows.size() < 2) break;
    Bundle half{{big->rows.begin() + big->rows.size() / 2, big->rows.end()}, big->shared};
    big->rows.resize(big->rows.size() / 2);
    out.insert(big + 1, std::move(half));
  }
  return out;
}

// Query heads of one key-value head a task: all of them (`group`), or fewer where the tasks
// would not give every thread two (a plain step's 3 tasks of 3 heads left one of 2 threads
// idle a third of the time)
int64_t heads_a_task(int64_t group, int64_t tasks_per_run) {
  int64_t together = group;
  while (together > 1 && (group + together - 1) / together * tasks_per_run < 2 * at::get_num_threads()) --together;
  return together;
}

// How a pass's attention splits into tasks, the same in every layer (the rows' keys are): the
// bundles of rows, and per key-value head runs of `together` query heads (`runs` of them)
struct AttentionPlan {
  std::vector<Bundle> bundles;
  int64_t together, runs;
};

AttentionPlan attention_plan(c10::IntArrayRef slots, const KeyLists& keys, Heads hd) {
  const int64_t group = hd.hq / hd.hkv;
  std::vector<Bundle> bundles = row_bundles(slots, keys, hd.hkv);
  const int64_t together = heads_a_task(group, hd.hkv * static_cast<int64_t>(bundles.size()));
  return {std::move(bundles), together, (group + together - 1) / together};
}

// Writes every row's key and value into the layer cache, then out [R, Hq * D]: row r's
// attention over the cache entries keys[r], in the tasks of `plan`.
void attend(Rows qkv, const at::Tensor& cos, const at::Tensor& sin, LayerCache cache, c10::IntArrayRef slots,
            c10::IntArrayRef writes, const KeyLists& keys, const AttentionPlan& plan, Heads hd, Rows out,
            Workspace& ws) {
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
  // Tasks of a key-value head, a run of the query heads that share it (HF repeat_kv) and a
  // bundle of rows, in one parallel region a layer, key-value head by head: each task reads the
  // keys and values it needs once (the layer's whole cache is 1.5 MB at a 1000-token context,
  // past L2), and the next task of the same head finds them in cache
  float* op = out.p;
  const std::vector<Bundle>& bundles = plan.bundles;
  const int64_t nb = static_cast<int64_t>(bundles.size()), together = plan.together, runs = plan.runs;
  at::parallel_for(0, hd.hkv * runs * nb, 1, [&](int64_t i0, int64_t i1) {
    std::vector<Query> qs;
    std::vector<float> scores;  // this task's, one task's at a time
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kvh = i / (runs * nb), run = i / nb % runs;
      const Bundle& b = bundles[i % nb];
      const int64_t h0 = kvh * group + run * together, count = std::min(together, (kvh + 1) * group - h0);
      int64_t total = 0;
      for (int64_t r : b.rows) total += count * static_cast<int64_t>(keys[r].size());
      scores.resize(total);
      qs.clear();
      float* sc = scores.data();
      for (int64_t r : b.rows)
        for (int64_t h = h0; h < h0 + count; ++h) {
          const int64_t n = static_cast<int64_t>(keys[r].size());
          qs.push_back({q.data() + (r * hd.hq + h) * d, op + (r * hd.hq + h) * d, keys[r].data(), n, sc});
          sc += n;
        }
      const int64_t at = slots[b.rows[0]] * slot_stride + kvh * d;
      attend_queries(qs.data(), static_cast<int64_t>(qs.size()), count, b.shared, {kp + at, vp + at, pos_stride, d});
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
  const AttentionPlan plan = attention_plan(slots, keys, hd);
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
    attend(qkv, c, s, layer, slots, writes, keys, plan, hd, att, ws);
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

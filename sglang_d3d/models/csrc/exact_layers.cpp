// The 4-bit target's decode and verify layers as one call (models/exact_pass.py says why each
// query runs alone). The projections are torch's int4 CPU kernel; what lies between them (RMS
// norms, RoPE, cache writes, one query's attention, the SiLU gate) is a loop here over one row
// at a time, in a fixed order, so a row's result depends on that row's inputs only.
//
// Precision: each projection's input is rounded to bf16 (the kernel's), every other value is
// fp32; sums run in LANES running partial sums added in a fixed tree.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int64_t GROUP = 32;  // the int4 kernel's group: one Q4_1 block
constexpr int64_t MAX_HEAD = 256;  // head sizes up to this, in whole LANES
using bf16 = c10::BFloat16;

// LANES floats as one value: GCC and Clang lower it to the widest vectors the target has.
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));

lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

typedef float lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float lanes4 __attribute__((vector_size(4 * sizeof(float))));
typedef float lanes2 __attribute__((vector_size(2 * sizeof(float))));

// The lanes' sum in a fixed tree: halves added, then their halves, down to one
float hsum(lanes v) {
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

// sum a[i] * b[i] for n a multiple of LANES: LANES running sums, then the tree
float dot(const float* a, const float* b, int64_t n) {
  lanes acc = {};
  for (int64_t i = 0; i < n; i += LANES) acc += load(a + i) * load(b + i);
  return hsum(acc);
}

// bf16 of each value, rounded to nearest even (c10::BFloat16's rounding, in a loop the
// compiler vectorises)
void to_bf16(const float* x, bf16* out, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    bits[i] = x[i] != x[i] ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

template <typename T>
float at_f(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// [rows, width] bf16, row r filled in fp32 by fill(r, buffer) and then rounded
template <typename Fill>
at::Tensor bf16_rows(int64_t rows, int64_t width, const at::TensorOptions& options, Fill fill) {
  at::Tensor out = at::empty({rows, width}, options.dtype(at::kBFloat16));
  bf16* op = out.data_ptr<bf16>();
  std::vector<float> row(width);
  for (int64_t r = 0; r < rows; ++r) {
    fill(r, row.data());
    to_bf16(row.data(), op + r * width, width);
  }
  return out;
}

// h [R, H] += y [R, H] (bf16 or fp32), unless y is undefined
void add_rows(at::Tensor& h, const at::Tensor& y) {
  if (!y.defined()) return;
  float* hp = h.data_ptr<float>();
  const int64_t n = h.numel();
  if (y.scalar_type() == at::kBFloat16) {
    const bf16* yp = y.data_ptr<bf16>();
    for (int64_t i = 0; i < n; ++i) hp[i] += static_cast<float>(yp[i]);
  } else {
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) hp[i] += yp[i];
  }
}

// h += y, then bf16(h * rsqrt(mean(h^2) + eps) * w) per row: [R, H] -> [R, H] bf16
at::Tensor residual_rms(at::Tensor& h, const at::Tensor& y, const at::Tensor& w, double eps) {
  add_rows(h, y);
  const int64_t width = h.size(1);
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  return bf16_rows(h.size(0), width, h.options(), [&](int64_t r, float* out) {
    const float* x = hp + r * width;
    const float inv = 1.0f / std::sqrt(dot(x, x, width) / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) out[i] = x[i] * inv * wp[i];
  });
}

// x [R, K] bf16 -> [R, N]: bf16, or fp32 where the projection has a bias
at::Tensor project(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias) {
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x, packed, GROUP, scales);
  if (bias.has_value() && bias->defined()) return y.to(at::kFloat).add_(*bias);
  return y;
}

// RoPE on one head: out[i] = x[i] cos[i] + x[(i + d/2) % d] sin[i] (sin signed), times scale
template <typename T>
void rope(const T* x, const float* cos, const float* sin, int64_t d, float scale, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float xi = at_f(x, i), xr = at_f(x, (i + half) % d);
    out[i] = (xi * cos[i] + xr * sin[i]) * scale;
  }
}

struct Heads {
  int64_t hq, hkv, d;
};

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

// Writes every row's key and value into the layer cache, then -> [R, Hq * D] bf16: row r's
// attention over the cache entries keys[r].
template <typename T>
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor& kl, at::Tensor& vl, c10::IntArrayRef slots, c10::IntArrayRef writes,
                  const KeyLists& keys, Heads hd) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), d = hd.d;
  const int64_t group = hd.hq / hd.hkv, slot_stride = kl.stride(0), pos_stride = kl.stride(1);
  const T* src = qkv.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = kl.data_ptr<float>();
  float* vp = vl.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> q(rows * hd.hq * d);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * width;
    const float *c = cp + r * d, *s = sp + r * d;
    float* kdst = kp + slots[r] * slot_stride + writes[r] * pos_stride;
    float* vdst = vp + slots[r] * slot_stride + writes[r] * pos_stride;
    for (int64_t h = 0; h < hd.hq; ++h) rope(row + h * d, c, s, d, scale, q.data() + (r * hd.hq + h) * d);
    for (int64_t h = 0; h < hd.hkv; ++h) {
      rope(row + (hd.hq + h) * d, c, s, d, 1.0f, kdst + h * d);
      for (int64_t i = 0; i < d; ++i) vdst[h * d + i] = at_f(row, (hd.hq + hd.hkv + h) * d + i);
    }
  }
  at::Tensor out = at::empty({rows, hd.hq * d}, qkv.options().dtype(at::kBFloat16));
  bf16* op = out.data_ptr<bf16>();
  std::vector<float> out_h(d);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int64_t>& seen = keys[r];
    const int64_t n = static_cast<int64_t>(seen.size());
    const float* kbase = kp + slots[r] * slot_stride;
    const float* vbase = vp + slots[r] * slot_stride;
    at::Tensor scores = at::empty({hd.hq, n}, cos.options());
    float* sc = scores.data_ptr<float>();
    for (int64_t h = 0; h < hd.hq; ++h) {
      const float* qh = q.data() + (r * hd.hq + h) * d;
      const int64_t kvh = h / group;  // query heads share key-value heads in runs (HF repeat_kv)
      for (int64_t t = 0; t < n; ++t) sc[h * n + t] = dot(qh, kbase + seen[t] * pos_stride + kvh * d, d);
    }
    const at::Tensor probs = at::_softmax(scores, -1, false);  // vectorised exp, row by row
    const float* pr = probs.data_ptr<float>();
    for (int64_t h = 0; h < hd.hq; ++h) {
      const int64_t kvh = h / group;
      lanes acc[MAX_HEAD / LANES] = {};
      for (int64_t t = 0; t < n; ++t) {
        const float* v = vbase + seen[t] * pos_stride + kvh * d;
        const float w = pr[h * n + t];
        for (int64_t j = 0; j < d / LANES; ++j) acc[j] += w * load(v + j * LANES);
      }
      std::memcpy(out_h.data(), acc, d * sizeof(float));
      to_bf16(out_h.data(), op + (r * hd.hq + h) * d, d);
    }
  }
  return out;
}

// gate_up [R, 2I] -> bf16 silu(gate) * up [R, I]; SiLU through ATen (vectorised exp)
template <typename T>
at::Tensor silu_gate(const at::Tensor& gu) {
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor gate = at::silu(gu.narrow(1, 0, inter).to(at::kFloat)).contiguous();  // [R, I]
  const T* src = gu.data_ptr<T>();
  const float* gp = gate.data_ptr<float>();
  return bf16_rows(gu.size(0), inter, gu.options(), [&](int64_t r, float* out) {
    for (int64_t i = 0; i < inter; ++i) out[i] = gp[r * inter + i] * at_f(src + r * 2 * inter, inter + i);
  });
}

at::Tensor exact_layers(const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin,
                        c10::IntArrayRef slots, c10::IntArrayRef writes, c10::IntArrayRef counts,
                        at::TensorList paths, at::TensorList packed, at::TensorList scales,
                        const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                        at::Tensor& kc, at::Tensor& vc, double eps, int64_t hq, int64_t hkv,
                        int64_t d) {
  TORCH_CHECK(d % LANES == 0 && d <= MAX_HEAD && h0.size(1) % LANES == 0,
              "exact_layers: head size a multiple of ", LANES, " up to ", MAX_HEAD, ", width a multiple of ", LANES);
  TORCH_CHECK(h0.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous(),
              "exact_layers: fp32 activations and contiguous fp32 caches");
  at::Tensor h = h0.contiguous().clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const Heads hd{hq, hkv, d};
  const KeyLists keys = key_lists(counts, paths);
  at::Tensor down;  // the previous layer's MLP output, added at the next norm
  for (int64_t li = 0; li < kc.size(0); ++li) {
    const int64_t p = 4 * li;
    at::Tensor x = residual_rms(h, down, norms[2 * li], eps);
    at::Tensor qkv = project(x, packed[p], scales[p], biases.get(p)).contiguous();
    at::Tensor kl = kc[li], vl = vc[li];
    at::Tensor att = qkv.scalar_type() == at::kBFloat16
        ? attend<bf16>(qkv, c, s, kl, vl, slots, writes, keys, hd)
        : attend<float>(qkv, c, s, kl, vl, slots, writes, keys, hd);
    at::Tensor o = project(att, packed[p + 1], scales[p + 1], biases.get(p + 1)).contiguous();
    x = residual_rms(h, o, norms[2 * li + 1], eps);
    at::Tensor gu = project(x, packed[p + 2], scales[p + 2], biases.get(p + 2)).contiguous();
    at::Tensor act = gu.scalar_type() == at::kBFloat16 ? silu_gate<bf16>(gu) : silu_gate<float>(gu);
    down = project(act, packed[p + 3], scales[p + 3], biases.get(p + 3)).contiguous();
  }
  add_rows(h, down);
  return h;
}

}  // namespace

TORCH_LIBRARY(d3d_cpu, m) {
  m.def("exact_layers(Tensor h, Tensor cos, Tensor sin, int[] slots, int[] writes, int[] counts, "
        "Tensor[] paths, Tensor[] packed, Tensor[] scales, Tensor?[] biases, Tensor[] norms, "
        "Tensor(a!) kc, Tensor(b!) vc, float eps, int hq, int hkv, int d) -> Tensor");
  m.impl("exact_layers", c10::DispatchKey::CPU, TORCH_FN(exact_layers));
}

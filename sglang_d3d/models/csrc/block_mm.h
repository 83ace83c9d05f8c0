// Matrix products on a GGUF's own block weights (block_mm.cpp)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace d3d {

// Bytes past the last Q4_1 weight row that q4_mm may read (and multiply by zero)
constexpr int64_t Q4_PAD_BYTES = 128;

// x [M, K] fp32 @ W.T -> [M, N] fp32, W [N, K] as Q4_1 in q4_mm's layout (block_mm.cpp;
// packed by models/q4_linear.py): qs [N * K / 2 + Q4_PAD_BYTES] uint8, d and m
// [N * K / 32 + 8] fp16 (zeros past the end; N follows from d's size). portable: the plain C++
// path even where AVX-VNNI is at hand (the same results; tests compare them). coarse: the
// inputs keep 8 bits of each block's range, not 14 (a drafter's passes; block_mm.cpp).
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                 bool portable = false, bool coarse = false);

// A Q4_1 weight's rows N in q4_mm's layout for K inputs; raises a clear error where qs, d and
// m are not that layout (q4_mm checks every call; exact_layers once per pass and projection)
int64_t q4_checked_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t k);

// Rounding buffers q4_mm_into reuses from call to call (each grown to the largest call's need)
struct Q4Scratch {
  std::vector<int8_t> bytes;
  std::vector<float> dx, xs;
};

// y [rows, N] = x [rows, K] @ W.T, both contiguous fp32, W in q4_mm's layout (checked by the
// caller with q4_checked_rows); the same bits as q4_mm
void q4_mm_into(const float* x, int64_t rows, int64_t k, const at::Tensor& qs, const at::Tensor& d,
                const at::Tensor& m, float* y, Q4Scratch& scratch, bool portable = false,
                bool coarse = false);

// x [M, K] fp32 @ W.T -> [M, N] fp32, W as Q8_0: qs [N, K] int8, d [N, K / 32] fp16 (w = d q).
// portable: the generic 16-lane loop even where an AVX2 one is written out (the same bits).
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, bool portable = false);

}  // namespace d3d

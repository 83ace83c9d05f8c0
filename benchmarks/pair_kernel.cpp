// The AVX-512 pair kernel of models/csrc/block_mm.cpp timed alone, for
// benchmarks/bench_pair_kernel.py: one pair of weight rows against R rounded input rows, over
// and over on the same bytes, so that weights and inputs stay in L1 and what is measured is
// the kernel's own instructions. The kernel's source is included whole (bench_pair_kernel.py
// puts this file beside a copy of models/csrc), its operators under a namespace of their own.
#include "block_mm.cpp"

#include <pybind11/pybind11.h>

#include <chrono>

namespace d3d {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// ns per (input row, weight-row pair, octet of 8 blocks) of q4_pair_vnni<R, COARSE> over
// `groups` blocks of inputs, `calls` calls
template <int R, bool COARSE>
double time_pair(int64_t groups, int64_t calls) {
  const int64_t octets = (groups + OCTET - 1) / OCTET, row_bytes = groups * BLOCK / 2;
  const int64_t x_bytes = octets * XQ_BYTES + TAIL_BYTES;
  std::vector<uint8_t> w(2 * row_bytes + Q4_PAD_BYTES, 0x5a);
  std::vector<at::Half> dm(2 * groups + OCTET, at::Half(0.01f));
  std::vector<int8_t> storage(R * x_bytes + CACHE_LINE, 3);
  std::vector<float> dx(R * octets * OCTET, 0.5f), xs(R * octets * OCTET, 0.25f);
  std::vector<Rounded> xr(R);
  int8_t* bytes = line_aligned(storage.data());  // as q4_mm_into lays its rows out
  for (int r = 0; r < R; ++r)
    xr[r] = {bytes + r * x_bytes, dx.data() + r * octets * OCTET, xs.data() + r * octets * OCTET,
             bytes + r * x_bytes + octets * XQ_BYTES};
  alignas(64) float lanes[PAIR_TILE * PANEL * OCTET];
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    q4_pair_vnni<R, COARSE>(xr.data(), w.data(), w.data() + row_bytes, dm.data(), dm.data() + groups, dm.data(),
                            dm.data() + groups, groups, lanes, PANEL * OCTET);
    asm volatile("" : : "r"(lanes), "r"(xr.data()) : "memory");  // the outputs count, the inputs may change
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return secs * 1e9 / (static_cast<double>(calls) * R * groups / OCTET);
}

template <bool C>
double by_rows(int rows, int64_t groups, int64_t calls) {
  switch (rows) {
    case 1: return time_pair<1, C>(groups, calls);
    case 2: return time_pair<2, C>(groups, calls);
    case 4: return time_pair<4, C>(groups, calls);
    case 5: return time_pair<5, C>(groups, calls);
    case 8: return time_pair<8, C>(groups, calls);
    default: TORCH_CHECK(false, "rows: 1, 2, 4, 5 or 8");
  }
}
#endif

}  // namespace
}  // namespace d3d

// ns per input row, weight-row pair and octet; -1 where the build has no AVX-512 pair kernel
double ns_per_row_pair_octet(int64_t rows, bool coarse, int64_t groups, int64_t calls) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  const int r = static_cast<int>(rows);
  return coarse ? d3d::by_rows<true>(r, groups, calls) : d3d::by_rows<false>(r, groups, calls);
#else
  return -1.0;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("ns_per_row_pair_octet", &ns_per_row_pair_octet); }

// What this CPU can do at most, for benchmarks/bench_floors.py: the throughput of the vector
// instructions the block products are made of (models/csrc/block_mm.cpp), and the memory read
// bandwidth, each on 1 thread and on `threads` threads at once (OpenMP), so that what a second
// thread adds is measured rather than assumed.
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <vector>

namespace {

constexpr int CHAINS = 12;  // independent accumulators, more than latency x throughput needs

// Keeps the accumulators in registers and their results live
#define KEEP(v)                                                                                      \
  asm volatile("" : "+v"(v[0]), "+v"(v[1]), "+v"(v[2]), "+v"(v[3]), "+v"(v[4]), "+v"(v[5]), "+v"(v[6]), \
               "+v"(v[7]), "+v"(v[8]), "+v"(v[9]), "+v"(v[10]), "+v"(v[11]))

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// n / CHAINS rounds of CHAINS instructions `op(sum, x, y)`, four a chain between the barriers
// that keep the sums in registers, their operands taken in turn from a, b and c. The loop's
// shape moves the rate a lot here: one byte dot product a chain between barriers ran at
// 0.8-0.95 ns, four at 0.27-0.31, with the same 12 chains. The faster is what the instruction
// allows, and the floor takes that one.
template <typename V, typename Op>
void chains(int64_t n, V start, V a, V b, V c, Op op) {
  V acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = start;
  asm volatile("" : "+v"(a), "+v"(b), "+v"(c));  // not constants to the compiler
  for (int64_t r = 0; r < n / (4 * CHAINS); ++r) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = op(acc[i], a, b);
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = op(acc[i], c, a);
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = op(acc[i], a, c);
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = op(acc[i], b, a);
    KEEP(acc);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
void dpbusd_loop(int64_t n) {  // byte dot products, 64 products each
  chains(n, _mm512_set1_epi32(1), _mm512_set1_epi8(3), _mm512_set1_epi8(5), _mm512_set1_epi8(7),
         [](__m512i s, __m512i x, __m512i y) { return _mm512_dpbusd_epi32(s, x, y); });
}
#endif

#if defined(__AVX512F__)
void fma_loop(int64_t n) {  // fp32 multiply-adds, 16 lanes each; the sums stay near 1: no subnormals
  chains(n, _mm512_set1_ps(1.0f), _mm512_set1_ps(0.999999f), _mm512_set1_ps(1e-7f), _mm512_set1_ps(0.5f),
         [](__m512 s, __m512 x, __m512 y) { return _mm512_fmadd_ps(s, x, y); });
}
#endif

}  // namespace

// ns per instruction on each of `threads` threads running the loop at once ("dpbusd": AVX-512
// VNNI byte dot products; "fma": AVX-512 fp32 multiply-adds); -1 where the build lacks them
double ns_per_instruction(const std::string& what, int64_t n, int64_t threads) {
  void (*loop)(int64_t) = nullptr;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (what == "dpbusd") loop = dpbusd_loop;
#endif
#if defined(__AVX512F__)
  if (what == "fma") loop = fma_loop;
#endif
  if (!loop) return -1.0;
  int ran = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : ran)
  {
    loop(n);
    ran += 1;
  }
  const double ns = seconds_since(t0) * 1e9 / static_cast<double>(n);
  TORCH_CHECK(ran == threads, "asked for ", threads, " threads, ", ran, " ran");  // else the rate would be wrong
  return ns;
}

// GB/s that `threads` threads read together, each summing its own share of `bytes` (so that
// the sum is not optimised away, it is returned through `sink`)
double read_gb_per_s(int64_t bytes, int64_t threads, int64_t reps) {
  const int64_t n = bytes / sizeof(float) / 64 * 64;
  std::vector<float> buf(n, 1.0f);
  double sink = 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
#pragma omp parallel for num_threads(threads) reduction(+ : sink) schedule(static)
    for (int64_t i = 0; i < n; i += 64) {  // four cache lines a step
#if defined(__AVX512F__)
      const __m512 s0 = _mm512_add_ps(_mm512_loadu_ps(&buf[i]), _mm512_loadu_ps(&buf[i + 32]));
      const __m512 s1 = _mm512_add_ps(_mm512_loadu_ps(&buf[i + 16]), _mm512_loadu_ps(&buf[i + 48]));
      sink += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#else
      float s = 0.0f;
      for (int j = 0; j < 64; ++j) s += buf[i + j];
      sink += s;
#endif
    }
  }
  const double secs = seconds_since(t0);
  if (sink < 0) return -1.0;  // never: keeps the reads
  return static_cast<double>(n) * sizeof(float) * reps / secs / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ns_per_instruction", &ns_per_instruction);
  m.def("read_gb_per_s", &read_gb_per_s);
}

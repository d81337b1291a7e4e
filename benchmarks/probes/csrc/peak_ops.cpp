// Peak issue rate of the vector instructions the CPU kernels are made of, on every torch
// thread at once: 16 independent accumulator chains per thread (enough to hide any latency),
// nothing but the instruction in the loop. benchmarks/cpu_roofline.py divides a kernel's
// instruction count by these rates to get the fastest it could run on this machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int kChains = 16;

#define PEAK_LOOP(TYPE, INIT, OP, FOLD)                                  \
  TYPE a[kChains];                                                       \
  for (int c = 0; c < kChains; ++c) a[c] = INIT;                         \
  for (int64_t n = 0; n < iters; ++n) {                                  \
    _Pragma("GCC unroll 16") for (int c = 0; c < kChains; ++c) a[c] = OP; \
    asm volatile("" : "+x"(a[0]), "+x"(a[8]));                           \
  }                                                                      \
  double sink = 0;                                                       \
  for (int c = 0; c < kChains; ++c) sink += FOLD;                        \
  return sink;

__attribute__((target("avx2,fma"))) double fma256(int64_t iters) {
  const __m256 m = _mm256_set1_ps(1.0f), z = _mm256_set1_ps(0.0f);
  PEAK_LOOP(__m256, _mm256_set1_ps(c), _mm256_fmadd_ps(a[c], m, z),
            _mm256_cvtss_f32(a[c]))
}

__attribute__((target("avx512f"))) double fma512(int64_t iters) {
  const __m512 m = _mm512_set1_ps(1.0f), z = _mm512_set1_ps(0.0f);
  PEAK_LOOP(__m512, _mm512_set1_ps(c), _mm512_fmadd_ps(a[c], m, z),
            _mm512_reduce_add_ps(a[c]))
}

__attribute__((target("avx2,avxvnni"))) double dpbusd256(int64_t iters) {
  const __m256i w = _mm256_set1_epi8(1), x = _mm256_set1_epi8(0);
  PEAK_LOOP(__m256i, _mm256_set1_epi32(c), _mm256_dpbusd_avx_epi32(a[c], w, x),
            _mm256_extract_epi32(a[c], 0))
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double dpbusd512(int64_t iters) {
  const __m512i w = _mm512_set1_epi8(1), x = _mm512_set1_epi8(0);
  PEAK_LOOP(__m512i, _mm512_set1_epi32(c), _mm512_dpbusd_epi32(a[c], w, x),
            _mm512_reduce_add_epi32(a[c]))
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_512(int64_t iters) {
  const __m512bh w = (__m512bh)_mm512_set1_epi16(0), x = w;
  PEAK_LOOP(__m512, _mm512_set1_ps(c), _mm512_dpbf16_ps(a[c], w, x),
            _mm512_reduce_add_ps(a[c]))
}

#undef PEAK_LOOP

bool supported(const std::string& kind) {
  if (kind == "fma256") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (kind == "fma512") return __builtin_cpu_supports("avx512f");
  if (kind == "dpbusd256") return __builtin_cpu_supports("avxvnni");
  if (kind == "dpbusd512")
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  if (kind == "dpbf16_512") return __builtin_cpu_supports("avx512bf16");
  return false;
}

// Runs ``iters`` x 16 instructions of ``kind`` on each of the torch threads at once.
double run(const std::string& kind, int64_t iters) {
  TORCH_CHECK(supported(kind), kind, " does not run on this CPU (or is not a known kind)");
  double (*fn)(int64_t) = kind == "fma256"      ? fma256
                          : kind == "fma512"    ? fma512
                          : kind == "dpbusd256" ? dpbusd256
                          : kind == "dpbusd512" ? dpbusd512
                                                : dpbf16_512;
  const int64_t threads = at::get_num_threads();
  std::vector<double> sinks(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sinks[t] = fn(iters);
  });
  double s = 0;
  for (double v : sinks) s += v;
  return s;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported);
  m.def("run", &run);
  m.attr("chains") = kChains;
}

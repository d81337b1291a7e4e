// Small pieces both block-matmul translation units use (qgemm.cpp, amx.cpp): the block size, the
// weight streams' software prefetch, and the AVX-512 loads of two 8-feature groups' scales.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specserve::block_simd {

constexpr int64_t QK = 32;  // weights (and activation codes) per block

// Software prefetch of the weight streams, kPrefetchBytes of codes ahead and the scales at the
// same block distance (past a group's end that is the next group's data, which the same thread
// runs next). A 1-row step reads every weight byte once; with the hardware prefetcher alone the
// kernels read it at ~0.6 of the bandwidth of a plain sum: all projections of the built-in model
// at 1 row 3.0 -> 2.5 ms on Zen 5, every form, 4 to 16 KB ahead alike. A hint: same bits.
constexpr int64_t kPrefetchBytes = 8192;

// Addresses as integers: near the end of the weights the target lies past the array (a prefetch
// never faults, but pointer arithmetic out of bounds is undefined).
inline void prefetch_at(const void* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset),
               _MM_HINT_T0);
}

// 8 float16 scales at a, 8 at b -> 16 float32 (exact).
__attribute__((target("avx2,f16c,avx512f"))) inline __m512 load_half16(const uint16_t* a,
                                                                        const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// 8 float32 at a, 8 at b -> 16 float32.
__attribute__((target("avx2,avx512f"))) inline __m512 load_float16(const float* a,
                                                                  const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
      _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

}  // namespace specserve::block_simd

// Block-quantized matmuls for CPU decoding: y[M, N] = x[M, K] @ W[N, K]^T with W in llama.cpp's
// Q4_1 / Q8_0 block formats (32 weights per block), x quantized on the fly to int8 per block of 32
// (llama.cpp's Q8 activations), integer dot products per block, float accumulation across blocks.
//
// Layout: 8 output features interleaved (as llama.cpp's repacked "x8" CPU formats do), so one
// integer dot product serves 8 features and the float work (convert, scale, accumulate) runs on
// 8 features per instruction instead of one; packed once at load by kernels/quant.py's pack.
// G = N / 8 (N padded with zero features to a multiple of 8), KB = K / 32, feature c of group g
// is n = 8 g + c, q[c][j] its code j of the block:
//   Q4_1: qs [G, KB, 128] uint8: 4 vectors of 32 bytes; byte 4c+t of vector v holds q[c][4v+t]
//         in the low nibble and q[c][16+4v+t] in the high one; d, m [G, KB, 8] float16;
//         w = d * q + m, q in 0..15
//   Q8_0: qs [G, KB, 256] int8: 8 vectors; byte 4c+t of vector v holds q[c][4v+t];
//         d [G, KB, 8] float16; w = d * q
// Per feature and block: an exact int32 dot product of the block, then acc += float(dot) *
// (d * dx) (+ m * sum(x) for Q4_1), blocks in order.
//
// Instruction sets (the ``kernel`` argument, 256 * code class + 32 * isa + rows per pass; the
// code classes are above q8_group): 0 AVX2 (maddubs: 16-bit
// pair sums, widened), 1 AVX-VNNI and 2 AVX-512 VNNI (dpbusd: 4 products straight into int32;
// the 512-bit form runs two groups, 16 features, per instruction), 3 AMX-INT8 (tile products:
// amx.cpp, every layout, 16 rows a pass). Q8_0's signed codes go in
// as unsigned w + 128 and lose 128 * sum(x) after (exact). Rows per pass: 1, 2, 4 or 8 (that
// many rows share a pass, the rest in halving passes), or 16 in the AVX-512 form (16 at a time,
// all the rest in one pass). The integer dot is exact in every form and the float ops per
// feature are the same, so all variants give the same bits; the tuner (kernels/tuner.py) picks
// whichever runs fastest on the machine.
//
// Batch invariance: y[i, n] is computed by the same sequence of instructions whatever M is and
// however rows are grouped (1 to 16 rows share each unpacked weight block; each row keeps its
// own accumulators and its own block order), and whatever the thread split over groups. So row
// i of an M-row call equals the 1-row call bit for bit, which is what makes a k+1-row
// speculative verify pick exactly the tokens one-row decode steps would. Built with
// -ffp-contract=off so the compiler never fuses a multiply-add in one code path and not in
// another.
// Only the headers used, not torch/extension.h (all of libtorch's API): a cold build's compile
// time is mostly header parsing (CPU seconds on a Zen 3: qgemm.cpp 57 -> 28, fused.cpp 75 -> 43).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "block_simd.h"
#include "pool.h"

namespace {

using specserve::pool::parallel_for;
using specserve::block_simd::kPrefetchBytes;
using specserve::block_simd::load_float16;
using specserve::block_simd::load_half16;
using specserve::block_simd::prefetch_at;
using specserve::block_simd::QK;

// Sum of the 8 lanes, always in the same order.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// One row of activations -> int8 per block of 32 (scale amax/127, round to nearest even) plus
// the block scale, the exact float sum of the block (for Q4_1's min term) and the exact integer
// sums of its codes, per block and per half block of 16 (for the offset code classes below).
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* xs,
                  int32_t* xh) {
  const int64_t KB = K / QK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      sum = _mm256_add_ps(sum, v[j]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float am = _mm_cvtss_f32(m4);
    const float d = am / 127.0f;
    const float id = am > 0.0f ? 127.0f / am : 0.0f;
    dx[b] = d;
    sx[b] = hsum(sum);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int j = 0; j < 4; ++j) {
      __m256 s = _mm256_round_ps(_mm256_mul_ps(v[j], vid),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i32[j] = _mm256_cvtps_epi32(s);
    }
    alignas(32) int32_t lanes[2][8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), _mm256_add_epi32(i32[0], i32[1]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), _mm256_add_epi32(i32[2], i32[3]));
    for (int h = 0; h < 2; ++h)
      xh[2 * b + h] = lanes[h][0] + lanes[h][1] + lanes[h][2] + lanes[h][3] + lanes[h][4] +
                      lanes[h][5] + lanes[h][6] + lanes[h][7];
    xs[b] = xh[2 * b] + xh[2 * b + 1];
    // Pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane; permute restores order).
    __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK), p);
  }
}

// Per-call scratch for the quantized activations, kept per calling thread so a decode step's
// 121 projections allocate nothing (the pool's workers only read it).
struct QuantRows {
  std::vector<int8_t> xq;  // [M, K]
  std::vector<float> dx;   // [M, KB] block scales
  std::vector<float> sx;   // [M, KB] block float sums
  std::vector<int32_t> xs;  // [M, KB] block code sums (Q8_0 under dpbusd)
  std::vector<int32_t> xh;  // [M, KB, 2] half-block code sums (the offset code classes)
};

const QuantRows& quantize_rows(const at::Tensor& x) {
  thread_local QuantRows q;
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  q.xq.resize(M * K);
  q.dx.resize(M * KB);
  q.sx.resize(M * KB);
  q.xs.resize(M * KB);
  q.xh.resize(M * KB * 2);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.xq.data();
  float* dp = q.dx.data();
  float* sp = q.sx.data();
  int32_t* ip = q.xs.data();
  int32_t* hp = q.xh.data();
  parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * K, K, qp + i * K, dp + i * KB, sp + i * KB, ip + i * KB,
                   hp + i * KB * 2);
  });
  return q;
}

// 4 activation bytes (one group of 4 codes) broadcast to all 8 lanes.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// 8 float16 scales -> float32 (exact).
inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int BlockBytes>
inline void prefetch_codes(const void* group, int64_t b) {
  // every line a block touches (a 160-byte block straddles 3 of them)
  for (int l = 0; l < (BlockBytes + 63) / 64; ++l)
    prefetch_at(group, b * BlockBytes + kPrefetchBytes + 64 * l);
}

// 8 float16 scales a block: one 64-byte line holds 4 blocks' worth.
template <int BlockBytes>
inline void prefetch_scales(const uint16_t* group, int64_t b) {
  if ((b & 3) == 0) prefetch_at(group, (b + kPrefetchBytes / BlockBytes) * 16);
}

// One Q4_1 block of a group (128 bytes) -> its 8 vectors of codes 0..15: w[v] the low nibbles
// of vector v, w[v + 4] the high ones.
inline void unpack_q4(const uint8_t* p, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
    w[v] = _mm256_and_si256(raw, low);
    w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
}

// Q4_1, 8 features interleaved: per (group, block) 128 bytes = 4 vectors; byte 4c+t of vector v
// holds q[c][4v+t] (low nibble) and q[c][4v+16+t] (high nibble). out[r]: the 8 features of
// row i0 + r.
template <int R>
void q4_group(int64_t g, int64_t i0, int64_t KB, const uint8_t* qs, const uint16_t* d,
              const uint16_t* m, const int8_t* xq, const float* dx, const float* sx, int64_t K,
              __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* qg = qs + g * KB * 128;
  const uint16_t* dg = d + g * KB * 8;
  const uint16_t* mg = m + g * KB * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<128>(qg, b);
    prefetch_scales<128>(dg, b);
    prefetch_scales<128>(mg, b);
    __m256i w[8];
    unpack_q4(qg + b * 128, w);
    const __m256 dv = load_half8(dg + b * 8);
    const __m256 mv = load_half8(mg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // 8 products of <= 2*15*127 each: the 16-bit sum stays below 2^15.
      __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xb));
      for (int v = 1; v < 8; ++v)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[v], bcast4(xb + 4 * v)));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Code classes (kernel / 256, set per tensor from its codes' range by kernels/quant.py) of the
// int8 codes in the Q8_0 layout (Q8_0 itself, Q5_0) and the Q8_F form below:
//   class 0: any int8: |w| times x carrying w's sign (maddubs takes unsigned x signed); each
//            product pair (<= 2*128*127) needs its own 32-bit widening;
//   class 1: 0..31 (Q5_1, Q4_K, Q5_K), class 2: -16..15 (Q5_0), class 3: -32..31 (Q6_K):
//            u = q + off (0, 16, 32) is a non-negative byte maddubs takes as is, and NS of its
//            16-bit pair sums (each <= 2 * umax * 127: NS 4 for umax 31, 2 for 63) add up in 16
//            bits before one widening; dot = sum(u * x) - off * sum(x).
// Every integer dot is exact, so all classes give a tensor the same sums and the same bits; the
// small-range ones take about a third fewer instructions a row.
constexpr int kCodeClasses = 4;
constexpr int kClassOffset[kCodeClasses] = {0, 0, 16, 32};

// A block's 8 code vectors (256 bytes at p) plus the byte offset in vo, as unsigned bytes.
inline void load_offset_codes(const int8_t* p, __m256i vo, __m256i* u) {
  for (int v = 0; v < 8; ++v)
    u[v] = _mm256_add_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v)), vo);
}

// Five-bit codes ("P5", class 2 only: Q5_0's u = q + 16 in 0..31), 160 bytes per (group, block)
// instead of 256: the low nibbles of u in Q4_1's layout (128 bytes: byte 4c+t of vector v holds
// u[c][4v+t] low, u[c][16+4v+t] high), then 32 bytes of fifth bits, byte 4c+t holding bit 4 of
// u[c][4j+t] at bit j for j = 0..7. A 1-row step reads 35% fewer bytes of these tensors; the
// unpack (shift, mask, or per vector) is shared by the rows of a pass. The unpacked vectors are
// the class-2 offset form's u exactly, so the dots, and the bits, are that form's.
constexpr int64_t kP5Bytes = 160;

inline void unpack_q5(const uint8_t* p, __m256i* u) {
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  for (int v = 0; v < 4; ++v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
    u[v] = _mm256_and_si256(raw, low);
    u[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
  // bit j of each byte to bit 4: a 16-bit shift by at most 4 keeps bit 4 of both bytes within
  // its own byte, and the mask drops the rest
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128));
  u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
  u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
  u[2] = _mm256_or_si256(u[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit4));
  u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit4));
  u[4] = _mm256_or_si256(u[4], _mm256_and_si256(hb, bit4));
  u[5] = _mm256_or_si256(u[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit4));
  u[6] = _mm256_or_si256(u[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bit4));
  u[7] = _mm256_or_si256(u[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), bit4));
}

// One block of 8 interleaved features (byte 4c+t of vector v holds q[c][4v+t]) held for the
// rows' dots: NS 0 the class-0 sign form, else class NS's offset form.
template <int NS>
struct BlockCodes {
  __m256i w[8], a[8];  // NS 0: the codes and their magnitudes; else w holds u = q + off

  void load(const int8_t* p, __m256i vo) {
    if constexpr (NS == 0) {
      for (int v = 0; v < 8; ++v) {
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
        a[v] = _mm256_sign_epi8(w[v], w[v]);
      }
    } else {
      load_offset_codes(p, vo, w);
    }
  }

  void load_p5(const uint8_t* p) { unpack_q5(p, w); }  // NS 4, class 2: w holds u

  // Half h (codes 16h..16h+15, vectors 4h..4h+3) against row codes xb: the exact int32 dot per
  // feature, less off * sum(x) (the caller's, for NS > 0).
  __m256i half(const int8_t* xb, int h) const {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    if constexpr (NS == 0) {
      for (int v = 4 * h; v < 4 * h + 4; ++v)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(
                _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(bcast4(xb + 4 * v), w[v])), ones));
    } else {
      for (int v0 = 4 * h; v0 < 4 * h + 4; v0 += NS) {
        __m256i p = _mm256_maddubs_epi16(w[v0], bcast4(xb + 4 * v0));
        for (int v = v0 + 1; v < v0 + NS; ++v)
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[v], bcast4(xb + 4 * v)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
      }
    }
    return s;
  }
};

// Q8_0 layout, 8 features interleaved: per (group, block) 256 bytes = 8 vectors and 8 float16
// scales; acc += dot * (d * dx) per block. NS picks the code class's form (BlockCodes).
// P5: the five-bit layout (kP5Bytes a block; NS 4, off 16).
template <int R, int NS, bool P5 = false>
void q8_group(int64_t g, int64_t i0, int64_t KB, const int8_t* qs, const uint16_t* d,
              const int8_t* xq, const float* dx, const int32_t* xs, int off, int64_t K,
              __m256* out) {
  constexpr int64_t kBytes = P5 ? kP5Bytes : 256;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* qg = qs + g * KB * kBytes;
  const uint16_t* dg = d + g * KB * 8;
  const __m256i vo = _mm256_set1_epi8(static_cast<char>(off));
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<kBytes>(qg, b);
    prefetch_scales<kBytes>(dg, b);
    BlockCodes<NS> c;
    if constexpr (P5)
      c.load_p5(reinterpret_cast<const uint8_t*>(qg + b * kBytes));
    else
      c.load(qg + b * 256, vo);
    const __m256 dv = load_half8(dg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      __m256i s = _mm256_add_epi32(c.half(xb, 0), c.half(xb, 1));
      if constexpr (NS > 0) s = _mm256_add_epi32(s, _mm256_set1_epi32(-off * xs[i * KB + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                               _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#define SPECSERVE_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define SPECSERVE_TARGET_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// AVX-VNNI forms of q4_group / q8_group: dpbusd adds 4 u8 x s8 products into each int32 lane.
// Two accumulators halve the chain of dependent dpbusd a lone row waits on.
template <int R>
SPECSERVE_TARGET_VNNI void q4_group_vnni(int64_t g, int64_t i0, int64_t KB, const uint8_t* qs,
                                         const uint16_t* d, const uint16_t* m, const int8_t* xq,
                                         const float* dx, const float* sx, int64_t K,
                                         __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* qg = qs + g * KB * 128;
  const uint16_t* dg = d + g * KB * 8;
  const uint16_t* mg = m + g * KB * 8;
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<128>(qg, b);
    prefetch_scales<128>(dg, b);
    prefetch_scales<128>(mg, b);
    __m256i w[8];
    unpack_q4(qg + b * 128, w);
    const __m256 dv = load_half8(dg + b * 8);
    const __m256 mv = load_half8(mg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // two dependent chains for 1-2 rows, one per row beyond (rows give the ILP)
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int v = 0; v < 8; v += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, w[v], bcast4(xb + 4 * v));
        if constexpr (R <= 2)
          s1 = _mm256_dpbusd_avx_epi32(s1, w[v + 1], bcast4(xb + 4 * v + 4));
        else
          s0 = _mm256_dpbusd_avx_epi32(s0, w[v + 1], bcast4(xb + 4 * v + 4));
      }
      const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
SPECSERVE_TARGET_VNNI void q8_group_vnni(int64_t g, int64_t i0, int64_t KB, const int8_t* qs,
                                         const uint16_t* d, const int8_t* xq, const float* dx,
                                         const int32_t* xs, int64_t K, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* qg = qs + g * KB * 256;
  const uint16_t* dg = d + g * KB * 8;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<256>(qg, b);
    prefetch_scales<256>(dg, b);
    __m256i u[8];  // w + 128 as unsigned bytes
    load_offset_codes(qg + b * 256, flip, u);
    const __m256 dv = load_half8(dg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // two dependent chains for 1-2 rows, one per row beyond (rows give the ILP)
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int v = 0; v < 8; v += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, u[v], bcast4(xb + 4 * v));
        if constexpr (R <= 2)
          s1 = _mm256_dpbusd_avx_epi32(s1, u[v + 1], bcast4(xb + 4 * v + 4));
        else
          s0 = _mm256_dpbusd_avx_epi32(s0, u[v + 1], bcast4(xb + 4 * v + 4));
      }
      const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0, s1),
                                         _mm256_set1_epi32(128 * xs[i * KB + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                               _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// A block's 8 code vectors of two groups (Q8_0 layout at a and b) side by side, + 128 (as
// unsigned bytes, which dpbusd takes).
SPECSERVE_TARGET_AVX512 inline void load_pair_flipped(const int8_t* a, const int8_t* b,
                                                      __m512i* u) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int v = 0; v < 8; ++v)
    u[v] = _mm512_xor_si512(
        _mm512_inserti64x4(
            _mm512_castsi256_si512(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * v))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * v)), 1),
        flip);
}

// AVX-512 VNNI: groups g and g + 1 side by side in one 512-bit vector (16 features), whose
// outputs are adjacent in y, so each row stores 16 floats at once.
template <int R>
SPECSERVE_TARGET_AVX512 void q4_pair_avx512(int64_t g, int64_t i0, int64_t KB,
                                            const uint8_t* qs, const uint16_t* d,
                                            const uint16_t* m, const int8_t* xq, const float* dx,
                                            const float* sx, int64_t K, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* qa = qs + g * KB * 128;
  const uint8_t* qb = qa + KB * 128;
  const uint16_t* da = d + g * KB * 8;
  const uint16_t* ma = m + g * KB * 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<128>(qa, b);
    prefetch_codes<128>(qb, b);
    prefetch_scales<128>(da, b);
    prefetch_scales<128>(da + KB * 8, b);
    prefetch_scales<128>(ma, b);
    prefetch_scales<128>(ma + KB * 8, b);
    __m512i w[8];
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + b * 128 + 32 * v))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + b * 128 + 32 * v)), 1);
      w[v] = _mm512_and_si512(raw, low);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const __m512 dv = load_half16(da + b * 8, da + KB * 8 + b * 8);
    const __m512 mv = load_half16(ma + b * 8, ma + KB * 8 + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // two dependent chains for 1-2 rows, one per row beyond (rows give the ILP)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int v = 0; v < 8; v += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[v], _mm512_set1_epi32(load4(xb + 4 * v)));
        if constexpr (R <= 2)
          s1 = _mm512_dpbusd_epi32(s1, w[v + 1], _mm512_set1_epi32(load4(xb + 4 * v + 4)));
        else
          s0 = _mm512_dpbusd_epi32(s0, w[v + 1], _mm512_set1_epi32(load4(xb + 4 * v + 4)));
      }
      const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dv, _mm512_set1_ps(dx[i * KB + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
SPECSERVE_TARGET_AVX512 void q8_pair_avx512(int64_t g, int64_t i0, int64_t KB, const int8_t* qs,
                                            const uint16_t* d, const int8_t* xq, const float* dx,
                                            const int32_t* xs, int64_t K, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* qa = qs + g * KB * 256;
  const int8_t* qb = qa + KB * 256;
  const uint16_t* da = d + g * KB * 8;
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<256>(qa, b);
    prefetch_codes<256>(qb, b);
    prefetch_scales<256>(da, b);
    prefetch_scales<256>(da + KB * 8, b);
    __m512i u[8];  // w + 128 as unsigned bytes
    load_pair_flipped(qa + b * 256, qb + b * 256, u);
    const __m512 dv = load_half16(da + b * 8, da + KB * 8 + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // two dependent chains for 1-2 rows, one per row beyond (rows give the ILP)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int v = 0; v < 8; v += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[v], _mm512_set1_epi32(load4(xb + 4 * v)));
        if constexpr (R <= 2)
          s1 = _mm512_dpbusd_epi32(s1, u[v + 1], _mm512_set1_epi32(load4(xb + 4 * v + 4)));
        else
          s0 = _mm512_dpbusd_epi32(s0, u[v + 1], _mm512_set1_epi32(load4(xb + 4 * v + 4)));
      }
      const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1),
                                         _mm512_set1_epi32(128 * xs[i * KB + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                               _mm512_mul_ps(dv, _mm512_set1_ps(dx[i * KB + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Q8_F ("int8 codes, float scales"), the form every K-quant and the 5-bit types run as: the
// file's integer codes as int8 in Q8_0's interleaved layout (qs [G, KB, 256]), a float32 scale
// per half block of 16 (d [G, KB, 2, 8]: Q6_K's sub-block scale d * sc, or one scale twice) and
// an optional float32 min per block (m [G, KB, 8]: -dmin * m of Q4_K / Q5_K, Q5_1's m). The
// scales are products of the file's float16 and small integers, exact in float32 and not in
// float16, hence their own form. Per feature and block: two exact int32 dots (codes 0-15 and
// 16-31), acc += dot_lo * (d_lo * dx) + dot_hi * (d_hi * dx) (+ m * sum(x)), blocks in order:
// the same instructions whatever the row count, rows per pass or thread split.
template <int R, int NS>
void q8f_group(int64_t g, int64_t i0, int64_t KB, const int8_t* qs, const float* d,
               const float* m, const int8_t* xq, const float* dx, const float* sx,
               const int32_t* xh, int off, int64_t K, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* qg = qs + g * KB * 256;
  const float* dg = d + g * KB * 16;
  const float* mg = m == nullptr ? nullptr : m + g * KB * 8;
  const __m256i vo = _mm256_set1_epi8(static_cast<char>(off));
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<256>(qg, b);
    prefetch_at(dg, b * 64 + kPrefetchBytes / 4);
    BlockCodes<NS> c;
    c.load(qg + b * 256, vo);
    const __m256 d0 = _mm256_loadu_ps(dg + b * 16);
    const __m256 d1 = _mm256_loadu_ps(dg + b * 16 + 8);
    const __m256 mv = mg == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(mg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      __m256i s[2];
      for (int h = 0; h < 2; ++h) {
        s[h] = c.half(xb, h);
        if constexpr (NS > 0)
          s[h] = _mm256_add_epi32(s[h], _mm256_set1_epi32(-off * xh[2 * (i * KB + b) + h]));
      }
      const __m256 xd = _mm256_set1_ps(dx[i * KB + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(d0, xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(d1, xd), acc[r]);
      if (mg != nullptr) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// The AVX-512 VNNI form of q8f_group: groups g and g + 1 side by side (16 features), every
// code class as u = q + 128 (dpbusd takes unsigned x signed), dot = sum(u * x) - 128 * sum(x)
// per half block (exact), then q8f_group's float ops lane for lane.
template <int R>
SPECSERVE_TARGET_AVX512 void q8f_pair_avx512(int64_t g, int64_t i0, int64_t KB, const int8_t* qs,
                                             const float* d, const float* m, const int8_t* xq,
                                             const float* dx, const float* sx,
                                             const int32_t* xh, int64_t K, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* qa = qs + g * KB * 256;
  const int8_t* qb = qa + KB * 256;
  const float* da = d + g * KB * 16;
  const float* db = da + KB * 16;
  const float* ma = m == nullptr ? nullptr : m + g * KB * 8;
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_codes<256>(qa, b);
    prefetch_codes<256>(qb, b);
    prefetch_at(da, b * 64 + kPrefetchBytes / 4);
    prefetch_at(db, b * 64 + kPrefetchBytes / 4);
    __m512i u[8];  // q + 128 as unsigned bytes
    load_pair_flipped(qa + b * 256, qb + b * 256, u);
    const __m512 d0 = load_float16(da + b * 16, db + b * 16);
    const __m512 d1 = load_float16(da + b * 16 + 8, db + b * 16 + 8);
    const __m512 mv = ma == nullptr ? _mm512_setzero_ps()
                                    : load_float16(ma + b * 8, ma + KB * 8 + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      __m512i s[2];
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm512_set1_epi32(-128 * xh[2 * (i * KB + b) + h]);
        for (int v = 4 * h; v < 4 * h + 4; ++v)
          s[h] = _mm512_dpbusd_epi32(s[h], u[v], _mm512_set1_epi32(load4(xb + 4 * v)));
      }
      const __m512 xd = _mm512_set1_ps(dx[i * KB + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(d0, xd), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(d1, xd), acc[r]);
      if (ma != nullptr) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

struct ScaledJob {
  const int8_t* qs;
  const float* d;
  const float* m;     // null: no min term
  const float* bias;  // null when none
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* xh;
  float* y;
  int64_t M, K, KB, N;
  int rows_per_pass;
  int code_class;
};

template <int R>
void q8f_pass(const ScaledJob& j, int64_t g, int64_t i) {
  __m256 out[R];
  const int off = kClassOffset[j.code_class];
  switch (j.code_class) {
    case 0:
      q8f_group<R, 0>(g, i, j.KB, j.qs, j.d, j.m, j.xq, j.dx, j.sx, j.xh, 0, j.K, out);
      break;
    case 3:
      q8f_group<R, 2>(g, i, j.KB, j.qs, j.d, j.m, j.xq, j.dx, j.sx, j.xh, off, j.K, out);
      break;
    default:
      q8f_group<R, 4>(g, i, j.KB, j.qs, j.d, j.m, j.xq, j.dx, j.sx, j.xh, off, j.K, out);
  }
  const __m256 bv = j.bias != nullptr ? _mm256_loadu_ps(j.bias + 8 * g) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(j.y + (i + r) * j.N + 8 * g,
                     j.bias != nullptr ? _mm256_add_ps(out[r], bv) : out[r]);
}

template <int R>
SPECSERVE_TARGET_AVX512 void q8f_avx512_pass(const ScaledJob& j, int64_t g, int64_t i) {
  __m512 out[R];
  q8f_pair_avx512<R>(g, i, j.KB, j.qs, j.d, j.m, j.xq, j.dx, j.sx, j.xh, j.K, out);
  const __m512 bv = j.bias != nullptr ? _mm512_loadu_ps(j.bias + 8 * g) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(j.y + (i + r) * j.N + 8 * g,
                     j.bias != nullptr ? _mm512_add_ps(out[r], bv) : out[r]);
}

void run_q8f(const ScaledJob& j, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t i = 0;
    if (j.rows_per_pass >= 8)
      for (; i + 8 <= j.M; i += 8) q8f_pass<8>(j, g, i);
    if (j.rows_per_pass >= 4)
      for (; i + 4 <= j.M; i += 4) q8f_pass<4>(j, g, i);
    if (j.rows_per_pass >= 2)
      for (; i + 2 <= j.M; i += 2) q8f_pass<2>(j, g, i);
    for (; i < j.M; ++i) q8f_pass<1>(j, g, i);
  }
}

// One block_linear call's operands, for the per-instruction-set loops below.
struct Job {
  const void* qs;
  const uint16_t* d;
  const uint16_t* m;  // null for Q8_0
  const float* bias;  // null when none
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* xs;
  float* y;
  int64_t M, K, KB, N;
  int rows_per_pass;
  int code_class;
  bool p5;  // five-bit codes (class 2): the AVX2 form runs them, whatever the kernel's isa
};

// Each ISA's pass: rows i..i+R-1 of group g (of groups g, g + 1 for AVX-512), bias added, stored.
// Plain functions, not lambdas: a lambda does not inherit its enclosing function's target.
template <int R>
void avx2_pass(const Job& j, int64_t g, int64_t i) {
  __m256 out[R];
  const int8_t* q8 = static_cast<const int8_t*>(j.qs);
  if (j.m != nullptr)
    q4_group<R>(g, i, j.KB, static_cast<const uint8_t*>(j.qs), j.d, j.m, j.xq, j.dx, j.sx, j.K,
                out);
  else if (j.p5)
    q8_group<R, 4, true>(g, i, j.KB, q8, j.d, j.xq, j.dx, j.xs, 16, j.K, out);
  else if (j.code_class == 0)
    q8_group<R, 0>(g, i, j.KB, q8, j.d, j.xq, j.dx, j.xs, 0, j.K, out);
  else if (j.code_class == 3)
    q8_group<R, 2>(g, i, j.KB, q8, j.d, j.xq, j.dx, j.xs, 32, j.K, out);
  else
    q8_group<R, 4>(g, i, j.KB, q8, j.d, j.xq, j.dx, j.xs, kClassOffset[j.code_class], j.K, out);
  const __m256 bv = j.bias != nullptr ? _mm256_loadu_ps(j.bias + 8 * g) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(j.y + (i + r) * j.N + 8 * g,
                     j.bias != nullptr ? _mm256_add_ps(out[r], bv) : out[r]);
}

template <int R>
SPECSERVE_TARGET_VNNI void vnni_pass(const Job& j, int64_t g, int64_t i) {
  __m256 out[R];
  if (j.m != nullptr)
    q4_group_vnni<R>(g, i, j.KB, static_cast<const uint8_t*>(j.qs), j.d, j.m, j.xq, j.dx, j.sx,
                     j.K, out);
  else
    q8_group_vnni<R>(g, i, j.KB, static_cast<const int8_t*>(j.qs), j.d, j.xq, j.dx, j.xs, j.K,
                     out);
  const __m256 bv = j.bias != nullptr ? _mm256_loadu_ps(j.bias + 8 * g) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(j.y + (i + r) * j.N + 8 * g,
                     j.bias != nullptr ? _mm256_add_ps(out[r], bv) : out[r]);
}

template <int R>
SPECSERVE_TARGET_AVX512 void avx512_pass(const Job& j, int64_t g, int64_t i) {
  __m512 out[R];
  if (j.m != nullptr)
    q4_pair_avx512<R>(g, i, j.KB, static_cast<const uint8_t*>(j.qs), j.d, j.m, j.xq, j.dx,
                      j.sx, j.K, out);
  else
    q8_pair_avx512<R>(g, i, j.KB, static_cast<const int8_t*>(j.qs), j.d, j.xq, j.dx, j.xs, j.K,
                      out);
  const __m512 bv = j.bias != nullptr ? _mm512_loadu_ps(j.bias + 8 * g) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(j.y + (i + r) * j.N + 8 * g,
                     j.bias != nullptr ? _mm512_add_ps(out[r], bv) : out[r]);
}

// AVX-512 only (32 vector registers hold 16 rows' accumulators beside a block's 8 code vectors):
// rows_per_pass 16 runs 16 rows at a time, then all the rows left in one pass. A 13-row verify
// unpacks each block once instead of three times (8 + 4 + 1), and a lone last row no longer
// runs a pass of its own: 1.5x faster at 13 rows, 1.14x at 9, 1.2-1.3x at 16-17 (Zen 5).
#define SPECSERVE_ROW_PASSES_ANY(PASS)                                           \
  {                                                                              \
    int64_t i = 0;                                                               \
    for (; i + 16 <= j.M; i += 16) PASS<16>(j, g, i);                            \
    switch (j.M - i) {                                                           \
      case 1: PASS<1>(j, g, i); break;                                           \
      case 2: PASS<2>(j, g, i); break;                                           \
      case 3: PASS<3>(j, g, i); break;                                           \
      case 4: PASS<4>(j, g, i); break;                                           \
      case 5: PASS<5>(j, g, i); break;                                           \
      case 6: PASS<6>(j, g, i); break;                                           \
      case 7: PASS<7>(j, g, i); break;                                           \
      case 8: PASS<8>(j, g, i); break;                                           \
      case 9: PASS<9>(j, g, i); break;                                           \
      case 10: PASS<10>(j, g, i); break;                                         \
      case 11: PASS<11>(j, g, i); break;                                         \
      case 12: PASS<12>(j, g, i); break;                                         \
      case 13: PASS<13>(j, g, i); break;                                         \
      case 14: PASS<14>(j, g, i); break;                                         \
      case 15: PASS<15>(j, g, i); break;                                         \
      default: break;                                                            \
    }                                                                            \
  }

// All rows of group g: 8 at a time, then 4, 2, 1, as rows_per_pass allows.
#define SPECSERVE_ROW_PASSES(PASS)                                               \
  {                                                                              \
    int64_t i = 0;                                                               \
    if (j.rows_per_pass >= 8)                                                    \
      for (; i + 8 <= j.M; i += 8) PASS<8>(j, g, i);                             \
    if (j.rows_per_pass >= 4)                                                    \
      for (; i + 4 <= j.M; i += 4) PASS<4>(j, g, i);                             \
    if (j.rows_per_pass >= 2)                                                    \
      for (; i + 2 <= j.M; i += 2) PASS<2>(j, g, i);                             \
    for (; i < j.M; ++i) PASS<1>(j, g, i);                                       \
  }

void run_avx2(const Job& j, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) SPECSERVE_ROW_PASSES(avx2_pass)
}

SPECSERVE_TARGET_VNNI void run_vnni(const Job& j, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) SPECSERVE_ROW_PASSES(vnni_pass)
}

// Q8_F's forms under the names the pair loop below calls for either job.
void run_avx2(const ScaledJob& j, int64_t g0, int64_t g1) { run_q8f(j, g0, g1); }
template <int R>
SPECSERVE_TARGET_AVX512 void avx512_pass(const ScaledJob& j, int64_t g, int64_t i) {
  q8f_avx512_pass<R>(j, g, i);
}

// Pairs [p0, p1) of groups (2p, 2p + 1); an odd last group runs the AVX2 form (same bits).
template <typename J>
SPECSERVE_TARGET_AVX512 void run_avx512(const J& j, int64_t G, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = 2 * p;
    if (g + 1 == G)
      run_avx2(j, g, g + 1);
    else if (j.rows_per_pass == 16)
      SPECSERVE_ROW_PASSES_ANY(avx512_pass)
    else
      SPECSERVE_ROW_PASSES(avx512_pass)
  }
}
#undef SPECSERVE_ROW_PASSES
#undef SPECSERVE_ROW_PASSES_ANY

enum Isa : int64_t { kAvx2 = 0, kAvxVnni = 1, kAvx512Vnni = 2, kAmx = 3 };

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kAvx2:
      return true;
    case kAvxVnni:
      return __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAmx:
      return specserve::amx::supported();
    default:
      return false;
  }
}

// The AMX form over group pairs [p0, p1) of G groups: whole pairs on the tiles, an odd last
// group through `single` (another form: the same bits).
template <typename Single>
void run_amx(const specserve::amx::Operands& op, int64_t G, int64_t p0, int64_t p1,
             const Single& single) {
  const int64_t whole = std::min(p1, G / 2);
  if (p0 < whole) specserve::amx::run_pairs(op, p0, whole);
  if (p1 > whole && G % 2 == 1) single(G - 1, G);
}

}  // namespace

at::Tensor scaled_block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                               const c10::optional<at::Tensor>& m,
                               const c10::optional<at::Tensor>& bias, int64_t kernel);

// kernel = 256 * code class + 32 * isa + rows_per_pass (see the header and the code classes).
// The class is the caller's statement about the codes' range (kernels/quant.py measures it on
// the planes); class 0 holds for any codes. Q8_F planes (float32 scales
// [G, KB, 2, 8]) go to scaled_block_linear, so every caller (the whole-layer path of fused.cpp
// too) runs any format through this one entry.
// kernel | (1 << 10): run qs5, the layer's five-bit planes, instead of qs (the same numbers).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs_int8, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias,
                        int64_t kernel, const c10::optional<at::Tensor>& qs5) {
  constexpr int64_t kFiveBit = 1 << 10;
  TORCH_CHECK(!(kernel & kFiveBit) || qs5.has_value(),
              "kernel bit 1 << 10 runs five-bit planes: pass qs5 (kernels/quant.py)");
  const at::Tensor& qs = (kernel & kFiveBit) ? *qs5 : qs_int8;
  kernel &= ~kFiveBit;
  if (d.scalar_type() == at::kFloat && d.dim() == 4)
    return scaled_block_linear(x, qs, d, m, bias, kernel);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const bool q4 = m.has_value();
  const int64_t M = x.size(0), K = x.size(1), G = qs.size(0), KB = qs.size(1), N = 8 * G;
  TORCH_CHECK(K == KB * QK, "x has ", K, " columns, the weight has ", KB, " blocks of 32");
  const bool p5 = !q4 && qs.dim() == 3 && qs.size(2) == kP5Bytes;
  TORCH_CHECK(qs.dim() == 3 && (qs.size(2) == (q4 ? 128 : 256) || p5) && qs.is_contiguous(),
              "packed weight must be [N / 8, K / 32, ", q4 ? "128" : "256 or 160",
              "] (kernels/quant.py pack)");
  TORCH_CHECK(!p5 || kernel / 256 == 2, "five-bit codes ([N / 8, K / 32, 160]) are code "
              "class 2 (kernel / 256 == 2), got class ", kernel / 256);
  TORCH_CHECK(d.sizes() == at::IntArrayRef({G, KB, 8}) && d.is_contiguous() &&
                  d.scalar_type() == at::kHalf,
              "scales must be float16 [N / 8, K / 32, 8]");
  TORCH_CHECK(!q4 || (m->sizes() == d.sizes() && m->is_contiguous() &&
                      m->scalar_type() == at::kHalf),
              "mins must be like scales");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have N (padded to 8) entries");
  const int64_t code_class = kernel / 256, isa = kernel % 256 / 32, rows_per_pass = kernel % 32;
  TORCH_CHECK(code_class >= 0 && code_class < kCodeClasses, "kernel / 256 (code class) must be 0-",
              kCodeClasses - 1, ", got ", code_class);
  TORCH_CHECK(isa == kAmx ? rows_per_pass == 16
                          : (rows_per_pass == 1 || rows_per_pass == 2 || rows_per_pass == 4 ||
                             rows_per_pass == 8 || (rows_per_pass == 16 && isa == 2)),
              "kernel % 32 (rows per pass) must be 1, 2, 4 or 8, or 16 for AVX-512 VNNI (isa 2), "
              "16 only for AMX (isa 3), got ", rows_per_pass, " with isa ", isa);
  TORCH_CHECK(isa_supported(isa), "kernel / 32 = ", isa,
              " names an instruction set this CPU lacks (0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI, "
              "3 AMX-INT8)");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& xr = quantize_rows(x);
  const Job job{qs.data_ptr(),
                reinterpret_cast<const uint16_t*>(d.data_ptr()),
                q4 ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr,
                bias.has_value() ? bias->data_ptr<float>() : nullptr,
                xr.xq.data(),
                xr.dx.data(),
                xr.sx.data(),
                xr.xs.data(),
                y.data_ptr<float>(),
                M,
                K,
                KB,
                N,
                static_cast<int>(rows_per_pass),
                q4 ? 0 : static_cast<int>(code_class),
                p5};
  // Split over groups of 8 output features only: a row's sums never depend on the thread split.
  // A few chunks a thread (the policy's chunks per thread), claimed as threads come free
  // (kernels/csrc/pool.h); under the openmp policy one static piece a thread, as before.
  const int64_t cuts = specserve::pool::team_size() *
                       (specserve::pool::dynamic() ? specserve::pool::chunks_per_thread() : 4);
  if (isa == kAmx && !p5) {
    const specserve::amx::Operands op{
        q4 ? specserve::amx::Layout::kQ4_1 : specserve::amx::Layout::kQ8, job.qs, job.d, job.m,
        job.bias, job.xq, job.dx, job.sx, job.y, M, K, KB, N};
    const int64_t pairs = (G + 1) / 2;
    specserve::pool::parallel_for(0, pairs, std::max<int64_t>(1, pairs / cuts),
                                  [&](int64_t p0, int64_t p1) {
                                    run_amx(op, G, p0, p1, [&](int64_t g0, int64_t g1) {
                                      run_avx2(job, g0, g1);
                                    });
                                  });
  } else if (isa == kAvx512Vnni && !p5) {
    const int64_t pairs = (G + 1) / 2;
    specserve::pool::parallel_for(0, pairs, std::max<int64_t>(1, pairs / cuts),
                                  [&](int64_t p0, int64_t p1) { run_avx512(job, G, p0, p1); });
  } else {
    const int64_t chunk = std::max<int64_t>(2, G / cuts);
    specserve::pool::parallel_for(0, G, chunk, [&](int64_t g0, int64_t g1) {
      if (isa == kAvxVnni && !p5)
        run_vnni(job, g0, g1);
      else
        run_avx2(job, g0, g1);
    });
  }
  return y;
}

// Q8_F weights (see q8f_group). kernel as block_linear's: the AVX-512 VNNI (isa 2) and AMX
// (isa 3) forms where asked for, else the AVX2 one (AVX-VNNI too), its rows per pass above 8
// run as 8 (the same bits in every form).
at::Tensor scaled_block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                               const c10::optional<at::Tensor>& m,
                               const c10::optional<at::Tensor>& bias, int64_t kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), G = qs.size(0), KB = qs.size(1), N = 8 * G;
  TORCH_CHECK(K == KB * QK, "x has ", K, " columns, the weight has ", KB, " blocks of 32");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 256 && qs.is_contiguous() &&
                  qs.scalar_type() == at::kChar,
              "packed weight must be int8 [N / 8, K / 32, 256] (kernels/quant.py pack)");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({G, KB, 2, 8}) && d.is_contiguous() &&
                  d.scalar_type() == at::kFloat,
              "scales must be float32 [N / 8, K / 32, 2, 8]");
  TORCH_CHECK(!m.has_value() || (m->sizes() == at::IntArrayRef({G, KB, 8}) &&
                                 m->is_contiguous() && m->scalar_type() == at::kFloat),
              "mins must be float32 [N / 8, K / 32, 8]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have N (padded to 8) entries");
  const int64_t isa = kernel % 256 / 32;
  TORCH_CHECK(isa_supported(isa), "kernel / 32 = ", isa,
              " names an instruction set this CPU lacks (0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI, "
              "3 AMX-INT8)");
  const bool amx = isa == kAmx, avx512 = isa == kAvx512Vnni;
  const int64_t code_class = kernel / 256,
                rows_per_pass = avx512 ? kernel % 32 : std::min<int64_t>(kernel % 32, 8);
  TORCH_CHECK(code_class >= 0 && code_class < kCodeClasses, "kernel / 256 (code class) must be 0-",
              kCodeClasses - 1, ", got ", code_class);
  TORCH_CHECK(rows_per_pass == 1 || rows_per_pass == 2 || rows_per_pass == 4 ||
                  rows_per_pass == 8 || (rows_per_pass == 16 && avx512),
              "kernel % 32 (rows per pass) must be 1, 2, 4, 8 or 16, got ", kernel % 32);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& xr = quantize_rows(x);
  const ScaledJob job{qs.data_ptr<int8_t>(), d.data_ptr<float>(),
                      m.has_value() ? m->data_ptr<float>() : nullptr,
                      bias.has_value() ? bias->data_ptr<float>() : nullptr,
                      xr.xq.data(), xr.dx.data(), xr.sx.data(), xr.xh.data(),
                      y.data_ptr<float>(), M, K, KB, N, static_cast<int>(rows_per_pass),
                      static_cast<int>(code_class)};
  // Split over groups of 8 output features only, as block_linear.
  const int64_t cuts = specserve::pool::team_size() *
                       (specserve::pool::dynamic() ? specserve::pool::chunks_per_thread() : 4);
  if (amx) {
    const specserve::amx::Operands op{specserve::amx::Layout::kQ8F, job.qs, job.d, job.m,
                                      job.bias, job.xq, job.dx, job.sx, job.y, M, K, KB, N};
    const int64_t pairs = (G + 1) / 2;
    specserve::pool::parallel_for(0, pairs, std::max<int64_t>(1, pairs / cuts),
                                  [&](int64_t p0, int64_t p1) {
                                    run_amx(op, G, p0, p1, [&](int64_t g0, int64_t g1) {
                                      run_q8f(job, g0, g1);
                                    });
                                  });
    return y;
  }
  if (avx512) {
    const int64_t pairs = (G + 1) / 2;
    specserve::pool::parallel_for(0, pairs, std::max<int64_t>(1, pairs / cuts),
                                  [&](int64_t p0, int64_t p1) {
                                    run_avx512(job, G, p0, p1);
                                  });
    return y;
  }
  const int64_t chunk = std::max<int64_t>(2, G / cuts);
  specserve::pool::parallel_for(0, G, chunk,
                                [&](int64_t g0, int64_t g1) { run_q8f(job, g0, g1); });
  return y;
}

bool block_isa_supported(int64_t isa) { return isa_supported(isa); }

// Writes back and drops every cache line of each tensor's bytes from every cache level, so the
// next read comes from memory, as a forward meets a projection whose weights exceed the cache
// (kernels/tuner.py's cache_evictor): a few MB of flushes instead of reading twice the cache
// (2-core Xeon, 300 MB L3: 24 MB flushed in 1.0 ms, against 31 ms to read 600 MB). CLFLUSHOPT
// (the caller checks the CPU has it): plain CLFLUSH is ordered and took 59 ms there.
__attribute__((target("clflushopt"))) void evict_from_cache(
    const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr()) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
    for (uintptr_t line = begin; line < end; line += 64)
      _mm_clflushopt(reinterpret_cast<void*>(line));
  }
  _mm_mfence();
}

void register_fused(pybind11::module& mod);  // fused.cpp
void register_pool(pybind11::module& mod);   // pool.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  register_fused(mod);
  register_pool(mod);
  // Without the GIL, as fused.cpp's entries (why: there).
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  mod.def("block_linear", &block_linear,
          "y = x @ W^T for Q4_1 (m given), Q8_0 (m None) or Q8_F (float32 scales) block "
          "weights, int8 activations; kernel = 256 * code class + 32 * isa + rows per pass, "
          "| 1 << 10 to run qs5 (five-bit codes) instead of qs",
          pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("d"), pybind11::arg("m"),
          pybind11::arg("bias"), pybind11::arg("kernel"), pybind11::arg("qs5") = pybind11::none(),
          NoGil());
  mod.def("scaled_block_linear", &scaled_block_linear,
          "y = x @ W^T for Q8_F block weights (int8 codes, float32 half-block scales, optional "
          "float32 mins), int8 activations; kernel as block_linear's", NoGil());
  mod.def("evict_from_cache", &evict_from_cache,
          "Flushes the tensors' bytes from every cache level (CLFLUSHOPT: check the CPU has "
          "it): their next read is from memory", NoGil());
  mod.def("block_isa_supported", &block_isa_supported,
          "True when this CPU runs block_linear's instruction set `isa` (0, 1, 2 or 3)");
}

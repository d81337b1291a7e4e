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
// Batch invariance: y[i, n] is computed by the same sequence of instructions whatever M is and
// however rows are grouped (1, 2 or 4 rows share each unpacked weight block; each row keeps its
// own accumulators and its own block order), and whatever the thread split over groups. So row
// i of an M-row call equals the 1-row call bit for bit, which is what makes a k+1-row
// speculative verify pick exactly the tokens one-row decode steps would. Built with
// -ffp-contract=off so the compiler never fuses a multiply-add in one code path and not in
// another.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t QK = 32;

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
// the block scale and the exact float sum of the block (for Q4_1's min term).
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
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
      __m256 s = _mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i32[j] = _mm256_cvtps_epi32(s);
    }
    // Pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane; permute restores order).
    __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK), p);
  }
}

// Per-call scratch for the quantized activations, kept per calling thread so a decode step's
// 121 projections allocate nothing (the OpenMP workers only read it).
struct QuantRows {
  std::vector<int8_t> xq;  // [M, K]
  std::vector<float> dx;   // [M, KB] block scales
  std::vector<float> sx;   // [M, KB] block float sums
};

const QuantRows& quantize_rows(const at::Tensor& x) {
  thread_local QuantRows q;
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  q.xq.resize(M * K);
  q.dx.resize(M * KB);
  q.sx.resize(M * KB);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.xq.data();
  float* dp = q.dx.data();
  float* sp = q.sx.data();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * K, K, qp + i * K, dp + i * KB, sp + i * KB);
  });
  return q;
}

inline __m256i bcast4(const int8_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// Q4_1, 8 columns interleaved: per (group, block) 128 bytes = 4 vectors; byte 4c+t of vector v
// holds q[c][4v+t] (low nibble) and q[c][4v+16+t] (high nibble).
// 8 float16 scales -> float32 (exact).
inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R>
void q4_group(int64_t g, int64_t i0, int64_t KB, const uint8_t* qs, const uint16_t* d,
              const uint16_t* m,
              const int8_t* xq, const float* dx, const float* sx, int64_t K, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* qg = qs + g * KB * 128;
  const uint16_t* dg = d + g * KB * 8;
  const uint16_t* mg = m + g * KB * 8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < KB; ++b) {
    __m256i w[8];
    for (int v = 0; v < 4; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + b * 128 + 32 * v));
      w[v] = _mm256_and_si256(raw, low);
      w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    const __m256 dv = load_half8(dg + b * 8);
    const __m256 mv = load_half8(mg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      // 8 products of <= 2*15*127 each: the 16-bit sum stays below 2^15.
      __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xb));
      for (int v = 1; v < 8; ++v) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[v], bcast4(xb + 4 * v)));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[i * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Q8_0, 8 columns interleaved: per (group, block) 256 bytes = 8 vectors; byte 4c+t of vector v
// holds q[c][4v+t].
template <int R>
void q8_group(int64_t g, int64_t i0, int64_t KB, const int8_t* qs, const uint16_t* d,
              const int8_t* xq, const float* dx, int64_t K, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* qg = qs + g * KB * 256;
  const uint16_t* dg = d + g * KB * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < KB; ++b) {
    __m256i w[8], a[8];
    for (int v = 0; v < 8; ++v) {
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + b * 256 + 32 * v));
      a[v] = _mm256_sign_epi8(w[v], w[v]);
    }
    const __m256 dv = load_half8(dg + b * 8);
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + r;
      const int8_t* xb = xq + i * K + b * QK;
      __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(a[0], _mm256_sign_epi8(bcast4(xb), w[0])), ones);
      for (int v = 1; v < 8; ++v)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(
                _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(bcast4(xb + 4 * v), w[v])), ones));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * KB + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

}  // namespace

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias,
                        int64_t rows_per_pass) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const bool q4 = m.has_value();
  const int64_t M = x.size(0), K = x.size(1), G = qs.size(0), KB = qs.size(1), N = 8 * G;
  TORCH_CHECK(K == KB * QK, "x has ", K, " columns, the weight has ", KB, " blocks of 32");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == (q4 ? 128 : 256) && qs.is_contiguous(),
              "packed weight must be [N / 8, K / 32, ", q4 ? 128 : 256, "] (kernels/quant.py pack)");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({G, KB, 8}) && d.is_contiguous() &&
                  d.scalar_type() == at::kHalf,
              "scales must be float16 [N / 8, K / 32, 8]");
  TORCH_CHECK(!q4 || (m->sizes() == d.sizes() && m->is_contiguous() && m->scalar_type() == at::kHalf),
              "mins must be like scales");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "bias must have N (padded to 8) entries");
  TORCH_CHECK(rows_per_pass == 1 || rows_per_pass == 2 || rows_per_pass == 4,
              "rows_per_pass must be 1, 2 or 4");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& xr = quantize_rows(x);
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* mp = q4 ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int8_t* xqp = xr.xq.data();
  const float* dxp = xr.dx.data();
  const float* sxp = xr.sx.data();
  float* yp = y.data_ptr<float>();
  // Split over groups of 8 output features only: a row's sums never depend on the thread split.
  const int64_t grain = std::max<int64_t>(2, G / (4 * at::get_num_threads()));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const __m256 bv = bp != nullptr ? _mm256_loadu_ps(bp + 8 * g) : _mm256_setzero_ps();
      int64_t i = 0;
#define SPECSERVE_RUN(R)                                                                     \
  {                                                                                          \
    __m256 out[R];                                                                           \
    if (q4)                                                                                  \
      q4_group<R>(g, i, KB, reinterpret_cast<const uint8_t*>(qs.data_ptr()), dp, mp, xqp,    \
                  dxp, sxp, K, out);                                                         \
    else                                                                                     \
      q8_group<R>(g, i, KB, reinterpret_cast<const int8_t*>(qs.data_ptr()), dp, xqp, dxp, K, \
                  out);                                                                      \
    for (int r = 0; r < R; ++r)                                                              \
      _mm256_storeu_ps(yp + (i + r) * N + 8 * g, bp != nullptr ? _mm256_add_ps(out[r], bv)   \
                                                                : out[r]);                   \
  }
      if (rows_per_pass >= 4)
        for (; i + 4 <= M; i += 4) SPECSERVE_RUN(4)
      if (rows_per_pass >= 2)
        for (; i + 2 <= M; i += 2) SPECSERVE_RUN(2)
      for (; i < M; ++i) SPECSERVE_RUN(1)
#undef SPECSERVE_RUN
    }
  });
  return y;
}

void register_fused(pybind11::module& mod);  // fused.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  register_fused(mod);
  mod.def("block_linear", &block_linear,
          "y = x @ W^T for Q4_1 (m given) or Q8_0 (m None) block weights, int8 activations");
}

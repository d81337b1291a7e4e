// Block-quantized matmuls for CPU decoding: y[M, N] = x[M, K] @ W[N, K]^T with W in llama.cpp's
// Q4_1 / Q8_0 block formats (32 weights per block), x quantized on the fly to int8 per block of 32
// (llama.cpp's Q8 activations), integer dot products per block, float accumulation across blocks.
//
// Layouts (the GGUF file's own bytes, split into planes):
//   Q4_1: qs [N, KB, 16] uint8 (byte j: q[j] in the low nibble, q[j+16] in the high nibble),
//         d [N, KB] float32, m [N, KB] float32;         w = d * q + m,  q in 0..15
//   Q8_0: qs [N, KB, 32] int8, d [N, KB] float32;        w = d * q
//
// Batch invariance: y[i, n] is computed by the same sequence of instructions whatever M is and
// however rows are grouped (1, 2 or 4 rows share each unpacked weight block; each row keeps its
// own accumulator and its own block order), and whatever the thread split over N. So row i of an
// M-row call equals the 1-row call bit for bit, which is what makes a k+1-row speculative verify
// pick exactly the tokens one-row decode steps would. Built with -ffp-contract=off so the compiler
// never fuses a multiply-add in one code path and not in another.
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

// 32 Q4 nibbles (16 bytes) -> 32 uint8 in weight order.
inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Integer dot product of 32 uint8 weights with 32 int8 activations, as 8 float partial sums.
inline __m256 dot_u8s8(__m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(w, x);  // |sum| <= 2*15*127: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// Same for signed int8 weights: |w| times x carrying w's sign (|sum| <= 2*127*127 < 2^15).
inline __m256 dot_s8s8(__m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

template <int R, bool Q4>
void rows_kernel(int64_t n0, int64_t n1, int64_t i0, int64_t KB, int64_t N, const uint8_t* qs,
                 const float* d, const float* m, const int8_t* xq, const float* dx,
                 const float* sx, const float* bias, float* y) {
  constexpr int64_t kBytes = Q4 ? QK / 2 : QK;
  const int64_t K = KB * QK;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    float accm[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      accm[r] = 0.0f;
    }
    const uint8_t* qn = qs + n * KB * kBytes;
    const float* dn = d + n * KB;
    for (int64_t b = 0; b < KB; ++b) {
      const __m256i w = Q4 ? unpack_q4(qn + b * kBytes)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + b * kBytes));
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + r;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + b * QK));
        const __m256 p = Q4 ? dot_u8s8(w, xv) : dot_s8s8(w, xv);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dn[b] * dx[i * KB + b]), p, acc[r]);
        if (Q4) accm[r] = accm[r] + m[n * KB + b] * sx[i * KB + b];
      }
    }
    for (int r = 0; r < R; ++r) {
      float v = hsum(acc[r]) + accm[r];
      if (bias != nullptr) v = v + bias[n];
      y[(i0 + r) * N + n] = v;
    }
  }
}

}  // namespace

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias,
                        int64_t rows_per_pass) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const bool q4 = m.has_value();
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), KB = qs.size(1);
  TORCH_CHECK(K == KB * QK, "x has ", K, " columns, the weight has ", KB, " blocks of 32");
  TORCH_CHECK(qs.size(2) == (q4 ? QK / 2 : QK), "packed weight has the wrong block size");
  TORCH_CHECK(rows_per_pass == 1 || rows_per_pass == 2 || rows_per_pass == 4,
              "rows_per_pass must be 1, 2 or 4");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& xr = quantize_rows(x);
  const uint8_t* qsp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q4 ? m->data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int8_t* xqp = xr.xq.data();
  const float* dxp = xr.dx.data();
  const float* sxp = xr.sx.data();
  float* yp = y.data_ptr<float>();
  // Split over output features only: a row's sums never depend on the thread split.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t i = 0;
#define SPECSERVE_RUN(R)                                                                    \
  if (q4)                                                                                   \
    rows_kernel<R, true>(n0, n1, i, KB, N, qsp, dp, mp, xqp, dxp, sxp, bp, yp);            \
  else                                                                                      \
    rows_kernel<R, false>(n0, n1, i, KB, N, qsp, dp, mp, xqp, dxp, sxp, bp, yp);
    if (rows_per_pass >= 4)
      for (; i + 4 <= M; i += 4) { SPECSERVE_RUN(4) }
    if (rows_per_pass >= 2)
      for (; i + 2 <= M; i += 2) { SPECSERVE_RUN(2) }
    for (; i < M; ++i) { SPECSERVE_RUN(1) }
#undef SPECSERVE_RUN
  });
  return y;
}

void register_fused(pybind11::module& mod);  // fused.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  register_fused(mod);
  mod.def("block_linear", &block_linear,
          "y = x @ W^T for Q4_1 (m given) or Q8_0 (m None) block weights, int8 activations");
}

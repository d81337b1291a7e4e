// Fused float32 CPU ops for the quantized decode path: each replaces several small torch ops
// (a decode step of a 30-layer model ran ~20 ms of such ops around ~11 ms of matmuls), and each
// computes every row on its own, in a fixed order, so a row's result never depends on how many
// rows share the call (batch invariance, see qgemm.cpp).
//
//   rms_norm(x, w, eps)            y = w * (x / sqrt(mean(x^2) + eps)), per row
//   add_rms_norm_(x, r, w, eps)    r += x (the residual stream, in place); returns rms_norm(r)
//   rotary_qkv_(qkv, cos, sin, H, KVH, D)  rotate-half RoPE on the q and k parts, in place
//   silu_mul(gate_up)              silu(gate) * up for gate_up = [gate | up]
//   paged_attention(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window)
//       one query row at absolute position p attends keys 0..p (p-window+1..p with a sliding
//       window) of its sequence in the paged cache: scores, max, exp, sum, weighted values,
//       all in key order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// Sum of squares, 8 lanes then a fixed horizontal order; K need not be a multiple of 8.
inline float sum_squares(const float* x, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum8(acc);
  for (; i < K; ++i) s = s + x[i] * x[i];
  return s;
}

inline void norm_row(const float* x, const float* w, float eps, int64_t K, float* y) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, K) / static_cast<float>(K) + eps);
  for (int64_t i = 0; i < K; ++i) y[i] = w[i] * (x[i] * inv);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be a contiguous float32 [T, K] tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * K, wp, (float)eps, K, yp + t * K);
  });
  return y;
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                         double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* r = rp + t * K;
      for (int64_t i = 0; i < K; ++i) r[i] = r[i] + xp[t * K + i];
      norm_row(r, wp, (float)eps, K, yp + t * K);
    }
  });
  return y;
}

void rotary_qkv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
                 int64_t KVH, int64_t D) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), W = qkv.size(1), half = D / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D,
              "cos/sin must be contiguous [T, D]");
  float* p = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H + KVH; ++h) {  // q heads then k heads: contiguous in qkv
        float* x = p + t * W + h * D;
        for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * c[i] - x[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) tmp[i] = x[i] * c[i] + x[i - half] * s[i];
        std::copy(tmp.begin(), tmp.end(), x);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float a = g[t * 2 * I + i];
        yp[t * I + i] = (a / (1.0f + std::exp(-a))) * g[t * 2 * I + I + i];
      }
  });
  return y;
}

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < D; ++i) s = s + a[i] * b[i];
  return s;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_of, const at::Tensor& pos_of, double scale,
                           int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "caches must be contiguous float32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), maxb = block_tables.size(1);
  const int64_t group = H / KVH;
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(),
              *vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t *sq = seq_of.data_ptr<int64_t>(), *ps = pos_of.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, T * H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    std::vector<float> acc(D);
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / H, h = th % H, kvh = h / group;
      const int64_t pos = ps[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int32_t* table = bt + sq[t] * maxb;
      const float* qv = qp + (t * H + h) * D;
      scores.resize(pos - lo + 1);
      float mx = -INFINITY;
      for (int64_t j = lo; j <= pos; ++j) {
        const int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
        const float s = dot(qv, kp + (slot * KVH + kvh) * D, D) * sc;
        scores[j - lo] = s;
        mx = std::max(mx, s);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = lo; j <= pos; ++j) {
        const float p = std::exp(scores[j - lo] - mx);
        sum = sum + p;
        const int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
        const float* vv = vp + (slot * KVH + kvh) * D;
        for (int64_t i = 0; i < D; ++i) acc[i] = acc[i] + p * vv[i];
      }
      float* o = op + (t * H + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] = acc[i] / sum;
    }
  });
  return out;
}

}  // namespace

void register_fused(pybind11::module& mod) {
  mod.def("rms_norm", &rms_norm);
  mod.def("add_rms_norm_", &add_rms_norm_);
  mod.def("rotary_qkv_", &rotary_qkv_);
  mod.def("silu_mul", &silu_mul);
  mod.def("paged_attention", &paged_attention);
}

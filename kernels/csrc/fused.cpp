// Fused float32 CPU ops for the quantized decode path: each replaces several small torch ops
// (a decode step of a 30-layer model ran ~20 ms of such ops around ~11 ms of matmuls), and each
// computes every row on its own, in a fixed order, so a row's result never depends on how many
// rows share the call (batch invariance, see qgemm.cpp).
//
//   rms_norm(x, w, eps)            y = w * (x / sqrt(mean(x^2) + eps)), per row
//   add_rms_norm_(x, r, w, eps)    r += x (the residual stream, in place); returns rms_norm(r)
//   rotary_qkv_(qkv, cos, sin, H, KVH, D)  rotate-half RoPE on the q and k parts, in place
//   silu_mul(gate_up)              silu(gate) * up for gate_up = [gate | up]
//   gelu_tanh_mul(gate_up)         gelu_tanh(gate) * up (Gemma's MLP)
//   softcap_(x, cap)               x = cap * tanh(x / cap), in place (Gemma 2's final logits)
//   paged_attention(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window, form)
//       one query row at absolute position p attends keys 0..p (p-window+1..p with a sliding
//       window) of its sequence in the paged cache: scores, max, exp, sum, weighted values,
//       all in key order.
//   paged_attention_capped(..., form, softcap)  the same with each score s (after the scale)
//       replaced by softcap * tanh(s / softcap) (Gemma 2)
//
// Parallel regions run on the kernels' own pool (pool.h): chunks claimed as threads come free,
// which moves no bit, since each row's (or work item's) arithmetic is its own.
// Only the headers used, not torch/extension.h (all of libtorch's API): a cold build's compile
// time is mostly header parsing (CPU seconds on a Zen 3: qgemm.cpp 57 -> 28, fused.cpp 75 -> 43).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "pool.h"

namespace {

using specserve::pool::parallel_for;

// A bfloat16 cache element (its 16 bits; a type of its own so the loads below overload on it).
struct bf16_t {
  uint16_t bits;
};

// float32 -> bfloat16 bits, rounded to nearest even (what torch's .to(torch.bfloat16) gives for
// finite values), 8 at a time with integer ops: any AVX2 CPU writes the same cache.
inline __m128i to_bf16x8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// exp on 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial, scale by 2^n);
// within 2 ulp of expf over [-87, 88]. Ours, so every row computes it the same way.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  const float c[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                     5.0000001201e-1f};
  for (float ci : c) y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(ci));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
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
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
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
  parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
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
  parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* gt = g + t * 2 * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 a = _mm256_loadu_ps(gt + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f),
                                         exp256(_mm256_sub_ps(_mm256_setzero_ps(), a)));
        _mm256_storeu_ps(yp + t * I + i,
                         _mm256_mul_ps(_mm256_div_ps(a, den), _mm256_loadu_ps(gt + I + i)));
      }
      for (; i < I; ++i) yp[t * I + i] = (gt[i] / (1.0f + std::exp(-gt[i]))) * gt[I + i];
    }
  });
  return y;
}

// gelu_tanh(g) * up, g and up the halves of each row: 0.5 g (1 + tanh(u)), u = sqrt(2 / pi)
// (g + 0.044715 g^3), tanh(u) = 1 - 2 / (1 + exp(2u)). Every element's arithmetic depends only
// on its place in its row (8 lanes, then the tail), so rows never depend on the batch.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr float kAlpha = 0.7978845608028654f, kBeta = 0.044715f;
  parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* gt = g + t * 2 * I;
      int64_t i = 0;
      const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
      for (; i + 8 <= I; i += 8) {
        const __m256 a = _mm256_loadu_ps(gt + i);
        const __m256 a3 = _mm256_mul_ps(_mm256_mul_ps(a, a), a);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kAlpha),
                                       _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(kBeta), a3)));
        const __m256 th = _mm256_sub_ps(
            one, _mm256_div_ps(two, _mm256_add_ps(one, exp256(_mm256_mul_ps(two, u)))));
        const __m256 gl = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), a),
                                        _mm256_add_ps(one, th));
        _mm256_storeu_ps(yp + t * I + i, _mm256_mul_ps(gl, _mm256_loadu_ps(gt + I + i)));
      }
      for (; i < I; ++i) {
        const float a = gt[i], u = kAlpha * (a + kBeta * (a * a * a));
        const float th = 1.0f - 2.0f / (1.0f + std::exp(2.0f * u));
        yp[t * I + i] = (0.5f * a * (1.0f + th)) * gt[I + i];
      }
    }
  });
  return y;
}

// x = cap * tanh(x / cap) in place, one scalar tanh per element (torch's vectorized tanh can
// round an element differently when a thread's chunk boundary moves with the row count).
void softcap_(at::Tensor& x, double cap) {
  check_rows(x, "x");
  const int64_t T = x.size(0), K = x.size(1);
  float* xp = x.data_ptr<float>();
  const float c = (float)cap;
  parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b * K; i < e * K; ++i) xp[i] = c * std::tanh(xp[i] / c);
  });
}

// r += x, row by row, in place (the residual stream): torch's add_ would run a prefill chunk's
// rows as an OpenMP region, whose workers then spin beside the pool's.
void add_rows_(at::Tensor& r, const at::Tensor& x) {
  check_rows(r, "residual");
  check_rows(x, "x");
  TORCH_CHECK(r.sizes() == x.sizes(), "residual and x must have the same shape");
  const int64_t T = r.size(0), K = r.size(1);
  float* rp = r.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b * K; i < e * K; ++i) rp[i] = rp[i] + xp[i];
  });
}

// Columns [c0, c0 + n) of x [T, W] as a new contiguous [T, n] tensor (q out of the fused qkv
// output; .contiguous() would copy a prefill chunk in an OpenMP region).
at::Tensor copy_columns(const at::Tensor& x, int64_t c0, int64_t n) {
  check_rows(x, "x");
  const int64_t T = x.size(0), W = x.size(1);
  TORCH_CHECK(c0 >= 0 && n >= 0 && c0 + n <= W, "columns out of range");
  at::Tensor y = at::empty({T, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) std::copy(xp + t * W + c0, xp + t * W + c0 + n, yp + t * n);
  });
  return y;
}

// Query rows are taken in tiles of up to ``tile`` consecutive positions of one sequence (the
// attention kernel's second part, measured per machine); a tile and one KV head's query heads
// read each key and value row once. Each query row still computes its own scores, max, sum and
// weighted values in key order with the same instructions: tiling and grouping change no bits.
constexpr int64_t kMaxTile = 32;
// Keys per chunk in the item loops: 64 key (or value) rows of head_dim 64 are 16 KB, in L1.
constexpr int64_t kChunk = 64;

// k, v [T, KVH, D] (rows may be strided views of the fused qkv output): written into the cache
// at slot_mapping first (slot -1: padding, not written), as kernels.torch_ref.write_kv does.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == D && v.stride(1) == D,
              "k and v must be float32 [T, KVH, D] with contiguous rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "slot_mapping must be int64 [T]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf ||
                   k_cache.scalar_type() == at::kBFloat16),
              "k and v caches must both be float32, both float16 or both bfloat16");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const int64_t row = KVH * D;
  if (k_cache.scalar_type() != at::kFloat) {  // 16-bit: rounded to nearest even, 8 at a time
    const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
    auto round8 = [bf16](const float* x) {
      const __m256 v = _mm256_loadu_ps(x);
      return bf16 ? to_bf16x8(v) : _mm256_cvtps_ph(v, 0);
    };
    auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
    auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      if (sm[t] < 0) continue;
      for (int64_t i = 0; i < row; i += 8) {  // D % 8 == 0
        _mm_storeu_si128(reinterpret_cast<__m128i*>(kc + sm[t] * row + i),
                         round8(kp + t * k.stride(0) + i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(vc + sm[t] * row + i),
                         round8(vp + t * v.stride(0) + i));
      }
    }
    return;
  }
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    if (sm[t] < 0) continue;
    std::copy(kp + t * k.stride(0), kp + t * k.stride(0) + row, kc + sm[t] * row);
    std::copy(vp + t * v.stride(0), vp + t * v.stride(0) + row, vc + sm[t] * row);
  }
}

// 8 cache elements as float32: float32 caches as they are, float16 ones (stored as uint16_t)
// widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const bf16_t* p) {  // bfloat16 is float32's top half: exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// One query row against 8 keys: 8 independent FMA chains over D, then one reduction tree that
// gives lane u the sum of chain u's lanes as ((0+1)+(2+3))+((4+5)+(6+7)), whatever the other
// lanes hold. So a key's score is the same bits in any group of 8 (and as a repeated tail).
template <typename T>
inline __m256 score8(const float* q, const T* const* k, int64_t D, float scale) {
  __m256 a[8];
  for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, load8(k[u] + i), a[u]);
  }
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                   _mm256_permute2f128_ps(g0, g1, 0x31));
  return _mm256_mul_ps(sum, _mm256_set1_ps(scale));
}

// acc[D] (+)= sum over keys j in [a0, z) of p[j] * v_j, in key order, one FMA per lane and key
// (resume: continue from acc, else start from zero); NV = D / 8 accumulators kept in registers
// (NV = 0: any D, the same arithmetic in memory).
template <int NV, typename T>
inline void weigh_values_nv(const float* p, const T* const* vals, int64_t a0, int64_t z,
                            int64_t nv, float* acc, bool resume) {
  constexpr int kN = NV > 0 ? NV : 32;
  const int64_t n = NV > 0 ? NV : nv;
  __m256 a[kN];
  for (int64_t i = 0; i < n; ++i)
    a[i] = resume ? _mm256_loadu_ps(acc + 8 * i) : _mm256_setzero_ps();
  for (int64_t j = a0; j < z; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
    const T* v = vals[j];
    for (int64_t i = 0; i < n; ++i) a[i] = _mm256_fmadd_ps(pv, load8(v + 8 * i), a[i]);
  }
  for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

template <typename T>
inline void weigh_values(const float* p, const T* const* vals, int64_t a0, int64_t z,
                         int64_t nv, float* acc, bool resume) {
  switch (nv) {
    case 4: return weigh_values_nv<4>(p, vals, a0, z, nv, acc, resume);
    case 8: return weigh_values_nv<8>(p, vals, a0, z, nv, acc, resume);
    case 16: return weigh_values_nv<16>(p, vals, a0, z, nv, acc, resume);
    default: return weigh_values_nv<0>(p, vals, a0, z, nv, acc, resume);
  }
}

// max of x[a0..z): 8 lanes, then the tail (a max is exact in any order; one dependent chain of
// scalar max over 1000 keys cost a third of a verify's attention).
inline float max_of(const float* x, int64_t a0, int64_t z) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = a0;
  for (; j + 8 <= z; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int u = 1; u < 8; ++u) m = std::max(m, lanes[u]);
  for (; j < z; ++j) m = std::max(m, x[j]);
  return m;
}

// sr[j..min(j + 8, z)) = the first lanes of s8.
inline void store_scores(__m256 s8, int64_t j, int64_t z, float* sr) {
  if (j + 8 <= z) {
    _mm256_storeu_ps(sr + j, s8);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, s8);
    std::copy(tmp, tmp + (z - j), sr + j);
  }
}

// Scores of one query row against keys [a0, z) (sr[j] = score of key j), 8 keys at a time; a
// tail group repeats its last key. Same bits for a key whatever the other keys of its group.
template <typename T>
void score_row(const float* q, const T* const* keys, int64_t a0, int64_t z, int64_t D,
               float scale, float* sr) {
  for (int64_t j = a0; j < z; j += 8) {
    const T* k8[8];
    for (int u = 0; u < 8; ++u) k8[u] = keys[std::min(j + u, z - 1)];
    const __m256 s8 = score8(q, k8, D, scale);
    store_scores(s8, j, z, sr);
  }
}

// AVX-512 forms of score_row and weigh_values, for head dims that are multiples of 16: 16 lanes
// per FMA, and the weighted values for G (1-4) query heads of one position at a time (they
// attend the same keys, so each value row loaded serves G rows). Their sums run in another order
// than the AVX2 forms', so one process passes one form for every call (``form``, chosen by
// measuring: kernels/attention_form.py); each row's own arithmetic does not depend on G or on
// what else shares the call.
#define SPECSERVE_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))

SPECSERVE_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECSERVE_TARGET_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPECSERVE_TARGET_AVX512 inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Lane u = scale * (the sum of chain u's 16 lanes): each chain's two 8-lane halves added, then
// score8's reduction tree.
SPECSERVE_TARGET_AVX512 inline __m256 reduce8_512(const __m512* a, float scale) {
  __m256 h[8];
  for (int u = 0; u < 8; ++u)
    h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[u]), 1)));
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                   _mm256_permute2f128_ps(g0, g1, 0x31));
  return _mm256_mul_ps(sum, _mm256_set1_ps(scale));
}

// As score8: 8 FMA chains over D, 16 lanes each, then reduce8_512.
template <typename T>
SPECSERVE_TARGET_AVX512 inline __m256 score8_512(const float* q, const T* const* k, int64_t D,
                                                 float scale) {
  __m512 a[8];
  for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qv, load16(k[u] + i), a[u]);
  }
  return reduce8_512(a, scale);
}

template <typename T>
SPECSERVE_TARGET_AVX512 void score_row_512(const float* q, const T* const* keys, int64_t a0,
                                           int64_t z, int64_t D, float scale, float* sr) {
  for (int64_t j = a0; j < z; j += 8) {
    const T* k8[8];
    for (int u = 0; u < 8; ++u) k8[u] = keys[std::min(j + u, z - 1)];
    const __m256 s8 = score8_512(q, k8, D, scale);
    store_scores(s8, j, z, sr);
  }
}

// acc[g][0, D) (+)= sum over keys j in [a0, z) of p[g][j] * v_j for G rows, in key order, one
// FMA per lane and key (resume: continue from acc[g], else from zero). NV = D / 16 (0: any D).
template <int G, int NV, typename T>
SPECSERVE_TARGET_AVX512 void weigh_rows_512_nv(const float* const* p, const T* const* vals,
                                               int64_t a0, int64_t z, int64_t nv,
                                               float* const* acc, bool resume) {
  constexpr int kN = NV > 0 ? NV : 16;
  const int64_t n = NV > 0 ? NV : nv;
  __m512 a[G][kN];
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i)
      a[g][i] = resume ? _mm512_loadu_ps(acc[g] + 16 * i) : _mm512_setzero_ps();
  for (int64_t j = a0; j < z; ++j) {
    const T* v = vals[j];
    __m512 pv[G];
    for (int g = 0; g < G; ++g) pv[g] = _mm512_set1_ps(p[g][j]);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 vv = load16(v + 16 * i);
      for (int g = 0; g < G; ++g) a[g][i] = _mm512_fmadd_ps(pv[g], vv, a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(acc[g] + 16 * i, a[g][i]);
}

template <int G, typename T>
SPECSERVE_TARGET_AVX512 void weigh_rows_512(const float* const* p, const T* const* vals,
                                            int64_t a0, int64_t z, int64_t nv, float* const* acc,
                                            bool resume) {
  if (nv == 4) return weigh_rows_512_nv<G, 4, T>(p, vals, a0, z, nv, acc, resume);
  weigh_rows_512_nv<G, 0, T>(p, vals, a0, z, nv, acc, resume);
}

template <typename T>
SPECSERVE_TARGET_AVX512 void weigh_heads_512(int g, const float* const* p,
                                             const T* const* vals, int64_t a0, int64_t z,
                                             int64_t nv, float* const* acc, bool resume) {
  switch (g) {
    case 1: return weigh_rows_512<1, T>(p, vals, a0, z, nv, acc, resume);
    case 2: return weigh_rows_512<2, T>(p, vals, a0, z, nv, acc, resume);
    case 3: return weigh_rows_512<3, T>(p, vals, a0, z, nv, acc, resume);
    default: return weigh_rows_512<4, T>(p, vals, a0, z, nv, acc, resume);
  }
}

// The AVX-512 BF16 form (isa 2, bfloat16 caches, head_dim a multiple of 32): vdpbf16ps takes 32
// bfloat16 products per instruction where an FMA takes 16 float32 ones, so a verify's attention
// (compute-bound: every extra row costs its arithmetic on these CPUs) runs about half the
// multiply instructions. Scores: the query row rounded to bfloat16 once, dotted with the cached
// keys, float32 sums, score8_512's reduction (a 16-key transposing tree of adds measured slower
// on Zen 5). Weighted values: each weight
// exp(s - max) rounded to bfloat16 (and the row's sum taken over the rounded weights, so they
// still sum to one), two keys per instruction: keys pair by absolute position (2i, 2i + 1), a
// pair's key outside the row's range weighs zero, and every chunk and segment boundary falls on
// an even position, so a row's bits depend on its own keys only, in any call.
#define SPECSERVE_TARGET_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

// exp256 on 16 lanes, as its two halves.
SPECSERVE_TARGET_BF16 inline __m512 exp512(__m512 x) {
  const __m256 lo = exp256(_mm512_castps512_ps256(x));
  const __m256 hi = exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                             _mm256_castps_pd(hi), 1));
}

SPECSERVE_TARGET_BF16 inline __m512bh load_bh(const void* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// score8_512 with bfloat16 products: q (the row's bfloat16 bits) against 8 key rows, the same
// reduction.
SPECSERVE_TARGET_BF16 inline __m256 score8_dot(const uint16_t* q, const bf16_t* const* k,
                                               int64_t D, float scale) {
  __m512 a[8];
  for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 32) {
    const __m512bh qv = load_bh(q + i);
    for (int u = 0; u < 8; ++u) a[u] = _mm512_dpbf16_ps(a[u], qv, load_bh(k[u] + i));
  }
  return reduce8_512(a, scale);
}

SPECSERVE_TARGET_BF16 void score_row_dot(const uint16_t* q, const bf16_t* const* keys,
                                         int64_t a0, int64_t z, int64_t D, float scale,
                                         float* sr) {
  for (int64_t j = a0; j < z; j += 8) {
    const bf16_t* k8[8];
    for (int u = 0; u < 8; ++u) k8[u] = keys[std::min(j + u, z - 1)];
    store_scores(score8_dot(q, k8, D, scale), j, z, sr);
  }
}

// The row's query (float32) as bfloat16 bits, rounded to nearest even.
SPECSERVE_TARGET_BF16 void round_row_bf16(const float* q, int64_t D, uint16_t* out) {
  for (int64_t i = 0; i < D; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16),
                                                              _mm512_loadu_ps(q + i)));
}

// p[a0..z) = bfloat16(exp(s - mx)) (bits), 16 lanes from a0 (the tail masked); returns the sum
// of the rounded weights: lane sums, then _mm512_reduce_add_ps's fixed tree.
SPECSERVE_TARGET_BF16 float softmax_row_bf16(const float* s, int64_t a0, int64_t z, float mx,
                                             uint16_t* p) {
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t j = a0; j < z; j += 16) {
    const __mmask16 mask = z - j >= 16 ? 0xFFFF : (__mmask16)((1u << (z - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv));
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    sv = _mm512_mask_add_ps(sv, mask, sv, w);
    _mm256_mask_storeu_epi16(p + j, mask, b);
  }
  return _mm512_reduce_add_ps(sv);
}

// acc[g][0, D) (+)= sum over key pairs (j, j + 1), j even, covering [a0, z), of p[g][j] v_j +
// p[g][j + 1] v_{j + 1} (one vdpbf16ps per 16 dims; the caller zeroed the weight of a pair's key
// outside [a0, z)). 32 dims at a time: unpacking two value rows interleaves them as vdpbf16ps
// pairs them, with the dims permuted (lo: 0-3, 8-11, 16-19, 24-27; hi: the rest), undone on the
// way out of the registers.
template <int G>
SPECSERVE_TARGET_BF16 void weigh_rows_dot(const uint16_t* const* p, const bf16_t* const* vals,
                                          int64_t a0, int64_t z, int64_t D, float* const* acc,
                                          bool resume) {
  static const __m512i in_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                                 25, 26, 27);
  static const __m512i in_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                                 29, 30, 31);
  static const __m512i out0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                                22, 23);
  static const __m512i out1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                                29, 30, 31);
  const int64_t pa = a0 & ~int64_t{1}, pz = z > a0 ? (z + 1) & ~int64_t{1} : pa;
  for (int64_t b = 0; b < D; b += 32) {
    __m512 lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      if (resume) {
        const __m512 t0 = _mm512_loadu_ps(acc[g] + b), t1 = _mm512_loadu_ps(acc[g] + b + 16);
        lo[g] = _mm512_permutex2var_ps(t0, in_lo, t1);
        hi[g] = _mm512_permutex2var_ps(t0, in_hi, t1);
      } else {
        lo[g] = hi[g] = _mm512_setzero_ps();
      }
    }
    for (int64_t j = pa; j < pz; j += 2) {
      const __m512i x = _mm512_loadu_si512(vals[j] + b), y = _mm512_loadu_si512(vals[j + 1] + b);
      const __m512bh ul = (__m512bh)_mm512_unpacklo_epi16(x, y);
      const __m512bh uh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, p[g] + j, sizeof pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
        lo[g] = _mm512_dpbf16_ps(lo[g], pp, ul);
        hi[g] = _mm512_dpbf16_ps(hi[g], pp, uh);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(acc[g] + b, _mm512_permutex2var_ps(lo[g], out0, hi[g]));
      _mm512_storeu_ps(acc[g] + b + 16, _mm512_permutex2var_ps(lo[g], out1, hi[g]));
    }
  }
}

SPECSERVE_TARGET_BF16 void weigh_heads_dot(int g, const uint16_t* const* p,
                                           const bf16_t* const* vals, int64_t a0, int64_t z,
                                           int64_t D, float* const* acc, bool resume) {
  switch (g) {
    case 1: return weigh_rows_dot<1>(p, vals, a0, z, D, acc, resume);
    case 2: return weigh_rows_dot<2>(p, vals, a0, z, D, acc, resume);
    case 3: return weigh_rows_dot<3>(p, vals, a0, z, D, acc, resume);
    default: return weigh_rows_dot<4>(p, vals, a0, z, D, acc, resume);
  }
}

// Attention kernels (paged_attention's ``form``) = 1024 * seg + 64 * isa + tile: isa 0 AVX2 (any
// CPU the extension runs on), 1 AVX-512 (AVX-512F, D a multiple of 16) or 2 AVX-512 BF16
// (bfloat16 caches, D a multiple of 32: bfloat16 products, see weigh_rows_dot); tile 1..32 query
// positions per work item; seg 0 (each row's keys in one run) or 1..3 (keys in segments of
// 64 << seg absolute positions, folded in order: see attend). The ISAs and the segment sizes sum in
// different orders, so a process passes one form for every call (kernels/attention_form.py
// measures which is fastest here); tiles, and which thread computes which segment, change no bits.
constexpr int64_t kMaxSeg = 3;

bool attention_form_supported(int64_t form, int64_t D, bool bf16_cache) {
  const int64_t seg = form / 1024, isa = form % 1024 / 64, tile = form % 64;
  if (form < 0 || tile < 1 || tile > kMaxTile || seg > kMaxSeg) return false;
  if (isa == 0) return true;
  if (isa == 1) return D % 16 == 0 && __builtin_cpu_supports("avx512f");
  return isa == 2 && bf16_cache && D % 32 == 0 && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }

// What one work item needs of a paged_attention call.
template <typename T>
struct AttendCall {
  const float* qp;
  const T *kp, *vp;
  const int32_t* bt;
  const int64_t *sq, *ps;
  int64_t H, KVH, D, bs, maxb, group, window;
  float scale;
  bool wide;  // isa 1 or 2: the 16-lane loops
  bool dot;   // isa 2: bfloat16 products (bfloat16 caches only)
  float softcap;  // > 0: scores become softcap * tanh(s / softcap)
  int64_t lo(int64_t t) const { return window > 0 ? std::max<int64_t>(0, ps[t] - window + 1) : 0; }
};

// Rows [a, b) of the key or value pointers, prefetched: the next chunk's while this one is
// scored or weighed (paged rows are scattered by the block table, and at 2000-4000 keys a decode
// row's cache no longer fits in L2). A hint: same bits. 30 layers, bfloat16 dot form, Zen 5:
// decode row 1.23x faster at 2000 keys, 1.13x at 4000, verifies 1.03-1.07x, 500 keys alike.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t a, int64_t b, int64_t D) {
  const int64_t lines = (D * (int64_t)sizeof(T) + 63) / 64;
  for (int64_t j = a; j < b; ++j)
    for (int64_t l = 0; l < lines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + 64 * l, _MM_HINT_T0);
}

// Per-thread scratch of attend_keys.
template <typename T>
struct AttendScratch {
  std::vector<float> scores;
  std::vector<const T*> keys, vals;
  std::vector<uint16_t> qb, pb;  // the dot form's bfloat16 query rows and weights
};

// One work item: query rows of positions [t0, t0 + nt) of one sequence (a tile) x the query heads
// of KV head kvh, against keys [ka, kb] (absolute positions; each row only its own [lo, hi]
// within). Per query row x (position x / group, head x % group) it writes m[x], the max score
// (-inf: the row has no key here), l[x] = sum of exp(s - m), and acc[x * D ..] = sum of
// exp(s - m) v, keys in order. The bfloat16-dot form (see weigh_rows_dot) takes its key arrays
// from the even position at or below ka to the odd one at or above kb, positions outside
// [ka, kb] reading a zero row.
template <typename T>
void attend_keys(const AttendCall<T>& c, int64_t t0, int64_t nt, int64_t kvh, int64_t ka,
                 int64_t kb, AttendScratch<T>& w, float* m, float* l, float* acc) {
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  alignas(64) static const T kZero[256] = {};  // D <= 256
  const bool dot = kBf16 && c.dot;
  const int64_t D = c.D, sub = c.group, R = nt * sub, hbase = kvh * c.group;
  const int32_t* table = c.bt + c.sq[t0] * c.maxb;
  int64_t lo[kMaxTile], hi[kMaxTile];
  for (int64_t r = 0; r < nt; ++r) {
    lo[r] = std::max(c.lo(t0 + r), ka);
    hi[r] = std::min(c.ps[t0 + r], kb);
  }
  const int64_t jlo = dot ? ka & ~int64_t{1} : ka, span = (dot ? kb | 1 : kb) - jlo + 1;
  w.scores.resize(R * span);
  w.keys.resize(span);
  w.vals.resize(span);
  for (int64_t j = jlo; j < jlo + span; ++j) {
    if (j < ka || j > kb) {
      w.keys[j - jlo] = w.vals[j - jlo] = kZero;
      continue;
    }
    const int64_t slot = (int64_t)table[j / c.bs] * c.bs + j % c.bs;
    w.keys[j - jlo] = c.kp + (slot * c.KVH + kvh) * D;
    w.vals[j - jlo] = c.vp + (slot * c.KVH + kvh) * D;
  }
  auto qrow = [&](int64_t x) { return c.qp + ((t0 + x / sub) * c.H + hbase + x % sub) * D; };
  if (dot) {
    w.pb.resize(R * span);
    w.qb.resize(R * D);
    for (int64_t x = 0; x < R; ++x) round_row_bf16(qrow(x), D, w.qb.data() + x * D);
  }
  // Scores: each row against only its own keys, 8 keys at a time (score8); keys in chunks of
  // kChunk, so a chunk stays in L1 while every row of the item reads it.
  for (int64_t c0 = 0; c0 < span; c0 += kChunk) {
    const int64_t c1 = std::min(span, c0 + kChunk);
    prefetch_rows(w.keys.data(), c1, std::min(span, c1 + kChunk), D);
    for (int64_t x = 0; x < R; ++x) {
      const int64_t r = x / sub;
      const int64_t a0 = std::max(lo[r] - jlo, c0), z = std::min(hi[r] - jlo + 1, c1);
      float* sr = w.scores.data() + x * span;
      if constexpr (kBf16) {
        if (dot) {
          score_row_dot(w.qb.data() + x * D, w.keys.data(), a0, z, D, c.scale, sr);
          continue;
        }
      }
      if (c.wide)
        score_row_512(qrow(x), w.keys.data(), a0, z, D, c.scale, sr);
      else
        score_row(qrow(x), w.keys.data(), a0, z, D, c.scale, sr);
    }
  }
  if (c.softcap > 0.0f) {  // per score, so no bit depends on what else is in the call
    for (int64_t x = 0; x < R; ++x) {
      const int64_t r = x / sub;
      float* sr = w.scores.data() + x * span;
      for (int64_t j = lo[r] - jlo; j <= hi[r] - jlo; ++j)
        sr[j] = c.softcap * std::tanh(sr[j] / c.softcap);
    }
  }
  prefetch_rows(w.vals.data(), 0, std::min(span, kChunk), D);
  // Per query row: max, p = exp(s - max) in place (8 lanes from its first key, then a fixed
  // horizontal order and the tail), sum. The dot form: p rounded to bfloat16 into pb, the sum
  // over the rounded weights, and the other key of a boundary pair weighing zero.
  for (int64_t x = 0; x < R; ++x) {
    const int64_t r = x / sub;
    float* sr = w.scores.data() + x * span;
    const int64_t a0 = lo[r] - jlo, z = hi[r] - jlo + 1;
    if (z <= a0) {  // no key of this row in [ka, kb]
      m[x] = -INFINITY;
      l[x] = 0.0f;
      continue;
    }
    const float mx = max_of(sr, a0, z);
    m[x] = mx;
    if (dot) {
      uint16_t* pr = w.pb.data() + x * span;
      l[x] = softmax_row_bf16(sr, a0, z, mx, pr);
      if (a0 & 1) pr[a0 - 1] = 0;
      if (z & 1) pr[z] = 0;
      continue;
    }
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    int64_t j = a0;
    for (; j + 8 <= z; j += 8) {
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
      _mm256_storeu_ps(sr + j, p);
      sv = _mm256_add_ps(sv, p);
    }
    float sum = hsum8(sv);
    for (; j < z; ++j) {
      sr[j] = _mm256_cvtss_f32(exp256(_mm256_set1_ps(sr[j] - mx)));
      sum = sum + sr[j];
    }
    l[x] = sum;
  }
  // Weighted values: per row, its accumulators in registers, its keys in order; value rows in
  // chunks as above (a row's accumulators go to memory between chunks: same numbers). The
  // 16-lane forms weigh up to 4 query heads of a position per value row loaded.
  const int64_t nv = D / 8;
  for (int64_t c0 = 0; c0 < span; c0 += kChunk) {
    const int64_t c1 = std::min(span, c0 + kChunk);
    prefetch_rows(w.vals.data(), c1, std::min(span, c1 + kChunk), D);
    if (c.wide) {
      for (int64_t r = 0; r < nt; ++r) {
        const int64_t a0 = std::max(lo[r] - jlo, c0), z = std::min(hi[r] - jlo + 1, c1);
        if (z <= a0 && c0 > 0) continue;
        for (int64_t h0 = 0; h0 < sub; h0 += 4) {
          const int g = static_cast<int>(std::min<int64_t>(4, sub - h0));
          const float* p4[4];
          const uint16_t* b4[4];
          float* a4[4];
          for (int u = 0; u < g; ++u) {
            p4[u] = w.scores.data() + (r * sub + h0 + u) * span;
            b4[u] = dot ? w.pb.data() + (r * sub + h0 + u) * span : nullptr;
            a4[u] = acc + (r * sub + h0 + u) * D;
          }
          if constexpr (kBf16) {
            if (dot) {
              weigh_heads_dot(g, b4, w.vals.data(), a0, z, D, a4, c0 > 0);
              continue;
            }
          }
          weigh_heads_512(g, p4, w.vals.data(), a0, z, D / 16, a4, c0 > 0);
        }
      }
      continue;
    }
    for (int64_t x = 0; x < R; ++x) {
      const int64_t r = x / sub;
      const int64_t a0 = std::max(lo[r] - jlo, c0), z = std::min(hi[r] - jlo + 1, c1);
      if (z <= a0 && c0 > 0) continue;
      weigh_values(w.scores.data() + x * span, w.vals.data(), a0, z, nv, acc + x * D, c0 > 0);
    }
  }
}

// A thread's scratch for attention work items, kept across items and calls (on the pool a
// chunk is one item, and a decode step runs a region per layer), let go when a long prefill
// left it larger than 4 MB of scores.
template <typename T>
struct ItemScratch {
  AttendScratch<T> w;
  std::vector<float> m, l, acc, ms, ls, as;
  void trim() {
    if (w.scores.capacity() > (size_t{1} << 20)) *this = ItemScratch();
  }
};

template <typename T>
ItemScratch<T>& item_scratch() {
  thread_local ItemScratch<T> scratch;
  return scratch;
}

// Row state (m, l, acc) folded with a later segment's (ms, ls, as), segments in key order: the
// same float ops wherever and in whatever call the segments were computed. An empty segment
// (ms = -inf) is skipped; an empty state takes the segment as it is.
inline void fold(float& m, float& l, float* acc, float ms, float ls, const float* as,
                 int64_t D) {
  if (ms == -INFINITY) return;
  if (m == -INFINITY) {
    m = ms;
    l = ls;
    std::copy(as, as + D, acc);
    return;
  }
  const float mn = std::max(m, ms);
  const float a = exp1(m - mn), b = exp1(ms - mn);
  l = l * a + ls * b;
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(acc + i), av),
                                            _mm256_mul_ps(_mm256_loadu_ps(as + i), bv)));
  m = mn;
}

// paged_attention with cache elements T: float (float32 caches) or uint16_t (float16 ones).
// seg_len 0: each row's keys in one run. seg_len > 0: keys in segments [s * seg_len, (s + 1) *
// seg_len) by absolute position, each segment's (max, sum, weighted values) folded in order
// (fold). Both give a row the same bits in any call; segments let a lone sequence's few KV heads
// spread over every thread (a decode step of 3 KV heads on 2 threads ran 2:1), because a call
// with few work items computes its segments as separate items and folds them afterwards, while
// a call with many (prefill, large batches) folds each item's segments as it goes, with no
// buffer.
template <typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_of,
                  const at::Tensor& pos_of, double scale, int64_t window, int64_t isa,
                  int64_t tile, int64_t seg_len, double softcap) {
  const int64_t num_rows = q.size(0), H = q.size(1), D = q.size(2);
  const AttendCall<T> c{q.data_ptr<float>(),
                        reinterpret_cast<const T*>(k_cache.data_ptr()),
                        reinterpret_cast<const T*>(v_cache.data_ptr()),
                        block_tables.data_ptr<int32_t>(),
                        seq_of.data_ptr<int64_t>(),
                        pos_of.data_ptr<int64_t>(),
                        H, k_cache.size(2), D, k_cache.size(1), block_tables.size(1),
                        H / k_cache.size(2), window, (float)scale, isa >= 1, isa == 2,
                        (float)softcap};
  const int64_t KVH = c.KVH, group = c.group;
  const int64_t* sq = c.sq;
  const int64_t* ps = c.ps;
  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  // Tiles: runs of consecutive positions of one sequence, cut into near-equal tiles of at most
  // ``tile`` rows. One work item = one tile x all query heads of one KV head, so each key and value
  // row is read once for the group's heads (reading them per head was memory-bound, even at a
  // 450-token context). When the items would not split evenly over the threads and are few (a
  // 5-row verify of one sequence: 3 items on 2 threads), each run's tiles are doubled (3 + 2
  // rows: 6 items). Every query row runs the same instructions whatever its tile, so the cut
  // changes no bits.
  std::vector<int64_t> run_start, run_tiles;
  for (int64_t t = 0; t < num_rows; ++t)
    if (t == 0 || sq[t] != sq[t - 1] || ps[t] != ps[t - 1] + 1) run_start.push_back(t);
  run_start.push_back(num_rows);
  const int64_t n_runs = (int64_t)run_start.size() - 1;
  int64_t total = 0;
  for (int64_t r = 0; r < n_runs; ++r) {
    run_tiles.push_back((run_start[r + 1] - run_start[r] + tile - 1) / tile);
    total += run_tiles.back();
  }
  const int64_t threads = specserve::pool::team_size();
  if ((total * KVH) % threads != 0 && total * KVH < 4 * threads)
    for (int64_t r = 0; r < n_runs; ++r)
      run_tiles[r] = std::min(run_start[r + 1] - run_start[r], 2 * run_tiles[r]);
  std::vector<int64_t> tile_start;
  for (int64_t r = 0; r < n_runs; ++r) {
    const int64_t len = run_start[r + 1] - run_start[r];
    for (int64_t i = 0; i < run_tiles[r]; ++i)
      tile_start.push_back(run_start[r] + i * len / run_tiles[r]);
  }
  const int64_t n_tiles = (int64_t)tile_start.size();
  tile_start.push_back(num_rows);
  // A tile's keys [first row's lo, last row's hi] in segments: segment s of tile i is
  // [max(jlo, (seg0 + s) * seg_len), min(jhi, (seg0 + s + 1) * seg_len - 1)].
  std::vector<int64_t> seg0(n_tiles), nseg(n_tiles);
  for (int64_t i = 0; i < n_tiles; ++i) {
    const int64_t jlo = c.lo(tile_start[i]), jhi = ps[tile_start[i + 1] - 1];
    seg0[i] = seg_len > 0 ? jlo / seg_len : 0;
    nseg[i] = seg_len > 0 ? jhi / seg_len - seg0[i] + 1 : 1;
  }
  auto seg_range = [&](int64_t i, int64_t s) {
    const int64_t jlo = c.lo(tile_start[i]), jhi = ps[tile_start[i + 1] - 1];
    if (seg_len == 0) return std::make_pair(jlo, jhi);
    return std::make_pair(std::max(jlo, (seg0[i] + s) * seg_len),
                          std::min(jhi, (seg0[i] + s + 1) * seg_len - 1));
  };
  // out row x of tile i, KV head kvh <- acc / l
  auto store = [&](int64_t i, int64_t kvh, const float* l, const float* acc) {
    const int64_t t0 = tile_start[i], R = (tile_start[i + 1] - t0) * group;
    for (int64_t x = 0; x < R; ++x) {
      const __m256 inv = _mm256_set1_ps(l[x]);
      float* o = op + ((t0 + x / group) * H + kvh * group + x % group) * D;
      const float* ax = acc + x * D;
      for (int64_t v = 0; v < D; v += 8)
        _mm256_storeu_ps(o + v, _mm256_div_ps(_mm256_loadu_ps(ax + v), inv));
    }
  };
  int64_t total_segs = 0;
  for (int64_t i = 0; i < n_tiles; ++i) total_segs += nseg[i];
  if (seg_len == 0 || total_segs == n_tiles || n_tiles * KVH >= 4 * threads) {
    // Each item folds its own segments as it goes.
    parallel_for(0, n_tiles * KVH, 1, [&](int64_t b, int64_t e) {
      ItemScratch<T>& scratch = item_scratch<T>();
      AttendScratch<T>& w = scratch.w;
      auto &m = scratch.m, &l = scratch.l, &acc = scratch.acc;
      auto &ms = scratch.ms, &ls = scratch.ls, &as = scratch.as;
      for (int64_t item = b; item < e; ++item) {
        const int64_t i = item / KVH, kvh = item % KVH;
        const int64_t t0 = tile_start[i], nt = tile_start[i + 1] - t0, R = nt * group;
        m.resize(R);
        l.resize(R);
        acc.resize(R * D);
        const auto [ka, kb] = seg_range(i, 0);
        attend_keys(c, t0, nt, kvh, ka, kb, w, m.data(), l.data(), acc.data());
        if (nseg[i] > 1) {
          ms.resize(R);
          ls.resize(R);
          as.resize(R * D);
        }
        for (int64_t s = 1; s < nseg[i]; ++s) {
          const auto [sa, sb] = seg_range(i, s);
          attend_keys(c, t0, nt, kvh, sa, sb, w, ms.data(), ls.data(), as.data());
          for (int64_t x = 0; x < R; ++x)
            fold(m[x], l[x], acc.data() + x * D, ms[x], ls[x], as.data() + x * D, D);
        }
        store(i, kvh, l.data(), acc.data());
      }
      scratch.trim();
    });
    return out;
  }
  // Few items: every (tile, segment, KV head) is an item of its own, into a buffer; then each
  // (tile, KV head) folds its segments in order. Per item: m [R], l [R], acc [R, D].
  std::vector<int64_t> first(n_tiles + 1, 0);  // first segment item of tile i
  for (int64_t i = 0; i < n_tiles; ++i) first[i + 1] = first[i] + nseg[i];
  std::vector<int64_t> tile_of(first[n_tiles]), offset(first[n_tiles] + 1, 0);
  for (int64_t i = 0; i < n_tiles; ++i)
    for (int64_t s = 0; s < nseg[i]; ++s) {
      const int64_t gs = first[i] + s;
      tile_of[gs] = i;
      offset[gs + 1] = offset[gs] + KVH * (tile_start[i + 1] - tile_start[i]) * group * (D + 2);
    }
  std::unique_ptr<float[]> buf(new float[offset[first[n_tiles]]]);  // every float written first
  auto part = [&](int64_t gs, int64_t kvh) {
    const int64_t i = tile_of[gs], R = (tile_start[i + 1] - tile_start[i]) * group;
    return buf.get() + offset[gs] + kvh * R * (D + 2);
  };
  // Items of very different sizes (a full segment and a tail, a 16-row tile and a 1-row one):
  // longest first, instead of contiguous ranges (which gave one thread every full segment of a
  // decode row). On the pool each thread claims the next longest as it comes free, so a thread
  // that starts late holds no share of its own; under OpenMP each item goes, in that order, to
  // the least loaded thread.
  const int64_t n_items = first[n_tiles] * KVH;
  std::vector<int64_t> order(n_items), cost(n_items);
  for (int64_t item = 0; item < n_items; ++item) {
    const int64_t gs = item / KVH, i = tile_of[gs];
    const auto [ka, kb] = seg_range(i, gs - first[i]);
    cost[item] = (tile_start[i + 1] - tile_start[i]) * (kb - ka + 1);
    order[item] = item;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  auto attend_item = [&](int64_t item, AttendScratch<T>& w) {
    const int64_t gs = item / KVH, kvh = item % KVH, i = tile_of[gs];
    const int64_t t0 = tile_start[i], nt = tile_start[i + 1] - t0, R = nt * group;
    float* p = part(gs, kvh);
    const auto [ka, kb] = seg_range(i, gs - first[i]);
    attend_keys(c, t0, nt, kvh, ka, kb, w, p, p + R, p + 2 * R);
  };
  if (specserve::pool::dynamic()) {
    parallel_for(0, n_items, 1, [&](int64_t b, int64_t e) {
      ItemScratch<T>& scratch = item_scratch<T>();
      for (int64_t k = b; k < e; ++k) attend_item(order[k], scratch.w);
      scratch.trim();
    });
  } else {
    std::vector<std::vector<int64_t>> mine(threads);
    std::vector<int64_t> load(threads, 0);
    for (int64_t item : order) {
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      mine[t].push_back(item);
      load[t] += cost[item];
    }
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      AttendScratch<T> w;
      for (int64_t t = b; t < e; ++t)
        for (int64_t item : mine[t]) attend_item(item, w);
    });
  }
  parallel_for(0, n_tiles * KVH, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t i = item / KVH, kvh = item % KVH;
      const int64_t R = (tile_start[i + 1] - tile_start[i]) * group;
      float* p0 = part(first[i], kvh);  // segment 0 becomes the state
      for (int64_t s = 1; s < nseg[i]; ++s) {
        const float* p = part(first[i] + s, kvh);
        for (int64_t x = 0; x < R; ++x)
          fold(p0[x], p0[R + x], p0 + 2 * R + x * D, p[x], p[R + x], p + 2 * R + x * D, D);
      }
      store(i, kvh, p0 + R, p0 + 2 * R);
    }
  });
  return out;
}

at::Tensor paged_attention_capped(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_of, const at::Tensor& pos_of,
                                  double scale, int64_t window, int64_t form, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf ||
                   k_cache.scalar_type() == at::kBFloat16) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous, both float32, both float16 or both bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  const int64_t D = q.size(2), group = q.size(1) / k_cache.size(2);
  TORCH_CHECK(D % 8 == 0 && D <= 256 && group <= 32, "head_dim must be a multiple of 8, at "
              "most 256, and at most 32 query heads per KV head (got ", D, ", ", group,
              "); use --attention-backend torch");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(attention_form_supported(form, D, bf16), "attention form ", form,
              " does not run here (1024 * seg + 64 * isa + tile, tile 1..", kMaxTile, ", seg 0..",
              kMaxSeg, "; isa 0 AVX2, 1 AVX-512F with head_dim a multiple of 16, 2 AVX-512 BF16 "
              "with a bfloat16 cache and head_dim a multiple of 32; got head_dim ", D, ")");
  const int64_t isa = form % 1024 / 64, tile = form % 64, seg = form / 1024;
  const int64_t seg_len = seg > 0 ? int64_t{64} << seg : 0;
  if (bf16)
    return attend<bf16_t>(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window, isa,
                          tile, seg_len, softcap);
  if (k_cache.scalar_type() == at::kHalf)
    return attend<uint16_t>(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window,
                            isa, tile, seg_len, softcap);
  return attend<float>(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window, isa,
                       tile, seg_len, softcap);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_of, const at::Tensor& pos_of, double scale,
                           int64_t window, int64_t form) {
  return paged_attention_capped(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale, window,
                                form, 0.0);
}


}  // namespace

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias,
                        int64_t kernel, const c10::optional<at::Tensor>& qs5);  // qgemm.cpp

namespace {

using OptTensor = c10::optional<at::Tensor>;

// A block-quantized projection's planes: qs, d, m or None, bias or None, and the five-bit
// codes or None (the kernels the tuner gave bit 1 << 10 read those instead of qs).
struct Projection {
  at::Tensor qs, d;
  OptTensor m, b, q5;

  at::Tensor operator()(const at::Tensor& x, int64_t kernel) const {
    return block_linear(x, qs, d, m, b, kernel, q5);
  }
};

constexpr size_t kPlanes = 5;  // per projection, in Projection's order

// planes: kPlanes per projection, for qkv, o, gate_up, down in that order.
std::vector<Projection> projections_of(const std::vector<OptTensor>& planes) {
  TORCH_CHECK(planes.size() == 4 * kPlanes, "need ", 4 * kPlanes,
              " planes (4 projections x (qs, d, m, bias, qs5)), got ", planes.size());
  std::vector<Projection> out;
  for (size_t i = 0; i < 4; ++i) {
    const OptTensor* p = planes.data() + kPlanes * i;
    TORCH_CHECK(p[0].has_value() && p[1].has_value(), "projection ", i,
                ": qs and d are required");
    out.push_back(Projection{*p[0], *p[1], p[2], p[3], p[4]});
  }
  return out;
}

// One whole decoder layer of a block-quantized Llama-family model, in place on the residual
// stream h [T, hidden]: the same kernels, in the same order, as the Python path of
// target/model.py (DecoderLayer with fused ops), without ~15 Python-level calls per layer.
// ps: qkv, o, gate_up, down; rpp: their block_linear kernels.
void layer_forward_(at::Tensor& h, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                    const Projection* ps, const std::vector<int64_t>& rpp,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                    int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_of,
                    const at::Tensor& pos_of, const at::Tensor& slot_mapping, double scale,
                    int64_t window, int64_t form) {
  TORCH_CHECK(rpp.size() == 4, "rpp needs 4 entries");
  const int64_t T = h.size(0);
  at::Tensor qkv = ps[0](rms_norm(h, ln1, eps), rpp[0]);
  rotary_qkv_(qkv, cos, sin, H, KVH, D);
  const at::Tensor k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
  const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor q = copy_columns(qkv, 0, H * D).view({T, H, D});
  const at::Tensor o = paged_attention(q, k_cache, v_cache, block_tables, seq_of, pos_of, scale,
                                       window, form);
  const at::Tensor a = ps[1](o.view({T, H * D}), rpp[1]);
  const at::Tensor x = add_rms_norm_(a, h, ln2, eps);
  const at::Tensor gu = ps[2](x, rpp[2]);
  add_rows_(h, ps[3](silu_mul(gu), rpp[3]));
}

}  // namespace

// layer_forward_ for one layer from Python; planes as projections_of takes them.
void decoder_layer_(at::Tensor& h, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                    const std::vector<OptTensor>& planes, const std::vector<int64_t>& rpp,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                    int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_of,
                    const at::Tensor& pos_of, const at::Tensor& slot_mapping, double scale,
                    int64_t window, int64_t form) {
  const std::vector<Projection> ps = projections_of(planes);
  layer_forward_(h, ln1, ln2, eps, ps.data(), rpp, cos, sin, H, KVH, D, k_cache, v_cache,
                 block_tables, seq_of, pos_of, slot_mapping, scale, window, form);
}

// Every decoder layer of a model in one call per step. Thirty Python calls of decoder_layer_
// spent ~40 us each on the Python side (module dispatch, pybind converting ~25 arguments):
// about 1.2 ms of a 10 ms batch-1 decode step. DecoderStack holds each layer's weights from
// load time, so a step converts only what changes per step. The arithmetic is decoder_layer_'s,
// layer after layer: bit-identical to the per-layer calls (tests/test_quant.py).
namespace {

struct Layer {
  at::Tensor ln1, ln2;
  double eps;
  std::vector<Projection> ps;  // qkv, o, gate_up, down
  int64_t window;  // sliding window, 0 = none
};

class DecoderStack {
 public:
  // form: the attention form every layer uses (see attention_form_supported).
  DecoderStack(int64_t H, int64_t KVH, int64_t D, double scale, int64_t form)
      : H_(H), KVH_(KVH), D_(D), scale_(scale), form_(form) {}

  // planes: as projections_of takes them.
  void add_layer(const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                 const std::vector<OptTensor>& planes, int64_t window) {
    layers_.push_back(Layer{ln1, ln2, eps, projections_of(planes), window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // kv: 2 * num_layers tensors, layer i's k cache at 2i and v cache at 2i + 1.
  void forward_(at::Tensor& h, const std::vector<int64_t>& rpp, const at::Tensor& cos,
                const at::Tensor& sin, std::vector<at::Tensor> kv,
                const at::Tensor& block_tables, const at::Tensor& seq_of,
                const at::Tensor& pos_of, const at::Tensor& slot_mapping) {
    TORCH_CHECK(kv.size() == 2 * layers_.size(), "need 2 caches per layer (",
                2 * layers_.size(), "), got ", kv.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      layer_forward_(h, l.ln1, l.ln2, l.eps, l.ps.data(), rpp, cos, sin, H_, KVH_, D_,
                     kv[2 * i], kv[2 * i + 1], block_tables, seq_of, pos_of, slot_mapping,
                     scale_, l.window, form_);
    }
  }

 private:
  int64_t H_, KVH_, D_;
  double scale_;
  int64_t form_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_fused(pybind11::module& mod) {
  // Every compute entry runs without the GIL (what the arguments hold was converted before the
  // call): a decoder stack is one call of ~3 ms for the built-in model, and holding the GIL for
  // it kept the server's event loop from writing a stream's chunk until the step's end.
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<DecoderStack>(mod, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward_", &DecoderStack::forward_, NoGil());
  mod.def("decoder_layer_", &decoder_layer_, NoGil());
  mod.def("rms_norm", &rms_norm, NoGil());
  mod.def("add_rms_norm_", &add_rms_norm_, NoGil());
  mod.def("rotary_qkv_", &rotary_qkv_, NoGil());
  mod.def("silu_mul", &silu_mul, NoGil());
  mod.def("gelu_tanh_mul", &gelu_tanh_mul, NoGil());
  mod.def("softcap_", &softcap_, NoGil());
  mod.def("paged_attention", &paged_attention, NoGil());
  mod.def("paged_attention_capped", &paged_attention_capped, NoGil());
  mod.def("write_kv", &write_kv, NoGil());
  mod.def("attention_form_supported", &attention_form_supported,
          "True when paged_attention's form (1024 * seg + 64 * isa + tile) runs here for "
          "head_dim D and a bfloat16 (else float32 or float16) cache",
          pybind11::arg("form"), pybind11::arg("head_dim"), pybind11::arg("bf16_cache") = false);
}

// The AMX-INT8 form of qgemm.cpp's block matmuls: a block's integer dots for up to 16 rows and
// 16 features come from one tile product (TDPBSSD, signed x signed) instead of 16 rows of
// dpbusd chains, which leaves the float work per feature (convert, scale, accumulate) as the
// pass's main cost. That is where k+1-row verifies and batched steps spend their extra time.
//
// Bits: every integer dot is exact (a block's 32 products of |q| <= 128 and |x| <= 127 sum far
// below 2^31), equal to the dpbusd forms' offset-corrected sums, and the float ops per feature
// and block are the AVX-512 form's, lane for lane, blocks in order. So each output equals the
// other forms' bit for bit, whatever the row count or the rows a pass holds (batch invariance).
//
// Tiles (palette 1): tmm0 the rows' activation codes of a block (or half block), tmm1/tmm2 the
// block's codes of groups g and g + 1 (8 features each, qgemm.cpp's interleaved layout is
// already TDPBSSD's "K/4 rows of 4-byte feature groups"), tmm4..7 the int32 dots, stored to a
// 16 x 16 scratch the float pass reads. Q4_1's nibbles are unpacked to int8 in a scratch first.
#include "amx.h"
#include "block_simd.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace specserve::amx {
namespace {

using block_simd::kPrefetchBytes;
using block_simd::load_float16;
using block_simd::load_half16;
using block_simd::prefetch_at;
using block_simd::QK;

#define SPECSERVE_TARGET_AMX                                                          \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile," \
                        "amx-int8")))

// The tile shapes of one pass: R rows of activations against 8-feature groups, K bytes of
// codes per product (32: a block; 16: a half block, Q8_F's two scales).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

SPECSERVE_TARGET_AMX void configure(int R, int kbytes) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(R);  // activations: R x kbytes
  c.colsb[0] = static_cast<uint16_t>(kbytes);
  for (int t = 1; t <= 2; ++t) {  // weights: kbytes / 4 rows of 8 features x 4 codes
    c.rows[t] = static_cast<uint8_t>(kbytes / 4);
    c.colsb[t] = 32;
  }
  for (int t = 4; t <= 7; ++t) {  // dots: R x 8 int32
    c.rows[t] = static_cast<uint8_t>(R);
    c.colsb[t] = 32;
  }
  _tile_loadconfig(&c);
}

// One Q4_1 block of a group (128 bytes, codes 0..15 in nibbles) -> the Q8_0 layout's 256 bytes.
SPECSERVE_TARGET_AMX inline void unpack_q4(const uint8_t* p, int8_t* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * v), _mm256_and_si256(raw, low));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (v + 4)),
                       _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
  }
}

// tmm C0 = tmm0 . tmm1 and tmm C1 = tmm0 . tmm2 (the activations against both groups' codes);
// a macro, as the tile intrinsics take their register numbers as literal text.
#define SPECSERVE_DOT_PAIR(C0, C1) \
  do {                             \
    _tile_zero(C0);                \
    _tile_zero(C1);                \
    _tile_dpbssd(C0, 0, 1);        \
    _tile_dpbssd(C1, 0, 2);        \
  } while (0)

// The tile dots of block b of groups g, g + 1 for the rows at xb (stride K) -> out[half][row][16].
template <Layout L>
SPECSERVE_TARGET_AMX inline void tile_dots(const uint8_t* qa, const uint8_t* qb, int64_t b,
                                           const int8_t* xb, int64_t K, int32_t* out) {
  constexpr int64_t kBlockBytes = L == Layout::kQ4_1 ? 128 : 256;
  for (int l = 0; l < kBlockBytes / 64; ++l) {
    prefetch_at(qa, b * kBlockBytes + kPrefetchBytes + 64 * l);
    prefetch_at(qb, b * kBlockBytes + kPrefetchBytes + 64 * l);
  }
  if constexpr (L == Layout::kQ8F) {
    for (int h = 0; h < 2; ++h) {
      _tile_loadd(0, xb + 16 * h, K);
      _tile_loadd(1, qa + b * 256 + 128 * h, 32);
      _tile_loadd(2, qb + b * 256 + 128 * h, 32);
      if (h == 0)
        SPECSERVE_DOT_PAIR(4, 5);
      else
        SPECSERVE_DOT_PAIR(6, 7);
    }
    _tile_stored(4, out, 64);
    _tile_stored(5, out + 8, 64);
    _tile_stored(6, out + 256, 64);
    _tile_stored(7, out + 256 + 8, 64);
  } else {
    alignas(64) int8_t codes[2][256];  // Q4_1 only: the two groups' block as int8
    _tile_loadd(0, xb, K);
    if constexpr (L == Layout::kQ4_1) {
      unpack_q4(qa + b * 128, codes[0]);
      unpack_q4(qb + b * 128, codes[1]);
      _tile_loadd(1, codes[0], 32);
      _tile_loadd(2, codes[1], 32);
    } else {
      _tile_loadd(1, qa + b * 256, 32);
      _tile_loadd(2, qb + b * 256, 32);
    }
    SPECSERVE_DOT_PAIR(4, 5);
    _tile_stored(4, out, 64);
    _tile_stored(5, out + 8, 64);
  }
}

// Blocks whose tile dots are stored before the float pass reads the first of them: a load
// from a tile store's bytes waits until that store retires, so reading each block's dots right
// after its store serialized every block (16 rows of a 4864 x 896 Q8_0 layer: 0.23 ms, against
// 0.32 ms for AVX-512 VNNI).
constexpr int64_t kBlocksAhead = 8;

// Rows i0..i0+R-1 of groups g, g + 1: the tile dots of up to kBlocksAhead blocks, then their
// float ops, those of the AVX-512 pair forms (qgemm.cpp's q8_pair_avx512 / q4_pair_avx512 /
// q8f_group), lane for lane, blocks in order.
template <int R, Layout L>
SPECSERVE_TARGET_AMX void pair_pass(const Operands& op, int64_t g, int64_t i0) {
  constexpr int64_t kBlockBytes = L == Layout::kQ4_1 ? 128 : 256;
  constexpr int kHalves = L == Layout::kQ8F ? 2 : 1;
  const int64_t KB = op.KB, K = op.K;
  const uint8_t* qa = static_cast<const uint8_t*>(op.qs) + g * KB * kBlockBytes;
  const uint8_t* qb = qa + KB * kBlockBytes;
  alignas(64) int32_t dots[kBlocksAhead][kHalves][16][16];  // [block][half][row][feature]
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xrow = op.xq + i0 * K;
  for (int64_t b0 = 0; b0 < KB; b0 += kBlocksAhead) {
    const int64_t nb = KB - b0 < kBlocksAhead ? KB - b0 : kBlocksAhead;
    for (int64_t j = 0; j < nb; ++j)
      tile_dots<L>(qa, qb, b0 + j, xrow + (b0 + j) * QK, K, &dots[j][0][0][0]);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t b = b0 + j;
      const float* dx = op.dx + i0 * KB + b;
      const float* sx = op.sx + i0 * KB + b;
      if constexpr (L == Layout::kQ8F) {
        const float* da = static_cast<const float*>(op.d) + g * KB * 16 + b * 16;
        const float* db = da + KB * 16;
        const __m512 d0 = load_float16(da, db);
        const __m512 d1 = load_float16(da + 8, db + 8);
        const float* m = static_cast<const float*>(op.m);
        const __m512 mv = m == nullptr ? _mm512_setzero_ps()
                                       : load_float16(m + g * KB * 8 + b * 8,
                                                      m + (g + 1) * KB * 8 + b * 8);
        for (int r = 0; r < R; ++r) {
          const __m512 xd = _mm512_set1_ps(dx[r * KB]);
          const __m512 s0 = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][0][r]));
          const __m512 s1 = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][kHalves - 1][r]));
          acc[r] = _mm512_fmadd_ps(s0, _mm512_mul_ps(d0, xd), acc[r]);
          acc[r] = _mm512_fmadd_ps(s1, _mm512_mul_ps(d1, xd), acc[r]);
          if (m != nullptr) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * KB]), acc[r]);
        }
      } else {
        const uint16_t* da = static_cast<const uint16_t*>(op.d) + g * KB * 8 + b * 8;
        const __m512 dv = load_half16(da, da + KB * 8);
        if constexpr (L == Layout::kQ4_1) {
          const uint16_t* ma = static_cast<const uint16_t*>(op.m) + g * KB * 8 + b * 8;
          const __m512 mv = load_half16(ma, ma + KB * 8);
          for (int r = 0; r < R; ++r) {
            const __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][0][r]));
            acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * KB])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * KB]), acc[r]);
          }
        } else {
          for (int r = 0; r < R; ++r) {
            const __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][0][r]));
            acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * KB])), acc[r]);
          }
        }
      }
    }
  }
  const __m512 bv = op.bias != nullptr ? _mm512_loadu_ps(op.bias + 8 * g) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(op.y + (i0 + r) * op.N + 8 * g,
                     op.bias != nullptr ? _mm512_add_ps(acc[r], bv) : acc[r]);
}

template <Layout L>
SPECSERVE_TARGET_AMX void pass_rows(const Operands& op, int64_t g, int64_t i, int64_t rows) {
  switch (rows) {
#define SPECSERVE_CASE(R) \
  case R:                 \
    pair_pass<R, L>(op, g, i); \
    break;
    SPECSERVE_CASE(1) SPECSERVE_CASE(2) SPECSERVE_CASE(3) SPECSERVE_CASE(4)
    SPECSERVE_CASE(5) SPECSERVE_CASE(6) SPECSERVE_CASE(7) SPECSERVE_CASE(8)
    SPECSERVE_CASE(9) SPECSERVE_CASE(10) SPECSERVE_CASE(11) SPECSERVE_CASE(12)
    SPECSERVE_CASE(13) SPECSERVE_CASE(14) SPECSERVE_CASE(15) SPECSERVE_CASE(16)
#undef SPECSERVE_CASE
    default:
      break;
  }
}

// Rows outer, pairs inner: the tile shapes change with the row count only, so a chunk loads
// its configuration once per row pass (a 1-16-row call: once), not once per pair.
template <Layout L>
SPECSERVE_TARGET_AMX void run(const Operands& op, int64_t p0, int64_t p1) {
  const int kbytes = L == Layout::kQ8F ? 16 : 32;
  for (int64_t i = 0; i < op.M; i += 16) {
    const int64_t rows = op.M - i < 16 ? op.M - i : 16;
    configure(static_cast<int>(rows), kbytes);
    for (int64_t p = p0; p < p1; ++p) pass_rows<L>(op, 2 * p, i, rows);
  }
  _tile_release();  // the chunk's thread may next run torch's own AMX code, or nothing
}

// Linux keeps the tile data state off until a process asks for it (arch_prctl).
bool request_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
  unsigned long features = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &features) != 0) return false;
  return (features >> kXtileData) & 1;
}

}  // namespace

bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("amx-tile") &&
                         __builtin_cpu_supports("amx-int8") && request_tiles();
  return ok;
}

void run_pairs(const Operands& op, int64_t p0, int64_t p1) {
  switch (op.layout) {
    case Layout::kQ8:
      run<Layout::kQ8>(op, p0, p1);
      break;
    case Layout::kQ4_1:
      run<Layout::kQ4_1>(op, p0, p1);
      break;
    case Layout::kQ8F:
      run<Layout::kQ8F>(op, p0, p1);
      break;
  }
}

}  // namespace specserve::amx

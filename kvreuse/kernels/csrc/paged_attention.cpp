// Paged attention on CPU that reads K and V where they lie: through each sequence's block table, with no
// gathered copy of the context. One kernel serves decode rows (one query per sequence) and prefill chunks
// that continue cached context (many queries, an offset causal mask); a sequence with no cached context
// attends over its own new K/V through SDPA instead (one GEMM-shaped call, which this loop cannot beat).
//
// The work is cut into items of (sequence, KV head, query tile, key partition):
// - GQA is folded: the query heads that share a KV head are the rows of one tile, so each K/V row is read
//   and converted once per KV head, not once per query head;
// - a long context is split into partitions (flash-decoding), each with its own running max, sum and
//   accumulator, merged at the end, so one long sequence keeps every thread busy.
// Within an item the keys are taken KEY_TILE at a time: their K rows are converted to float32 and stored
// transposed (so the scores of a query row are a vector over the tile's keys), their V rows converted
// beside them, the scores go through an online softmax (running max and sum, rescaled accumulator).
//
// A layer may differ from plain causal attention (kvreuse/attention/backend.py's LayerAttention): its own
// softmax scale; a sliding window W (`window`, 0: none), under which a row at position p sees keys
// max(0, p - W + 1) .. p, so a tile's items start at its first query's window start (the blocks before it
// are never read: a decode row after 4,000 tokens under a 512-key window reads 512 keys) and a row whose
// window starts later (a chunk's later query) masks its first keys within the tile; and learned sinks
// (`sinks`, float32 [heads], gpt-oss), one logit per head that only adds to the softmax's denominator, folded
// in once per row when it is written, after the partitions are merged.
//
// K/V may be stored as float32, bfloat16, float16, or as one-byte codes (int8, fp8 e4m3 / e5m2) with a
// bfloat16 scale per token and KV head (kvreuse/cache/kv_quant.py): a code is turned into a float and
// multiplied by its scale as it is read; nothing is written back. kvreuse/attention/cpu_paged.py holds
// the PyTorch reference this equals within float summation error (tests/test_paged_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// The AVX512_BF16 layout's switch (use_bf16_dot below): read once per call, set only by tests and benchmarks.
std::atomic<bool> use_bf16_dot{true};

constexpr int64_t KEY_TILE = 16;     // keys per inner step: one AVX-512 vector or two AVX2 vectors of scores
constexpr int64_t PREFETCH_TILES = 2;  // how far ahead the pool's rows are asked for
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t MAX_TILE_ROWS = 32;  // query rows (queries x folded heads) of one item
constexpr int64_t MAX_TILE_KV_VALUES = 2048;  // kv heads x head_dim of one key in a tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp of 8 floats. A scalar expf per score would cost more than the dot products of a decode row; this is
// a degree-6 polynomial on the reduced argument with the power of two put in the exponent bits (relative
// error ~2e-7, below float32 summation error over a context). Inputs below -87.3 (masked scores, -inf)
// give exactly 0.
// The exp polynomial's constants, shared by the 8- and 16-lane versions: the clamp, log2(e), ln(2) split in
// a high and a low part, and the coefficients of r^6 .. r^2 (r + 1 is added as is).
constexpr float EXP_LO = -87.3f, EXP_HI = 88.3f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX2__) && defined(__FMA__)
__attribute__((always_inline)) inline __m256 exp8(__m256 v) {
  const __m256 is_tiny = _mm256_cmp_ps(v, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[k]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Rows of one tile attended together: how many query rows that share a KV head take each K and V load.
// Their accumulators live in registers: with AVX-512's 32 vector registers (the compiler uses them for
// 256-bit code too) 4 rows x 4 keys of dot products fit, with AVX2's 16 only 2 x 4.
#if defined(__AVX512F__)
constexpr int ROW_BLOCK = 4;
#else
constexpr int ROW_BLOCK = 2;
#endif
#endif

// One row block's view of the tile: R query rows that share a KV head (their q pre-scaled, their running
// max m, sum l and accumulator acc), over the tile's keys K / V (rows key_stride apart; n keys, of which
// row i may see keys [hidden[i], visible[i]): the causal limit ends the run, a sliding window's first key
// starts it). K rows from n up to KEY_TILE are zero. visible 0 means the row sees nothing here (hidden is
// then 0 too), so the kernels test one number for the empty case.
struct RowBlock {
  const float* q[MAX_TILE_ROWS];
  const uint32_t* q_pairs[MAX_TILE_ROWS];  // the bf16 path's unscaled bf16 q, two values a word
  float* acc[MAX_TILE_ROWS];
  float* m[MAX_TILE_ROWS];
  float* l[MAX_TILE_ROWS];
  int64_t visible[MAX_TILE_ROWS];
  int64_t hidden[MAX_TILE_ROWS];  // keys before a row's window start; 0 for a plain layer
};

#if defined(__AVX2__) && defined(__FMA__)
template <int R>
void attend_rows(const RowBlock& b, int64_t first, const float* keys, const float* values, int64_t key_stride,
                 int64_t n, int64_t dim) {
  // Scores of all KEY_TILE keys (K rows past n are zeros): each load of a K row serves R query rows; four
  // keys' sums share their horizontal adds, and the 16 scores of a row stay in two registers.
  __m128 quarter[R][KEY_TILE / 4];
  for (int64_t j0 = 0; j0 < KEY_TILE; j0 += 4) {
    __m256 dots[R][4];
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) dots[r][k] = _mm256_setzero_ps();
    }
    const float* key = keys + j0 * key_stride;
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 k0 = _mm256_loadu_ps(key + d), k1 = _mm256_loadu_ps(key + key_stride + d);
      const __m256 k2 = _mm256_loadu_ps(key + 2 * key_stride + d), k3 = _mm256_loadu_ps(key + 3 * key_stride + d);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_loadu_ps(b.q[first + r] + d);
        dots[r][0] = _mm256_fmadd_ps(x, k0, dots[r][0]);
        dots[r][1] = _mm256_fmadd_ps(x, k1, dots[r][1]);
        dots[r][2] = _mm256_fmadd_ps(x, k2, dots[r][2]);
        dots[r][3] = _mm256_fmadd_ps(x, k3, dots[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(dots[r][0], dots[r][1]), _mm256_hadd_ps(dots[r][2], dots[r][3]));
      quarter[r][j0 / 4] = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
    }
  }
  // Online softmax of each row over its visible keys, as two vectors of 8 scores: the later keys (and the
  // ones before a window's start) masked to -inf (their weight is exactly 0), the running max and sum
  // updated, the accumulator's correction kept.
  alignas(32) float p[R][KEY_TILE];
  float correction[R];
  const __m256 lane0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lane8 = _mm256_add_ps(lane0, _mm256_set1_ps(8.0f));
  const __m256 neg_inf = _mm256_set1_ps(NEG_INF);
  for (int r = 0; r < R; ++r) {
    const int64_t visible = b.visible[first + r];
    if (visible == 0) {  // every key here is after this row's query: nothing changes
      correction[r] = 1.0f;
      _mm256_store_ps(p[r], _mm256_setzero_ps());
      _mm256_store_ps(p[r] + 8, _mm256_setzero_ps());
      continue;
    }
    const __m256 limit = _mm256_set1_ps(static_cast<float>(visible));
    __m256 seen0 = _mm256_cmp_ps(lane0, limit, _CMP_LT_OQ), seen1 = _mm256_cmp_ps(lane8, limit, _CMP_LT_OQ);
    if (b.hidden[first + r] > 0) {  // a window starts inside this tile (never for a plain layer)
      const __m256 start = _mm256_set1_ps(static_cast<float>(b.hidden[first + r]));
      seen0 = _mm256_and_ps(seen0, _mm256_cmp_ps(lane0, start, _CMP_GE_OQ));
      seen1 = _mm256_and_ps(seen1, _mm256_cmp_ps(lane8, start, _CMP_GE_OQ));
    }
    __m256 s0 = _mm256_blendv_ps(neg_inf, _mm256_set_m128(quarter[r][1], quarter[r][0]), seen0);
    __m256 s1 = _mm256_blendv_ps(neg_inf, _mm256_set_m128(quarter[r][3], quarter[r][2]), seen1);
    float& m = *b.m[first + r];
    const float new_max = std::max(m, hmax8(_mm256_max_ps(s0, s1)));
    correction[r] = m == NEG_INF ? 0.0f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m - new_max)));
    m = new_max;
    const __m256 shift = _mm256_set1_ps(new_max);
    s0 = exp8(_mm256_sub_ps(s0, shift));
    s1 = exp8(_mm256_sub_ps(s1, shift));
    *b.l[first + r] = *b.l[first + r] * correction[r] + hsum8(_mm256_add_ps(s0, s1));
    _mm256_store_ps(p[r], s0);
    _mm256_store_ps(p[r] + 8, s1);
  }
  // acc = acc * correction + p . V, 32 values of every row at a time: each load of a V row serves R rows.
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    __m256 a[R][4];
    for (int r = 0; r < R; ++r) {
      const __m256 c = _mm256_set1_ps(correction[r]);
      for (int k = 0; k < 4; ++k) a[r][k] = _mm256_mul_ps(_mm256_loadu_ps(b.acc[first + r] + d + 8 * k), c);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* row = values + j * key_stride + d;
      const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
      const __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(&p[r][j]);
        a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(w, v2, a[r][2]);
        a[r][3] = _mm256_fmadd_ps(w, v3, a[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(b.acc[first + r] + d + 8 * k, a[r][k]);
    }
  }
  for (; d < dim; d += 8) {
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_mul_ps(_mm256_loadu_ps(b.acc[first + r] + d), _mm256_set1_ps(correction[r]));
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v = _mm256_loadu_ps(values + j * key_stride + d);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[r][j]), v, a[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(b.acc[first + r] + d, a[r]);
  }
}
#endif

// The same for one row, in plain C++: machines without AVX2 and FMA.
void attend_row_scalar(const RowBlock& b, int64_t r, const float* keys, const float* values, int64_t key_stride,
                       int64_t dim) {
  const int64_t visible = b.visible[r], hidden = b.hidden[r];
  if (visible == 0) return;
  float scores[KEY_TILE];
  float tile_max = NEG_INF;
  for (int64_t j = hidden; j < visible; ++j) {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim; ++d) sum += b.q[r][d] * keys[j * key_stride + d];
    scores[j] = sum;
    tile_max = std::max(tile_max, sum);
  }
  const float new_max = std::max(*b.m[r], tile_max);
  const float correction = *b.m[r] == NEG_INF ? 0.0f : std::exp(*b.m[r] - new_max);
  *b.m[r] = new_max;
  float tile_sum = 0.0f;
  for (int64_t j = hidden; j < visible; ++j) tile_sum += scores[j] = std::exp(scores[j] - new_max);
  *b.l[r] = *b.l[r] * correction + tile_sum;
  for (int64_t d = 0; d < dim; ++d) {
    float value = b.acc[r][d] * correction;
    for (int64_t j = hidden; j < visible; ++j) value += scores[j] * values[j * key_stride + d];
    b.acc[r][d] = value;
  }
}

// Attend rows [0, count) of a row block over the tile, ROW_BLOCK rows (or fewer, evenly split) at a time.
void attend_block(const RowBlock& b, int64_t count, const float* keys, const float* values, int64_t key_stride,
                  int64_t n, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t pieces = (count + ROW_BLOCK - 1) / ROW_BLOCK;
  int64_t first = 0;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t rows = (count - first + (pieces - piece) - 1) / (pieces - piece);
    switch (rows) {
      case 1: attend_rows<1>(b, first, keys, values, key_stride, n, dim); break;
#if defined(__AVX512F__)
      case 3: attend_rows<3>(b, first, keys, values, key_stride, n, dim); break;
      case 4: attend_rows<4>(b, first, keys, values, key_stride, n, dim); break;
#endif
      default: attend_rows<2>(b, first, keys, values, key_stride, n, dim);
    }
    first += rows;
  }
#else
  for (int64_t r = 0; r < count; ++r) attend_row_scalar(b, r, keys, values, key_stride, dim);
  (void)n;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// A kernel for one data layout, chosen per call: a bfloat16 pool and bfloat16 queries on a CPU with
// AVX512_BF16, where VDPBF16PS multiplies bf16 pairs into float32 sums. Nothing is converted to float32:
// - scores: a tile's K rows are transposed as 32-bit words (pairs of dims), KEY_TILE keys across the 16
//   lanes of a register, so a row's 16 scores come out in one register with no horizontal sums (each
//   product of two bf16 values is exact in float32);
// - values: V rows are interleaved in pairs of keys, and the softmax weights rounded to bf16, so one
//   instruction adds two keys' weighted values to 16 dims of a row's accumulator.
constexpr bool HAS_BF16_DOT = true;

// r[0..16): 16 rows of 16 words in, their transpose out (r[i] lane j = row j's word i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

// kp[w * KEY_TILE + j] = word w (dims 2w, 2w + 1) of key j's row; rows[j] points at the key's bf16 row.
inline void transpose_key_words(const uint16_t* const* rows, int64_t dim, uint32_t* kp) {
  for (int64_t w0 = 0; w0 < dim / 2; w0 += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + 2 * w0);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (w0 + i) * KEY_TILE, r[i]);
  }
}

__attribute__((always_inline)) inline __m512 exp16(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int k = 1; k < 6; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[k]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// vp[jp * dim + d] = the word (V[2jp][d], V[2jp + 1][d]): a tile's V rows interleaved in pairs of keys,
// so that VDPBF16PS adds two keys' weighted values per lane. rows[j] points at key j's bf16 V row.
inline void interleave_value_pairs(const uint16_t* const* rows, int64_t dim, uint32_t* vp) {
  alignas(64) static const uint16_t low_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(low_index);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t jp = 0; jp < KEY_TILE / 2; ++jp) {
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i a = _mm512_loadu_si512(rows[2 * jp] + d), b = _mm512_loadu_si512(rows[2 * jp + 1] + d);
      _mm512_storeu_si512(vp + jp * dim + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(vp + jp * dim + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// R rows sharing a KV head over one tile of n keys: kp its keys' transposed bf16 words, vp its values
// interleaved in pairs of keys. The softmax weights are rounded to bf16 for the weighted sum of V (the
// running sum adds the rounded weights, so each output row stays a convex combination of V rows): in a
// bf16 engine that is the precision of everything around it.
template <int R>
void attend_rows_bf16(const RowBlock& b, int64_t first, const uint32_t* kp, const uint32_t* vp, int64_t n,
                      int64_t dim, float scale) {
  // Two sums per row (even and odd words) so that even one or two rows keep several VDPBF16PS in flight.
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t w = 0; w < dim / 2; w += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + w * KEY_TILE);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (w + 1) * KEY_TILE);
    for (int r = 0; r < R; ++r) {
      const uint32_t* q = b.q_pairs[first + r];
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[w])), k0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[w + 1])), k1);
    }
  }
  // Online softmax, the corrections of all R rows in one vector exp.
  const __m512 scale_v = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(NEG_INF);
  alignas(64) float shift[16] = {}, correction[16] = {};
  for (int r = 0; r < R; ++r) {
    const int64_t visible = b.visible[first + r];
    // Lanes [hidden, visible): the causal limit ends them, a window's first key starts them.
    const __mmask16 seen = static_cast<__mmask16>(((1u << visible) - 1) & ~((1u << b.hidden[first + r]) - 1));
    even[r] = _mm512_mask_blend_ps(seen, neg_inf, _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), scale_v));
    const float m = *b.m[first + r];
    if (visible == 0) {  // every key here is after this row's query: weights 0, correction 1
      correction[r] = 0.0f;
      continue;
    }
    shift[r] = std::max(m, _mm512_reduce_max_ps(even[r]));
    correction[r] = m == NEG_INF ? NEG_INF : m - shift[r];  // exp: 0 for a row's first keys
  }
  _mm512_store_ps(correction, exp16(_mm512_load_ps(correction)));
  alignas(64) uint16_t weights[R][KEY_TILE];
  for (int r = 0; r < R; ++r) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(exp16(_mm512_sub_ps(even[r], _mm512_set1_ps(shift[r]))));
    _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r]), rounded);
    if (b.visible[first + r] == 0) continue;
    const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    *b.l[first + r] = *b.l[first + r] * correction[r] + _mm512_reduce_add_ps(widened);
    *b.m[first + r] = shift[r];
  }
  // acc = acc * correction + weights . V, 16 values of every row at a time, two keys a VDPBF16PS.
  const int64_t pairs = (n + 1) / 2;
  for (int64_t d = 0; d < dim; d += 16) {
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_mul_ps(_mm512_loadu_ps(b.acc[first + r] + d), _mm512_set1_ps(correction[r]));
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + jp * dim + d);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, &weights[r][2 * jp], 4);
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), v);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(b.acc[first + r] + d, a[r]);
  }
}

void attend_block_bf16(const RowBlock& b, int64_t count, const uint32_t* kp, const uint32_t* vp, int64_t n,
                       int64_t dim, float scale) {
  const int64_t pieces = (count + 7) / 8;
  int64_t first = 0;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t rows = (count - first + (pieces - piece) - 1) / (pieces - piece);
    switch (rows) {
      case 1: attend_rows_bf16<1>(b, first, kp, vp, n, dim, scale); break;
      case 2: attend_rows_bf16<2>(b, first, kp, vp, n, dim, scale); break;
      case 3: attend_rows_bf16<3>(b, first, kp, vp, n, dim, scale); break;
      case 4: attend_rows_bf16<4>(b, first, kp, vp, n, dim, scale); break;
      case 5: attend_rows_bf16<5>(b, first, kp, vp, n, dim, scale); break;
      case 6: attend_rows_bf16<6>(b, first, kp, vp, n, dim, scale); break;
      case 7: attend_rows_bf16<7>(b, first, kp, vp, n, dim, scale); break;
      default: attend_rows_bf16<8>(b, first, kp, vp, n, dim, scale);
    }
    first += rows;
  }
}
#else
constexpr bool HAS_BF16_DOT = false;
#endif

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, 4);
  return value;
}

// How the pool stores a value, and how one row of head_dim values becomes float32.
enum class Storage { Float32, BFloat16, Float16, Int8, Fp8E4M3, Fp8E5M2 };

struct RowReader {
  Storage storage;
  const uint8_t* base;        // the layer's K or V: [slots, kv_heads, head_dim] values
  const c10::BFloat16* scales;  // [slots, kv_heads] for one-byte codes, else null
  int64_t kv_heads, head_dim, elem_size;
  float fp8_table[256];

  void init_table() {
    for (int code = 0; code < 256; ++code) {
      const uint8_t byte = static_cast<uint8_t>(code);
      if (storage == Storage::Fp8E4M3) {
        fp8_table[code] = static_cast<float>(c10::Float8_e4m3fn(byte, c10::Float8_e4m3fn::from_bits()));
      } else if (storage == Storage::Fp8E5M2) {
        fp8_table[code] = static_cast<float>(c10::Float8_e5m2(byte, c10::Float8_e5m2::from_bits()));
      }
    }
  }

  // Heads [head, head + count) of a slot are adjacent in the pool: one run of bytes to ask for early, into
  // L2 (locality 2): asked into L1, a tile's 8 KB of lines (qwen2.5's two KV heads of a bf16 pool) made
  // decode over a 4,000-token context 1.4x slower when the pool was not in cache (24 layers' pools in
  // turn, a 2-core AVX-512 EPYC; two tiles ahead measured best, one to eight within 5%).
  inline void prefetch(int64_t slot, int64_t head, int64_t count) const {
    const uint8_t* src = base + (slot * kv_heads + head) * head_dim * elem_size;
    for (int64_t byte = 0; byte < count * head_dim * elem_size; byte += 64) __builtin_prefetch(src + byte, 0, 2);
  }

  // The row of (slot, head) as float32 into out[0 .. head_dim).
  inline void read(int64_t slot, int64_t head, float* out) const {
    const int64_t row = slot * kv_heads + head;
    const uint8_t* src = base + row * head_dim * elem_size;
    switch (storage) {
      case Storage::Float32: {
        const float* values = reinterpret_cast<const float*>(src);
        for (int64_t i = 0; i < head_dim; ++i) out[i] = values[i];
        break;
      }
      case Storage::BFloat16: {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(src);
        for (int64_t i = 0; i < head_dim; ++i) out[i] = bf16_bits_to_float(values[i]);
        break;
      }
      case Storage::Float16: {
        const c10::Half* values = reinterpret_cast<const c10::Half*>(src);
        for (int64_t i = 0; i < head_dim; ++i) out[i] = static_cast<float>(values[i]);
        break;
      }
      case Storage::Int8: {
        const int8_t* values = reinterpret_cast<const int8_t*>(src);
        const float scale = static_cast<float>(scales[row]);
        for (int64_t i = 0; i < head_dim; ++i) out[i] = static_cast<float>(values[i]) * scale;
        break;
      }
      case Storage::Fp8E4M3:
      case Storage::Fp8E5M2: {
        const float scale = static_cast<float>(scales[row]);
        for (int64_t i = 0; i < head_dim; ++i) out[i] = fp8_table[src[i]] * scale;
        break;
      }
    }
  }
};

// One unit of work: a query tile of one sequence, over a run of KV heads, over one partition of its keys.
// The tile's rows are (query, head) pairs, the heads of the run's KV heads folded in:
// row = query_in_tile * rows_per_query + (kv_head - kv_begin) * group + g, rows_per_query = kv heads x group.
// Taking every KV head of a token at once reads the pool in order (a token's heads are adjacent).
struct Tile {
  int64_t seq, kv_begin, kv_end, query_begin, query_end;
  int64_t first_partial, num_parts;  // its partial results, merged when num_parts > 1
};

// The keys a tile's rows attend over: up to its last query's position, and with a window from its first
// query's window start on, so no item reads (or even steps through) the blocks before it: a decode row
// after 4,000 tokens under a 512-key window reads 512 keys.
inline int64_t tile_key_begin(const Tile& tile, const int64_t* clens, const int64_t* qlens, int64_t window) {
  if (window <= 0) return 0;
  return std::max<int64_t>(0, clens[tile.seq] - qlens[tile.seq] + tile.query_begin - window + 1);
}

inline int64_t tile_key_end(const Tile& tile, const int64_t* clens, const int64_t* qlens) {
  return clens[tile.seq] - qlens[tile.seq] + tile.query_end;
}

struct Item {
  int64_t tile;
  int64_t key_begin, key_end;  // context positions this item attends over
  int64_t partial;             // index of the item's partial results, or -1: it writes the output
};

template <typename Out>
inline void store_row(const float* acc, float inv_sum, int64_t dim, Out* out) {
  for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<Out>(acc[i] * inv_sum);
}

struct Problem {
  const at::Tensor* q;  // [tokens, heads, dim], rows q_stride apart (a view of the fused q|k|v rows)
  at::Tensor* out;
  const int64_t* query_start;
  const int64_t* query_lens;
  const int64_t* context_lens;
  const int64_t* tables;  // [seqs, table_width]
  int64_t table_width, block_size, heads, kv_heads, group, dim, q_stride;
  float scale;
  int64_t window;       // a row at position p sees keys from p - window + 1 on; 0: no window
  const float* sinks;   // [heads]: a logit per head in the softmax's denominator only, or null
  RowReader keys, values;
  bool bf16_dot;  // bf16 pool and q, AVX512_BF16 built in, head_dim a multiple of 32: attend_rows_bf16
};

// What one thread converts a tile's keys into: float32 K and V of KEY_TILE keys.
struct Scratch {
  std::vector<float> keys = std::vector<float>(KEY_TILE * MAX_TILE_KV_VALUES);
  std::vector<float> values = std::vector<float>(KEY_TILE * MAX_TILE_KV_VALUES);
};

// The tile's query rows as the loop reads them: float32 pre-multiplied by the softmax scale (q), or on the bf16
// path the raw bf16 values two to a word (q_pairs; the scale is applied to the scores); a query's heads of the
// run are adjacent in q. Each row's running max, sum and accumulator start empty.
inline void load_queries(const Problem& p, const Tile& tile, int64_t rows, int64_t rows_per_query, float* q,
                         uint32_t* q_pairs, float* m, float* l, float* acc) {
  const int64_t dim = p.dim, group = p.group;
  const int64_t token0 = p.query_start[tile.seq] + tile.query_begin;
  const int64_t first_head = tile.kv_begin * group;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = q + r * dim;
    const int64_t offset = (token0 + r / rows_per_query) * p.q_stride + (first_head + r % rows_per_query) * dim;
    switch (p.q->scalar_type()) {
      case at::kFloat: {
        const float* src = p.q->data_ptr<float>() + offset;
        for (int64_t i = 0; i < dim; ++i) row[i] = src[i] * p.scale;
        break;
      }
      case at::kBFloat16: {
        const c10::BFloat16* src = p.q->data_ptr<c10::BFloat16>() + offset;
        if (p.bf16_dot) {
          std::memcpy(q_pairs + r * dim / 2, src, dim * sizeof(c10::BFloat16));
        } else {
          for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(src[i]) * p.scale;
        }
        break;
      }
      default: {
        const c10::Half* src = p.q->data_ptr<c10::Half>() + offset;
        for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(src[i]) * p.scale;
      }
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
    std::fill(acc + r * dim, acc + (r + 1) * dim, 0.0f);
  }
}

// Ask for the K and V rows of keys [begin, end) of a sequence (its block table) for KV heads [kv_begin,
// kv_begin + kv_count): blocks lie anywhere in the pool, a jump the hardware prefetcher does not foresee. The
// block and offset are stepped: a 64-bit division per key costs more than reading the key.
inline void prefetch_keys(const Problem& p, const int64_t* table, int64_t kv_begin, int64_t kv_count, int64_t begin,
                          int64_t end) {
  int64_t block = begin / p.block_size, offset = begin - block * p.block_size;
  for (int64_t position = begin; position < end; ++position) {
    const int64_t slot = table[block] * p.block_size + offset;
    p.keys.prefetch(slot, kv_begin, kv_count);
    p.values.prefetch(slot, kv_begin, kv_count);
    if (++offset == p.block_size) {
      offset = 0;
      ++block;
    }
  }
}

// Each row's keys [hidden, visible) of a tile of n keys from key0: all of them, or those at or before the
// row's position (needs_mask) and inside its window (needs_window). Row i is query i / group, at position
// first_query_position + i / group. Only a tile that masks pays the division (per row and tile: measurable
// on a long decode row).
inline void mask_rows(RowBlock& rows, int64_t count, int64_t group, int64_t first_query_position, int64_t key0,
                      int64_t n, int64_t window, bool needs_mask, bool needs_window) {
  for (int64_t i = 0; i < count; ++i) {
    int64_t visible = n, hidden = 0;
    if (needs_mask || needs_window) {
      const int64_t position = first_query_position + i / group;
      if (needs_mask) visible = std::max<int64_t>(0, std::min(n, position + 1 - key0));  // keys <= position
      if (needs_window) {
        hidden = std::max<int64_t>(0, std::min(n, position - window + 1 - key0));
        if (hidden >= visible) visible = hidden = 0;  // the row's window and this tile do not meet
      }
    }
    rows.visible[i] = visible;
    rows.hidden[i] = hidden;
  }
}

// Attend one item: its tile's rows over keys [key_begin, key_end). Leaves the running max, sum and
// (unnormalised) accumulator of every row in m, l, acc.
void attend(const Problem& p, const Tile& tile, const Item& item, Scratch& scratch, float* m, float* l,
            float* acc) {
  const int64_t dim = p.dim, group = p.group;
  const int64_t kv_count = tile.kv_end - tile.kv_begin, rows_per_query = kv_count * group;
  const int64_t rows = (tile.query_end - tile.query_begin) * rows_per_query;
  const int64_t query_len = p.query_lens[tile.seq], context_len = p.context_lens[tile.seq];
  const int64_t first_position = context_len - query_len;  // absolute position of query 0
  const int64_t* table = p.tables + tile.seq * p.table_width;
  // Queries as float32, pre-multiplied by the softmax scale. A query's heads of the run are adjacent in q.
  alignas(64) float q[MAX_TILE_ROWS * MAX_HEAD_DIM];
  // The bf16 path's q: the raw bf16 values (the scale is applied to the scores), two a 32-bit word.
  alignas(64) uint32_t q_pairs[MAX_TILE_ROWS * MAX_HEAD_DIM / 2];
  load_queries(p, tile, rows, rows_per_query, q, q_pairs, m, l, acc);
  // K and V of the tile's keys as float32: kt[(j * kv_count + kv) * dim + d], the same for vt.
  float* kt = scratch.keys.data();
  float* vt = scratch.values.data();
  // The bf16 path's keys instead: per KV head, dim / 2 words x KEY_TILE keys (kept where kt would be).
  uint32_t* key_words = reinterpret_cast<uint32_t*>(kt);
  uint32_t* value_words = reinterpret_cast<uint32_t*>(vt);  // per KV head: KEY_TILE / 2 pairs x dim words
  int64_t slots[KEY_TILE];
  const int64_t key_stride = kv_count * dim;
  // Each KV head's rows: query i / group's head kv * group + i % group.
  RowBlock rows_of[MAX_TILE_ROWS];
  for (int64_t kv = 0; kv < kv_count; ++kv) {
    for (int64_t i = 0; i < (tile.query_end - tile.query_begin) * group; ++i) {
      const int64_t r = (i / group) * rows_per_query + kv * group + i % group;
      rows_of[kv].q[i] = q + r * dim;
      rows_of[kv].q_pairs[i] = q_pairs + r * dim / 2;
      rows_of[kv].acc[i] = acc + r * dim;
      rows_of[kv].m[i] = m + r;
      rows_of[kv].l[i] = l + r;
    }
  }
  // The first query of the tile sees the fewest keys: limit first_position + query + 1 for each row.
  const int64_t first_row_limit = first_position + tile.query_begin + 1;
  // With a window the last query's keys start latest: a tile before this start masks some rows' first keys.
  const int64_t last_row_window_start = first_position + tile.query_end - p.window;
  // The first tiles' rows, which the loop's prefetch (PREFETCH_TILES ahead) never asks for.
  prefetch_keys(p, table, tile.kv_begin, kv_count, item.key_begin,
                std::min(item.key_end, item.key_begin + PREFETCH_TILES * KEY_TILE));
  for (int64_t key0 = item.key_begin; key0 < item.key_end; key0 += KEY_TILE) {
    const int64_t n = std::min(KEY_TILE, item.key_end - key0);
    // Block and offset of the tile's first key, then stepped: a 64-bit division per key costs more than
    // reading the key.
    int64_t block = key0 / p.block_size, offset = key0 - block * p.block_size;
    // Ask for the rows of the tile PREFETCH_TILES ahead now: blocks lie anywhere in the pool, a jump the
    // hardware prefetcher does not foresee.
    const int64_t next_begin = key0 + PREFETCH_TILES * KEY_TILE;
    prefetch_keys(p, table, tile.kv_begin, kv_count, next_begin, std::min(item.key_end, next_begin + KEY_TILE));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = table[block] * p.block_size + offset;
      slots[j] = slot;
      for (int64_t kv = 0; kv < kv_count && !p.bf16_dot; ++kv) {  // the bf16 layout reads words below
        p.keys.read(slot, tile.kv_begin + kv, kt + j * key_stride + kv * dim);
        p.values.read(slot, tile.kv_begin + kv, vt + j * key_stride + kv * dim);
      }
      if (++offset == p.block_size) {
        offset = 0;
        ++block;
      }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    if (p.bf16_dot) {  // each KV head's keys transposed and values paired as bf16 words; missing keys are zeros
      static const uint16_t zeros[MAX_HEAD_DIM] = {};
      for (int64_t kv = 0; kv < kv_count; ++kv) {
        const uint16_t* key_rows[KEY_TILE];
        const uint16_t* value_rows[KEY_TILE];
        for (int64_t j = 0; j < KEY_TILE; ++j) {
          const int64_t row = j < n ? (slots[j] * p.kv_heads + tile.kv_begin + kv) * dim : -1;
          key_rows[j] = row >= 0 ? reinterpret_cast<const uint16_t*>(p.keys.base) + row : zeros;
          value_rows[j] = row >= 0 ? reinterpret_cast<const uint16_t*>(p.values.base) + row : zeros;
        }
        transpose_key_words(key_rows, dim, key_words + kv * (dim / 2) * KEY_TILE);
        interleave_value_pairs(value_rows, dim, value_words + kv * (KEY_TILE / 2) * dim);
      }
    }
#endif
    if (!p.bf16_dot && n < KEY_TILE) {  // the dot products take every key of a tile: the missing ones are zeros
      std::fill(kt + n * key_stride, kt + KEY_TILE * key_stride, 0.0f);
    }
    const bool needs_mask = key0 + n > first_row_limit;  // some key here is after some row's query
    // Some key here is before some row's window start (the item began at the first row's start, so with
    // one query a tile only ever straddles its start, and rows of a chunk start at different keys).
    const bool needs_window = p.window > 0 && key0 < last_row_window_start;
    for (int64_t kv = 0; kv < kv_count; ++kv) {
      // The rows that read this KV head: its group of heads of each query of the tile.
      RowBlock& block_rows = rows_of[kv];
      const int64_t count = (tile.query_end - tile.query_begin) * group;
      mask_rows(block_rows, count, group, first_position + tile.query_begin, key0, n, p.window, needs_mask,
                needs_window);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
      if (p.bf16_dot) {
        attend_block_bf16(block_rows, count, key_words + kv * (dim / 2) * KEY_TILE,
                          value_words + kv * (KEY_TILE / 2) * dim, n, dim, p.scale);
        continue;
      }
#endif
      attend_block(block_rows, count, kt + kv * dim, vt + kv * dim, key_stride, n, dim);
    }
  }
}

// Row r of a tile, its accumulator acc and sum taken relative to its max m, normalised into out. A head's
// sink joins the softmax here, once, after any merge: it only adds exp(sink) to the denominator, so with
// m' = max(m, sink) the sum becomes sum * exp(m - m') + exp(sink - m') and the accumulator is scaled by
// exp(m - m') (taken relative to m' so that neither a large sink nor a large score overflows).
template <typename Out>
void write_output(const Problem& p, const Tile& tile, int64_t r, const float* acc, float m, float sum) {
  const int64_t rows_per_query = (tile.kv_end - tile.kv_begin) * p.group;
  const int64_t token = p.query_start[tile.seq] + tile.query_begin + r / rows_per_query;
  const int64_t head = tile.kv_begin * p.group + r % rows_per_query;
  Out* target = p.out->data_ptr<Out>() + (token * p.heads + head) * p.dim;
  float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
  if (p.sinks != nullptr && m != NEG_INF) {
    const float sink = p.sinks[head], top = std::max(m, sink), factor = std::exp(m - top);
    inv_sum = factor / (sum * factor + std::exp(sink - top));
  }
  store_row(acc, inv_sum, p.dim, target);
}

void write_row(const Problem& p, const Tile& tile, int64_t r, const float* acc, float m, float sum) {
  switch (p.out->scalar_type()) {
    case at::kFloat: write_output<float>(p, tile, r, acc, m, sum); break;
    case at::kBFloat16: write_output<c10::BFloat16>(p, tile, r, acc, m, sum); break;
    default: write_output<c10::Half>(p, tile, r, acc, m, sum);
  }
}

Storage storage_of(const at::Tensor& pool, int64_t scheme) {
  if (scheme == 0) return Storage::Int8;
  if (scheme == 1) return Storage::Fp8E4M3;
  if (scheme == 2) return Storage::Fp8E5M2;
  switch (pool.scalar_type()) {
    case at::kFloat: return Storage::Float32;
    case at::kBFloat16: return Storage::BFloat16;
    case at::kHalf: return Storage::Float16;
    default: TORCH_CHECK(false, "a K/V pool of ", pool.scalar_type(), " needs a quantization scheme (0, 1 or 2)");
  }
  return Storage::Float32;
}

// out[rows of the given sequences] = attention of q over each sequence's paged context.
// Stores the step's new K and V rows (k_new / v_new [tokens, kv_heads, head_dim], in the pool's dtype) at
// their slots: a float pool's write, done here so a decode layer makes one call, not three.
void write_new_rows(at::Tensor& pool, const at::Tensor& rows, const int64_t* slots, int64_t tokens) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) == tokens && rows.size(1) == pool.size(1) &&
              rows.size(2) == pool.size(2) && rows.stride(2) == 1 && rows.stride(1) == pool.size(2) &&
              rows.scalar_type() == pool.scalar_type(), "k_new / v_new: [tokens, kv_heads, head_dim] rows in the pool's dtype");
  const int64_t row_bytes = pool.size(1) * pool.size(2) * pool.element_size();
  const auto* src = static_cast<const uint8_t*>(rows.data_ptr());
  auto* dst = static_cast<uint8_t*>(pool.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(dst + slots[t] * row_bytes, src + t * rows.stride(0) * pool.element_size(), row_bytes);
  }
}

void paged_attention(at::Tensor out, const at::Tensor& q, at::Tensor k_pool, at::Tensor v_pool,
                     const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, int64_t scheme, double scale,
                     int64_t window, const c10::optional<at::Tensor>& sinks, int64_t partition_size,
                     const c10::optional<at::Tensor>& k_new,
                     const c10::optional<at::Tensor>& v_new, const c10::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [tokens, heads, head_dim] with each token's heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out: contiguous, shaped like q");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q must be float32, bfloat16 or float16");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes() &&
              v_pool.is_contiguous() && v_pool.scalar_type() == k_pool.scalar_type(),
              "k_pool / v_pool: contiguous [slots, kv_heads, head_dim], alike");
  TORCH_CHECK(scheme >= -1 && scheme <= 2, "scheme: -1 (pool in a float dtype), 0 int8, 1 fp8_e4m3, 2 fp8_e5m2");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1), num_slots = k_pool.size(0);
  TORCH_CHECK(k_pool.size(2) == dim, "the pool's head_dim ", k_pool.size(2), " is not q's ", dim);
  TORCH_CHECK(dim <= MAX_HEAD_DIM && dim % 8 == 0, "head_dim must be a multiple of 8, at most ", MAX_HEAD_DIM);
  TORCH_CHECK(heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(group <= MAX_TILE_ROWS, "at most ", MAX_TILE_ROWS, " query heads per KV head");
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a positive number of keys, got ", window);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == heads &&
                sinks->is_contiguous() && sinks->device().is_cpu(),
                "sinks: a contiguous float32 CPU tensor [heads] (", heads, " heads), got ", sinks->scalar_type(), " ",
                sinks->sizes());
  }
  const Storage storage = storage_of(k_pool, scheme);
  const bool coded = scheme >= 0;
  if (coded) {
    TORCH_CHECK(k_pool.element_size() == 1, "codes are one byte each");
    for (const auto* scales : {&k_scales, &v_scales}) {
      TORCH_CHECK(scales->has_value() && (*scales)->scalar_type() == at::kBFloat16 && (*scales)->is_contiguous() &&
                  (*scales)->dim() == 2 && (*scales)->size(0) == num_slots && (*scales)->size(1) == kv_heads,
                  "a quantized pool needs contiguous bfloat16 scales [slots, kv_heads]");
    }
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables: contiguous int64 [seqs, blocks]");
  const int64_t seqs = block_tables.size(0);
  for (const auto* t : {&query_start, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->size(0) == seqs,
                "query_start, query_lens, context_lens: contiguous int64 [seqs]");
  }
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();
  const int64_t* clens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), tokens = q.size(0);
  if (slot_mapping.has_value()) {
    TORCH_CHECK(scheme == -1 && k_new.has_value() && v_new.has_value(),
                "k_new, v_new and slot_mapping go together, into a pool in a float dtype");
    TORCH_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->dim() == 1 && slot_mapping->is_contiguous() &&
                slot_mapping->size(0) == tokens, "slot_mapping: contiguous int64 [tokens]");
    const int64_t* slots = slot_mapping->data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pool");
    }
    write_new_rows(k_pool, *k_new, slots, tokens);
    write_new_rows(v_pool, *v_new, slots, tokens);
  }
  // Every index the loops will follow is checked here, once: no read outside the pool or the batch.
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(qlens[s] >= 1 && clens[s] >= qlens[s], "sequence ", s, ": query_len ", qlens[s],
                " must be at least 1 and at most its context_len ", clens[s]);
    TORCH_CHECK(starts[s] >= 0 && starts[s] + qlens[s] <= tokens, "sequence ", s, "'s rows are outside q");
    const int64_t blocks = (clens[s] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= width, "sequence ", s, " needs ", blocks, " blocks, its table has ", width);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = tables[s * width + b];
      TORCH_CHECK(block >= 0 && (block + 1) * block_size <= num_slots, "sequence ", s, ": block ", block,
                  " is outside the pool");
    }
  }

  Problem problem{&q, &out, starts, qlens, clens, tables, width, block_size, heads, kv_heads, group, dim,
                  q.stride(0), static_cast<float>(scale), window,
                  sinks.has_value() ? sinks->data_ptr<float>() : nullptr,
                  RowReader{storage, static_cast<const uint8_t*>(k_pool.data_ptr()),
                            coded ? (*k_scales).data_ptr<c10::BFloat16>() : nullptr, kv_heads, dim,
                            k_pool.element_size(), {}},
                  RowReader{storage, static_cast<const uint8_t*>(v_pool.data_ptr()),
                            coded ? (*v_scales).data_ptr<c10::BFloat16>() : nullptr, kv_heads, dim,
                            v_pool.element_size(), {}},
                  HAS_BF16_DOT && storage == Storage::BFloat16 && q.scalar_type() == at::kBFloat16 && dim % 32 == 0 &&
                      use_bf16_dot.load(std::memory_order_relaxed)};
  problem.keys.init_table();
  problem.values.init_table();

  // Tiles: a run of KV heads (all of them where their folded heads fit) and the queries whose rows fit.
  const int64_t kv_per_tile =
      std::max<int64_t>(1, std::min({kv_heads, MAX_TILE_ROWS / group, MAX_TILE_KV_VALUES / dim}));
  const int64_t queries_per_tile = std::max<int64_t>(1, MAX_TILE_ROWS / (kv_per_tile * group));
  std::vector<Tile> tiles;
  int64_t total_keys = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t kv0 = 0; kv0 < kv_heads; kv0 += kv_per_tile) {
      for (int64_t q0 = 0; q0 < qlens[s]; q0 += queries_per_tile) {
        const int64_t q1 = std::min(qlens[s], q0 + queries_per_tile);
        tiles.push_back(Tile{s, kv0, std::min(kv_heads, kv0 + kv_per_tile), q0, q1, 0, 1});
        total_keys += tile_key_end(tiles.back(), clens, qlens) - tile_key_begin(tiles.back(), clens, qlens, window);
      }
    }
  }
  // Partition length: long enough that an item's fixed cost is small, short enough that there are a few
  // items per thread when the batch itself offers too few (one long decode).
  int64_t part = partition_size;
  if (part <= 0) {
    const int64_t threads = at::get_num_threads();
    part = std::max<int64_t>(256, (total_keys + 4 * threads - 1) / (4 * threads));
  }
  part = (part + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  std::vector<Item> items;
  int64_t partials = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    Tile& tile = tiles[t];
    const int64_t key_begin = tile_key_begin(tile, clens, qlens, window);
    const int64_t key_end = tile_key_end(tile, clens, qlens);
    const int64_t parts = std::max<int64_t>(1, (key_end - key_begin + part - 1) / part);
    tile.num_parts = parts;
    tile.first_partial = partials;
    for (int64_t k = 0; k < parts; ++k) {
      items.push_back(Item{t, key_begin + k * part, std::min(key_end, key_begin + (k + 1) * part),
                           parts > 1 ? partials + k : -1});
    }
    if (parts > 1) partials += parts;
  }
  const int64_t row_floats = MAX_TILE_ROWS * (dim + 2);  // m, l, acc of every row of one item
  std::vector<float> partial_store(static_cast<size_t>(partials * row_floats));

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // Per thread, kept across calls: a decode step calls this once per layer, and fresh buffers would be
    // zeroed every time.
    thread_local std::vector<float> local(static_cast<size_t>(MAX_TILE_ROWS * (MAX_HEAD_DIM + 2)));
    thread_local Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      const Tile& tile = tiles[item.tile];
      float* base = item.partial >= 0 ? partial_store.data() + item.partial * row_floats : local.data();
      float* m = base;
      float* l = base + MAX_TILE_ROWS;
      float* acc = base + 2 * MAX_TILE_ROWS;
      attend(problem, tile, item, scratch, m, l, acc);
      if (item.partial < 0) {
        const int64_t rows = (tile.query_end - tile.query_begin) * (tile.kv_end - tile.kv_begin) * group;
        for (int64_t r = 0; r < rows; ++r) write_row(problem, tile, r, acc + r * dim, m[r], l[r]);
      }
    }
  });
  // Merge the partitions of split tiles: rescale each part's sum and accumulator to the global max.
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(dim));
    for (int64_t t = begin; t < end; ++t) {
      const Tile& tile = tiles[t];
      if (tile.num_parts == 1) continue;
      const int64_t rows = (tile.query_end - tile.query_begin) * (tile.kv_end - tile.kv_begin) * group;
      for (int64_t r = 0; r < rows; ++r) {
        float global_max = NEG_INF;
        for (int64_t k = 0; k < tile.num_parts; ++k) {
          global_max = std::max(global_max, partial_store[(tile.first_partial + k) * row_floats + r]);
        }
        std::fill(merged.begin(), merged.end(), 0.0f);
        float sum = 0.0f;
        for (int64_t k = 0; k < tile.num_parts; ++k) {
          const float* base = partial_store.data() + (tile.first_partial + k) * row_floats;
          if (base[r] == NEG_INF) continue;  // this part held no key the row may see
          const float factor = std::exp(base[r] - global_max);
          sum += base[MAX_TILE_ROWS + r] * factor;
          const float* acc = base + 2 * MAX_TILE_ROWS + r * dim;
          for (int64_t d = 0; d < dim; ++d) merged[d] += acc[d] * factor;
        }
        write_row(problem, tile, r, merged.data(), global_max, sum);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvreuse_attn, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, int scheme, float scale, int window, Tensor? sinks, int partition_size, Tensor? k_new, "
        "Tensor? v_new, Tensor? slot_mapping) -> ()");
  // Whether this build holds the AVX512_BF16 kernel (bf16 pools and queries, head_dim a multiple of 32).
  m.def("has_bf16_dot() -> bool", []() { return HAS_BF16_DOT; });
  // Whether calls from now on use it where it applies (on at load; off reads a bf16 pool as float32 rows like every
  // other dtype: the tests and the benchmark compare the two layouts; a user never needs it).
  m.def("use_bf16_dot(bool on) -> ()", [](bool on) { use_bf16_dot.store(on, std::memory_order_relaxed); });
}

TORCH_LIBRARY_IMPL(kvreuse_attn, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}

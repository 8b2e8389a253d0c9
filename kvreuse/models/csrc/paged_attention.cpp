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
// K/V may be stored as float32, bfloat16, float16, or as one-byte codes (int8, fp8 e4m3 / e5m2) with a
// bfloat16 scale per token and KV head (kvreuse/cache/kv_quant.py): a code is turned into a float and
// multiplied by its scale as it is read; nothing is written back. kvreuse/models/paged_attention.py holds
// the PyTorch reference this equals within float summation error (tests/test_paged_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KEY_TILE = 16;     // keys per inner step: one AVX-512 vector or two AVX2 vectors of scores
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t MAX_TILE_ROWS = 32;  // query rows (queries x folded heads) of one item
constexpr int64_t MAX_TILE_KV_VALUES = 2048;  // kv heads x head_dim of one key in a tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp of KEY_TILE floats at once. A scalar expf per score would cost more than the dot products of a
// decode row; this is a degree-6 polynomial on the reduced argument with the power of two put in the
// exponent bits (relative error ~2e-7, below float32 summation error over a context).
inline void exp_tile(float* x) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 hi = _mm256_set1_ps(88.3f);
  for (int64_t i = 0; i < KEY_TILE; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    const __m256 is_neg_inf = _mm256_cmp_ps(v, lo, _CMP_LT_OQ);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2_hi, v);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
    result = _mm256_andnot_ps(is_neg_inf, result);  // masked scores (-inf) and underflow give exactly 0
    _mm256_storeu_ps(x + i, result);
  }
#else
  for (int64_t i = 0; i < KEY_TILE; ++i) x[i] = std::exp(x[i]);
#endif
}

// a . b over n floats (n a multiple of 8 where AVX2 is used; head_dim is checked to be one).
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
#else
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
#endif
}

// The dots of a with four rows b0..b3 (each n floats) into out[0..4): the four horizontal sums share
// their shuffles.
inline void dot4(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + stride + i), acc1);
    acc2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 2 * stride + i), acc2);
    acc3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 3 * stride + i), acc3);
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc0, acc1), _mm256_hadd_ps(acc2, acc3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#else
  for (int64_t k = 0; k < 4; ++k) out[k] = dot(a, b + k * stride, n);
#endif
}

// acc[0..n) = acc * correction + sum_j weights[j] * rows[j * stride ..], over `count` rows; the accumulator
// stays in registers across the rows, 32 values at a time.
inline void weighted_sum(float* acc, float correction, const float* weights, const float* rows, int64_t stride,
                         int64_t count, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 c = _mm256_set1_ps(correction);
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8), c);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 16), c), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 24), c);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_set1_ps(weights[j]);
      const float* row = rows + j * stride + d;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d < n; d += 8) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
    for (int64_t j = 0; j < count; ++j) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(weights[j]), _mm256_loadu_ps(rows + j * stride + d), a0);
    }
    _mm256_storeu_ps(acc + d, a0);
  }
#else
  for (int64_t d = 0; d < n; ++d) acc[d] *= correction;
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t d = 0; d < n; ++d) acc[d] += weights[j] * rows[j * stride + d];
  }
#endif
}

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

  // Heads [head, head + count) of a slot are adjacent in the pool: one run of bytes to ask for early.
  inline void prefetch(int64_t slot, int64_t head, int64_t count) const {
    const uint8_t* src = base + (slot * kv_heads + head) * head_dim * elem_size;
    for (int64_t byte = 0; byte < count * head_dim * elem_size; byte += 64) __builtin_prefetch(src + byte);
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
  RowReader keys, values;
};

// Attend one item: its tile's rows over keys [key_begin, key_end). Leaves the running max, sum and
// (unnormalised) accumulator of every row in m, l, acc.
// What one thread converts a tile's keys into: float32 K and V of KEY_TILE keys.
struct Scratch {
  std::vector<float> keys = std::vector<float>(KEY_TILE * MAX_TILE_KV_VALUES);
  std::vector<float> values = std::vector<float>(KEY_TILE * MAX_TILE_KV_VALUES);
};

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
        for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(src[i]) * p.scale;
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
  // K and V of the tile's keys as float32: kt[(j * kv_count + kv) * dim + d], the same for vt.
  float* kt = scratch.keys.data();
  float* vt = scratch.values.data();
  alignas(64) float scores[KEY_TILE];
  const int64_t key_stride = kv_count * dim;
  // The first query of the tile sees the fewest keys: limit first_position + query + 1 for each row.
  const int64_t first_row_limit = first_position + tile.query_begin + 1;
  for (int64_t key0 = item.key_begin; key0 < item.key_end; key0 += KEY_TILE) {
    const int64_t n = std::min(KEY_TILE, item.key_end - key0);
    // Block and offset of the tile's first key, then stepped: a 64-bit division per key costs more than
    // reading the key.
    int64_t block = key0 / p.block_size, offset = key0 - block * p.block_size;
    // Ask for the next tile's rows now: blocks lie anywhere in the pool, a jump the hardware prefetcher
    // does not foresee.
    const int64_t next_end = std::min(item.key_end, key0 + 2 * KEY_TILE);
    if (key0 + KEY_TILE < next_end) {
      int64_t next_block = (key0 + KEY_TILE) / p.block_size;
      int64_t next_offset = key0 + KEY_TILE - next_block * p.block_size;
      for (int64_t position = key0 + KEY_TILE; position < next_end; ++position) {
        const int64_t slot = table[next_block] * p.block_size + next_offset;
        p.keys.prefetch(slot, tile.kv_begin, kv_count);
        p.values.prefetch(slot, tile.kv_begin, kv_count);
        if (++next_offset == p.block_size) {
          next_offset = 0;
          ++next_block;
        }
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = table[block] * p.block_size + offset;
      for (int64_t kv = 0; kv < kv_count; ++kv) {
        p.keys.read(slot, tile.kv_begin + kv, kt + j * key_stride + kv * dim);
        p.values.read(slot, tile.kv_begin + kv, vt + j * key_stride + kv * dim);
      }
      if (++offset == p.block_size) {
        offset = 0;
        ++block;
      }
    }
    const bool needs_mask = key0 + n > first_row_limit;  // some key here is after some row's query
    for (int64_t r = 0; r < rows; ++r) {
      int64_t visible = n;  // keys of this tile the row may attend to: a prefix of it
      if (needs_mask) {
        const int64_t limit = first_position + tile.query_begin + r / rows_per_query + 1;  // keys < limit
        visible = std::max<int64_t>(0, std::min(n, limit - key0));
      }
      if (visible == 0) continue;
      const float* qrow = q + r * dim;
      const int64_t kv_offset = ((r % rows_per_query) / group) * dim;
      const float* keys = kt + kv_offset;
      int64_t j = 0;
      for (; j + 4 <= visible; j += 4) dot4(qrow, keys + j * key_stride, key_stride, dim, scores + j);
      for (; j < visible; ++j) scores[j] = dot(qrow, keys + j * key_stride, dim);
      float tile_max = NEG_INF;
      for (j = 0; j < visible; ++j) tile_max = std::max(tile_max, scores[j]);
      for (j = visible; j < KEY_TILE; ++j) scores[j] = NEG_INF;
      const float new_max = std::max(m[r], tile_max);
      const float correction = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - new_max);
      m[r] = new_max;
      for (j = 0; j < KEY_TILE; ++j) scores[j] -= new_max;
      exp_tile(scores);
      float tile_sum = 0.0f;
      for (j = 0; j < visible; ++j) tile_sum += scores[j];
      l[r] = l[r] * correction + tile_sum;
      weighted_sum(acc + r * dim, correction, scores, vt + kv_offset, key_stride, visible, dim);
    }
  }
}

template <typename Out>
void write_output(const Problem& p, const Tile& tile, int64_t r, const float* acc, float sum) {
  const int64_t rows_per_query = (tile.kv_end - tile.kv_begin) * p.group;
  const int64_t token = p.query_start[tile.seq] + tile.query_begin + r / rows_per_query;
  const int64_t head = tile.kv_begin * p.group + r % rows_per_query;
  Out* target = p.out->data_ptr<Out>() + (token * p.heads + head) * p.dim;
  store_row(acc, sum > 0.0f ? 1.0f / sum : 0.0f, p.dim, target);
}

void write_row(const Problem& p, const Tile& tile, int64_t r, const float* acc, float sum) {
  switch (p.out->scalar_type()) {
    case at::kFloat: write_output<float>(p, tile, r, acc, sum); break;
    case at::kBFloat16: write_output<c10::BFloat16>(p, tile, r, acc, sum); break;
    default: write_output<c10::Half>(p, tile, r, acc, sum);
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
                     int64_t partition_size, const c10::optional<at::Tensor>& k_new,
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
                  q.stride(0), static_cast<float>(scale),
                  RowReader{storage, static_cast<const uint8_t*>(k_pool.data_ptr()),
                            coded ? (*k_scales).data_ptr<c10::BFloat16>() : nullptr, kv_heads, dim,
                            k_pool.element_size(), {}},
                  RowReader{storage, static_cast<const uint8_t*>(v_pool.data_ptr()),
                            coded ? (*v_scales).data_ptr<c10::BFloat16>() : nullptr, kv_heads, dim,
                            v_pool.element_size(), {}}};
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
        total_keys += clens[s] - qlens[s] + q1;
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
    const int64_t key_end = clens[tile.seq] - qlens[tile.seq] + tile.query_end;
    const int64_t parts = std::max<int64_t>(1, (key_end + part - 1) / part);
    tile.num_parts = parts;
    tile.first_partial = partials;
    for (int64_t k = 0; k < parts; ++k) {
      items.push_back(Item{t, k * part, std::min(key_end, (k + 1) * part), parts > 1 ? partials + k : -1});
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
        for (int64_t r = 0; r < rows; ++r) write_row(problem, tile, r, acc + r * dim, l[r]);
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
        write_row(problem, tile, r, merged.data(), sum);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvreuse_attn, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor query_start, Tensor query_lens, Tensor context_lens, "
        "int block_size, int scheme, float scale, int partition_size, Tensor? k_new, Tensor? v_new, "
        "Tensor? slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvreuse_attn, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}

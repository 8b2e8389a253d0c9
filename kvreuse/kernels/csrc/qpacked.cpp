// Quantized products over weights packed in blocks of 16 outputs (kernels/qpacked.py): batch-invariant mode's
// kernel for q8_0, q4_0 and q4_1, one arithmetic at every row count.
//
// Batch-invariant mode wants one arithmetic for a row whatever number of rows share its step. The int8 route
// makes that cheap to guarantee: an input row is rounded to int8 codes per chunk of 32 values (one float32
// scale, amax / 127, as llama.cpp rounds its activations), and the integer dot product of a chunk of codes
// with a chunk of weight codes is exact in int32 whatever order its terms are added in. Only the float part
// rounds, in `float_part`: per chunk, in chunk order, acc = fma(float(sum), a * d, acc) (then fma(b, d * the
// input's code sum, acc) for q4_1's offsets), one float32 lane per output. Every row of every call goes
// through that function, so a row's bits depend on its input and the weight only.
//
// The weights are packed at load (qpacked.pack), per block of 16 outputs and chunk of 32 inputs: the 512 codes
// in rows of 16 outputs x 4 codes (row k4 holds each output's codes 4 * k4 .. 4 * k4 + 3: the layout AMX's
// TDPBSSD reads, and one vpdpbusd's operand), 4-bit codes two to a byte (code i low, code 256 + i high, so a
// mask and a shift unpack 64 bytes into two rows' worth), then the 16 outputs' fp16 scales a and, for q4_1,
// their fp16 offsets b: q8_0 544 bytes, q4_0 288, q4_1 320, the file's bytes per value.
//
// The integer sums come from one of two places, chosen by the row count only for speed:
// - AVX512-VNNI (`vnni_block`), up to 4 rows at a time: one vpdpbusd adds 4 products to each of 16 outputs'
//   int32 lanes, the decoded weight registers shared by the rows. Decode rows always run here: it streams the
//   weights at the memory's speed.
// - AMX (`tile_product`), above kVnniRows rows where the CPU grants the tiles: TDPBSSD multiplies 16 rows of
//   input codes by a chunk of 16 outputs' codes into 16 x 16 int32 sums, one chunk per instruction so each
//   chunk's sum takes its own scales; four chunks in flight.
// Without AMX every row count runs on VNNI, 4 rows at a time: the same bits, more slowly.
//
// Built with -march=native: without AVX512-VNNI (and F16C, AVX512-BF16 for the bf16 outputs) the operators
// exist, `packed_built` says False and the product refuses. A CPU may advertise AMX and Linux still refuse the
// tile state (granted per process on request: arch_prctl ARCH_REQ_XCOMP_PERM), so `amx_probe` asks, runs one
// tile product and compares it with a scalar sum before the tiles are used.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define KVREUSE_PACKED 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVREUSE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

// Formats (kernels/qpacked.py's FORMAT_CODES): codes' bytes per 16 x 32 block, and what the float part adds.
constexpr int64_t kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2;
constexpr int64_t kChunk = 32;  // input values per scale, and per tile product
constexpr int64_t kTile = 16;   // rows of a tile: input rows, and output rows per packed block

int64_t codes_bytes(int64_t format) { return format == kQ8_0 ? 512 : 256; }
int64_t block_bytes(int64_t format) { return codes_bytes(format) + 32 + (format == kQ4_1 ? 32 : 0); }

#ifdef KVREUSE_PACKED

// An input row as 16 float32 lanes from float32 or bfloat16 (a bf16 value is the top half of its float32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The input rows rounded per chunk: codes [padded rows, in] (rows past the last zero, so a tile of 16 rows can
// always be loaded), and per row and chunk the scale d = amax / 127 and d * (the sum of its codes), and
// that sum itself (q4_0's zero is taken in the integer sums).
struct QuantizedInput {
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> sum;
};

template <class T>
QuantizedInput quantize_rows(const T* x, int64_t rows, int64_t in) {
  const int64_t chunks = in / kChunk, padded = (rows + kTile - 1) / kTile * kTile;
  QuantizedInput q;
  q.codes.assign(padded * in, 0);
  q.scale.resize(rows * chunks);
  q.scaled_sum.resize(rows * chunks);
  q.sum.resize(rows * chunks);
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t r = first; r < last; ++r) {
      for (int64_t c = 0; c < chunks; ++c) {
        const T* p = x + r * in + c * kChunk;
        const __m512 lo = load16(p), hi = load16(p + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, magnitude), _mm512_and_ps(hi, magnitude)));
        const float d = amax / 127.f;
        const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        // Rounded to nearest (even on ties) by the conversion; |x| * 127 / amax <= 127 (+ rounding) fits.
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
        int8_t* out = q.codes.data() + r * in + c * kChunk;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(qhi));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        q.scale[r * chunks + c] = d;
        q.sum[r * chunks + c] = sum;
        q.scaled_sum[r * chunks + c] = d * static_cast<float>(sum);
      }
    }
  });
  return q;
}

// Weight bytes [from, from + bytes) clipped to limit, asked for into L2 a cache line at a time, kPrefetchAhead
// bytes before the kernel reads them: a decode step's weights come from memory, and the hardware prefetchers
// restart at every 4 KiB page (csrc/quant.cpp's products do the same).
constexpr int64_t kPrefetchAhead = 2048;

inline void prefetch_weights(const uint8_t* from, int64_t bytes, const uint8_t* limit) {
  const uint8_t* stop = std::min(from + bytes, limit);
  for (const uint8_t* p = from; p < stop; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// 4-bit codes two to a byte -> one byte each, in the tile's layout (low nibbles the first 256 bytes).
inline void unpack_nibbles(const uint8_t* packed, uint8_t* out) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(packed + 64 * i);
    _mm512_storeu_si512(out + 64 * i, _mm512_and_si512(v, mask));
    _mm512_storeu_si512(out + 256 + 64 * i, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// The float part of one chunk for one input row (its chunk index `at` in q's per-chunk arrays): its 16 outputs'
// exact integer sums, the weights' scales a and offsets b. Both kernels below take every row through this one
// function, so a row's bits do not depend on which of them multiplied it.
template <int64_t Format>
inline __m512 float_part(__m512 acc, __m512i sum, __m512 a, __m512 b, const QuantizedInput& q, int64_t at) {
  if constexpr (Format == kQ4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * q.sum[at]));  // the zero, 8
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(a, _mm512_set1_ps(q.scale[at])), acc);
  if constexpr (Format == kQ4_1) acc = _mm512_fmadd_ps(b, _mm512_set1_ps(q.scaled_sum[at]), acc);
  return acc;
}

// A chunk's 16 scales a and (q4_1) offsets b, from their fp16 bytes.
template <int64_t Format>
inline void chunk_scales(const uint8_t* scales, __m512& a, __m512& b) {
  a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
  b = _mm512_setzero_ps();
  if constexpr (Format == kQ4_1) b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
}

// A row's 16 outputs: float32, or rounded to bfloat16 (to nearest even, as out.to(bfloat16) rounds).
inline void store_row(float* out, __mmask16 lanes, __m512 v) { _mm512_mask_storeu_ps(out, lanes, v); }
inline void store_row(at::BFloat16* out, __mmask16 lanes, __m512 v) {
  _mm256_mask_storeu_epi16(out, lanes, (__m256i)_mm512_cvtneps_pbh(v));
}

// Calls fn(std::integral_constant<int, R>{}) for R = count (1..16): a tile's rows are a compile-time count, so
// its accumulators stay in registers.
template <class Fn, int R = 1>
void with_tile_rows(int64_t count, Fn&& fn) {
  if constexpr (R == kTile) {
    fn(std::integral_constant<int, R>{});
  } else {
    if (count == R) return fn(std::integral_constant<int, R>{});
    with_tile_rows<Fn, R + 1>(count, std::forward<Fn>(fn));
  }
}

// A few rows on AVX512-VNNI instead of the tiles: a tile product costs 25-30 ns whatever its rows (on the 2-core
// Xeon VM of docs/benchmarks.md), more than a decode row's chunk takes to stream from memory, so up to
// kVnniRows rows each chunk's integer sums come from vpdpbusd over the same packed codes (row k4 of a chunk's
// codes is 16 outputs x 4 bytes: one instruction adds 4 products to each output's int32 lane, the input's 4
// codes broadcast), then the same float_part: the same exact sums, the same float instructions, the same bits.
// 4-bit codes go as the unsigned operand; q8_0's signed codes meet the inputs shifted to unsigned (code + 128),
// and 128 * (the chunk's weight sum) is taken back in int32.
constexpr int64_t kVnniRows = 4;

template <int64_t Format, int R, class Out>
void vnni_block(const QuantizedInput& q, int64_t row0, int64_t in, const uint8_t* block, Out* out,
                int64_t out_features, int64_t width, const uint8_t* limit) {
  const int64_t chunks = in / kChunk, bytes = block_bytes(Format), cbytes = codes_bytes(Format);
  const __m512i low4 = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(-128);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = block + c * bytes;
    prefetch_weights(chunk + kPrefetchAhead, bytes, limit);
    __m512i w[8];
    if constexpr (Format == kQ8_0) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(chunk + 64 * j);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * j);
        w[j] = _mm512_and_si512(v, low4);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    __m512i weight_sum = _mm512_setzero_si512();  // q8_0: each output's sum of codes over the chunk
    if constexpr (Format == kQ8_0) {
      for (int j = 0; j < 8; ++j) weight_sum = _mm512_dpbusd_epi32(weight_sum, ones, w[j]);
      weight_sum = _mm512_slli_epi32(weight_sum, 7);
    }
    __m512 a, b;
    chunk_scales<Format>(chunk + cbytes, a, b);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = q.codes.data() + (row0 + r) * in + c * kChunk;
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, x + 4 * j, 4);
        const __m512i xj = _mm512_set1_epi32(four);
        if constexpr (Format == kQ8_0) {
          sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(xj, flip), w[j]);
        } else {
          sum = _mm512_dpbusd_epi32(sum, w[j], xj);
        }
      }
      if constexpr (Format == kQ8_0) sum = _mm512_sub_epi32(sum, weight_sum);
      acc[r] = float_part<Format>(acc[r], sum, a, b, q, (row0 + r) * chunks + c);
    }
  }
  const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1);
  for (int r = 0; r < R; ++r) store_row(out + (row0 + r) * out_features, lanes, acc[r]);
}

#ifdef KVREUSE_AMX

// The tile registers' shapes (palette 1): 0-3 int32 sums (16 x 16), 4 and 5 input codes (16 rows x 32 bytes),
// 6 and 7 weight codes (8 rows of 16 outputs x 4 bytes): four chunks' products in flight before their sums are
// read.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's _tile_loadconfig hands the asm only the first 8 bytes of the configuration as its memory operand (so
// the compiler dropped the stores of the shapes), and its _tile_loadd names no memory at all (so stores into a
// buffer a tile then loads could be moved past the load): these two say what they read.
inline void load_tile_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
#define KVREUSE_TILE_LOAD(tile, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(base), "r"(static_cast<long>(stride)) : "memory")

// Input rows per tile product: 16, or fewer for the last rows of a call (a decode step's one row loads, multiplies
// and stores one row of each tile, not 16).
void configure_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows);      // int32 sums
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = kChunk, cfg.rows[t] = static_cast<uint8_t>(rows);  // input codes
  for (int t = 6; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kChunk / 4;                      // weight codes
  load_tile_config(cfg);
}

// Linux hands out the tile state only to a process that asks (once; every thread then has it).
bool tiles_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// One tile product checked against a scalar sum: whether the tiles work here, not only exist.
bool probe() {
  if (!tiles_granted()) return false;
  alignas(64) int8_t a[kTile * kChunk], b[8 * 64];
  alignas(64) int32_t c[kTile * kTile];
  for (int i = 0; i < kTile * kChunk; ++i) a[i] = static_cast<int8_t>((i * 37) % 255 - 127);
  for (int i = 0; i < 8 * 64; ++i) b[i] = static_cast<int8_t>((i * 91) % 31 - 15);
  configure_tiles(kTile);
  _tile_zero(0);
  KVREUSE_TILE_LOAD(4, a, kChunk);
  KVREUSE_TILE_LOAD(6, b, 64);
  _tile_dpbssd(0, 4, 6);
  _tile_stored(0, c, 64);
  _tile_release();
  for (int m = 0; m < kTile; ++m) {
    for (int n = 0; n < kTile; ++n) {
      int32_t sum = 0;
      for (int k = 0; k < kChunk; ++k) sum += a[m * kChunk + k] * b[(k / 4) * 64 + n * 4 + k % 4];
      if (c[m * kTile + n] != sum) return false;
    }
  }
  return true;
}

// The float part of chunk c for R input rows (their integer sums s[r * 16 ..]), into their accumulators.
template <int64_t Format, int R>
inline void add_chunk(const QuantizedInput& q, int64_t row0, int64_t chunks, int64_t c, const uint8_t* scales,
                      const int32_t* s, __m512 (&acc)[R]) {
  __m512 a, b;
  chunk_scales<Format>(scales, a, b);
  for (int r = 0; r < R; ++r) {
    acc[r] = float_part<Format>(acc[r], _mm512_load_si512(s + r * kTile), a, b, q, (row0 + r) * chunks + c);
  }
}

// Input rows [row0, row0 + R) against one block of 16 outputs (codes(c): the block's weight codes of chunk c,
// scales(c): its scales), two chunks' tile products in flight, their sums added in chunk order.
template <int64_t Format, int R, class Codes, class Scales, class Out>
void tile_product(const QuantizedInput& q, int64_t row0, int64_t in, Codes codes, Scales scales, Out* out,
                  int64_t out_features, int64_t width) {
  const int64_t chunks = in / kChunk;
  alignas(64) int32_t sums[4][kTile * kTile];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = q.codes.data() + row0 * in;
  // The product of chunk c into sum tile T, with input tile A and weight tile B.
#define KVREUSE_CHUNK_PRODUCT(T, A, B, c)             \
  _tile_zero(T);                                      \
  KVREUSE_TILE_LOAD(A, x + (c) * kChunk, in);         \
  KVREUSE_TILE_LOAD(B, codes(c), 64);                 \
  _tile_dpbssd(T, A, B);
  int64_t c = 0;
  // Four chunks' products in flight before the first sum is read (a tile product's latency is long), their
  // float parts then added in chunk order.
  for (; c + 4 <= chunks; c += 4) {
    KVREUSE_CHUNK_PRODUCT(0, 4, 6, c)
    KVREUSE_CHUNK_PRODUCT(1, 5, 7, c + 1)
    KVREUSE_CHUNK_PRODUCT(2, 4, 6, c + 2)
    KVREUSE_CHUNK_PRODUCT(3, 5, 7, c + 3)
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int i = 0; i < 4; ++i) add_chunk<Format, R>(q, row0, chunks, c + i, scales(c + i), sums[i], acc);
  }
  for (; c < chunks; ++c) {
    KVREUSE_CHUNK_PRODUCT(0, 4, 6, c)
    _tile_stored(0, sums[0], 64);
    add_chunk<Format, R>(q, row0, chunks, c, scales(c), sums[0], acc);
  }
#undef KVREUSE_CHUNK_PRODUCT
  const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1);
  for (int r = 0; r < R; ++r) store_row(out + (row0 + r) * out_features, lanes, acc[r]);
}

#endif  // KVREUSE_AMX

// Output blocks [first, last) of 16 outputs for every input row: out [rows, out_features] (float32 or bf16).
template <int64_t Format, class Out>
void run_blocks(const QuantizedInput& q, int64_t rows, int64_t in, const uint8_t* packed, int64_t out_features,
                Out* out, int64_t first, int64_t last, bool tiles) {
  const int64_t chunks = in / kChunk, bytes = block_bytes(Format);
  const uint8_t* limit = packed + last * chunks * bytes;
  prefetch_weights(packed + first * chunks * bytes, kPrefetchAhead, limit);
  if (!tiles || rows <= kVnniRows) {
    for (int64_t nb = first; nb < last; ++nb) {
      const uint8_t* block = packed + nb * chunks * bytes;
      const int64_t width = std::min<int64_t>(kTile, out_features - nb * kTile);
      for (int64_t m0 = 0; m0 < rows; m0 += kVnniRows) {
        with_tile_rows(std::min<int64_t>(kVnniRows, rows - m0), [&](auto r) {
          if constexpr (decltype(r)::value <= kVnniRows) {
            vnni_block<Format, decltype(r)::value>(q, m0, in, block, out + nb * kTile, out_features, width, limit);
          }
        });
      }
    }
    return;
  }
#ifdef KVREUSE_AMX
  const int64_t cbytes = codes_bytes(Format);
  // A block's weight codes for every chunk, unpacked once and used by every tile of input rows.
  std::vector<uint8_t> unpacked(Format == kQ8_0 ? 0 : chunks * 512);
  const int64_t whole = rows / kTile * kTile;
  // Two passes over the blocks where the rows end in a partial tile (the tiles' shape is set once per pass).
  for (const auto& [m_begin, m_end] : {std::pair{int64_t{0}, whole}, std::pair{whole, rows}}) {
    if (m_begin == m_end) continue;
    const int64_t tile_rows = std::min<int64_t>(kTile, m_end - m_begin);
    configure_tiles(tile_rows);
    for (int64_t nb = first; nb < last; ++nb) {
      const uint8_t* block = packed + nb * chunks * bytes;
      for (int64_t c = 0; c < chunks; ++c) {
        prefetch_weights(block + c * bytes + kPrefetchAhead, bytes, limit);
        if constexpr (Format != kQ8_0) unpack_nibbles(block + c * bytes, unpacked.data() + c * 512);
      }
      auto codes = [&](int64_t c) -> const uint8_t* {
        return Format == kQ8_0 ? block + c * bytes : unpacked.data() + c * 512;
      };
      auto scales = [&](int64_t c) -> const uint8_t* { return block + c * bytes + cbytes; };
      const int64_t width = std::min<int64_t>(kTile, out_features - nb * kTile);
      Out* block_out = out + nb * kTile;
      with_tile_rows(tile_rows, [&](auto r) {
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kTile) {
          tile_product<Format, decltype(r)::value>(q, m0, in, codes, scales, block_out, out_features, width);
        }
      });
    }
  }
  _tile_release();
#endif
}

#endif  // KVREUSE_PACKED

bool amx_probe() {
#ifdef KVREUSE_AMX
  static const bool works = probe();
  return works;
#else
  return false;
#endif
}

bool packed_built() {
#ifdef KVREUSE_PACKED
  return true;
#else
  return false;
#endif
}

// y = x W^T, W packed (qpacked.pack). `tiles`: AMX above kVnniRows rows where the probe passed (False: VNNI at every
// row count, which the tests hold to the tiles' bits).
at::Tensor qlinear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                          bool tiles) {
  TORCH_CHECK(format == kQ8_0 || format == kQ4_0 || format == kQ4_1, "qlinear_packed: unknown format code ", format);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear_packed: x must be a CPU float32 or bfloat16 [rows, in] tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t rows = x.size(0), in = x.size(1), chunks = in / kChunk;
  const int64_t blocks = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(in % kChunk == 0, "qlinear_packed: in_features must be a multiple of 32, got ", in);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == blocks && packed.size(1) == chunks && packed.size(2) == block_bytes(format),
              "qlinear_packed: packed weight must be contiguous uint8 [", blocks, ", ", chunks, ", ",
              block_bytes(format), "], got ", packed.scalar_type(), " ", packed.sizes());
  at::Tensor out = at::empty({rows, out_features}, x.options());
#ifdef KVREUSE_PACKED
  if (rows == 0 || out_features == 0) return out;
  const bool use_tiles = tiles && amx_probe();
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const QuantizedInput q = bf16 ? quantize_rows(xc.const_data_ptr<at::BFloat16>(), rows, in)
                                : quantize_rows(xc.const_data_ptr<float>(), rows, in);
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  auto run = [&](auto* o) {
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      if (format == kQ8_0) {
        run_blocks<kQ8_0>(q, rows, in, w, out_features, o, first, last, use_tiles);
      } else if (format == kQ4_0) {
        run_blocks<kQ4_0>(q, rows, in, w, out_features, o, first, last, use_tiles);
      } else {
        run_blocks<kQ4_1>(q, rows, in, w, out_features, o, first, last, use_tiles);
      }
    });
  };
  if (bf16) {
    run(out.mutable_data_ptr<at::BFloat16>());
  } else {
    run(out.mutable_data_ptr<float>());
  }
  return out;
#else
  TORCH_CHECK(false, "qlinear_packed: built without AVX512-VNNI (this CPU does not have it)");
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY(kvreuse_qpacked, m) {
  // No tensor argument: one implementation for every dispatch key.
  m.def("amx_probe() -> bool", &amx_probe);
  m.def("packed_built() -> bool", &packed_built);
  m.def("qlinear_packed(Tensor x, Tensor packed, int format, int out_features, bool tiles=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_qpacked, CPU, m) {
  m.impl("qlinear_packed", &qlinear_packed);
}

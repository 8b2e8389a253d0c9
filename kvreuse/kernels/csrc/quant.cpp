// Linear layers on quantized weights (kernels/quant.py's layouts), reading the quantized groups directly.
//
// A decode step's linear layer reads each weight byte once and does two flops per value, so its speed is
// how fast the weight streams from memory; a weight held at 4.5-8.5 bits per value streams 4-7x fewer
// bytes than float32. `qlinear` computes y = x W^T for a few rows of x: per group of 32 values it turns
// the stored integers into float32 (one conversion and one FMA with the group's scale and offset, in
// registers), then multiplies them into every input row's float32 accumulators. `qdequant` writes the
// float32 values of whole rows (the larger row counts multiply those tiles with the library GEMM).
//
// The layouts (kept in step with kernels/quant.py's FORMATS and sections): each output row is a run of
// spans of 256 values (the last one shorter where the row is not a multiple of 256), each span its fp16
// scales, its 8-bit codes, its high-bit planes (a 32-bit word per 32 values and plane) and its values
// (int8, or 4 bits: in each group of 32, byte i holds value i low and value i + 16 high). For every format
// the value is a * q + b with a * q exact in float32 (or a * (q - zero)), so fma(q, a, b) is gguf's own.
//
// Built at run time by layers/quantized_linear.py with -march=native: AVX-512 (16 lanes), AVX2 with FMA (8 lanes),
// or scalar code. Output rows are split between torch's OpenMP threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 32;   // values per nibble group and per plane word
constexpr int64_t kSuper = 256;  // values per K-quant super-block
constexpr int kMaxRows = 8;      // input rows per pass over the weights (their accumulators stay in registers)

// The formats, numbered as in kernels/quant.py.
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kMXFP4 = 8 };
constexpr int64_t kLastFormat = kMXFP4;
const char* const kNames[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4"};

// MXFP4's 4-bit codes are E2M1 floats: doubled, they are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives (llama.cpp's kvalues_mxfp4), times 2^(e - 128) for the group's E8M0 byte e. Held as levels
// 12 + value (0..24), so they run as unsigned codes with zero 12 (value = (level - 12) * scale), as
// q4_0's do with zero 8: every kernel takes them through this table and is otherwise q4_0's.
constexpr int kMxfp4Levels[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

template <int Code>
struct Fmt;
// bits: value bits (8: int8 values); group: values per scale; kquant: scales are 8-bit codes times an fp16
// per super-block; has_min: an offset per group (else -zero * scale); block: GGUF's values per block;
// mx: an E8M0 byte per group for scale and the codes read through kMxfp4Levels (MXFP4).
#define KVREUSE_FORMAT(CODE, BITS, GROUP, KQUANT, HAS_MIN, ZERO, BLOCK, MX)                   \
  template <>                                                                                \
  struct Fmt<CODE> {                                                                         \
    static constexpr int bits = BITS, group = GROUP, zero = ZERO;                            \
    static constexpr bool kquant = KQUANT, has_min = HAS_MIN, mx = MX;                       \
    static constexpr int64_t block = BLOCK;                                                  \
  };
KVREUSE_FORMAT(kQ8_0, 8, 32, false, false, 0, 32, false)
KVREUSE_FORMAT(kQ4_0, 4, 32, false, false, 8, 32, false)
KVREUSE_FORMAT(kQ4_1, 4, 32, false, true, 0, 32, false)
KVREUSE_FORMAT(kQ5_0, 5, 32, false, false, 16, 32, false)
KVREUSE_FORMAT(kQ5_1, 5, 32, false, true, 0, 32, false)
KVREUSE_FORMAT(kQ4_K, 4, 32, true, true, 0, 256, false)
KVREUSE_FORMAT(kQ5_K, 5, 32, true, true, 0, 256, false)
KVREUSE_FORMAT(kQ6_K, 6, 16, true, false, 32, 256, false)
KVREUSE_FORMAT(kMXFP4, 4, 32, false, false, 12, 32, true)
#undef KVREUSE_FORMAT

// Byte offsets of a span's arrays (kernels/quant.py QuantFormat.sections) and its size.
struct SpanLayout {
  int64_t d = 0, dmin = 0, scales = 0, mins = 0, planes = 0, values = 0, bytes = 0;
};

template <class F>
SpanLayout span_layout(int64_t chunks) {
  SpanLayout l;
  const int64_t codes = chunks * kChunk / F::group;
  int64_t at = 0;
  if constexpr (F::kquant) {
    l.d = at, at += 2;
    if constexpr (F::has_min) l.dmin = at, at += 2;
    l.scales = at, at += codes;
    if constexpr (F::has_min) l.mins = at, at += codes;
  } else {
    l.scales = at, at += (F::mx ? 1 : 2) * codes;
    if constexpr (F::has_min) l.mins = at, at += 2 * codes;
  }
  if constexpr (F::bits > 4 && F::bits < 8) l.planes = at, at += 4 * (F::bits - 4) * chunks;
  l.values = at, at += F::bits == 8 ? kChunk * chunks : kChunk / 2 * chunks;
  l.bytes = at;
  return l;
}

// A row: `full` spans of 8 chunks, then a span of `tail` chunks (0: none).
struct Layout {
  SpanLayout span, last;
  int64_t full = 0, tail = 0, row_bytes = 0;
};

template <class F>
Layout layout_of(int64_t in) {
  Layout l;
  l.full = in / kSuper, l.tail = in % kSuper / kChunk;
  l.span = span_layout<F>(kSuper / kChunk);
  l.last = span_layout<F>(l.tail);
  l.row_bytes = l.full * l.span.bytes + (l.tail ? l.last.bytes : 0);
  return l;
}

// Weight bytes [from, from + bytes) clipped to limit, asked for into L2 (prefetcht1), a cache line at a time.
// The products run prefetch_distance bytes ahead of their reads: a decode step's weights come from memory,
// in matrices of 0.1-1 MB (experts, attention projections) that the hardware prefetchers start on late
// (they restart at every 4 KiB page), and read cold the products streamed half as fast as from cache.
constexpr int64_t kPrefetchAhead = 2048;

inline void prefetch_weights(const uint8_t* from, int64_t bytes, const uint8_t* limit) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const uint8_t* stop = std::min(from + bytes, limit);
  for (const uint8_t* p = from; p < stop; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
#endif
}

// Calls fn(std::integral_constant<int, R>{}) with R = min(count, kMaxRows): the kernels' input rows per
// pass over the weights are a compile-time count, so their accumulators stay in registers.
template <class Fn>
void with_rows(int64_t count, Fn&& fn) {
  switch (std::min<int64_t>(kMaxRows, count)) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Up to this many values a product's bfloat16 inputs and outputs are converted by the loops below, beyond it by
// ATen's vectorised, threaded `.to()`: at a decode row its four dispatched calls cost as long as the
// conversion, and the scalar loops cost 3 ns a value (at 256 rows x 1,280 outputs they made a qdot8 product
// 30% slower).
constexpr int64_t kOwnConversionValues = int64_t{1} << 15;

// A product's input rows as float32: x's own memory where it is contiguous float32, otherwise widened (a
// bfloat16 value is the upper half of its float32: exact), here for a few rows.
class FloatRows {
 public:
  explicit FloatRows(const at::Tensor& x) {
    if (x.scalar_type() == at::kFloat && x.is_contiguous()) {
      data_ = x.const_data_ptr<float>();
    } else if (x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.numel() <= kOwnConversionValues) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
      widened_.resize(x.numel());
      for (int64_t i = 0; i < x.numel(); ++i) widened_[i] = bf16_to_float(h[i]);
      data_ = widened_.data();
    } else {
      held_ = x.to(at::kFloat).contiguous();
      data_ = held_.const_data_ptr<float>();
    }
  }
  const float* data() const { return data_; }

 private:
  const float* data_ = nullptr;
  std::vector<float> widened_;
  at::Tensor held_;
};

// A product's float32 outputs: the returned tensor's memory where x is float32; for a few bfloat16 rows, a
// buffer that `result` rounds into x's dtype (to nearest even, as out.to(dtype) rounds), one ATen allocation
// in all; otherwise a float32 tensor that `result` converts with `.to()`.
class ProductOutputs {
 public:
  ProductOutputs(const at::Tensor& x, int64_t rows, int64_t out_features) : dtype_(x.scalar_type()) {
    if (dtype_ == at::kFloat || (dtype_ == at::kBFloat16 && rows * out_features <= kOwnConversionValues)) {
      out_ = at::empty({rows, out_features}, x.options());
      if (dtype_ == at::kBFloat16) buffer_.resize(rows * out_features);
    } else {
      out_ = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
    }
  }
  float* data() { return buffer_.empty() ? out_.mutable_data_ptr<float>() : buffer_.data(); }
  at::Tensor result() {
    if (out_.scalar_type() == at::kBFloat16) {
      at::BFloat16* o = out_.mutable_data_ptr<at::BFloat16>();
      for (size_t i = 0; i < buffer_.size(); ++i) o[i] = at::BFloat16(buffer_[i]);
      return out_;
    }
    return dtype_ == at::kFloat ? out_ : out_.to(dtype_);
  }

 private:
  at::ScalarType dtype_;
  at::Tensor out_;
  std::vector<float> buffer_;
};

// An E8M0 byte as MXFP4 scales its doubled levels: 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF), exact.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// A 4-bit code's integer level (the code itself, or MXFP4's table).
template <class F>
constexpr int level(int code) {
  if constexpr (F::mx) return kMxfp4Levels[code & 15];
  return code;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The scales a and offsets b of a span of n <= 8 chunks (256 values) starting at chunk c0: the value of
// group g is a[g] * q + b[g], with one group per chunk (32 values) or, for 16-value groups, two.
struct Span {
  float a[16], b[16];
};

template <class F>
inline void span_params(const uint8_t* sp, const SpanLayout& l, int n, Span& s) {
  constexpr int per_chunk = kChunk / F::group;
  if constexpr (F::kquant) {
    const float d = half_at(sp + l.d);
    const uint8_t* codes = sp + l.scales;
    if constexpr (F::has_min) {
      const float dmin = half_at(sp + l.dmin);
      for (int g = 0; g < n; ++g) {
        s.a[g] = d * static_cast<float>(codes[g]);
        s.b[g] = -(dmin * static_cast<float>(sp[l.mins + g]));
      }
    } else {
      for (int g = 0; g < n * per_chunk; ++g) {
        s.a[g] = d * static_cast<float>(static_cast<int8_t>(codes[g]));
        s.b[g] = -F::zero * s.a[g];
      }
    }
  } else if constexpr (F::mx) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    if (n == 8) {  // e8m0_half on eight lanes: (e - 1) << 23, or 0x00200000 << e for the two subnormal bytes
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + l.scales)));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      const __m256 a = _mm256_castsi256_ps(
          _mm256_mask_blend_epi32(_mm256_cmplt_epu32_mask(e, _mm256_set1_epi32(2)), normal, subnormal));
      _mm256_storeu_ps(s.a, a);
      _mm256_storeu_ps(s.b, _mm256_mul_ps(a, _mm256_set1_ps(static_cast<float>(-F::zero))));
      return;
    }
#endif
    for (int g = 0; g < n; ++g) {
      s.a[g] = e8m0_half(sp[l.scales + g]);
      s.b[g] = -F::zero * s.a[g];
    }
  } else {
#if defined(__F16C__)
    if (n == 8) {
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + l.scales)));
      _mm256_storeu_ps(s.a, a);
      if constexpr (F::has_min) {
        _mm256_storeu_ps(s.b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + l.mins))));
      } else {
        _mm256_storeu_ps(s.b, _mm256_mul_ps(a, _mm256_set1_ps(static_cast<float>(-F::zero))));
      }
      return;
    }
#endif
    for (int g = 0; g < n; ++g) {
      s.a[g] = half_at(sp + l.scales + 2 * g);
      s.b[g] = F::has_min ? half_at(sp + l.mins + 2 * g) : -F::zero * s.a[g];
    }
  }
}

// ---- vectors: W float lanes ----------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
using V = __m512;
using VI = __m512i;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vfloat(VI q) { return _mm512_cvtepi32_ps(q); }
inline VI u8_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI i8_lanes(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI low4(VI q) { return _mm512_and_si512(q, _mm512_set1_epi32(15)); }
inline VI high4(VI q) { return _mm512_srli_epi32(q, 4); }
inline VI levels_of(VI q) {  // MXFP4's levels of codes 0..15
  return _mm512_permutexvar_epi32(q, _mm512_loadu_si512(kMxfp4Levels));
}
template <int Shift>
inline VI add_bits(VI q, uint32_t bits) {  // lane i += (bit i of bits) << Shift
  return _mm512_mask_add_epi32(q, static_cast<__mmask16>(bits), q, _mm512_set1_epi32(1 << Shift));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using V = __m256;
using VI = __m256i;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline float vsum(V acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vfloat(VI q) { return _mm256_cvtepi32_ps(q); }
inline VI u8_lanes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI i8_lanes(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI low4(VI q) { return _mm256_and_si256(q, _mm256_set1_epi32(15)); }
inline VI high4(VI q) { return _mm256_srli_epi32(q, 4); }
inline VI levels_of(VI q) {  // MXFP4's levels of codes 0..15: two 8-lane lookups, chosen by bit 3
  const VI lo = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMxfp4Levels)), q);
  const VI hi = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMxfp4Levels + 8)), q);
  return _mm256_blendv_epi8(lo, hi, _mm256_cmpgt_epi32(q, _mm256_set1_epi32(7)));
}
template <int Shift>
inline VI add_bits(VI q, uint32_t bits) {
  const VI lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const VI bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), lane), _mm256_set1_epi32(1));
  return _mm256_add_epi32(q, _mm256_slli_epi32(bit, Shift));
}
#else
constexpr int W = 1;
using V = float;
using VI = int32_t;
inline V vzero() { return 0.f; }
inline V vset(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline float vsum(V a) { return a; }
inline V vfloat(VI q) { return static_cast<float>(q); }
inline VI u8_lanes(const uint8_t* p) { return *p; }
inline VI i8_lanes(const uint8_t* p) { return static_cast<int8_t>(*p); }
inline VI low4(VI q) { return q & 15; }
inline VI high4(VI q) { return q >> 4; }
inline VI levels_of(VI q) { return kMxfp4Levels[q]; }
template <int Shift>
inline VI add_bits(VI q, uint32_t bits) { return q + static_cast<int32_t>((bits & 1u) << Shift); }
#endif
constexpr int N = kChunk / W;  // vectors per chunk of 32 values

// The integers q of chunk c of a span, N vectors of W lanes, in value order.
template <class F>
inline void decode(const uint8_t* sp, const SpanLayout& l, int c, VI q[N]) {
  if constexpr (F::bits == 8) {
    const uint8_t* v = sp + l.values + kChunk * c;
    for (int k = 0; k < N; ++k) q[k] = i8_lanes(v + k * W);
  } else {
    const uint8_t* v = sp + l.values + kChunk / 2 * c;
    for (int k = 0; k < N / 2; ++k) {
      const VI bytes = u8_lanes(v + k * W);
      q[k] = low4(bytes);
      q[k + N / 2] = high4(bytes);
    }
    if constexpr (F::mx) {
      for (int k = 0; k < N; ++k) q[k] = levels_of(q[k]);
    }
    if constexpr (F::bits > 4) {
      uint32_t words[F::bits - 4];
      std::memcpy(words, sp + l.planes + 4 * (F::bits - 4) * c, sizeof(words));
      for (int k = 0; k < N; ++k) {
        q[k] = add_bits<4>(q[k], words[0] >> (k * W));
        if constexpr (F::bits > 5) q[k] = add_bits<5>(q[k], words[1] >> (k * W));
      }
    }
  }
}

// y[r, j] = sum_i x[r, i] * w[j, i] for R input rows and weight rows [begin, end): per chunk of 32 values
// the weights are made float32 once, in registers, and multiplied into each row's two accumulators.
template <class F, int R>
void dot_rows(const float* x, int64_t in, const uint8_t* w, const Layout& l, float* out, int64_t out_features,
              int64_t begin, int64_t end) {
  const int64_t chunks = in / kChunk;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    prefetch_weights(row + kPrefetchAhead, l.row_bytes, limit);
    V acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const bool last = c0 / 8 == l.full;  // the short last span
      const SpanLayout& sl = last ? l.last : l.span;
      const uint8_t* sp = row + c0 / 8 * l.span.bytes;
      const int n = last ? static_cast<int>(l.tail) : 8;
      Span s;
      span_params<F>(sp, sl, n, s);
      for (int c = 0; c < n; ++c) {
        VI q[N];
        decode<F>(sp, sl, c, q);
        for (int k = 0; k < N; ++k) {
          const int g = F::group == 32 ? c : 2 * c + k * W / 16;
          const V wv = vfma(vfloat(q[k]), vset(s.a[g]), vset(s.b[g]));
          const float* xk = x + kChunk * (c0 + c) + k * W;
          for (int r = 0; r < R; ++r) acc[r][k & 1] = vfma(wv, vload(xk + r * in), acc[r][k & 1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_features + j] = vsum(vadd(acc[r][0], acc[r][1]));
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The offsets of R rows: sum over groups of b * (the inputs' sum over the group), per span of 8 groups in
// 8 float32 lanes, a short last span in scalars.
template <int R>
struct GroupOffsets {
  __m256 lanes[R];
  float tail[R];
  GroupOffsets() {
    for (int r = 0; r < R; ++r) lanes[r] = _mm256_setzero_ps(), tail[r] = 0.f;
  }
  // s.b of the span's n groups starting at group c0; sums [R, chunks]: each row's group sums.
  void add(const Span& s, const float* sums, int64_t chunks, int64_t c0, int n) {
    for (int r = 0; r < R; ++r) {
      const float* xs = sums + r * chunks + c0;
      if (n == 8) {
        lanes[r] = _mm256_fmadd_ps(_mm256_loadu_ps(s.b), _mm256_loadu_ps(xs), lanes[r]);
      } else {
        for (int g = 0; g < n; ++g) tail[r] += s.b[g] * xs[g];
      }
    }
  }
  float total(int r) const {
    __m128 o = _mm_add_ps(_mm256_castps256_ps128(lanes[r]), _mm256_extractf128_ps(lanes[r], 1));
    o = _mm_add_ps(o, _mm_movehl_ps(o, o));
    o = _mm_add_ss(o, _mm_movehdup_ps(o));
    return _mm_cvtss_f32(o) + tail[r];
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX512-BF16: the integers q (at most 8 bits) are exact in bfloat16, so one vdpbf16ps multiplies 32 of
// them by 32 bf16 inputs exactly and adds the products into 16 float32 lanes: the weights of a chunk
// become bf16 lanes by a table lookup (vpermw) on their 4-bit (5-, 6-bit) codes, the chunk's scale is
// applied to its float32 sums, and the offsets b * sum(x) of each group come from the inputs' group
// sums. A float32 input is split exactly into three bf16 parts (8 + 8 + 8 significant bits: x = h + m + l)
// multiplied in turn, so its products are exact too and only the float32 sums round.
#define KVREUSE_BF16_DOT 1

inline uint16_t bf16_bits(float exact) {
  uint32_t bits;
  std::memcpy(&bits, &exact, 4);
  return static_cast<uint16_t>(bits >> 16);  // exact for the small integers the tables hold
}

// 32 bf16 lanes: lane i holds value(i).
template <class Fn>
inline __m512i bf16_table(Fn value) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = bf16_bits(static_cast<float>(value(i)));
  return _mm512_load_si512(t);
}

// The tables that turn codes into bf16 values: lo for indices 0-31, hi for 32-63 (6-bit values).
template <class F>
struct Bf16Tables {
  __m512i lo, hi, shifts;
  Bf16Tables() {
    // The nibble lanes: 16 bytes widened twice, the second copy shifted right by 4 (the high halves).
    shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    if constexpr (F::bits == 8) {
      lo = bf16_table([](int i) { return i & 15; });                                // low nibble
      hi = bf16_table([](int i) { return 16 * ((i & 15) < 8 ? (i & 15) : (i & 15) - 16); });  // signed high
    } else if constexpr (F::bits == 4) {
      lo = bf16_table([](int i) { return level<F>(i & 15) - F::zero; });  // bit 4 of the index is not cleared
    } else {
      lo = bf16_table([](int i) { return i - F::zero; });
      hi = bf16_table([](int i) { return i + 32 - F::zero; });
    }
  }
};

// The bf16 weights of chunk c in value order (w[0]; for int8 values also w[1]: w[0] + w[1] = q).
template <class F>
inline void decode_bf16(const uint8_t* sp, const SpanLayout& l, int c, const Bf16Tables<F>& t, __m512i w[2]) {
  if constexpr (F::bits == 8) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + l.values + kChunk * c)));
    w[0] = _mm512_permutexvar_epi16(bytes, t.lo);
    w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), t.hi);
  } else {
    const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + l.values + kChunk / 2 * c));
    __m512i idx = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(b16)), t.shifts);
    if constexpr (F::bits == 4) {
      w[0] = _mm512_permutexvar_epi16(idx, t.lo);
    } else {
      uint32_t words[F::bits - 4];
      std::memcpy(words, sp + l.planes + 4 * (F::bits - 4) * c, sizeof(words));
      idx = _mm512_and_si512(idx, _mm512_set1_epi16(15));
      idx = _mm512_mask_add_epi16(idx, static_cast<__mmask32>(words[0]), idx, _mm512_set1_epi16(16));
      if constexpr (F::bits == 5) {
        w[0] = _mm512_permutexvar_epi16(idx, t.lo);
      } else {
        idx = _mm512_mask_add_epi16(idx, static_cast<__mmask32>(words[1]), idx, _mm512_set1_epi16(32));
        w[0] = _mm512_permutex2var_epi16(t.lo, idx, t.hi);
      }
    }
  }
}

inline __m512 dot_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// As dot_rows, over bf16 inputs: xh [R, in] (and, when Split, xm and xl [R, in]: a float32 input is
// xh + xm + xl exactly), xsum [R, chunks] the inputs' sum per chunk (for formats with offsets).
template <class F, int R, bool Split>
void dot_rows_bf16(const uint16_t* xh, const uint16_t* xm, const uint16_t* xl, const float* xsum, int64_t in,
                   const uint8_t* w, const Layout& l, float* out, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t chunks = in / kChunk;
  const Bf16Tables<F> tables;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    prefetch_weights(row + kPrefetchAhead, l.row_bytes, limit);
    __m512 even[R], odd[R];  // chunks alternate between two accumulators per row: two FMA chains
    GroupOffsets<R> offsets;
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const bool last = c0 / 8 == l.full;  // the short last span
      const SpanLayout& sl = last ? l.last : l.span;
      const uint8_t* sp = row + c0 / 8 * l.span.bytes;
      const int n = last ? static_cast<int>(l.tail) : 8;
      Span s;
      span_params<F>(sp, sl, n, s);
      const auto step = [&](int c, __m512 (&acc)[R]) {
        __m512i wv[2];
        decode_bf16<F>(sp, sl, c, tables, wv);
        __m512 scale;
        if constexpr (F::group == 32) {
          scale = _mm512_set1_ps(s.a[c]);
        } else {
          scale = _mm512_insertf32x8(_mm512_set1_ps(s.a[2 * c]), _mm256_set1_ps(s.a[2 * c + 1]), 1);
        }
        const int64_t at = kChunk * (c0 + c);
        for (int r = 0; r < R; ++r) {
          __m512 t = dot_bf16(_mm512_setzero_ps(), wv[0], xh + r * in + at);
          if constexpr (Split) t = dot_bf16(dot_bf16(t, wv[0], xm + r * in + at), wv[0], xl + r * in + at);
          if constexpr (F::bits == 8) {
            t = dot_bf16(t, wv[1], xh + r * in + at);
            if constexpr (Split) t = dot_bf16(dot_bf16(t, wv[1], xm + r * in + at), wv[1], xl + r * in + at);
          }
          acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        }
      };
      int c = 0;
      for (; c + 1 < n; c += 2) step(c, even), step(c + 1, odd);
      if (c < n) step(c, even);
      if constexpr (F::has_min) offsets.add(s, xsum, chunks, c0, n);
    }
    for (int r = 0; r < R; ++r) {
      float total = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
      if constexpr (F::has_min) total += offsets.total(r);
      out[r * out_features + j] = total;
    }
  }
}

template <class F, bool Split>
void dot_range_bf16(const uint16_t* xh, const uint16_t* xm, const uint16_t* xl, const float* xsum, int64_t rows,
                    int64_t in, const uint8_t* w, const Layout& l, float* out, int64_t out_features, int64_t begin,
                    int64_t end) {
  const int64_t chunks = in / kChunk;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const uint16_t* h = xh + r0 * in;
    const uint16_t* mid = Split ? xm + r0 * in : nullptr;
    const uint16_t* lo = Split ? xl + r0 * in : nullptr;
    const float* xs = xsum + r0 * chunks;
    float* o = out + r0 * out_features;
    with_rows(rows - r0, [&](auto r) {
      dot_rows_bf16<F, decltype(r)::value, Split>(h, mid, lo, xs, in, w, l, o, out_features, begin, end);
    });
  }
}
#endif


#if defined(__AVX2__)
// MXFP4's levels of 32 byte codes 0..15 (vpshufb looks up each 128-bit half in its own copy of the table).
inline __m256i mx_level_table() {
  alignas(32) static const int8_t table[32] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                               12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(table));
}
inline __m256i mx_levels(__m256i codes) { return _mm256_shuffle_epi8(mx_level_table(), codes); }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX512-VNNI over int8 activations, as llama.cpp multiplies its quantized files: each input row is rounded
// per chunk of 32 values to int8 codes with one float32 scale (amax / 127), and vpdpbusd multiplies 64
// unsigned bytes by 64 signed bytes into 16 int32 lanes, exactly. A pair of chunks shares one instruction;
// the int32 sums become float32 once per pair, times the weight's and the input's scales. 8-bit weights
// are the signed operand and the inputs go unsigned (code + 128; the 128 * sum(w) this adds is taken
// back per lane); 4-bit weights are the unsigned operand as stored, their offsets b * sum(x) per group
// come from the rounded inputs' group sums. Formats: q8_0, q4_0, q4_1, mxfp4, q4_k (5- and 6-bit codes stay on
// the bf16 kernel). Only the inputs round: 7 bits plus sign against each chunk's largest value.
#define KVREUSE_INT8_DOT 1
#define KVREUSE_BLOCKED_INT8 1

template <class F>
constexpr bool int8_dot_format() {
  return F::bits == 8 || (F::bits == 4 && F::group == 32) || F::kquant;
}

// The values per input scale qlinear_int8 rounds with: K-quants go per super-block (below), the rest per chunk.
template <class F>
constexpr int64_t int8_input_group() {
  return F::kquant ? kSuper : kChunk;
}

// Chunks per step of the int8 kernels: 8-bit weights go two chunks to a 64-byte register, 4-bit ones four (their
// 64 packed bytes as two registers, low nibbles and high nibbles, whose int32 lanes sum the same chunks, so the
// two products add as integers and become float32 once per four chunks).
template <class F>
constexpr int step_chunks() {
  return F::bits == 8 ? 2 : 4;
}

// The weight bytes of 8-bit chunks c and c + 1 of a span (c + 1 < n, else the second half zero).
template <class F>
inline __m512i pair_codes(const uint8_t* sp, const SpanLayout& l, int c, bool both) {
  const uint8_t* v = sp + l.values + kChunk * c;
  return both ? _mm512_loadu_si512(v) : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
}

// 4-bit chunks c .. c + count - 1 (count <= 4; the rest zero codes): low nibbles (values 0-15 of each chunk, 16
// bytes a chunk) and high nibbles (values 16-31), as unsigned levels (MXFP4's through its table).
template <class F>
inline void quad_codes(const uint8_t* sp, const SpanLayout& l, int c, int count, __m512i& low, __m512i& high) {
  const uint8_t* v = sp + l.values + kChunk / 2 * c;
  const __m512i b = count == 4 ? _mm512_loadu_si512(v) : _mm512_maskz_loadu_epi8((1ull << (16 * count)) - 1, v);
  const __m512i nibble = _mm512_set1_epi8(15);
  low = _mm512_and_si512(b, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
  if constexpr (F::mx) {  // a 16-entry table per 128-bit lane
    const __m512i table = _mm512_broadcast_i32x4(_mm256_castsi256_si128(mx_level_table()));
    low = _mm512_shuffle_epi8(table, low);
    high = _mm512_shuffle_epi8(table, high);
  }
}

// Which chunk of a step each int32 lane sums: 8-bit [c x8, c+1 x8]; 4-bit [c x4, c+1 x4, c+2 x4, c+3 x4].
template <class F>
inline __m512i step_lane_chunk() {
  if constexpr (F::bits == 8) return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
}

// The rows' int8 codes, per step of chunks in the weights' lane order (missing chunks of a last step zero):
// 8-bit, 64 bytes a pair, unsigned (code + 128); 4-bit, 128 bytes a quad, values 0-15 of its four chunks then
// values 16-31. Per step 16 float32 lane scales (the chunk's scale in each lane that sums it); per chunk the
// sum of its values as rounded (scale * sum of codes).
struct QuantizedRows {
  int64_t steps = 0;
  std::vector<uint8_t> codes;
  std::vector<float> lane_scales, sums;
  std::vector<int32_t> lane_bias;  // zero_in_sums formats: -zero * (the chunk's code sum), per step, in lane 4i of chunk i
};

// 4-bit formats whose value is (level - zero) * scale with an integer zero (q4_0, MXFP4): the zero is taken
// in the int32 sums (-zero * the chunk's input code sum, one lane per chunk), so a chunk's four lanes sum its
// exact integer product and no float offsets are kept per group.
template <class F>
constexpr bool zero_in_sums() {
  return F::bits == 4 && !F::kquant && !F::has_min;
}

template <class F>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t rows, int64_t in) {
  QuantizedRows q;
  constexpr int per = step_chunks<F>(), step_bytes = per * kChunk;
  const int64_t chunks = in / kChunk;
  q.steps = (chunks + per - 1) / per;
  q.codes.assign(rows * q.steps * step_bytes, F::bits == 8 ? 128 : 0);
  q.lane_scales.assign(rows * q.steps * 16, 0.f);
  q.sums.assign(rows * chunks, 0.f);
  if constexpr (zero_in_sums<F>()) q.lane_bias.assign(rows * q.steps * 16, 0);
  const FloatRows xf(x);
  const float* xp = xf.data();
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* v = xp + r * in + c * kChunk;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign_off), _mm512_and_ps(v1, sign_off)));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      // Rounded to nearest even (the default MXCSR mode), as std::nearbyint would.
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1);  // |code| <= 127: exact
      const int i = static_cast<int>(c % per);
      uint8_t* out = q.codes.data() + (r * q.steps + c / per) * step_bytes;
      if constexpr (F::bits == 8) {  // unsigned: code + 128
        b0 = _mm_xor_si128(b0, _mm_set1_epi8(static_cast<char>(0x80)));
        b1 = _mm_xor_si128(b1, _mm_set1_epi8(static_cast<char>(0x80)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i * 32), b0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i * 32 + 16), b1);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * i), b0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 + 16 * i), b1);
      }
      // The chunk's scale in the lanes that sum it.
      float* scales = q.lane_scales.data() + (r * q.steps + c / per) * 16;
      const __mmask16 mine = _mm512_cmpeq_epi32_mask(step_lane_chunk<F>(), _mm512_set1_epi32(i));
      _mm512_storeu_ps(scales, _mm512_mask_mov_ps(_mm512_loadu_ps(scales), mine, _mm512_set1_ps(d)));
      q.sums[r * chunks + c] = d * static_cast<float>(total);
      if constexpr (zero_in_sums<F>()) q.lane_bias[(r * q.steps + c / per) * 16 + 4 * i] = -F::zero * total;
    }
  }
  return q;
}

// q4_1 (a float offset per group, so no integer zero): one weight row at a time, the offsets b * sum(x) per group.
template <class F, int R>
void dot_rows_int8(const QuantizedRows& q, int64_t r0, int64_t in, const uint8_t* w, const Layout& l, float* out,
                   int64_t out_features, int64_t begin, int64_t end) {
  static_assert(F::bits == 4 && F::has_min, "q8_0, q4_0 and MXFP4 run dot_rows_int8_blocked");
  constexpr int per = step_chunks<F>(), step_bytes = per * kChunk;
  const int64_t chunks = in / kChunk;
  const __m512i lane_chunk = step_lane_chunk<F>();
  const uint8_t* codes = q.codes.data() + r0 * q.steps * step_bytes;
  const float* lane_scales = q.lane_scales.data() + r0 * q.steps * 16;
  const float* sums = q.sums.data() + r0 * chunks;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    prefetch_weights(row + kPrefetchAhead, l.row_bytes, limit);
    __m512 even[R], odd[R];
    GroupOffsets<R> offsets;
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const bool last = c0 / 8 == l.full;  // the short last span
      const SpanLayout& sl = last ? l.last : l.span;
      const uint8_t* sp = row + c0 / 8 * l.span.bytes;
      const int n = last ? static_cast<int>(l.tail) : 8;
      Span s;
      if (n < 8) std::fill(std::begin(s.a), std::end(s.a), 0.f);  // lanes of missing chunks: zero, not garbage
      span_params<F>(sp, sl, n, s);
      const __m512 a = _mm512_loadu_ps(s.a);  // lanes past n unused
      // The int32 sums of step c (chunks c ..), their float32 scales applied, into acc.
      const auto step = [&](int c, __m512 (&acc)[R]) {
        const int64_t at = (c0 + c) / per;
        const __m512 wscale = _mm512_permutexvar_ps(_mm512_add_epi32(lane_chunk, _mm512_set1_epi32(c)), a);
        __m512i low, high;
        quad_codes<F>(sp, sl, c, std::min(4, n - c), low, high);
        for (int r = 0; r < R; ++r) {
          const uint8_t* xr = codes + (r * q.steps + at) * step_bytes;
          const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xr)),
                                                high, _mm512_loadu_si512(xr + 64));
          const __m512 scale = _mm512_mul_ps(wscale, _mm512_loadu_ps(lane_scales + (r * q.steps + at) * 16));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[r]);
        }
      };
      int c = 0;
      for (; c + per < n; c += 2 * per) step(c, even), step(c + per, odd);
      for (; c < n; c += per) step(c, even);
      offsets.add(s, sums, chunks, c0, n);  // q4_1's offsets: b * sum(x) per group
    }
    for (int r = 0; r < R; ++r) {
      const float total = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
      out[r * out_features + j] = total + offsets.total(r);
    }
  }
}


// The blocked kernel (q8_0, q4_0, MXFP4): J weight rows at once against R input rows, so one input row's
// codes, lane scales and biases are loaded once per step for J weight rows, each row keeps one accumulator
// chain (J independent chains in flight, not one per row), and J rows' sums reduce together. A span's chunk
// scales are made once into 8 float32 lanes (MXFP4: its exponents e - 128, applied with vscalefps, which is
// the product with the exact 2^(e - 128) that e8m0_half gives, rounded once, as before) and permuted per step.
// q4_0 and MXFP4 keep their zero in the int32 sums (zero_in_sums). Decode products are this kernel's: one
// stream multiplies one input row, and the per-row work of dot_rows_int8 (offsets per span, a horizontal sum
// per row, a span's scales through memory) cost as much as the products on gpt-oss's [384, 1024] experts.
template <class F>
constexpr bool blocked_int8_format() {
  return F::bits == 8 || zero_in_sums<F>();
}

// A span's n chunk scales in float32 lanes 0 .. n - 1 (the rest 0): fp16 scales as floats, MXFP4's E8M0
// bytes e as the float e - 128 (its scale is 2^(e - 128)).
template <class F>
inline __m512 span_scales(const uint8_t* sp, const SpanLayout& l, int n) {
  if constexpr (F::mx) {
    const __m128i e = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), sp + l.scales);
    const __m512i lanes = _mm512_sub_epi32(_mm512_cvtepu8_epi32(e), _mm512_set1_epi32(128));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), _mm512_cvtepi32_ps(lanes));
  } else {
    const __m128i halves = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), sp + l.scales);
    return _mm512_cvtph_ps(_mm256_zextsi128_si256(halves));
  }
}

// Lane scales of a step: the input's (per lane) times the weight's (permuted to the lanes that sum its chunk).
template <class F>
inline __m512 step_scale(__m512 input, __m512 weight) {
  if constexpr (F::mx) return _mm512_scalef_ps(input, weight);
  return _mm512_mul_ps(input, weight);
}

// The float sums of J accumulators into out[0 .. J): one tree for every J (halves 256, then pairs of
// neighbours twice, then halves 128), so a row's sum has the same bits whichever block it was in.
template <int J>
inline void reduce_rows(const __m512 (&acc)[J], float* out) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 a = acc[i < J ? i : 0];
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
  if constexpr (J == 4) {
    _mm_storeu_ps(out, sums);
  } else {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sums);
    for (int i = 0; i < J; ++i) out[i] = lanes[i];
  }
}

template <class F, int R, int J>
void dot_rows_int8_blocked(const QuantizedRows& q, int64_t r0, int64_t in, const uint8_t* w, const Layout& l,
                           float* out, int64_t out_features, int64_t j) {
  static_assert(blocked_int8_format<F>());
  constexpr int per = step_chunks<F>(), step_bytes = per * kChunk;
  const int64_t chunks = in / kChunk;
  const __m512i lane_chunk = step_lane_chunk<F>();
  const __m512i ones_128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* codes = q.codes.data() + r0 * q.steps * step_bytes;
  const float* lane_scales = q.lane_scales.data() + r0 * q.steps * 16;
  const int32_t* bias = zero_in_sums<F>() ? q.lane_bias.data() + r0 * q.steps * 16 : nullptr;
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < J; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
    const bool last = c0 / 8 == l.full;  // the short last span
    const SpanLayout& sl = last ? l.last : l.span;
    const int n = last ? static_cast<int>(l.tail) : 8;
    const uint8_t* sp[J];
    __m512 scales[J];
    for (int i = 0; i < J; ++i) {
      sp[i] = w + (j + i) * l.row_bytes + c0 / 8 * l.span.bytes;
      scales[i] = span_scales<F>(sp[i], sl, n);
    }
    for (int c = 0; c < n; c += per) {
      const int64_t at = (c0 + c) / per;
      const __m512i lanes = _mm512_add_epi32(lane_chunk, _mm512_set1_epi32(c));
      __m512i wv[J][2];
      __m512 ws[J];
      for (int i = 0; i < J; ++i) {
        ws[i] = _mm512_permutexvar_ps(lanes, scales[i]);
        if constexpr (F::bits == 8) {
          wv[i][0] = pair_codes<F>(sp[i], sl, c, c + 1 < n);
          // -128 * sum(w) per lane: the inputs go unsigned (code + 128).
          wv[i][1] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones_128, wv[i][0]));
        } else {
          quad_codes<F>(sp[i], sl, c, std::min(4, n - c), wv[i][0], wv[i][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = codes + (r * q.steps + at) * step_bytes;
        const __m512 xs = _mm512_loadu_ps(lane_scales + (r * q.steps + at) * 16);
        if constexpr (F::bits == 8) {
          const __m512i xv = _mm512_loadu_si512(xr);
          for (int i = 0; i < J; ++i) {
            const __m512i t = _mm512_dpbusd_epi32(wv[i][1], xv, wv[i][0]);
            acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step_scale<F>(xs, ws[i]), acc[r][i]);
          }
        } else {
          const __m512i xlo = _mm512_loadu_si512(xr), xhi = _mm512_loadu_si512(xr + 64);
          const __m512i b = _mm512_loadu_si512(bias + (r * q.steps + at) * 16);
          for (int i = 0; i < J; ++i) {
            const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(b, wv[i][0], xlo), wv[i][1], xhi);
            acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step_scale<F>(xs, ws[i]), acc[r][i]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) reduce_rows<J>(acc[r], out + r * out_features + j);
}

// Weight rows [begin, end) for R input rows: blocks of J (4 for one input row, 2 for two, else 1), then
// the rest one at a time (the same bits: reduce_rows).
template <class F, int R>
void dot_span_int8_blocked(const QuantizedRows& q, int64_t r0, int64_t in, const uint8_t* w, const Layout& l,
                           float* out, int64_t out_features, int64_t begin, int64_t end) {
  constexpr int J = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t j = begin;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (; j + J <= end; j += J) {
    prefetch_weights(w + j * l.row_bytes + kPrefetchAhead, J * l.row_bytes, limit);
    dot_rows_int8_blocked<F, R, J>(q, r0, in, w, l, out, out_features, j);
  }
  for (; j < end; ++j) dot_rows_int8_blocked<F, R, 1>(q, r0, in, w, l, out, out_features, j);
}

#define KVREUSE_KQUANT_DOT 1
// K-quants (q4_k, q5_k, q6_k) as llama.cpp multiplies them (its q8_K inputs): the inputs are rounded per
// super-block of 256 values with one float32 scale, so a weight row's products stay integers over the
// whole super-block and become float32 once per super-block, not once per pair of chunks. Per pair of
// chunks: the weight codes unpacked as stored (unsigned, 0..2^bits - 1, the planes' high bits added
// under a byte mask), vpmaddubsw with the int8 inputs (pairs summed into int16, exactly: at most
// 2 * 63 * 127), and vpdpwssd with each group's 6- or 8-bit scale code, which multiplies and widens into
// int32 lanes in one instruction (at most 16.3 M per lane a super-block: exact, and exact in float32).
// The offsets (Q4_K/Q5_K's dmin * min per group, Q6_K's -32 * code) multiply the inputs' integer sums per
// group. This is about half the instructions of the per-chunk path above, where the one-row products of
// the 4- to 6-bit formats were compute-bound (8-9 GB/s a core on the AVX-512 EPYC).
struct QuantizedSpans {
  int64_t spans = 0;
  std::vector<int8_t> codes;     // [rows, spans, 4 pairs, 64]: each pair in pair_codes' 4-bit lane order
  std::vector<float> scales;     // [rows, spans]
  std::vector<int16_t> sums16;   // [rows, spans, 16]: the codes' sum over values 16g .. 16g + 15
  std::vector<int16_t> sums32;   // [rows, spans, 8]: over chunk g's 32 values
};

inline QuantizedSpans quantize_spans(const at::Tensor& x, int64_t rows, int64_t in) {
  QuantizedSpans q;
  q.spans = in / kSuper;
  q.codes.assign(rows * in, 0);
  q.scales.assign(rows * q.spans, 0.f);
  q.sums16.assign(rows * q.spans * 16, 0);
  q.sums32.assign(rows * q.spans * 8, 0);
  const FloatRows xf(x);
  const float* xp = xf.data();
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t s = 0; s < q.spans; ++s) {
      const float* v = xp + r * in + s * kSuper;
      __m512 m = _mm512_setzero_ps();
      for (int k = 0; k < 16; ++k) m = _mm512_max_ps(m, _mm512_and_ps(_mm512_loadu_ps(v + 16 * k), magnitude));
      const float amax = _mm512_reduce_max_ps(m);
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t at = r * q.spans + s;
      q.scales[at] = d;
      int8_t* out = q.codes.data() + at * kSuper;
      for (int k = 0; k < 16; ++k) {  // values 16k .. 16k + 15: half h of chunk c
        // Rounded to nearest even (the default MXCSR mode), as std::nearbyint would.
        const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * k), _mm512_set1_ps(id)));
        const int c = k / 2, h = k % 2;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (c / 2) * 64 + h * 32 + (c % 2) * 16),
                         _mm512_cvtepi32_epi8(codes));  // |code| <= 127: exact
        const int32_t total = _mm512_reduce_add_epi32(codes);
        q.sums16[at * 16 + k] = static_cast<int16_t>(total);
        q.sums32[at * 8 + c] = static_cast<int16_t>(q.sums32[at * 8 + c] + total);
      }
    }
  }
  return q;
}

template <class F, int R>
void dot_rows_kquant(const QuantizedSpans& q, int64_t r0, const uint8_t* w, const Layout& l, float* out,
                     int64_t out_features, int64_t begin, int64_t end) {
  static_assert(F::kquant && F::bits < 8);
  const int64_t spans = q.spans;
  const SpanLayout& sl = l.span;  // K-quant rows are whole super-blocks
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i nibble = _mm512_set1_epi8(15);
  // The int16 lanes of pair p take group code idx[p]: lanes 0-7 chunk 2p's values 0-15, 8-15 chunk
  // 2p + 1's, 16-23 chunk 2p's values 16-31, 24-31 chunk 2p + 1's; 16-value groups: two per chunk.
  __m512i idx[4];
  for (int p = 0; p < 4; ++p) {
    alignas(64) int16_t lanes[32];
    for (int k = 0; k < 32; ++k) {
      const int c = 2 * p + (k / 8) % 2, half = k / 16;
      lanes[k] = static_cast<int16_t>(F::group == 32 ? c : 2 * c + half);
    }
    idx[p] = _mm512_load_si512(lanes);
  }
  // The high-bit planes as byte masks in pair_codes' lane order, for all four pairs of a super-block in one
  // 16-bit permutation of its plane words (pair_plane_mask's shuffle, done in a vector, not per pair in
  // scalar code, which cost Q6_K a third of its time): mask 2p + k is pair p's plane k (Q5_K: mask p).
  // Planes are a 32-bit word per chunk and plane, chunk-major; in 16-bit halves, chunk c's plane k is
  // (c * planes + k) * 2 (low) and + 1 (high); the mask of chunks c, c + 1 is [c lo, c+1 lo, c hi, c+1 hi].
  constexpr int planes = F::bits - 4;
  __m512i plane_order = _mm512_setzero_si512();
  if constexpr (planes > 0) {
    alignas(64) int16_t order[32] = {};
    for (int p = 0; p < 4; ++p) {
      for (int k = 0; k < planes; ++k) {
        const int c = 2 * p, word = (p * planes + k) * 4;
        order[word + 0] = static_cast<int16_t>((c * planes + k) * 2);
        order[word + 1] = static_cast<int16_t>(((c + 1) * planes + k) * 2);
        order[word + 2] = static_cast<int16_t>((c * planes + k) * 2 + 1);
        order[word + 3] = static_cast<int16_t>(((c + 1) * planes + k) * 2 + 1);
      }
    }
    plane_order = _mm512_load_si512(order);
  }
  const int8_t* codes = q.codes.data() + r0 * spans * kSuper;
  const float* xscales = q.scales.data() + r0 * spans;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    prefetch_weights(row + kPrefetchAhead, l.row_bytes, limit);
    __m512 acc[R];
    __m256 offset[R];  // per lane, summed once per row (not a horizontal sum per super-block)
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), offset[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < spans; ++s) {
      const uint8_t* sp = row + s * sl.bytes;
      const float d = half_at(sp + sl.d);
      alignas(64) uint64_t masks[8];
      if constexpr (planes == 2) {
        _mm512_store_si512(masks, _mm512_permutexvar_epi16(plane_order, _mm512_loadu_si512(sp + sl.planes)));
      } else if constexpr (planes == 1) {
        const __m512i words = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + sl.planes)));
        _mm512_store_si512(masks, _mm512_permutexvar_epi16(plane_order, words));
      }
      __m512i sc;  // the group codes as int16
      if constexpr (F::group == 32) {
        sc = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + sl.scales))));
      } else {
        sc = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + sl.scales))));
      }
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + sl.values + 32 * p));
        __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(packed), shifts), nibble);
        if constexpr (planes == 1) {
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(masks[p]), wv, _mm512_set1_epi8(16));
        } else if constexpr (planes == 2) {
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(masks[2 * p]), wv, _mm512_set1_epi8(16));
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(masks[2 * p + 1]), wv, _mm512_set1_epi8(32));
        }
        const __m512i scale = _mm512_permutexvar_epi16(idx[p], sc);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512(codes + ((r * spans + s) * 4 + p) * 64);
          sums[r] = _mm512_dpwssd_epi32(sums[r], _mm512_maddubs_epi16(wv, xv), scale);
        }
      }
      // The offsets: Q4_K / Q5_K's - dmin * sum over chunks of min * (the inputs' sum over the chunk); Q6_K's
      // values are (q - 32) * code, so - 32 * d * sum over groups of code * (the inputs' group sum).
      const float factor = F::has_min ? half_at(sp + sl.dmin) : static_cast<float>(F::zero) * d;
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * spans + s;
        const float xs = xscales[r * spans + s];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(d * xs), acc[r]);
        // The group products as int32 lanes (exact: at most 8 * 127 * 2,032), made float32 exactly, scaled.
        __m256 m;
        if constexpr (F::has_min) {  // four lanes, the upper four zero
          m = _mm256_zextps128_ps256(_mm_cvtepi32_ps(
              _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + sl.mins))),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(q.sums32.data() + at * 8)))));
        } else {
          m = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm512_castsi512_si256(sc),
                                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.sums16.data() + at * 16))));
        }
        offset[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(-factor * xs), offset[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 o = offset[r];
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[r * out_features + j] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(h);
    }
  }
}

// Rows [first, first + rows) of q against weight rows [begin, end); out points at row `first`'s outputs.
template <class F>
void dot_range_kquant(const QuantizedSpans& q, int64_t first, int64_t rows, const uint8_t* w, const Layout& l,
                      float* out, int64_t out_features, int64_t begin, int64_t end) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    float* o = out + r0 * out_features;
    with_rows(rows - r0, [&](auto r) {
      dot_rows_kquant<F, decltype(r)::value>(q, first + r0, w, l, o, out_features, begin, end);
    });
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 over int8 activations, for CPUs without VNNI (llama.cpp's AVX2 arithmetic): the inputs are rounded
// as on VNNI (per chunk of 32 values, one float32 scale amax / 127, codes -127..127), kept in value order,
// and one chunk is a step: vpmaddubsw multiplies 32 unsigned bytes by 32 signed bytes into 16 int16 sums
// of pairs, exactly (at most 2 * 128 * 127 = 32,512 in magnitude), and vpmaddwd by ones widens them to 8
// int32 lanes, which become float32 once per chunk, times the weight's and the input's scales. 8-bit
// weights go as |w| against x * sign(w) (vpsignb); 4-bit codes are unsigned as stored, their offsets
// b * sum(x) per group from the rounded inputs' group sums. 5- and 6-bit codes get their high bits from
// the planes, one byte per bit (a shuffle, an and, a compare); Q6_K's groups of 16 values go signed
// (q - 32, as 8-bit weights go) with each group's scale in the four int32 lanes that sum it, so every
// format runs here, not only VNNI's four (the int32 sums are exact either way; only the float32
// additions' order differs).
#define KVREUSE_INT8_DOT 1

template <class F>
constexpr bool int8_dot_format() {
  return F::group == 32 || (F::bits == 6 && F::group == 16 && !F::has_min);
}

template <class F>
constexpr int64_t int8_input_group() {
  return kChunk;
}

// Weights multiplied as signed bytes (|w| against x * sign(w)): 8-bit codes, and Q6_K's q - 32, whose
// 16-value groups the per-group offsets below cannot express.
template <class F>
constexpr bool signed_weights() {
  return F::bits == 8 || F::group == 16;
}

// 32 bytes, byte i 0xFF where bit i of word is set (else 0).
inline __m256i bytes_of_bits(uint32_t word) {
  const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word)), which);
  return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

// Chunk c of a span as 32 bytes in value order: 8-bit codes as stored (signed), 4- to 6-bit codes
// unsigned 0..2^bits - 1, or q - zero for signed_weights.
template <class F>
inline __m256i chunk_bytes(const uint8_t* sp, const SpanLayout& sl, int c) {
  if constexpr (F::bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + sl.values + kChunk * c));
  } else {  // byte i holds value i low and value i + 16 high
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + sl.values + kChunk / 2 * c));
    __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
    if constexpr (F::mx) wv = mx_levels(wv);
    if constexpr (F::bits > 4) {
      uint32_t words[F::bits - 4];
      std::memcpy(words, sp + sl.planes + 4 * (F::bits - 4) * c, sizeof(words));
      wv = _mm256_or_si256(wv, _mm256_and_si256(bytes_of_bits(words[0]), _mm256_set1_epi8(16)));
      if constexpr (F::bits > 5) wv = _mm256_or_si256(wv, _mm256_and_si256(bytes_of_bits(words[1]), _mm256_set1_epi8(32)));
    }
    if constexpr (signed_weights<F>()) wv = _mm256_sub_epi8(wv, _mm256_set1_epi8(static_cast<char>(F::zero)));
    return wv;
  }
}

inline float sum8(__m256 v) {  // (vsum is the 16-lane one where AVX-512 without VNNI is built)
  __m128 o = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  o = _mm_add_ps(o, _mm_movehl_ps(o, o));
  o = _mm_add_ss(o, _mm_movehdup_ps(o));
  return _mm_cvtss_f32(o);
}

struct QuantizedRows {
  std::vector<int8_t> codes;        // [rows, in]: the inputs' int8 codes, in value order
  std::vector<float> scales, sums;  // [rows, chunks]: each chunk's scale, and its values' sum as rounded
};

template <class F>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t rows, int64_t in) {
  QuantizedRows q;
  const int64_t chunks = in / kChunk;
  q.codes.resize(rows * in);
  q.scales.resize(rows * chunks);
  q.sums.resize(rows * chunks);
  const FloatRows xf(x);
  const float* xp = xf.data();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // vpackssdw / vpacksswb interleave the two 128-bit halves; this puts the 4-byte groups back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* v = xp + r * in + c * kChunk;
      __m256 vs[4];
      for (int k = 0; k < 4; ++k) vs[k] = _mm256_loadu_ps(v + 8 * k);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(vs[0], magnitude), _mm256_and_ps(vs[1], magnitude)),
                                     _mm256_max_ps(_mm256_and_ps(vs[2], magnitude), _mm256_and_ps(vs[3], magnitude)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      __m256i i[4];
      // Rounded to nearest even (the default MXCSR mode), as std::nearbyint would.
      for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(vs[k], _mm256_set1_ps(id)));
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      const int32_t total = _mm_cvtsi128_si32(s4);
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.codes.data() + r * in + c * kChunk),
                          _mm256_permutevar8x32_epi32(packed, order));  // |code| <= 127: packing is exact
      q.scales[r * chunks + c] = d;
      q.sums[r * chunks + c] = d * static_cast<float>(total);
    }
  }
  return q;
}

template <class F, int R>
void dot_rows_int8(const QuantizedRows& q, int64_t r0, int64_t in, const uint8_t* w, const Layout& l, float* out,
                   int64_t out_features, int64_t begin, int64_t end) {
  const int64_t chunks = in / kChunk;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* codes = q.codes.data() + r0 * in;
  const float* scales = q.scales.data() + r0 * chunks;
  const float* sums = q.sums.data() + r0 * chunks;
  const uint8_t* limit = w + out_features * l.row_bytes;  // the weight's end
  prefetch_weights(w + begin * l.row_bytes, kPrefetchAhead, limit);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    prefetch_weights(row + kPrefetchAhead, l.row_bytes, limit);
    // Even and odd chunks add into their own accumulators where registers allow (one or two rows: a
    // decode step's products), so a row's chunks are not one chain of FMAs each waiting for the last.
    __m256 even[R], odd[R];
    GroupOffsets<R> offsets;
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const bool last = c0 / 8 == l.full;  // the short last span
      const SpanLayout& sl = last ? l.last : l.span;
      const uint8_t* sp = row + c0 / 8 * l.span.bytes;
      const int n = last ? static_cast<int>(l.tail) : 8;
      Span s;
      span_params<F>(sp, sl, n, s);
      const auto step = [&](int c, __m256 (&acc)[R]) {
        const __m256i wv = chunk_bytes<F>(sp, sl, c);
        const __m256i unsigned_w = signed_weights<F>() ? _mm256_sign_epi8(wv, wv) : wv;  // |-128| reads as 128
        const int64_t chunk = c0 + c;
        for (int r = 0; r < R; ++r) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * in + chunk * kChunk));
          if constexpr (signed_weights<F>()) xv = _mm256_sign_epi8(xv, wv);
          const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_w, xv), ones);
          const float xs = scales[r * chunks + chunk];
          __m256 scale;
          if constexpr (F::group == 16) {  // lanes 0-3 sum values 0-15 (group 2c), lanes 4-7 values 16-31
            scale = _mm256_set_m128(_mm_set1_ps(s.a[2 * c + 1] * xs), _mm_set1_ps(s.a[2 * c] * xs));
          } else {
            scale = _mm256_set1_ps(s.a[c] * xs);
          }
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[r]);
        }
      };
      int c = 0;
      for (; c + 1 < n; c += 2) {
        step(c, even);
        step(c + 1, R <= 2 ? odd : even);
      }
      if (c < n) step(c, even);
      // Unsigned codes: b * sum(x) per group (signed ones carry their zero in the codes).
      if constexpr (!signed_weights<F>()) offsets.add(s, sums, chunks, c0, n);
    }
    for (int r = 0; r < R; ++r) {
      float total = sum8(R <= 2 ? _mm256_add_ps(even[r], odd[r]) : even[r]);
      if constexpr (!signed_weights<F>()) total += offsets.total(r);
      out[r * out_features + j] = total;
    }
  }
}
#endif

#if defined(KVREUSE_INT8_DOT)
// Rows [first, first + rows) of q against weight rows [begin, end); out points at row `first`'s outputs.
template <class F>
void dot_range_int8(const QuantizedRows& q, int64_t first, int64_t rows, int64_t in, const uint8_t* w, const Layout& l,
                    float* out, int64_t out_features, int64_t begin, int64_t end) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    float* o = out + r0 * out_features;
    with_rows(rows - r0, [&](auto r) {
#if defined(KVREUSE_BLOCKED_INT8)
      if constexpr (blocked_int8_format<F>()) {
        dot_span_int8_blocked<F, decltype(r)::value>(q, first + r0, in, w, l, o, out_features, begin, end);
      } else
#endif
      {
        dot_rows_int8<F, decltype(r)::value>(q, first + r0, in, w, l, o, out_features, begin, end);
      }
    });
  }
}
#endif

template <class F>
void dot_range(const float* x, int64_t rows, int64_t in, const uint8_t* w, const Layout& l, float* out,
               int64_t out_features, int64_t begin, int64_t end) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const float* xr = x + r0 * in;
    float* o = out + r0 * out_features;
    with_rows(rows - r0, [&](auto r) { dot_rows<F, decltype(r)::value>(xr, in, w, l, o, out_features, begin, end); });
  }
}

// float32 values of weight rows [begin, end): fma(q, a, b), or (q - zero) * a without an offset, which is
// gguf's own arithmetic (a * q is exact), signed zeros included.
template <class F>
void dequant_range(const uint8_t* w, const Layout& l, int64_t in, float* out, int64_t begin, int64_t end) {
  const int64_t chunks = in / kChunk;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    float* o = out + j * in;
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const bool last = c0 / 8 == l.full;  // the short last span
      const SpanLayout& sl = last ? l.last : l.span;
      const uint8_t* sp = row + c0 / 8 * l.span.bytes;
      const int n = last ? static_cast<int>(l.tail) : 8;
      Span s;
      span_params<F>(sp, sl, n, s);
      for (int c = 0; c < n; ++c) {
        VI q[N];
        decode<F>(sp, sl, c, q);
        for (int k = 0; k < N; ++k) {
          const int g = F::group == 32 ? c : 2 * c + k * W / 16;
          V value;
          if constexpr (F::has_min) {
            value = vfma(vfloat(q[k]), vset(s.a[g]), vset(s.b[g]));
          } else {
            value = vmul(vsub(vfloat(q[k]), vset(static_cast<float>(F::zero))), vset(s.a[g]));
          }
          vstore(o + kChunk * (c0 + c) + k * W, value);
        }
      }
    }
  }
}

// Calls fn.template operator()<Fmt<code>>() for a runtime format code.
template <class Fn>
void with_format(int64_t code, Fn&& fn) {
  switch (code) {
    case kQ8_0: fn(Fmt<kQ8_0>{}); break;
    case kQ4_0: fn(Fmt<kQ4_0>{}); break;
    case kQ4_1: fn(Fmt<kQ4_1>{}); break;
    case kQ5_0: fn(Fmt<kQ5_0>{}); break;
    case kQ5_1: fn(Fmt<kQ5_1>{}); break;
    case kQ4_K: fn(Fmt<kQ4_K>{}); break;
    case kQ5_K: fn(Fmt<kQ5_K>{}); break;
    case kQ6_K: fn(Fmt<kQ6_K>{}); break;
    case kMXFP4: fn(Fmt<kMXFP4>{}); break;
    default: TORCH_CHECK(false, "unknown quantized format ", code);
  }
}

// Checks what every op needs of a weight: a known format, a width it allows, uint8 rows of that format.
Layout checked_layout(const char* op, const at::Tensor& weight, int64_t format, int64_t in) {
  TORCH_CHECK(format >= 0 && format <= kLastFormat, op, ": unknown format ", format,
              " (0-8: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, mxfp4)");
  TORCH_CHECK(weight.device().is_cpu(), op, ": weight must be a CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, op, ": weight must be uint8 [out, row bytes], got ",
              weight.scalar_type(), " ", weight.sizes());
  Layout l;
  int64_t block = 0;
  with_format(format, [&](auto f) {
    using F = decltype(f);
    block = F::block;
    if (in > 0 && in % F::block == 0) l = layout_of<F>(in);
  });
  TORCH_CHECK(in > 0 && in % block == 0, op, ": ", kNames[format], " needs in_features a positive multiple of ", block,
              ", got ", in);
  TORCH_CHECK(weight.size(1) == l.row_bytes, op, ": a ", kNames[format], " row of ", in, " features has ", l.row_bytes,
              " bytes, weight rows have ", weight.size(1));
  return l;
}

// Checks what a grouped product needs (one row count per weight, counts adding up to x's rows, one output
// width) and returns each weight's layout; first[g]: group g's first row.
std::vector<Layout> checked_groups(const char* op, const at::Tensor& x, c10::IntArrayRef group_rows,
                                   at::TensorList weights, int64_t format, int64_t in, std::vector<int64_t>& first) {
  TORCH_CHECK(!weights.empty() && group_rows.size() == weights.size(), op, ": one row count per weight, got ",
              group_rows.size(), " row counts and ", weights.size(), " weights");
  std::vector<Layout> layouts;
  for (const at::Tensor& w : weights) {
    layouts.push_back(checked_layout(op, w, format, in));
    TORCH_CHECK(w.size(0) == weights[0].size(0), op, ": every weight must have the same output rows, got ", w.size(0),
                " and ", weights[0].size(0));
  }
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in], got ", x.sizes());
  TORCH_CHECK(x.size(1) == in, op, ": x has ", x.size(1), " features, weight expects ", in);
  first.assign(group_rows.size() + 1, 0);
  for (size_t g = 0; g < group_rows.size(); ++g) {
    TORCH_CHECK(group_rows[g] >= 0, op, ": a group's row count must not be negative, got ", group_rows[g]);
    first[g + 1] = first[g] + group_rows[g];
  }
  TORCH_CHECK(first.back() == x.size(0), op, ": the groups' row counts add up to ", first.back(), ", x has ",
              x.size(0), " rows");
  return layouts;
}

// Weight bytes per task of split_groups: a thread's own tasks are adjacent, so its stream stays one stream;
// a task is what another thread can take over from it.
constexpr int64_t kTaskBytes = 32 * 1024;

// A thread's share of split_groups' tasks: [front, back) still to run, packed in one atomic word. The owner takes
// tasks from the front (one contiguous stream of weight rows, as a fixed share would be) and the other threads,
// once their own share is done, take from the back.
class alignas(64) TaskShare {  // a cache line each: the owners take from their fronts without disturbing each other
 public:
  void reset(int64_t front, int64_t back) { range_.store(pack(front, back), std::memory_order_relaxed); }
  // The next task from the front (owner) or the back (another thread), or -1 when none is left.
  int64_t take(bool from_front) {
    uint64_t now = range_.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = static_cast<int64_t>(now >> 32), back = static_cast<int64_t>(now & 0xffffffffu);
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (range_.compare_exchange_weak(now, next, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }
  std::atomic<uint64_t> range_{0};
};

// Calls run(g, begin, end) for the weight rows [begin, end) of every group with rows, all the groups' output rows
// (unit g * out_features + j: group g's weight row j) in one parallel region. Each thread has its share of the
// rows, in tasks of about kTaskBytes, and runs it front to back; a thread done with its share takes tasks from
// the back of another's. A server's event loop and its clients share these cores: a thread they preempt in the
// middle of a product then leaves the rest of its share to the others, instead of making them wait at the
// region's end. Each output row is computed as before, whichever thread takes it: bit for bit.
template <class Run>
void split_groups(c10::IntArrayRef group_rows, int64_t out_features, int64_t row_bytes, Run&& run) {
  const int64_t groups = static_cast<int64_t>(group_rows.size()), units = groups * out_features;
  // 16 weight rows per task at least: thread hand-off stays cheap against a row's work.
  const int64_t task = std::max<int64_t>(16, kTaskBytes / std::max<int64_t>(row_bytes, 1));
  const int64_t tasks = (units + task - 1) / task;
  const auto run_task = [&](int64_t t) {
    const int64_t b = t * task, e = std::min(units, b + task);
    for (int64_t g = b / out_features; g < groups && g * out_features < e; ++g) {
      const int64_t begin = std::max(b - g * out_features, int64_t{0});
      const int64_t end = std::min(e - g * out_features, out_features);
      if (group_rows[g] > 0) run(g, begin, end);
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (threads <= 1 || at::in_parallel_region() || tasks >= (int64_t{1} << 31)) {
    for (int64_t t = 0; t < tasks; ++t) run_task(t);
    return;
  }
  std::vector<TaskShare> shares(threads);
  for (int64_t i = 0; i < threads; ++i) shares[i].reset(tasks * i / threads, tasks * (i + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t mine = first; mine < last; ++mine) {
      for (int64_t t = shares[mine].take(true); t >= 0; t = shares[mine].take(true)) run_task(t);
    }
    for (int64_t other = 1; other < threads; ++other) {  // the others' shares, from their backs
      TaskShare& share = shares[(last - 1 + other) % threads];
      for (int64_t t = share.take(false); t >= 0; t = share.take(false)) run_task(t);
    }
  });
}

// y = x W_g^T for groups of x's rows, each group against its own weight: one weight (qlinear), or a mixture-of-
// experts layer's routed experts (qlinear_grouped), whose every product is then one parallel region over all
// their output rows, so a decode row's small expert products stream side by side on every thread, not one
// product per thread. Each output is computed exactly as a call per group would.
at::Tensor float_products(const char* op, const at::Tensor& x, c10::IntArrayRef group_rows, at::TensorList weights,
                          int64_t format, int64_t in) {
  std::vector<int64_t> first;
  const std::vector<Layout> layouts = checked_groups(op, x, group_rows, weights, format, in, first);
  std::vector<at::Tensor> contiguous(weights.begin(), weights.end());
  for (at::Tensor& w : contiguous) w = w.contiguous();
  const int64_t rows = x.size(0), out_features = contiguous[0].size(0);
  ProductOutputs out(x, rows, out_features);
  if (rows == 0 || out_features == 0) return out.result();
  float* op_out = out.data();
#if defined(KVREUSE_BF16_DOT)
  // The inputs as bf16 (a float32 one as three bf16 parts that add up to it exactly), and their sums per
  // chunk of 32 values.
  const bool split = x.scalar_type() == at::kFloat;
  const at::Tensor xc = x.contiguous();
  const int64_t chunks = in / kChunk;
  std::vector<uint16_t> parts(split ? 3 * rows * in : 0);
  std::vector<float> sums(rows * chunks);
  const uint16_t* xh;
  uint16_t* high = parts.data();
  uint16_t* mid = high + rows * in;
  uint16_t* low = mid + rows * in;
  if (split) {
    const float* xf = xc.const_data_ptr<float>();
    for (int64_t i = 0; i < rows * in; ++i) {
      const c10::BFloat16 h(xf[i]);  // rounded to nearest even; each remainder is exact in float32
      const float rest = xf[i] - static_cast<float>(h);
      const c10::BFloat16 m(rest);
      const c10::BFloat16 lo(rest - static_cast<float>(m));
      high[i] = h.x, mid[i] = m.x, low[i] = lo.x;
    }
    xh = high;
  } else {
    xh = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      float total = 0.f;
      for (int64_t i = r * in + c * kChunk, e = i + kChunk; i < e; ++i) {
        total += split ? (bf16_to_float(high[i]) + bf16_to_float(mid[i])) + bf16_to_float(low[i]) : bf16_to_float(xh[i]);
      }
      sums[r * chunks + c] = total;
    }
  }
  with_format(format, [&](auto f) {
    using F = decltype(f);
    split_groups(group_rows, out_features, layouts[0].row_bytes, [&](int64_t g, int64_t begin, int64_t end) {
      const int64_t at = first[g] * in;
      const uint8_t* wp = contiguous[g].const_data_ptr<uint8_t>();
      float* o = op_out + first[g] * out_features;
      if (split) {
        dot_range_bf16<F, true>(xh + at, mid + at, low + at, sums.data() + first[g] * chunks, group_rows[g], in, wp,
                                layouts[g], o, out_features, begin, end);
      } else {
        dot_range_bf16<F, false>(xh + at, nullptr, nullptr, sums.data() + first[g] * chunks, group_rows[g], in, wp,
                                 layouts[g], o, out_features, begin, end);
      }
    });
  });
#else
  const FloatRows xf(x);  // bf16 rows widened once per call
  const float* xp = xf.data();
  with_format(format, [&](auto f) {
    using F = decltype(f);
    split_groups(group_rows, out_features, layouts[0].row_bytes, [&](int64_t g, int64_t begin, int64_t end) {
      dot_range<F>(xp + first[g] * in, group_rows[g], in, contiguous[g].const_data_ptr<uint8_t>(), layouts[g],
                   op_out + first[g] * out_features, out_features, begin, end);
    });
  });
#endif
  return out.result();
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t in) {
  return float_products("qlinear", x, {x.dim() == 2 ? x.size(0) : 0}, {weight}, format, in);
}

at::Tensor qlinear_grouped(const at::Tensor& x, c10::IntArrayRef group_rows, at::TensorList weights, int64_t format,
                           int64_t in) {
  return float_products("qlinear_grouped", x, group_rows, weights, format, in);
}

// The formats qlinear_int8 runs here (none without AVX2 or AVX512-VNNI).
std::vector<int64_t> int8_formats() {
  std::vector<int64_t> codes;
#if defined(KVREUSE_INT8_DOT)
  for (int64_t code = kQ8_0; code <= kLastFormat; ++code) {
    with_format(code, [&](auto f) {
      if (int8_dot_format<decltype(f)>()) codes.push_back(code);
    });
  }
#endif
  return codes;
}

// The values per input scale qlinear_int8 rounds a format's inputs with (0 where it does not run it).
int64_t int8_group(int64_t format) {
  int64_t group = 0;
#if defined(KVREUSE_INT8_DOT)
  if (format >= kQ8_0 && format <= kLastFormat) {
    with_format(format, [&](auto f) {
      using F = decltype(f);
      if constexpr (int8_dot_format<F>()) group = int8_input_group<F>();
    });
  }
#endif
  return group;
}

// "q8_0, q4_0, ...": the formats named, for an error message (built only when the check fails).
std::string format_names(const std::vector<int64_t>& codes) {
  std::string names;
  for (const int64_t code : codes) names += (names.empty() ? "" : ", ") + std::string(kNames[code]);
  return names;
}

// float_products over inputs rounded to int8 (qlinear_int8, qlinear_int8_grouped): all rows rounded once.
at::Tensor int8_products(const char* op, const at::Tensor& x, c10::IntArrayRef group_rows, at::TensorList weights,
                         int64_t format, int64_t in) {
  std::vector<int64_t> first;
  const std::vector<Layout> layouts = checked_groups(op, x, group_rows, weights, format, in, first);
  static const std::vector<int64_t> formats = int8_formats();  // fixed by the build; checked on every call
  TORCH_CHECK(std::find(formats.begin(), formats.end(), format) != formats.end(), op, ": ", kNames[format],
              formats.empty() ? " is not run on int8 inputs here: this CPU (or build) lacks AVX2 and AVX512-VNNI"
                              : " is not run on int8 inputs on this CPU (" + format_names(formats) + " are)");
  std::vector<at::Tensor> contiguous(weights.begin(), weights.end());
  for (at::Tensor& w : contiguous) w = w.contiguous();
  const int64_t rows = x.size(0), out_features = contiguous[0].size(0);
  ProductOutputs out(x, rows, out_features);
#if defined(KVREUSE_INT8_DOT)
  if (rows > 0 && out_features > 0) {
    float* op_out = out.data();
    with_format(format, [&](auto f) {
      using F = decltype(f);
#if defined(KVREUSE_KQUANT_DOT)
      if constexpr (F::kquant) {
        const QuantizedSpans q = quantize_spans(x, rows, in);
        split_groups(group_rows, out_features, layouts[0].row_bytes, [&](int64_t g, int64_t begin, int64_t end) {
          dot_range_kquant<F>(q, first[g], group_rows[g], contiguous[g].const_data_ptr<uint8_t>(), layouts[g],
                              op_out + first[g] * out_features, out_features, begin, end);
        });
      } else
#endif
      if constexpr (int8_dot_format<F>()) {
        const QuantizedRows q = quantize_rows<F>(x, rows, in);
        split_groups(group_rows, out_features, layouts[0].row_bytes, [&](int64_t g, int64_t begin, int64_t end) {
          dot_range_int8<F>(q, first[g], group_rows[g], in, contiguous[g].const_data_ptr<uint8_t>(), layouts[g],
                            op_out + first[g] * out_features, out_features, begin, end);
        });
      }
    });
  }
#endif
  return out.result();
}

at::Tensor qlinear_int8(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t in) {
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  return int8_products("qlinear_int8", x, {rows}, {weight}, format, in);
}

at::Tensor qlinear_int8_grouped(const at::Tensor& x, c10::IntArrayRef group_rows, at::TensorList weights,
                                int64_t format, int64_t in) {
  return int8_products("qlinear_int8_grouped", x, group_rows, weights, format, in);
}

at::Tensor qdequant(const at::Tensor& weight, int64_t format, int64_t in) {
  const Layout l = checked_layout("qdequant", weight, format, in);
  const at::Tensor wc = weight.contiguous();
  const int64_t out_features = wc.size(0);
  at::Tensor out = at::empty({out_features, in}, wc.options().dtype(at::kFloat));
  if (out_features > 0) {
    const uint8_t* wp = wc.const_data_ptr<uint8_t>();
    float* op = out.mutable_data_ptr<float>();
    with_format(format, [&](auto f) {
      using F = decltype(f);
      at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
        dequant_range<F>(wp, l, in, op, begin, end);
      });
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("qlinear(Tensor x, Tensor weight, int format, int in_features) -> Tensor");
  m.def("qlinear_grouped(Tensor x, int[] group_rows, Tensor[] weights, int format, int in_features) -> Tensor");
  m.def("qdequant(Tensor weight, int format, int in_features) -> Tensor");
  m.def("qlinear_int8(Tensor x, Tensor weight, int format, int in_features) -> Tensor");
  m.def("qlinear_int8_grouped(Tensor x, int[] group_rows, Tensor[] weights, int format, int in_features) -> Tensor");
  m.def("int8_formats() -> int[]", &int8_formats);
  m.def("int8_group(int format) -> int", &int8_group);
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qlinear_grouped", &qlinear_grouped);
  m.impl("qdequant", &qdequant);
  m.impl("qlinear_int8", &qlinear_int8);
  m.impl("qlinear_int8_grouped", &qlinear_int8_grouped);
}

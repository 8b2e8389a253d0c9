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
#include "quant_lanes_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "quant_lanes_avx2.h"
#else
#include "quant_lanes_scalar.h"
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
#include "quant_bf16_avx512.h"
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
#include "quant_int8_avx512vnni.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "quant_int8_avx2.h"
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
        const QuantizedSpans q = quantize_spans<F>(x, rows, in);
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

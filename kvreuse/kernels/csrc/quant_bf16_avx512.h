// quant.cpp's bf16 dot-product kernel (AVX512-BF16): qlinear under bfloat16 activations.
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

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

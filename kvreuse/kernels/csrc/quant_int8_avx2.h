// quant.cpp's int8 kernels on AVX2 without VNNI (qdot8): vpmaddubsw over int8-rounded inputs.
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

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

// quant.cpp's int8 kernels on AVX512-VNNI (qdot8): vpdpbusd over int8-rounded inputs.
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

// AVX512-VNNI over int8 activations, as llama.cpp multiplies its quantized files: each input row is rounded
// per chunk of 32 values to int8 codes with one float32 scale (amax / 127), and vpdpbusd multiplies 64
// unsigned bytes by 64 signed bytes into 16 int32 lanes, exactly. A pair of chunks shares one instruction;
// the int32 sums become float32 once per pair, times the weight's and the input's scales. 8-bit weights
// are the signed operand and the inputs go unsigned (code + 128; the 128 * sum(w) this adds is taken
// back per lane); 4-bit weights are the unsigned operand as stored, their offsets b * sum(x) per group
// come from the rounded inputs' group sums. Formats: q8_0, q4_0, q4_1, mxfp4, and the K-quants below (q5_0 and
// q5_1 stay on the bf16 kernel). Only the inputs round: 7 bits plus sign against each chunk's largest value.
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
// the 4- to 6-bit formats were compute-bound (8-9 GB/s a core on the AVX-512 EPYC). Q6_K (groups of 16) runs
// this pair path; Q4_K and Q5_K take fewer multiplies still (dot_rows_kquant_quads, below).
struct QuantizedSpans {
  int64_t spans = 0;
  std::vector<int8_t> codes;     // [rows, spans, 4 pairs, 64]: each pair in pair_codes' 4-bit lane order
  std::vector<float> scales;     // [rows, spans]
  std::vector<int16_t> sums16;   // [rows, spans, 16]: the codes' sum over values 16g .. 16g + 15
  std::vector<int16_t> sums32;   // [rows, spans, 8]: over chunk g's 32 values
  std::vector<float> scaled_sums32;  // Q4_K / Q5_K: sums32 times the span's scale, for the offsets' float products
};

// The input codes' order in a super-block follows the kernel that reads them: for Q4_K and Q5_K (groups of 32,
// dot_rows_kquant_quads) four chunks' values 0-15, then their values 16-31, for chunks 0-3 and then 4-7; for Q6_K
// (dot_rows_kquant) each pair of chunks in pair_codes' 4-bit lane order.
template <class F>
constexpr bool quad_kquant() {
  return F::kquant && F::group == 32;
}

template <class F>
inline QuantizedSpans quantize_spans(const at::Tensor& x, int64_t rows, int64_t in) {
  QuantizedSpans q;
  q.spans = in / kSuper;
  q.codes.assign(rows * in, 0);
  q.scales.assign(rows * q.spans, 0.f);
  q.sums16.assign(rows * q.spans * 16, 0);
  q.sums32.assign(rows * q.spans * 8, 0);
  if constexpr (quad_kquant<F>()) q.scaled_sums32.assign(rows * q.spans * 8, 0.f);
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
        const int at_byte = quad_kquant<F>() ? (c / 4) * 128 + h * 64 + (c % 4) * 16 : (c / 2) * 64 + h * 32 + (c % 2) * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at_byte), _mm512_cvtepi32_epi8(codes));  // |code| <= 127: exact
        const int32_t total = _mm512_reduce_add_epi32(codes);
        q.sums16[at * 16 + k] = static_cast<int16_t>(total);
        q.sums32[at * 8 + c] = static_cast<int16_t>(q.sums32[at * 8 + c] + total);
      }
      if constexpr (quad_kquant<F>()) {
        for (int c = 0; c < 8; ++c) q.scaled_sums32[at * 8 + c] = d * static_cast<float>(q.sums32[at * 8 + c]);
      }
    }
  }
  return q;
}

// A K-quant weight row's outputs for R input rows: each row's float lanes summed, plus its offsets' lanes.
template <int R>
inline void store_kquant_rows(const __m512 (&acc)[R], const __m256 (&offset)[R], float* out, int64_t out_features,
                              int64_t j) {
  for (int r = 0; r < R; ++r) {
    const __m256 o = offset[r];
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    out[r * out_features + j] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(h);
  }
}

template <class F, int R>
void dot_rows_kquant(const QuantizedSpans& q, int64_t r0, const uint8_t* w, const Layout& l, float* out,
                     int64_t out_features, int64_t begin, int64_t end) {
  static_assert(F::kquant && !quad_kquant<F>(), "Q4_K and Q5_K run dot_rows_kquant_quads");
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
      lanes[k] = static_cast<int16_t>(2 * c + half);
    }
    idx[p] = _mm512_load_si512(lanes);
  }
  // The high-bit planes as byte masks in pair_codes' lane order, for all four pairs of a super-block in one
  // 16-bit permutation of its plane words (pair_plane_mask's shuffle, done in a vector, not per pair in
  // scalar code, which cost Q6_K a third of its time): mask 2p + k is pair p's plane k.
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
      }
      // the group codes as int16
      const __m512i sc = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + sl.scales))));
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + sl.values + 32 * p));
        __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(packed), shifts), nibble);
        if constexpr (planes == 2) {
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(masks[2 * p]), wv, _mm512_set1_epi8(16));
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(masks[2 * p + 1]), wv, _mm512_set1_epi8(32));
        }
        const __m512i scale = _mm512_permutexvar_epi16(idx[p], sc);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512(codes + ((r * spans + s) * 4 + p) * 64);
          sums[r] = _mm512_dpwssd_epi32(sums[r], _mm512_maddubs_epi16(wv, xv), scale);
        }
      }
      // The offsets: Q6_K's values are (q - 32) * code, so - 32 * d * sum over groups of code * (the inputs'
      // group sum).
      const float factor = static_cast<float>(F::zero) * d;
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * spans + s;
        const float xs = xscales[r * spans + s];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(d * xs), acc[r]);
        // The group products as int32 lanes (exact: at most 8 * 127 * 2,032), made float32 exactly, scaled.
        const __m256 m = _mm256_cvtepi32_ps(_mm256_madd_epi16(
            _mm512_castsi512_si256(sc), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.sums16.data() + at * 16))));
        offset[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(-factor * xs), offset[r]);
      }
    }
    store_kquant_rows<R>(acc, offset, out, out_features, j);
  }
}

// Q4_K and Q5_K (groups of 32) in fewer multiplies: vpdpbusd takes 64 unsigned weight codes against 64 int8
// inputs into 16 int32 lanes in one instruction, where the pair path above needs two (vpmaddubsw, vpdpwssd).
// A super-block's 128 packed bytes are two registers of four chunks each; their low nibbles (values 0-15 of
// each chunk) and high nibbles (values 16-31) put chunk k's values in the same four int32 lanes, so two
// vpdpbusd per register leave each lane the sum of 8 products of one chunk: at most 8 * 31 * 127 = 31,496,
// which fits int16. vpackssdw packs the two registers' lanes into one of int16 (exactly, no saturation) and
// one vpmaddwd multiplies each by its group's 6-bit scale code and sums pairs of the same chunk into int32.
// Per input row and super-block: 4 + 1 multiplies and a pack, against the pair path's 8 multiplies; the
// weight's decode (the nibbles, Q5_K's plane, the scale order) is shared by all R rows. The super-block's sum
// stays an exact integer, made float32 once per super-block as before (INT8_ARITHMETIC names the lane order).
template <class F, int R>
void dot_rows_kquant_quads(const QuantizedSpans& q, int64_t r0, const uint8_t* w, const Layout& l, float* out,
                           int64_t out_features, int64_t begin, int64_t end) {
  static_assert(quad_kquant<F>() && F::has_min && F::bits <= 5);
  const int64_t spans = q.spans;
  const SpanLayout& sl = l.span;  // K-quant rows are whole super-blocks
  const __m512i nibble = _mm512_set1_epi8(15);
  // int16 lane 8j + t of vpackssdw(A, B) sums chunk j (t < 4, from A: chunks 0-3) or 4 + j (t >= 4, from B).
  alignas(64) int16_t lanes[32];
  for (int k = 0; k < 32; ++k) lanes[k] = static_cast<int16_t>(k / 8 + (k % 8 >= 4 ? 4 : 0));
  const __m512i scale_order = _mm512_load_si512(lanes);
  // Q5_K's plane (a 32-bit word per chunk, bit i for value i) as four byte masks in the nibble registers'
  // order: mask 2h + half covers chunks 4h .. 4h + 3, values 0-15 (half 0) or 16-31 (half 1); in 16-bit
  // halves of the plane words, chunk c's values 0-15 are half 2c and 16-31 half 2c + 1.
  constexpr int planes = F::bits - 4;
  __m512i plane_order = _mm512_setzero_si512();
  if constexpr (planes == 1) {
    alignas(64) int16_t order[32] = {};
    for (int m = 0; m < 4; ++m) {
      for (int k = 0; k < 4; ++k) order[m * 4 + k] = static_cast<int16_t>((4 * (m / 2) + k) * 2 + m % 2);
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
      const __m512 d = _mm512_set1_ps(half_at(sp + sl.d));
      const __m512i packed_a = _mm512_loadu_si512(sp + sl.values), packed_b = _mm512_loadu_si512(sp + sl.values + 64);
      __m512i low_a = _mm512_and_si512(packed_a, nibble), high_a = _mm512_and_si512(_mm512_srli_epi16(packed_a, 4), nibble);
      __m512i low_b = _mm512_and_si512(packed_b, nibble), high_b = _mm512_and_si512(_mm512_srli_epi16(packed_b, 4), nibble);
      if constexpr (planes == 1) {
        alignas(64) uint64_t masks[8];
        const __m512i words = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + sl.planes)));
        _mm512_store_si512(masks, _mm512_permutexvar_epi16(plane_order, words));
        const __m512i sixteen = _mm512_set1_epi8(16);
        low_a = _mm512_mask_add_epi8(low_a, _cvtu64_mask64(masks[0]), low_a, sixteen);
        high_a = _mm512_mask_add_epi8(high_a, _cvtu64_mask64(masks[1]), high_a, sixteen);
        low_b = _mm512_mask_add_epi8(low_b, _cvtu64_mask64(masks[2]), low_b, sixteen);
        high_b = _mm512_mask_add_epi8(high_b, _cvtu64_mask64(masks[3]), high_b, sixteen);
      }
      const __m512i scale = _mm512_permutexvar_epi16(
          scale_order, _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + sl.scales)))));
      // - dmin * min per chunk (exact in float32: an fp16 times a 6-bit code), for every row.
      const __m256 mins = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + sl.mins)))),
          _mm256_set1_ps(-half_at(sp + sl.dmin)));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = codes + (r * spans + s) * kSuper;
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low_a, _mm512_loadu_si512(x));
        a = _mm512_dpbusd_epi32(a, high_a, _mm512_loadu_si512(x + 64));
        __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low_b, _mm512_loadu_si512(x + 128));
        b = _mm512_dpbusd_epi32(b, high_b, _mm512_loadu_si512(x + 192));
        const __m512i sums = _mm512_madd_epi16(_mm512_packs_epi32(a, b), scale);
        const int64_t at = (r0 + r) * spans + s;
        // (sum * d) * the input's scale, broadcast from memory (a load, not a shuffle).
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), d), _mm512_set1_ps(xscales[r * spans + s]), acc[r]);
        // The offsets: - dmin * min times the inputs' sum over each chunk, scaled (quantize_spans).
        offset[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(q.scaled_sums32.data() + at * 8), offset[r]);
      }
    }
    store_kquant_rows<R>(acc, offset, out, out_features, j);
  }
}

// Rows [first, first + rows) of q against weight rows [begin, end); out points at row `first`'s outputs.
template <class F>
void dot_range_kquant(const QuantizedSpans& q, int64_t first, int64_t rows, const uint8_t* w, const Layout& l,
                      float* out, int64_t out_features, int64_t begin, int64_t end) {
  // Q4_K / Q5_K: 8 rows a pass while their codes stay in L1 (8 rows of 2,048 inputs: 16 KiB), else 4 (a 6,144-wide
  // down projection ran 16 rows 15-20% faster in four passes of 4 than in two of 8, on the 2-core Xeon).
  const int64_t step = quad_kquant<F>() && q.spans * kSuper > 2048 ? 4 : kMaxRows;
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    float* o = out + r0 * out_features;
    with_rows(std::min(rows - r0, step), [&](auto r) {
      if constexpr (quad_kquant<F>()) {
        dot_rows_kquant_quads<F, decltype(r)::value>(q, first + r0, w, l, o, out_features, begin, end);
      } else {
        dot_rows_kquant<F, decltype(r)::value>(q, first + r0, w, l, o, out_features, begin, end);
      }
    });
  }
}


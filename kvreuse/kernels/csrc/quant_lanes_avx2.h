// The float lanes of quant.cpp's decode loops on AVX2 + FMA: 8 floats a vector.
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

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

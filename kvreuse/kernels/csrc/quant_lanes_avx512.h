// The float lanes of quant.cpp's decode loops on AVX-512: 16 floats a vector.
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

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

// The float lanes of quant.cpp's decode loops without AVX2: one float a "vector".
// Included by quant.cpp inside its anonymous namespace, under the #if that selects this
// instruction set (one file per ISA, as llama.cpp's ggml-cpu/arch/); it uses quant.cpp's helpers above
// the include and is not a standalone header.
#pragma once

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

// y = x W^T for a few rows of x, reading W [out, in] in its own row-major layout: every output is a dot
// product of one weight row with one input row. With one to a few input rows this product reads each
// weight byte once and does two flops per element, so it is memory-bound: its speed is how fast the
// weight streams from memory. The BLAS paths PyTorch takes for it on CPU stream at 40-80% of what the
// machine can (layers/plan_book.py has the figures); these loops keep one FMA chain per weight row,
// stream the rows in order and split the output rows between torch's threads.
//
// Built at run time by kernels/rowdot.py with -march=native, so the vector width is the CPU's own:
// AVX-512 (16 floats), AVX2 with FMA (8 floats), or plain scalar code elsewhere. float32 and bfloat16
// (bf16 products are accumulated in float32, with AVX512-BF16's dot instruction where the CPU has it,
// and the output rounded to bf16 once, as PyTorch's bf16 matmul does).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// One element type's vector loop: Acc accumulates a dot product Step elements at a time.
struct Float32Dot {
  using Elem = float;
#if defined(__AVX512F__)
  using Acc = __m512;
  static constexpr int64_t Step = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc step(Acc acc, const float* w, const float* x) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
  }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif defined(__AVX2__) && defined(__FMA__)
  using Acc = __m256;
  static constexpr int64_t Step = 8;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc step(Acc acc, const float* w, const float* x) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
  }
  static float sum(Acc acc) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
#else
  using Acc = float;
  static constexpr int64_t Step = 1;
  static Acc zero() { return 0.f; }
  static Acc step(Acc acc, const float* w, const float* x) { return *w * *x + acc; }
  static float sum(Acc acc) { return acc; }
#endif
  static float scalar(const float* w, const float* x) { return *w * *x; }
  static float store(float value) { return value; }
};

struct BFloat16Dot {
  using Elem = uint16_t;  // bf16 bits
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  using Acc = __m512;
  static constexpr int64_t Step = 32;  // 32 bf16 pairs, products summed in pairs into 16 float lanes
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc step(Acc acc, const uint16_t* w, const uint16_t* x) {
    const __m512i wv = _mm512_loadu_si512(w), xv = _mm512_loadu_si512(x);
    return _mm512_dpbf16_ps(acc, (__m512bh)wv, (__m512bh)xv);
  }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif defined(__AVX512F__)
  using Acc = __m512;
  static constexpr int64_t Step = 16;
  static __m512 widen(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc step(Acc acc, const uint16_t* w, const uint16_t* x) { return _mm512_fmadd_ps(widen(w), widen(x), acc); }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif defined(__AVX2__) && defined(__FMA__)
  using Acc = __m256;
  static constexpr int64_t Step = 8;
  static __m256 widen(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc step(Acc acc, const uint16_t* w, const uint16_t* x) { return _mm256_fmadd_ps(widen(w), widen(x), acc); }
  static float sum(Acc acc) { return Float32Dot::sum(acc); }
#else
  using Acc = float;
  static constexpr int64_t Step = 1;
  static Acc zero() { return 0.f; }
  static Acc step(Acc acc, const uint16_t* w, const uint16_t* x) { return bf16_to_float(*w) * bf16_to_float(*x) + acc; }
  static float sum(Acc acc) { return acc; }
#endif
  static float scalar(const uint16_t* w, const uint16_t* x) { return bf16_to_float(*w) * bf16_to_float(*x); }
  static uint16_t store(float value) { return c10::BFloat16(value).x; }  // round to nearest even
};

// The dot products of weight rows [begin, end) with every input row, Group weight rows per pass: one
// pass keeps Group accumulators, so Group independent FMA chains share each load of the input row.
// One row per pass streams a single address range (best for short rows); eight hide more latency
// (best for long rows). Which wins on a CPU is measured (layers/plan_book.py), not assumed.
template <int Group, typename Dot>
void dot_rows(const typename Dot::Elem* x, int64_t rows, const typename Dot::Elem* w, int64_t in,
              typename Dot::Elem* out, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t body = in - in % Dot::Step;
  int64_t j = begin;
  for (; j + Group <= end; j += Group) {
    const auto* wj = w + j * in;
    for (int64_t r = 0; r < rows; ++r) {
      const auto* xr = x + r * in;
      typename Dot::Acc acc[Group];
      for (int g = 0; g < Group; ++g) acc[g] = Dot::zero();
      for (int64_t k = 0; k < body; k += Dot::Step) {
        for (int g = 0; g < Group; ++g) acc[g] = Dot::step(acc[g], wj + g * in + k, xr + k);
      }
      for (int g = 0; g < Group; ++g) {
        float sum = Dot::sum(acc[g]);
        for (int64_t k = body; k < in; ++k) sum += Dot::scalar(wj + g * in + k, xr + k);
        out[r * out_features + j + g] = Dot::store(sum);
      }
    }
  }
  if constexpr (Group > 1) {
    if (j < end) dot_rows<1, Dot>(x, rows, w, in, out, out_features, j, end);
  }
}

template <typename Dot>
void run(const typename Dot::Elem* x, int64_t rows, const typename Dot::Elem* w, int64_t in,
         typename Dot::Elem* out, int64_t out_features, int64_t group) {
  // Work is cut at whole passes of `group` weight rows; 64 rows per task keeps thread hand-off cheap.
  const int64_t passes = (out_features + group - 1) / group;
  at::parallel_for(0, passes, std::max<int64_t>(1, 64 / group), [&](int64_t first, int64_t last) {
    const int64_t begin = first * group, end = std::min(last * group, out_features);
    if (group == 8) {
      dot_rows<8, Dot>(x, rows, w, in, out, out_features, begin, end);
    } else {
      dot_rows<1, Dot>(x, rows, w, in, out, out_features, begin, end);
    }
  });
}

at::Tensor rowdot(const at::Tensor& x, const at::Tensor& weight, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rowdot: x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rowdot: x and weight must both be float32 or both bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "rowdot: x must be [rows, in] and weight [out, in], got ",
              x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "rowdot: x has ", x.size(1), " features, weight expects ",
              weight.size(1));
  TORCH_CHECK(group == 1 || group == 8, "rowdot: group must be 1 or 8, got ", group);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1), out_features = wc.size(0);
  at::Tensor out = at::empty({rows, out_features}, xc.options());
  if (rows == 0 || out_features == 0) return out;
  if (xc.scalar_type() == at::kFloat) {
    run<Float32Dot>(xc.const_data_ptr<float>(), rows, wc.const_data_ptr<float>(), in,
                    out.mutable_data_ptr<float>(), out_features, group);
  } else {
    run<BFloat16Dot>(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>()), rows,
                     reinterpret_cast<const uint16_t*>(wc.const_data_ptr<at::BFloat16>()), in,
                     reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()), out_features, group);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvreuse_cpu, m) {
  m.def("rowdot(Tensor x, Tensor weight, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) {
  m.impl("rowdot", &rowdot);
}

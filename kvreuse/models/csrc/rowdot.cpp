// y = x W^T for a few rows of x, reading W [out, in] in its own row-major layout: every output is a dot
// product of one weight row with one input row. With one to a few input rows this product reads each
// weight byte once and does two flops per four bytes, so it is memory-bound: its speed is how fast the
// weight streams from memory. The BLAS paths PyTorch takes for it on CPU stream at 40-80% of what the
// machine can (models/kernels.py has the figures); these loops keep one FMA chain per weight row,
// stream the rows in order and split the output rows between torch's threads.
//
// Built at run time by models/rowdot.py with -march=native, so the vector width is the CPU's own:
// AVX-512 (16 floats), AVX2 with FMA (8 floats), or plain scalar code elsewhere. float32 only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm512_fmadd_ps(a, b, acc); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vfma(Vec a, Vec b, Vec acc) { return a * b + acc; }
inline float vsum(Vec v) { return v; }
#endif

// The dot products of weight rows [begin, end) with every input row, Group weight rows per pass: one
// pass keeps Group accumulators, so Group independent FMA chains share each load of the input row.
// One row per pass streams a single address range (best for short rows); eight hide more latency
// (best for long rows). Which wins on a CPU is measured (models/kernels.py), not assumed.
template <int Group>
void dot_rows(const float* x, int64_t rows, const float* w, int64_t in, float* out, int64_t out_features,
              int64_t begin, int64_t end) {
  const int64_t body = in - in % kLanes;
  int64_t j = begin;
  for (; j + Group <= end; j += Group) {
    const float* wj = w + j * in;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      Vec acc[Group];
      for (int g = 0; g < Group; ++g) acc[g] = vzero();
      for (int64_t k = 0; k < body; k += kLanes) {
        const Vec xv = vload(xr + k);
        for (int g = 0; g < Group; ++g) acc[g] = vfma(vload(wj + g * in + k), xv, acc[g]);
      }
      for (int g = 0; g < Group; ++g) {
        float sum = vsum(acc[g]);
        for (int64_t k = body; k < in; ++k) sum += wj[g * in + k] * xr[k];
        out[r * out_features + j + g] = sum;
      }
    }
  }
  if constexpr (Group > 1) {
    if (j < end) dot_rows<1>(x, rows, w, in, out, out_features, j, end);
  }
}

at::Tensor rowdot(const at::Tensor& x, const at::Tensor& weight, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rowdot: x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rowdot: x and weight must be float32, got ", x.scalar_type(), " and ", weight.scalar_type());
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
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  // Work is cut at whole passes of `group` weight rows; 64 rows per task keeps thread hand-off cheap.
  const int64_t passes = (out_features + group - 1) / group;
  at::parallel_for(0, passes, std::max<int64_t>(1, 64 / group), [&](int64_t first, int64_t last) {
    const int64_t begin = first * group, end = std::min(last * group, out_features);
    if (group == 8) {
      dot_rows<8>(xp, rows, wp, in, op, out_features, begin, end);
    } else {
      dot_rows<1>(xp, rows, wp, in, op, out_features, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvreuse_cpu, m) {
  m.def("rowdot(Tensor x, Tensor weight, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) {
  m.impl("rowdot", &rowdot);
}

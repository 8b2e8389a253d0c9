// The small element-wise work of a decoder layer, each as one call instead of four to ten PyTorch ops.
//
// A decode step of a small model on CPU spends more time between its matrix products than in them: an
// RMSNorm in reduced precision is five ops (cast, square, mean, rsqrt, two products), rotary is eight per
// tensor, SiLU-and-multiply two, each paying PyTorch eager's dispatch for a few hundred values. These
// kernels do each in one pass over the rows, split over torch's threads only when there are many rows
// (a prefill); kvreuse/kernels/fused_ops.py holds the PyTorch reference each one equals (float32: within
// an ulp or two, the summation order of a norm; bfloat16: one rounding where PyTorch rounds after every op).
//
// - rms_norm(x, weight, eps, residual): where `residual` is given, x += residual first (in place, rounded to
//   x's dtype as PyTorch's add_ does); returns weight * x / rms(x), normalised in float32 and rounded to x's
//   dtype before the weight, as transformers does;
// - rms_norm_float_scale(x, scale, eps, residual): the same with a float32 scale and one rounding (Gemma's and
//   Qwen3.5's (1 + weight) norms);
// - rotary_(qkv, cos, sin, positions, heads, kv_heads, head_dim, q_norm, k_norm, eps): on the fused q|k|v
//   rows, in place: q and k per head through their RMSNorm (Qwen3's q/k norms, where given), then rotated
//   by position (rotate-half layout, the float32 cos/sin tables of the model);
// - silu_mul(gate_up): silu(gate) * up of the fused [rows, 2 x intermediate] product;
// - clamped_swiglu(gate_up, limit, alpha): gpt-oss's expert activation of the same fused product;
// - argmax_rows(logits): torch.argmax(logits, dim=-1) of float32 logits, vectorised and threaded (greedy
//   sampling's one op);
// - short_conv(bcx, weight, bias, planes, taps, slot_mapping): LFM2's gated short convolution between its two
//   projections (layers/short_conv.py): B * x written to each row's plane row, the K rows its taps name read back
//   and summed in tap order in float32, then C * that; bit for bit the reference's element-wise ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

template <typename T>
inline T from_float(float value) {
  return static_cast<T>(value);
}

// Rows per thread below which a call stays on one thread: a decode step's rows are cheaper than waking
// the others.
constexpr int64_t ROW_GRAIN = 16;
constexpr int64_t SILU_GRAIN = 16384;  // values per thread at least, for silu_mul

// kRoundFirst: the normalised value rounded to T before the weight (transformers' Llama order, a weight in T);
// otherwise scaled by a float32 weight and rounded once (Gemma's and Qwen3.5's (1 + weight) norms).
template <typename T, typename W, bool kRoundFirst>
void rms_norm_rows(T* x, const T* residual, const W* weight, T* out, int64_t rows, int64_t size, float eps) {
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> values(static_cast<size_t>(size));
    for (int64_t row = begin; row < end; ++row) {
      T* x_row = x + row * size;
      float sum = 0.0f;
      for (int64_t i = 0; i < size; ++i) {
        float value = to_float(x_row[i]);
        if (residual != nullptr) {
          const T stored = from_float<T>(value + to_float(residual[row * size + i]));  // add_ rounds to T
          x_row[i] = stored;
          value = to_float(stored);
        }
        values[i] = value;
        sum += value * value;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
      T* out_row = out + row * size;
      for (int64_t i = 0; i < size; ++i) {
        if constexpr (kRoundFirst) {
          // Rounded to T before the weight (transformers' order), the product rounded again.
          out_row[i] = from_float<T>(to_float(from_float<T>(values[i] * inv)) * to_float(weight[i]));
        } else {
          out_row[i] = from_float<T>(values[i] * inv * static_cast<float>(weight[i]));
        }
      }
    }
  });
}

// Both norms' entry: x (and the residual, like it) checked, the weight `kFloatWeight` (float32) or in x's dtype, rows
// normalised in Llama's order (rounded before a weight in x's dtype) or Gemma's (a float32 scale, rounded once).
template <bool kFloatWeight>
at::Tensor norm_rows(at::Tensor x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x: contiguous [..., size]");
  const int64_t size = x.size(-1), rows = size == 0 ? 0 : x.numel() / size;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous() &&
              weight.scalar_type() == (kFloatWeight ? at::kFloat : x.scalar_type()),
              kFloatWeight ? "scale: contiguous float32 [size]" : "weight: contiguous [size] in x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                residual->is_contiguous(), "residual: like x");
  }
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    using W = std::conditional_t<kFloatWeight, float, scalar_t>;
    rms_norm_rows<scalar_t, W, !kFloatWeight>(
        x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
        weight.data_ptr<W>(), out.data_ptr<scalar_t>(), rows, size, static_cast<float>(eps));
  });
  return out;
}

at::Tensor rms_norm(at::Tensor x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual) {
  return norm_rows<false>(std::move(x), weight, eps, residual);
}

// RMSNorm scaled by a float32 `scale` and rounded once: Gemma's and Qwen3.5's norms, whose (1 + weight) the caller
// holds in float32 (the PyTorch reference: rms_norm(x.float()) * scale, then to x's dtype).
at::Tensor rms_norm_float_scale(at::Tensor x, const at::Tensor& scale, double eps,
                                const c10::optional<at::Tensor>& residual) {
  return norm_rows<true>(std::move(x), scale, eps, residual);
}

// One head's values in place: optional RMSNorm (weight in T, rounded like rms_norm), then rotate-half.
template <typename T>
inline void norm_and_rotate(T* head, const T* norm_weight, float eps, const float* cos, const float* sin,
                            int64_t dim, float* scratch) {
  for (int64_t i = 0; i < dim; ++i) scratch[i] = to_float(head[i]);
  if (norm_weight != nullptr) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += scratch[i] * scratch[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) {
      scratch[i] = to_float(from_float<T>(to_float(from_float<T>(scratch[i] * inv)) * to_float(norm_weight[i])));
    }
  }
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    // cos and sin as T (the reference casts the float32 tables to the activation dtype).
    const float c = to_float(from_float<T>(cos[i])), s = to_float(from_float<T>(sin[i]));
    const float x1 = scratch[i], x2 = scratch[i + half];
    head[i] = from_float<T>(x1 * c - x2 * s);
    head[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
void rotary_rows(T* qkv, int64_t rows, int64_t row_stride, const float* cos, const float* sin, int64_t table_len,
                 const int64_t* positions, int64_t heads, int64_t kv_heads, int64_t dim, const T* q_norm,
                 const T* k_norm, float eps) {
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(dim));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t position = positions[row];
      TORCH_CHECK(position >= 0 && position < table_len, "position ", position, " is outside the rotary table");
      const float* c = cos + position * (dim / 2);
      const float* s = sin + position * (dim / 2);
      T* base = qkv + row * row_stride;
      for (int64_t h = 0; h < heads; ++h) norm_and_rotate(base + h * dim, q_norm, eps, c, s, dim, scratch.data());
      T* keys = base + heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h) norm_and_rotate(keys + h * dim, k_norm, eps, c, s, dim, scratch.data());
    }
  });
}

void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
             int64_t heads, int64_t kv_heads, int64_t dim, const c10::optional<at::Tensor>& q_norm,
             const c10::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv: [rows, q + k + v] with contiguous rows");
  TORCH_CHECK(qkv.size(1) >= (heads + kv_heads) * dim, "qkv rows are narrower than the q and k heads");
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
              "cos / sin: contiguous float32 [positions, head_dim / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
              positions.size(0) == qkv.size(0), "positions: contiguous int64 [rows]");
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (norm->has_value()) {
      TORCH_CHECK((*norm)->dim() == 1 && (*norm)->size(0) == dim && (*norm)->scalar_type() == qkv.scalar_type() &&
                  (*norm)->is_contiguous(), "q_norm / k_norm: contiguous [head_dim] in qkv's dtype");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    rotary_rows<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(0), qkv.stride(0), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), cos.size(0), positions.data_ptr<int64_t>(), heads, kv_heads, dim,
                          q_norm.has_value() ? q_norm->data_ptr<scalar_t>() : nullptr,
                          k_norm.has_value() ? k_norm->data_ptr<scalar_t>() : nullptr, static_cast<float>(eps));
  });
}

// exp of 8 lanes as PyTorch's own float kernels take it (Vectorized<float>::exp is SLEEF's expf8_u10, which
// libtorch_cpu exports), so silu here is F.silu's value bit for bit, at vector speed: the scalar std::exp
// loop it replaces was 2% of a qwen2.5-0.5b decode step.
#if defined(__AVX2__)
inline void exp_lanes(const float* in, float* out) {
  _mm256_storeu_ps(out, Sleef_expf8_u10(_mm256_loadu_ps(in)));
}
#else
inline void exp_lanes(const float* in, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = std::exp(in[i]);
}
#endif

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* dst, int64_t size) {
  float negated[8], e[8];
  for (int64_t i0 = 0; i0 < size; i0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, size - i0));
    for (int i = 0; i < n; ++i) negated[i] = -to_float(gate[i0 + i]);
    for (int i = n; i < 8; ++i) negated[i] = 0.f;
    exp_lanes(negated, e);
    for (int i = 0; i < n; ++i) {
      const float g = -negated[i];
      // silu rounded to the dtype (F.silu's output), then the product rounded (mul_).
      const float activated = to_float(from_float<T>(g / (1.0f + e[i])));
      dst[i0 + i] = from_float<T>(activated * to_float(up[i0 + i]));
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [rows, 2 x intermediate]");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* target = out.data_ptr<scalar_t>();
    // Rows share the threads once a thread's part is at least ~16k values (a few rows of a real model).
    at::parallel_for(0, rows, std::max<int64_t>(1, SILU_GRAIN / size), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* gate = in + row * 2 * size;
        silu_mul_row(gate, gate + size, target + row * size, size);
      }
    });
  });
  return out;
}

// gpt-oss's expert activation on the fused [rows, gate | up] product, transformers' GptOssExperts._apply_gate
// op for op: gate clamped from above at limit, up on both sides, (up + 1) * (gate * sigmoid(gate * alpha)),
// each op's result rounded to the dtype as PyTorch rounds it (the bounds rounded to it first, as clamp rounds
// its scalars; alpha kept in float32, as mul keeps a Python scalar for reduced precision), sigmoid as
// 1 / (1 + exp(-t)) with PyTorch's own exp. Eleven eager ops (two views, two clamps, add, three products,
// sigmoid) for a few hundred values each at a decode row: this is one. NaN propagates as through the ops.
template <typename T>
void clamped_swiglu_row(const T* gate, const T* up, T* dst, int64_t size, float limit, float alpha) {
  const float high = to_float(from_float<T>(limit)), low = to_float(from_float<T>(-limit));
  float clamped[8], negated[8], e[8];
  for (int64_t i0 = 0; i0 < size; i0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, size - i0));
    for (int i = 0; i < n; ++i) {
      const float g = to_float(gate[i0 + i]);
      clamped[i] = g > high ? high : g;
      negated[i] = -to_float(from_float<T>(clamped[i] * alpha));
    }
    for (int i = n; i < 8; ++i) negated[i] = 0.f;
    exp_lanes(negated, e);
    for (int i = 0; i < n; ++i) {
      const float sigmoid = to_float(from_float<T>(1.0f / (1.0f + e[i])));
      const float gated = to_float(from_float<T>(clamped[i] * sigmoid));
      float u = to_float(up[i0 + i]);
      u = u < low ? low : (u > high ? high : u);
      const float shifted = to_float(from_float<T>(u + 1.0f));
      dst[i0 + i] = from_float<T>(shifted * gated);
    }
  }
}

at::Tensor clamped_swiglu(const at::Tensor& gate_up, double limit, double alpha) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [rows, 2 x intermediate]");
  TORCH_CHECK(limit > 0, "clamped_swiglu: limit must be positive, got ", limit);
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "clamped_swiglu", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* target = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, SILU_GRAIN / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* gate = in + row * 2 * size;
        clamped_swiglu_row(gate, gate + size, target + row * size, size, static_cast<float>(limit),
                           static_cast<float>(alpha));
      }
    });
  });
  return out;
}

// ---- argmax over a row of logits --------------------------------------------------------------------
// torch.argmax reduces a [rows, vocab] float32 tensor with a scalar loop per row on CPU: 0.35-0.4 ms for one
// row of qwen's 151,936 logits and ~16x that for 16 rows, a step's worth of a small model's attention. Here a
// row is cut into spans that the threads share; each span finds its largest value with vector max and then
// the first index holding it. The answer is torch.argmax's: the first index of the largest value, or the
// first NaN where there is one (NaN compares greater than everything there).
struct SpanBest {
  float value;
  int64_t index;
  bool nan;
};

constexpr int64_t kArgmaxSpan = 16384;

SpanBest span_argmax(const float* x, int64_t begin, int64_t end) {
  int64_t i = begin;
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  any_nan = _mm256_movemask_ps(unordered) != 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < end; ++i) {
    any_nan = any_nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  for (int64_t j = begin; j < end; ++j) {  // the first index holding it (or the first NaN)
    if (any_nan ? std::isnan(x[j]) : x[j] == best) return {x[j], j, any_nan};
  }
  return {best, begin, false};  // not reached: some element equals the span's largest
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits: float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const int64_t spans = (vocab + kArgmaxSpan - 1) / kArgmaxSpan;
  std::vector<SpanBest> best(static_cast<size_t>(rows * spans));
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t row = k / spans, span = k % spans;
      best[k] = span_argmax(x + row * stride, span * kArgmaxSpan, std::min(vocab, (span + 1) * kArgmaxSpan));
    }
  });
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* target = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    SpanBest pick = best[row * spans];
    for (int64_t span = 1; span < spans && !pick.nan; ++span) {  // strictly greater: the earlier span wins ties
      const SpanBest& other = best[row * spans + span];
      if (other.nan || other.value > pick.value) pick = other;
    }
    target[row] = pick.index;
  }
  return out;
}

// LFM2's gated short convolution between its projections, over rows whose inputs are plane rows of the pool
// (layers/short_conv.py): bcx [T, 3H] is in_proj's B | C | x; each row's B * x (rounded to T, as the op rounds it) is
// written to planes[slot_mapping[row]] first, for every row, since a row reads its sequence's earlier rows of the
// step; then row r's output is C * round(sum_k planes[taps[r, k]] * weight[k] (+ bias)), the sum in float32 in tap
// order. Compiled without contracting a product and a sum into one fused multiply-add, so a float32 model's rows
// are the reference's element-wise ops bit for bit (tests/test_short_conv.py).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // the lambdas' bodies too
template <typename T>
void short_conv_rows(
    const T* bcx, const float* weight, const float* bias, T* planes, const int64_t* taps, const int64_t* slots,
    T* out, int64_t rows, int64_t hidden, int64_t kernel) {
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* b = bcx + row * 3 * hidden;
      const T* x = b + 2 * hidden;
      T* plane = planes + slots[row] * hidden;
      for (int64_t h = 0; h < hidden; ++h) plane[h] = from_float<T>(to_float(b[h]) * to_float(x[h]));
    }
  });
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> total(static_cast<size_t>(hidden));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t* row_taps = taps + row * kernel;
      const T* first = planes + row_taps[0] * hidden;
      for (int64_t h = 0; h < hidden; ++h) total[h] = to_float(first[h]) * weight[h];
      for (int64_t k = 1; k < kernel; ++k) {
        const T* tap = planes + row_taps[k] * hidden;
        const float* w = weight + k * hidden;
        for (int64_t h = 0; h < hidden; ++h) total[h] = total[h] + to_float(tap[h]) * w[h];
      }
      if (bias != nullptr) {
        for (int64_t h = 0; h < hidden; ++h) total[h] = total[h] + bias[h];
      }
      const T* c = bcx + row * 3 * hidden + hidden;
      T* target = out + row * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] = from_float<T>(to_float(c[h]) * to_float(from_float<T>(total[h])));
    }
  });
}
#pragma GCC pop_options

at::Tensor short_conv(const at::Tensor& bcx, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::Tensor planes, const at::Tensor& taps, const at::Tensor& slot_mapping) {
  TORCH_CHECK(bcx.dim() == 2 && bcx.is_contiguous() && bcx.size(1) % 3 == 0, "bcx: contiguous [rows, 3 x hidden]");
  const int64_t rows = bcx.size(0), hidden = bcx.size(1) / 3;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.size(0) >= 1,
              "weight: contiguous float32 [kernel, hidden] (the depthwise kernel, tap-major)");
  const int64_t kernel = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == hidden && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "bias: contiguous float32 [hidden]");
  }
  TORCH_CHECK(planes.dim() == 2 && planes.size(1) == hidden && planes.scalar_type() == bcx.scalar_type() &&
                  planes.is_contiguous(), "planes: contiguous [slots, hidden] in bcx's dtype");
  TORCH_CHECK(taps.dim() == 2 && taps.size(0) == rows && taps.size(1) == kernel && taps.scalar_type() == at::kLong &&
                  taps.is_contiguous(), "taps: contiguous int64 [rows, kernel]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping: contiguous int64 [rows]");
  const int64_t slots = planes.size(0);
  const int64_t* tap_data = taps.data_ptr<int64_t>();
  const int64_t* slot_data = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * kernel; ++i) TORCH_CHECK(0 <= tap_data[i] && tap_data[i] < slots, "taps: slot out of range");
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(0 <= slot_data[i] && slot_data[i] < slots, "slot_mapping: slot out of range");
  at::Tensor out = at::empty({rows, hidden}, bcx.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bcx.scalar_type(), "short_conv", [&] {
    short_conv_rows<scalar_t>(bcx.data_ptr<scalar_t>(), weight.data_ptr<float>(),
                              bias.has_value() ? bias->data_ptr<float>() : nullptr, planes.data_ptr<scalar_t>(),
                              tap_data, slot_data, out.data_ptr<scalar_t>(), rows, hidden, kernel);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvreuse_fused, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor weight, float eps, Tensor? residual) -> Tensor");
  m.def("rms_norm_float_scale(Tensor(a!) x, Tensor scale, float eps, Tensor? residual) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int heads, int kv_heads, int head_dim, "
        "Tensor? q_norm, Tensor? k_norm, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("clamped_swiglu(Tensor gate_up, float limit, float alpha) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("short_conv(Tensor bcx, Tensor weight, Tensor? bias, Tensor(a!) planes, Tensor taps, Tensor slot_mapping) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_float_scale", &rms_norm_float_scale);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("clamped_swiglu", &clamped_swiglu);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("short_conv", &short_conv);
}

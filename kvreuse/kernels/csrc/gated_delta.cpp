// The gated delta rule (Qwen3.5's Gated DeltaNet), token by token, each sequence's state in a slot of the pool.
//
// For every (sequence, value head) pair, independently and in token order: S = S * exp(g); mem = k^T S;
// delta = beta * (v - mem); S = S + k delta^T; o = q^T S. Two passes over the dk x dv state a token (the decay with
// the memory read, then the update with the output), the inner loop over dv vectorised by the compiler
// (-O3 -march=native). The pairs are split over torch's threads; a pair's arithmetic does not depend on which
// other pairs run, so a sequence's output and state are the same bits whatever the batch.
//
// Built at run time by kernels/gated_delta.py; the PyTorch reference is layers/gated_delta.py's
// delta_rule_reference (tests compare the two).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "recurrent_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// One token's step of one value head: the decay with the memory read (k^T S), then the update with the output (q^T S).
// `memory` and `delta` are scratch of value_dim floats.
inline void delta_token(float* state, const float* qt, const float* kt, const float* vt, float decay, float beta,
                        int64_t key_dim, int64_t value_dim, float* memory, float* delta, float* ot) {
  for (int64_t j = 0; j < value_dim; ++j) memory[j] = 0.f;
  for (int64_t i = 0; i < key_dim; ++i) {
    float* s = state + i * value_dim;
    const float ki = kt[i];
    for (int64_t j = 0; j < value_dim; ++j) {
      s[j] *= decay;
      memory[j] += ki * s[j];
    }
  }
  for (int64_t j = 0; j < value_dim; ++j) {
    delta[j] = (vt[j] - memory[j]) * beta;
    ot[j] = 0.f;
  }
  for (int64_t i = 0; i < key_dim; ++i) {
    float* s = state + i * value_dim;
    const float ki = kt[i], qi = qt[i];
    for (int64_t j = 0; j < value_dim; ++j) {
      s[j] += ki * delta[j];
      ot[j] += qi * s[j];
    }
  }
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& states, int64_t layer, at::IntArrayRef slots,
                            at::IntArrayRef starts, at::IntArrayRef lens, bool tiled) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  states.scalar_type() == at::kFloat,
              "gated_delta_rule: float32 inputs and state");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && g.is_contiguous() &&
                  beta.is_contiguous() && states.is_contiguous(),
              "gated_delta_rule: contiguous tensors");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && states.dim() == 5,
              "gated_delta_rule: q, k [T, Hk, dk], v [T, Hv, dv], state [slots, layers, Hv, dk, dv]");
  const int64_t key_heads = q.size(1), key_dim = q.size(2);
  const int64_t value_heads = v.size(1), value_dim = v.size(2);
  TORCH_CHECK(value_heads % key_heads == 0, "gated_delta_rule: value heads a multiple of key heads");
  TORCH_CHECK(states.size(2) == value_heads && states.size(3) == key_dim && states.size(4) == value_dim,
              "gated_delta_rule: the state's shape does not match the heads");
  TORCH_CHECK(layer >= 0 && layer < states.size(1), "gated_delta_rule: layer out of range");
  const int64_t num_seqs = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == num_seqs && static_cast<int64_t>(lens.size()) == num_seqs,
              "gated_delta_rule: slots, starts and lens of one length");
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < states.size(0), "gated_delta_rule: slot out of range");
    TORCH_CHECK(starts[i] >= 0 && lens[i] >= 0 && starts[i] + lens[i] <= q.size(0), "gated_delta_rule: rows out of range");
  }
  const int64_t ratio = value_heads / key_heads;
  at::Tensor out = at::empty(v.sizes(), v.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t state_size = key_dim * value_dim;
  const int64_t slot_stride = states.stride(0), layer_stride = states.stride(1);
  std::vector<int64_t> slot_of(slots.begin(), slots.end()), start_of(starts.begin(), starts.end()),
      len_of(lens.begin(), lens.end());
  at::parallel_for(0, num_seqs * value_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> memory(value_dim), delta(value_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      // Value head h reads key head h / ratio (HF's order: a key head's value heads together) or, tiled (llama.cpp's
      // GGUF order, the value heads reordered at conversion), h % key_heads.
      const int64_t seq = pair / value_heads, head = pair % value_heads;
      const int64_t key_head = tiled ? head % key_heads : head / ratio;
      float* state = sp + slot_of[seq] * slot_stride + layer * layer_stride + head * state_size;
      for (int64_t row = start_of[seq]; row < start_of[seq] + len_of[seq]; ++row) {
        const float* qt = qp + (row * key_heads + key_head) * key_dim;
        const float* kt = kp + (row * key_heads + key_head) * key_dim;
        const float* vt = vp + (row * value_heads + head) * value_dim;
        float* ot = op + (row * value_heads + head) * value_dim;
        delta_token(state, qt, kt, vt, std::exp(gp[row * value_heads + head]), bp[row * value_heads + head], key_dim,
                    value_dim, memory.data(), delta.data(), ot);
      }
    }
  });
  return out;
}

// SiLU (kind 0) or sigmoid (kind 1) of every value, in place, float32, with the scalar exp: the same bits for a value
// wherever it sits in the tensor. (PyTorch's vectorised exp runs a tensor's last few values through the scalar one,
// so which of the two a row gets depends on how many rows the step has: not batch-invariant.)
void pointwise_(at::Tensor& x, int64_t kind) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "pointwise_: a contiguous float32 tensor");
  TORCH_CHECK(kind == 0 || kind == 1, "pointwise_: kind 0 (silu) or 1 (sigmoid)");
  float* data = x.data_ptr<float>();
  at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float sigmoid = 1.f / (1.f + std::exp(-data[i]));
      data[i] = kind == 0 ? data[i] * sigmoid : sigmoid;
    }
  });
}

// A Gated DeltaNet layer's per-token gates from its projections a and b [T, Hv]: the decay's log
// g = -exp(A_log) * softplus(a + dt_bias) (softplus as PyTorch's: x itself above 20) and beta = sigmoid(b).
std::tuple<at::Tensor, at::Tensor> delta_gates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                               const at::Tensor& dt_bias) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a_log.scalar_type() == at::kFloat &&
                  dt_bias.scalar_type() == at::kFloat,
              "delta_gates: float32 tensors");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && b.sizes() == a.sizes() &&
                  a_log.numel() == a.size(1) && dt_bias.numel() == a.size(1),
              "delta_gates: a, b [T, Hv] contiguous, A_log and dt_bias [Hv]");
  const int64_t heads = a.size(1);
  at::Tensor g = at::empty(a.sizes(), a.options()), beta = at::empty(a.sizes(), a.options());
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const at::Tensor a_log_c = a_log.contiguous(), dt_c = dt_bias.contiguous();
  const float *lp = a_log_c.data_ptr<float>(), *dp = dt_c.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const int64_t head = i % heads;
    const float x = ap[i] + dp[head];
    const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
    gp[i] = -std::exp(lp[head]) * softplus;
    betap[i] = 1.f / (1.f + std::exp(-bp[i]));
  }
  return {g, beta};
}

// x rounded to the nearest bfloat16 (ties to even), as a float: what a bfloat16 model's PyTorch ops round to between
// the steps the fused mixer below keeps in float32.
inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u) return x;  // inf, nan
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// The whole Gated DeltaNet between its projections, for every row of a step (prefill and decode alike): the causal
// convolution of q|k|v with SiLU (its last K - 1 inputs in the sequence's slot), q and k L2-normalised per key head (q
// scaled by 1/sqrt(dk)), the gates from a and b, the delta rule above, and the output's RMS norm per value head, scaled
// by the norm's weight and gated by SiLU(z). `round_bf16`: the values rounded to bfloat16 where a bfloat16 model's
// op-by-op path rounds them (the convolution's output, the rule's output, the normalised and the scaled values). Each
// value is computed the same way whatever row it is in and whatever the step holds, so a token's output is the same
// bits in a prefill chunk, a decode step or a resumed run, in one call instead of ~40 small PyTorch ops a layer. The
// PyTorch reference is layers/gated_delta.py's op-by-op path.
at::Tensor delta_mixer(const at::Tensor& mixed, const at::Tensor& z, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& conv_w, at::Tensor& conv_states, const at::Tensor& a_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_w, at::Tensor& states, int64_t layer,
                       at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef lens, int64_t key_heads, bool tiled,
                       double eps, bool round_to_bf16) {
  for (const at::Tensor* t : {&mixed, &z, &a, &b, &conv_w, &a_log, &dt_bias, &norm_w,
                              static_cast<const at::Tensor*>(&conv_states), static_cast<const at::Tensor*>(&states)}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "delta mixer: contiguous float32 tensors");
  }
  TORCH_CHECK(states.dim() == 5 && conv_states.dim() == 4 && mixed.dim() == 2 && a.dim() == 2,
              "delta mixer: mixed [T, C], a [T, Hv], state [slots, layers, Hv, dk, dv], conv [slots, layers, K-1, C]");
  const int64_t tokens = mixed.size(0), channels = mixed.size(1), value_heads = a.size(1);
  const int64_t key_dim = states.size(3), value_dim = states.size(4), kernel = conv_w.size(1);
  const int64_t key_size = key_heads * key_dim, value_size = value_heads * value_dim;
  TORCH_CHECK(key_heads > 0 && value_heads % key_heads == 0 && states.size(2) == value_heads &&
                  channels == 2 * key_size + value_size && conv_w.size(0) == channels &&
                  conv_states.size(2) == kernel - 1 && conv_states.size(3) == channels && z.size(0) == tokens &&
                  z.size(1) == value_size && b.sizes() == a.sizes() && a.size(0) == tokens &&
                  a_log.numel() == value_heads && dt_bias.numel() == value_heads && norm_w.numel() == value_dim,
              "delta mixer: shapes do not agree");
  TORCH_CHECK(layer >= 0 && layer < states.size(1) && layer < conv_states.size(1), "delta mixer: layer out of range");
  const kvreuse_recurrent::Sequences seqs = kvreuse_recurrent::sequences(
      slots, starts, lens, tokens, std::min(states.size(0), conv_states.size(0)));
  const int64_t num_seqs = static_cast<int64_t>(seqs.slot.size());
  auto rounded = [round_to_bf16](float x) { return round_to_bf16 ? round_bf16(x) : x; };
  // 1. The convolution and SiLU (rounded where the model's dtype rounds it).
  at::Tensor conv_out = at::empty({tokens, channels}, mixed.options());
  float* cp = conv_out.data_ptr<float>();
  kvreuse_recurrent::conv_silu(mixed.data_ptr<float>(), conv_w.data_ptr<float>(), nullptr,
                               conv_states.data_ptr<float>(), conv_states.stride(0), layer * conv_states.stride(1), cp,
                               channels, kernel, seqs);
  // 2. Per row: the rounding, q and k L2-normalised per key head (q scaled), and the gates per value head.
  at::Tensor gates = at::empty({tokens, 2, value_heads}, mixed.options());  // g, beta
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>(), *lp = a_log.data_ptr<float>(),
              *dp = dt_bias.data_ptr<float>();
  float* gp = gates.data_ptr<float>();
  const float q_scale = 1.f / std::sqrt(static_cast<float>(key_dim));
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* values = cp + row * channels;
      if (round_to_bf16)
        for (int64_t c = 0; c < channels; ++c) values[c] = round_bf16(values[c]);
      for (int64_t part = 0; part < 2 * key_heads; ++part) {  // q heads, then k heads
        float* head = values + part * key_dim;
        const float inverse = 1.f / std::sqrt(kvreuse_recurrent::sum_of_squares(head, key_dim) + 1e-6f);
        for (int64_t i = 0; i < key_dim; ++i) head[i] = part < key_heads ? head[i] * inverse * q_scale : head[i] * inverse;
      }
      for (int64_t h = 0; h < value_heads; ++h) {
        const float x = ap[row * value_heads + h] + dp[h];
        const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
        gp[(row * 2) * value_heads + h] = -std::exp(lp[h]) * softplus;
        gp[(row * 2 + 1) * value_heads + h] = 1.f / (1.f + std::exp(-bp[row * value_heads + h]));
      }
    }
  });
  // 3. The delta rule per (sequence, value head), rows in order.
  at::Tensor out = at::empty({tokens, value_size}, mixed.options());
  float *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t ratio = value_heads / key_heads, matrix = key_dim * value_dim;
  const int64_t slot_stride = states.stride(0), layer_stride = states.stride(1);
  at::parallel_for(0, num_seqs * value_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> memory(value_dim), delta(value_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / value_heads, head = pair % value_heads;
      const int64_t key_head = tiled ? head % key_heads : head / ratio;
      float* state = sp + seqs.slot[seq] * slot_stride + layer * layer_stride + head * matrix;
      for (int64_t row = seqs.start[seq]; row < seqs.start[seq] + seqs.len[seq]; ++row) {
        const float* qt = cp + row * channels + key_head * key_dim;
        const float* kt = cp + row * channels + key_size + key_head * key_dim;
        const float* vt = cp + row * channels + 2 * key_size + head * value_dim;
        float* ot = op + row * value_size + head * value_dim;
        delta_token(state, qt, kt, vt, std::exp(gp[(row * 2) * value_heads + head]),
                    gp[(row * 2 + 1) * value_heads + head], key_dim, value_dim, memory.data(), delta.data(), ot);
      }
    }
  });
  // 4. Per (row, value head): RMS norm, the weight, SiLU(z).
  const float *zp = z.data_ptr<float>(), *wp = norm_w.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t h = 0; h < value_heads; ++h) {
        float* o = op + row * value_size + h * value_dim;
        const float* zt = zp + row * value_size + h * value_dim;
        if (round_to_bf16)
          for (int64_t j = 0; j < value_dim; ++j) o[j] = round_bf16(o[j]);
        const float scale =
            1.f / std::sqrt(kvreuse_recurrent::sum_of_squares(o, value_dim) / static_cast<float>(value_dim) + epsilon);
        for (int64_t j = 0; j < value_dim; ++j)
          o[j] = rounded(wp[j] * rounded(o[j] * scale)) * kvreuse_recurrent::silu(zt[j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvreuse_delta, m) {
  m.def("delta_mixer(Tensor mixed, Tensor z, Tensor a, Tensor b, Tensor conv_w, Tensor(a!) conv_states, Tensor a_log, "
        "Tensor dt_bias, Tensor norm_w, Tensor(b!) states, int layer, int[] slots, int[] starts, int[] lens, "
        "int key_heads, bool tiled, float eps, bool round_bf16) -> Tensor");
  m.def("pointwise_(Tensor(a!) x, int kind) -> ()");
  m.def("delta_gates(Tensor a, Tensor b, Tensor a_log, Tensor dt_bias) -> (Tensor, Tensor)");
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, int layer, "
        "int[] slots, int[] starts, int[] lens, bool tiled) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_delta, CPU, m) {
  m.impl("gated_delta_rule", &gated_delta_rule);
  m.impl("pointwise_", &pointwise_);
  m.impl("delta_gates", &delta_gates);
  m.impl("delta_mixer", &delta_mixer);
}

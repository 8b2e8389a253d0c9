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

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

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
        const float decay = std::exp(gp[row * value_heads + head]);
        const float b = bp[row * value_heads + head];
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
          delta[j] = (vt[j] - memory[j]) * b;
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

}  // namespace

TORCH_LIBRARY(kvreuse_delta, m) {
  m.def("pointwise_(Tensor(a!) x, int kind) -> ()");
  m.def("delta_gates(Tensor a, Tensor b, Tensor a_log, Tensor dt_bias) -> (Tensor, Tensor)");
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, int layer, "
        "int[] slots, int[] starts, int[] lens, bool tiled) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_delta, CPU, m) {
  m.impl("gated_delta_rule", &gated_delta_rule);
  m.impl("pointwise_", &pointwise_);
  m.impl("delta_gates", &delta_gates);
}

// Mamba-2's selective scan (Nemotron-H), token by token, each sequence's state in a slot of the pool.
//
// For every (sequence, head) pair, independently and in token order, with the head's B and C those of its group:
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max);  decay = exp(dt * A),  A = -exp(A_log)
//   S[p, n] = S[p, n] * decay + (dt * B[n]) * x[p];           y[p] = sum_n S[p, n] C[n] + D x[p]
// One pass over the head_dim x state_size state a token, the inner loop over n vectorised by the compiler
// (-O3 -march=native). The pairs are split over torch's threads; a pair's arithmetic does not depend on which other
// pairs run, nor on how its tokens were split into steps, so a sequence's output and state are the same bits whatever
// the batch, and a state snapshotted at token t and resumed is the state a cold run reaches there.
//
// Built at run time by kernels/mamba2_scan.py; the PyTorch reference is layers/mamba2.py's selective_scan_reference
// (tests compare the two).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

at::Tensor selective_scan(const at::Tensor& x, const at::Tensor& dt_raw, const at::Tensor& b, const at::Tensor& c,
                          const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& d, at::Tensor& states,
                          int64_t layer, at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef lens,
                          double dt_min, double dt_max) {
  for (const at::Tensor* t : {&x, &dt_raw, &b, &c, &a_log, &dt_bias, &d, static_cast<const at::Tensor*>(&states)}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "selective_scan: contiguous float32 tensors");
  }
  TORCH_CHECK(x.dim() == 3 && dt_raw.dim() == 2 && b.dim() == 3 && c.sizes() == b.sizes() && states.dim() == 5,
              "selective_scan: x [T, H, P], dt [T, H], B, C [T, G, N], state [slots, layers, H, P, N]");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t groups = b.size(1), state_size = b.size(2);
  TORCH_CHECK(dt_raw.size(0) == tokens && dt_raw.size(1) == heads && b.size(0) == tokens,
              "selective_scan: x, dt, B and C of one row count");
  TORCH_CHECK(heads % groups == 0, "selective_scan: heads a multiple of groups");
  TORCH_CHECK(a_log.numel() == heads && dt_bias.numel() == heads && d.numel() == heads,
              "selective_scan: A_log, dt_bias and D [H]");
  TORCH_CHECK(states.size(2) == heads && states.size(3) == head_dim && states.size(4) == state_size,
              "selective_scan: the state's shape does not match the heads");
  TORCH_CHECK(layer >= 0 && layer < states.size(1), "selective_scan: layer out of range");
  const int64_t num_seqs = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == num_seqs && static_cast<int64_t>(lens.size()) == num_seqs,
              "selective_scan: slots, starts and lens of one length");
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < states.size(0), "selective_scan: slot out of range");
    TORCH_CHECK(starts[i] >= 0 && lens[i] >= 0 && starts[i] + lens[i] <= tokens, "selective_scan: rows out of range");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt_raw.data_ptr<float>(), *bp = b.data_ptr<float>(),
              *cp = c.data_ptr<float>(), *alp = a_log.data_ptr<float>(), *dbp = dt_bias.data_ptr<float>(),
              *dp = d.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t matrix = head_dim * state_size, per_group = heads / groups;
  const int64_t slot_stride = states.stride(0), layer_stride = states.stride(1);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  std::vector<int64_t> slot_of(slots.begin(), slots.end()), start_of(starts.begin(), starts.end()),
      len_of(lens.begin(), lens.end());
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> db(state_size);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / heads, head = pair % heads, group = head / per_group;
      float* state = sp + slot_of[seq] * slot_stride + layer * layer_stride + head * matrix;
      const float a = -std::exp(alp[head]);
      for (int64_t row = start_of[seq]; row < start_of[seq] + len_of[seq]; ++row) {
        const float raw = dtp[row * heads + head] + dbp[head];
        const float dt = std::min(std::max(raw > 20.f ? raw : std::log1p(std::exp(raw)), lo), hi);  // torch's softplus
        const float decay = std::exp(dt * a);
        const float* bt = bp + (row * groups + group) * state_size;
        const float* ct = cp + (row * groups + group) * state_size;
        const float* xt = xp + (row * heads + head) * head_dim;
        float* yt = op + (row * heads + head) * head_dim;
        for (int64_t n = 0; n < state_size; ++n) db[n] = dt * bt[n];
        for (int64_t p = 0; p < head_dim; ++p) {
          float* s = state + p * state_size;
          const float xv = xt[p];
          float acc = 0.f;
          for (int64_t n = 0; n < state_size; ++n) {
            s[n] = s[n] * decay + db[n] * xv;
            acc += s[n] * ct[n];
          }
          yt[p] = acc + dp[head] * xv;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvreuse_mamba2, m) {
  m.def("selective_scan(Tensor x, Tensor dt, Tensor b, Tensor c, Tensor a_log, Tensor dt_bias, Tensor d, "
        "Tensor(a!) states, int layer, int[] slots, int[] starts, int[] lens, float dt_min, float dt_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_mamba2, CPU, m) { m.impl("selective_scan", &selective_scan); }

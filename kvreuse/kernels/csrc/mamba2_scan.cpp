// Mamba-2's selective scan (Nemotron-H), token by token, each sequence's state in a slot of the pool.
//
// For every (sequence, head) pair, independently and in token order, with the head's B and C those of its group:
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max);  decay = exp(dt * A),  A = -exp(A_log)
//   S[p, n] = S[p, n] * decay + (dt * B[n]) * x[p];           y[p] = sum_n S[p, n] C[n] + D x[p]
// One pass over the head_dim x state_size state a token, the inner loop over n vectorised by the compiler
// (-O3 -march=native; the readout's sum in lanes of a fixed order, update_and_read). The pairs are split over torch's threads; a pair's arithmetic does not depend on which other
// pairs run, nor on how its tokens were split into steps, so a sequence's output and state are the same bits whatever
// the batch, and a state snapshotted at token t and resumed is the state a cold run reaches there.
//
// Built at run time by kernels/mamba2_scan.py; the PyTorch reference is layers/mamba2.py's selective_scan_reference
// (tests compare the two).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "recurrent_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using kvreuse_recurrent::kLanes;
using kvreuse_recurrent::sum_of_squares;

// One state row's update and readout: s[n] = s[n] * decay + db[n] * x; returns sum_n s[n] c[n].
inline float update_and_read(float* s, const float* db, const float* c, float decay, float x, int64_t size) {
  float lanes[kLanes] = {};
  int64_t n = 0;
  for (; n + kLanes <= size; n += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float value = s[n + l] * decay + db[n + l] * x;
      s[n + l] = value;
      lanes[l] += value * c[n + l];
    }
  }
  float total = 0.f;
  for (; n < size; ++n) {
    const float value = s[n] * decay + db[n] * x;
    s[n] = value;
    total += value * c[n];
  }
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// One token's step of one head: the time step (softplus of dt + dt_bias, as PyTorch computes it, clamped), the decay,
// every state row updated and read out against C, plus D's skip. `db` is scratch of state_size floats.
inline void scan_token(float* state, const float* x, const float* b, const float* c, float dt_raw, float dt_bias,
                       float a, float d, float lo, float hi, int64_t head_dim, int64_t state_size, float* db, float* y) {
  const float raw = dt_raw + dt_bias;
  const float step = std::min(std::max(raw > 20.f ? raw : std::log1p(std::exp(raw)), lo), hi);
  const float decay = std::exp(step * a);
  for (int64_t n = 0; n < state_size; ++n) db[n] = step * b[n];
  for (int64_t p = 0; p < head_dim; ++p) y[p] = update_and_read(state + p * state_size, db, c, decay, x[p], state_size) + d * x[p];
}

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
  const kvreuse_recurrent::Sequences seqs = kvreuse_recurrent::sequences(slots, starts, lens, tokens, states.size(0));
  const int64_t num_seqs = static_cast<int64_t>(seqs.slot.size());
  const std::vector<int64_t>&slot_of = seqs.slot, &start_of = seqs.start, &len_of = seqs.len;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt_raw.data_ptr<float>(), *bp = b.data_ptr<float>(),
              *cp = c.data_ptr<float>(), *alp = a_log.data_ptr<float>(), *dbp = dt_bias.data_ptr<float>(),
              *dp = d.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t matrix = head_dim * state_size, per_group = heads / groups;
  const int64_t slot_stride = states.stride(0), layer_stride = states.stride(1);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> db(state_size);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / heads, head = pair % heads, group = head / per_group;
      float* state = sp + slot_of[seq] * slot_stride + layer * layer_stride + head * matrix;
      const float a = -std::exp(alp[head]);
      for (int64_t row = start_of[seq]; row < start_of[seq] + len_of[seq]; ++row) {
        scan_token(state, xp + (row * heads + head) * head_dim, bp + (row * groups + group) * state_size,
                   cp + (row * groups + group) * state_size, dtp[row * heads + head], dbp[head], a, dp[head], lo, hi,
                   head_dim, state_size, db.data(), op + (row * heads + head) * head_dim);
      }
    }
  });
  return out;
}

// The whole Mamba-2 mixer between its two projections, for every row of a step (prefill and decode alike): the
// causal depthwise convolution of x|B|C (K taps, a bias, SiLU), its last K - 1 inputs left in the sequence's slot;
// the selective scan above; then y * SiLU(z), RMS-normalised per group of `norm_groups` equal slices and scaled by
// the norm's weight. Every value is computed the same way whatever row it is in and whatever the step holds (a
// channel's taps summed in tap order, a group's squares in channel order, the scalar exp), so a token's output is
// the same bits in a prefill chunk, a decode step or a resumed run: what hit invariance needs, in one call instead
// of ~40 small PyTorch ops a layer. The PyTorch reference is layers/mamba2.py's op-by-op path.
at::Tensor mixer(const at::Tensor& xbc, const at::Tensor& z, const at::Tensor& dt_raw, const at::Tensor& conv_w,
                 const c10::optional<at::Tensor>& conv_b, at::Tensor& conv_states, const at::Tensor& a_log,
                 const at::Tensor& dt_bias, const at::Tensor& d, const at::Tensor& norm_w, at::Tensor& states,
                 int64_t layer, at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef lens, int64_t heads,
                 int64_t groups, int64_t norm_groups, double eps, double dt_min, double dt_max) {
  for (const at::Tensor* t : {&xbc, &z, &dt_raw, &conv_w, &a_log, &dt_bias, &d, &norm_w,
                              static_cast<const at::Tensor*>(&conv_states), static_cast<const at::Tensor*>(&states)}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "mamba2 mixer: contiguous float32 tensors");
  }
  const int64_t tokens = xbc.size(0), channels = xbc.size(1), inner = z.size(1);
  TORCH_CHECK(states.dim() == 5 && states.size(2) == heads && conv_states.dim() == 4, "mamba2 mixer: state shapes");
  const int64_t head_dim = states.size(3), state_size = states.size(4), kernel = conv_w.size(1);
  TORCH_CHECK(inner == heads * head_dim && channels == inner + 2 * groups * state_size && conv_w.size(0) == channels &&
                  conv_states.size(2) == kernel - 1 && conv_states.size(3) == channels && z.size(0) == tokens &&
                  dt_raw.size(0) == tokens && dt_raw.size(1) == heads && norm_w.numel() == inner &&
                  inner % norm_groups == 0 && heads % groups == 0,
              "mamba2 mixer: shapes do not agree");
  TORCH_CHECK(!conv_b.has_value() || (conv_b->scalar_type() == at::kFloat && conv_b->is_contiguous() &&
                                      conv_b->numel() == channels),
              "mamba2 mixer: conv bias [C] float32");
  const int64_t num_seqs = static_cast<int64_t>(slots.size());
  TORCH_CHECK(layer >= 0 && layer < states.size(1) && layer < conv_states.size(1), "mamba2 mixer: layer out of range");
  const kvreuse_recurrent::Sequences seqs = kvreuse_recurrent::sequences(slots, starts, lens, tokens,
                                                                         std::min(states.size(0), conv_states.size(0)));
  const std::vector<int64_t>&slot_of = seqs.slot, &start_of = seqs.start, &len_of = seqs.len;
  // 1. The convolution and SiLU, per (sequence, channel), rows in order; the slot keeps the last K - 1 inputs.
  at::Tensor mixed = at::empty({tokens, channels}, xbc.options());
  float* mp = mixed.data_ptr<float>();
  kvreuse_recurrent::conv_silu(xbc.data_ptr<float>(), conv_w.data_ptr<float>(),
                               conv_b.has_value() ? conv_b->data_ptr<float>() : nullptr, conv_states.data_ptr<float>(),
                               conv_states.stride(0), layer * conv_states.stride(1), mp, channels, kernel, seqs);
  // 2. The scan over the convolved x, B and C (views of `mixed`'s rows).
  at::Tensor y = at::empty({tokens, inner}, xbc.options());
  const float *dtp = dt_raw.data_ptr<float>(), *alp = a_log.data_ptr<float>(), *dbp = dt_bias.data_ptr<float>(),
              *dp = d.data_ptr<float>();
  float *sp = states.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t matrix = head_dim * state_size, per_group = heads / groups;
  const int64_t slot_stride = states.stride(0), layer_stride = states.stride(1);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> db(state_size);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / heads, head = pair % heads, group = head / per_group;
      float* state = sp + slot_of[seq] * slot_stride + layer * layer_stride + head * matrix;
      const float a = -std::exp(alp[head]);
      for (int64_t row = start_of[seq]; row < start_of[seq] + len_of[seq]; ++row) {
        const float* x = mp + row * channels;  // x | B | C after the convolution
        scan_token(state, x + head * head_dim, x + inner + group * state_size,
                   x + inner + groups * state_size + group * state_size, dtp[row * heads + head], dbp[head], a, dp[head],
                   lo, hi, head_dim, state_size, db.data(), yp + row * inner + head * head_dim);
      }
    }
  });
  // 3. y * SiLU(z), normalised per group, scaled: per row, in place.
  const float *zp = z.data_ptr<float>(), *np = norm_w.data_ptr<float>();
  const int64_t group_size = inner / norm_groups;
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* yt = yp + row * inner;
      const float* zt = zp + row * inner;
      for (int64_t i = 0; i < inner; ++i) yt[i] = yt[i] * kvreuse_recurrent::silu(zt[i]);
      for (int64_t g = 0; g < norm_groups; ++g) {
        float* part = yt + g * group_size;
        const float squares = sum_of_squares(part, group_size);
        const float scale = 1.f / std::sqrt(squares / static_cast<float>(group_size) + epsilon);
        for (int64_t i = 0; i < group_size; ++i) part[i] = np[g * group_size + i] * (part[i] * scale);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(kvreuse_mamba2, m) {
  m.def("mixer(Tensor xbc, Tensor z, Tensor dt, Tensor conv_w, Tensor? conv_b, Tensor(a!) conv_states, Tensor a_log, "
        "Tensor dt_bias, Tensor d, Tensor norm_w, Tensor(b!) states, int layer, int[] slots, int[] starts, int[] lens, "
        "int heads, int groups, int norm_groups, float eps, float dt_min, float dt_max) -> Tensor");
  m.def("selective_scan(Tensor x, Tensor dt, Tensor b, Tensor c, Tensor a_log, Tensor dt_bias, Tensor d, "
        "Tensor(a!) states, int layer, int[] slots, int[] starts, int[] lens, float dt_min, float dt_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_mamba2, CPU, m) {
  m.impl("selective_scan", &selective_scan);
  m.impl("mixer", &mixer);
}

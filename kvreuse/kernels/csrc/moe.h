// A mixture-of-experts layer's rows in one call, shared by the MoE layer (moe.cpp, layers/experts.py) and the native
// decode step (decoder_layer.cpp), over the kernels that already exist, found in the dispatcher by name.
//
//   Qwen3-MoE:
//   probabilities = softmax(x @ router^T) in float32    at::linear (the router held in float32), at::softmax
//   weights, ids  = top_k(probabilities) (renormalised)  at::topk
//   for each expert routed to, ascending:                rows grouped by expert (one counting sort)
//     y = down(silu(gate(x_rows)) * up(x_rows))          kvreuse_cpu::qlinear / qlinear_int8 or at::linear;
//                                                        kvreuse_fused::silu_mul; where every routed expert
//                                                        runs on one quantized GEMV kernel, all of them in
//                                                        one call per product (qlinear_grouped,
//                                                        qlinear_int8_grouped)
//     out[rows] += y * weights                           a loop rounding as transformers' mul and index_add_ do
//   out += sigmoid(x @ shared_gate^T)                    Qwen3.5-MoE's shared expert: its two products as an
//          * down(silu(gate_up(x)))                      expert's, at::linear, at::sigmoid, mul and add_
//
//   gpt-oss (the same, but):
//   logits        = x @ router^T + bias                  at::linear
//   top, ids      = top_k(logits); weights = softmax(top) in the logits' dtype
//   gate|up       = x_rows @ W^T + b, down likewise      the product, then `out + bias` (quantized) as
//                                                        QuantizedLinearKernel adds it, or at::linear's bias
//   h             = clamped_swiglu(gate, up)             kvreuse_fused::clamped_swiglu, as layers.py's GatedMLP
//                                                        calls it (the biases added in one loop, as add_ rounds)
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace kvreuse_moe {

struct MoEKernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)> qlinear, qlinear_int8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, c10::IntArrayRef, at::TensorList, int64_t, int64_t)>
      qlinear_grouped, qlinear_int8_grouped;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, double, double)> clamped_swiglu;
};

inline const MoEKernels& moe_kernels() {
  static const MoEKernels k{
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_cpu::qlinear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_cpu::qlinear_int8", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_cpu::qlinear_grouped", "")
          .typed<at::Tensor(const at::Tensor&, c10::IntArrayRef, at::TensorList, int64_t, int64_t)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_cpu::qlinear_int8_grouped", "")
          .typed<at::Tensor(const at::Tensor&, c10::IntArrayRef, at::TensorList, int64_t, int64_t)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_fused::silu_mul", "").typed<at::Tensor(const at::Tensor&)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvreuse_fused::clamped_swiglu", "")
          .typed<at::Tensor(const at::Tensor&, double, double)>(),
  };
  return k;
}

// layers/experts.py's KERNEL_CODES: how a product runs at a row count.
enum MoEKernel : int64_t { kMoEQdot = 0, kMoEQdot8 = 1, kMoEPlain = 2 };

// One kind of expert matrix (gate|up, or down) of every expert, and the kernel for each row count.
struct ExpertProduct {
  std::vector<at::Tensor> weights;  // per expert: a quantized weight's blocks, or a float weight
  int64_t format = -1;               // the quantized format's code; -1: float weights (at::linear)
  int64_t in_features = 0;
  std::vector<int64_t> kernel_by_rows;  // [r - 1]: the kernel for r rows; past the end, the last one
  std::vector<at::Tensor> biases;       // per expert (gpt-oss), or none

  // x @ W^T (+ b), as layers/linear.py's Linear computes it: at::linear with the bias for float weights
  // (F.linear), the quantized product and then `out + bias` (QuantizedLinearKernel).
  at::Tensor run(const MoEKernels& k, int64_t expert, const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    const int64_t code = kernel_by_rows[std::min<int64_t>(rows, kernel_by_rows.size()) - 1];
    const at::Tensor& w = weights[expert];
    const bool biased = !biases.empty();
    at::Tensor out;
    switch (code) {
      case kMoEQdot: out = k.qlinear.call(x, w, format, in_features); break;
      case kMoEQdot8: out = k.qlinear_int8.call(x, w, format, in_features); break;
      case kMoEPlain: return biased ? at::linear(x, w, biases[expert]) : at::linear(x, w);
      default: TORCH_CHECK(false, "moe: unknown kernel code ", code);
    }
    return biased ? at::add(out, biases[expert]) : out;
  }

  int64_t kernel_for(int64_t rows) const { return kernel_by_rows[std::min<int64_t>(rows, kernel_by_rows.size()) - 1]; }

  // Whether every routed expert's product (counts[i] rows each) runs on a quantized GEMV kernel (qdot or qdot8)
  // at its row count, so `run_grouped` can make it.
  bool groups(const std::vector<int64_t>& counts) const {
    if (format < 0) return false;
    for (const int64_t count : counts) {
      const int64_t code = kernel_for(count);
      if (code != kMoEQdot && code != kMoEQdot8) return false;
    }
    return true;
  }

  // The routed experts' products at once, x's rows grouped by expert (counts[i] rows for experts[i], in that
  // order): one kvreuse_cpu::qlinear_grouped / qlinear_int8_grouped call for the experts on each kernel (one
  // call where their row counts pick one kernel; otherwise each kernel's experts' rows gathered, multiplied
  // and put back in place), each expert's bias then added to its rows as `run` adds it. Numbers as `run` per
  // expert, bit for bit. `groups(counts)` must hold.
  at::Tensor run_grouped(const MoEKernels& k, const std::vector<int64_t>& experts, const std::vector<int64_t>& counts,
                         const at::Tensor& x) const {
    std::vector<int64_t> first(counts.size() + 1, 0);
    for (size_t i = 0; i < counts.size(); ++i) first[i + 1] = first[i] + counts[i];
    const auto product = [&](int64_t code, const std::vector<size_t>& which, const at::Tensor& rows) {
      std::vector<at::Tensor> ws;
      std::vector<int64_t> row_counts;
      for (const size_t i : which) ws.push_back(weights[experts[i]]), row_counts.push_back(counts[i]);
      return code == kMoEQdot8 ? k.qlinear_int8_grouped.call(rows, row_counts, ws, format, in_features)
                               : k.qlinear_grouped.call(rows, row_counts, ws, format, in_features);
    };
    std::vector<size_t> on_qdot, on_qdot8;
    for (size_t i = 0; i < counts.size(); ++i) (kernel_for(counts[i]) == kMoEQdot8 ? on_qdot8 : on_qdot).push_back(i);
    at::Tensor out;
    if (on_qdot.empty() || on_qdot8.empty()) {
      out = product(on_qdot.empty() ? kMoEQdot8 : kMoEQdot, on_qdot.empty() ? on_qdot8 : on_qdot, x);
    } else {
      out = at::empty({x.size(0), weights[experts[0]].size(0)}, x.options());
      for (const auto& [code, which] : {std::pair{kMoEQdot, &on_qdot}, std::pair{kMoEQdot8, &on_qdot8}}) {
        std::vector<int64_t> rows;
        for (const size_t i : *which) {
          for (int64_t r = first[i]; r < first[i + 1]; ++r) rows.push_back(r);
        }
        const at::Tensor index = at::tensor(rows, x.options().dtype(at::kLong));
        out.index_copy_(0, index, product(code, *which, x.index_select(0, index)));
      }
    }
    if (!biases.empty()) add_biases(out, experts, first);
    return out;
  }

  // out's rows [first[i], first[i + 1]) += biases[experts[i]], each sum rounded to out's dtype as add_ rounds it
  // (in float32, then to nearest even): one loop, where a narrow and an add_ per expert were two dispatched
  // calls each, at a decode row as long as the sums. Biases of another dtype take the ATen ops.
  void add_biases(at::Tensor& out, const std::vector<int64_t>& experts, const std::vector<int64_t>& first) const {
    const int64_t width = out.size(1);
    for (size_t i = 0; i < experts.size(); ++i) {
      const at::Tensor& b = biases[experts[i]];
      if (b.scalar_type() != out.scalar_type() || !b.is_contiguous() || !out.is_contiguous()) {
        out.narrow(0, first[i], first[i + 1] - first[i]).add_(b);
        continue;
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_bias", [&] {
        const scalar_t* bp = b.const_data_ptr<scalar_t>();
        scalar_t* o = out.mutable_data_ptr<scalar_t>();
        for (int64_t r = first[i]; r < first[i + 1]; ++r) {
          scalar_t* row = o + r * width;
          for (int64_t c = 0; c < width; ++c) {
            row[c] = static_cast<scalar_t>(static_cast<float>(row[c]) + static_cast<float>(bp[c]));
          }
        }
      });
    }
  }
};

// One layer's experts and router.
struct MoEWeights {
  at::Tensor router;  // [experts, hidden], the model's dtype
  ExpertProduct gate_up, down;
  int64_t top_k = 1;
  bool norm_topk_prob = false;
  // gpt-oss: the router's bias, the softmax over the top k logits (in their dtype), the clamped SwiGLU.
  std::optional<at::Tensor> router_bias;
  bool softmax_after_topk = false;
  std::optional<double> swiglu_limit;  // set: clamped_swiglu; none: SiLU
  double swiglu_alpha = 1.702;
  int64_t intermediate = 0;
  // Qwen3.5-MoE's shared expert beside the routed ones (set_shared_expert): out += sigmoid(x @ gate^T) *
  // down(silu(gate_up(x))), as layers/experts.py's SparseMoE.forward adds it.
  std::optional<ExpertProduct> shared_gate_up, shared_down;
  at::Tensor shared_gate;  // [1, hidden], the model's dtype; undefined: no shared expert
};

// The shared expert's products (one weight each, with their kernels per row count) and its gate.
inline void set_shared_expert(MoEWeights& m, at::Tensor gate_up, int64_t gate_up_format,
                              std::vector<int64_t> gate_up_kernels, at::Tensor down, int64_t down_format,
                              std::vector<int64_t> down_kernels, int64_t intermediate, at::Tensor gate) {
  const int64_t hidden = m.router.size(1);
  TORCH_CHECK(!gate_up_kernels.empty() && !down_kernels.empty(), "moe: a shared expert kernel for at least one row count");
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == 1 && gate.size(1) == hidden, "moe: the shared expert gate must be [1, hidden]");
  TORCH_CHECK(!m.swiglu_limit, "moe: a shared expert runs SiLU experts only");
  m.shared_gate_up = ExpertProduct{{std::move(gate_up)}, gate_up_format, hidden, std::move(gate_up_kernels), {}};
  m.shared_down = ExpertProduct{{std::move(down)}, down_format, intermediate, std::move(down_kernels), {}};
  m.shared_gate = std::move(gate);
}

inline MoEWeights make_moe_weights(at::Tensor router, std::vector<at::Tensor> gate_up_weights, int64_t gate_up_format,
                                   std::vector<int64_t> gate_up_kernels, std::vector<at::Tensor> down_weights,
                                   int64_t down_format, std::vector<int64_t> down_kernels, int64_t hidden,
                                   int64_t intermediate, int64_t top_k, bool norm_topk_prob,
                                   std::optional<at::Tensor> router_bias, bool softmax_after_topk,
                                   std::vector<at::Tensor> gate_up_biases, std::vector<at::Tensor> down_biases,
                                   std::optional<double> swiglu_limit, double swiglu_alpha) {
  const int64_t experts = router.size(0);
  TORCH_CHECK(router.dim() == 2 && router.size(1) == hidden, "moe: router must be [experts, hidden]");
  TORCH_CHECK(static_cast<int64_t>(gate_up_weights.size()) == experts &&
              static_cast<int64_t>(down_weights.size()) == experts, "moe: one gate|up and one down weight per expert");
  TORCH_CHECK(!gate_up_kernels.empty() && !down_kernels.empty(), "moe: a kernel for at least one row count");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe: top_k must be between 1 and the expert count");
  TORCH_CHECK(gate_up_biases.empty() || static_cast<int64_t>(gate_up_biases.size()) == experts,
              "moe: gate|up biases: one per expert or none");
  TORCH_CHECK(down_biases.empty() || static_cast<int64_t>(down_biases.size()) == experts,
              "moe: down biases: one per expert or none");
  for (const at::Tensor& b : gate_up_biases) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == 2 * intermediate, "moe: a gate|up bias must be [2 * intermediate]");
  }
  for (const at::Tensor& b : down_biases) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == hidden, "moe: a down bias must be [hidden]");
  }
  TORCH_CHECK(!router_bias || (router_bias->dim() == 1 && router_bias->size(0) == experts),
              "moe: the router bias must be [experts]");
  TORCH_CHECK(!swiglu_limit || *swiglu_limit > 0, "moe: swiglu_limit must be positive");
  MoEWeights m{std::move(router),
               ExpertProduct{std::move(gate_up_weights), gate_up_format, hidden, std::move(gate_up_kernels),
                             std::move(gate_up_biases)},
               ExpertProduct{std::move(down_weights), down_format, intermediate, std::move(down_kernels),
                             std::move(down_biases)},
               top_k, norm_topk_prob};
  m.router_bias = std::move(router_bias);
  m.softmax_after_topk = softmax_after_topk;
  m.swiglu_limit = swiglu_limit;
  m.swiglu_alpha = swiglu_alpha;
  m.intermediate = intermediate;
  return m;
}

inline at::Tensor moe_forward(const MoEWeights& m, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == m.router.size(1), "moe: x must be contiguous [rows, hidden]");
  const MoEKernels& k = moe_kernels();
  const int64_t rows = x.size(0), experts = m.router.size(0);
  at::Tensor weights, ids;
  // The router's logits in its dtype (float32: layers/experts.py says why).
  const at::Tensor logits = at::linear(x.to(m.router.scalar_type()), m.router, m.router_bias);
  if (m.softmax_after_topk) {  // gpt-oss's GptOssTopKRouter: softmax over the top k logits, in their dtype
    auto [top, chosen] = at::topk(logits, m.top_k, -1);
    weights = at::softmax(top, -1, top.scalar_type());
    ids = chosen;
  } else {
    at::Tensor probabilities = at::softmax(logits, -1, at::kFloat);
    std::tie(weights, ids) = at::topk(probabilities, m.top_k, -1);
    if (m.norm_topk_prob) weights.div_(weights.sum(-1, true));
  }
  // The weights as float32 (exact for any float dtype they come in); each is rounded to the model's dtype where
  // it is used, as transformers' `weights.to(x.dtype)` rounds it.
  const at::Tensor weights_f = weights.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros_like(x);

  // The (row, choice) pairs grouped by expert, rows ascending within each (a stable counting sort).
  const int64_t pairs = rows * m.top_k;
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++start[id[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  at::Tensor order = at::empty({pairs}, ids.options());  // pair indices, grouped by expert
  int64_t* slot = order.data_ptr<int64_t>();
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) slot[next[id[p]]++] = p;
  at::Tensor pair_rows = at::empty({pairs}, ids.options());  // each pair's row, in that order
  int64_t* prow = pair_rows.mutable_data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) prow[p] = slot[p] / m.top_k;

  std::vector<int64_t> routed, counts;  // the experts with rows, ascending, and their row counts
  for (int64_t e = 0; e < experts; ++e) {
    if (start[e + 1] > start[e]) routed.push_back(e), counts.push_back(start[e + 1] - start[e]);
  }
  // y: each (row, choice) pair's expert output, in pair order (grouped by expert), or per expert.
  at::Tensor grouped_y;
  std::vector<at::Tensor> results(routed.size());
  if (m.gate_up.groups(counts) && m.down.groups(counts)) {
    // Every routed expert on a quantized GEMV kernel: each of the two products is one parallel region over all
    // the experts' output rows per kernel (qlinear_grouped / qlinear_int8_grouped), and the activation one
    // call over all the pairs' rows.
    const at::Tensor xs = x.index_select(0, pair_rows);
    const at::Tensor gate_up = m.gate_up.run_grouped(k, routed, counts, xs);
    const at::Tensor h = m.swiglu_limit ? k.clamped_swiglu.call(gate_up, *m.swiglu_limit, m.swiglu_alpha)
                                        : k.silu_mul.call(gate_up);
    grouped_y = m.down.run_grouped(k, routed, counts, h.contiguous());
  } else {
    // Quantized experts side by side on the threads, each expert's two products on one thread: a decode
    // row's expert is a few hundred kB of weights, too little to split each product between threads
    // without the fork and join costing more than the split saves. A product called inside the parallel
    // region runs on its thread alone; its outputs do not depend on how its rows are split, so the numbers
    // are the same either way. Float weights' products (the library GEMM) may sum in another order on one
    // thread than on several, so they keep the Python loop's threading: one expert after another.
    auto run_experts = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t e = routed[i], count = counts[i];
        at::Tensor xe = rows == 1 ? x : x.index_select(0, pair_rows.narrow(0, start[e], count));
        const at::Tensor gate_up = m.gate_up.run(k, e, xe);
        const at::Tensor h = m.swiglu_limit ? k.clamped_swiglu.call(gate_up.contiguous(), *m.swiglu_limit, m.swiglu_alpha)
                                            : k.silu_mul.call(gate_up);
        results[i] = m.down.run(k, e, h).contiguous();
      }
    };
    if (m.gate_up.format >= 0 && m.down.format >= 0) {
      at::parallel_for(0, static_cast<int64_t>(routed.size()), 1, run_experts);
    } else {
      run_experts(0, static_cast<int64_t>(routed.size()));
    }
  }
  // out[row] += y * weight, in ascending expert order, each product and each sum rounded to the model's dtype
  // as transformers' `y * weights` and `index_add_` round them; a loop, not those two ops per expert: at a
  // decode row they cost ~12 us an expert in dispatch and allocation, a tenth of the layer.
  const int64_t hidden = x.size(1);
  const float* pw = weights_f.const_data_ptr<float>();  // by (row, choice), pair p's at slot[p]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_accumulate", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    // The products go through memory before the sums, in two loops: one expression would let the compiler
    // fuse them into an FMA (-ffp-contract=fast), rounding once where transformers rounds twice.
    std::vector<scalar_t> product(hidden);
    for (size_t i = 0; i < routed.size(); ++i) {
      const int64_t e = routed[i];
      const scalar_t* y = grouped_y.defined() ? grouped_y.const_data_ptr<scalar_t>() + start[e] * hidden
                                              : results[i].const_data_ptr<scalar_t>();
      for (int64_t p = start[e]; p < start[e + 1]; ++p) {
        const scalar_t w = static_cast<scalar_t>(pw[slot[p]]);  // the weight as the model's dtype rounds it
        scalar_t* row = o + prow[p] * hidden;
        const scalar_t* yr = y + (p - start[e]) * hidden;
        for (int64_t c = 0; c < hidden; ++c) product[c] = yr[c] * w;
        for (int64_t c = 0; c < hidden; ++c) row[c] = row[c] + product[c];
      }
    }
  });
  if (m.shared_gate.defined()) {  // the same ops as SparseMoE.forward's, so the same bits
    const at::Tensor y = m.shared_down->run(k, 0, k.silu_mul.call(m.shared_gate_up->run(k, 0, x)));
    // The gate's sigmoid on rows of 64 copies (layers/experts.py's shared_expert_scale: every value in eager
    // sigmoid's vector body, so a row's bits do not follow the row count).
    const at::Tensor logit = at::linear(x, m.shared_gate).expand({-1, 64}).contiguous();
    out.add_(at::mul(at::sigmoid(logit).narrow(1, 0, 1), y));
  }
  return out;
}

}  // namespace kvreuse_moe

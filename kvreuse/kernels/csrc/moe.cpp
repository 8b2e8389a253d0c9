// The mixture-of-experts layer in one call from Python (layers/experts.py), as ``torch.classes.kvreuse_moe.Experts``.
//
// Run from Python, a decode row's MoE layer is the router, a softmax, a top-k, and then for each of its k
// experts (8 for Qwen3-30B-A3B) two products, the SiLU and a weighted add: about forty operator calls per
// layer, each paying the interpreter, the module and argument handling and torch's Python binding. On a
// 2-core CPU that cost as much as the expert products themselves (qwen3-moe-1b Q8_0: 12 of 26 ms a token).
// `Experts` makes the same calls from C++ (moe.h, which the native decode step shares), in the same order,
// with the same kernels, so its numbers are the Python path's bit for bit. It holds one layer's expert
// weights and the kernel each product runs at each row count (the plan book's picks, made once), and gpt-oss's
// extras where it has them: the router's bias and softmax over its top k, the experts' biases, the clamped SwiGLU;
// and Qwen3.5-MoE's shared expert with its gate (`set_shared_expert`), which ran from Python beside this call.
#include "moe.h"

#include <torch/custom_class.h>
#include <torch/library.h>

namespace {

struct Experts : torch::CustomClassHolder {
  kvreuse_moe::MoEWeights weights;

  Experts(at::Tensor router, std::vector<at::Tensor> gate_up_weights, int64_t gate_up_format,
          std::vector<int64_t> gate_up_kernels, std::vector<at::Tensor> down_weights, int64_t down_format,
          std::vector<int64_t> down_kernels, int64_t hidden, int64_t intermediate, int64_t top_k, bool norm_topk_prob,
          std::optional<at::Tensor> router_bias, bool softmax_after_topk, std::vector<at::Tensor> gate_up_biases,
          std::vector<at::Tensor> down_biases, std::optional<double> swiglu_limit, double swiglu_alpha)
      : weights(kvreuse_moe::make_moe_weights(std::move(router), std::move(gate_up_weights), gate_up_format,
                                              std::move(gate_up_kernels), std::move(down_weights), down_format,
                                              std::move(down_kernels), hidden, intermediate, top_k, norm_topk_prob,
                                              std::move(router_bias), softmax_after_topk, std::move(gate_up_biases),
                                              std::move(down_biases), swiglu_limit, swiglu_alpha)) {}

  void set_shared_expert(at::Tensor gate_up, int64_t gate_up_format, std::vector<int64_t> gate_up_kernels,
                         at::Tensor down, int64_t down_format, std::vector<int64_t> down_kernels, int64_t intermediate,
                         at::Tensor gate) {
    kvreuse_moe::set_shared_expert(weights, std::move(gate_up), gate_up_format, std::move(gate_up_kernels),
                                   std::move(down), down_format, std::move(down_kernels), intermediate, std::move(gate));
  }

  at::Tensor forward(const at::Tensor& x) { return kvreuse_moe::moe_forward(weights, x); }
};

}  // namespace

TORCH_LIBRARY(kvreuse_moe, m) {
  m.class_<Experts>("Experts")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, int64_t, std::vector<int64_t>, std::vector<at::Tensor>,
                       int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t, bool, std::optional<at::Tensor>, bool,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::optional<double>, double>())
      .def("set_shared_expert", &Experts::set_shared_expert)
      .def("forward", &Experts::forward);
}

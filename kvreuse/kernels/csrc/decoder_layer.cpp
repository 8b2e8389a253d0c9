// A decode step's decoder layers in one call (runner/decode/native_step.py), over the kernels that already exist.
//
// Run from Python, one decode row's layer is about ten operator calls (norm, products, rotary, attention,
// norm, products, SiLU, product, residual adds), each paying the interpreter, the module and argument
// handling and torch's Python binding: for a 135M model that overhead is as large as the arithmetic.
// `DecodeLayers` makes the same calls from C++ through torch's dispatcher, in the same order, with the same
// kernels, so its numbers are the Python path's bit for bit:
//
//   normed = rms_norm(hidden)                           kvreuse_fused::rms_norm
//   qkv    = normed @ Wqkv^T (+ bias)                   per part: kvreuse_cpu::qlinear / qlinear_int8 /
//                                                       rowdot, or at::linear on a float weight
//   q/k norms and rotary, in place on qkv               kvreuse_fused::rotary_
//   K/V stored, attention over the paged context        kvreuse_attn::paged_attention (fused store)
//   hidden += o_proj(attention); normed = rms_norm      kvreuse_fused::rms_norm with its residual
//   hidden += down(silu(gate) * up)                     kvreuse_fused::silu_mul, products as above
//     or, in a mixture-of-experts layer, its experts   moe.h (the MoE layer's own code, layers/experts.py)
//
// It holds every layer's weights, norms and KV pools for one row count (`add_layer`, once), so a decode
// step is one call from Python for the whole model (`run`), not one per layer.
//
// The kernels live in their own libraries (quant, rowdot, fused_ops, paged_attention); they are loaded
// first, and this one finds them by name in the dispatcher once per process.
//
// A hybrid's conv layer (LFM2: `add_conv_layer`) has the same norms and MLP around its gated short convolution in the
// attention's place: in_proj, kvreuse_fused::short_conv over the pool's planes (each row's K inputs by slot, the taps
// found once a step from the block tables, as ConvTaps finds them), out_proj.
//
// Qwen3.5's layers (`set_offset_norms`, `set_gated_attention`, `add_delta_layer`) are the op-by-op path's calls too:
// every norm a float32 (1 + weight) scale (kvreuse_fused::rms_norm_float_scale); a gated attention layer's query and
// gate side by side per head, q/k norms, rotary over the first rotary_dim of each head and the sigmoid gate on the
// output made of the same ATen ops as models/qwen3_5.py's GatedAttention; a Gated DeltaNet layer's mixer the one
// native call layers/gated_delta.py makes (kvreuse_delta::delta_mixer), over the state slots `run` is given.
//
// Nemotron-H's blocks (`add_block`, `add_mamba_block`) are one norm, one mixer and the residual each: grouped-query
// attention without rotary, the squared-ReLU MLP, or Mamba-2 through the one native call layers/mamba2.py makes
// (kvreuse_mamba2::mixer); its norms are float32 scales too (set_offset_norms: rms_norm_float_scale by the weight).
//
// A layer's attention is plain (the whole causal context, scale 1 / sqrt(head_dim), no sinks) unless
// `set_attention` gives it what its `LayerAttention` holds: a sliding window, a softmax scale of its own,
// learned sinks (gpt-oss), and the output projection's bias; the kernel takes the first three as the
// op-by-op path hands them to it, and the bias is added as the Linear adds it.
#include "moe.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

// The kernels' signatures exactly as their libraries implement them (the dispatcher checks).
struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)> qlinear, qlinear_int8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)> rowdot;
  c10::TypedOperatorHandle<at::Tensor(at::Tensor, const at::Tensor&, double, const OptTensor&)> rms_norm,
      rms_norm_float_scale;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                int64_t, const OptTensor&, const OptTensor&, double)> rotary;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, at::Tensor,
                                      const at::Tensor&, const at::Tensor&)> short_conv;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, at::Tensor, at::Tensor, const OptTensor&,
                                const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t, int64_t, double, int64_t, const OptTensor&, int64_t,
                                const OptTensor&, const OptTensor&, const OptTensor&)> paged_attention;
};

template <class Fn>
c10::TypedOperatorHandle<Fn> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

const Kernels& kernels() {
  static const Kernels k{
      find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>("kvreuse_cpu::qlinear"),
      find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>("kvreuse_cpu::qlinear_int8"),
      find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("kvreuse_cpu::rowdot"),
      find<at::Tensor(at::Tensor, const at::Tensor&, double, const OptTensor&)>("kvreuse_fused::rms_norm"),
      find<at::Tensor(at::Tensor, const at::Tensor&, double, const OptTensor&)>("kvreuse_fused::rms_norm_float_scale"),
      find<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                const OptTensor&, const OptTensor&, double)>("kvreuse_fused::rotary_"),
      find<at::Tensor(const at::Tensor&)>("kvreuse_fused::silu_mul"),
      find<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, at::Tensor, const at::Tensor&,
                      const at::Tensor&)>("kvreuse_fused::short_conv"),
      find<void(at::Tensor, const at::Tensor&, at::Tensor, at::Tensor, const OptTensor&, const OptTensor&,
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                int64_t, const OptTensor&, int64_t, const OptTensor&, const OptTensor&,
                const OptTensor&)>("kvreuse_attn::paged_attention"),
  };
  return k;
}

// How a weight part is multiplied (runner/decode/native_step.py's KERNEL_CODES).
// kPlain: a float weight's F.linear (its bias inside, where it is the projection's one part); kFloatPart:
// a float part of a quantized weight (F.linear, the bias added after, as QuantizedLinearKernel does).
// kQpacked8: batch-invariant mode's int8 product over a weight packed in blocks of 16 outputs (kernels/qpacked.py),
// whose library is found on first use (only such a model loads it).
enum Kernel : int64_t { kQdot = 0, kQdot8 = 1, kPlain = 2, kRowdot = 3, kRowdot8 = 4, kFloatPart = 5, kQpacked8 = 6 };
constexpr int kProjections = 4;  // qkv, o, gate_up, down (a conv layer: in_proj, out_proj, gate_up, down)
// What a layer mixes its rows with: attention over its K/V in the pool, LFM2's short convolution over its planes, or
// Qwen3.5's Gated DeltaNet over each sequence's state.
// Nemotron-H's blocks are a norm, one mixer and the residual: attention without rotary, the squared-ReLU MLP, Mamba-2.
enum LayerKind : int {
  kAttentionLayer = 0, kConvLayer = 1, kDeltaLayer = 2, kAttentionBlock = 3, kMLPBlock = 4, kMambaBlock = 5
};

// A Mamba-2 block's mixer (add_mamba_block): its float32 parameters as layers/mamba2.py hands them to
// kvreuse_mamba2::mixer, the state pool's tensors, the split of in_proj's output (z, x|B|C, dt) and the time step's limits.
struct MambaMixer {
  at::Tensor conv_weight;
  OptTensor conv_bias;
  at::Tensor a_log, dt_bias, d, norm_weight, conv_states, states;
  int64_t state_layer = 0, heads = 0, groups = 0, inner = 0, conv_dim = 0;
  double dt_min = 0.0, dt_max = 0.0;
};

// A Gated DeltaNet layer's mixer (add_delta_layer): its float32 parameters as layers/gated_delta.py hands them to
// kvreuse_delta::delta_mixer, the state pool's tensors, and the split of in_proj's output.
struct DeltaMixer {
  at::Tensor conv_weight, a_log, dt_bias, norm_weight, conv_states, states;
  int64_t state_layer = 0, key_heads = 0, conv_dim = 0, value_size = 0, value_heads = 0;
  bool tiled = false;
};

// One projection's parts, side by side in its output (a fused weight whose parts differ in format).
struct Projection {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> kernels, formats;
};

// x @ W^T (+ bias) as the Python path computes it: F.linear(x, w, bias) for one plain float weight (the
// bias inside the GEMM, as there), otherwise the product and then the bias added.
at::Tensor project(const Kernels& k, const Projection& p, const at::Tensor& x, const OptTensor& bias = c10::nullopt) {
  if (p.weights.size() == 1 && p.kernels[0] == kPlain) return at::linear(x, p.weights[0], bias);
  const int64_t in = x.size(1);
  std::vector<at::Tensor> outs;
  outs.reserve(p.weights.size());
  for (size_t i = 0; i < p.weights.size(); ++i) {
    const at::Tensor& w = p.weights[i];
    switch (p.kernels[i]) {
      case kQdot: outs.push_back(k.qlinear.call(x, w, p.formats[i], in)); break;
      case kQdot8: outs.push_back(k.qlinear_int8.call(x, w, p.formats[i], in)); break;
      case kPlain: outs.push_back(at::linear(x, w)); break;
      case kFloatPart: outs.push_back(at::linear(x, w.to(x.scalar_type()))); break;  // as held (no copy kept)
      case kRowdot: outs.push_back(k.rowdot.call(x, w, 1)); break;
      case kRowdot8: outs.push_back(k.rowdot.call(x, w, 8)); break;
      case kQpacked8: {
        static const auto qpacked8 =
            find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>("kvreuse_qpacked::qlinear_packed");
        // Whole blocks of 16 outputs (native_step.py runs no other).
        outs.push_back(qpacked8.call(x, w, p.formats[i], w.size(0) * 16, true));
        break;
      }
      default: TORCH_CHECK(false, "decoder_layer: unknown kernel code ", p.kernels[i]);
    }
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// One decoder layer's weights, norms and KV pools: what stays the same from step to step.
struct Layer {
  Projection p[kProjections];  // qkv, o, gate_up, down (no parts for the last two in a mixture-of-experts layer)
  OptTensor qkv_bias, q_norm, k_norm;  // a conv layer: in_proj's bias in qkv_bias
  at::Tensor input_norm, post_norm, k_pool, v_pool;
  std::optional<kvreuse_moe::MoEWeights> experts;  // set_experts: the layer's MLP is its experts
  // set_attention: the layer's window (0: none), softmax scale (0: the model's), sinks and o_proj's bias.
  int64_t window = 0;
  double scale = 0.0;
  OptTensor sinks, o_bias;  // a conv layer: out_proj's bias in o_bias
  // add_conv_layer: the convolution's float32 [K, H] kernel and [H] bias, and the layer's planes [slots + 1, H].
  LayerKind kind = kAttentionLayer;
  at::Tensor conv_weight, planes;
  OptTensor conv_bias;
  // set_gated_attention: Qwen3.5's output gate beside each head's query, rotary over the first rotary_dim.
  bool gated = false;
  int64_t rotary_dim = 0;
  std::optional<DeltaMixer> delta;  // add_delta_layer
  std::optional<MambaMixer> mamba;  // add_mamba_block
};

// What the model's shape fixes for every layer.
struct Shape {
  double eps = 0.0, scale = 0.0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, block_size = 0;
  // The attention's key partition length (0: the kernel's choice, by the step's size and threads; a fixed
  // length makes a row's reduction order independent of the step: set_partition_size, batch-invariant mode).
  int64_t partition_size = 0;
  // A hybrid's conv layers (set_planes): the convolution's width and the planes' row that is always zero.
  int64_t conv_kernel = 0, zero_plane_slot = -1;
  // set_offset_norms: every norm's weight is a float32 (1 + weight) scale, normed and scaled in float32, rounded once.
  bool offset_norms = false;
};

// What changes every step: the rows, their positions and the block tables of their sequences.
struct StepInputs {
  at::Tensor cos, sin, positions, block_tables, query_start, query_lens, context_lens, slot_mapping;
  at::Tensor conv_taps;  // [tokens, K] int64: the plane slots each row's convolution reads (conv layers only)
  at::Tensor cos_rows, sin_rows;  // [tokens, 1, rotary_dim / 2] in the activations' dtype (gated attention only)
  // Each sequence's state slot, first row and row count (Gated DeltaNet layers only; layers/recurrent.py StateInputs).
  c10::IntArrayRef state_slots, state_starts, state_lens;
};

// Each row's K convolution inputs, oldest first, as layers/short_conv.py's ConvTaps.build gives them: position p - K + 1
// + k of the row's sequence, the zero row before position 0, this step's own slot (slot_mapping) from the sequence's
// first row this step on, and the block table's slot before it.
at::Tensor conv_taps(const StepInputs& in, int64_t kernel, int64_t block_size, int64_t zero_slot) {
  const int64_t tokens = in.slot_mapping.size(0), seqs = in.query_start.size(0);
  at::Tensor taps = at::empty({tokens, kernel}, in.slot_mapping.options().dtype(at::kLong));
  int64_t* out = taps.data_ptr<int64_t>();
  const int64_t* starts = in.query_start.data_ptr<int64_t>();
  const int64_t* lens = in.query_lens.data_ptr<int64_t>();
  const int64_t* contexts = in.context_lens.data_ptr<int64_t>();
  const int64_t* slots = in.slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = in.block_tables.data_ptr<int64_t>();
  const int64_t width = in.block_tables.size(1);
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t first_row = starts[i], first_position = contexts[i] - lens[i];
    TORCH_CHECK(first_row >= 0 && first_row + lens[i] <= tokens && first_position >= 0,
                "decoder_layer: a sequence's rows are not within the step");
    for (int64_t r = 0; r < lens[i]; ++r) {
      for (int64_t k = 0; k < kernel; ++k) {
        const int64_t position = first_position + r - (kernel - 1) + k;
        int64_t slot;
        if (position < 0) {
          slot = zero_slot;
        } else if (position >= first_position) {
          slot = slots[first_row + position - first_position];
        } else {
          TORCH_CHECK(position / block_size < width, "decoder_layer: a conv tap past the block table");
          slot = tables[i * width + position / block_size] * block_size + position % block_size;
        }
        out[(first_row + r) * kernel + k] = slot;
      }
    }
  }
  return taps;
}

Layer make_layer(const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes, c10::IntArrayRef formats,
                 c10::IntArrayRef parts, const OptTensor& qkv_bias, const at::Tensor& input_norm,
                 const at::Tensor& post_norm, const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& k_pool,
                 const at::Tensor& v_pool) {
  TORCH_CHECK(parts.size() == kProjections, "decoder_layer: parts must count the parts of qkv, o, gate_up and down");
  TORCH_CHECK(weights.size() == kernel_codes.size() && weights.size() == formats.size(),
              "decoder_layer: one kernel code and one format per weight part");
  Layer layer{{}, qkv_bias, q_norm, k_norm, input_norm, post_norm, k_pool, v_pool, std::nullopt, 0, 0.0,
              c10::nullopt, c10::nullopt};
  size_t at = 0;
  for (int j = 0; j < kProjections; ++j) {
    // gate_up and down may have no parts: a mixture-of-experts layer's MLP comes with set_experts.
    TORCH_CHECK((parts[j] > 0 || (j >= 2 && parts[2] == 0 && parts[3] == 0)) && at + parts[j] <= weights.size(),
                "decoder_layer: parts do not add up to the weights");
    for (int64_t i = 0; i < parts[j]; ++i, ++at) {
      layer.p[j].weights.push_back(weights[at]);
      layer.p[j].kernels.push_back(kernel_codes[at]);
      layer.p[j].formats.push_back(formats[at]);
    }
  }
  TORCH_CHECK(at == weights.size(), "decoder_layer: parts do not add up to the weights");
  return layer;
}

// The model's RMSNorm of x (x += residual first, where given): Llama's (weight in x's dtype), or a float32 (1 + weight)
// scale's (Gemma's and Qwen3.5's) under set_offset_norms.
at::Tensor norm(const Kernels& k, const Shape& shape, const at::Tensor& x, const at::Tensor& weight,
                const OptTensor& residual = c10::nullopt) {
  return shape.offset_norms ? k.rms_norm_float_scale.call(x, weight, shape.eps, residual)
                            : k.rms_norm.call(x, weight, shape.eps, residual);
}

// The rotate-half rotary of x [T, heads, d] by cos / sin [T, 1, d / 2], as fused_ops.reference_rotary computes it.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

// x's first rotary_dim of each head rotated, the rest as it is (Qwen3.5's partial rotary).
at::Tensor rotate_part(const at::Tensor& x, int64_t rotary_dim, const StepInputs& in) {
  return at::cat({rotate(x.narrow(-1, 0, rotary_dim), in.cos_rows, in.sin_rows),
                  x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)}, -1);
}

// Attention of q [T, heads, head_dim] over the layer's paged context, the step's key and value [T, kv_heads, head_dim]
// stored by the kernel as it attends (rounded to the pool's dtype first where it differs: a bfloat16 pool under a
// float32 model), as NativePagedAttention.forward's fused store does. Returns [T, heads, head_dim].
at::Tensor paged_attend(const Kernels& k, const Layer& layer, const Shape& shape, const StepInputs& in,
                        const at::Tensor& q, at::Tensor key, at::Tensor value) {
  if (layer.k_pool.scalar_type() != key.scalar_type()) {
    key = key.to(layer.k_pool.scalar_type());
    value = value.to(layer.k_pool.scalar_type());
  }
  at::Tensor attention = at::empty({q.size(0), shape.heads, shape.head_dim}, q.options());
  k.paged_attention.call(attention, q, layer.k_pool, layer.v_pool, c10::nullopt, c10::nullopt, in.block_tables,
                         in.query_start, in.query_lens, in.context_lens, shape.block_size, -1,
                         layer.scale > 0.0 ? layer.scale : shape.scale, layer.window, layer.sinks,
                         shape.partition_size, key, value, in.slot_mapping);
  return attention;
}

void run_mlp(const Kernels& k, const Layer& layer, at::Tensor& hidden, const at::Tensor& normed);

// sigmoid of a float32 copy of x, the scalar exp on every value (kvreuse_delta::pointwise_, kind 1: layers/recurrent.py
// sigmoid), so a value's bits do not depend on where it sits in its tensor.
at::Tensor native_sigmoid(const at::Tensor& x) {
  static const auto pointwise = find<void(at::Tensor&, int64_t)>("kvreuse_delta::pointwise_");
  at::Tensor copy = x.to(at::kFloat, false, true, at::MemoryFormat::Contiguous);
  pointwise.call(copy, 1);
  return copy;
}

// Qwen3.5's gated attention layer (models/qwen3_5.py GatedAttention, op for op): q|gate per head, k, v from one product;
// q and k through their (1 + weight) norms, their first rotary_dim rotated; attention over the paged context with the
// step's K/V stored; the output scaled by sigmoid(gate) in float32 and rounded; o_proj; the post norm; the MLP.
void run_gated_attention_layer(const Kernels& k, const Layer& layer, const Shape& shape, at::Tensor& hidden,
                               const StepInputs& in) {
  const int64_t tokens = hidden.size(0), heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const at::Tensor qkv = project(k, layer.p[0], norm(k, shape, hidden, layer.input_norm), layer.qkv_bias);
  TORCH_CHECK(qkv.size(1) == 2 * q_size + 2 * kv_size, "decoder_layer: a gated attention's product has ", qkv.size(1),
              " columns, heads make ", 2 * q_size + 2 * kv_size);
  const at::Tensor query_gate = qkv.narrow(1, 0, 2 * q_size).reshape({tokens, heads, 2 * head_dim});
  at::Tensor q = norm(k, shape, query_gate.narrow(-1, 0, head_dim).contiguous(), *layer.q_norm);
  at::Tensor key = norm(k, shape, qkv.narrow(1, 2 * q_size, kv_size).reshape({tokens, kv_heads, head_dim}).contiguous(),
                        *layer.k_norm);
  const at::Tensor value = qkv.narrow(1, 2 * q_size + kv_size, kv_size).reshape({tokens, kv_heads, head_dim}).contiguous();
  q = rotate_part(q, layer.rotary_dim, in);
  key = rotate_part(key, layer.rotary_dim, in);
  const at::Tensor attention = paged_attend(k, layer, shape, in, q, key, value);
  const at::Tensor gate = query_gate.narrow(-1, head_dim, head_dim).reshape({tokens, q_size});
  const at::Tensor gated = (attention.reshape({tokens, q_size}) * native_sigmoid(gate)).to(hidden.scalar_type());
  const at::Tensor attended = project(k, layer.p[1], gated, layer.o_bias);
  run_mlp(k, layer, hidden, norm(k, shape, hidden, layer.post_norm, attended));
}

// A Gated DeltaNet layer (models/qwen3_5.py GatedDeltaNetDecoderLayer): norm, in_proj (q|k|v, z, b, a), the mixer in
// one native call over each sequence's state slot, out_proj, the post norm, the MLP.
void run_delta_layer(const Kernels& k, const Layer& layer, const Shape& shape, at::Tensor& hidden,
                     const StepInputs& in) {
  static const auto delta_mixer =
      find<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, int64_t,
                      c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, int64_t, bool, double, bool)>(
          "kvreuse_delta::delta_mixer");
  const DeltaMixer& d = *layer.delta;
  TORCH_CHECK(static_cast<int64_t>(in.state_slots.size()) > 0, "decoder_layer: a Gated DeltaNet layer needs the "
              "step's state slots (DecodeLayers.run's slots, starts and lens)");
  const at::Tensor projected = project(k, layer.p[0], norm(k, shape, hidden, layer.input_norm), layer.qkv_bias);
  TORCH_CHECK(projected.size(1) == d.conv_dim + d.value_size + 2 * d.value_heads,
              "decoder_layer: in_proj's output does not split into q|k|v, z, b and a");
  auto as_float = [](const at::Tensor& x) { return x.to(at::kFloat).contiguous(); };
  const int64_t b_at = d.conv_dim + d.value_size;
  at::Tensor conv_states = d.conv_states, states = d.states;
  const at::Tensor out = delta_mixer.call(
      as_float(projected.narrow(1, 0, d.conv_dim)), as_float(projected.narrow(1, d.conv_dim, d.value_size)),
      as_float(projected.narrow(1, b_at + d.value_heads, d.value_heads)), as_float(projected.narrow(1, b_at, d.value_heads)),
      d.conv_weight, conv_states, d.a_log, d.dt_bias, d.norm_weight, states, d.state_layer, in.state_slots,
      in.state_starts, in.state_lens, d.key_heads, d.tiled, shape.eps, hidden.scalar_type() == at::kBFloat16);
  const at::Tensor mixed = project(k, layer.p[1], out.to(hidden.scalar_type()), layer.o_bias);
  run_mlp(k, layer, hidden, norm(k, shape, hidden, layer.post_norm, mixed));
}

// Nemotron-H's blocks (models/nemotron_h.py): hidden += the mixer of the block's norm of hidden. Attention without rotary
// (UnrotatedAttention: q, k, v copied out of the product, the step's K/V stored as the kernel attends), the squared-ReLU
// MLP (SquaredReLUMLP), or Mamba-2 (Mamba2Mixer: z, x|B|C and dt from in_proj, the mixer in one native call).
void run_block(const Kernels& k, const Layer& layer, const Shape& shape, at::Tensor& hidden, const StepInputs& in) {
  const at::Tensor projected = project(k, layer.p[0], norm(k, shape, hidden, layer.input_norm), layer.qkv_bias);
  const int64_t tokens = hidden.size(0);
  if (layer.kind == kMLPBlock) {
    hidden.add_(project(k, layer.p[1], at::relu(projected).square_(), layer.o_bias));
    return;
  }
  if (layer.kind == kAttentionBlock) {
    const int64_t heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    TORCH_CHECK(projected.size(1) == q_size + 2 * kv_size, "decoder_layer: qkv has ", projected.size(1),
                " columns, heads make ", q_size + 2 * kv_size);
    const at::Tensor attention = paged_attend(
        k, layer, shape, in, projected.narrow(1, 0, q_size).reshape({tokens, heads, head_dim}).contiguous(),
        projected.narrow(1, q_size, kv_size).reshape({tokens, kv_heads, head_dim}).contiguous(),
        projected.narrow(1, q_size + kv_size, kv_size).reshape({tokens, kv_heads, head_dim}).contiguous());
    hidden.add_(project(k, layer.p[1], attention.reshape({tokens, q_size}), layer.o_bias));
    return;
  }
  static const auto mixer =
      find<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                      at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      at::Tensor&, int64_t, c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, int64_t, int64_t,
                      int64_t, double, double, double)>("kvreuse_mamba2::mixer");
  const MambaMixer& m = *layer.mamba;
  TORCH_CHECK(static_cast<int64_t>(in.state_slots.size()) > 0, "decoder_layer: a Mamba-2 block needs the step's state "
              "slots (DecodeLayers.run's slots, starts and lens)");
  TORCH_CHECK(projected.size(1) == m.inner + m.conv_dim + m.heads,
              "decoder_layer: in_proj's output does not split into z, x|B|C and dt");
  auto as_float = [](const at::Tensor& x) { return x.to(at::kFloat).contiguous(); };
  at::Tensor conv_states = m.conv_states, states = m.states;
  const at::Tensor y = mixer.call(
      as_float(projected.narrow(1, m.inner, m.conv_dim)), as_float(projected.narrow(1, 0, m.inner)),
      as_float(projected.narrow(1, m.inner + m.conv_dim, m.heads)), m.conv_weight, m.conv_bias, conv_states, m.a_log,
      m.dt_bias, m.d, m.norm_weight, states, m.state_layer, in.state_slots, in.state_starts, in.state_lens, m.heads,
      m.groups, m.groups, shape.eps, m.dt_min, m.dt_max);
  hidden.add_(project(k, layer.p[1], y.to(hidden.scalar_type()), layer.o_bias));
}

// hidden += down(silu(gate) * up) of the post-mixer norm's output, or the layer's experts of it.
void run_mlp(const Kernels& k, const Layer& layer, at::Tensor& hidden, const at::Tensor& normed) {
  if (layer.experts.has_value()) {
    hidden.add_(kvreuse_moe::moe_forward(*layer.experts, normed));
    return;
  }
  TORCH_CHECK(!layer.p[2].weights.empty(), "decoder_layer: a layer without MLP weights needs set_experts");
  hidden.add_(project(k, layer.p[3], k.silu_mul.call(project(k, layer.p[2], normed))));
}

// A conv layer (models/lfm2.py's ShortConvDecoderLayer): norm, in_proj, the gated short convolution over the layer's
// planes, out_proj, residual with the post norm, the MLP.
void run_conv_layer(const Kernels& k, const Layer& layer, const Shape& shape, at::Tensor& hidden,
                    const StepInputs& in) {
  const at::Tensor bcx =
      project(k, layer.p[0], k.rms_norm.call(hidden, layer.input_norm, shape.eps, c10::nullopt), layer.qkv_bias);
  const at::Tensor mixed =
      k.short_conv.call(bcx.contiguous(), layer.conv_weight, layer.conv_bias, layer.planes, in.conv_taps, in.slot_mapping);
  const at::Tensor out = project(k, layer.p[1], mixed, layer.o_bias);
  run_mlp(k, layer, hidden, k.rms_norm.call(hidden, layer.post_norm, shape.eps, out));
}

// hidden: contiguous [tokens, hidden] (DecodeLayers.run checks, once a step).
void run_layer(const Kernels& k, const Layer& layer, const Shape& shape, at::Tensor& hidden, const StepInputs& in) {
  if (layer.kind == kConvLayer) {
    run_conv_layer(k, layer, shape, hidden, in);
    return;
  }
  if (layer.kind == kDeltaLayer) {
    run_delta_layer(k, layer, shape, hidden, in);
    return;
  }
  if (layer.kind >= kAttentionBlock) {
    run_block(k, layer, shape, hidden, in);
    return;
  }
  if (layer.gated) {
    run_gated_attention_layer(k, layer, shape, hidden, in);
    return;
  }
  const double eps = shape.eps;
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const int64_t tokens = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;

  at::Tensor qkv = project(k, layer.p[0], k.rms_norm.call(hidden, layer.input_norm, eps, c10::nullopt), layer.qkv_bias);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_layer: qkv has ", qkv.size(1), " columns, heads make ",
              q_size + 2 * kv_size);
  k.rotary.call(qkv, in.cos, in.sin, in.positions, heads, kv_heads, head_dim, layer.q_norm, layer.k_norm, eps);
  // q, k and v read where the product left them (views of its rows).
  const at::Tensor attention = paged_attend(k, layer, shape, in, qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim}),
                                            qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim}),
                                            qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim}));
  const at::Tensor attended = project(k, layer.p[1], attention.view({tokens, q_size}), layer.o_bias);
  // hidden += attended, then the post-attention norm of the sum (one pass).
  run_mlp(k, layer, hidden, k.rms_norm.call(hidden, layer.post_norm, eps, attended));
}

// A model's decoder layers for one row count, held across steps, so a decode step is one call from Python
// for all of them: the per-layer call (its 26 arguments converted from Python objects, its weight lists
// rebuilt) cost a small model about as much as its attention.
struct DecodeLayers : torch::CustomClassHolder {
  Shape shape;
  std::vector<Layer> layers;

  DecodeLayers(double eps, double scale, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size)
      : shape{eps, scale, heads, kv_heads, head_dim, block_size} {}

  void add_layer(const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes, c10::IntArrayRef formats,
                 c10::IntArrayRef parts, const OptTensor& qkv_bias, const at::Tensor& input_norm,
                 const at::Tensor& post_norm, const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& k_pool,
                 const at::Tensor& v_pool) {
    layers.push_back(make_layer(weights, kernel_codes, formats, parts, qkv_bias, input_norm, post_norm, q_norm, k_norm,
                                k_pool, v_pool));
  }

  // A conv layer (LFM2): in_proj, out_proj, gate_up and down as `parts` counts them, their biases, the norms, the
  // convolution's float32 kernel [K, H] and bias [H], and the layer's planes [slots + 1, H] (set_planes first).
  void add_conv_layer(const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes, c10::IntArrayRef formats,
                      c10::IntArrayRef parts, const OptTensor& in_bias, const OptTensor& out_bias,
                      const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor& conv_weight,
                      const OptTensor& conv_bias, const at::Tensor& planes) {
    TORCH_CHECK(shape.conv_kernel > 0, "DecodeLayers.add_conv_layer: set_planes first");
    TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == shape.conv_kernel &&
                    conv_weight.scalar_type() == at::kFloat && conv_weight.is_contiguous(),
                "DecodeLayers.add_conv_layer: the kernel must be contiguous float32 [", shape.conv_kernel, ", hidden]");
    TORCH_CHECK(planes.dim() == 2 && shape.zero_plane_slot < planes.size(0),
                "DecodeLayers.add_conv_layer: planes must be [slots + 1, hidden], the zero row among them");
    Layer layer = make_layer(weights, kernel_codes, formats, parts, in_bias, input_norm, post_norm, c10::nullopt,
                             c10::nullopt, at::Tensor(), at::Tensor());
    layer.o_bias = out_bias;
    layer.kind = kConvLayer;
    layer.conv_weight = conv_weight;
    layer.conv_bias = conv_bias;
    layer.planes = planes;
    layers.push_back(std::move(layer));
  }

  // A Gated DeltaNet layer (Qwen3.5): in_proj, out_proj, gate_up and down as `parts` counts them, the (1 + weight)
  // norm scales, the mixer's float32 parameters (conv kernel [C, K], A_log, dt_bias, the output norm's weight) and the
  // state pool's conv inputs and states, the layer's place in a slot, the heads and the split of in_proj's output.
  void add_delta_layer(const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes, c10::IntArrayRef formats,
                       c10::IntArrayRef parts, const at::Tensor& input_norm, const at::Tensor& post_norm,
                       at::Tensor conv_weight, at::Tensor a_log, at::Tensor dt_bias, at::Tensor norm_weight,
                       at::Tensor conv_states, at::Tensor states, int64_t state_layer, int64_t key_heads, bool tiled,
                       int64_t conv_dim, int64_t value_size, int64_t value_heads) {
    TORCH_CHECK(shape.offset_norms, "DecodeLayers.add_delta_layer: a Gated DeltaNet model's norms are offset "
                "(set_offset_norms first)");
    for (const at::Tensor* t : {&conv_weight, &a_log, &dt_bias, &norm_weight}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "DecodeLayers.add_delta_layer: the mixer's parameters must be contiguous float32");
    }
    TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == conv_dim,
                "DecodeLayers.add_delta_layer: the conv kernel must be [conv_dim, K]");
    TORCH_CHECK(states.dim() == 5 && 0 <= state_layer && state_layer < states.size(1),
                "DecodeLayers.add_delta_layer: states [slots, layers, Hv, dk, dv] with the layer among them");
    Layer layer = make_layer(weights, kernel_codes, formats, parts, c10::nullopt, input_norm, post_norm, c10::nullopt,
                             c10::nullopt, at::Tensor(), at::Tensor());
    layer.kind = kDeltaLayer;
    layer.delta = DeltaMixer{std::move(conv_weight), std::move(a_log), std::move(dt_bias), std::move(norm_weight),
                             std::move(conv_states), std::move(states), state_layer, key_heads, conv_dim, value_size,
                             value_heads, tiled};
    layers.push_back(std::move(layer));
  }

  // A Nemotron-H attention or MLP block (kind 3 or 4): its two projections as `parts` counts them ([first, second, 0,
  // 0]), their biases, its norm's float32 scale (set_offset_norms first) and, for attention, its K/V pools.
  void add_block(int64_t kind, const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes,
                 c10::IntArrayRef formats, c10::IntArrayRef parts, const OptTensor& in_bias, const OptTensor& out_bias,
                 const at::Tensor& input_norm, const at::Tensor& k_pool, const at::Tensor& v_pool) {
    TORCH_CHECK(kind == kAttentionBlock || kind == kMLPBlock, "DecodeLayers.add_block: kind 3 (attention) or 4 (MLP)");
    TORCH_CHECK(shape.offset_norms, "DecodeLayers.add_block: a block's norm is a float32 scale (set_offset_norms first)");
    TORCH_CHECK(parts.size() == kProjections && parts[2] == 0 && parts[3] == 0,
                "DecodeLayers.add_block: a block has two projections");
    Layer layer = make_layer(weights, kernel_codes, formats, parts, in_bias, input_norm, at::Tensor(), c10::nullopt,
                             c10::nullopt, k_pool, v_pool);
    layer.o_bias = out_bias;
    layer.kind = static_cast<LayerKind>(kind);
    layers.push_back(std::move(layer));
  }

  // A Nemotron-H Mamba-2 block: in_proj and out_proj ([1+, 1+, 0, 0] parts), their biases, its norm's float32 scale, the
  // mixer's float32 parameters (conv kernel [C, K] and bias, A_log, dt_bias, D, the grouped norm's weight), the state
  // pool's conv inputs and states, the block's place in a slot, heads, groups, inner and conv widths, dt's limits.
  void add_mamba_block(const std::vector<at::Tensor>& weights, c10::IntArrayRef kernel_codes, c10::IntArrayRef formats,
                       c10::IntArrayRef parts, const OptTensor& in_bias, const OptTensor& out_bias,
                       const at::Tensor& input_norm, at::Tensor conv_weight, OptTensor conv_bias, at::Tensor a_log,
                       at::Tensor dt_bias, at::Tensor d, at::Tensor norm_weight, at::Tensor conv_states,
                       at::Tensor states, int64_t state_layer, int64_t heads, int64_t groups, int64_t inner,
                       int64_t conv_dim, double dt_min, double dt_max) {
    TORCH_CHECK(shape.offset_norms, "DecodeLayers.add_mamba_block: a block's norm is a float32 scale "
                "(set_offset_norms first)");
    TORCH_CHECK(parts.size() == kProjections && parts[2] == 0 && parts[3] == 0,
                "DecodeLayers.add_mamba_block: a block has two projections");
    for (const at::Tensor* t : {&conv_weight, &a_log, &dt_bias, &d, &norm_weight}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "DecodeLayers.add_mamba_block: the mixer's parameters must be contiguous float32");
    }
    TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == conv_dim,
                "DecodeLayers.add_mamba_block: the conv kernel must be [conv_dim, K]");
    TORCH_CHECK(states.dim() == 5 && 0 <= state_layer && state_layer < states.size(1),
                "DecodeLayers.add_mamba_block: states [slots, layers, H, P, N] with the block among them");
    Layer layer = make_layer(weights, kernel_codes, formats, parts, in_bias, input_norm, at::Tensor(), c10::nullopt,
                             c10::nullopt, at::Tensor(), at::Tensor());
    layer.o_bias = out_bias;
    layer.kind = kMambaBlock;
    layer.mamba = MambaMixer{std::move(conv_weight), std::move(conv_bias), std::move(a_log), std::move(dt_bias),
                             std::move(d), std::move(norm_weight), std::move(conv_states), std::move(states),
                             state_layer, heads, groups, inner, conv_dim, dt_min, dt_max};
    layers.push_back(std::move(layer));
  }

  // Every norm's weight a float32 scale, normed and scaled in float32 and rounded once: Qwen3.5's (1 + weight), and
  // Nemotron-H's weight in float32; add_layer's norms too, given as such scales.
  void set_offset_norms(bool offset) { shape.offset_norms = offset; }

  // Layer ``index``'s attention is Qwen3.5's gated attention, rotary over the first ``rotary_dim`` of each head.
  void set_gated_attention(int64_t index, int64_t rotary_dim) {
    TORCH_CHECK(0 <= index && index < num_layers() && layers[index].kind == kAttentionLayer,
                "DecodeLayers.set_gated_attention: layer ", index, " is not an attention layer");
    TORCH_CHECK(0 < rotary_dim && rotary_dim <= shape.head_dim && rotary_dim % 2 == 0,
                "DecodeLayers.set_gated_attention: rotary_dim must be even and within head_dim");
    TORCH_CHECK(layers[index].q_norm.has_value() && layers[index].k_norm.has_value(),
                "DecodeLayers.set_gated_attention: a gated attention layer has q and k norms");
    layers[index].gated = true;
    layers[index].rotary_dim = rotary_dim;
  }

  // A hybrid's conv layers: their width and the planes' zero row (KVCache.zero_plane_slot).
  void set_planes(int64_t conv_kernel, int64_t zero_plane_slot) {
    TORCH_CHECK(conv_kernel > 0 && zero_plane_slot >= 0, "DecodeLayers.set_planes: a positive width and a zero row");
    shape.conv_kernel = conv_kernel;
    shape.zero_plane_slot = zero_plane_slot;
  }

  // Layer ``index``'s MLP as experts (layers/experts.py's native arguments, as kvreuse_moe.Experts takes them).
  void set_experts(int64_t index, at::Tensor router, std::vector<at::Tensor> gate_up, int64_t gate_up_format,
                   std::vector<int64_t> gate_up_kernels, std::vector<at::Tensor> down, int64_t down_format,
                   std::vector<int64_t> down_kernels, int64_t hidden, int64_t intermediate, int64_t top_k,
                   bool norm_topk_prob, std::optional<at::Tensor> router_bias, bool softmax_after_topk,
                   std::vector<at::Tensor> gate_up_biases, std::vector<at::Tensor> down_biases,
                   std::optional<double> swiglu_limit, double swiglu_alpha) {
    TORCH_CHECK(0 <= index && index < num_layers(), "DecodeLayers.set_experts: no layer ", index);
    layers[index].experts = kvreuse_moe::make_moe_weights(
        std::move(router), std::move(gate_up), gate_up_format, std::move(gate_up_kernels), std::move(down),
        down_format, std::move(down_kernels), hidden, intermediate, top_k, norm_topk_prob, std::move(router_bias),
        softmax_after_topk, std::move(gate_up_biases), std::move(down_biases), swiglu_limit, swiglu_alpha);
  }

  // Layer ``index``'s attention as its LayerAttention has it, and its output projection's bias.
  void set_attention(int64_t index, int64_t window, double scale, std::optional<at::Tensor> sinks,
                     std::optional<at::Tensor> o_bias) {
    TORCH_CHECK(0 <= index && index < num_layers(), "DecodeLayers.set_attention: no layer ", index);
    TORCH_CHECK(window >= 0 && scale >= 0.0, "DecodeLayers.set_attention: window and scale must not be negative");
    Layer& layer = layers[index];
    layer.window = window;
    layer.scale = scale;
    layer.sinks = std::move(sinks);
    layer.o_bias = std::move(o_bias);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  void set_partition_size(int64_t partition_size) {
    TORCH_CHECK(partition_size >= 0, "DecodeLayers.set_partition_size: must not be negative");
    shape.partition_size = partition_size;
  }

  // Layers [first, last) on hidden [tokens, hidden], updated in place, their K/V stored; a Gated DeltaNet layer's
  // sequences keep their state in ``state_slots`` (rows ``state_starts`` on, ``state_lens`` of them; else empty).
  void run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
           const at::Tensor& context_lens, const at::Tensor& slot_mapping, int64_t first, int64_t last,
           c10::IntArrayRef state_slots, c10::IntArrayRef state_starts, c10::IntArrayRef state_lens) const {
    TORCH_CHECK(0 <= first && first <= last && last <= num_layers(), "DecodeLayers.run: layers [", first, ", ", last,
                ") are not within the ", num_layers(), " held");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decoder_layer: hidden must be contiguous [tokens, hidden]");
    const Kernels& k = kernels();
    TORCH_CHECK(state_slots.size() == state_starts.size() && state_slots.size() == state_lens.size(),
                "DecodeLayers.run: one state slot, start and length per sequence");
    StepInputs in{cos, sin, positions, block_tables, query_start, query_lens, context_lens, slot_mapping, at::Tensor(),
                  at::Tensor(), at::Tensor(), state_slots, state_starts, state_lens};
    for (int64_t i = first; i < last; ++i) {
      if (layers[i].kind == kConvLayer && !in.conv_taps.defined()) {
        in.conv_taps = conv_taps(in, shape.conv_kernel, shape.block_size, shape.zero_plane_slot);
      }
      if (layers[i].gated && !in.cos_rows.defined()) {  // RotaryEmbedding.cos_sin: the rows at the positions, in dtype
        in.cos_rows = cos.index_select(0, positions).to(hidden.scalar_type()).unsqueeze(1);
        in.sin_rows = sin.index_select(0, positions).to(hidden.scalar_type()).unsqueeze(1);
      }
      run_layer(k, layers[i], shape, hidden, in);
    }
  }
};

}  // namespace

TORCH_LIBRARY(kvreuse_step, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<double, double, int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_conv_layer", &DecodeLayers::add_conv_layer)
      .def("set_planes", &DecodeLayers::set_planes)
      .def("add_delta_layer", &DecodeLayers::add_delta_layer)
      .def("set_offset_norms", &DecodeLayers::set_offset_norms)
      .def("set_gated_attention", &DecodeLayers::set_gated_attention)
      .def("add_block", &DecodeLayers::add_block)
      .def("add_mamba_block", &DecodeLayers::add_mamba_block)
      .def("set_experts", &DecodeLayers::set_experts)
      .def("set_attention", &DecodeLayers::set_attention)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("set_partition_size", &DecodeLayers::set_partition_size)
      .def("run", &DecodeLayers::run);
}

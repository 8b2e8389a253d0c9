"""A mixture-of-experts MLP (Qwen3-MoE's and gpt-oss's): a router picks each token's top-k experts, and each
expert runs once per step for every row routed to it.

gpt-oss differs in switches of ``MoEConfig``: its router (HF ``mlp.router``) has a bias and softmaxes the top k
logits only; its experts have biases and a clamped SwiGLU (``GatedMLP``'s ``clamped_swiglu``). The native layer
below computes both kinds (csrc/moe.h: the same ops in the same order, so either equals the Python loop bit for
bit).

Every expert is a ``GatedMLP`` of ``Linear`` layers, so its weights take the same paths as a dense model's:
float, or held quantized from a GGUF file (each expert's rows of the file's stacked tensor) or by
``quantization="int8"``, run by the kernel the plan book measured fastest for the expert's shape and the
row count it gets. The router stays float (it is small, and rounding it would move tokens between
experts).

Cost follows the active parameters: a decode row reads only its k experts' weights. A step's rows are
grouped by expert (one stable sort of the (row, choice) pairs), so an expert routed to by several rows of
a batched decode or a prefill reads its weights once for all of them. The experts run in ascending index
order and add into the output with ``index_add_``, the order transformers uses, so float32 outputs match
its token for token.

Steps of up to ``NATIVE_MAX_ROWS`` rows (decode batches) run the whole layer in one native call
(csrc/moe.cpp's ``Experts``: the same kernels in the same order, from C++), where every expert's products
are quantized blocks or plain float weights; from Python, a decode row's 8 experts were about forty operator
calls per layer, as long as their products on a 2-core CPU. ``KVREUSE_NATIVE_MOE=0`` keeps the Python loop
(the benchmark compares the two).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.kernels import quant_ops
from kvreuse.kernels.moe import library
from kvreuse.kernels.quant import QuantizedTensor
from kvreuse.layers import quantized_linear
from kvreuse.layers.linear import Linear
from kvreuse.layers.mlp import CLAMPED_SWIGLU, GatedMLP
from kvreuse.layers.moe_config import MoEConfig

logger = logging.getLogger(__name__)

ENV = "KVREUSE_NATIVE_MOE"
KERNEL_CODES = {"qdot": 0, "qdot8": 1, "plain": 2}  # csrc/moe.cpp's Kernel
# Steps of at most this many rows run natively; the kernel per row count is the plan book's (quantized_linear.py probes
# the quantized GEMV up to QDOT_MAX_ROWS). Larger steps (prefills) group rows per expert into GEMM-sized
# products from Python, where the per-call overhead is paid once per expert over many rows.
NATIVE_MAX_ROWS = quantized_linear.QDOT_MAX_ROWS


def _biases(linears: list[Linear]) -> list[torch.Tensor]:
    """Every expert's bias of one kind (gpt-oss), as its Linear adds it (a quantized kernel holds its own); [] where
    they have none."""
    biases = [linear.kernel.bias if linear.quantized is not None else linear.bias for linear in linears]
    return [] if biases[0] is None else [bias.detach() for bias in biases]


def _product(linears: list[Linear], rows: int) -> tuple[list[torch.Tensor], int, list[int]] | str:
    """Every expert's matrix of one kind as the native layer takes it: the weights, their format code (-1:
    float) and the kernel code for 1 .. ``rows`` rows; or why it cannot."""
    weights: list[torch.Tensor] = []
    formats: set[int] = set()
    codes: list[int] | None = None
    for linear in linears:
        kernel = linear.kernel
        if linear.quantized is not None:
            if len(kernel.parts) != 1 or not isinstance(kernel.parts[0], QuantizedTensor):
                return "an expert weight in parts of several formats"
            part, plan = kernel.parts[0], kernel.plans[0]
            names = [plan.kernel_for(count) for count in range(1, rows + 1)]
            names = ["qdot" if name == "qdot8" and part.format.name not in quant_ops.int8_formats() else name
                     for name in names]
            # Up to the first row count planned on dequantized tiles (the native layer runs the GEMV kernels).
            for index, name in enumerate(names):
                if name not in ("qdot", "qdot8"):
                    names = names[:index]
                    break
            if not names:
                return "expert products planned on dequantized tiles from one row"
            weights.append(part.data)
            formats.add(part.format.code)
            found = [KERNEL_CODES[name] for name in names]
        elif kernel is None and linear.weight is not None:
            weights.append(linear.weight.detach())
            formats.add(-1)
            found = [KERNEL_CODES["plain"]] * rows
        else:
            return "an expert weight in a second float layout"
        if codes is not None and found[:len(codes)] != codes[:len(found)]:
            return "experts whose plans differ"
        codes = found if codes is None or len(found) < len(codes) else codes
    if len(formats) != 1:
        return "experts in several formats"
    return weights, formats.pop(), codes or []


# Eager sigmoid takes SLEEF's exp in its vector body and std::exp on the tail of the flattened tensor, so a [rows, 1]
# gate's bits would follow the step's row count; rows this wide (a multiple of every vector step) keep every value in
# the body. csrc/moe.h computes the native layer's gate the same way.
SIGMOID_ROW = 64


def shared_expert_scale(logit: torch.Tensor) -> torch.Tensor:
    """sigmoid of the shared expert's gate logits [rows, 1], each row's bits the same at any row count."""
    return torch.sigmoid(logit.expand(-1, SIGMOID_ROW).contiguous())[:, :1]


class SparseMoE(nn.Module):
    """The experts of one layer and their router (HF names: ``mlp.gate`` (Qwen3-MoE) or ``mlp.router``
    (gpt-oss), ``mlp.experts.{e}.*``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, activation: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.softmax_after_topk = moe.softmax_after_topk
        # Registered under the checkpoint's name, so the weights load by their HF names.
        self.router_name = "router" if moe.router_bias else "gate"
        # The router is held and run in float32 whatever the model's dtype, as llama.cpp runs a GGUF file's
        # (stored F32): its logits choose the experts, so bf16 rounding there flips near-tied choices; and on
        # CPU a [1, hidden] x [hidden, experts] product in bf16 cost 4x the float32 one (27 against 6 us).
        # In float32 models this is transformers' arithmetic exactly; in bf16 ones the choice is closer to
        # the float32 model's than transformers' bf16 router is.
        router = Linear(hidden_size, [moe.num_experts], moe.router_bias, torch.float32, device)
        router.keep_float = True  # quantize_int8 leaves the router as it is
        self.add_module(self.router_name, router)
        if moe.swiglu_limit is not None:
            activation = CLAMPED_SWIGLU
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.moe_intermediate_size, dtype, device, activation, bias=moe.expert_bias,
                     swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)
            for _ in range(moe.num_experts)
        )
        self.expert_bias = moe.expert_bias
        self.activation = activation
        # Qwen3.5-MoE's shared expert and its gate (HF names mlp.shared_expert.*, mlp.shared_expert_gate).
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, dtype, device, activation)
            self.shared_expert_gate = Linear(hidden_size, [1], False, dtype, device)
            # One output: F.linear (no plan, no int8 copy), which the native layer calls as at::linear.
            self.shared_expert_gate.keep_float = True
        self.native: Any = None  # csrc/moe.cpp's Experts, made by prepare_native once the kernels are chosen
        self.native_shared = False  # the native layer runs the shared expert too (else it runs from Python)
        self.native_max_rows = 0
        self.native_args: tuple[Any, ...] = ()

    @property
    def router_layer(self) -> Linear:
        """The router, whichever name the checkpoint gives it (a property named ``router`` would shadow the
        gpt-oss module of that name)."""
        return self._modules[self.router_name]  # type: ignore[return-value]

    def prepare_native(self) -> str | None:
        """Hold this layer's experts in the native layer for steps of up to NATIVE_MAX_ROWS rows (call after
        the kernels are chosen: it records each product's kernel per row count). Returns why not, or None."""
        self.native, self.native_shared = None, False
        if os.environ.get(ENV, "1").strip() == "0":
            return f"{ENV}=0"
        if self.activation not in ("silu", CLAMPED_SWIGLU):
            return f"{self.activation} experts"
        router = self.router_layer
        if router.weight is None or router.kernel is not None:
            return "a router held in another layout"
        if router.weight.device.type != "cpu":
            return f"not on {router.weight.device.type}"
        if library() is None:
            return "the native MoE layer could not be built (see the log)"
        gate_up_linears = [expert.gate_up_proj for expert in self.experts]
        down_linears = [expert.down_proj for expert in self.experts]
        gate_up = _product(gate_up_linears, NATIVE_MAX_ROWS)
        down = _product(down_linears, NATIVE_MAX_ROWS)
        for found in (gate_up, down):
            if isinstance(found, str):
                return found
        expert = self.experts[0]
        # Steps up to this many rows run natively: every product's plan runs a GEMV kernel up to there.
        self.native_max_rows = min(len(gate_up[2]), len(down[2]))
        clamped = self.activation == CLAMPED_SWIGLU
        # What the native layer is made of; the native decode step holds the same (csrc/decoder_layer.cpp). The
        # last six are gpt-oss's: the router's bias, the softmax over the top k, the experts' biases ([]: none),
        # the clamped SwiGLU's limit (None: SiLU) and alpha.
        self.native_args = (router.weight.detach(), gate_up[0], gate_up[1], gate_up[2], down[0], down[1], down[2],
                            router.input_size, expert.intermediate_size, self.top_k, self.norm_topk_prob,
                            None if router.bias is None else router.bias.detach(), self.softmax_after_topk,
                            _biases(gate_up_linears), _biases(down_linears),
                            float(expert.swiglu_limit) if clamped else None, float(expert.swiglu_alpha))
        self.native = torch.classes.kvreuse_moe.Experts(*self.native_args)
        if self.shared_expert is not None:
            why = self._prepare_native_shared()
            if why is not None:
                logger.info("the shared expert runs from Python beside the native MoE layer: %s", why)
        return None

    def _prepare_native_shared(self) -> str | None:
        """Give the native layer the shared expert and its gate too (one call a layer, not a dozen from Python: at a
        Qwen3.5-MoE decode row they were an eighth of the step). Returns why not, or None."""
        if self.activation != "silu":
            return f"a {self.activation} shared expert"
        gate = self.shared_expert_gate
        if gate.kernel is not None or gate.weight is None or gate.bias is not None:
            return "a shared expert gate held in another layout"
        gate_up = _product([self.shared_expert.gate_up_proj], NATIVE_MAX_ROWS)
        down = _product([self.shared_expert.down_proj], NATIVE_MAX_ROWS)
        for found in (gate_up, down):
            if isinstance(found, str):
                return found
        self.native.set_shared_expert(gate_up[0][0], gate_up[1], gate_up[2], down[0][0], down[1], down[2],
                                      self.shared_expert.intermediate_size, gate.weight.detach())
        self.native_max_rows = min(self.native_max_rows, len(gate_up[2]), len(down[2]))
        self.native_shared = True
        return None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]): softmax over all experts in float32, the top k,
        renormalised where the config says so (transformers' Qwen3MoeTopKRouter); or, for gpt-oss, the top k
        logits softmaxed among themselves in the logits' dtype (GptOssTopKRouter)."""
        logits = self.router_layer(x.float())
        if self.softmax_after_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype).to(x.dtype), experts
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on mixture-of-experts layers are not supported")
        if self.native is not None and x.shape[0] <= self.native_max_rows and x.is_contiguous():
            out = self.native.forward(x)
            if self.native_shared:  # the shared expert added there, by the same ops as below
                return out
        else:
            out = self.routed(x)
        if self.shared_expert is not None:  # transformers' order: routed + sigmoid(gate) * shared
            out.add_(shared_expert_scale(self.shared_expert_gate(x)) * self.shared_expert(x))
        return out

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, in Python (the native layer runs it in ``forward``)."""
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # a single row: its k experts in ascending order, no sort
            order = torch.argsort(experts[0])
            for expert, weight in zip(experts[0, order].tolist(), weights[0, order].unbind()):
                out.add_(self.experts[expert](x) * weight)
            return out
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, choice) pairs grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        pair_weights = weights.reshape(-1).index_select(0, order)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            expert_rows = rows[start:start + count]
            y = self.experts[expert](x.index_select(0, expert_rows))
            out.index_add_(0, expert_rows, y.mul_(pair_weights[start:start + count, None]))
            start += count
        return out

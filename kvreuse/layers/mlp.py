"""The gated MLP (SwiGLU, GELU-tanh, gpt-oss's clamped SwiGLU) over two Linear layers, its gate and up fused; and
Nemotron-H's ungated squared-ReLU MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.kernels import fused_ops
from kvreuse.layers.linear import Linear

CLAMPED_SWIGLU = "clamped_swiglu"


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", CLAMPED_SWIGLU)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation, in transformers' GptOssExperts._apply_gate's order of operations: the gate
    clamped from above, the up projection on both sides, (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU (the Llama family,
    Qwen's experts), tanh-approximated GELU (Gemma: transformers' ``gelu_pytorch_tanh``) or gpt-oss's clamped
    SwiGLU (``clamped_swiglu``, with ``swiglu_limit`` and ``swiglu_alpha``; its experts also have biases).
    The gate and up rows are held [gate; up] whatever the checkpoint's order (gpt-oss interleaves them: the
    loader splits them apart)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 activation: str = "silu", bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
        if activation == CLAMPED_SWIGLU and swiglu_limit is None:
            raise ValueError("the clamped_swiglu activation needs swiglu_limit")
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], bias, dtype, device)
        self.down_proj = Linear(intermediate_size, [hidden_size], bias, dtype, device)

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.activation == CLAMPED_SWIGLU:
            if gate_up.dim() == 2 and gate_up.is_contiguous() and fused_ops.applies(gate_up):
                return self.down_proj(fused_ops.clamped_swiglu(gate_up, self.swiglu_limit, self.swiglu_alpha), lora)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha), lora)
        if self.activation == "gelu_pytorch_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up), lora)
        if gate_up.is_contiguous() and fused_ops.applies(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up), lora)
        return self.down_proj(fused_ops.reference_silu_mul(gate_up), lora)


class SquaredReLUMLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP blocks (transformers' ``relu2``), no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, [intermediate_size], bias, dtype, device)
        self.down_proj = Linear(intermediate_size, [hidden_size], bias, dtype, device)

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x, lora)).square_(), lora)

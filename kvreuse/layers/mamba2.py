"""Nemotron-H's Mamba-2 mixer over a flat batch of many sequences, each sequence's state in a slot of the state pool.

The block (transformers' ``NemotronHMamba2Mixer``): ``in_proj`` gives the gate z, the convolved x|B|C and a time step
per head; x|B|C run through a causal depthwise convolution of width K (with a bias) and SiLU; each head h keeps a
head_dim x state_size matrix S, and every token, in order (B and C those of the head's group),

    dt = clamp(softplus(dt + dt_bias), time_step_limit)      decay = exp(dt * A),  A = -exp(A_log)
    S = S * decay + (dt B) x^T                                y = S C + D x

then y is gated by SiLU(z), RMS-normalised per group of heads (``n_groups``) and projected by ``out_proj``. A layer's
whole past is S and the convolution's last K - 1 inputs: a sequence's state, kept in its slot of
``RecurrentStatePool`` (cache/recurrent_state.py) and snapshotted as the Gated DeltaNet's is (cache/state_snapshots.py).

The scan runs token by token in float32, prefill chunks too (kernels/mamba2_scan.py's loop, or
``selective_scan_reference``), for the reason layers/gated_delta.py gives: the chunked SSD form sums a chunk's
contributions in an order that depends on where the chunk began, so a state snapshotted at token 412 and continued
would not be the bits a cold run computes there. Token by token, the state after token t is one function of the state
before it and token t: a hit changes no bit. On a CPU the loop costs about 2 head_dim x state_size multiply-adds a
token and head, the chunked form's work without its chunk-sized matrices.

On a CPU the whole mixer between the projections (the convolution, the scan, the gate and the grouped norm) is one
native call (kernels/mamba2_scan.py ``mixer``) that computes every row alike, prefill or decode; ``reference`` is the
same computation op by op (other devices, and the tests' reference).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.kernels import mamba2_scan as scan_kernel
from kvreuse.layers.linear import Linear, _empty_parameter
from kvreuse.layers.recurrent import Float32Parameters, StateInputs, causal_conv_with_state, silu


def selective_scan_reference(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                             a_log: torch.Tensor, dt_bias: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
                             layer: int, inputs: StateInputs, dt_limit: tuple[float, float] = (0.0, math.inf)
                             ) -> torch.Tensor:
    """The selective scan token by token (PyTorch): x [T, H, P], dt [T, H] (before dt_bias and softplus), B, C
    [T, G, N], all float32; ``states`` [slots, layers, H, P, N] updated in place. Returns y [T, H, P] float32."""
    heads, groups = x.shape[1], b.shape[1]
    a = -a_log.float().exp()
    steps = F.softplus(dt + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])  # [T, H]
    b_heads = b.repeat_interleave(heads // groups, dim=1)  # [T, H, N]
    c_heads = c.repeat_interleave(heads // groups, dim=1)
    out = torch.empty_like(x)
    for slot, start, length in zip(inputs.slots, inputs.starts, inputs.lens):
        state = states[slot, layer]  # [H, P, N]
        for row in range(start, start + length):
            step = steps[row]
            decay = torch.exp(step * a)
            state.mul_(decay[:, None, None]).add_((step[:, None] * b_heads[row])[:, None, :] * x[row][:, :, None])
            out[row] = (state * c_heads[row][:, None, :]).sum(dim=-1) + d.float()[:, None] * x[row]
    return out


def selective_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor, d: torch.Tensor, states: torch.Tensor, layer: int, inputs: StateInputs,
                   dt_limit: tuple[float, float]) -> torch.Tensor:
    """``selective_scan_reference`` in the native loop where it runs (CPU, float32 state), else the reference."""
    if states.device.type == "cpu" and scan_kernel.available():
        return scan_kernel.selective_scan(x, dt, b, c, a_log, dt_bias, d, states, layer, inputs.slots, inputs.starts,
                                          inputs.lens, dt_limit)
    return selective_scan_reference(x, dt, b, c, a_log, dt_bias, d, states, layer, inputs, dt_limit)


class GroupedGatedRMSNorm(nn.Module):
    """x * SiLU(z), RMS-normalised over each of ``groups`` equal slices, scaled by ``weight``: all in float32, rounded
    once (transformers' ``NemotronHRMSNormGated``, gate first)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gated = x.float() * silu(gate)
        rows = gated.shape[0]
        grouped = gated.view(rows, self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * grouped.view(rows, -1)).to(dtype)


class Mamba2Mixer(nn.Module):
    """HF's ``mixer.*`` of a Mamba-2 layer: ``in_proj``, ``conv1d`` (weight and bias), ``dt_bias``, ``A_log``, ``D``,
    ``norm`` and ``out_proj``. ``state_layer``: its index among the model's state layers (its place in a slot)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, groups: int, state_size: int, kernel: int,
                 conv_bias: bool, bias: bool, dt_limit: tuple[float, float], eps: float, state_layer: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads, self.head_dim, self.groups, self.state_size = heads, head_dim, groups, state_size
        self.inner_size = heads * head_dim
        self.conv_dim = self.inner_size + 2 * groups * state_size
        self.dt_limit = dt_limit
        self.state_layer = state_layer
        # One output part: a GGUF file holds ssm_in as one quantized matrix (z, x|B|C and dt split after the product).
        self.in_proj = Linear(hidden_size, [self.inner_size + self.conv_dim + heads], bias, dtype, device)
        self.conv1d = BiasedDepthwiseConv(self.conv_dim, kernel, conv_bias, dtype, device)
        self.dt_bias = _empty_parameter((heads,), dtype, device)
        self.A_log = _empty_parameter((heads,), dtype, device)
        self.D = _empty_parameter((heads,), dtype, device)
        self.norm = GroupedGatedRMSNorm(self.inner_size, groups, eps, dtype, device)
        self.out_proj = Linear(self.inner_size, [hidden_size], bias, dtype, device)
        self._native_parameters = Float32Parameters()

    def forward(self, hidden: torch.Tensor, inputs: StateInputs) -> torch.Tensor:
        rows = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split([self.inner_size, self.conv_dim, self.heads], dim=-1)
        pool = inputs.pool
        if pool.ssm.device.type == "cpu" and scan_kernel.available():  # the whole mixer in one native call
            conv_weight, conv_bias, a_log, dt_bias, d, norm_weight = self._native_parameters.get(
                self.conv1d.weight, self.conv1d.bias, self.A_log, self.dt_bias, self.D, self.norm.weight)
            y = scan_kernel.mixer(xbc, z, dt, conv_weight, conv_bias, pool.conv, a_log, dt_bias, d, norm_weight,
                                  pool.ssm, self.state_layer, inputs.slots, inputs.starts, inputs.lens, self.heads,
                                  self.groups, self.norm.eps, self.dt_limit)
            return self.out_proj(y.to(hidden.dtype))
        return self.out_proj(self.reference(rows, z, xbc, dt, inputs, hidden.dtype))

    def reference(self, rows: int, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, inputs: StateInputs,
                  dtype: torch.dtype) -> torch.Tensor:
        """The mixer between its projections op by op (PyTorch, the native scan where it builds): what the fused
        native call computes, in another summation order."""
        xbc = causal_conv_with_state(xbc, self.conv1d.weight, self.conv1d.bias, inputs, self.state_layer)
        x, b, c = xbc.float().split([self.inner_size, self.groups * self.state_size, self.groups * self.state_size],
                                    dim=-1)
        y = selective_scan(x.reshape(rows, self.heads, self.head_dim).contiguous(), dt.float().contiguous(),
                           b.reshape(rows, self.groups, self.state_size).contiguous(),
                           c.reshape(rows, self.groups, self.state_size).contiguous(), self.A_log, self.dt_bias,
                           self.D, inputs.pool.ssm, self.state_layer, inputs, self.dt_limit)
        return self.norm(y.reshape(rows, self.inner_size), z, dtype)


class BiasedDepthwiseConv(nn.Module):
    """The convolution's parameters under HF's names (``conv1d.weight`` [C, 1, K], ``conv1d.bias`` [C])."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter((channels, 1, kernel), dtype, device)
        self.bias = _empty_parameter((channels,), dtype, device) if bias else None

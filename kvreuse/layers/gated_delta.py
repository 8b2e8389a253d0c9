"""Qwen3.5's Gated DeltaNet over a flat batch of many sequences, each sequence's state in a slot of the state pool.

The block (transformers' ``Qwen3_5GatedDeltaNet``): ``in_proj`` gives the mixed q/k/v, the output gate z and per value
head b and a; q/k/v run through a causal depthwise convolution of width K with SiLU; q and k are L2-normalised (q also
scaled by 1/sqrt(dk)); each value head keeps a dk x dv matrix S, and every token, in order,

    S = S * exp(g)           g = -exp(A_log) * softplus(a + dt_bias)   (the decay)
    S = S + k (beta (v - k^T S))^T                                    beta = sigmoid(b)  (the delta rule)
    o = q^T S

then o is RMS-normalised per head, gated by SiLU(z) and projected by ``out_proj``. A layer's whole past is S and the
convolution's last K - 1 inputs: a sequence's state, kept in its slot of ``RecurrentStatePool`` (cache/recurrent_state.py),
not per token. A prefix hit resumes from a snapshot of it (cache/state_snapshots.py).

The update runs token by token, in float32, for prefill chunks too (``delta_rule``: the native loop of
kernels/gated_delta.py, or its PyTorch reference). transformers' chunked form (64 tokens a chunk) is a different
summation: the state it reaches at a chunk's end depends on where the chunks began, so a state snapshotted at token
412 and continued would not be the bits a cold run computes there. Token by token, the state after token t is one
function of the state before it and token t, however the tokens were split into steps, batched or resumed: a hit
changes no bit. On a CPU the loop costs no more: about 4 dk dv multiply-adds a token and head against the chunked
form's ~5.7 at 64-token chunks, with S (64 KiB at dk = dv = 128) in the core's L2.

On a CPU the whole mixer between the two projections (the convolution, the L2 norms, the gates, the rule and the
gated output norm, with a bfloat16 model's roundings where the op-by-op path rounds) is one native call
(kernels/gated_delta.py ``delta_mixer``) that computes every row alike, prefill or decode; ``reference`` is the same
computation op by op (other devices, float16, and the tests' reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.kernels import gated_delta as delta_kernel
from kvreuse.layers.linear import Linear, _empty_parameter
from kvreuse.layers.recurrent import Float32Parameters, StateInputs, causal_conv_with_state, native, silu

__all__ = ["GatedDeltaNet", "StateInputs", "delta_rule", "delta_rule_reference", "l2_normalize"]


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor, layer: int, inputs: StateInputs, tiled: bool = False) -> torch.Tensor:
    """The gated delta rule token by token (PyTorch): q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], all float32;
    ``states`` [slots, layers, Hv, dk, dv] updated in place. Returns o [T, Hv, dv] float32. Value head h reads key
    head h // (Hv / Hk) (HF's order), or h % Hk when ``tiled`` (llama.cpp's GGUF order)."""
    ratio = v.shape[1] // k.shape[1]
    out = torch.empty_like(v)
    for slot, start, length in zip(inputs.slots, inputs.starts, inputs.lens):
        state = states[slot, layer]
        for row in range(start, start + length):
            q_t = q[row].repeat(ratio, 1) if tiled else q[row].repeat_interleave(ratio, 0)
            k_t = k[row].repeat(ratio, 1) if tiled else k[row].repeat_interleave(ratio, 0)
            state.mul_(g[row].exp()[:, None, None])
            memory = (state * k_t[:, :, None]).sum(dim=1)
            delta = (v[row] - memory) * beta[row][:, None]
            state.add_(k_t[:, :, None] * delta[:, None, :])
            out[row] = (state * q_t[:, :, None]).sum(dim=1)
    return out


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               states: torch.Tensor, layer: int, inputs: StateInputs, tiled: bool = False) -> torch.Tensor:
    """``delta_rule_reference`` in the native loop where it runs (CPU, float32 state), else the reference."""
    if native(states):
        return delta_kernel.gated_delta_rule(q, k, v, g, beta, states, layer, inputs.slots, inputs.starts, inputs.lens,
                                             tiled)
    return delta_rule_reference(q, k, v, g, beta, states, layer, inputs, tiled)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, scaled by ``weight`` in the activations' dtype, then gated by SiLU(z) in
    float32 (transformers' ``Qwen3_5RMSNormGated``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * silu(gate)).to(dtype)


class GatedDeltaNet(nn.Module):
    """HF's ``linear_attn.*``: in_proj_qkv / _z / _b / _a fused into ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
    ``norm`` and ``out_proj``. ``state_layer``: its index among the model's Gated DeltaNet layers (its place in a slot).
    ``tiled_values``: the value heads in llama.cpp's GGUF order (value head h shares key head h % Hk; its converter
    reorders every value-head row and column so), not HF's (h // (Hv / Hk)); nothing else depends on their order."""

    def __init__(self, hidden_size: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
                 eps: float, state_layer: int, dtype: torch.dtype, device: torch.device,
                 tiled_values: bool = False) -> None:
        super().__init__()
        self.tiled_values = tiled_values
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.key_size, self.value_size = key_heads * key_dim, value_heads * value_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.state_layer = state_layer
        self.in_proj = Linear(hidden_size, [self.conv_dim, self.value_size, value_heads, value_heads], False, dtype,
                              device)
        self.conv1d = DepthwiseConv(self.conv_dim, kernel, dtype, device)
        self.dt_bias = _empty_parameter((value_heads,), dtype, device)
        self.A_log = _empty_parameter((value_heads,), dtype, device)
        self.norm = GatedRMSNorm(value_dim, eps, dtype, device)
        self.out_proj = Linear(self.value_size, [hidden_size], False, dtype, device)
        self._native_parameters = Float32Parameters()

    def forward(self, hidden: torch.Tensor, inputs: StateInputs) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_size, self.value_heads, self.value_heads], dim=-1)
        pool = inputs.pool
        if native(pool.ssm) and hidden.dtype in (torch.float32, torch.bfloat16):  # the whole mixer in one native call
            conv_weight, a_log, dt_bias, norm_weight = self._native_parameters.get(
                self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
            out = delta_kernel.delta_mixer(mixed, z, a, b, conv_weight, pool.conv, a_log, dt_bias, norm_weight, pool.ssm,
                                           self.state_layer, inputs.slots, inputs.starts, inputs.lens, self.key_heads,
                                           self.tiled_values, self.norm.eps, hidden.dtype == torch.bfloat16)
            return self.out_proj(out.to(hidden.dtype))
        return self.out_proj(self.reference(mixed, z, b, a, inputs, hidden.dtype))

    def reference(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, inputs: StateInputs,
                  dtype: torch.dtype) -> torch.Tensor:
        """The mixer between its projections op by op (PyTorch, the native loop and activations where they build):
        what the fused native call computes, in another summation order."""
        num_tokens = mixed.shape[0]
        mixed = causal_conv_with_state(mixed, self.conv1d.weight, None, inputs, self.state_layer)
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = l2_normalize(q.reshape(num_tokens, self.key_heads, self.key_dim).float()) * self.key_dim ** -0.5
        k = l2_normalize(k.reshape(num_tokens, self.key_heads, self.key_dim).float())
        v = v.reshape(num_tokens, self.value_heads, self.value_dim).float()
        if native(a):
            g, beta = delta_kernel.delta_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = b.sigmoid().float()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                         inputs.pool.ssm, self.state_layer, inputs, self.tiled_values)
        out = self.norm(out.to(dtype), z.reshape(num_tokens, self.value_heads, self.value_dim))
        return out.reshape(num_tokens, self.value_size)


class DepthwiseConv(nn.Module):
    """The convolution's weight under HF's name (``conv1d.weight`` [C, 1, K]; no bias in Qwen3.5)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter((channels, 1, kernel), dtype, device)

"""What a recurrent layer's step shares, whichever the layer (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2): where
each sequence of the flat batch keeps its state (``StateInputs``: a slot of cache/recurrent_state.py's pool), the causal
depthwise convolution that reads and leaves the last K - 1 inputs there, and the activations that give a value the same
bits wherever it sits in its tensor (kernels/gated_delta.py's scalar exp: batch invariance), PyTorch's elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.kernels import gated_delta as delta_kernel


@dataclass
class StateInputs:
    """Where a step's sequences keep their state: sequence i owns rows ``[starts[i], starts[i] + lens[i])`` of the
    flat batch and slot ``slots[i]`` of the pool."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    pool: RecurrentStatePool

    @classmethod
    def for_batch(cls, batch: ForwardBatch, kv_cache: KVCache) -> StateInputs:
        """Where ``batch``'s sequences keep their state: the slots the scheduler gave them in the pool."""
        if kv_cache.states is None or batch.state_slots is None:
            raise ValueError("a recurrent-state model's step needs the state pool and each sequence's slot "
                             "(KVCache.states, ForwardBatch.state_slots)")
        starts, row = [], 0
        for length in batch.query_lens:
            starts.append(row)
            row += length
        return cls(batch.state_slots, starts, list(batch.query_lens), kv_cache.states)


def causal_conv_with_state(mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inputs: StateInputs,
                           layer: int) -> torch.Tensor:
    """The depthwise causal convolution of ``mixed`` [T, C] by ``weight`` [C, 1, K] (plus ``bias`` [C]: Mamba-2's),
    then SiLU; each sequence's K - 1 inputs before its rows come from its slot, which ends holding its last K - 1
    inputs. Summed in float32 in tap order, so a row's output is the same bits whatever the batch."""
    kernel = weight.shape[-1]
    taps = weight.squeeze(1).t().float()  # [K, C]
    conv_states = inputs.pool.conv
    if all(length == 1 for length in inputs.lens):  # a decode step: every sequence's window at once, the same sums
        slots = torch.tensor(inputs.slots, dtype=torch.long, device=mixed.device)
        window = torch.cat((conv_states[slots, layer], mixed.float().unsqueeze(1)), dim=1)  # [N, K, C]
        total = window[:, 0] * taps[0]
        for tap in range(1, kernel):
            total = total + window[:, tap] * taps[tap]
        conv_states[slots, layer] = window[:, 1:]
        if bias is not None:
            total = total + bias.float()
        return silu_(total).to(mixed.dtype)
    out = torch.empty(mixed.shape, dtype=torch.float32, device=mixed.device)
    for slot, start, length in zip(inputs.slots, inputs.starts, inputs.lens):
        window = torch.cat((conv_states[slot, layer], mixed[start:start + length].float()))  # [K - 1 + n, C]
        total = window[0:length] * taps[0]
        for tap in range(1, kernel):
            total = total + window[tap:tap + length] * taps[tap]
        out[start:start + length] = total
        conv_states[slot, layer] = window[length:]
    if bias is not None:
        out += bias.float()
    return silu_(out).to(mixed.dtype)


def native(x: torch.Tensor) -> bool:
    """Whether ``x``'s activations run in kernels/gated_delta.py (CPU, where it builds): the same bits for a value
    wherever it sits in its tensor, which batch invariance needs; PyTorch's ops elsewhere."""
    return x.device.type == "cpu" and delta_kernel.available()


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` in float32."""
    return delta_kernel.pointwise(x, delta_kernel.SILU) if native(x) else F.silu(x.float())


def silu_(x: torch.Tensor) -> torch.Tensor:
    """SiLU of a contiguous float32 ``x`` that the caller owns, in place (no copy on the step's widest tensor)."""
    return delta_kernel.pointwise_(x, delta_kernel.SILU) if native(x) else F.silu(x, inplace=True)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid of ``x`` in float32."""
    return delta_kernel.pointwise(x, delta_kernel.SIGMOID) if native(x) else torch.sigmoid(x.float())


class Float32Parameters:
    """float32, contiguous copies of a mixer's small parameters for its native call, made once and remade only when
    a parameter changes in place (its version moves, as loading copies into it): a bfloat16 model's step would
    otherwise convert them in every layer of every step."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self._copies: tuple[torch.Tensor | None, ...] = ()

    def get(self, *parameters: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        key = tuple((id(p), p._version) if p is not None else (0, 0) for p in parameters)
        if key != self._key:
            self._copies = tuple(None if p is None else p.detach().float().contiguous() for p in parameters)
            self._key = key
        return self._copies


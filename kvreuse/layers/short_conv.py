"""LFM2's gated short convolution over a flat batch of many sequences, its inputs kept in the paged pool.

The block (transformers' ``Lfm2ShortConv``): ``in_proj`` gives B, C and x (each hidden wide), ``B * x`` runs
through a causal depthwise convolution of width K (``conv_L_cache``, 3 in every released LFM2), and
``C *`` its output goes through ``out_proj``. A token's output reads its own ``B * x`` and the K - 1 before it:
the layer's whole past is those K - 1 rows. So the layer keeps each token's ``B * x`` in the pool, one plane row
per slot beside the attention layers' K/V (cache/kv.py ``planes``), and reads a row's K inputs by slot, as
attention reads its keys: a chunked prefill, a decode step, a prefix hit ending at any token (the rows before it
are cached with their blocks) and a verified draft (a rejected token's row is overwritten later, as its K/V is)
all read exactly the rows that were written, and nothing is recomputed or snapshotted.

A step's sequences are concatenated as everywhere else (``ForwardBatch``): sequence i owns rows
``[query_start[i], query_start[i] + query_lens[i])`` and its positions run up to its context length.
``ConvTaps`` gives each row the slots of its K inputs: the K - 1 positions before the sequence's first row this
step from its block table (the pool's zero row before position 0), the rest the step's own slots, which the
layer writes before it reads. Every row's sum runs in the same order whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvreuse.kernels import fused_ops
from kvreuse.layers.linear import Linear, _empty_parameter


@dataclass
class ConvTaps:
    """Where a step's rows read their convolution inputs: ``slots`` [T, K], oldest first."""

    slot_mapping: torch.Tensor  # [T] int64: where each row's own input is written
    slots: torch.Tensor  # [T, K] int64

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, starts: list[int], query_lens: list[int],
              block_tables: list[list[int]], block_size: int, kernel: int, zero_slot: int) -> ConvTaps:
        """``starts``: each sequence's first position this step; ``block_tables``: its blocks (the positions
        before ``starts`` are cached there); ``zero_slot``: the pool's zero row (before position 0)."""
        keep, num_seqs = kernel - 1, len(query_lens)
        before = [zero_slot if position < 0 else table[position // block_size] * block_size + position % block_size
                  for start, table in zip(starts, block_tables) for position in range(start - keep, start)]
        # Index into [the K - 1 slots before each sequence, the step's slots]: row r of sequence i, tap k reads
        # offset (r - first row of i) - (K - 1) + k of its sequence, before its first row where that is negative.
        lengths = torch.tensor(query_lens, dtype=torch.long)
        sequence = torch.repeat_interleave(torch.arange(num_seqs), lengths)
        first = (torch.cumsum(lengths, 0) - lengths)[sequence]
        offset = (torch.arange(int(lengths.sum())) - first).unsqueeze(1) - keep + torch.arange(kernel)
        index = torch.where(offset < 0, (sequence * keep + keep).unsqueeze(1) + offset,
                            num_seqs * keep + first.unsqueeze(1) + offset)
        device = slot_mapping.device
        pool_slots = torch.cat((torch.tensor(before, dtype=torch.long, device=device), slot_mapping))
        return cls(slot_mapping, pool_slots[index.to(device)])


def reference_short_conv(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, planes: torch.Tensor,
                         taps: ConvTaps) -> torch.Tensor:
    """``C * conv(B * x)`` for bcx [T, 3H] (in_proj's B | C | x), op by op: each row's B * x written to its slot of
    ``planes`` [slots + 1, H] (one conv layer's rows in the pool), then its K inputs read by slot and summed by
    ``weight`` [K, H] float32 in tap order in float32 (a half-precision model's conv1d accumulates so too), plus
    ``bias`` [H] float32, rounded once, then gated by C. What kernels/fused_ops.py's ``short_conv`` computes in one
    pass, bit for bit."""
    b, c, x = bcx.split(bcx.shape[1] // 3, dim=-1)
    planes.index_copy_(0, taps.slot_mapping, (b * x).to(planes.dtype))
    inputs = planes[taps.slots]  # [T, K, H]
    total = inputs[:, 0].float() * weight[0]
    for tap in range(1, weight.shape[0]):
        total = total + inputs[:, tap].float() * weight[tap]
    if bias is not None:
        total = total + bias
    return c * total.to(bcx.dtype)


@dataclass
class ConvInputs:
    """What a step's conv layers read: where each row's convolution inputs are, and the pool's planes
    [conv layers, slots + 1, H]."""

    taps: ConvTaps
    planes: torch.Tensor


class ShortConv(nn.Module):
    """HF's ``conv.{in_proj,conv,out_proj}``: the gated short convolution of one layer, whose inputs are row ``plane``
    of the pool's planes."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, plane: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.plane = plane
        self.in_proj = Linear(hidden_size, [3 * hidden_size], bias, dtype, device)
        self.conv = DepthwiseConvWeight(hidden_size, kernel, bias, dtype, device)
        self.out_proj = Linear(hidden_size, [hidden_size], bias, dtype, device)

    def forward(self, hidden: torch.Tensor, inputs: ConvInputs) -> torch.Tensor:
        bcx = self.in_proj(hidden)
        weight, bias = self.conv.taps()
        planes = inputs.planes[self.plane]
        if fused_ops.applies(bcx) and planes.dtype == bcx.dtype:
            mixed = fused_ops.short_conv(bcx.contiguous(), weight, bias, planes, inputs.taps.slots,
                                         inputs.taps.slot_mapping)
        else:
            mixed = reference_short_conv(bcx, weight, bias, planes, inputs.taps)
        return self.out_proj(mixed)


class DepthwiseConvWeight(nn.Module):
    """The convolution's parameters under HF's names (``conv.conv.weight`` [H, 1, K], ``conv.conv.bias``)."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter((hidden_size, 1, kernel), dtype, device)
        self.bias = _empty_parameter((hidden_size,), dtype, device) if bias else None
        self._key: tuple[int, int] | None = None
        self._taps: tuple[torch.Tensor, torch.Tensor | None] = (self.weight, None)

    def taps(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel as float32 [K, H] (tap-major, contiguous) and the bias as float32 [H]: what both the kernel and
        the reference sum by, made once and remade only where loading changes a parameter (its version moves)."""
        key = (self.weight._version, -1 if self.bias is None else self.bias._version)
        if key != self._key:
            weight = self.weight.detach().squeeze(1).t().float().contiguous()
            bias = None if self.bias is None else self.bias.detach().float().contiguous()
            self._taps, self._key = (weight, bias), key
        return self._taps

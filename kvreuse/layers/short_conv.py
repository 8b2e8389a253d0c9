"""LFM2's gated short convolution over a flat batch of many sequences, each carrying its state in a slot.

The block (transformers' ``Lfm2ShortConv``): ``in_proj`` gives B, C and x (each hidden wide), ``B * x`` runs
through a causal depthwise convolution of width K (``conv_L_cache``, 3 in every released LFM2), and
``C *`` its output goes through ``out_proj``. A token's output reads its own ``B * x`` and the K - 1 before it,
so a sequence's whole past is those K - 1 rows: its recurrent state, kept per sequence in a slot of
``RecurrentStates`` between steps (a chunked prefill, then one row a decode step).

A step's sequences are concatenated as everywhere else (``ForwardBatch``): sequence i owns rows
``[query_start[i], query_start[i] + query_lens[i])``. ``ConvWindows`` turns that into two gathers over one
buffer, the sequences' states followed by the step's rows: each row's K inputs, and each sequence's new state.
A sequence whose step starts at position 0 reads zeros (a new sequence, or one preempted and recomputed), never
what its slot held before. Every row's sum runs in the same order whatever the batch, so a token's output does not
depend on what else ran in its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.layers.linear import Linear, _empty_parameter


@dataclass
class ConvWindows:
    """Where a step's rows read their convolution inputs: indices into ``[states of the step's sequences
    (K - 1 rows each), the step's rows]``."""

    slots: torch.Tensor  # [S] int64: each sequence's state slot
    fresh: torch.Tensor  # [S] bool: the sequence starts at position 0 (its state is zeros)
    window_rows: torch.Tensor  # [T, K] int64: each row's K inputs, oldest first
    state_rows: torch.Tensor  # [S, K - 1] int64: each sequence's state after the step

    @classmethod
    def build(cls, slots: list[int], starts: list[int], query_lens: list[int], kernel: int,
              device: torch.device) -> ConvWindows:
        """``starts``: each sequence's first position this step (0: fresh)."""
        keep = kernel - 1
        num_seqs = len(slots)
        base = num_seqs * keep  # the step's rows follow the states
        window_rows: list[list[int]] = []
        state_rows: list[list[int]] = []
        row = 0

        def source(sequence: int, first_row: int, offset: int) -> int:
            # offset < 0: the state's row (keep + offset); else the step's row
            return sequence * keep + keep + offset if offset < 0 else base + first_row + offset

        for sequence, length in enumerate(query_lens):
            for offset in range(length):
                window_rows.append([source(sequence, row, offset - keep + k) for k in range(kernel)])
            state_rows.append([source(sequence, row, length - keep + k) for k in range(keep)])
            row += length
        long = dict(dtype=torch.long, device=device)
        return cls(torch.tensor(slots, **long), torch.tensor([start == 0 for start in starts], device=device),
                   torch.tensor(window_rows, **long).view(-1, kernel), torch.tensor(state_rows, **long).view(num_seqs, keep))


class RecurrentStates:
    """The short convolutions' states: per conv layer, ``num_slots`` slots of K - 1 rows of hidden values, in the
    model's dtype (what the next step reads, as transformers keeps its conv cache)."""

    def __init__(self, num_layers: int, num_slots: int, kernel: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.tensor = torch.zeros(num_layers, num_slots, kernel - 1, hidden_size, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def layer(self, index: int) -> torch.Tensor:
        return self.tensor[index]


def causal_conv(bx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, windows: ConvWindows,
                states: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution of ``bx`` [T, H] by ``weight`` [H, 1, K], each sequence continuing from its
    slot in ``states`` [slots, K - 1, H], which is updated in place to the state after the step."""
    previous = states.index_select(0, windows.slots)
    previous = previous.masked_fill(windows.fresh.view(-1, 1, 1), 0)
    buffer = torch.cat((previous.reshape(-1, bx.shape[-1]), bx))
    taps = buffer[windows.window_rows]  # [T, K, H]
    # In float32, rounded once (a half-precision model's conv1d accumulates so too).
    out = (taps.float() * weight.squeeze(1).t().float()).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    out = out.to(bx.dtype)
    states.index_copy_(0, windows.slots, buffer[windows.state_rows])
    return out


class ShortConv(nn.Module):
    """HF's ``conv.{in_proj,conv,out_proj}``: the gated short convolution of one layer."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = Linear(hidden_size, [3 * hidden_size], bias, dtype, device)
        self.conv = DepthwiseConvWeight(hidden_size, kernel, bias, dtype, device)
        self.out_proj = Linear(hidden_size, [hidden_size], bias, dtype, device)

    def forward(self, hidden: torch.Tensor, windows: ConvWindows, states: torch.Tensor,
                lora: ProjectionDeltas | None = None) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).split(self.hidden_size, dim=-1)
        mixed = causal_conv(b * x, self.conv.weight, self.conv.bias, windows, states)
        return self.out_proj(c * mixed)


class DepthwiseConvWeight(nn.Module):
    """The convolution's parameters under HF's names (``conv.conv.weight`` [H, 1, K], ``conv.conv.bias``)."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter((hidden_size, 1, kernel), dtype, device)
        self.bias = _empty_parameter((hidden_size,), dtype, device) if bias else None

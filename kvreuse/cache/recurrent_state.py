"""RecurrentStatePool: the tensors of a hybrid model's per-sequence recurrent state (Qwen3.5's Gated DeltaNet).

A slot holds one sequence's state across every Gated DeltaNet layer: each value head's dk x dv matrix (``ssm``) and the
convolution's last K - 1 inputs (``conv``), both float32. A running request owns a slot; when it finishes (or is
preempted) its slot becomes a snapshot of its state at its last computed token, kept in the prefix index
(cache/state_snapshots.py, the manager's ``StateSlots``); a request that hits there starts with a copy of it. The
copies the manager asks for (``StateCopy``: a snapshot into a new request's slot, a request's state into a branch
snapshot, zeros for a request that starts at token 0, or a state read back from a KV tier) run before the step's
forward, in order. ``read_slot`` / ``write_slot`` are a slot's bytes for the tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvreuse.cache.state_slots import StateCopy


class RecurrentStatePool:
    def __init__(self, num_slots: int, num_layers: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_dim: int, conv_kernel: int, device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.ssm = torch.zeros(num_slots, num_layers, value_heads, key_dim, value_dim, dtype=torch.float32,
                               device=device)
        self.conv = torch.zeros(num_slots, num_layers, conv_kernel - 1, conv_dim, dtype=torch.float32, device=device)

    @property
    def slot_bytes(self) -> int:
        return (self.ssm[0].numel() + self.conv[0].numel()) * 4

    @property
    def memory_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def read_slot(self, slot: int) -> bytes:
        """One slot's state as bytes (its ``ssm`` matrices, then its ``conv`` rows): what a KV tier stores."""
        return b"".join(part[slot].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
                        for part in (self.ssm, self.conv))

    def write_slot(self, slot: int, payload: bytes | memoryview) -> None:
        """Fill one slot from ``read_slot``'s bytes."""
        if len(payload) != self.slot_bytes:
            raise ValueError(f"a state payload has {self.slot_bytes} bytes, got {len(payload)}")
        values = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        split = self.ssm[slot].numel()
        self.ssm[slot].copy_(values[:split].view(self.ssm[slot].shape))
        self.conv[slot].copy_(values[split:].view(self.conv[slot].shape))

    def apply(self, copies: Sequence[StateCopy]) -> None:
        """Run the step's state copies in order (a ``src`` of None: zeros, or the copy's ``payload``)."""
        for copy in copies:
            if copy.payload is not None:
                self.write_slot(copy.dst, copy.payload)
            elif copy.src is None:
                self.ssm[copy.dst].zero_()
                self.conv[copy.dst].zero_()
            else:
                self.ssm[copy.dst].copy_(self.ssm[copy.src])
                self.conv[copy.dst].copy_(self.conv[copy.src])

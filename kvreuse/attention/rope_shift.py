"""Moving rotated keys to other positions (issue 39, part two: chunks reused at any position).

A chunk's K/V computed where it first appeared can serve the chunk somewhere else. V carries no position.
K was rotated by RoPE at its old positions p..p+n-1, and must look as if computed at q..q+n-1.

**Rotate by the delta; keep no un-rotated K.** RoPE turns each pair of a head's dimensions (i, i + d/2 in
the rotate-half layout kvreuse uses for every family) by the angle position * inv_freq[i]. Rotations of a
plane compose: R(q) = R(q - p) R(p). So K rotated at p, turned once more by the delta q - p, is K at q.
Why this and not un-rotated K:

- The paged pool already holds rotated K, as attention reads it: every kernel, the fused rotary included,
  writes K rotated. Un-rotated K would need either a second copy of every chunk's K (memory the pool
  could spend on tokens), or kernels that rotate K as they read it (every backend changed, and a rotation
  per token per step instead of one per reuse).
- A block computed for a plain prefix can serve as a chunk as it stands: its K is already rotated.
- The cost is float rounding: the angle used is fl(p * f) + fl(d * f) instead of fl(q * f) (each product
  rounded in float32, as the tables are), and one more rounding of the result to the pool's dtype. In
  float32 that is at most about 1.5 ulp of the largest angle, times the pair's length: about 2e-4 of a
  pair's norm at positions up to 2,047, 2e-3 up to 16,383 (tests/test_rope_shift.py holds it to that bound).
  In bfloat16 the extra rounding of K to the pool's dtype is what counts. Measured on SmolLM2-135M's first
  layer, 512 tokens moved from 0 to 1,536, against float32 K computed there: RMS error 3.77e-3 of K's RMS
  shifted, 3.48e-3 computed directly in bfloat16 (the rounding K has anyway).

What it relies on:

- Q/K norms (Qwen3, Gemma 3) act on K before rotary: norm-then-rotate, so a rotation after is exact.
- YaRN's tables carry its attention factor in cos and sin. K rotated at p carries it once already, so the
  delta's rotation divides it out (``RotaryEmbedding.attention_factor``).
- Each layer rotates with its own table: Gemma 3's sliding layers with their local base
  (``rotary_for_layer``).
- Partial rotary (rope over fewer dimensions than head_dim) is refused at load (loading/gguf.py), so every
  dimension pair turns.

Quantized K (``kv_cache_dtype`` int8 / fp8) is not handled here: it has to be dequantized, turned and
quantized again with fresh scales. That belongs with the chunk store, which reads and writes the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvreuse.cache.kv import KVCache


class RotaryTable(Protocol):
    """What a turn reads of a rotary layer's table (layers/rotary.py's ``RotaryEmbedding``): cos and sin
    [max_position, head_dim // 2] in float32 by position, and the factor YaRN scales both by."""

    head_dim: int
    max_position: int
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    attention_factor: float


def delta_cos_sin(rotary: RotaryTable, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, head_dim // 2] in float32 of the rotation by each of ``deltas`` [n] positions (any
    sign), from the model's own table: cos is even and sin odd, so a move back reads the table at -delta."""
    distance = deltas.abs()
    if int(distance.max()) >= rotary.max_position:
        raise ValueError(f"a position delta of {int(distance.max())} is beyond the rotary table's "
                         f"{rotary.max_position} positions")
    cos = rotary.cos_cache.index_select(0, distance)
    sin = rotary.sin_cache.index_select(0, distance) * deltas.sign().to(torch.float32)[:, None]
    if rotary.attention_factor != 1.0:
        cos, sin = cos / rotary.attention_factor, sin / rotary.attention_factor
    return cos.unsqueeze(1), sin.unsqueeze(1)


def shift_rotated_keys(keys: torch.Tensor, delta: int | torch.Tensor, rotary: RotaryTable) -> torch.Tensor:
    """K rows [n, kv_heads, head_dim] rotated at positions p..p+n-1, returned as if rotated at p+delta.. .

    ``delta`` is one int (a chunk moves as a whole) or an int tensor [n], a delta per row (several chunks,
    each moved by its own amount, in one call). The rotation runs in float32 and rounds once to ``keys``'
    dtype. A delta of 0 returns ``keys`` itself; a zero row in a tensor of deltas comes back bit for bit
    (cos 1 and sin 0 exactly). Returns a new tensor otherwise: the caller writes it where it belongs.
    """
    if keys.shape[-1] != rotary.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]}, the rotary table {rotary.head_dim}")
    if isinstance(delta, int):
        if delta == 0:
            return keys
        deltas = torch.full((keys.shape[0],), delta, dtype=torch.int64, device=keys.device)
    else:
        deltas = delta.to(device=keys.device, dtype=torch.int64)
        if deltas.shape != (keys.shape[0],):
            raise ValueError(f"one delta per row: {keys.shape[0]} rows, deltas of shape {tuple(deltas.shape)}")
    return turned_by(keys, *delta_cos_sin(rotary, deltas))


def turned_by(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """K rows [n, kv_heads, head_dim] turned by ``delta_cos_sin``'s cos and sin in float32, rounded once to
    ``keys``' dtype (the rotate-half layout: dimension i pairs with i + head_dim / 2)."""
    rows = keys.float()
    half = rows.shape[-1] // 2
    first, second = rows[..., :half], rows[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(keys.dtype)


def move_kv(rotaries: Sequence[RotaryTable], kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor,
            deltas: torch.Tensor, capture_layer: int = -1,
            first_layer: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Copy the K/V of layers ``first_layer`` on from slots ``src`` to ``dst`` [M], each K row turned by its delta
    with the layer's own table (``rotaries[layer]``: the model's ``rotary_tables()``), in float32, rounded once
    as the pool stores it (a quantized pool dequantizes and
    quantizes again with fresh scales: ``KVCache.gather`` / ``write``). Returns the K and V written at
    ``capture_layer``, float32, as the blend's deviation reference (None for -1). A source slot is read before any
    destination is written, so sources and destinations may overlap.

    Layers before ``first_layer`` are left alone: a blend's forward computes them afresh for every row (its check
    layers), so moving them would be overwritten unread. A float pool copies V as stored (a float32 round trip
    changes no bit of it) and turns K with cos and sin computed once per table."""
    num_layers = len(rotaries)
    if not 0 <= first_layer <= num_layers or capture_layer >= 0 and capture_layer < first_layer:
        raise ValueError(f"first_layer {first_layer} must be in 0..{num_layers} and at or before capture_layer "
                         f"{capture_layer}")
    if kv_cache.scheme is None:
        return _move_float_pool(rotaries, kv_cache, src, dst, deltas, capture_layer, first_layer)
    captured = None
    for layer in range(first_layer, num_layers):
        keys, values = kv_cache.gather(layer, src, torch.float32)
        keys = shift_rotated_keys(keys, deltas, rotaries[layer])
        kv_cache.write(layer, dst, keys, values)
        if layer == capture_layer:
            # What the pool now holds (rounded to its dtype), so an unchanged token deviates by exactly 0.
            captured = kv_cache.gather(layer, dst, torch.float32)
    return captured


def _move_float_pool(rotaries: Sequence[RotaryTable], kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor,
                     deltas: torch.Tensor, capture_layer: int,
                     first_layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``move_kv`` on a float pool, layer by layer: V copied as stored, K turned in float32 with each rotary
    table's cos and sin of the deltas computed once (Gemma 3's sliding layers have their own table). The same
    arithmetic as ``shift_rotated_keys`` (``turned_by``), so the same bits; a third faster than through
    ``gather`` / ``write`` (27 of SmolLM2's layers, 2,000 moved tokens: 25 against 32 ms on the 2-core Xeon VM)."""
    deltas = deltas.to(device=kv_cache.device, dtype=torch.int64)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    captured = None
    for layer in range(first_layer, len(rotaries)):
        rotary = rotaries[layer]
        if id(rotary) not in tables:
            tables[id(rotary)] = delta_cos_sin(rotary, deltas)
        cos, sin = tables[id(rotary)]
        key_pool, value_pool, _, _ = kv_cache.layer_pools(layer)
        value_pool.index_copy_(0, dst, value_pool.index_select(0, src))
        key_pool.index_copy_(0, dst, turned_by(key_pool.index_select(0, src), cos, sin))
        if layer == capture_layer:
            # What the pool now holds (rounded to its dtype), so an unchanged token deviates by exactly 0.
            captured = key_pool.index_select(0, dst).float(), value_pool.index_select(0, dst).float()
    return captured

"""RoPE re-rotation (attention/rope_shift.py, issue 39 part two): K computed at positions p.. and turned by the
delta equals K computed at q.. by the model itself, within the float32 rounding of the angles.

The K compared are the engine's own: the tiny models run a sequence through ``ModelRunner.execute`` at
chosen positions and the pool's K rows are read back, so the path is the one serving takes (the fused
rotary on CPU, Q/K norms before it). Layer 0's K depends on nothing but the tokens and their positions,
so placing the same tokens at p and at q gives K that differ by the rotation alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvreuse import LLM
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.rope_shift import shift_rotated_keys

TOKENS = 40  # three blocks of 16, the last partly filled


def keys_at(llm: LLM, token_ids: list[int], start: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s K [n, kv_heads, head_dim] of ``token_ids`` computed at positions start.., as the
    engine's pool holds them (blocks 0, 1, 2 of an engine that runs nothing else)."""
    engine = llm.engine
    block_size = engine.kv_cache.block_size
    count = len(token_ids)
    table = list(range(math.ceil(count / block_size)))
    slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(count)])
    batch = ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.arange(start, start + count, dtype=torch.int64),
        slot_mapping=slots, query_lens=[count], context_lens=[count], block_tables=[table],
        logits_indices=torch.tensor([count - 1], dtype=torch.int64))
    engine.runner.execute(batch)
    keys, _ = engine.kv_cache.gather(layer, slots)
    return keys.reshape(count, -1, engine.model.config.head_dim).clone()


def float32_bound(largest_position: int) -> float:
    """The largest error, as a share of a dimension pair's length, that float32 angles allow. The direct
    angle is fl(q f), the shifted one fl(p f) + fl(d f): three roundings of half an ulp each, at angles below
    largest_position (f <= 1). Then cos / sin and the two rotations' arithmetic: a few ulp of 1 (8 allowed)."""
    angle_ulp = 2.0 ** (math.floor(math.log2(largest_position)) - 23)
    return 1.5 * angle_ulp + 8 * 2.0 ** -24


def pair_lengths(keys: torch.Tensor) -> torch.Tensor:
    """Each rotated pair's length (|(x_i, x_{i + d/2})|), beside both of its dimensions."""
    half = keys.shape[-1] // 2
    length = torch.sqrt(keys[..., :half] ** 2 + keys[..., half:] ** 2)
    return torch.cat((length, length), dim=-1)


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]) -> dict[str, LLM]:
    return {}


def engine_for(engines: dict[str, LLM], tiny_models: dict[str, Path], arch: str) -> LLM:
    if arch not in engines:
        engines[arch] = LLM(str(tiny_models[arch]), dtype="float32", device="cpu", kv_cache_memory="4MiB",
                            enable_prefix_caching=False)
    return engines[arch]


# llama: Llama 3.1 rope scaling; qwen3: Q/K norms before rotary; gpt_oss: YaRN (cos and sin carry its
# attention factor); gemma3: layer 0 slides, with its own rope base; qwen2: plain rope.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss", "gemma3", "qwen2"])
@pytest.mark.parametrize(("old_start", "new_start"), [(0, 1500), (1300, 7), (600, 611)])
def test_shifted_keys_equal_keys_computed_at_the_new_positions(
        engines: dict[str, LLM], tiny_models: dict[str, Path], arch: str, old_start: int, new_start: int) -> None:
    llm = engine_for(engines, tiny_models, arch)
    model = llm.engine.model
    token_ids = torch.randint(10, model.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    old = keys_at(llm, token_ids, old_start, layer=0)
    direct = keys_at(llm, token_ids, new_start, layer=0)
    shifted = shift_rotated_keys(old, new_start - old_start, model.rotary_for_layer(0))

    bound = float32_bound(max(old_start, new_start) + TOKENS)
    lengths = pair_lengths(direct)
    error = (shifted - direct).abs()
    assert bool((error <= bound * lengths + 1e-7).all()), (
        f"worst error {float((error / (lengths + 1e-12)).max()):.2e} of a pair's length, bound {bound:.2e}")
    # The check has teeth: K left where it was, or turned the wrong way, is far outside the bound.
    for wrong in (old, shift_rotated_keys(old, old_start - new_start, model.rotary_for_layer(0))):
        assert float((wrong - direct).abs().max()) > 100 * bound * float(lengths.max())


def test_a_delta_of_zero_returns_the_keys_unchanged(engines: dict[str, LLM], tiny_models: dict[str, Path]) -> None:
    llm = engine_for(engines, tiny_models, "gpt_oss")  # YaRN: the attention factor divided out leaves 1 exactly
    rotary = llm.engine.model.rotary_for_layer(0)
    keys = torch.randn(5, 2, rotary.head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert shift_rotated_keys(keys, 0, rotary) is keys
    # Zero deltas among others, in a tensor: those rows come back bit for bit, the others move.
    deltas = torch.tensor([0, 3, 0, -2, 0])
    moved = shift_rotated_keys(keys, deltas, rotary)
    assert moved.dtype == torch.bfloat16
    assert torch.equal(moved[deltas == 0], keys[deltas == 0])
    assert not torch.equal(moved[deltas != 0], keys[deltas != 0])


def test_moves_compose_and_undo(engines: dict[str, LLM], tiny_models: dict[str, Path]) -> None:
    """There and back is the identity, and two moves are one move of their sum (float32 rounding only)."""
    rotary = engine_for(engines, tiny_models, "llama").engine.model.rotary_for_layer(0)
    keys = torch.randn(TOKENS, 2, rotary.head_dim, generator=torch.Generator().manual_seed(1))
    back = shift_rotated_keys(shift_rotated_keys(keys, 900, rotary), -900, rotary)
    torch.testing.assert_close(back, keys, rtol=0, atol=float32_bound(900) * float(pair_lengths(keys).max()))
    twice = shift_rotated_keys(shift_rotated_keys(keys, 500, rotary), 700, rotary)
    once = shift_rotated_keys(keys, 1200, rotary)
    torch.testing.assert_close(twice, once, rtol=0, atol=float32_bound(1200) * float(pair_lengths(keys).max()))


def test_gemma3_layers_use_their_own_tables(engines: dict[str, LLM], tiny_models: dict[str, Path]) -> None:
    model = engine_for(engines, tiny_models, "gemma3").engine.model
    tables = {id(model.rotary_for_layer(layer)) for layer in range(len(model.model.layers))}
    assert tables == {id(model.rotary), id(model.local_rotary)}
    assert model.rotary_for_layer(0) is model.local_rotary  # the first layer slides


def test_refusals(engines: dict[str, LLM], tiny_models: dict[str, Path]) -> None:
    rotary = engine_for(engines, tiny_models, "llama").engine.model.rotary_for_layer(0)
    keys = torch.zeros(3, 2, rotary.head_dim)
    with pytest.raises(ValueError, match="beyond the rotary table"):
        shift_rotated_keys(keys, -rotary.max_position, rotary)
    with pytest.raises(ValueError, match="one delta per row"):
        shift_rotated_keys(keys, torch.tensor([1, 2]), rotary)
    with pytest.raises(ValueError, match="head_dim"):
        shift_rotated_keys(torch.zeros(3, 2, rotary.head_dim + 2), 1, rotary)


def moved_layer_by_layer(model: Any, kv_cache: Any, src: torch.Tensor, dst: torch.Tensor, deltas: torch.Tensor,
                         first_layer: int) -> None:
    """The reference move: each layer through the pool's own gather (float32) and write, K turned by
    ``shift_rotated_keys``."""
    for layer in range(first_layer, model.config.num_hidden_layers):
        keys, values = kv_cache.gather(layer, src, torch.float32)
        kv_cache.write(layer, dst, shift_rotated_keys(keys, deltas, model.rotary_for_layer(layer)), values)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: two rotary tables among the layers
def test_a_float_pools_move_is_the_gather_and_write_move_bit_for_bit(tiny_models: dict[str, Path], arch: str) -> None:
    from kvreuse.attention import rope_shift

    llm = LLM(str(tiny_models[arch]), dtype="bfloat16", device="cpu", kv_cache_memory="4MiB",
              enable_prefix_caching=False)
    model, kv_cache = llm.engine.model, llm.engine.kv_cache
    layers = model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(7)
    kv_cache.kv.copy_(torch.randn(kv_cache.kv.shape, generator=generator).to(kv_cache.kv.dtype))
    before = kv_cache.kv.clone()
    # Sources and destinations overlap (a turn moved earlier reads slots it also writes), deltas of both signs.
    src = torch.tensor([40, 41, 42, 43, 90, 91])
    dst = torch.tensor([38, 39, 40, 41, 130, 131])
    deltas = torch.tensor([-2, -2, -2, -2, 40, 40])
    for first_layer in range(layers):
        kv_cache.kv.copy_(before)
        moved_layer_by_layer(model, kv_cache, src, dst, deltas, first_layer)
        expected = kv_cache.kv.clone()
        kv_cache.kv.copy_(before)
        captured = rope_shift.move_kv(model.rotary_tables(), kv_cache, src, dst, deltas, capture_layer=layers - 1,
                                      first_layer=first_layer)
        assert torch.equal(kv_cache.kv, expected), f"first_layer {first_layer}"
        assert torch.equal(kv_cache.kv[:first_layer], before[:first_layer]), "layers before first_layer moved"
        reference = kv_cache.gather(layers - 1, dst, torch.float32)
        assert torch.equal(captured[0], reference[0]) and torch.equal(captured[1], reference[1])
    with pytest.raises(ValueError, match="first_layer"):
        rope_shift.move_kv(model.rotary_tables(), kv_cache, src, dst, deltas, capture_layer=0, first_layer=1)

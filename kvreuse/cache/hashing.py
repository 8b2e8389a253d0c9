"""Stable content keys for KV blocks.

The key of block i is BLAKE2b(key of block i-1 || tokens of block i); the first block's parent is the
key of the request's namespace (cache_salt, adapter, model, speculative draft). Keys are stable across processes and
machines (never Python's salted ``hash``), so a router can compute the same keys as the servers.
A key alone never decides a hit: matching also compares the tokens, so a collision cannot serve
wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

KEY_BYTES = 16


def namespace_key(cache_salt: str | None = None, adapter: str | None = None, model: str | None = None,
                  draft: str | None = None) -> bytes:
    """Key of the cache namespace; requests in different namespaces never share a block.

    ``draft``: digest of the speculative draft whose K/V and features the blocks also hold (an engine
    with another draft, or none, must not read them). Left out of the key when None, so engines without
    speculation keep the keys they always had.
    """
    fields: dict[str, str | None] = {"cache_salt": cache_salt, "adapter": adapter, "model": model}
    if draft is not None:
        fields["draft"] = draft
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES).digest()


def block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """Key of one full block given its parent's key (little-endian uint32 token encoding)."""
    payload = struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.blake2b(parent_key + payload, digest_size=KEY_BYTES).digest()


BLEND_TAG = b"kvreuse-blend"  # salts the keys of blended blocks (issue 39), so no exact chain ever leads to one


def blend_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a blended block under ``parent_key`` (a namespace, an exact block's key or a blended one's)."""
    return block_key(parent_key + BLEND_TAG, tokens)


def extend_block_keys(keys: list[bytes], root_key: bytes, token_ids: Sequence[int], block_size: int) -> None:
    """Append the keys of every full block of ``token_ids`` not yet in ``keys`` (incremental)."""
    num_full = len(token_ids) // block_size
    parent = keys[-1] if keys else root_key
    for i in range(len(keys), num_full):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)


STATE_TAG = b"kvreuse-state"  # salts a recurrent state's key (issue 66): never equal to a block's


def state_keys(anchor_key: bytes, tokens: Sequence[int]) -> list[bytes]:
    """The keys of a hybrid's recurrent state after ``anchor_key``'s chain and each prefix of ``tokens``: element t is
    the state after the anchor's tokens and ``tokens[:t]`` (its tail), for t = 0 .. len(tokens). The anchor is a full
    block's chained key (a namespace's for a state within the first block), so the key holds the namespace and every
    token before the state, as a block's does. Incremental: one hash update a token."""
    digest = hashlib.blake2b(anchor_key + STATE_TAG, digest_size=KEY_BYTES)
    keys = [digest.copy().digest()]
    for token in tokens:
        digest.update(struct.pack("<I", token))
        keys.append(digest.copy().digest())
    return keys


def state_key(anchor_key: bytes, tail: Sequence[int]) -> bytes:
    """The key of the state after ``anchor_key``'s chain and ``tail`` (``state_keys``' last)."""
    return state_keys(anchor_key, tail)[-1]

"""The stored form of one KV block outside the device pool, and the checks every read makes.

A record is ``MAGIC | header length (u32 LE) | header (JSON) | payload``. The header names what the
payload is: the block's full chained key, its namespace key, its token ids, the model fingerprint
(a digest of everything that decides the KV bytes: config, weights, tokenizer, dtypes, block size,
layer layout, draft; see ``kvreuse.cache.tiers.fingerprint``), the payload's shape and dtype, and a
BLAKE2b checksum of the payload. ``decode`` returns the payload only when every one of those equals
what the reader expects; anything else (another model, another key, other tokens, a flipped byte,
a truncated file, a record copied under another name) raises ``RecordMismatch`` with the reason
(format, truncated, fingerprint, key, tokens, layout, checksum), and the caller counts it as a miss
and drops the entry. Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"KVRB"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<I")


class RecordMismatch(ValueError):
    """A stored block that must not be served; ``reason`` is one word for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """What a payload must look like for this engine: shape and dtype of one block's bytes."""

    shape: tuple[int, ...]
    dtype: str
    num_bytes: int


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode(fingerprint: str, key: bytes, namespace: bytes, tokens: Sequence[int], layout: BlockLayout,
           payload: bytes) -> bytes:
    if len(payload) != layout.num_bytes:
        raise ValueError(f"payload has {len(payload)} bytes, the layout {layout.num_bytes}")
    header = json.dumps({
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "key": key.hex(), "namespace": namespace.hex(),
        "tokens": list(tokens), "shape": list(layout.shape), "dtype": layout.dtype, "checksum": checksum(payload),
    }, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def decode(data: bytes, fingerprint: str, key: bytes, tokens: Sequence[int], layout: BlockLayout) -> memoryview:
    """The payload of ``data`` if it is the block (fingerprint, key, tokens, layout) with an intact
    payload; else RecordMismatch."""
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start and MAGIC.startswith(bytes(data[: len(MAGIC)])):
        raise RecordMismatch("truncated", f"{len(data)} bytes, cut before the header's length")
    if data[: len(MAGIC)] != MAGIC:
        raise RecordMismatch("format", "not a kvreuse block record")
    (header_length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if len(data) < start + header_length:
        raise RecordMismatch("truncated", f"{len(data)} bytes, cut inside the {header_length}-byte header")
    try:
        header = json.loads(data[start: start + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordMismatch("format", f"unreadable header ({error})") from None
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        raise RecordMismatch("format", f"format version {header.get('version') if isinstance(header, dict) else '?'}")
    if header.get("fingerprint") != fingerprint:
        raise RecordMismatch("fingerprint", "stored by another model, dtype, block size or layout")
    if header.get("key") != key.hex():
        raise RecordMismatch("key", "the record belongs to another block")
    if header.get("tokens") != list(tokens):
        raise RecordMismatch("tokens", "the record's tokens differ from the block's")
    if header.get("shape") != list(layout.shape) or header.get("dtype") != layout.dtype:
        raise RecordMismatch("layout", f"shape {header.get('shape')} {header.get('dtype')}")
    payload = memoryview(data)[start + header_length:]
    if len(payload) < layout.num_bytes:
        raise RecordMismatch("truncated", f"payload of {len(payload)} bytes, expected {layout.num_bytes}")
    if len(payload) > layout.num_bytes:
        raise RecordMismatch("format", f"payload of {len(payload)} bytes, expected {layout.num_bytes}")
    if checksum(payload) != header.get("checksum"):
        raise RecordMismatch("checksum", "the payload's checksum does not match")
    return payload

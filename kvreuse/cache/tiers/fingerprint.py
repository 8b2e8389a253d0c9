"""The model fingerprint: one digest of everything that decides a KV block's bytes.

Two engines may exchange a block (through disk or Redis) only when their fingerprints are equal:
the same config, weights, tokenizer, model dtype, KV dtype, block size and layer layout (KV layers,
heads, head size, the speculative draft's feature store) and record format. Adapter, draft and
tenant live in the block key's namespace as well, so a stored block also carries them. Weights are
digested by content (BLAKE2b over every file); since a big checkpoint takes seconds to read, the
digest is remembered per (path, size, mtime) in a small JSON file when the engine gives one.
Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FINGERPRINT_VERSION = 1
_CHUNK = 1 << 20


def files_digest(paths: Sequence[Path], memo: Path | None = None) -> str:
    """BLAKE2b over each file's name and bytes, in the given order; memoised by (path, size, mtime)."""
    signature = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in paths]
    memo_key = hashlib.blake2b(json.dumps(signature).encode(), digest_size=16).hexdigest()
    known: dict[str, str] = {}
    if memo is not None and memo.is_file():
        try:
            known = json.loads(memo.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            known = {}
        if memo_key in known:
            return known[memo_key]
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        digest.update(f"\x00{path.name}\x00".encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    value = digest.hexdigest()
    if memo is not None:
        known[memo_key] = value
        memo.parent.mkdir(parents=True, exist_ok=True)
        temporary = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(known), encoding="utf-8")
        os.replace(temporary, memo)
    return value


def model_fingerprint(fields: dict[str, Any]) -> str:
    """Hex digest of the canonical JSON of ``fields`` (plus the fingerprint version)."""
    canonical = json.dumps({"fingerprint_version": FINGERPRINT_VERSION, **fields}, sort_keys=True,
                           separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

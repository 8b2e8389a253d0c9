"""The cache identity of a set of weights: one digest over their names, dtypes, shapes and bytes.

A leaf: LoRA adapters (``kvreuse.lora.adapter``) and EAGLE drafts (``kvreuse.spec.eagle``) are keyed by it,
and neither should need the model loader to compute it.
"""

from __future__ import annotations

import hashlib
import json

import torch


def tensors_digest(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """Hex BLAKE2b over ``meta`` (JSON) and every tensor's name, dtype, shape and bytes, in name order:
    the cache identity of a set of weights (a LoRA adapter, an EAGLE draft). Same bytes, same digest,
    in any process; one changed element, another digest."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"\x00{name}\x00{tensor.dtype}\x00{tuple(tensor.shape)}\x00".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()

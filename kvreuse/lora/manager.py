"""Which adapters exist (by name) and which are resident (at most ``max_loras``, LRU).

``resolve`` runs when a request is added: it loads the adapter the first time, and again whenever its
files changed (a cheap stat check), so a name always maps to the digest of the weights on disk now.
``activate`` runs when the scheduler admits a request: it makes the adapter resident, unloading the
least recently used adapter that no running request needs. Unloading never touches the KV cache:
cached blocks are keyed by the digest and stay valid for the next time the adapter is loaded.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection

import torch

from kvreuse.errors import InvalidRequestError
from kvreuse.lora.adapter import LoRAAdapter, load_adapter, source_signature
from kvreuse.lora.request import LoRARequest
from kvreuse.models.config import ModelConfig

logger = logging.getLogger("kvreuse.lora")


class LoRAManager:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_loras: int,
                 max_lora_rank: int) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, LoRARequest] = {}
        self._digest_of: dict[str, str] = {}  # name -> digest of its current weights
        self._resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # digest -> adapter, LRU first
        self._paths: dict[str, LoRARequest] = {}  # digest -> where to reload it from
        self._signatures: dict[str, tuple] = {}  # digest -> its files' (size, mtime, ctime, inode) when loaded
        self.num_loads = 0

    # --- names ------------------------------------------------------------------------------------
    def resolve(self, request: LoRARequest, *, reload: bool = False) -> str:
        """The digest of ``request``'s adapter as its files are now (loading it if new, changed on disk,
        or ``reload``)."""
        digest = self._digest_of.get(request.lora_name)
        known = self._by_name.get(request.lora_name)
        if not reload and digest is not None and known is not None and known.lora_path == request.lora_path:
            try:
                unchanged = source_signature(request.lora_path) == self._signatures.get(digest)
            except (OSError, InvalidRequestError):
                unchanged = False
            if unchanged:
                return digest
        adapter = self._load(request)
        if digest is not None and digest != adapter.digest:
            logger.info("adapter %r changed: digest %s -> %s (KV computed with the old weights can no longer "
                        "be hit)", request.lora_name, digest[:12], adapter.digest[:12])
        self._by_name[request.lora_name] = request
        self._digest_of[request.lora_name] = adapter.digest
        return adapter.digest

    def names(self) -> dict[str, str]:
        """Registered adapter names -> digest of their current weights."""
        return dict(self._digest_of)

    def remove(self, name: str) -> None:
        """Forget a name (its KV stays cached under the digest until evicted)."""
        if name not in self._by_name:
            raise InvalidRequestError(f"no adapter named {name!r} is loaded", "lora_name")
        del self._by_name[name]
        digest = self._digest_of.pop(name)
        if digest not in self._digest_of.values():
            self._resident.pop(digest, None)

    # --- residency --------------------------------------------------------------------------------
    def activate(self, digest: str, in_use: Collection[str]) -> LoRAAdapter:
        """The resident adapter with this digest, loaded if it was unloaded; evicts the least recently
        used adapter outside ``in_use`` when more than ``max_loras`` would be resident."""
        adapter = self._resident.get(digest)
        if adapter is None:
            request = self._paths[digest]
            adapter = self._load(request)
            if adapter.digest != digest:
                raise InvalidRequestError(
                    f"adapter {request.lora_name!r} changed on disk while a request for its earlier weights "
                    "waited; send the request again", "lora_name")
        self._resident.move_to_end(digest)
        while len(self._resident) > self.max_loras:
            victim = next((d for d in self._resident if d != digest and d not in in_use), None)
            if victim is None:
                break  # every resident adapter is running; the scheduler keeps this within max_loras
            logger.debug("unloading adapter %s (least recently used)", victim[:12])
            del self._resident[victim]
        return adapter

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(request.lora_name, request.lora_path, self.config, self.max_lora_rank)
        adapter = adapter.to(self.dtype, self.device)
        self.num_loads += 1
        self._resident[adapter.digest] = adapter
        self._resident.move_to_end(adapter.digest)
        self._paths[adapter.digest] = request
        self._signatures[adapter.digest] = adapter.source_signature
        logger.info("loaded adapter %r from %s: rank %d, scaling %g, %d modules, digest %s", request.lora_name,
                    request.lora_path, adapter.rank, adapter.scaling, len(adapter.weights), adapter.digest[:12])
        return adapter

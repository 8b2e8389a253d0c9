"""PinRegistry: cached prefixes kept on purpose, with TTLs and a budget.

Automatic prefix caching forgets by LRU; a pin says "keep this". A pin holds a chain of prefix-index
nodes (pinned nodes are never evicted). Pins expire after their TTL without use (a use refreshes it),
and the blocks held by all pins together are capped at a fraction of the pool: going over demotes
the least recently used pin to ordinary cache (it stays cached until LRU evicts it) and logs it.
Plain Python: time is passed in, so tests control it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvreuse.cache.hashing import state_key
from kvreuse.cache.prefix import CacheNode, PrefixIndex

logger = logging.getLogger("kvreuse")


@dataclass
class Pin:
    pin_id: str
    key: str  # what identifies the pinned content (e.g. formatted system prompt + adapter)
    kind: str  # "system_prompt" | "breakpoint" | "api" | "warm"
    nodes: list[CacheNode]
    num_tokens: int  # tokens covered (full blocks only)
    adapter: str | None
    created: float
    last_used: float
    ttl: float | None  # seconds without use before it expires; None: until removed or demoted
    hits: int = 0
    owner: str | None = None  # the tenant that made it, when tenants are isolated

    @property
    def expires(self) -> float | None:
        return None if self.ttl is None else self.last_used + self.ttl

    def as_dict(self) -> dict:
        return {
            "id": self.pin_id, "kind": self.kind, "tokens": self.num_tokens, "blocks": len(self.nodes),
            "adapter": self.adapter, "created": self.created, "last_used": self.last_used, "hits": self.hits,
            "ttl": self.ttl, "expires": self.expires, "owner": self.owner,
        }


class PinBudgetError(ValueError):
    """A single pin is larger than the whole pinned budget."""


class PinListener(Protocol):
    """Told which block keys a pin holds and releases (the disk tier keeps pinned entries)."""

    def protect(self, keys: Iterable[bytes]) -> None: ...
    def unprotect(self, keys: Iterable[bytes]) -> None: ...


class PinRegistry:
    def __init__(self, index: PrefixIndex, max_pinned_blocks: int) -> None:
        self.index = index
        self.listener: PinListener | None = None
        self.max_pinned_blocks = max_pinned_blocks
        self.pins: dict[str, Pin] = {}
        self._pins_by_tail: dict[int, list[Pin]] = {}  # id(last node) -> pins ending there
        self.num_demoted = 0
        self.num_expired = 0

    # --- counts -----------------------------------------------------------------------------------
    def pinned_blocks(self) -> int:
        """Distinct blocks held by pins (pins that share a prefix share its blocks)."""
        return len({id(node) for pin in self.pins.values() for node in pin.nodes})

    # --- create / remove --------------------------------------------------------------------------
    def pin(
        self,
        key: str,
        nodes: Sequence[CacheNode],
        *,
        kind: str,
        now: float,
        ttl: float | None = None,
        adapter: str | None = None,
        owner: str | None = None,
    ) -> Pin:
        """Pin a chain (a refresh if the same key is already pinned over the same chain)."""
        nodes = list(nodes)
        if not nodes:
            raise ValueError(
                f"nothing to pin: the prefix is shorter than one KV block ({self.index.block_size} tokens)"
            )
        if len(nodes) > self.max_pinned_blocks:
            raise PinBudgetError(
                f"the prefix needs {len(nodes)} blocks but the pinned budget is {self.max_pinned_blocks} blocks; "
                f"raise max_pinned_fraction or kv_cache_memory"
            )
        pin_id = _pin_id(key, nodes[-1].key)
        existing = self.pins.get(pin_id)
        if existing is not None:
            existing.last_used = now
            existing.ttl = ttl if ttl is None or existing.ttl is None else max(ttl, existing.ttl)
            return existing
        self.index.pin(nodes)
        if self.listener is not None:
            self.listener.protect(_protected_keys(nodes))
        pin = Pin(pin_id, key, kind, nodes, len(nodes) * self.index.block_size, adapter, now, now, ttl,
                  owner=owner)
        self.pins[pin_id] = pin
        self._pins_by_tail.setdefault(id(nodes[-1]), []).append(pin)
        self._enforce_budget(keep=pin)
        return pin

    def unpin(self, pin_id: str) -> Pin:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            raise KeyError(pin_id)
        tail_pins = self._pins_by_tail[id(pin.nodes[-1])]
        tail_pins.remove(pin)
        if not tail_pins:
            del self._pins_by_tail[id(pin.nodes[-1])]
        self.index.unpin(pin.nodes)
        if self.listener is not None:
            self.listener.unprotect(_protected_keys(pin.nodes))
        return pin

    def _enforce_budget(self, keep: Pin) -> None:
        while self.pinned_blocks() > self.max_pinned_blocks:
            victims = [pin for pin in self.pins.values() if pin is not keep]
            if not victims:
                return
            victim = min(victims, key=lambda pin: pin.last_used)
            self.unpin(victim.pin_id)
            self.num_demoted += 1
            logger.info(
                "pinned budget of %d blocks exceeded: pin %s (%d tokens, %s) demoted to ordinary cache",
                self.max_pinned_blocks, victim.pin_id, victim.num_tokens, victim.kind,
            )

    # --- time -------------------------------------------------------------------------------------
    def expire(self, now: float) -> list[Pin]:
        expired = [pin for pin in self.pins.values() if pin.expires is not None and pin.expires <= now]
        for pin in expired:
            self.unpin(pin.pin_id)
            self.num_expired += 1
            logger.debug("pin %s (%s, %d tokens) expired after %.0f s unused", pin.pin_id, pin.kind,
                         pin.num_tokens, pin.ttl)
        return expired

    def record_use(self, matched: Sequence[CacheNode], now: float) -> list[Pin]:
        """A request reused ``matched``: every pin whose whole chain it covered is refreshed."""
        used: list[Pin] = []
        if not self._pins_by_tail:
            return used
        for node in matched:
            for pin in self._pins_by_tail.get(id(node), ()):
                pin.hits += 1
                pin.last_used = now
                used.append(pin)
        return used


def _pin_id(key: str, tail_key: bytes) -> str:
    return "pin-" + hashlib.blake2b(key.encode() + tail_key, digest_size=6).hexdigest()


@dataclass(frozen=True)
class PinSpec:
    """Ask the engine to pin the first ``num_tokens`` of a request's tokens once they are computed."""

    num_tokens: int
    key: str
    kind: str = "api"
    ttl: float | None = None
    adapter: str | None = None
    owner: str | None = None  # tenant id when tenants are isolated (pins are listed per tenant)

    def check(self, num_prompt_tokens: int, block_size: int, enable_prefix_caching: bool) -> None:
        """Refuse, naming the limit, a pin that could never be made for a prompt of ``num_prompt_tokens``
        (checked before the request changes any state)."""
        if not enable_prefix_caching:
            raise ValueError("pinning a prefix needs prefix caching; it is disabled (enable_prefix_caching=False)")
        if not 0 < self.num_tokens <= num_prompt_tokens:
            raise ValueError(f"a pinned prefix must cover 1..{num_prompt_tokens} prompt tokens, got {self.num_tokens}")
        if self.num_tokens < block_size:
            raise ValueError(
                f"the prefix to pin has {self.num_tokens} tokens, shorter than one KV block "
                f"({block_size} tokens): too short to be worth caching"
            )
        if self.ttl is not None and self.ttl <= 0:
            raise ValueError(f"a pin's ttl must be positive seconds, got {self.ttl}")


def _protected_keys(nodes: Sequence[CacheNode]) -> list[bytes]:
    """What a pin keeps on disk: its blocks, and a hybrid's state at its end (issue 66: the pin snapshot, anchored at
    its last block with no tail; a model without states never stores that key)."""
    return [node.key for node in nodes] + [state_key(nodes[-1].key, ())]

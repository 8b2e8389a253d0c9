"""Who may see which cache entries: the rule every observatory view (drift report, cache tree, hit
counters) applies before any prompt text leaves the engine.

A cache entry lives in a namespace (cache salt, adapter, model). The engine remembers every owner
(tenant id, or None for a request without one) that ever sent a request in each namespace. A caller
that sees all (an admin key, or a server without keys) sees every entry; a tenant T sees an entry
only when T is the namespace's only owner ever. With ``--isolate-tenants`` each tenant has its own
namespaces, so it sees its whole tree; without isolation a namespace two tenants used is hidden from
both, because its text may be either tenant's prompt: no prompt text of one tenant reaches another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

Owner = str | None  # a tenant id, or None for a request that came without one


@dataclass(frozen=True)
class Scope:
    """What one caller may see: everything (``sees_all``) or the entries of ``tenant_id`` alone."""

    tenant_id: str | None
    sees_all: bool

    def may_see(self, owners: frozenset[Owner]) -> bool:
        """May this caller see an entry whose namespace was used by exactly ``owners``?"""
        if self.sees_all:
            return True
        return self.tenant_id is not None and owners == frozenset((self.tenant_id,))

    def may_see_owner(self, owner: Owner) -> bool:
        """May this caller see the counters of one owner (a tenant: only its own)?"""
        return self.sees_all or (self.tenant_id is not None and owner == self.tenant_id)


ALL = Scope(None, True)


class NamespaceOwners:
    """Namespace -> every owner that ever sent a request in it. Only grows per namespace, so the rule
    "every request was T's" holds over the namespace's whole life; `prune` forgets namespaces the
    caller no longer holds anything of (their text is gone, so forgetting cannot reveal it)."""

    def __init__(self) -> None:
        self._owners: dict[bytes, frozenset[Owner]] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def add(self, namespace: bytes, owner: Owner) -> None:
        current = self._owners.get(namespace)
        if current is None or owner not in current:  # frozensets are rebuilt only when the set changes
            self._owners[namespace] = (current or frozenset()) | {owner}

    def of(self, namespace: bytes) -> frozenset[Owner]:
        """The owners of ``namespace``; empty for one never seen (which only an all-seeing scope sees)."""
        return self._owners.get(namespace, frozenset())

    def single_owner(self, namespace: bytes) -> Owner:
        """The namespace's owner when there is exactly one (a tenant id or None), else None."""
        owners = self.of(namespace)
        return next(iter(owners)) if len(owners) == 1 else None

    def prune(self, keep: Callable[[bytes], bool]) -> int:
        """Forget every namespace ``keep`` rejects; returns how many went."""
        gone = [namespace for namespace in self._owners if not keep(namespace)]
        for namespace in gone:
            del self._owners[namespace]
        return len(gone)

    def namespaces(self) -> Iterable[bytes]:
        return self._owners.keys()

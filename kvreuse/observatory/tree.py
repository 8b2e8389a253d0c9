"""What the prefix cache holds: its largest cached subtrees, with their text and how often each was reused.

The prefix index is a radix tree of full blocks per namespace. An operator wants to see the prefixes
requests share (a system prompt with 40 questions cached below it, a chat's earlier turns), so the
view lists the tree's "segment ends": nodes where a chain of blocks branches (two or more cached
continuations) or ends. Each entry is the prefix from the namespace's start to that node, the blocks
that begin with it, whether it is pinned, and its hits: admissions that reused all of it.

Hits are counted cheaply at admission (`PrefixHits.record`: one dict update at the deepest block a
request reused); a prefix's hits are the sum over its subtree, computed when the view is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvreuse.cache.prefix import CacheNode, PrefixIndex, PrefixMatch
from kvreuse.observatory.drift import namespace_label
from kvreuse.observatory.scope import NamespaceOwners, Scope

PREVIEW_CHARS = 200
PREVIEW_TOKENS = 48  # decoded at each end of a long prefix (the preview shows its start and its end)


class PrefixHits:
    """Admissions that reused a cached prefix, counted at the deepest full block each one reused."""

    def __init__(self) -> None:
        self.ends: dict[bytes, int] = {}  # block key -> admissions whose reuse ended at that block

    def record(self, match: PrefixMatch) -> None:
        if match.nodes:
            key = match.nodes[-1].key
            self.ends[key] = self.ends.get(key, 0) + 1

    def prune(self, index: PrefixIndex) -> None:
        """Forget evicted blocks' counts once they outnumber the cached blocks (amortised O(1))."""
        if len(self.ends) > 2 * index.num_cached_blocks + 1024:
            live = {node.key for node in index.iter_nodes()}
            self.ends = {key: count for key, count in self.ends.items() if key in live}


def _prefix_tokens(node: CacheNode) -> list[int]:
    blocks: list[list[int]] = []
    while node.parent is not None:
        blocks.append(node.tokens)
        node = node.parent
    return [token for block in reversed(blocks) for token in block]


def preview(tokens: Sequence[int], decode: Callable[[Sequence[int]], str], limit: int = PREVIEW_CHARS) -> str:
    """The prefix's text in at most ``limit`` characters: all of it, or its start and its end."""
    if len(tokens) <= 2 * PREVIEW_TOKENS:
        text = decode(tokens)
        if len(text) <= limit:
            return text
        head, tail = text, text
    else:
        head, tail = decode(tokens[:PREVIEW_TOKENS]), decode(tokens[-PREVIEW_TOKENS:])
    keep_head = (limit - 3) * 3 // 5
    return head[:keep_head] + " … " + tail[-(limit - 3 - keep_head):]


def largest_subtrees(index: PrefixIndex, scope: Scope, owners: NamespaceOwners, hits: PrefixHits,
                     decode: Callable[[Sequence[int]], str], top: int) -> list[dict[str, Any]]:
    """The ``top`` largest cached prefixes ``scope`` may see (most blocks beginning with them first)."""
    candidates: list[tuple[int, int, CacheNode, bytes]] = []  # (blocks, hits, node, namespace)
    for namespace, root in index.roots.items():
        if not scope.may_see(owners.of(namespace)):
            continue
        order: list[CacheNode] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        below: dict[int, tuple[int, int]] = {}  # id(node) -> (blocks in its subtree, hits in it)
        for node in reversed(order):  # children before parents
            blocks, node_hits = 1, hits.ends.get(node.key, 0)
            for child in node.children.values():
                child_blocks, child_hits = below[id(child)]
                blocks += child_blocks
                node_hits += child_hits
            below[id(node)] = (blocks, node_hits)
            if len(node.children) != 1:  # a branch point or the end of a chain
                # Blocks that begin with this prefix: its own chain and everything cached under it.
                candidates.append((node.depth + blocks - 1, node_hits, node, namespace))
    candidates.sort(key=lambda item: (-item[0], -item[1], -item[2].depth))
    entries = []
    for blocks, node_hits, node, namespace in candidates[:max(top, 0)]:
        tokens = _prefix_tokens(node)
        entries.append({
            "text": preview(tokens, decode),
            "tokens": len(tokens),
            "blocks": blocks,
            "branches": len(node.children),
            "pinned": node.pin_count > 0,
            "hits": node_hits,
            "namespace": namespace_label(namespace),
            "namespace_owner": owners.single_owner(namespace),
        })
    return entries

"""AdmissionRecorder: what the observatory records when the engine admits a request, and the reports
it gives from that record.

At a request's first admission it counts the prompt tokens looked up and hit per owner (the tenant
that sent it), the reuse of the deepest block it matched (``PrefixHits``), and on a partial miss the
position where the prompt left the cache with the text the cache holds there (``DriftLog``: token ids
only; decoding and analysis wait for a report). It remembers who used each namespace (the tenant rule
of ``scope.py``), forgetting namespaces nothing is held of any more. Cheap at admission: dict updates
and one divergence lookup per partial miss.

With ``--debug`` (the ``kvreuse`` logger at DEBUG) it also explains every admission in the log: the
tokens reused and computed and, on a miss, the position and the text where the prompt left the cache.

The engine owns one and calls ``note_owner`` / ``admitted`` from its step; readers call the reports on
the engine thread. Torch-free: it reads the cache core, never changes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvreuse.cache.chunks import CHUNK_MISS_REASONS, MovedSpan
from kvreuse.cache.manager import CacheSequence, KVCacheManager
from kvreuse.cache.prefix import Divergence, PrefixMatch
from kvreuse.observatory.drift import DriftLog, cached_continuation
from kvreuse.observatory.scope import ALL, NamespaceOwners, Owner, Scope
from kvreuse.observatory.tree import PrefixHits, largest_subtrees

logger = logging.getLogger("kvreuse")

SHARED_OWNER = "shared"  # hit_counters' name for requests without an owner
MAX_TRACKED_NAMESPACES = 65536  # namespace owners kept before those nothing is held of are forgotten

Decode = Callable[[Sequence[int]], str]


class AdmittedSequence(CacheSequence, Protocol):
    """A sequence as the observatory sees it at admission (``kvreuse.request.Request``)."""

    prompt_token_ids: list[int]
    moved_spans: list[MovedSpan]  # spans its next step reads from elsewhere in the pool (issue 39)
    index: int  # which of the request's n samples (the drift log records sample 0 only)
    num_preemptions: int

    @property
    def num_prompt_tokens(self) -> int: ...


class AdmissionRecorder:
    def __init__(self, kv: KVCacheManager, decode: Decode) -> None:
        self.kv = kv
        self.decode = decode  # the engine thread's tokenizer: reports and debug lines run on that thread
        self.namespace_owners = NamespaceOwners()
        self.drift = DriftLog()
        self.prefix_hits = PrefixHits()
        self._hits_by_owner: dict[Owner, list[int]] = {}  # owner -> [prompt tokens looked up, tokens hit]
        # Reuse beyond the prefix (issue 39), by kind ("chunk", "turn"): [spans, tokens] moved in at admission.
        self.moved: dict[str, list[int]] = {"chunk": [0, 0], "turn": [0, 0]}
        # Marked chunks computed rather than moved (issue 64), by reason (CHUNK_MISS_REASONS): [spans, tokens].
        self.chunk_misses: dict[str, list[int]] = {reason: [0, 0] for reason in CHUNK_MISS_REASONS}
        # A hybrid with per-sequence state (issue 66): admissions whose blocks matched past the deepest state snapshot,
        # and the matched tokens they recomputed for it ([requests, tokens]).
        self.state_misses = [0, 0]
        self._prune_owners_at = MAX_TRACKED_NAMESPACES

    def note_owner(self, namespace: bytes, owner: Owner, in_flight: Callable[[], set[bytes]]) -> None:
        """A request of ``owner`` entered ``namespace``. ``in_flight``: the namespaces of requests in flight
        (asked only when the owner table is pruned)."""
        self.namespace_owners.add(namespace, owner)
        if len(self.namespace_owners) > self._prune_owners_at:
            # Forget namespaces nothing is held of any more (no cached block, no recorded miss, no request
            # in flight): their text is gone, so forgetting their owners cannot show it to anyone.
            held = set(self.kv.index.roots) | self.drift.namespaces() | in_flight()
            held.add(namespace)
            self.namespace_owners.prune(held.__contains__)
            self._prune_owners_at = max(MAX_TRACKED_NAMESPACES, 2 * len(self.namespace_owners))  # amortised

    def admitted(self, request: AdmittedSequence, match: PrefixMatch, owner: Owner, now: float) -> None:
        """An admission of ``request`` that reused ``match``: recorded at its first admission, explained in
        the debug log at every one (a preempted request is admitted again)."""
        if request.num_preemptions:
            if logger.isEnabledFor(logging.DEBUG):
                self.log_admission(request, match)
            return
        counters = self._hits_by_owner.setdefault(owner, [0, 0, 0])
        counters[0] += request.num_prompt_tokens
        counters[1] += match.num_tokens
        for span in request.moved_spans:
            counters[2] += span.num_tokens
            self.moved[span.kind][0] += 1
            self.moved[span.kind][1] += span.num_tokens
        for start, end, reason in request.chunk_misses:
            self.chunk_misses[reason][0] += 1
            self.chunk_misses[reason][1] += end - start
        hit = request.state_hit
        if hit is not None and hit.matched > hit.resume:
            self.state_misses[0] += 1
            self.state_misses[1] += hit.matched - hit.resume
        divergence = None
        if self.kv.enable_prefix_caching:
            self.prefix_hits.record(match)
            self.prefix_hits.prune(self.kv.index)
        if self.kv.enable_prefix_caching and request.index == 0 and match.num_tokens < request.num_tokens - 1:
            divergence = self.kv.divergence(request, match)  # the partial miss log_admission explains
            continuation = cached_continuation(self.kv.index, request.namespace, match, divergence)
            self.drift.record(request.namespace, request.prompt_token_ids, divergence.position, continuation,
                              owner, now)
        if logger.isEnabledFor(logging.DEBUG):
            self.log_admission(request, match, divergence)

    # --- reports (kvreuse.observatory.drift / tree; the server's /v1/cache/* routes and the dashboard) ----
    def drift_report(self, scope: Scope = ALL, top: int = 10) -> dict[str, Any]:
        report = self.drift.report(scope, top, self.decode, self.namespace_owners)
        # Moved spans are hits beyond the prefix: each miss above may have been partly served by one.
        report["moved"] = {kind: {"spans": spans, "tokens": tokens} for kind, (spans, tokens) in self.moved.items()}
        # Marked chunks computed though chunk reuse is on, and why: a document recomputed shows up here.
        report["chunk_misses"] = {reason: {"spans": spans, "tokens": tokens}
                                  for reason, (spans, tokens) in self.chunk_misses.items()}
        # Matched blocks recomputed because no state was kept where they end (a hybrid's Gated DeltaNet layers).
        report["state_misses"] = {"requests": self.state_misses[0], "tokens": self.state_misses[1]}
        return report

    def cache_tree(self, scope: Scope = ALL, top: int = 8) -> list[dict[str, Any]]:
        return largest_subtrees(self.kv.index, scope, self.namespace_owners, self.prefix_hits, self.decode, top)

    def hit_counters(self, scope: Scope = ALL) -> dict[str, dict[str, int]]:
        return {SHARED_OWNER if owner is None else owner: {"query_tokens": query, "hit_tokens": hit, "moved_tokens": moved}
                for owner, (query, hit, moved) in self._hits_by_owner.items() if scope.may_see_owner(owner)}

    # --- the --debug explanation ------------------------------------------------------------------------
    def log_admission(self, request: AdmittedSequence, match: PrefixMatch, divergence: Divergence | None = None) -> None:
        total = request.num_tokens
        reused = match.num_tokens
        logger.debug(
            "request %s: %d prompt tokens, reused %d from the prefix cache, computing %d%s",
            request.request_id, total, reused, total - reused,
            f" (after {request.num_preemptions} preemption(s))" if request.num_preemptions else "",
        )
        for span in request.moved_spans:
            logger.debug("request %s: %s hit: tokens [%d, %d) %r... moved in from position %d (delta %+d), blended",
                         request.request_id, "chunk" if span.kind == "chunk" else "earlier turn's tokens",
                         span.start, span.end, self.decode(request.all_token_ids[span.start:span.start + 8]),
                         span.source_start, span.delta)
        for start, end, reason in request.chunk_misses:
            logger.debug("request %s: chunk tokens [%d, %d) %r... computed: %s", request.request_id, start, end,
                         self.decode(request.all_token_ids[start:start + 8]), CHUNK_MISS_REASONS[reason])
        hit = request.state_hit
        if hit is not None and hit.explanation is not None:
            logger.debug("request %s: %s", request.request_id, hit.explanation)
        if not self.kv.enable_prefix_caching or reused >= total - 1:
            return
        if divergence is None:
            divergence = self.kv.divergence(request, match)
        tokens = request.all_token_ids
        position = divergence.position
        before = self.decode(tokens[max(0, position - 12) : position])
        after = self.decode(tokens[position : position + 12])
        if divergence.cached_token is None:
            reason = "nothing was cached beyond this point"
        else:
            cached_text = self.decode([divergence.cached_token])
            reason = f"the cache holds {cached_text!r} (token {divergence.cached_token}) there"
        logger.debug(
            "request %s: cache miss at token position %d: ...%r >>> %r...; prompt token %d, %s",
            request.request_id, position, before, after, tokens[position], reason,
        )

"""Prompt drift: why requests miss a prefix the cache holds, grouped into sentences an operator can act on.

Every admitted request that misses part of its prompt while the cache holds a different continuation
at that point (the divergence `PrefixIndex.divergence` finds, the one ``--debug`` logs) leaves a
`DriftRecord` in a bounded `DriftLog`: its namespace, where it diverged, a few tokens before that
and a window of its own and the cached tokens after it. Recording is cheap on purpose (it runs on
the engine thread at admission): token ids are copied into compact arrays, nothing is decoded or
compared then. `DriftLog.report` does the work when someone asks: it re-aligns each miss with the
cached text it left (to count the tokens a stable prompt would have reused), decodes the text
around the divergence, looks for volatile spans there (kvreuse.observatory.volatile) and groups the
misses by (namespace, template start, divergence position) into sentences such as

    412 requests of the prefix starting 'You are the billing assistant' diverge at token 16, where
    the text changes ('Monday' / 'Friday 2026-11-20'): 1,731 tokens per request recomputed

with the kinds of span found and advice. Where the divergence falls inside a tool list (agent prompts
resend their tools every turn), the tool that changed, came, went or moved is named too
(kvreuse.observatory.tools). The same log serves ``kvreuse diagnose`` offline.
"""

from __future__ import annotations

import hashlib
import re
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvreuse.cache.prefix import CacheNode, Divergence, PrefixIndex, PrefixMatch
from kvreuse.observatory.scope import NamespaceOwners, Owner, Scope
from kvreuse.observatory.tools import ToolDrift, tool_drift
from kvreuse.observatory.volatile import (
    REORDERED,
    TOOLS,
    WHITESPACE,
    VolatileSpan,
    advice_for,
    item_cuts,
    reordered_items,
    spans_near,
    whitespace_only,
)

DRIFT_LOG_CAPACITY = 1024  # misses kept (the most recent)
CONTEXT_TOKENS = 32  # tokens before the divergence shown (and compared when nearby groups merge)
# Tokens kept before the divergence: a tool definition that changed starts there, and its name and the path
# to what changed need it whole (a tool of the lists agents send is rarely longer).
LEAD_TOKENS = 1024
WINDOW_TOKENS = 2048  # tokens kept after it on each side: what re-alignment can see, so tokens lost cap here
TEMPLATE_START_TOKENS = 32  # leading prompt tokens that name the template a miss belongs to
TOKEN_BYTES = 4  # token ids are kept as uint32 arrays
REALIGN_MIN_RUN = 8  # tokens that must agree in a row for the two sides to count as re-aligned
REALIGN_PROBE = 4  # tokens searched for at once
REALIGN_STRIDE = REALIGN_MIN_RUN - REALIGN_PROBE + 1  # probe spacing that still meets every run of MIN_RUN
REALIGN_CANDIDATES = 16  # cached positions tried per request position
DIFF_TOKENS = 8  # tokens shown on each side when the two never re-align
REORDER_WINDOW_TOKENS = 512  # tokens decoded on each side to look for a reordered block
LOST_SAMPLE = 16  # records per group whose tokens lost are measured (the rest are estimated from them)
MERGE_TOKENS = 8  # divergence positions this close (of one namespace and template) are one group

Decode = Callable[[Sequence[int]], str]


def cached_continuation(index: PrefixIndex, namespace: bytes, match: PrefixMatch, divergence: Divergence,
                        limit: int = WINDOW_TOKENS) -> list[int]:
    """The tokens the cache holds from the divergence on (at most ``limit``): the block ``divergence``
    reported, then down the most recently used child: the cached prompt this request diverged from."""
    if divergence.cached_token is None or limit <= 0:
        return []
    node: CacheNode
    if match.partial is not None:
        node = match.partial.node
        tokens = list(node.tokens[match.partial.num_tokens:])
    else:
        parent = match.nodes[-1] if match.nodes else index.roots.get(namespace)
        siblings = parent.children_by_first_token.get(divergence.cached_token) if parent is not None else None
        if not siblings:
            return []
        # The same child PrefixIndex.divergence named (the most recent among all children starts with its
        # token), found among the few children that start with that token.
        node = max(siblings, key=lambda child: child.last_access)
        tokens = list(node.tokens)
    while len(tokens) < limit and node.children:
        children = node.children
        # Most chains do not branch: skip the max() there (this runs on the engine thread per miss).
        node = next(iter(children.values())) if len(children) == 1 else max(
            children.values(), key=lambda child: child.last_access)
        tokens += node.tokens
    return tokens[:limit]


@dataclass
class DriftRecord:
    """One miss: where a prompt left the cached text, and enough tokens around it to explain why."""

    namespace: bytes
    owner: Owner  # who sent it (the scope rule uses the namespace's owners, not this one)
    position: int  # first prompt token not served from the cache
    prompt_tokens: int
    template_start: tuple[int, ...]  # the prompt's first tokens (never past the divergence)
    before: array  # prompt tokens before the divergence (at most LEAD_TOKENS; the last CONTEXT_TOKENS are shown)
    request_after: array  # prompt tokens from the divergence on (at most WINDOW_TOKENS)
    cached_after: array  # cached tokens from the divergence on (at most WINDOW_TOKENS)
    time: float  # Unix seconds
    tokens_lost: int | None = None  # measured at report time, then kept
    tools: ToolDrift | None = field(default=None, repr=False)  # the tool list's changes, analysed at report time
    tools_analysed: bool = False  # (then kept: None is also an answer)

    @property
    def tokens_recomputed(self) -> int:
        return self.prompt_tokens - self.position


class Run(NamedTuple):
    """``request[i:i + length] == cached[j:j + length]``: the two sides agree again."""

    i: int
    j: int
    length: int


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return tokens.tobytes() if isinstance(tokens, array) else array("I", tokens).tobytes()


def _common_units(first: bytes, first_at: int, second: bytes, second_at: int) -> int:
    """How many 4-byte tokens agree from these byte offsets on (a binary search of C-speed compares)."""
    low, high = 0, min(len(first) - first_at, len(second) - second_at) // TOKEN_BYTES
    while low < high:
        middle = (low + high + 1) // 2
        if first[first_at:first_at + middle * TOKEN_BYTES] == second[second_at:second_at + middle * TOKEN_BYTES]:
            low = middle
        else:
            high = middle - 1
    return low


def realign(request: Sequence[int], cached: Sequence[int]) -> list[Run]:
    """Where a prompt, after its divergence, agrees again with the cached continuation it left:
    greedy, left to right, runs of at least REALIGN_MIN_RUN tokens, anywhere in the cached side (so a
    reordered block re-aligns too).

    It runs on the engine thread when a report is asked for, so it is cheap: the token ids are searched
    as bytes (``bytes.find``), and only every REALIGN_STRIDE-th position is probed with a
    REALIGN_PROBE-token needle (any run of REALIGN_MIN_RUN tokens contains one such probe), each hit
    then extended both ways."""
    ours, theirs = _token_bytes(request), _token_bytes(cached)
    width = REALIGN_PROBE * TOKEN_BYTES
    runs: list[Run] = []
    lower, i, n = 0, 0, len(ours) // TOKEN_BYTES  # lower: where the search may start a run (after the last one)
    while i + REALIGN_PROBE <= n:
        needle = ours[i * TOKEN_BYTES:i * TOKEN_BYTES + width]
        best: Run | None = None
        found, tried = theirs.find(needle), 0
        while found >= 0 and tried < REALIGN_CANDIDATES:
            if found % TOKEN_BYTES == 0:  # a match must start on a token, not inside one
                tried += 1
                j = found // TOKEN_BYTES
                back = 0
                while (back < i - lower and back < j
                       and request[i - back - 1] == cached[j - back - 1]):
                    back += 1
                length = back + REALIGN_PROBE + _common_units(ours, (i + REALIGN_PROBE) * TOKEN_BYTES,
                                                              theirs, found + width)
                if length >= REALIGN_MIN_RUN and (best is None or length > best.length):
                    best = Run(i - back, j - back, length)
            found = theirs.find(needle, found + 1)
        if best is not None:
            runs.append(best)
            lower = i = best.i + best.length
        else:
            i += REALIGN_STRIDE
    return runs


def tokens_lost(record: DriftRecord) -> int:
    """Prompt tokens this miss recomputed that a stable prompt would have reused: from the divergence to
    the end of the last stretch where the prompt agrees again with the cached text (0 when it never
    does: the prompts really differ from here). Measured once, then kept on the record."""
    if record.tokens_lost is None:
        runs = realign(record.request_after, record.cached_after)
        record.tokens_lost = runs[-1].i + runs[-1].length if runs else 0
    return record.tokens_lost


def tool_changes(record: DriftRecord, decode: Decode) -> ToolDrift | None:
    """How the tool list this miss diverged inside differs from the cached one (None: the divergence is in no
    tool list). Both sides are decoded with the tokens kept before the divergence, where the tool it falls
    in starts; analysed once, then kept on the record."""
    if not record.tools_analysed:
        lead = record.before.tolist()
        record.tools = tool_drift(decode(lead + record.request_after.tolist()),
                                  decode(lead + record.cached_after.tolist()))
        record.tools_analysed = True
    return record.tools


def namespace_label(namespace: bytes) -> str:
    """A short stable name for a namespace (its key is a digest already; this one is shorter)."""
    return hashlib.blake2b(namespace, digest_size=6).hexdigest()


class DriftLog:
    """The most recent misses (bounded) and a count of the cold ones (nothing cached to diverge from)."""

    def __init__(self, capacity: int = DRIFT_LOG_CAPACITY) -> None:
        self.records: deque[DriftRecord] = deque(maxlen=capacity)
        self.num_recorded = 0  # every miss with a cached continuation since start
        self.num_cold = 0  # misses where the cache held nothing beyond the matched prefix

    @property
    def capacity(self) -> int:
        return self.records.maxlen or 0

    def record(self, namespace: bytes, prompt_token_ids: Sequence[int], position: int,
               continuation: Sequence[int], owner: Owner = None, now: float | None = None) -> None:
        """Keep one miss. ``continuation``: the cached tokens from ``position`` on (empty: a cold miss,
        only counted)."""
        if not continuation:
            self.num_cold += 1
            return
        self.num_recorded += 1
        self.records.append(DriftRecord(
            namespace=namespace, owner=owner, position=position, prompt_tokens=len(prompt_token_ids),
            template_start=tuple(prompt_token_ids[:min(position, TEMPLATE_START_TOKENS)]),
            before=array("I", prompt_token_ids[max(0, position - LEAD_TOKENS):position]),
            request_after=array("I", prompt_token_ids[position:position + WINDOW_TOKENS]),
            cached_after=array("I", continuation[:WINDOW_TOKENS]),
            time=time.time() if now is None else now,
        ))

    def namespaces(self) -> set[bytes]:
        return {record.namespace for record in self.records}

    def report(self, scope: Scope, top: int, decode: Decode, owners: NamespaceOwners) -> dict[str, Any]:
        """The misses ``scope`` may see, grouped, worst first (most tokens lost), at most ``top`` groups."""
        groups: dict[tuple[bytes, tuple[int, ...], int], list[DriftRecord]] = {}
        for record in self.records:
            if scope.may_see(owners.of(record.namespace)):
                groups.setdefault((record.namespace, record.template_start, record.position), []).append(record)
        groups = _merge_nearby(groups)
        summaries = [_GroupFigures.of(records) for records in groups.values()]
        summaries.sort(key=lambda figures: (-figures.total_lost, -len(figures.records), -figures.records[-1].time))
        visible = sum(len(records) for records in groups.values())
        return {
            "object": "cache.drift",
            "capacity": self.capacity,
            "recorded_misses": visible,  # misses in the window this caller may see
            "num_groups": len(groups),
            "tokens_lost": sum(figures.total_lost for figures in summaries),
            # Totals since start, every namespace: counts only, no text.
            "total_misses": self.num_recorded if scope.sees_all else None,
            "cold_misses": self.num_cold if scope.sees_all else None,
            "groups": [_describe(figures, decode, owners) for figures in summaries[:max(top, 0)]],
        }


def _context(record: DriftRecord) -> array:
    """The prompt tokens shown before the divergence (and compared when nearby groups merge)."""
    return record.before[-CONTEXT_TOKENS:]


def _agree_before(first: DriftRecord, second: DriftRecord) -> bool:
    """Do two misses' prompts agree on the CONTEXT_TOKENS before the earlier divergence (those both keep)?"""
    early, late = sorted((first, second), key=lambda record: record.position)
    early_before, late_before = _context(early), _context(late)
    start = max(early.position - len(early_before), late.position - len(late_before))
    ours = early_before[start - (early.position - len(early_before)):]
    theirs = late_before[start - (late.position - len(late_before)):][:len(ours)]
    return ours == theirs


def _merge_nearby(groups: dict[tuple[bytes, tuple[int, ...], int], list[DriftRecord]]
                  ) -> dict[tuple[bytes, tuple[int, ...], int], list[DriftRecord]]:
    """One volatile field makes misses diverge at a few nearby positions (a clock's seconds, then its
    minutes): groups of one namespace and template whose positions lie within MERGE_TOKENS and whose
    prompts agree before them become one group, keyed by its earliest position."""
    merged: dict[tuple[bytes, tuple[int, ...], int], list[DriftRecord]] = {}
    previous: tuple[bytes, tuple[int, ...], int] | None = None
    for key in sorted(groups, key=lambda key: (key[0], key[1], key[2])):
        records = groups[key]
        if (previous is not None and previous[:2] == key[:2] and key[2] - previous[2] <= MERGE_TOKENS
                and _agree_before(merged[previous][-1], records[-1])):
            merged[previous] = sorted(merged[previous] + records, key=lambda record: record.time)
            continue
        merged[key] = list(records)
        previous = key
    return merged


@dataclass
class _GroupFigures:
    records: list[DriftRecord]  # oldest first
    lost_per_request: int = 0
    total_lost: int = 0

    @classmethod
    def of(cls, records: list[DriftRecord]) -> _GroupFigures:
        measured = [tokens_lost(record) for record in records[-LOST_SAMPLE:]]
        per_request = round(sum(measured) / len(measured))
        return cls(records, per_request, per_request * len(records))


@dataclass
class _Side:
    """One side of a divergence as text: ``context`` is the text before it, then this side's text from
    the divergence on; ``context[start:end]`` is what differs (up to where the sides agree again)."""

    name: str  # "request" or "cached"
    context: str
    start: int
    end: int
    spans: list[VolatileSpan] = field(default_factory=list)  # volatile spans the difference runs into
    realigned: bool = True  # False: the sides never agree again, so the difference is cut off by its window
    whitespace: bool = False  # the sides differ in whitespace only

    @property
    def shown(self) -> str:
        """The changed text widened to the volatile spans it touches (a date the divergence cuts in two is
        shown whole) and to whole words at both ends."""
        if self.start == self.end and not self.spans:
            return ""
        start = min([self.start, *(span.start for span in self.spans)])
        end = max([self.end, *(span.end for span in self.spans)])
        text = self.context
        if start < end and not text[start].isspace():
            start = re.search(r"\S*$", text[:start]).start()
        if start < end and not text[end - 1].isspace():
            end += re.match(r"\S*", text[end:]).end()
        if self.whitespace:  # the difference is the whitespace itself: keep it (quoted, it shows)
            return text[start:end]
        shown = text[start:end].strip()
        if not self.realigned and re.search(r"\s", shown):  # a window cut mid-word: end at the last whole word
            shown = re.sub(r"\s+\S*$", "", shown) + " …"
        value = shown.rstrip(".,;:")  # a sentence's full stop is not part of the changed value
        if value.endswith('"') and value.count('"') % 2:  # nor is the quote that ends a JSON string (a tool's)
            value = value[:-1].rstrip(".,;:")
        return value or shown


def _sides(record: DriftRecord, decode: Decode) -> tuple[str, _Side, _Side, bool]:
    """(text before the divergence, this request's side, the cached side, whether they re-align)."""
    runs = realign(record.request_after, record.cached_after)
    if runs:
        ends = (runs[0].i, runs[0].j)
    else:
        ends = (min(DIFF_TOKENS, len(record.request_after)), min(DIFF_TOKENS, len(record.cached_after)))
    context = _context(record)
    before = decode(context)
    if record.position > len(context):  # the window starts inside the prompt: drop its first, cut word
        before = re.sub(r"^\S*", "", before, count=1)
    sides = []
    for name, tokens, end in (("request", record.request_after, ends[0]), ("cached", record.cached_after, ends[1])):
        diff = decode(tokens[:end])
        after = decode(tokens[end:end + 2 * DIFF_TOKENS]) if runs else ""
        side = _Side(name, before + diff + after, len(before), len(before) + len(diff), realigned=bool(runs))
        # Without re-alignment the window runs into text that differs anyway: only what the divergence
        # runs into at once counts.
        reach = side.end if runs else min(side.end, side.start + 2)
        side.spans = spans_near(side.context, side.start, reach)
        sides.append(side)
    return before, sides[0], sides[1], bool(runs)


def _first_items(text: str, unit: str) -> list[str]:
    return dict(item_cuts(text))[unit]


def _quote(text: str, limit: int = 60) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return f"'{text}'"


def _template_text(tokens: Sequence[int], decode: Decode, cut: bool, limit: int = 60) -> str:
    """The template's start as one line; ``cut``: the tokens stop inside the prompt (drop the cut word)."""
    text = " ".join(decode(tokens).split())
    if cut and " " in text:
        text = text.rsplit(" ", 1)[0]
    if len(text) > limit:
        cut = text[:limit].rsplit(" ", 1)[0]
        text = cut if len(cut) > limit // 2 else text[:limit]
    return text


def _describe(figures: _GroupFigures, decode: Decode, owners: NamespaceOwners) -> dict[str, Any]:
    records = figures.records
    latest = records[-1]
    before, request, cached, _ = _sides(latest, decode)
    volatile = [{"side": side.name, "context": side.context} | span.as_dict()
                for side in (request, cached) for span in side.spans]
    kinds = sorted({span.kind for side in (request, cached) for span in side.spans})
    is_whitespace = whitespace_only(decode(latest.request_after[:2 * DIFF_TOKENS]),
                                    decode(latest.cached_after[:2 * DIFF_TOKENS]))
    if is_whitespace:
        kinds.append(WHITESPACE)
        request.whitespace = cached.whitespace = True
    tools = tool_changes(latest, decode)
    line_start = before.rsplit("\n", 1)[-1]
    # Inside a tool list the tools analysis says what moved, by name (one tool per line would read as
    # reordered lines too, and no fix to the messages' text reorders tools).
    reordered = None if tools is not None else reordered_items(
        line_start + decode(latest.request_after[:REORDER_WINDOW_TOKENS]),
        line_start + decode(latest.cached_after[:REORDER_WINDOW_TOKENS]))
    if reordered is not None:
        kinds.append(REORDERED)
    if tools is not None:
        kinds.append(TOOLS)
    request_text, cached_text = request.shown, cached.shown
    if reordered is not None:  # the sides start with the same items in another order: show each side's first
        request_text = reordered.items[0].strip()
        cached_start = line_start + decode(latest.cached_after[:REORDER_WINDOW_TOKENS])
        cached_text = next(item for item in _first_items(cached_start, reordered.unit) if item.strip()).strip()
    if tools is not None and tools.moved and tools.request_at and tools.cached_at:
        # Tools in another order: the sides re-align on the moved tool itself, so show the tools each has there.
        request_text, cached_text = tools.request_at, tools.cached_at
    template = _template_text(latest.template_start, decode, cut=latest.position > len(latest.template_start))
    count = len(records)
    positions = sorted({record.position for record in records})
    where = f"token {positions[0]:,}" if len(positions) == 1 else f"tokens {positions[0]:,}-{positions[-1]:,}"
    prefix = f" of the prefix starting {_quote(template)}" if template else " of this namespace"
    sentence = (
        f"{count:,} request{'s' if count != 1 else ''}{prefix} "
        f"diverge{'' if count != 1 else 's'} at {where}, where the text changes "
        f"({_quote(cached_text)} / {_quote(request_text)}): {figures.lost_per_request:,} tokens per request "
        f"recomputed")
    if kinds:
        sentence += f" ({', '.join(kinds)})"
    if tools is not None:
        sentence += "; " + "; ".join(tools.summary)
    return {
        "sentence": sentence,
        "requests": count,
        "namespace": namespace_label(latest.namespace),
        "namespace_owner": owners.single_owner(latest.namespace),
        "template": template,
        "position": positions[0],  # the group's earliest divergence (tokens)
        "positions": positions,  # every divergence position in it (nearby ones are one group)
        "latest_position": latest.position,  # the latest request's, where "before" ends
        "tokens_lost_per_request": figures.lost_per_request,
        "tokens_lost": figures.total_lost,
        "tokens_recomputed_per_request": round(sum(r.tokens_recomputed for r in records) / count),
        "before": before,
        "request_text": request_text,  # the latest request's text where it changes
        "cached_text": cached_text,  # what the cache held there
        "kinds": kinds,
        "volatile": volatile,  # spans with offsets into their side's "context" (the text before + that side's)
        "whitespace_only": is_whitespace,
        "reordered_items": len(reordered.items) if reordered is not None else None,
        # The reordered lines as this request has them (kvreuse diagnose tries one fixed order).
        "reordered_lines": list(reordered.items) if reordered is not None and reordered.unit == "lines" else None,
        # Which tools changed, came, went or moved, when the divergence is inside a tool list (else None).
        "tools": tools.as_dict() if tools is not None else None,
        "advice": advice_for(kinds) + (tools.advice if tools is not None else []),
        "first_seen": records[0].time,
        "last_seen": latest.time,
    }

"""Volatile spans: the parts of a prompt that change from request to request and so end the prefix a
cache can share (seed 001's list: a timestamp in the system prompt, an id, a reordered field,
trailing whitespace).

The drift report and ``kvreuse diagnose`` look at the text just before and after a divergence; this
module says what kind of text changes there (dates, written dates, weekday names, times, UUIDs, long
hex ids, request / session ids, epoch timestamps, plain numbers), whether the two sides differ in
whitespace only, and whether they hold the same lines or items in another order. Pure functions
over strings, so they are tested on crafted text without a tokenizer.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

_WEEKDAY = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tues?|Wed|Thu(?:rs?)?|Fri|Sat|Sun)"
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|"
          r"Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_AM_PM = r"(?:[AaPp]\.[Mm]\.|[AaPp][Mm]\b)"
_TIME = rf"\d{{1,2}}:\d{{2}}(?::\d{{2}}(?:\.\d+)?)?(?:\s?{_AM_PM})?"
_ISO_DATE = r"\d{4}-\d{2}-\d{2}"

# (kind, pattern), most specific first: a span claimed by an earlier kind is not claimed again.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(pattern)) for kind, pattern in (
    ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    ("datetime", rf"\b{_ISO_DATE}[T ]{_TIME}(?:Z|[+-]\d{{2}}:?\d{{2}})?"),
    ("date", rf"\b(?:{_WEEKDAY},?\s+)?{_ISO_DATE}\b"),
    ("date", rf"\b(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?\b"),
    ("date", rf"\b(?:{_WEEKDAY},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH}\.?,?(?:\s+\d{{4}})?\b"),
    ("date", r"\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"),
    ("weekday", rf"\b{_WEEKDAY}\b"),
    ("time", rf"\b{_TIME}"),
    ("time", rf"\b\d{{1,2}}\s?{_AM_PM}"),
    ("epoch", r"\b1\d{9}(?:\d{3})?\b"),
    ("hex-id", r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"),
    ("id", r"\b(?=[A-Za-z0-9_-]*[0-9])(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*\b"),
    ("number", r"\b\d+(?:[.,]\d+)*\b"),
))
_MIN_ID_LENGTH = 6  # shorter letter+digit words are names ("gpt4", "A1"), not ids

TEMPORAL = frozenset({"datetime", "date", "weekday", "time", "epoch"})
IDENTIFIER = frozenset({"uuid", "hex-id", "id"})
WHITESPACE = "whitespace"
REORDERED = "reordered"
TOOLS = "tools"  # inside a tool list: kvreuse.observatory.tools names what changed there, with its own advice


@dataclass(frozen=True)
class VolatileSpan:
    """``text[start:end]`` of the text it was found in looks like a value that changes per request."""

    kind: str
    start: int
    end: int
    text: str

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "start": self.start, "end": self.end, "text": self.text}


def find_volatile_spans(text: str) -> list[VolatileSpan]:
    """Every volatile-looking span of ``text``, non-overlapping, in order of position."""
    taken: list[VolatileSpan] = []
    for kind, pattern in _PATTERNS:
        for match in pattern.finditer(text):
            start, end = match.span()
            if kind == "id" and end - start < _MIN_ID_LENGTH:
                continue
            if any(start < other.end and other.start < end for other in taken):
                continue
            taken.append(VolatileSpan(kind, start, end, match.group()))
    return sorted(taken, key=lambda span: span.start)


def spans_near(text: str, start: int, end: int) -> list[VolatileSpan]:
    """The volatile spans of ``text`` that overlap ``[start, end]`` (or touch ``start`` when the range
    is empty): the ones a divergence at ``start`` runs into."""
    return [span for span in find_volatile_spans(text)
            if span.start <= max(start, end) and span.end >= start and (span.end > start or start == end)]


def _without_whitespace(text: str) -> str:
    return re.sub(r"\s+", "", text)


def whitespace_only(request_text: str, cached_text: str) -> bool:
    """Do two texts that start at the same point differ only in whitespace? Both are windows of the
    same length in tokens, so one may end before the other: compare up to the shorter one."""
    if request_text == cached_text:
        return False
    ours, theirs = _without_whitespace(request_text), _without_whitespace(cached_text)
    shorter = min(len(ours), len(theirs))
    if ours[:shorter] != theirs[:shorter]:
        return False
    # Both windows ran on past the whitespace difference (or one side is whitespace alone).
    return shorter > 0 or not ours or not theirs


@dataclass(frozen=True)
class Reordering:
    """Both sides begin with the same ``items`` (as this request orders them) in another order."""

    items: tuple[str, ...]
    unit: str  # "lines", or "items" (comma / semicolon separated parts)


def item_cuts(text: str) -> list[tuple[str, list[str]]]:
    """Ways to cut a text into items: lines, then comma / semicolon separated parts."""
    parts = [part for part in re.split(r"\s*[,;]\s*|\s*[{}\[\]]\s*", text) if part.strip()]
    return [("lines", text.split("\n")), ("items", parts)]


def reordered_items(request_text: str, cached_text: str, max_items: int = 64) -> Reordering | None:
    """Do both texts (starting at the same point) begin with the same items in another order? The
    smallest such block, as the request orders it; None when they do not."""
    for (unit, ours), (_, theirs) in zip(item_cuts(request_text), item_cuts(cached_text)):
        # The last item of each side may be cut off by the window's end: compare complete ones only.
        limit = min(len(ours) - 1, len(theirs) - 1, max_items)
        for count in range(2, limit + 1):
            first, second = ours[:count], theirs[:count]
            if first != second and Counter(first) == Counter(second):
                return Reordering(tuple(first), unit)
    return None


def advice_for(kinds: Iterable[str]) -> list[str]:
    """What to change in the prompts, for the kinds found at a divergence."""
    found = set(kinds)
    advice = []
    temporal = sorted(found & TEMPORAL)
    if temporal:
        what = "time" if found & TEMPORAL <= {"time"} else "date"
        advice.append(f"move the {what} to the end of the prompt (after the part requests share), "
                      f"or round it (e.g. to the day): {', '.join(temporal)} found here")
    identifiers = sorted(found & IDENTIFIER)
    if identifiers:
        advice.append(f"move the id to the end of the prompt or out of it (into metadata): "
                      f"{', '.join(identifiers)} found here")
    if "number" in found and not temporal and not identifiers:
        advice.append("a number changes here: if it is a counter, a price or a timestamp, move it to the end "
                      "of the prompt")
    if WHITESPACE in found:
        advice.append("strip trailing whitespace (and normalise line ends) before sending: the prompts differ "
                      "in whitespace only")
    if REORDERED in found:
        advice.append("keep a fixed order (sort the items, examples or fields the same way every time): the "
                      "same lines come in another order")
    if not advice and TOOLS not in found:
        advice.append("the prompts differ in content here (where the user's part starts, that is expected); "
                      "if this part is meant to be shared, make it byte-identical")
    return advice

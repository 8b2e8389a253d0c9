"""Tool lists in prompts: which tool definition changed, came, went or moved where a prompt left the cache.

Agent prompts carry their tools as JSON that the chat template writes into the prompt: Qwen2.5's and the
hermes templates one ``{"type": "function", "function": {...}}`` object per line between ``<tools>`` and
``</tools>``, Llama 3.1's indented objects one after another, Mistral's a JSON array. Every turn resends
them, so one edited description or two tools in another order makes every request miss from that point
on, and a token position alone does not say which tool to fix.

Given the text on both sides of a divergence (what both share before it, then each side's own window),
`tool_drift` finds the complete tool definitions on each side (JSON objects with a function name; an
object a window cuts is ignored), takes the list the divergence falls in, matches its tools by name and
says which definition changed and the first JSON path where it differs
(``parameters.properties.q.description``), which tools were added or removed, and which kept their
definitions but moved. Pure functions over strings, like kvreuse.observatory.volatile: tested on crafted
text without a tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Keys that make an object with a "name" a tool definition (OpenAI's function object, Anthropic's tool);
# a tool call ({"name", "arguments"}) in the history is not one.
_DEFINITION_KEYS = ("parameters", "input_schema", "description")
_GAP = re.compile(r"[\s,]*")  # what may separate two tools of one list: newlines, Mistral's ", "
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")  # keys a path writes after a dot; others as ["..."]
_DECODER = json.JSONDecoder()

# How a definition differs at its first differing path (first_difference).
CHANGED, ADDED, REMOVED, KEY_ORDER, SERIALISED = "changed", "added", "removed", "key order", "serialised"

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class ToolText:
    """One complete tool definition as the prompt has it: ``text[start:end]`` is its JSON object."""

    name: str
    value: dict[str, Any]  # the object as parsed (the wrapper with "function", or the definition itself)
    wrapped: bool  # {"type": "function", "function": {...}}: paths are given inside "function"
    start: int
    end: int
    source: str  # the object's text as rendered (two definitions may parse equal and differ here)


@dataclass(frozen=True)
class ToolList:
    """Tools one after another (only whitespace or commas between them): one list as a template writes it."""

    tools: tuple[ToolText, ...]
    complete: bool  # the text goes on past the list (no tool of it can lie beyond the window's end)

    def by_name(self) -> dict[str, ToolText]:
        named: dict[str, ToolText] = {}
        for tool in self.tools:
            named.setdefault(tool.name, tool)
        return named


def _as_tool(value: Any) -> tuple[str, bool] | None:
    """(name, wrapped) when ``value`` is a tool definition, else None."""
    if not isinstance(value, dict):
        return None
    function = value.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return function["name"], True
    if (isinstance(value.get("name"), str) and "arguments" not in value
            and any(key in value for key in _DEFINITION_KEYS)):
        return value["name"], False
    return None


def find_tools(text: str) -> list[ToolText]:
    """Every complete tool definition in ``text``, in order. Each ``{`` is tried as the start of a JSON
    object: one that does not parse (a brace in prose, an object a window's end cuts) is skipped, one that
    parses but is no tool is searched inside (a wrapper may hold the tools), a tool is taken whole."""
    tools: list[ToolText] = []
    position = text.find("{")
    while position >= 0:
        try:
            value, end = _DECODER.raw_decode(text, position)
        except ValueError:
            found = None
        else:
            found = _as_tool(value)
        if found is None:
            position = text.find("{", position + 1)
            continue
        name, wrapped = found
        tools.append(ToolText(name, value, wrapped, position, end, text[position:end]))
        position = text.find("{", end)
    return tools


def tool_lists(text: str) -> list[tuple[ToolList, int, int]]:
    """The tool lists of ``text``: each with the offset of its first tool and the end of the whitespace or
    commas after its last one."""
    runs: list[list[ToolText]] = []
    for tool in find_tools(text):
        if runs and _GAP.fullmatch(text, runs[-1][-1].end, tool.start):
            runs[-1].append(tool)
        else:
            runs.append([tool])
    lists = []
    for run in runs:
        after = _GAP.match(text, run[-1].end).end()
        # A list the window ends in, or ends right after, may go on past it; one followed by other text
        # (``</tools>``, ``]``, the next instruction) is whole. A "{" there is an object the window cut.
        complete = after < len(text) and text[after] != "{"
        lists.append((ToolList(tuple(run), complete), run[0].start, after))
    return lists


def _list_at(text: str, offset: int) -> ToolList | None:
    """The tool list ``offset`` falls in (the whitespace after it included), or None."""
    for tool_list, start, end in tool_lists(text):
        if start <= offset <= end:
            return tool_list
    return None


def first_difference(cached: Any, request: Any, path: Path = ()) -> tuple[Path, str] | None:
    """Where two parsed JSON values first differ, in the order their text has it: (path, how), ``how`` one
    of CHANGED, ADDED / REMOVED (a key or item the request has / lacks) and KEY_ORDER (the same keys in
    another order); None when they are equal, key order included."""
    if isinstance(cached, dict) and isinstance(request, dict):
        ours, theirs = list(request), list(cached)
        for mine, other in zip(ours, theirs):
            if mine == other:
                found = first_difference(cached[other], request[mine], (*path, mine))
                if found is not None:
                    return found
            elif mine not in cached:
                return (*path, mine), ADDED
            elif other not in request:
                return (*path, other), REMOVED
            else:
                return path, KEY_ORDER
        if len(ours) != len(theirs):
            if len(ours) > len(theirs):
                return (*path, ours[len(theirs)]), ADDED
            return (*path, theirs[len(ours)]), REMOVED
        return None
    if isinstance(cached, list) and isinstance(request, list):
        for index, (other, mine) in enumerate(zip(cached, request)):
            found = first_difference(other, mine, (*path, index))
            if found is not None:
                return found
        if len(cached) != len(request):
            shorter = min(len(cached), len(request))
            return (*path, shorter), ADDED if len(request) > len(cached) else REMOVED
        return None
    # bool is an int and 1 == 1.0 in Python; in the prompt they are different text.
    if type(cached) is not type(request) or cached != request:
        return path, CHANGED
    return None


def format_path(path: Path) -> str:
    """``parameters.properties.q.description``; list items as ``[0]``, odd keys as ``["a b"]``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part, ensure_ascii=False)}]"
    return text


@dataclass(frozen=True)
class ToolChange:
    """A tool in both lists whose definition differs: the first path where it does, and how."""

    name: str
    path: str  # "" when the difference is at the definition's top (its keys in another order)
    change: str  # CHANGED, ADDED, REMOVED, KEY_ORDER or SERIALISED

    @property
    def phrase(self) -> str:
        where = self.path or "its definition"
        if self.change == SERIALISED:
            return f"tool `{self.name}`: the same definition, serialised differently (whitespace or escapes)"
        if self.change == KEY_ORDER:
            return f"tool `{self.name}`: the keys of {where} in another order"
        return f"tool `{self.name}`: {where} {self.change}"

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path, "change": self.change}


def _names(names: Sequence[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _longest_common_order(first: Sequence[str], second: Sequence[str]) -> set[str]:
    """The names of a longest subsequence both orders share: the tools that kept their relative order."""
    lengths = [[0] * (len(second) + 1) for _ in range(len(first) + 1)]
    for i in range(len(first) - 1, -1, -1):
        for j in range(len(second) - 1, -1, -1):
            lengths[i][j] = (lengths[i + 1][j + 1] + 1 if first[i] == second[j]
                             else max(lengths[i + 1][j], lengths[i][j + 1]))
    kept, i, j = set(), 0, 0
    while i < len(first) and j < len(second):
        if first[i] == second[j]:
            kept.add(first[i])
            i, j = i + 1, j + 1
        elif lengths[i + 1][j] >= lengths[i][j + 1]:
            i += 1
        else:
            j += 1
    return kept


@dataclass(frozen=True)
class ToolDrift:
    """How the tool list a divergence falls in differs between a request and the cached prompt it left.
    Only the tools both windows show whole are compared; ``complete`` says whether both lists were seen
    to their end (if not, a tool past a window's end is neither added nor removed here)."""

    request_tools: tuple[str, ...]  # the list's tool names as the request orders them
    cached_tools: tuple[str, ...]
    request_at: str | None  # the request's tool the divergence falls inside (None: between two tools)
    cached_at: str | None  # the cached prompt's
    changed: tuple[ToolChange, ...]
    added: tuple[str, ...]  # in the request's list, not in the cached one
    removed: tuple[str, ...]
    moved: tuple[str, ...]  # in both, in another order (the fewest that explain it)
    swapped: bool  # the order differs by two tools trading places (``moved`` holds the two)
    complete: bool

    @property
    def summary(self) -> list[str]:
        """One phrase per finding, the one about the tool the prompts diverge in first."""
        found: list[tuple[Iterable[str], str]] = [((change.name,), change.phrase) for change in self.changed]
        if self.swapped:
            found.append((self.moved, f"tools {_names(self.moved)} swapped"))
        elif self.moved:
            found.append((self.moved, f"tool{'s' if len(self.moved) > 1 else ''} {_names(self.moved)} moved"))
        for names, how in ((self.added, "added"), (self.removed, "removed")):
            if names:
                found.append((names, f"tool{'s' if len(names) > 1 else ''} {_names(names)} {how}"))
        found.sort(key=lambda item: not {self.request_at, self.cached_at} & set(item[0]))
        return [phrase for _, phrase in found]

    @property
    def advice(self) -> list[str]:
        advice = []
        if self.moved:
            advice.append("keep the tool list in a fixed order (build it once, or sort it by name): the same tools "
                          "come in another order")
        edited = [change.name for change in self.changed if change.change not in (SERIALISED, KEY_ORDER)]
        reformed = [change.name for change in self.changed if change.change in (SERIALISED, KEY_ORDER)]
        if edited:
            advice.append(f"send each tool's definition byte-identical every time (build the tool list once, not "
                          f"per request; a definition that must change goes last in the list): {_names(edited)} "
                          f"changed")
        if reformed:
            advice.append(f"serialise the tools the same way every time (one JSON encoder, keys in a fixed order): "
                          f"{_names(reformed)} differ in form only")
        if self.added or self.removed:
            advice.append("send the same tools every turn (a list that grows or shrinks misses from the first "
                          "difference on), or put the tools that come and go at the end of the list")
        return advice

    def as_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "at_divergence": {"request": self.request_at, "cached": self.cached_at},
            "changed": [change.as_dict() for change in self.changed],
            "added": list(self.added),
            "removed": list(self.removed),
            "moved": list(self.moved),
            "swapped": self.swapped,
            "request_tools": list(self.request_tools),
            "cached_tools": list(self.cached_tools),
            "complete": self.complete,
        }


def _common_length(first: str, second: str) -> int:
    low, high = 0, min(len(first), len(second))
    while low < high:  # binary search of C-speed slice compares
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _change(cached: ToolText, request: ToolText) -> ToolChange:
    found = first_difference(cached.value, request.value)
    if found is None:  # equal values, key order included: the text differs in whitespace or escapes
        return ToolChange(request.name, "", SERIALISED)
    path, how = found
    if cached.wrapped and request.wrapped and path[:1] == ("function",):
        path = path[1:]  # paths inside the function object, as a tool's author knows them
    return ToolChange(request.name, format_path(path), how)


def tool_drift(request_text: str, cached_text: str) -> ToolDrift | None:
    """How the tool lists differ where two texts (the same text up to a divergence, then each side's own)
    part; None when the divergence falls in no tool list or the tools both sides show whole are the same."""
    offset = _common_length(request_text, cached_text)
    request_list, cached_list = _list_at(request_text, offset), _list_at(cached_text, offset)
    if request_list is None and cached_list is None:
        return None
    # A side with no list there has none (an empty list between <tools> and </tools>, say): it is whole.
    request_list = request_list or ToolList((), True)
    cached_list = cached_list or ToolList((), True)
    ours, theirs = request_list.by_name(), cached_list.by_name()
    changed = tuple(_change(theirs[name], tool) for name, tool in ours.items()
                    if name in theirs and theirs[name].source != tool.source)
    added = tuple(name for name in ours if name not in theirs) if cached_list.complete else ()
    removed = tuple(name for name in theirs if name not in ours) if request_list.complete else ()
    request_order = [name for name in ours if name in theirs]
    cached_order = [name for name in theirs if name in ours]
    differ = [index for index, (mine, other) in enumerate(zip(request_order, cached_order)) if mine != other]
    swapped = len(differ) == 2
    if swapped:
        moved = tuple(cached_order[index] for index in differ)  # as the cache had them: "a and b swapped"
    else:
        kept = _longest_common_order(request_order, cached_order)
        moved = tuple(name for name in request_order if name not in kept)
    if not (changed or added or removed or moved):
        return None
    request_at, cached_at = (next((tool.name for tool in tool_list.tools if tool.start <= offset < tool.end), None)
                             for tool_list in (request_list, cached_list))
    return ToolDrift(
        request_tools=tuple(ours), cached_tools=tuple(theirs), request_at=request_at, cached_at=cached_at,
        changed=changed, added=added, removed=removed, moved=moved, swapped=swapped,
        complete=request_list.complete and cached_list.complete)

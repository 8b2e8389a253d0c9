"""What every tool-call parser shares: the call and delta types, ``tool_choice``, the JSON scanning that
finds a call's arguments in text as it streams, and the grammar pieces.

A parser reads the text a model generated in its own tool-call format. ``extract`` and the streaming
extractor are one state machine (``extract`` feeds it the whole text at once), so the deltas of a stream
always add up to the non-streamed result, whatever the text. Arguments are handed on as the exact
characters the model generated, never re-serialised: the client sends them back in the next turn, and
the cache can only hit if the prompt then holds what the model produced.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from kvreuse.errors import InvalidRequestError
from kvreuse.messages import validate_tools
from kvreuse.structured_outputs import StructuredOutputsParams

# How the chat templates write JSON (transformers' ``tojson``: json.dumps with ensure_ascii=False and the
# default separators). Every %json in a tool-call grammar carries these options, so the model generates
# the arguments exactly as the template writes them back when the call is replayed in the history.
TEMPLATE_JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is the JSON text exactly as the model generated it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at ``index``: its first delta has the id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one piece of generated text added: content text and tool-call deltas (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def add_arguments(self, index: int, text: str) -> None:
        if text:
            self.tool_calls.append(ToolCallDelta(index, arguments=text))


class ToolCallStream(ABC):
    """Extracts content and tool calls from one sample's text as it arrives. Text that may still turn out
    to be the start of a tool call is held back until the next delta (or ``finish``) decides."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """Add generated text; returns what it made certain."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The sample ended: release what was held back. Call once."""


class BufferedToolCallStream(ToolCallStream):
    """The shape every format's stream takes: the text so far, a position before which it is settled, a
    state, the index of the call being read and the scanner of its arguments; ``_advance`` settles what the
    text allows (all of it when ``final``)."""

    def __init__(self, state: str) -> None:
        self._text = ""
        self._position = 0  # text before it is settled: handed out or skipped
        self._state = state
        self._index = -1
        self._scanner: ValueScanner | None = None

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    @abstractmethod
    def _advance(self, final: bool) -> StreamDelta:
        """Settle what the text so far decides; with ``final``, everything."""


ToolChoiceMode = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice`` resolved against its tools: the mode, and the one function a named
    choice forces (``mode == "required"`` then)."""

    mode: ToolChoiceMode
    function: str | None = None


def resolve_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]], *,
                        param: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice`` ("none", "auto", "required" or ``{"type": "function", "function": {"name"}}``;
    None means "auto") against checked ``tools``. A choice that cannot be met (no tools, an unknown name)
    raises InvalidRequestError naming the field."""
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto")
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice == "required":
        if not tools:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool in tools", param)
        return ToolChoice("required")
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if tool_choice.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise InvalidRequestError(
                "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                "{\"name\": ...}}", param)
        name = function.get("name")
        known = [tool["function"]["name"] for tool in tools]
        if name not in known:
            raise InvalidRequestError(f"{param}.function.name {name!r} is not one of the tools "
                                      f"({', '.join(known) or 'none given'})", f"{param}.function.name")
        return ToolChoice("required", name)
    raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                              param)


def random_call_id() -> str:
    """OpenAI's shape of a tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """One model family's tool-call format: extraction, streaming extraction, and the grammar that makes the
    model call in that format. ``added_tokens``: the tokenizer's added tokens (text -> id), so a grammar
    can name a tag that is one token as that token (llguidance treats an added ``<...>`` token as special,
    which text cannot spell); None assumes the family's usual tokenizer. ``id_factory`` makes call ids
    for formats whose text has none."""

    name: ClassVar[str]
    # Tags the format's text holds that are special tokens: decoding must keep them (skip_special_tokens
    # False) or extraction cannot see the calls.
    special_tags: ClassVar[tuple[str, ...]] = ()
    # Whether every chat reply is read through this parser, tools or not: a format whose markers frame all
    # replies (harmony's channels), so the content is what the parser finds, not the text.
    parses_every_reply: ClassVar[bool] = False

    def __init__(self, added_tokens: Mapping[str, int] | None = None,
                 id_factory: Callable[[], str] | None = None) -> None:
        self.added_tokens = dict(added_tokens) if added_tokens is not None else None
        self.id_factory = id_factory or random_call_id

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the text must be decoded with special tokens kept for this parser to find the calls."""
        return bool(self.special_tags)

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A streaming extractor for one sample."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole generated text. Content is None when it is empty and there are
        calls (OpenAI's ``content: null``)."""
        stream = self.stream()
        deltas = [stream.feed(text), stream.finish()]
        content = "".join(delta.content for delta in deltas)
        calls: dict[int, dict[str, str]] = {}
        for delta in deltas:
            for call in delta.tool_calls:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                if call.id is not None:
                    entry["id"] = call.id
                if call.name is not None:
                    entry["name"] = call.name
                entry["arguments"] += call.arguments
        tool_calls = [ToolCall(**calls[index]) for index in sorted(calls)]
        return (content or (None if tool_calls else "")), tool_calls

    def grammar(self, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = "auto",
                parallel_tool_calls: bool | None = True) -> str | None:
        """A Lark grammar (llguidance's dialect) that enforces ``tool_choice`` in this format, or None when
        nothing is enforced ("none", or "auto" without a ``strict`` tool). "required": one or more calls
        (exactly one when ``parallel_tool_calls`` is false) of the given tools; a named function: that
        function only; "auto" with a strict tool: free text, or calls once the format's opening tag comes.
        Arguments follow each tool's ``parameters`` schema, written as the chat template writes them."""
        checked = validate_tools(tools)
        choice = resolve_tool_choice(tool_choice, checked)
        if choice.mode == "none" or not checked:
            return None
        if choice.mode == "auto" and not any(tool["function"].get("strict") for tool in checked):
            return None
        functions = [tool["function"] for tool in checked if choice.function in (None, tool["function"]["name"])]
        return self._grammar(functions, choice.mode == "required", parallel_tool_calls is not False)

    def structured_outputs(self, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = "auto",
                           parallel_tool_calls: bool | None = True) -> StructuredOutputsParams | None:
        """`grammar` as the request's constraint (``SamplingParams.structured_outputs``), or None. A grammar
        the engine refuses (a schema it cannot compile) is reported against ``tools``."""
        grammar = self.grammar(tools, tool_choice, parallel_tool_calls)
        return None if grammar is None else StructuredOutputsParams(grammar=grammar, field="tools")

    @abstractmethod
    def _grammar(self, functions: list[dict[str, Any]], required: bool, parallel: bool) -> str:
        """The grammar over ``functions`` (checked), calls forced (required) or after free text (auto)."""

    def _has_token(self, tag: str) -> bool:
        return self.added_tokens is None or tag in self.added_tokens


# ----------------------------------------------------------------------------------------------
# Grammar pieces


def lark_literal(text: str) -> str:
    """A Lark string literal for ``text`` (JSON string syntax is Lark's)."""
    return json.dumps(text)


def arguments_json(function: Mapping[str, Any]) -> str:
    """``%json {...}`` for a function's arguments: its ``parameters`` schema (any object without one),
    serialised as the chat template writes JSON."""
    parameters = function.get("parameters")
    schema = dict(parameters) if isinstance(parameters, Mapping) else {"type": "object"}
    schema["x-guidance"] = {**TEMPLATE_JSON_STYLE}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def function_rules(functions: Sequence[Mapping[str, Any]], arguments_key: str) -> tuple[str, str]:
    """(``fn`` rule body, rule definitions): per function the text from its name to the end of its
    arguments, ``NAME", "<arguments_key>": ARGS`` (the opening ``{"name": "`` and closing ``}`` are the
    caller's)."""
    names = [f"fn_{index}" for index in range(len(functions))]
    rules = []
    for rule, function in zip(names, functions):
        head = lark_literal(f'{function["name"]}", "{arguments_key}": ')
        rules.append(f"{rule}: {head} {arguments_json(function)}\n")
    return " | ".join(names), "".join(rules)


def text_without(tags: Sequence[str], ending: str = "") -> str:
    """A Lark terminal body: any text that does not contain one of ``tags`` (the free text beside tool
    calls, so a tag in it always starts a call), ending in ``ending`` when given."""
    excluded = " | ".join(f"/(?s:.*){_regex_escape(tag)}(?s:.*)/" for tag in tags)
    return f"/(?s:.*){_regex_escape(ending)}/ & ~({excluded})"


def _regex_escape(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex (Rust regex syntax, and ``/`` escaped)."""
    special = "\\.+*?()|[]{}^$#&-~/"
    escaped = "".join(f"\\{character}" if character in special else character for character in text)
    return escaped.replace("\n", "\\n")


# ----------------------------------------------------------------------------------------------
# Scanning the text of a call


class HeaderStatus:
    PARTIAL = "partial"  # the text ends before the header can be decided
    FAIL = "fail"
    MATCH = "match"


_WHITESPACE = re.compile(r"[ \t\r\n]*")


def match_call_header(text: str, position: int, argument_keys: Sequence[str]) -> tuple[str, str | None, int]:
    """Match ``{"name": "<name>", "<argument key>": `` (any JSON whitespace between) at ``position``.
    Returns (status, name, index of the first character of the arguments value). MATCH only once that
    character has arrived; PARTIAL while the text could still become a header."""
    end = len(text)

    def skip_space(at: int) -> int:
        return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]

    def literal(at: int, expected: str | Sequence[str]) -> tuple[str, int]:
        options = [expected] if isinstance(expected, str) else list(expected)
        for option in options:
            if text.startswith(option, at):
                return HeaderStatus.MATCH, at + len(option)
        rest = text[at:]
        if any(option.startswith(rest) for option in options):
            return HeaderStatus.PARTIAL, at
        return HeaderStatus.FAIL, at

    at = skip_space(position)
    steps: list[str | Sequence[str]] = ["{", '"name"', ":"]
    for step in steps:
        status, at = literal(at, step)
        if status != HeaderStatus.MATCH:
            return status, None, at
        at = skip_space(at)
    if at >= end:
        return HeaderStatus.PARTIAL, None, at
    if text[at] != '"':
        return HeaderStatus.FAIL, None, at
    string_end = _string_end(text, at)
    if string_end is None:
        return HeaderStatus.PARTIAL, None, at
    try:
        name = json.loads(text[at:string_end])
    except ValueError:
        return HeaderStatus.FAIL, None, at
    at = skip_space(string_end)
    for step in (",", [f'"{key}"' for key in argument_keys], ":"):
        status, at = literal(at, step)
        if status != HeaderStatus.MATCH:
            return status, None, at
        at = skip_space(at)
    if at >= end:
        return HeaderStatus.PARTIAL, None, at
    return HeaderStatus.MATCH, name, at


def _string_end(text: str, quote: int) -> int | None:
    """Index after the JSON string that opens at ``quote``; None if the text ends inside it."""
    at = quote + 1
    while True:
        run = _STRING_RUN.match(text, at)
        at = run.end()  # type: ignore[union-attr]
        if at >= len(text):
            return None
        if text[at] == '"':
            return at + 1
        if at + 1 >= len(text):  # a backslash, its escaped character not here yet
            return None
        at += 2


_STRING_RUN = re.compile(r'[^"\\]*')
_OUTSIDE_STRING_RUN = re.compile(r'[^"{}\[\]]*')
_LITERAL_RUN = re.compile(r"[-+.0-9A-Za-z]*")


class ValueScanner:
    """Finds the end of the JSON value that starts at ``start`` as text arrives (resumable: each ``advance``
    scans only the new text). An object, array or string releases every character scanned (all belong to
    the value); a bare literal (number, true) only once it has ended, since its next character decides."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.position = start
        self.done = False
        self._kind: str | None = None  # "container", "string" or "literal"
        self._depth = 0
        self._in_string = False

    def advance(self, text: str) -> None:
        if self.done or self.position >= len(text):
            return
        if self._kind is None:
            first = text[self.position]
            if first in "{[":
                self._kind, self._depth = "container", 1
            elif first == '"':
                self._kind, self._in_string = "string", True
            else:
                self._kind = "literal"
            if self._kind != "literal":
                self.position += 1
        if self._kind == "literal":
            self.position = _LITERAL_RUN.match(text, self.position).end()  # type: ignore[union-attr]
            self.done = self.position < len(text)  # a character that is not part of it ended it
            return
        size = len(text)
        while self.position < size:
            if self._in_string:
                self.position = _STRING_RUN.match(text, self.position).end()  # type: ignore[union-attr]
                if self.position >= size:
                    return
                if text[self.position] == "\\":
                    if self.position + 1 >= size:
                        return
                    self.position += 2
                    continue
                self.position += 1
                self._in_string = False
                if self._kind == "string":
                    self.done = True
                    return
                continue
            self.position = _OUTSIDE_STRING_RUN.match(text, self.position).end()  # type: ignore[union-attr]
            if self.position >= size:
                return
            character = text[self.position]
            self.position += 1
            if character == '"':
                self._in_string = True
            elif character in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return

    def releasable(self, text: str, final: bool) -> int:
        """Up to where the value's text may be handed out now."""
        if self._kind == "literal" and not self.done:
            return len(text) if final else self.start
        return self.position


def partial_suffix(text: str, start: int, tags: Sequence[str]) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper prefix of one of ``tags``."""
    longest = min(max(len(tag) for tag in tags) - 1, len(text) - start)
    for length in range(longest, 0, -1):
        suffix = text[len(text) - length:]
        if any(tag.startswith(suffix) and len(tag) > length for tag in tags):
            return length
    return 0

"""harmony: gpt-oss's format, where every message names its channel and what the user sees is one of them.

After the prompt's ``<|start|>assistant`` the model writes messages such as
``<|channel|>analysis<|message|>...<|end|>`` (its reasoning), ``<|start|>assistant<|channel|>final<|message|>
...<|return|>`` (the answer) and, to call a tool, ``<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`` (the recipient may also stand before the channel). ``<|return|>`` and ``<|call|>``
stop generation, so the text usually ends without them. This parser keeps the final channel's text as the
content, reads each message addressed to ``functions.NAME`` as a call with its body as the arguments, and
drops the analysis channel (the OpenAI API has no field for it here). A text that never opens a harmony
message (``<|`` never written) is content as it is.

Unlike the other formats, the markers are special tokens, so the text must keep them (``special_tags``), and
the server applies this parser to every chat reply of a harmony model, tools or not: otherwise the channel
names would be the reply. A forced call (``tool_choice`` required or a named function) is a grammar of one
call message straight after the prompt; ``auto`` with strict tools is refused, since the free text it allows
(analysis messages with their own markers) has no grammar here.
"""

from __future__ import annotations

import re
from typing import Any

from kvreuse.errors import InvalidRequestError
from kvreuse.tool_parsers.base import (
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    arguments_json,
    lark_literal,
    partial_suffix,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
FUNCTIONS = "functions."
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


class HarmonyToolParser(ToolParser):
    name = "harmony"
    special_tags = MARKERS
    # Applied to every chat reply of the model, not only to requests with tools (see the module docstring).
    parses_every_reply = True

    def stream(self) -> ToolCallStream:
        return _HarmonyStream(self)

    def _grammar(self, functions: list[dict[str, Any]], required: bool, parallel: bool) -> str:
        if not required:
            raise InvalidRequestError(
                "strict tools with tool_choice 'auto' are not supported for the harmony format (gpt-oss): the free "
                "text before a call holds the model's own channel markers; send tool_choice 'required' or a named "
                "function to force a call, or tools without strict", "tools")
        tokens = all(self._has_token(tag) for tag in (CHANNEL, CONSTRAIN, MESSAGE))
        channel, constrain, message = (CHANNEL, CONSTRAIN, MESSAGE) if tokens else (
            lark_literal(CHANNEL), lark_literal(CONSTRAIN), lark_literal(MESSAGE))
        names = [f"fn_{index}" for index in range(len(functions))]
        lines = ["%llguidance {}", "start: call", f"call: {channel} fn", f"fn: {' | '.join(names)}"]
        for rule, function in zip(names, functions):
            head = lark_literal(f"commentary to={FUNCTIONS}{function['name']} ")
            lines.append(f"{rule}: {head} {constrain} \"json\" {message} {arguments_json(function)}")
        return "\n".join(lines) + "\n"


class _HarmonyStream(ToolCallStream):
    """Re-reads the whole text on each delta (replies are short next to the model's cost per token) and hands
    out what grew: final-channel text and call arguments up to any end that could still be a marker's start."""

    def __init__(self, parser: HarmonyToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._calls: list[tuple[str, str, int]] = []  # (id, name, argument characters sent)

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        content, calls = _read(self._text, final)
        delta = StreamDelta(content=content[self._content_sent:])
        self._content_sent = len(content)
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._calls):
                call_id = self._parser.id_factory()
                self._calls.append((call_id, name, 0))
                delta.tool_calls.append(ToolCallDelta(index, id=call_id, name=name))
            call_id, name, sent = self._calls[index]
            delta.add_arguments(index, arguments[sent:])
            self._calls[index] = (call_id, name, len(arguments))
        return delta


def _read(text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(function name, arguments)]) that ``text`` settles; with ``final``, all of it."""
    first = text.find("<|")
    if first < 0:  # no harmony message (yet): content, less an end that could open a marker
        held = 0 if final else partial_suffix(text, 0, MARKERS)
        return text[:len(text) - held], []
    content = [text[:first]]
    calls: list[tuple[str, str]] = []
    position = first
    while position < len(text):
        body_start = text.find(MESSAGE, position)
        if body_start < 0:
            break  # a header still arriving
        header = text[position:body_start]
        body_start += len(MESSAGE)
        ends = [found for found in (text.find(tag, body_start) for tag in TERMINATORS) if found >= 0]
        body_end = min(ends) if ends else len(text)
        complete = bool(ends)
        if not complete and not final:
            body_end -= partial_suffix(text, body_start, MARKERS)
        body = text[body_start:body_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            calls.append((recipient.group(1)[len(FUNCTIONS):], body))
        elif channel is not None and channel.group(1) == "final":
            content.append(body)
        if not complete:
            break
        position = body_end + len(next(tag for tag in TERMINATORS if text.startswith(tag, body_end)))
    return "".join(content), calls


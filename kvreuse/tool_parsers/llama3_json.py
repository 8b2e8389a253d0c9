"""llama3_json: Llama 3.1 / 3.2 / 3.3 JSON tool calling.

The model answers either with text or, from its first character, with calls: ``{"name": ..., "parameters":
...}`` (vLLM's parser takes ``"arguments"`` too), several separated by ``; ``, optionally after
``<|python_tag|>``. Llama 3.1's template writes a call back as ``{"name": "<name>", "parameters": <args |
tojson>}``, which is what the grammar makes the model generate. A reply that starts like a call but is not
one (``{"x": 1}``) is content, all of it.
"""

from __future__ import annotations

import re
from typing import Any

from kvreuse.tool_parsers.base import (
    BufferedToolCallStream,
    HeaderStatus,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    ValueScanner,
    function_rules,
    match_call_header,
)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")
# Between two calls: the end of the first one's object, then "; ".
_SEPARATOR = re.compile(r"[ \t\r\n]*\}[ \t\r\n]*;[ \t\r\n]*")
_SEPARATOR_SO_FAR = re.compile(r"[ \t\r\n]*(\}[ \t\r\n]*)?")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream(self)

    def _grammar(self, functions: list[dict[str, Any]], required: bool, parallel: bool) -> str:
        alternatives, rules = function_rules(functions, "parameters")
        lines = ["%llguidance {}", "start: calls" if required else "start: TEXT | calls"]
        if not required:
            lines.append("TEXT: /([^{](?s:.*))?/")  # text that does not start like a call
        lines += [
            'calls: call ("; " call)*' if parallel else "calls: call",
            'call: "{\\"name\\": \\"" fn "}"',
            f"fn: {alternatives}",
        ]
        return "\n".join(lines) + "\n" + rules


class _Llama3JsonStream(BufferedToolCallStream):
    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__("start")  # start, content, header, arguments, between, done
        self._parser = parser

    def _advance(self, final: bool) -> StreamDelta:
        text, out = self._text, StreamDelta()
        while True:
            if self._state == "start":
                rest = text[self._position:]
                if rest.startswith(PYTHON_TAG):
                    self._position, self._state = self._position + len(PYTHON_TAG), "header"
                elif rest.startswith("{"):
                    self._state = "header"
                elif not final and PYTHON_TAG.startswith(rest):  # nothing yet, or the tag's beginning
                    return out
                else:
                    self._state = "content"
            elif self._state == "content":
                out.content += text[self._position:]
                self._position = len(text)
                return out
            elif self._state == "header":
                status, name, value_start = match_call_header(text, self._position, ARGUMENT_KEYS)
                if status == HeaderStatus.PARTIAL and not final:
                    return out
                if status != HeaderStatus.MATCH:
                    if self._index == -1:  # nothing handed out yet: the whole reply is text after all
                        self._position, self._state = 0, "content"
                        continue
                    self._state = "done"
                    return out
                self._index += 1
                out.tool_calls.append(ToolCallDelta(self._index, id=self._parser.id_factory(), name=name))
                self._scanner, self._position, self._state = ValueScanner(value_start), value_start, "arguments"
            elif self._state == "arguments":
                assert self._scanner is not None
                self._scanner.advance(text)
                releasable = self._scanner.releasable(text, final)
                out.add_arguments(self._index, text[self._position:releasable])
                self._position = max(self._position, releasable)
                if not self._scanner.done:
                    return out
                self._state = "between"
            elif self._state == "between":
                separator = _SEPARATOR.match(text, self._position)
                if separator is not None:
                    self._position, self._state = separator.end(), "header"
                    continue
                so_far = _SEPARATOR_SO_FAR.match(text, self._position)
                if not final and so_far is not None and so_far.end() == len(text):
                    return out
                self._state = "done"
            else:
                return out

"""mistral: Mistral / Mixtral instruct models.

Calls follow the special token ``[TOOL_CALLS]`` as a JSON list, ``[TOOL_CALLS][{"name": ..., "arguments":
...}, ...]`` (tokenizer v3); newer tokenizers (v11 on) write each call as ``[TOOL_CALLS]name[ARGS]{...}``,
which is read too. Text before the first ``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token,
so the text must be decoded with special tokens kept (``needs_special_tokens``). Mistral's tool-call ids
are 9 letters and digits, and its template refuses others.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Mapping
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
    lark_literal,
    match_call_header,
    partial_suffix,
    text_without,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARGUMENT_KEYS = ("arguments", "parameters")
_LIST_START = re.compile(r"[ \t\r\n]*\[")
_NEXT_IN_LIST = re.compile(r"[ \t\r\n]*\}[ \t\r\n]*,")
_LIST_END = re.compile(r"[ \t\r\n]*\}[ \t\r\n]*\]")
_BETWEEN_SO_FAR = re.compile(r"[ \t\r\n]*(\}[ \t\r\n]*)?")
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_ALPHABET, k=9))


class MistralToolParser(ToolParser):
    name = "mistral"
    special_tags = (TOOL_CALLS,)

    def __init__(self, added_tokens: Mapping[str, int] | None = None,
                 id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(added_tokens, id_factory or mistral_call_id)

    def stream(self) -> ToolCallStream:
        return _MistralStream(self)

    def _grammar(self, functions: list[dict[str, Any]], required: bool, parallel: bool) -> str:
        token_id = (self.added_tokens or {}).get(TOOL_CALLS)
        tag = f"<[{token_id}]>" if token_id is not None else lark_literal(TOOL_CALLS)
        alternatives, rules = function_rules(functions, "arguments")
        lines = ["%llguidance {}"]
        if required:
            lines.append("start: calls")
        else:
            lines += ["start: TEXT | TEXT calls", f"TEXT: {text_without([TOOL_CALLS])}"]
        lines += [
            f'calls: {tag} "[" call (", " call)* "]"' if parallel else f'calls: {tag} "[" call "]"',
            'call: "{\\"name\\": \\"" fn "}"',
            f"fn: {alternatives}",
        ]
        return "\n".join(lines) + "\n" + rules


class _MistralStream(BufferedToolCallStream):
    def __init__(self, parser: MistralToolParser) -> None:
        super().__init__("content")  # content, open, header, name, arguments, between, done
        self._parser = parser
        self._in_list = False

    def _start_call(self, out: StreamDelta, name: str, value_start: int) -> None:
        self._index += 1
        out.tool_calls.append(ToolCallDelta(self._index, id=self._parser.id_factory(), name=name))
        self._scanner, self._position, self._state = ValueScanner(value_start), value_start, "arguments"

    def _advance(self, final: bool) -> StreamDelta:
        text, out = self._text, StreamDelta()
        while True:
            if self._state == "content":
                found = text.find(TOOL_CALLS, self._position)
                if found == -1:
                    held = 0 if final else partial_suffix(text, self._position, (TOOL_CALLS,))
                    out.content += text[self._position:len(text) - held]
                    self._position = len(text) - held
                    return out
                out.content += text[self._position:found]
                self._position, self._state = found + len(TOOL_CALLS), "open"
            elif self._state == "open":  # a list of calls, or one call as name[ARGS]{...}
                rest = text[self._position:].lstrip(" \t\r\n")
                if not rest:
                    return out
                opening = _LIST_START.match(text, self._position)
                if opening is not None:
                    self._position, self._state, self._in_list = opening.end(), "header", True
                else:
                    self._state = "name"
            elif self._state == "name":
                found = text.find(ARGS, self._position)
                if found == -1:
                    return out
                name = text[self._position:found].strip()
                self._start_call(out, name, found + len(ARGS))
            elif self._state == "header":
                status, name, value_start = match_call_header(text, self._position, ARGUMENT_KEYS)
                if status == HeaderStatus.PARTIAL:
                    return out
                if status == HeaderStatus.FAIL:
                    self._state = "done"
                    return out
                self._start_call(out, str(name), value_start)
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
                if not self._in_list:  # v11: the next call starts with its own [TOOL_CALLS]
                    found = text.find(TOOL_CALLS, self._position)
                    if found == -1:
                        return out
                    self._position, self._state = found + len(TOOL_CALLS), "name"
                    continue
                following = _NEXT_IN_LIST.match(text, self._position)
                if following is not None:
                    self._position, self._state = following.end(), "header"
                    continue
                so_far = _BETWEEN_SO_FAR.match(text, self._position)
                if not final and _LIST_END.match(text, self._position) is None and so_far is not None \
                        and so_far.end() == len(text):
                    return out
                self._state = "done"
            else:
                return out

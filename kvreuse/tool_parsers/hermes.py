"""hermes: Qwen2.5, Qwen3, Hermes and ChatML models (and the ones ``kvreuse make-model`` makes).

The model writes its reply text, then each call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>``, calls separated by a newline; Qwen2.5's template writes an assistant turn back as its
content, then ``\\n<tool_call>...`` per call. So the content is the text before the first ``<tool_call>``
less the one newline the template puts back before it, and a replayed turn renders what was generated.
Text after the first call (between or after calls) is not content: the template has nowhere to put it.
"""

from __future__ import annotations

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
    partial_suffix,
    text_without,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
# What content text may be the start of: the tag, or the newline before it (which is not content).
HELD_TAGS = ("\n" + TOOL_CALL_START, TOOL_CALL_START)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream(self)

    def _grammar(self, functions: list[dict[str, Any]], required: bool, parallel: bool) -> str:
        # In Qwen's tokenizers (and ours) the tags are added tokens, which llguidance names as tokens; a
        # tokenizer without them gets the tags as text.
        as_token = self._has_token(TOOL_CALL_START) and self._has_token(TOOL_CALL_END)
        start, end = (TOOL_CALL_START, TOOL_CALL_END) if as_token else ('"<tool_call>"', '"</tool_call>"')
        alternatives, rules = function_rules(functions, "arguments")
        lines = ["%llguidance {}"]
        if required:
            lines.append("start: calls")
        else:
            # Free text without the tag, or text ending in the newline the template writes before a call
            # (or nothing), then the calls.
            before_call = text_without([TOOL_CALL_START], ending="\n")
            lines += ["start: CONTENT | CONTENT_BEFORE_CALL? calls",
                      f"CONTENT: {text_without([TOOL_CALL_START])}",
                      f"CONTENT_BEFORE_CALL: {before_call}"]
        lines += [
            'calls: call ("\\n" call)*' if parallel else "calls: call",
            f'call: {start} "\\n{{\\"name\\": \\"" fn "}}\\n" {end}',
            f"fn: {alternatives}",
        ]
        return "\n".join(lines) + "\n" + rules


class _HermesStream(BufferedToolCallStream):
    def __init__(self, parser: HermesToolParser) -> None:
        super().__init__("content")  # content, header, arguments, seek
        self._parser = parser

    def _advance(self, final: bool) -> StreamDelta:
        text, out = self._text, StreamDelta()
        while True:
            if self._state == "content":
                found = text.find(TOOL_CALL_START, self._position)
                if found == -1:
                    # Hold back what may be the start of "\n<tool_call>": that newline is not content.
                    held = 0 if final else partial_suffix(text, self._position, HELD_TAGS)
                    out.content += text[self._position:len(text) - held]
                    self._position = len(text) - held
                    return out
                content = text[self._position:found]
                out.content += content[:-1] if content.endswith("\n") else content
                self._position, self._state = found + len(TOOL_CALL_START), "header"
            elif self._state == "header":
                status, name, value_start = match_call_header(text, self._position, ARGUMENT_KEYS)
                if status == HeaderStatus.PARTIAL:
                    return out
                if status == HeaderStatus.FAIL:
                    self._state = "seek"
                    continue
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
                self._state = "seek"
            else:  # seek the next call; whatever comes between calls is dropped
                found = text.find(TOOL_CALL_START, self._position)
                if found == -1:
                    self._position = max(self._position, len(text) - len(TOOL_CALL_START) + 1)
                    return out
                self._position, self._state = found + len(TOOL_CALL_START), "header"

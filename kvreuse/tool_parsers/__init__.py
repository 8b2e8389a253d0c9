"""Tool-call parsers by model family, with vLLM's names: ``hermes`` (Qwen2.5 / Qwen3 / ChatML
``<tool_call>{json}</tool_call>``, and the models ``kvreuse make-model`` makes), ``llama3_json``, ``mistral``
and ``harmony`` (gpt-oss: calls to ``functions.NAME`` on the commentary channel, the final channel as content). Each extracts calls from generated text (whole, or as stream deltas keyed by index) and
writes the grammar that makes the model call in its own format (``tool_choice`` required, a named
function, or ``auto`` with strict tools). `choose` picks one from the chat template or a
``--tool-call-parser`` name.

A leaf package: it imports only kvreuse.errors, kvreuse.messages and third-party code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvreuse.tool_parsers.base import (
    TEMPLATE_JSON_STYLE,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolChoice,
    ToolParser,
    random_call_id,
    resolve_tool_choice,
)
from kvreuse.tool_parsers.harmony import HarmonyToolParser
from kvreuse.tool_parsers.hermes import HermesToolParser
from kvreuse.tool_parsers.llama3_json import Llama3JsonToolParser
from kvreuse.tool_parsers.mistral import MistralToolParser

__all__ = [
    "PARSERS", "TEMPLATE_JSON_STYLE", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "StreamDelta",
    "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolChoice", "ToolParser", "choose", "random_call_id",
    "resolve_tool_choice",
]

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser)
}

# What a chat template that renders tool calls writes, per format, looked for in this order.
_TEMPLATE_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>",)),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": ')),
)


def choose(chat_template: str | None, name: str | None = None, *, added_tokens: Mapping[str, int] | None = None,
           id_factory: Callable[[], str] | None = None) -> ToolParser | None:
    """The parser named (``--tool-call-parser``; ValueError for an unknown name), else the one whose format
    the chat template writes, else None (the template renders no tool calls). ``added_tokens``: the
    tokenizer's added tokens (text -> id) so grammars name single-token tags as tokens."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
        return PARSERS[name](added_tokens, id_factory)
    if not chat_template:
        return None
    for parser_name, signs in _TEMPLATE_SIGNS:
        if any(sign in chat_template for sign in signs):
            return PARSERS[parser_name](added_tokens, id_factory)
    return None

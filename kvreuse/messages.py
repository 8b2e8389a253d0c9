"""Checking a chat conversation and its tools: roles, text parts, tool calls and tool results.

A leaf module (it imports only `kvreuse.errors`) so that both `kvreuse.inputs` (which renders and
encodes prompts) and `kvreuse.tokenizer` (whose ``apply_chat_template`` checks what it renders) can
use it without importing each other, and the tool-call parsers can check ``tools``. `kvreuse.inputs`
re-exports the names.

Tool history comes in OpenAI's shape: an assistant message with ``tool_calls`` (its content may be
null), each ``{"id", "type": "function", "function": {"name", "arguments"}}`` whose ``arguments`` is the
JSON text the model generated; then one ``role: "tool"`` message per call, its ``tool_call_id`` naming
it. The checked copy carries ``arguments`` parsed into an object (text that is not JSON, a call cut off by
``max_tokens``, stays text): chat templates write it with
``tojson`` (Qwen2.5's, Llama 3.1's, Mistral's and ours), which would quote a string a second time, and
the serialisation ``tojson`` gives back is the one the tool-call grammars make the model generate, so
a replayed turn renders the text the model produced.

Chunks (the first part of issue 39): a text part with ``"cache_control": {"type": "ephemeral", "scope": "chunk"}``
marks text that may be reused at any position of a prompt (a retrieved document). The checked copy flattens it
like any text part; `placeholder_messages` puts a placeholder in its place instead, so kvreuse.inputs can encode
the chunk's text on its own. A ``cache_control`` without a scope, or with scope ``"prefix"``, is accepted on any
text part and means what it always meant on the OpenAI side: nothing beyond automatic prefix caching.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreuse.errors import InvalidRequestError

# The roles OpenAI's chat API accepts ("developer" is its newer name for "system").
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# OpenAI's rule for function names, with dots (MCP servers name tools "server.tool"). A name is written
# into the prompt and into grammars as is, so nothing in it may need JSON escaping.
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# What a content part's cache_control may say about its scope (absent or None: "prefix").
PREFIX_SCOPE = "prefix"
CHUNK_SCOPE = "chunk"
CACHE_CONTROL_SCOPES = (PREFIX_SCOPE, CHUNK_SCOPE)


def cache_control_scope(cache_control: Any, where: str) -> str | None:
    """The scope a content part's ``cache_control`` (at ``where``) gives: None, "prefix" or "chunk". Only the
    scope is read; a chunk mark must be ephemeral, as Anthropic's cache_control is."""
    if cache_control is None:
        return None
    if not isinstance(cache_control, Mapping):
        raise InvalidRequestError(f"{where} must be an object such as {{\"type\": \"ephemeral\", \"scope\": "
                                  f"\"chunk\"}}, got {type(cache_control).__name__}", where)
    scope = cache_control.get("scope")
    if scope is not None and scope not in CACHE_CONTROL_SCOPES:
        raise InvalidRequestError(f"{where}.scope must be 'prefix' or 'chunk' (or absent), got {scope!r}",
                                  f"{where}.scope")
    if scope == CHUNK_SCOPE and cache_control.get("type") != "ephemeral":
        raise InvalidRequestError(f"{where}.type must be 'ephemeral' for a chunk, got {cache_control.get('type')!r}",
                                  f"{where}.type")
    return scope


def validate_messages(messages: Any, *, param: str = "messages") -> list[dict[str, Any]]:
    """Check a conversation and flatten OpenAI-style text parts into plain strings.

    Text parts are joined with "\\n"; any other part type (image, audio, ...) is refused, naming the
    message and part, since the engine only handles text. Roles must be one of `CHAT_ROLES`. A chunk part's
    text is flattened like any other (see `placeholder_messages`).
    """
    return _checked_messages(messages, param, _Chunks(None))


def placeholder_messages(messages: Any, placeholder: Callable[[int], str], *,
                         param: str = "messages") -> tuple[list[dict[str, Any]], list[str]]:
    """`validate_messages` with the k-th chunk part's text replaced by ``placeholder(k)``, and the chunks' texts
    in the order they were found (empty: no chunk, and the messages are exactly `validate_messages`')."""
    chunks = _Chunks(placeholder)
    return _checked_messages(messages, param, chunks), chunks.texts


@dataclass
class _Chunks:
    """The chunk parts found while flattening, and what stands in their place."""

    placeholder: Callable[[int], str] | None  # None: the chunk's own text
    texts: list[str] = field(default_factory=list)

    def stand_in(self, text: str) -> str:
        self.texts.append(text)
        return text if self.placeholder is None else self.placeholder(len(self.texts) - 1)


def _checked_messages(messages: Any, param: str, chunks: _Chunks) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError(f"{param} must be a list of message objects, got {type(messages).__name__}", param)
    if not messages:
        raise InvalidRequestError(f"{param} must contain at least 1 message, got 0", param)
    flattened: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"{param}[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content', "
                                      f"got {type(message).__name__}", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                      f"{where}.role")
        checked = {**message, "content": _content_text(message.get("content"), f"{where}.content", chunks)}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise InvalidRequestError(f"{where}.tool_calls: only assistant messages carry tool calls, "
                                          f"this one's role is {role!r}", f"{where}.tool_calls")
            calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
            if calls:
                checked["tool_calls"] = calls
            else:
                del checked["tool_calls"]
        if role == "tool":
            _check_tool_result(flattened, message, where)
        flattened.append(checked)
    return flattened


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's calls, each with its arguments parsed (see the module docstring)."""
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise InvalidRequestError(f"{where} must be a list of tool calls, got {type(calls).__name__}", where)
    checked: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        call_where = f"{where}[{index}]"
        if not isinstance(call, Mapping):
            raise InvalidRequestError(f"{call_where} must be an object, got {type(call).__name__}", call_where)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{call_where}.id must be a non-empty string", f"{call_where}.id")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{call_where}.type must be 'function', got {call.get('type')!r}",
                                      f"{call_where}.type")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{call_where}.function must be an object with name and arguments",
                                      f"{call_where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{call_where}.function.name must be a non-empty string",
                                      f"{call_where}.function.name")
        checked.append({**call, "id": call_id, "type": "function", "function": {
            **function, "name": name,
            "arguments": _parsed_arguments(function.get("arguments"), f"{call_where}.function.arguments"),
        }})
    return checked


def _parsed_arguments(arguments: Any, where: str) -> Any:
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{where} must be a JSON string, got {type(arguments).__name__}", where)
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        # Not JSON: a call that max_tokens cut off, sent back as the client got it. The agent loop goes on;
        # the text stays as it is (templates write a string argument as it is, or quote it).
        return arguments


def _check_tool_result(previous: list[dict[str, Any]], message: Mapping[str, Any], where: str) -> None:
    """A tool result answers a call of the assistant message just before it (other results of the same
    message may come between), as OpenAI requires."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}.tool_call_id must be a non-empty string naming the call it answers",
                                  f"{where}.tool_call_id")
    position = len(previous) - 1
    while position >= 0 and previous[position]["role"] == "tool":
        position -= 1
    answered = previous[position] if position >= 0 else None
    calls = answered.get("tool_calls") if answered is not None and answered["role"] == "assistant" else None
    if not calls:
        raise InvalidRequestError(f"{where}: a tool message must follow an assistant message with tool_calls",
                                  f"{where}.tool_call_id")
    if call_id not in {call["id"] for call in calls}:
        raise InvalidRequestError(f"{where}.tool_call_id {call_id!r} names no tool call of the assistant message "
                                  "before it", f"{where}.tool_call_id")


def validate_tools(tools: Any, *, param: str = "tools") -> list[dict[str, Any]]:
    """Check OpenAI-style ``tools`` (``[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]``): names unique and of OpenAI's form, ``parameters`` a valid JSON schema.
    Returns plain dicts in the order given (the order the prompt lists them in). None or [] is no tools."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"{param} must be a list of tools, got {type(tools).__name__}", param)
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"{where} must be an object, got {type(tool).__name__}", where)
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                      f"got {name!r}", f"{where}.function.name")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name {name!r} is already the name of another tool",
                                      f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string",
                                      f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict must be a bool", f"{where}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_schema(parameters, f"{where}.function.parameters")
        checked.append({**tool, "type": "function", "function": dict(function)})
    return checked


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
    import jsonschema  # imported on first use: only requests with tools pay for it

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.path)
        raise InvalidRequestError(f"{where}{path} is not a valid JSON schema: {error.message}",
                                  f"{where}{path}") from None


def _content_text(content: Any, where: str, chunks: _Chunks) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise InvalidRequestError(f"{where} must be a string, a list of text parts or null, "
                                  f"got {type(content).__name__}", where)
    texts: list[str] = []
    for part_index, part in enumerate(content):
        part_where = f"{where}[{part_index}]"
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{part_where} must be an object, got {type(part).__name__}", part_where)
        if part.get("type") != "text":
            raise InvalidRequestError(f"{part_where} has type {part.get('type')!r}; only 'text' content parts "
                                      "are supported", part_where)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{part_where}.text must be a string, got {type(text).__name__}",
                                      f"{part_where}.text")
        if cache_control_scope(part.get("cache_control"), f"{part_where}.cache_control") == CHUNK_SCOPE:
            if not text:
                raise InvalidRequestError(f"{part_where}.text: a chunk (cache_control scope 'chunk') must not be "
                                          "empty", f"{part_where}.text")
            text = chunks.stand_in(text)
        texts.append(text)
    return "\n".join(texts)

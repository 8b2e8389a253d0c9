"""The Anthropic Messages API's request and content blocks, and how they map onto kvreuse's chat path.

Request models (pydantic, extra fields refused so a 400 names them); the conversation converted to
OpenAI's shape, which the chat template renders (``tool_use`` blocks as an assistant message's
``tool_calls``, ``tool_result`` blocks as ``tool`` messages); Anthropic's rules for tool blocks; the tools and
``tool_choice`` against the server's tool-call parser (`tool_setup`); the prompt prefix each
``cache_control`` breakpoint pins (`breakpoint_prefixes`); and a reply's content blocks as its text reveals
them (`ContentBlocks`), shared by the streamed and the whole reply. The route itself is
kvreuse.server.anthropic.

Chunks (the first part of issue 39): a ``text`` or ``document`` block whose ``cache_control`` has
``"scope": "chunk"`` marks text that may be reused at any position (a retrieved document). It becomes a text part
with the same mark in the OpenAI-shaped conversation, which kvreuse.inputs encodes on its own. A chunk mark is not a
prefix breakpoint: it pins nothing, is not counted against the 4 breakpoints and adds nothing to
``cache_creation_input_tokens`` (`check_chunk_marks`, `is_breakpoint`). Without a scope, or with ``"prefix"``, a
cache_control is the breakpoint it always was.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor, common_prefix_length
from kvreuse.messages import CHUNK_SCOPE, validate_tools
from kvreuse.sampling import MAX_STOP_STRINGS, SamplingParams
from kvreuse.server.errors import APIError
from kvreuse.structured_outputs import StructuredOutputsParams
from kvreuse.tool_parsers import StreamDelta, ToolCallStream, ToolParser

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"
    # kvreuse's extension (issue 39): None or "prefix" is a prefix breakpoint; "chunk" marks a text or document
    # block as a chunk, reusable at any position, and is no breakpoint.
    scope: Literal["prefix", "chunk"] | None = None

    @property
    def is_chunk(self) -> bool:
        return self.scope == CHUNK_SCOPE


def is_breakpoint(cache_control: CacheControl | None) -> bool:
    """Whether a cache_control pins the prompt prefix that ends with its block (a chunk mark does not)."""
    return cache_control is not None and not cache_control.is_chunk


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    """A call the assistant made, in the history (and in responses)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """What a call returned, in the user message right after the call."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class DocumentSource(BaseModel):
    """A document's text (PDFs, images and URLs are not read here)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: str = Field(min_length=1)


class DocumentCitations(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: Literal[False] = False  # citations are not generated here: only "off" is accepted


class DocumentBlock(BaseModel):
    """A plain-text document in a user message; the prompt holds its title, context and text
    (`document_text`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    citations: DocumentCitations | None = None
    cache_control: CacheControl | None = None


def document_text(block: DocumentBlock) -> str:
    """A document as the prompt holds it: its title and its context, where given, each a paragraph before its
    text (a chunk mark covers all three, so the same document with the same title is the same chunk)."""
    return "\n\n".join(part for part in (block.title, block.context, block.source.data) if part)


ContentBlock = Annotated[TextBlock | DocumentBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
# How pydantic names the union's members in error locations.
_BLOCK_TAGS = ("text", "document", "tool_use", "tool_result")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    """A client tool: rendered into the prompt as an OpenAI-shaped function (input_schema as parameters)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are not served here
    strict: bool | None = None  # as OpenAI's strict: calls in auto mode follow the schema too
    cache_control: CacheControl | None = None

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    # SamplingParams' cap, checked here so the 400 names this API's field, in Anthropic's error shape.
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # Request-level cache_control (newer SDKs): a breakpoint after the last block of the last message.
    cache_control: CacheControl | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def sampling_params(self, max_tokens: int, tools: ToolSetup) -> SamplingParams:
        """How to sample the reply: this request's fields, the tool setup's constraint (None: nothing enforced).
        SamplingParams' refusals name this API's fields."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                stop=self.stop_sequences or None,
                # A format whose tags are special tokens needs them in the text to find the calls.
                skip_special_tokens=not (tools.parser is not None and tools.parser.needs_special_tokens),
                structured_outputs=tools.constraint,
            )
        except InvalidRequestError as error:
            raise InvalidRequestError(error.message, _SAMPLING_FIELDS.get(error.param, error.param),
                                      error.code) from None


# SamplingParams' names for this API's fields.
_SAMPLING_FIELDS = {"stop": "stop_sequences"}


# --- validation errors --------------------------------------------------------------------------------
def field_path(location: tuple[Any, ...]) -> str:
    """``messages[0].content[1].input`` from pydantic's location, without the names it gives union members
    (``str``, ``list[...]``, and a content block's type after its index)."""
    path = ""
    for position, part in enumerate(location):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "str" or "[" in part:
            continue
        elif (part in _BLOCK_TAGS and position + 1 < len(location) and position > 0
              and isinstance(location[position - 1], int)):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(error: ValidationError) -> APIError:
    """The 400 a client can act on, naming the field: where a field may be a string or a list of blocks, the
    string branch's complaint says nothing about a list that was sent, so a deeper one comes first."""
    errors = error.errors()
    chosen = next((item for item in errors if item["loc"][-1:] != ("str",)), errors[0])
    param = field_path(chosen["loc"]) or None
    return APIError(400, f"{param}: {chosen['msg']}" if param else chosen["msg"], param=param)


# --- the prompt, its tools and its breakpoints ------------------------------------------------------------
Block = TextBlock | DocumentBlock | ToolUseBlock | ToolResultBlock
# A chunk's mark in the OpenAI-shaped conversation kvreuse.inputs encodes.
CHUNK_MARK = {"type": "ephemeral", "scope": CHUNK_SCOPE}


def blocks_of(content: str | list[Block] | None) -> list[Block]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    return list(content)


def _text_parts(blocks: Sequence[Block]) -> list[dict[str, Any]]:
    """Text and document blocks as OpenAI text parts, a chunk's part with the chunk mark."""
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            part: dict[str, Any] = {"type": "text", "text": block.text}
        elif isinstance(block, DocumentBlock):
            part = {"type": "text", "text": document_text(block)}
        else:
            continue
        if block.cache_control is not None and block.cache_control.is_chunk:
            part["cache_control"] = dict(CHUNK_MARK)
        parts.append(part)
    return parts


def _result_text(block: ToolResultBlock) -> str:
    """A tool result as the template writes it; one marked as an error says so, since the prompt has no other
    place for that flag."""
    if block.content is None:
        text = ""
    elif isinstance(block.content, str):
        text = block.content
    else:
        text = "\n".join(part.text for part in block.content)
    return f"Error: {text}" if block.is_error else text


def openai_messages(system: list[TextBlock], messages: list[list[Block]], roles: list[str]) -> list[dict]:
    """The conversation in OpenAI's shape, which the chat template renders: an assistant message's tool_use
    blocks become its tool_calls (the input object, which the template writes as JSON), each tool_result a
    ``tool`` message, before the user's text (Anthropic puts the results first in the message)."""
    result: list[dict] = []
    if system:
        result.append({"role": "system", "content": _text_parts(system)})
    for role, blocks in zip(roles, messages):
        if role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": _text_parts(blocks)}
            calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
                     for block in blocks if isinstance(block, ToolUseBlock)]
            if calls:
                message["tool_calls"] = calls
            result.append(message)
            continue
        results = [block for block in blocks if isinstance(block, ToolResultBlock)]
        result += [{"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
                   for block in results]
        texts = _text_parts(blocks)
        if texts or not results:
            result.append({"role": "user", "content": texts})
    return result


def check_tool_history(messages: list[AnthropicMessage]) -> None:
    """Anthropic's rules for tool blocks, checked before the conversation is converted (so a 400 names the
    block the client sent): tool_use in assistant messages, tool_result in user messages before any text,
    each answering a tool_use of the assistant message just before."""
    for index, message in enumerate(messages):
        blocks = blocks_of(message.content)
        before = messages[index - 1] if index > 0 else None
        previous = blocks_of(before.content) if before is not None and before.role == "assistant" else []
        called = {block.id for block in previous if isinstance(block, ToolUseBlock)}
        seen_text = False
        for block_index, block in enumerate(blocks):
            where = f"messages[{index}].content[{block_index}]"
            if isinstance(block, DocumentBlock) and message.role != "user":
                raise APIError(400, f"{where}.type: document blocks belong to user messages", param=f"{where}.type")
            if isinstance(block, (TextBlock, DocumentBlock)):
                seen_text = True
            elif isinstance(block, ToolUseBlock) and message.role != "assistant":
                raise APIError(400, f"{where}.type: tool_use blocks belong to assistant messages", param=f"{where}.type")
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise APIError(400, f"{where}.type: tool_result blocks belong to user messages",
                                   param=f"{where}.type")
                if seen_text:
                    raise APIError(400, f"{where}: tool_result blocks come before any text in a user message",
                                   param=where)
                if block.tool_use_id not in called:
                    raise APIError(400, f"{where}.tool_use_id: {block.tool_use_id!r} names no tool_use block of "
                                        "the assistant message just before", param=f"{where}.tool_use_id")


def check_chunk_marks(body: MessagesRequest) -> None:
    """A chunk mark (cache_control scope "chunk") only on a non-empty text or document block of the system prompt
    or a message: a tool, a tool call, a tool result or the request itself is no text to reuse elsewhere, so a chunk
    mark there is a 400 naming it rather than a mark silently read as something else."""
    def refuse(where: str, what: str) -> APIError:
        return APIError(400, f"{where}.cache_control.scope: 'chunk' marks a text or document block; {what} cannot "
                             "be a chunk", param=f"{where}.cache_control.scope")

    if body.cache_control is not None and body.cache_control.is_chunk:
        raise APIError(400, "cache_control.scope: the request-level cache_control is a prefix breakpoint; mark "
                            "chunks on their text or document blocks", param="cache_control.scope")
    for index, tool in enumerate(body.tools or []):
        if tool.cache_control is not None and tool.cache_control.is_chunk:
            raise refuse(f"tools[{index}]", "a tool")
    located = [(f"system[{index}]", block) for index, block in enumerate(blocks_of(body.system))]
    located += [(f"messages[{index}].content[{block_index}]", block) for index, message in enumerate(body.messages)
                for block_index, block in enumerate(blocks_of(message.content))]
    for where, block in located:
        if isinstance(block, ToolResultBlock):
            inner = block.content if isinstance(block.content, list) else []
            for inner_index, part in enumerate(inner):
                if part.cache_control is not None and part.cache_control.is_chunk:
                    raise refuse(f"{where}.content[{inner_index}]", "a tool result's text")
        if block.cache_control is None or not block.cache_control.is_chunk:
            continue
        if isinstance(block, (ToolUseBlock, ToolResultBlock)):
            raise refuse(where, f"a {block.type} block")
        if isinstance(block, TextBlock) and not block.text:
            raise APIError(400, f"{where}.text: a chunk must not be empty", param=f"{where}.text")


def _tools_error(error: InvalidRequestError) -> APIError:
    """A tool checked in OpenAI's shape (kvreuse.messages), named as the client sent it."""
    def named(text: str) -> str:
        return text.replace(".function.parameters", ".input_schema").replace(".function.", ".")

    param = named(error.param or "tools")
    message = named(error.message)
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolSetup:
    """How a request's tools are served: ``tools`` (OpenAI's shape) go to the chat template; ``parser`` reads
    calls out of the text (None: the text is all text, as with tool_choice none); ``constraint`` enforces
    ``any`` or a named tool (None: nothing enforced)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None


def tool_setup(body: MessagesRequest, parser: ToolParser | None) -> ToolSetup:
    """The request's ``tools`` and ``tool_choice`` against the server's tool-call parser; what cannot be
    served is a 400 naming the field."""
    try:
        tools = validate_tools([tool.as_openai() for tool in body.tools or []])
    except InvalidRequestError as error:
        raise _tools_error(error) from None
    choice = body.tool_choice or ToolChoice(type="auto")
    names = [tool["function"]["name"] for tool in tools]
    if choice.type == "tool":
        if choice.name not in names:
            raise APIError(400, f"tool_choice.name: {choice.name!r} is not one of the tools "
                                f"({', '.join(names) or 'none given'})", param="tool_choice.name")
    elif choice.name is not None:
        raise APIError(400, f"tool_choice.name: only a tool_choice of type 'tool' names a tool, this one is "
                            f"{choice.type!r}", param="tool_choice.name")
    if choice.type == "any" and not tools:
        raise APIError(400, "tool_choice: 'any' needs at least one tool in tools", param="tool_choice")
    if not tools or choice.type == "none":
        # The tools stay in the prompt; no call is read out of the text, but a format that frames every reply
        # (harmony's channels) still is, for its content.
        return ToolSetup(tools, parser if parser is not None and parser.parses_every_reply else None)
    if parser is None:
        raise APIError(400, "tools: this model's chat template writes no tool-call format this server knows "
                            "(hermes, llama3_json, mistral, harmony): start the server with --tool-call-parser NAME, or send "
                            "tool_choice none", param="tools")
    openai_choice: Any = {"auto": "auto", "any": "required",
                          "tool": {"type": "function", "function": {"name": choice.name}}}[choice.type]
    try:
        constraint = parser.structured_outputs(tools, openai_choice, not choice.disable_parallel_tool_use)
    except InvalidRequestError as error:
        raise _tools_error(error) from None
    return ToolSetup(tools, parser, constraint)


def breakpoint_prefixes(inputs: InputProcessor, body: MessagesRequest, prompt_ids: list[int],
                        tools: list[dict[str, Any]] | None = None, memory_scope: str = "") -> list[tuple[int, float]]:
    """(prefix length in tokens, ttl seconds) for each cache_control breakpoint, in prompt order (a chunk mark is
    none: `is_breakpoint`).

    The prefix of a breakpoint is the conversation rendered up to and including its block; its
    length is where those tokens stop agreeing with the full prompt's (robust to any template). A
    breakpoint on tool k renders the system prompt with the tools up to k (the template lists them in
    the system turn); every other breakpoint renders all the tools, as the full prompt has them.
    """
    system = blocks_of(body.system)
    messages = [blocks_of(message.content) for message in body.messages]
    roles = [message.role for message in body.messages]
    tools = tools or []
    marked: list[tuple[int, int, float]] = []  # (message index; -1 = system, -2 = tools, block index, ttl)
    for tool_index, tool in enumerate(body.tools or []):
        if is_breakpoint(tool.cache_control):
            marked.append((-2, tool_index, TTL_SECONDS[tool.cache_control.ttl]))
    for block_index, block in enumerate(system):
        if is_breakpoint(block.cache_control):
            marked.append((-1, block_index, TTL_SECONDS[block.cache_control.ttl]))
    for message_index, blocks in enumerate(messages):
        for block_index, block in enumerate(blocks):
            if is_breakpoint(block.cache_control):
                marked.append((message_index, block_index, TTL_SECONDS[block.cache_control.ttl]))
    if is_breakpoint(body.cache_control) and messages and messages[-1]:
        marked.append((len(messages) - 1, len(messages[-1]) - 1, TTL_SECONDS[body.cache_control.ttl]))
    if len(marked) > MAX_BREAKPOINTS:
        raise APIError(400, f"at most {MAX_BREAKPOINTS} blocks may have a cache_control breakpoint (chunk marks "
                            f"do not count), got {len(marked)}", param="cache_control")
    def agreed(partial: list[dict], listed: list[dict[str, Any]]) -> int:
        ids = inputs.from_messages(partial, add_generation_prompt=False, tools=listed or None, validate=False,
                                   memory_scope=memory_scope).token_ids
        return common_prefix_length(ids, prompt_ids)

    prefixes = []
    for message_index, block_index, ttl in marked:
        if message_index == -2:
            listed = tools[: block_index + 1]
            if system:
                length = agreed(openai_messages(system, [], []), listed)
            else:  # no system prompt to end on: what two different first messages leave in common
                length = min(agreed([{"role": "user", "content": probe}], listed) for probe in ("a", "b"))
        elif message_index == -1:
            length = agreed(openai_messages(system[: block_index + 1], [], []), tools)
        else:
            upto = messages[:message_index] + [messages[message_index][: block_index + 1]]
            length = agreed(openai_messages(system, upto, roles[: message_index + 1]), tools)
        prefixes.append((length, ttl))
    return prefixes


# --- the reply's content blocks --------------------------------------------------------------------------
def tool_use_id() -> str:
    """Anthropic's shape of a tool_use id."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input_object(arguments: str) -> dict[str, Any]:
    """A call's input: its argument text as an object (a call max_tokens cut, or a malformed one generated
    without a grammar, has none: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class ContentBlocks:
    """A reply's content blocks in the order its text reveals them: text, then one tool_use block per call, each
    opened, extended and closed as Anthropic's stream events say. The non-streamed reply is built by the same
    steps over the whole text, so a stream's events always add up to it (its input_json_delta pieces are the
    argument text exactly as generated, whose JSON is the block's input)."""

    calls: ToolCallStream | None  # the parser's extractor for this reply (None: all text is text)
    blocks: list[dict[str, Any]] = field(default_factory=list)  # text: "text"; tool_use: "id", "name", "arguments"
    is_open: bool = False
    _call_blocks: dict[int, int] = field(default_factory=dict)  # the parser's call index -> block index

    @property
    def made_calls(self) -> bool:
        return bool(self._call_blocks)

    def feed(self, text: str, finished: bool) -> list[tuple[str, dict[str, Any]]]:
        """Events (name, data) for more generated text; ``finished``: the reply ended, close what is open."""
        if self.calls is None:
            delta = StreamDelta(content=text)
        else:
            delta = self.calls.feed(text)
            if finished:
                rest = self.calls.finish()
                delta.content += rest.content
                delta.tool_calls += rest.tool_calls
        events: list[tuple[str, dict[str, Any]]] = []
        if delta.content:
            if not (self.is_open and self.blocks[-1]["type"] == "text"):
                events += self._open({"type": "text", "text": ""}, {"type": "text", "text": ""})
            self.blocks[-1]["text"] += delta.content
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            if call.index not in self._call_blocks:
                block = {"type": "tool_use", "id": tool_use_id(), "name": call.name or "", "arguments": ""}
                events += self._open(block, {"type": "tool_use", "id": block["id"], "name": block["name"],
                                             "input": {}})
                self._call_blocks[call.index] = len(self.blocks) - 1
            if call.arguments:
                self.blocks[self._call_blocks[call.index]]["arguments"] += call.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if finished:
            if not self.blocks:  # an empty reply is one empty text block, as Anthropic sends it
                events += self._open({"type": "text", "text": ""}, {"type": "text", "text": ""})
            events += self._close()
        return events

    def content(self) -> list[dict[str, Any]]:
        """The blocks as a Messages response holds them."""
        return [{"type": "text", "text": block["text"]} if block["type"] == "text" else
                {"type": "tool_use", "id": block["id"], "name": block["name"],
                 "input": _input_object(block["arguments"])}
                for block in self.blocks]

    def _open(self, block: dict[str, Any], shown: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.blocks.append(block)
        self.is_open = True
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": shown})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.is_open:
            return []
        self.is_open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

"""OpenAI request models (pydantic) and the response / stream-chunk bodies.

Requests are validated strictly and with ``extra="forbid"``: a parameter this server cannot honour
is a 400 that names it, never silently ignored. Fields OpenAI defines but the engine cannot honour
(a non-empty logit_bias, store, ...) are declared so that their *neutral* values (null, [], {}) pass
and anything else gets a 400 naming the field; vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, ...) are honoured. Structured outputs come as OpenAI's
``response_format`` (json_object, json_schema) or vLLM's ``structured_outputs`` (json, regex, choice,
grammar, ...), on both completion endpoints. Chat takes ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (`ChatCompletionRequest.tool_setup`): the tools are rendered into the prompt by the
chat template whatever ``tool_choice`` says, and ``tool_choice`` acts on the logits only, through the tool-call
parser's grammar.

Responses are plain dicts serialised once with compact separators, the byte format OpenAI streams.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvreuse.errors import InvalidRequestError
from kvreuse.messages import validate_tools
from kvreuse.sampling import SamplingParams, TokenLogprobs
from kvreuse.server.errors import APIError, bad_request
from kvreuse.spec.stats import acceptance_rate, mean_acceptance_length
from kvreuse.structured_outputs import CONSTRAINTS, StructuredOutputsParams
from kvreuse.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolParser,
    resolve_tool_choice,
)

if TYPE_CHECKING:
    from kvreuse.tokenizer import Tokenizer

# Most samples per request: each is a sequence in the engine, so this bounds what one request costs.
MAX_N = 128
# Most prompts in one /v1/completions request.
MAX_PROMPTS_PER_REQUEST = 1024
MAX_CACHE_SALT_CHARS = 256
# vLLM's structured_outputs fields (its StructuredOutputsParams without our error-location field).
STRUCTURED_OUTPUT_FIELDS = (*CONSTRAINTS, "disable_any_whitespace", "disable_additional_properties",
                            "whitespace_pattern")
# JSON has no -inf; a token the model rules out gets this logprob (as vLLM reports it).
MIN_REPORTED_LOGPROB = -9999.0


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_StrictModel):
    include_usage: bool | None = None


class _SamplingRequest(_StrictModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None  # accepted only equal to n (benchmark clients send best_of=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {json | regex | choice | grammar | ...: ...}
    # vLLM's: the prompt's and each choice's token ids beside the text (a client that sends the next turn as
    # tokens, as RL and agent loops do, reuses the answer exactly: its text may re-tokenize otherwise).
    return_token_ids: bool | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        """400s for values this server cannot honour (pydantic has checked the types)."""
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) here: sampling best_of candidates and "
                              f"returning the best is not supported, got best_of={self.best_of}", "best_of")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported (only an empty object is accepted)", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise bad_request(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, "
                              f"got {len(self.cache_salt)} characters", "cache_salt")

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, each error naming the request's own field."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_OUTPUT_FIELDS))
            if unknown:
                raise bad_request(f"structured_outputs has unknown field(s) {', '.join(unknown)}; the fields are "
                                  f"{', '.join(STRUCTURED_OUTPUT_FIELDS)}", f"structured_outputs.{unknown[0]}")
            kinds = [name for name in CONSTRAINTS if self.structured_outputs.get(name) not in (None, False)]
            return StructuredOutputsParams(**self.structured_outputs,
                                           field=f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else None)
        response_format = self.response_format
        if response_format is None or response_format.get("type") == "text":
            return None
        kind = response_format.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True, field="response_format")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
                raise bad_request("response_format.json_schema must be an object with a name",
                                  "response_format.json_schema.name")
            schema = spec.get("schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format.json_schema.schema")
            return StructuredOutputsParams(json=schema, field="response_format.json_schema.schema")
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format.type")

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, renames: dict[str, str],
                        tools: ToolSetup | None = None) -> SamplingParams:
        """SamplingParams from the request; a bad value becomes a 400 naming the request field. ``tools``: the
        chat request's tool setup, whose grammar (if any) is the constraint and whose parser may need the
        special tokens kept in the text."""
        constraint = tools.constraint if tools is not None and tools.constraint is not None else self.constraint()
        keep_special = tools is not None and tools.parser is not None and tools.parser.needs_special_tokens
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens and not keep_special,
                structured_outputs=constraint,
            )
        except InvalidRequestError as error:
            # The request may name a field differently from SamplingParams (chat's top_logprobs).
            param = renames.get(error.param, error.param) if error.param else None
            raise bad_request(error.message, param, error.code) from None


@dataclass(frozen=True)
class ToolSetup:
    """How a chat request's tools are served: ``parser`` reads the calls out of each choice's text (None: no
    call can be made, the text is content), ``constraint`` is the grammar that enforces ``tool_choice`` (None:
    nothing enforced, e.g. ``auto`` without a strict tool)."""

    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None


NO_TOOLS = ToolSetup()


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Explicit caching: pin the KV of the system prompt (as formatted by the chat template).
    save_system_prompt_kv_cache: bool = False
    tools: list[Any] | None = None  # checked by kvreuse.messages.validate_tools (errors name tools[i]...)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields accepted only with their neutral value (see check()).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.functions:
            raise bad_request("functions (OpenAI's deprecated form) are not supported: send tools", "functions")
        if self.function_call not in (None, "none"):
            raise bad_request("function_call (OpenAI's deprecated form) is not supported: send tool_choice",
                              "function_call")
        if self.store:
            raise bad_request("store is not supported: this server keeps no completions", "store")
        if self.metadata:
            raise bad_request("metadata is only meaningful with store, which is not supported", "metadata")
        if self.service_tier not in (None, "auto", "default"):
            raise bad_request("service_tier is not supported (only 'auto' or 'default')", "service_tier")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    def tool_setup(self, parser: ToolParser | None) -> ToolSetup:
        """The request's ``tools`` and ``tool_choice`` against the server's tool-call parser (None: the chat
        template has no tool-call format we know). A choice that cannot be met, a parser missing, or a forced
        call beside a ``response_format`` is an InvalidRequestError / 400 naming the field."""
        tools = validate_tools(self.tools)
        # A format that frames every reply (harmony's channels) is read out of the text whatever the tools.
        no_tools = ToolSetup(parser) if parser is not None and parser.parses_every_reply else NO_TOOLS
        if not tools and self.tool_choice in (None, "auto", "none"):
            return no_tools
        choice = resolve_tool_choice(self.tool_choice, tools)  # required / a name without tools: refused here
        if choice.mode == "none":
            return no_tools  # the tools stay in the prompt; no call is read out of the text
        if parser is None:
            raise bad_request("this model's chat template writes no tool-call format this server knows "
                              "(hermes, llama3_json, mistral, harmony): start the server with --tool-call-parser NAME "
                              "to serve tools, or send tool_choice 'none'", "tools")
        constraint = parser.structured_outputs(tools, self.tool_choice, self.parallel_tool_calls)
        formatted = self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.get("type") != "text")
        if formatted:
            field_name = "structured_outputs" if self.structured_outputs is not None else "response_format"
            if constraint is not None:
                raise bad_request(f"{field_name} cannot be combined with a tool_choice that forces a call "
                                  "('required', a named function) or with strict tools: both constrain the same "
                                  "output", field_name)
            # The output is held to the format, so it can hold no call: its text is the content.
            return NO_TOOLS
        return ToolSetup(parser, constraint)

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens, the field that set it): max_completion_tokens wins over the older max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: Any  # string, list of strings, token ids, or list of token-id lists (checked in prompts())
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts: strings and token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list "
                              "of token-id lists, and not empty", "prompt")
        if all(_is_token(item) for item in prompt):
            return [list(prompt)]
        if all(isinstance(item, str) for item in prompt):
            prompts: list[str | list[int]] = list(prompt)
        elif all(isinstance(item, list) and item and all(_is_token(t) for t in item) for item in prompt):
            prompts = [list(item) for item in prompt]
        else:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list "
                              "of non-empty token-id lists, not a mixture", "prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(f"prompt holds {len(prompts)} prompts, more than the {MAX_PROMPTS_PER_REQUEST} "
                              "one request may carry", "prompt")
        return prompts


class TokenizeRequest(_StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # with messages: rendered by the chat template, as in a chat request
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_StrictModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_StrictModel):
    lora_name: str = Field(min_length=1)


RequestModelT = TypeVar("RequestModelT", bound=BaseModel)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(model_class: type[RequestModelT], body: bytes) -> RequestModelT:
    """Validate a JSON body; malformed JSON and bad fields become a 400 naming the field."""
    if not body.strip():
        raise bad_request("the request body is empty: send a JSON object", None)
    try:
        return model_class.model_validate_json(body)
    except ValidationError as error:
        raise validation_api_error(error.errors(include_url=False)) from None


def validation_api_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 naming the field of pydantic's first error (``errors``: a ValidationError's ``errors()``, or
    FastAPI's for a route's typed parameters, each ``loc`` counted from the top of the request)."""
    first = errors[0]
    kind = first["type"]
    location = [str(part) for part in first["loc"]]
    param = ".".join(location) or None
    if kind == "json_invalid":
        return bad_request(f"malformed JSON body: {first['msg']}", None, code="invalid_json")
    if not location and kind in ("model_type", "model_attributes_type"):
        return bad_request("the request body must be a JSON object", None)
    if kind == "extra_forbidden":
        return bad_request(f"unsupported parameter {param!r}: this server cannot honour it", param,
                           code="unsupported_parameter")
    if kind == "missing":
        return bad_request(f"missing required parameter {param!r}", param)
    # A union reports one error per member; the location then ends in the member's type name.
    return bad_request(f"invalid value for {param!r}: {first['msg']}", location[0] if location else None)


# --- responses --------------------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse_event(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A call in a chat message: ``arguments`` is the text the model generated, character for character (sent
    back in the next turn, it renders to the same tokens)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """A call's piece in a stream chunk, keyed by ``index``: the first piece has the id, type and name (and
    the arguments so far, maybe ""), later ones only argument text."""
    if delta.id is not None or delta.name is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


# kvreuse's extension of usage.prompt_tokens_details (only with KV tiers): cached_tokens split by tier.
CACHED_BY_TIER_FIELD = "kvreuse_cached_tokens_by_tier"
# Chunk reuse (issue 39): cached tokens moved in from other positions, and of them the ones recomputed.
MOVED_FIELD = "kvreuse_moved_tokens"
RECOMPUTED_FIELD = "kvreuse_recomputed_tokens"
# Speculative decoding (issue 65), in usage.completion_tokens_details where the request's tokens were drafted.
DRAFTS_FIELD = "kvreuse_drafts"


def drafts_usage(num_drafts: int, num_draft_tokens: int, num_accepted: int) -> dict[str, Any]:
    """How the drafts of a request fared: verifications, drafted and accepted tokens, the acceptance rate and the
    mean accepted length (tokens a verification step yielded: 1 + accepted per draft, vLLM's definition)."""
    return {"drafts": num_drafts, "draft_tokens": num_draft_tokens, "accepted_tokens": num_accepted,
            "acceptance_rate": round(acceptance_rate(num_accepted, num_draft_tokens), 4),
            "mean_accepted_length": round(mean_acceptance_length(num_accepted, num_drafts), 4)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          cached_by_tier: dict[str, int] | None = None, moved: tuple[int, int] = (0, 0),
          drafts: tuple[int, int, int] = (0, 0, 0)) -> dict[str, Any]:
    """OpenAI's usage object; with KV tiers, ``prompt_tokens_details`` also splits ``cached_tokens`` by
    the tier the tokens came from (``{"device": .., "host": .., "disk": .., "remote": ..}``, the tiers
    the server has; they add up to ``cached_tokens``). ``moved``: (moved, recomputed) tokens of chunk reuse;
    where any moved, ``cached_tokens`` includes them and two kvreuse fields say how many, and how many of
    them were recomputed to blend them in. ``drafts``: (verifications, drafted, accepted) tokens of speculative
    decoding; where any were drafted, ``completion_tokens_details`` holds ``drafts_usage`` under a kvreuse field."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if cached_by_tier is not None:
        details[CACHED_BY_TIER_FIELD] = cached_by_tier
    if moved[0]:
        details[MOVED_FIELD], details[RECOMPUTED_FIELD] = moved
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }
    if drafts[1]:
        body["completion_tokens_details"] = {DRAFTS_FIELD: drafts_usage(*drafts)}
    return body


def sum_cached_by_tier(splits: Iterable[dict[str, int] | None]) -> dict[str, int] | None:
    """The per-tier cached tokens of several outputs added up (None when the server has no tiers)."""
    total: dict[str, int] | None = None
    for split in splits:
        if split is None:
            continue
        total = total if total is not None else {}
        for tier, tokens in split.items():
            total[tier] = total.get(tier, 0) + tokens
    return total


def remote_url_digest(url: str) -> str:
    """BLAKE2b (32 hex digits) of a remote tier URL without its password: servers on the same Redis
    database show the same digest, and the card never carries the URL or anything of its password."""
    from kvreuse.engine_args import redact_url

    return hashlib.blake2b(redact_url(url, mask="").encode(), digest_size=16).hexdigest()


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_REPORTED_LOGPROB


class TokenTexts:
    """Text of single token ids for logprobs, decoded once per id (a bounded cache)."""

    MAX_ENTRIES = 1 << 16

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer  # the event loop's own tokenizer object
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) >= self.MAX_ENTRIES:
                self._texts.clear()
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def chat_logprobs(entries: Sequence[TokenLogprobs | None], texts: TokenTexts, num_top: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    content = []
    for entry in entries:
        if entry is None:
            continue
        token = texts(entry.token_id)
        top = []
        for token_id, logprob in entry.top_logprobs[:num_top]:
            top_text = texts(token_id)
            top.append({"token": top_text, "logprob": _finite(logprob), "bytes": list(top_text.encode("utf-8"))})
        content.append({"token": token, "logprob": _finite(entry.logprob), "bytes": list(token.encode("utf-8")),
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None], texts: TokenTexts, text_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset) and the
    text offset after the last token, for the next stream chunk."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for entry in entries:
        if entry is None:
            continue
        token = texts(entry.token_id)
        tokens.append(token)
        token_logprobs.append(_finite(entry.logprob))
        top_logprobs.append({texts(token_id): _finite(logprob) for token_id, logprob in entry.top_logprobs})
        offsets.append(text_offset)
        text_offset += len(token)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


def model_card(model_id: str, root: str, created: int, max_model_len: int, kv_cache_blocks: int,
               kv_block_size: int) -> dict[str, Any]:
    """A /v1/models entry with the ``root`` and ``max_model_len`` fields vLLM clients read, plus the KV
    pool's size (blocks of ``kv_block_size`` tokens) that ``kvreuse route`` bounds its index with."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvreuse", "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": [],
            "kv_cache_blocks": kv_cache_blocks, "kv_block_size": kv_block_size}

"""What every route of one server shares: `ServerState`, its `ServerConfig` and the `ServedAdapter`s.

`ServerState` holds the AsyncEngine (whose event-loop tokenizer and input processor the handlers
use), auth, the served LoRA adapters and the drain / in-flight bookkeeping, plus the checks every
route applies (admission, model names, prompts, ``max_tokens``), and the tool-call parser the chat routes
read calls with (`ServerState.tool_parser`: ``--tool-call-parser``, else chosen from the chat template). It sits below the route modules and
`server/app.py`: the routes import it, app.py imports the routes, and nothing here imports either.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import PromptInput
from kvreuse.lora.request import LoRARequest
from kvreuse.observatory.scope import ALL, Scope
from kvreuse.server.async_engine import AsyncEngine
from kvreuse.server.auth import ApiKeyAuth, Tenant
from kvreuse.server.errors import bad_request, model_not_found, unavailable
from kvreuse.server.protocol import TokenTexts
from kvreuse.structured_outputs import StructuredOutputsParams
from kvreuse.tool_parsers import ToolParser, choose

__all__ = ["ChatInputs", "ServedAdapter", "ServerConfig", "ServerState"]


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter clients select with ``"model": name``; ``digest`` is its identity in the cache."""

    lora_request: LoRARequest
    digest: str

    def model_card(self, parent: str, created: int) -> dict[str, Any]:
        return {"id": self.lora_request.lora_name, "object": "model", "created": created, "owned_by": "kvreuse",
                "root": self.lora_request.lora_path, "parent": parent, "permission": [],
                "adapter_digest": self.digest}


@dataclass(frozen=True)
class ChatInputs:
    """A chat request's conversation as the engine takes it (`ServerState.chat_inputs`): the prompt (its ids,
    with the chunks' spans where parts are marked as chunks) and the output budget it leaves."""

    prompt: PromptInput
    token_ids: list[int]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ServerConfig:
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    isolate_tenants: bool = False
    # Requests waiting for the engine beyond this get a 503 instead of an ever longer queue.
    max_waiting_requests: int = 1024
    model_root: str | None = None  # the "root" of the /v1/models entry (default: the model name)
    lora_dirs: tuple[str, ...] = ()  # the only folders POST /v1/load_lora_adapter may read adapters from
    tool_call_parser: str | None = None  # --tool-call-parser (vLLM's names); None: chosen from the chat template

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {self.max_waiting_requests}")


class ServerState:
    """What the routes share: the engine, the tokenizer, auth, and the drain / in-flight bookkeeping.
    Only touched on the event loop thread (the engine thread sees the AsyncEngine alone)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.llm_engine = engine.engine  # read-only use here: tokenizer, limits, prompt validation
        self.tokenizer = engine.tokenizer  # the event loop's own tokenizer object (the engine thread has another)
        self.model_name = engine.model_name
        self.max_model_len = self.llm_engine.max_model_len
        self.vocab_size = self.llm_engine.model_config.vocab_size
        self.auth = ApiKeyAuth(config.api_keys, config.isolate_tenants, config.admin_keys)
        self.token_texts = TokenTexts(self.tokenizer)
        # How this model writes tool calls (ValueError naming the choices for an unknown name); None: the chat
        # template writes no format we know, and requests that need calls get a 400.
        self.tool_parser: ToolParser | None = choose(self.tokenizer.chat_template, config.tool_call_parser,
                                                     added_tokens=self.tokenizer.added_tokens)
        self.created = int(time.time())
        self.adapters: dict[str, ServedAdapter] = {}  # served adapter names (--lora-modules, load route)
        self.draining = False
        self.num_in_flight = 0  # generation requests admitted and not yet answered in full

    # --- admission ----------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and accepts no new requests", code="draining")
        if not self.engine.is_running:
            raise unavailable("the engine is not running", code="engine_unavailable")

    def admit(self) -> _Admission:
        """Count a generation request in flight, or refuse it with a 503 (draining, overloaded)."""
        self.check_accepting()
        waiting = self.engine.stats.num_waiting + self.engine.num_pending_commands
        if waiting >= self.config.max_waiting_requests:
            raise unavailable(
                f"the server is overloaded: {waiting} requests are waiting for the engine "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later", code="overloaded"
            )
        self.num_in_flight += 1
        return _Admission(self)

    # --- validation helpers -------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Tenant | None:
        return self.auth.authenticate(request.headers.get("authorization"))

    def require_admin(self, request: Request, action: str) -> Tenant | None:
        """The caller of a route that acts on every tenant (reset, KV events, adapters): a 401 without
        a valid key, a 403 naming ``action`` for a tenant key; open when no keys are configured."""
        tenant = self.authenticate(request)
        self.auth.require_admin(tenant, action)
        return tenant

    def pin_owner_filter(self, tenant: Tenant | None) -> str | None:
        """Whose pins this caller may see and delete: None for all (an admin, or tenants not isolated)."""
        if tenant is not None and tenant.is_admin:
            return None
        return self.owner_of(tenant)

    def request_owner(self, tenant: Tenant | None) -> str | None:
        """Who a generation request belongs to, for the observatory's tenant rule: the caller's tenant
        id whenever keys are configured (isolated or not), None without keys."""
        return tenant.tenant_id if tenant is not None else None

    def scope_of(self, tenant: Tenant | None) -> Scope:
        """What this caller may see of the cache (drift report, cache tree, hit counters): everything
        without keys or with an admin key; a tenant key, only namespaces every request of which was its
        own (kvreuse.observatory.scope)."""
        if tenant is None:
            return ALL
        return Scope(tenant.tenant_id, sees_all=tenant.is_admin)

    def owner_of(self, tenant: Tenant | None) -> str | None:
        """Who owns pins made by this caller (only when tenants are isolated)."""
        return tenant.tenant_id if tenant is not None and self.auth.isolate_tenants else None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters:
            raise model_not_found(model)

    def lora_of(self, model: str | None) -> ServedAdapter | None:
        """The adapter a request's ``model`` names (vLLM's convention), None for the base model;
        a 404 for a name that is neither."""
        self.check_model(model)
        return self.adapters.get(model) if model is not None else None

    def checked_prompt(self, prompt: str | list[int], param: str) -> tuple[PromptInput, int]:
        """(the prompt for the engine, its token count); a bad prompt is a 400 naming ``param``."""
        try:
            tokenized = self.engine.inputs.from_prompt(prompt, param=param)
        except InvalidRequestError as error:
            raise bad_request(error.message, param, error.code) from None
        return tokenized.as_engine_prompt(), len(tokenized.token_ids)

    def chat_inputs(self, messages: Any, *, tools: list[Any] | None, cache_salt: str | None,
                    requested_max_tokens: tuple[int | None, str], add_generation_prompt: bool = True) -> ChatInputs:
        """A conversation in OpenAI's shape (both chat APIs hand theirs over so) as engine inputs, checked: a bad
        message or tool is a 400 naming it, and so is a ``requested_max_tokens`` (value, field) the context has
        no room for. The tools are in the prompt whatever tool_choice says (constraints act on the logits only).
        Replayed turns are encoded with the ids generated under the same cache salt (the tenant's), never
        another's. Text parts marked as chunks are encoded on their own; their spans go to the engine in the
        prompt dict."""
        tokenized = self.engine.inputs.from_messages(messages, add_generation_prompt=add_generation_prompt,
                                                     tools=tools, memory_scope=cache_salt or "")
        max_tokens = self.max_tokens(requested_max_tokens, len(tokenized.token_ids))
        return ChatInputs(tokenized.as_engine_prompt(), tokenized.token_ids, max_tokens)

    async def check_constraint(self, constraint: StructuredOutputsParams | None) -> None:
        """Compile a structured-output constraint before the request is queued (on the engine's grammar
        thread, awaited: the loop goes on serving); a refused one is a 400 naming the request's field. The
        compiled grammar is cached, so the engine finds it ready."""
        if constraint is None:
            return
        try:
            await asyncio.wrap_future(self.llm_engine.structured.compiler.submit(constraint))
        except InvalidRequestError as error:
            raise bad_request(error.message, error.param, error.code) from None

    def check_stop_token_ids(self, stop_token_ids: list[int] | None) -> None:
        # An id beyond the vocabulary would fail inside the sampler, in the middle of a batch.
        for position, token_id in enumerate(stop_token_ids or []):
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(f"stop_token_ids[{position}] = {token_id} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "stop_token_ids")

    def max_tokens(self, requested: tuple[int | None, str], num_prompt_tokens: int) -> int:
        """The output budget: what the client asked for, or all the room the context leaves."""
        value, field_name = requested
        room = self.max_model_len - num_prompt_tokens
        if value is None:
            return room
        if value < 1:
            raise bad_request(f"{field_name} must be at least 1, got {value}", field_name)
        if value > room:
            raise bad_request(
                f"{field_name}={value} is too large: the prompt has {num_prompt_tokens} tokens and "
                f"max_model_len is {self.max_model_len}, so at most {room} tokens can be generated",
                field_name, code="context_length_exceeded",
            )
        return value


class _Admission:
    """One in-flight request; `release` is idempotent so every exit path may call it."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state.num_in_flight -= 1

"""A request body as the routing policy sees it: its prompt's token ids and the block keys they make.

Shared by ``kvreuse route`` (kvreuse/router/app.py) and the Ray Serve request router (kvreuse/ray): both
read the prompt as the servers do (their chat template and tokenizer, the tools in the prompt) and key
its blocks in each backend's cache namespace (tenant salt, model, adapter digest, speculative draft), so
the keys are the ones the engines compute and publish in their KV events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvreuse.inputs import InputProcessor, validate_messages
from kvreuse.router.policy import RouteRequest, prompt_block_keys
from kvreuse.server.auth import bearer_key, isolated_cache_salt, tenant_id_of

# Without a tokenizer the router hashes characters: this many per "token", a rough average for BPE.
CHARS_PER_TOKEN = 4


class Namespace(NamedTuple):
    """What a backend keys a request's KV blocks under, besides the tenant's cache salt."""

    model: str | None
    adapter: str | None  # the LoRA adapter's digest
    draft: str | None  # the speculative draft's digest


class Prompt(NamedTuple):
    """A request's (first) prompt: token ids from the servers' tokenizer, or its text without one."""

    token_ids: tuple[int, ...] | None
    text: str | None


def prompt_of(body: dict[str, Any], chat: bool, inputs: InputProcessor | None) -> Prompt:
    """The prompt of an OpenAI completions (``chat`` False) or chat completions body. A body the server
    would refuse raises ValueError or TypeError (the caller routes it anywhere: the backend answers it)."""
    if chat:
        if inputs is not None:
            tools = body.get("tools") if isinstance(body.get("tools"), list) else None
            tokenized = inputs.from_messages(body.get("messages"), add_generation_prompt=body.get("add_generation_prompt", True),
                                             tools=tools or None, validate=False)
            return Prompt(tuple(tokenized.token_ids), None)
        messages = validate_messages(body.get("messages"))
        return Prompt(None, "".join(f"{m['role']}\n{m['content']}\n" for m in messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, list):
        return Prompt(tuple(int(t) for t in prompt), None)
    if inputs is not None:
        return Prompt(tuple(inputs.from_text(prompt, validate=False).token_ids), None)
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    return Prompt(None, prompt)


def cache_salt_of(body: dict[str, Any], authorization: str | None, isolate_tenants: bool) -> str | None:
    """The request's cache salt as the servers derive it: the body's ``cache_salt``, and with
    ``--isolate-tenants`` the tenant of its API key in front (kvreuse.server.auth's rule)."""
    cache_salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    if isolate_tenants:
        key = bearer_key(authorization)
        if key is not None:
            cache_salt = isolated_cache_salt(tenant_id_of(key), cache_salt)
    return cache_salt


def route_request(prompt: Prompt | None, cache_salt: str | None, session_id: str | None,
                  namespaces: Mapping[str, Namespace], block_size: int) -> RouteRequest:
    """The policy's view of a request: its block keys in every backend's namespace (``namespaces``:
    backend -> namespace; the keys are computed once per distinct namespace). Without token ids the
    characters stand in for tokens, in blocks of CHARS_PER_TOKEN x ``block_size`` characters: those keys
    are the router's own (no engine computes them), the counts approximate tokens."""
    if prompt is None or not namespaces:
        return RouteRequest((), 0, session_id)
    if prompt.token_ids is None:
        token_ids: tuple[int, ...] = tuple(ord(c) for c in prompt.text or "")
        block_size *= CHARS_PER_TOKEN
        num_prompt_tokens = len(token_ids) // CHARS_PER_TOKEN
    else:
        token_ids, num_prompt_tokens = prompt.token_ids, len(prompt.token_ids)
    keys_of = {namespace: tuple(prompt_block_keys(token_ids, block_size, cache_salt, adapter=namespace.adapter,
                                                  model=namespace.model, draft=namespace.draft))
               for namespace in dict.fromkeys(namespaces.values())}
    first = next(iter(keys_of.values()))
    backend_keys = {name: keys_of[namespace] for name, namespace in namespaces.items()} if len(keys_of) > 1 else {}
    return RouteRequest(first, num_prompt_tokens, session_id, backend_keys)

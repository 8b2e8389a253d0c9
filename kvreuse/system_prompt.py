"""The system prompt cache: which prefix of a conversation is "the system prompt" and its pin key.

The entry's key is (system prompt as formatted by the chat template, adapter digest) when the chat
template is applied, the raw system text otherwise, so any whitespace or punctuation difference is
a different entry, exactly as the prompt text would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvreuse.cache.pins import Pin, PinSpec
from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor, common_prefix_length, validate_messages
from kvreuse.sampling import SamplingParams

if TYPE_CHECKING:
    from kvreuse.engine import LLMEngine
    from kvreuse.lora.request import LoRARequest
    from kvreuse.tokenizer import Tokenizer


def leading_system_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The system messages that open the conversation; ValueError if there are none or not text."""
    system: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message.get("role") != "system":
            break
        content = message.get("content")
        if isinstance(content, list):
            for part_index, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise InvalidRequestError(
                        f"messages[{index}].content[{part_index}]: a system prompt saved with "
                        f"save_system_prompt_kv_cache must be text only, found a {kind!r} part",
                        f"messages[{index}].content[{part_index}]",
                    )
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{index}].content: a saved system prompt must be text",
                                      f"messages[{index}].content")
        system.append(dict(message))
    if not system:
        raise InvalidRequestError(
            "save_system_prompt_kv_cache is set but the conversation has no system message first", "messages")
    return validate_messages(system)


def system_prompt_pin(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    prompt_token_ids: Sequence[int],
    *,
    adapter: str | None = None,
    apply_chat_template: bool = True,
    ttl: float | None = None,
) -> PinSpec:
    """PinSpec for the system-prompt prefix of ``prompt_token_ids`` (the conversation's tokens)."""
    system = leading_system_messages(messages)
    inputs = InputProcessor(tokenizer)  # rendering and encoding only: the caller's tokenizer, the caller's thread
    if apply_chat_template:
        system_prompt = inputs.from_messages(system, add_generation_prompt=False, validate=False)
    else:
        system_prompt = inputs.from_text("\n".join(message["content"] for message in system), validate=False)
    text = system_prompt.text or ""
    # The system part's tokens are a prefix of the conversation's, up to tokenizer merges at the seam.
    common = common_prefix_length(system_prompt.token_ids, prompt_token_ids)
    return PinSpec(num_tokens=common, key=f"system\x00{adapter or ''}\x00{text}", kind="system_prompt",
                   ttl=ttl, adapter=adapter)


def pin_prompt_now(
    engine: LLMEngine,
    prompt: str | list[int] | list[Mapping[str, Any]],
    *,
    ttl: float | None = None,
    cache_salt: str | None = None,
    kind: str = "api",
    request_id: str = "pin",
    lora_request: LoRARequest | None = None,
) -> Pin:
    """Compute and pin a prompt's KV on an idle ``LLMEngine`` (stepping it here, synchronously).

    A conversation (list of messages) pins its system prompt, keyed as the system prompt cache
    keys it; a string or token ids pin the whole prompt.
    """
    inputs = engine.inputs  # this runs on the engine's thread (start-up, or LLM on the caller's thread)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
        tokenized = inputs.from_messages(prompt, add_generation_prompt=False)
        spec = system_prompt_pin(inputs.tokenizer, prompt, tokenized.token_ids, ttl=ttl,  # type: ignore[arg-type]
                                 adapter=engine.adapter_digest(lora_request))
        if kind != "api":
            spec = PinSpec(spec.num_tokens, spec.key, kind, spec.ttl, spec.adapter, spec.owner)
    else:
        tokenized = inputs.from_prompt(prompt)  # type: ignore[arg-type]
        token_ids = tokenized.token_ids
        key = tokenized.text if tokenized.text is not None else "tokens:" + ",".join(map(str, token_ids))
        adapter = engine.adapter_digest(lora_request)
        spec = PinSpec(num_tokens=len(token_ids), key=f"{adapter or ''}\x00{key}", kind=kind, ttl=ttl, adapter=adapter)
    engine.add_request(request_id, tokenized.as_engine_prompt(), SamplingParams(max_tokens=1),
                       cache_salt=cache_salt, pins=[spec], lora_request=lora_request)
    saved: list[str] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                saved = output.pins_saved
    if not saved:
        raise ValueError("the prefix could not be pinned (the pinned budget is too small; see the log)")
    pin = engine.get_pin(saved[0])
    if pin is None:
        raise ValueError(f"the pin {saved[0]} was removed before it could be returned")
    return pin

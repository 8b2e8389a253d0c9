"""The system prompt cache: which prefix of a conversation is "the system prompt" and its pin key.

The entry's key is (system prompt as formatted by the chat template, adapter name) when the chat
template is applied, the raw system text otherwise, so any whitespace or punctuation difference is
a different entry, exactly as the prompt text would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.cache.pins import PinSpec
from kvreuse.tokenizer import Tokenizer, flatten_message_content


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
                    raise ValueError(
                        f"messages[{index}].content[{part_index}]: a system prompt saved with "
                        f"save_system_prompt_kv_cache must be text only, found a {kind!r} part"
                    )
        elif not isinstance(content, str):
            raise ValueError(f"messages[{index}].content: a saved system prompt must be text")
        system.append(dict(message))
    if not system:
        raise ValueError("save_system_prompt_kv_cache is set but the conversation has no system message first")
    return flatten_message_content(system)


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
    if apply_chat_template:
        text = tokenizer.apply_chat_template(system, add_generation_prompt=False)
    else:
        text = "\n".join(message["content"] for message in system)
    system_ids = tokenizer.encode(text)
    # The system part's tokens are a prefix of the conversation's, up to tokenizer merges at the seam.
    common = 0
    for ours, theirs in zip(system_ids, prompt_token_ids):
        if ours != theirs:
            break
        common += 1
    return PinSpec(num_tokens=common, key=f"system\x00{adapter or ''}\x00{text}", kind="system_prompt",
                   ttl=ttl, adapter=adapter)

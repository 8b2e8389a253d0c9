"""Checking a chat conversation: roles, and OpenAI-style text parts flattened to plain strings.

A leaf module (it imports only `kvreuse.errors`) so that both `kvreuse.inputs` (which renders and
encodes prompts) and `kvreuse.tokenizer` (whose ``apply_chat_template`` checks what it renders) can
use it without importing each other. `kvreuse.inputs` re-exports both names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.errors import InvalidRequestError

# The roles OpenAI's chat API accepts ("developer" is its newer name for "system").
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any, *, param: str = "messages") -> list[dict[str, Any]]:
    """Check a conversation and flatten OpenAI-style text parts into plain strings.

    Text parts are joined with "\\n"; any other part type (image, audio, ...) is refused, naming the
    message and part, since the engine only handles text. Roles must be one of `CHAT_ROLES`.
    """
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
        flattened.append({**message, "content": _content_text(message.get("content"), f"{where}.content")})
    return flattened


def _content_text(content: Any, where: str) -> str:
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
        texts.append(text)
    return "\n".join(texts)

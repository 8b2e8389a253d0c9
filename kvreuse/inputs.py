"""One way in: render a conversation, encode, validate.

Every entry point (LLM.generate / chat, the OpenAI and Anthropic routes, the batch runner, the
system prompt cache, the router) turns its input into token ids here, so a chat template error, a
bad role or a prompt over ``max_model_len`` is the same `InvalidRequestError` (with the field in
``param``) wherever it comes from.

An `InputProcessor` holds a `Tokenizer`; Hugging Face fast tokenizers must not be used from two
threads at once, so each thread that encodes (the engine thread, the server's event loop) owns its
own processor and tokenizer object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from kvreuse.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from kvreuse.messages import CHAT_ROLES, validate_messages

if TYPE_CHECKING:
    from kvreuse.tokenizer import Tokenizer

__all__ = [
    "CHAT_ROLES", "InputProcessor", "PromptInput", "TokenizedPrompt", "common_prefix_length",
    "validate_messages", "validate_prompt_tokens",
]

# A prompt as the engine and LLM.generate take it: text, token ids, or {"prompt_token_ids": [...]}
# (optionally with "prompt", its text) / {"prompt": "..."}.
PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A validated prompt: its token ids, its text when known, and the conversation it came from."""

    token_ids: list[int]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None  # the flattened messages, when rendered from a chat

    def as_engine_prompt(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            prompt["prompt"] = self.text
        return prompt


def common_prefix_length(first: Sequence[Any], second: Sequence[Any]) -> int:
    """How many leading items two sequences (token ids, strings) share."""
    length = 0
    for ours, theirs in zip(first, second):
        if ours != theirs:
            break
        length += 1
    return length


def validate_prompt_tokens(token_ids: Sequence[int], max_model_len: int | None, vocab_size: int | None,
                           param: str = "prompt") -> None:
    """A prompt the engine can run: not empty, room for one output token, ids inside the vocabulary."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty: at least 1 token is required", param)
    if max_model_len is not None and len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens, longer than max_model_len={max_model_len} "
            f"allows (at most {max_model_len - 1} prompt tokens, leaving room for one output token)",
            param, CONTEXT_LENGTH_EXCEEDED,
        )
    if vocab_size is not None:
        for position, token in enumerate(token_ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids[{position}] = {token} is outside the vocabulary [0, {vocab_size})", param
                )


def _as_token_list(value: Any, param: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"{param} must be a list of integers", param)
    return list(value)


class InputProcessor:
    """Renders, encodes and validates prompts for one model; owned by a single thread.

    ``max_model_len`` / ``vocab_size`` of None skip those checks (the router only needs the ids).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def render(self, messages: Any, *, add_generation_prompt: bool = True, tools: list[Any] | None = None,
               param: str = "messages") -> str:
        """The conversation as the model's chat template formats it."""
        return self._render(validate_messages(messages, param=param), add_generation_prompt, tools, param)

    def _render(self, flattened: list[dict[str, Any]], add_generation_prompt: bool, tools: list[Any] | None,
                param: str) -> str:
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.render_chat(flattened, add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as error:
            # Messages of an unexpected shape fail inside the template: still the caller's input.
            raise InvalidRequestError(f"the chat template rejected the messages: {error}", param) from None

    def from_messages(self, messages: Any, *, add_generation_prompt: bool = True, tools: list[Any] | None = None,
                      param: str = "messages", validate: bool = True) -> TokenizedPrompt:
        """Render and encode a conversation (the template already holds any bos: none is added)."""
        flattened = validate_messages(messages, param=param)
        text = self._render(flattened, add_generation_prompt, tools, param)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if validate:
            self.validate(token_ids, param)
        return TokenizedPrompt(token_ids, text, flattened)

    def from_text(self, text: Any, *, add_special_tokens: bool = True, param: str = "prompt",
                  validate: bool = True) -> TokenizedPrompt:
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param} must be a string, got {type(text).__name__}", param)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if validate:
            self.validate(token_ids, param)
        return TokenizedPrompt(token_ids, text)

    def from_prompt(self, prompt: PromptInput, *, param: str = "prompt", validate: bool = True) -> TokenizedPrompt:
        """A prompt given as text, token ids, or a dict with ``prompt_token_ids`` and/or ``prompt``."""
        if isinstance(prompt, str):
            return self.from_text(prompt, param=param, validate=validate)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = _as_token_list(prompt["prompt_token_ids"], "prompt_token_ids")
                text = prompt.get("prompt")
            elif isinstance(prompt.get("prompt"), str):
                return self.from_text(prompt["prompt"], param=param, validate=validate)
            else:
                raise InvalidRequestError(
                    "a prompt dict needs 'prompt_token_ids' (list of ints) or 'prompt' (string)", param)
        elif isinstance(prompt, (list, tuple)):
            token_ids, text = _as_token_list(prompt, "prompt_token_ids"), None
        else:
            raise InvalidRequestError(
                f"{param} must be a string, a list of token ids or a dict, got {type(prompt).__name__}", param)
        if validate:
            self.validate(token_ids, param)
        return TokenizedPrompt(token_ids, text if isinstance(text, str) else None)

    def validate(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        validate_prompt_tokens(token_ids, self.max_model_len, self.vocab_size, param)

"""Tokenizer, chat template and incremental (streaming) detokenizer.

``Tokenizer`` wraps ``transformers.AutoTokenizer`` for a local model folder and adds what the engine
needs on top: the full set of end-of-sequence ids, the chat template over checked messages (OpenAI
style text parts are flattened by kvreuse.messages), and decoding that tolerates ids the tokenizer
does not know (random models may have a config vocab larger than the tokenizer's).

``IncrementalDetokenizer`` turns a stream of token ids into text deltas. With byte-level BPE one
character can span several tokens, so text is held back while it ends in an incomplete character.
Each step decodes only a short window of recent tokens, so the cost per token does not grow with
the length of the output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvreuse.errors import InvalidRequestError
from kvreuse.messages import validate_messages, validate_tools

REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    """An ``eos_token_id`` field is an int, a list of ints or null, depending on the model."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


class Tokenizer:
    """Tokenizer and chat template of a local model folder (loaded with ``AutoTokenizer``)."""

    def __init__(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> None:
        self.path = Path(path)
        if (self.path / "tokenizer.json").is_file() and not trust_remote_code:
            # A fast tokenizer straight from tokenizer.json (+ tokenizer_config.json for the chat template
            # and special tokens): AutoTokenizer resolves the same thing but imports ~2.5 s more of
            # transformers per process, and every server, router and benchmark process loads one.
            from transformers import PreTrainedTokenizerFast

            self.hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            from transformers import AutoTokenizer

            self.hf_tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        # Every id that decodes to something: the base vocabulary plus added (special) tokens.
        self.vocab_size: int = len(self.hf_tokenizer)
        self.bos_token_id: int | None = self.hf_tokenizer.bos_token_id
        self.pad_token_id: int | None = self.hf_tokenizer.pad_token_id
        self.eos_token_ids: frozenset[int] = self._collect_eos_token_ids()

    def _collect_eos_token_ids(self) -> frozenset[int]:
        """Union of the tokenizer's eos and the eos ids of generation_config.json and config.json.

        Chat models often stop on a turn-end token (``<|im_end|>``, ``<|eot_id|>``) that only the
        generation config lists, while the tokenizer names another one.
        """
        ids = set(_as_id_list(self.hf_tokenizer.eos_token_id))
        for file_name in ("generation_config.json", "config.json"):
            config = _read_json(self.path / file_name)
            ids.update(_as_id_list(config.get("eos_token_id")))
            # Multimodal / nested configs keep the language model's settings under text_config.
            text_config = config.get("text_config")
            if isinstance(text_config, dict):
                ids.update(_as_id_list(text_config.get("eos_token_id")))
        return frozenset(ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf_tokenizer, "chat_template", None)

    @property
    def added_tokens(self) -> dict[str, int]:
        """The added tokens (special or not), text -> id: tool-call grammars name single-token tags by them
        (kvreuse.tool_parsers.choose)."""
        return {token.content: token_id for token_id, token in self.hf_tokenizer.added_tokens_decoder.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens (bos) are added only where the tokenizer's own
        config adds them; the chat-template path passes ``add_special_tokens=False``."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; ids outside the tokenizer's vocabulary decode to ""."""
        known_ids = [int(token_id) for token_id in token_ids if 0 <= int(token_id) < self.vocab_size]
        if not known_ids:
            return ""
        return self.hf_tokenizer.decode(known_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` (checked and flattened by kvreuse.messages.validate_messages) with the model's
        chat template; extra kwargs go to the template (``tools`` checked by validate_tools first)."""
        if template_kwargs.get("tools") is not None:
            template_kwargs["tools"] = validate_tools(template_kwargs["tools"]) or None
        return self.render_chat(validate_messages(messages), add_generation_prompt, **template_kwargs)

    def render_chat(self, flattened: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The chat template over messages already checked and flattened by validate_messages."""
        if not self.chat_template:
            raise InvalidRequestError(f"the tokenizer at {self.path} has no chat_template; send a plain prompt "
                                      "instead", "messages")
        rendered = self.hf_tokenizer.apply_chat_template(
            flattened, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return str(rendered)

    def apply_chat_template_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                                **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat; the template already contains any bos it wants."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Streams text deltas for generated tokens, one ``add`` per token.

    For byte-level BPE tokenizers the concatenation of every delta plus ``finish()`` equals
    ``tokenizer.decode(output_ids)``. A few prompt tokens serve as decoding context, so tokenizers
    whose decoder strips a leading space (SentencePiece) stream the space the prompt implies.
    """

    # Prompt tokens kept as context: enough for any decoder's look-behind (leading-space rules).
    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(token_id) for token_id in prompt_ids[-self.CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output bytes would complete it and the stream would
            # then disagree with decoding the output alone, so start without context.
            context, context_text = [], ""
        # Window of recent ids: [prefix_offset, read_offset) is text already emitted (kept only as
        # context), [read_offset, end) is text not yet emitted.
        self._window_ids: list[int] = context
        self._read_offset = len(context)
        self._emitted_window_text = context_text
        self.num_output_tokens = 0

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is
        still incomplete)."""
        self._window_ids.append(int(token_id))
        self.num_output_tokens += 1
        window_text = self._decode(self._window_ids)
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) <= len(self._emitted_window_text):
            return ""
        return self._emit(window_text)

    def finish(self) -> str:
        """Text still held back (e.g. output ending in an incomplete character); call once at the end."""
        window_text = self._decode(self._window_ids)
        if len(window_text) <= len(self._emitted_window_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._emitted_window_text):]
        # The tokens just emitted become the context of the next window; older ones are dropped,
        # which keeps every decode call short.
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        self._emitted_window_text = self._decode(self._window_ids)
        return delta

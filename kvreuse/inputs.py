"""One way in: render a conversation, encode, validate.

Every entry point (LLM.generate / chat, the OpenAI and Anthropic routes, the batch runner, the
system prompt cache, the router) turns its input into token ids here, so a chat template error, a
bad role or a prompt over ``max_model_len`` is the same `InvalidRequestError` (with the field in
``param``) wherever it comes from.

An `InputProcessor` holds a `Tokenizer`; Hugging Face fast tokenizers must not be used from two
threads at once, so each thread that encodes (the engine thread, the server's event loop) owns its
own processor and tokenizer object.

Agent turns hit the cache by construction: a generated turn that comes back in the next request's
history, re-tokenized, need not give back the ids the model sampled (a BPE tokenizer encodes text one
canonical way; sampling can pick any spelling, ``<tool_call>`` piece by piece, a word split in two), and
the prompt would leave the cache exactly where that turn began. A `GenerationMemory`, shared by the
`OutputProcessor` that records each finished sample's text and ids and the `InputProcessor` that encodes
the next turn, lets a remembered text found at an assistant turn of a rendered chat be encoded as the ids
that produced it; the text around it is encoded as before, split at those points.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from kvreuse.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from kvreuse.messages import (
    CHAT_ROLES,
    placeholder_messages,
    validate_messages,
    validate_tools,
)

if TYPE_CHECKING:
    from kvreuse.tokenizer import Tokenizer

__all__ = [
    "CHAT_ROLES", "ChunkSpans", "GenerationMemory", "InputProcessor", "PromptInput", "TokenizedPrompt",
    "common_prefix_length", "validate_chunk_spans", "validate_messages", "validate_prompt_tokens", "validate_tools",
]

logger = logging.getLogger("kvreuse.inputs")

# A prompt as the engine and LLM.generate take it: text, token ids, or {"prompt_token_ids": [...]}
# (optionally with "prompt", its text, and "chunk_spans", its chunks) / {"prompt": "..."}.
PromptInput = str | list[int] | dict[str, Any]

# Where a prompt's chunks lie: (start, end) token positions, end exclusive, in prompt order.
ChunkSpans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A validated prompt: its token ids, its text when known, the conversation it came from, and where its
    chunks lie (issue 39; empty when nothing was marked)."""

    token_ids: list[int]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None  # the flattened messages, when rendered from a chat
    chunk_spans: ChunkSpans = ()

    def as_engine_prompt(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            prompt["prompt"] = self.text
        if self.chunk_spans:
            prompt["chunk_spans"] = [list(span) for span in self.chunk_spans]
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
                    f"{param}[{position}] = {token} is outside the vocabulary [0, {vocab_size})", param
                )


def validate_chunk_spans(spans: Any, num_tokens: int, param: str = "chunk_spans") -> ChunkSpans:
    """Chunk spans a prompt of ``num_tokens`` tokens can hold: [start, end) pairs of ints, each non-empty,
    inside the prompt, in order and not overlapping. Errors name ``param[i]``."""
    if spans is None:
        return ()
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise InvalidRequestError(f"{param} must be a list of [start, end] pairs, got {type(spans).__name__}", param)
    checked: list[tuple[int, int]] = []
    previous_end = 0
    for index, span in enumerate(spans):
        where = f"{param}[{index}]"
        if (isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2
                or not all(isinstance(bound, int) and not isinstance(bound, bool) for bound in span)):
            raise InvalidRequestError(f"{where} must be a [start, end] pair of token positions, got {span!r}", where)
        start, end = span
        if not 0 <= start < end <= num_tokens:
            raise InvalidRequestError(f"{where} = [{start}, {end}] must be a non-empty span inside the prompt's "
                                      f"{num_tokens} tokens (0 <= start < end <= {num_tokens})", where)
        if start < previous_end:
            raise InvalidRequestError(f"{where} = [{start}, {end}] starts before the span before it ends "
                                      f"({previous_end}): spans must be in order and not overlap", where)
        checked.append((start, end))
        previous_end = end
    return tuple(checked)


class GenerationMemory:
    """Generated texts and the token ids that produced them (without the final eos), least recently used
    first out, so a chat that replays them encodes them as those ids.

    Bounded by entries and by characters held; an entry evicted while its conversation goes on costs that
    conversation its cache from the evicted turn on, so the bounds are generous (an agent server holds
    every turn of every live conversation). Each lookup of an entry keeps it fresh. Not thread-safe: the
    recording and the encoding side of one memory run on one thread (the caller's for `LLM`, the event
    loop for the server).

    Entries are kept per ``scope``, the cache namespace's salt of the request (a tenant's): a prompt is
    encoded only with ids its own tenant generated. Shared across tenants, the prompt's token count would
    tell one tenant whether another had generated a given text.
    """

    # Entries are indexed by their first characters, so finding those that start at a position costs
    # HEAD_CHARS dictionary lookups, whatever the number of entries.
    HEAD_CHARS = 16

    def __init__(self, max_entries: int = 8192, max_chars: int = 32 * 1024 * 1024) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError(f"max_entries and max_chars must be >= 1, got {max_entries}, {max_chars}")
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()  # (scope, text) -> ids
        self._by_head: dict[tuple[str, str], set[str]] = {}  # (scope, first characters) -> texts
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, text: object) -> bool:
        return any(key[1] == text for key in self._entries)

    def record(self, text: str, token_ids: Sequence[int], scope: str = "") -> None:
        """Remember that ``token_ids`` (which decode to exactly ``text``, special tokens included) were
        generated. The same text generated again with other ids replaces them: the newest conversation is
        the likeliest to continue."""
        if not text or not token_ids or len(text) > self.max_chars:
            return
        key = (scope, text)
        if key in self._entries:
            self._entries[key] = tuple(token_ids)
            self._entries.move_to_end(key)
            return
        self._entries[key] = tuple(token_ids)
        self._by_head.setdefault((scope, text[: self.HEAD_CHARS]), set()).add(text)
        self._chars += len(text)
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            (old_scope, oldest), _ = self._entries.popitem(last=False)
            self._chars -= len(oldest)
            head = (old_scope, oldest[: self.HEAD_CHARS])
            self._by_head[head].discard(oldest)
            if not self._by_head[head]:
                del self._by_head[head]

    def longest_at(self, text: str, position: int, scope: str = "") -> tuple[str, tuple[int, ...]] | None:
        """The longest remembered text that ``text`` holds at ``position``, with its ids (now the most
        recently used), or None."""
        best: str | None = None
        for length in range(1, self.HEAD_CHARS + 1):
            head = text[position : position + length]
            if len(head) < length:
                break
            for candidate in self._by_head.get((scope, head), ()):
                if (best is None or len(candidate) > len(best)) and text.startswith(candidate, position):
                    best = candidate
        if best is None:
            return None
        self._entries.move_to_end((scope, best))
        return best, self._entries[(scope, best)]


def _first_invalid_text(value: Any, where: str) -> str | None:
    """Where in a JSON-like value the first string that is not valid Unicode (a lone surrogate) sits."""
    if isinstance(value, str):
        return None if _is_valid_unicode(value) else where
    if isinstance(value, Mapping):
        items: Any = ((f"{where}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for item_where, item in items:
        if (found := _first_invalid_text(item, item_where)) is not None:
            return found
    return None


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_invalid_text(param: str) -> InvalidRequestError:
    # A lone surrogate ("\ud800") is a Python str but no Unicode text: no tokenizer can encode it.
    return InvalidRequestError(f"{param} is not valid Unicode text: it holds a lone surrogate code point "
                               "(U+D800..U+DFFF), which no tokenizer encodes", param)


def _as_token_list(value: Any, param: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"{param} must be a list of integers", param)
    return list(value)


# Not computed yet (None means the template has no assistant turn marker).
_UNKNOWN = object()

# A chunk's placeholder in the rendered chat: letters and digits only, which templates write as they are (no
# escaping, no trimming); the nonce is digits, so a template that changes the letters' case still leaves it to be
# found. It is drawn per prompt, so no message can hold it.
_NONCE_DIGITS = 16


def _chunk_placeholder(nonce: str, index: int) -> str:
    return f"KVREUSECHUNK{nonce}N{index}E"


def _placeholder_pattern(nonce: str) -> re.Pattern[str]:
    """Any of `_chunk_placeholder`'s placeholders for ``nonce``, the chunk's index captured."""
    return re.compile(f"KVREUSECHUNK{nonce}N([0-9]+)E")


def _split_at_placeholders(rendered: str, chunk_texts: list[str], nonce: str) -> list[tuple[str, bool]] | None:
    """The rendered chat as (text, is a chunk) pieces, chunk texts in their placeholders' places; None when the
    nonce is left anywhere but in a whole placeholder (the template altered one)."""
    pieces: list[tuple[str, bool]] = []
    parts = _placeholder_pattern(nonce).split(rendered)
    for position, part in enumerate(parts):
        if position % 2 == 0:  # text between placeholders
            if nonce in part:
                return None
            if part:
                pieces.append((part, False))
        elif int(part) < len(chunk_texts):
            pieces.append((chunk_texts[int(part)], True))
        else:
            return None
    return pieces


class InputProcessor:
    """Renders, encodes and validates prompts for one model; owned by a single thread.

    ``max_model_len`` / ``vocab_size`` of None skip those checks (the router only needs the ids).
    ``generation_memory``: the memory this thread's `OutputProcessor` records generated turns into; a chat
    that replays one of them gets the ids that were generated (see the module docstring). None: chats are
    encoded as their text alone.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int | None = None,
                 vocab_size: int | None = None, generation_memory: GenerationMemory | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.generation_memory = generation_memory
        self._assistant_marker: Any = _UNKNOWN
        self._encodings_concatenate: bool | None = None
        self._warned: set[str] = set()

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
                      param: str = "messages", validate: bool = True, memory_scope: str = "") -> TokenizedPrompt:
        """Render and encode a conversation (the template already holds any bos: none is added).

        ``tools`` (OpenAI's shape, checked by validate_tools; errors name ``tools[i]...``) go to the
        template, which lists them in the prompt. Tool calls in the history have their JSON arguments
        parsed, so the template serialises them (see kvreuse.messages). Generated turns found in the
        generation memory (under ``memory_scope``: the request's cache salt) are encoded as the ids that were
        generated. Chunk parts are encoded on their own (`_encode_chunked`); a conversation without them is
        encoded exactly as it always was."""
        nonce = f"{secrets.randbelow(10 ** _NONCE_DIGITS):0{_NONCE_DIGITS}d}"
        placeheld, chunk_texts = placeholder_messages(messages, lambda index: _chunk_placeholder(nonce, index),
                                                      param=param)
        checked_tools = validate_tools(tools, param="tools")
        flattened = validate_messages(messages, param=param) if chunk_texts else placeheld
        if chunk_texts:
            chunked = self._encode_chunked(placeheld, chunk_texts, nonce, add_generation_prompt, checked_tools,
                                           messages, param, memory_scope)
            if chunked is not None:
                token_ids, text, spans = chunked
                if validate:
                    self.validate(token_ids, param)
                return TokenizedPrompt(token_ids, text, flattened, spans)
        text = self._render(flattened, add_generation_prompt, checked_tools or None, param)
        if not _is_valid_unicode(text):
            raise _refuse_invalid_text(_first_invalid_text(messages, param) or _first_invalid_text(tools, "tools")
                                       or param)
        token_ids = self._encode_chat(text, memory_scope)
        if validate:
            self.validate(token_ids, param)
        return TokenizedPrompt(token_ids, text, flattened)

    def _encode_chunked(self, placeheld: list[dict[str, Any]], chunk_texts: list[str], nonce: str,
                        add_generation_prompt: bool, tools: list[dict[str, Any]], messages: Any, param: str,
                        scope: str) -> tuple[list[int], str, ChunkSpans] | None:
        """A chat with chunk parts as (ids, text, chunk spans): the template rendered with a placeholder in each
        chunk's place, the rendered text split at the placeholders, every piece between them encoded as a chat
        is (generated turns spliced in) and every chunk's text encoded on its own, without special tokens; the
        ids concatenated. A span is where a chunk's ids lie in the prompt, one per placeholder the template wrote
        (a template that drops a message drops its chunks; one that repeats it repeats them).

        Why apart: a BPE tokenizer merges across any boundary in the text it is given, so a chunk encoded with
        its neighbours could start or end with a token that also holds their characters, and its ids would
        depend on what surrounds it. Encoded alone they are the same in any position, any order, any
        conversation, which is what reusing its KV elsewhere needs. The template never sees a chunk's text, so
        the chunk is written exactly as sent (a template that trims or rewrites content leaves it as it is).

        The cost: a token boundary is forced at each edge of a chunk, so the prompt may be a token or two longer
        (or spelled otherwise) than plain encoding of the same text; decoded, it is the same text.

        None (the caller encodes the chat as if nothing were marked, and the prompt has no spans) where the split
        would not be the same text: a template that altered a placeholder, or a tokenizer whose encodings do not
        concatenate (one that marks the start of every text it encodes, as SentencePiece's "\u2581" prefix
        does)."""
        rendered = self._render(placeheld, add_generation_prompt, tools or None, param)
        pieces = _split_at_placeholders(rendered, chunk_texts, nonce)
        if pieces is None:
            self._warn_once("the chat template altered a chunk's placeholder; chunk marks are ignored for such "
                            "prompts (encoded as if unmarked)")
            return None
        if not self.encodings_concatenate():
            self._warn_once("this tokenizer's encodings do not concatenate (it marks the start of each text it "
                            "encodes); chunk marks are ignored (prompts encoded as if unmarked)")
            return None
        text = "".join(piece for piece, _ in pieces)
        if not _is_valid_unicode(text):
            raise _refuse_invalid_text(_first_invalid_text(messages, param) or _first_invalid_text(tools, "tools")
                                       or param)
        token_ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for piece, is_chunk in pieces:
            if not is_chunk:
                token_ids += self._encode_chat(piece, scope)
                continue
            start = len(token_ids)
            token_ids += self.tokenizer.encode(piece, add_special_tokens=False)
            if len(token_ids) > start:
                spans.append((start, len(token_ids)))
        return token_ids, text, tuple(spans)

    def encodings_concatenate(self) -> bool:
        """Whether ids of texts encoded apart, put together, decode to the texts put together: true of byte-level
        BPE (GPT-2's, Llama 3's, Qwen's); false where every encoding starts with a marker (SentencePiece's
        prefix space, a bos). Chunks are encoded apart only where it holds. Probed once."""
        if self._encodings_concatenate is None:
            probes = (("Hello", " world"), ("line one\n", "\nline two"), ("a", "b"))
            encode, decode = self.tokenizer.encode, self.tokenizer.decode
            self._encodings_concatenate = all(
                decode(encode(first, add_special_tokens=False) + encode(second, add_special_tokens=False),
                       skip_special_tokens=False) == first + second
                for first, second in probes)
        return self._encodings_concatenate

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    def _encode_chat(self, text: str, scope: str = "") -> list[int]:
        """The rendered chat's ids: each remembered generated text that starts right after an assistant turn
        marker becomes its generated ids; the text between them is encoded as usual."""
        memory = self.generation_memory
        marker = self.assistant_marker() if memory else None
        if not memory or not marker:
            return self.tokenizer.encode(text, add_special_tokens=False)
        token_ids: list[int] = []
        encoded_up_to = 0
        search_from = 0
        while (found := text.find(marker, search_from)) != -1:
            turn_start = found + len(marker)
            match = memory.longest_at(text, turn_start, scope)
            if match is None:
                search_from = turn_start
                continue
            generated, generated_ids = match
            token_ids += self.tokenizer.encode(text[encoded_up_to:turn_start], add_special_tokens=False)
            token_ids += generated_ids
            encoded_up_to = search_from = turn_start + len(generated)
        if encoded_up_to < len(text):
            token_ids += self.tokenizer.encode(text[encoded_up_to:], add_special_tokens=False)
        return token_ids

    def assistant_marker(self) -> str | None:
        """What the template writes where an assistant turn begins: its generation prompt
        (``<|im_start|>assistant\\n`` for ChatML), found by rendering a one-message chat with and without it.
        A generated turn's text starts right after it. None when the template adds no generation prompt."""
        if self._assistant_marker is _UNKNOWN:
            probe = [{"role": "user", "content": "x"}]
            try:
                without = self.tokenizer.render_chat(probe, False)
                with_prompt = self.tokenizer.render_chat(probe, True)
            except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError):
                # No chat template, or one that cannot render this probe: no splicing, nothing worse.
                self._assistant_marker = None
            else:
                suffix = with_prompt[len(without):] if with_prompt.startswith(without) else ""
                self._assistant_marker = suffix or None
        return self._assistant_marker

    def from_text(self, text: Any, *, add_special_tokens: bool = True, param: str = "prompt",
                  validate: bool = True) -> TokenizedPrompt:
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param} must be a string, got {type(text).__name__}", param)
        if not _is_valid_unicode(text):
            raise _refuse_invalid_text(param)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if validate:
            self.validate(token_ids, param)
        return TokenizedPrompt(token_ids, text)

    def from_prompt(self, prompt: PromptInput, *, param: str = "prompt", validate: bool = True) -> TokenizedPrompt:
        """A prompt given as text, token ids, or a dict with ``prompt_token_ids`` and/or ``prompt``."""
        if isinstance(prompt, str):
            return self.from_text(prompt, param=param, validate=validate)
        chunk_spans: ChunkSpans = ()
        ids_param = param  # what an error about one of the ids names: the field that held them
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids_param = "prompt_token_ids"
                token_ids = _as_token_list(prompt["prompt_token_ids"], "prompt_token_ids")
                text = prompt.get("prompt")
                # Chunk spans are token positions: they come only with the ids they point into.
                chunk_spans = validate_chunk_spans(prompt.get("chunk_spans"), len(token_ids))
            elif "chunk_spans" in prompt:
                raise InvalidRequestError("chunk_spans are token positions: they go with prompt_token_ids",
                                          "chunk_spans")
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
            self.validate(token_ids, ids_param)
        return TokenizedPrompt(token_ids, text if isinstance(text, str) else None, chunk_spans=chunk_spans)

    def validate(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        validate_prompt_tokens(token_ids, self.max_model_len, self.vocab_size, param)

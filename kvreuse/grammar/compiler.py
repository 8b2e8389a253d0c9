"""GrammarCompiler: a request's ``StructuredOutputsParams`` compiled once, off the engine thread.

A constraint becomes an llguidance grammar (JSON schema, regex, choice, Lark/GBNF grammar or a
structural tag) and then a compiled ``LLMatcher``: the template every sequence of every request with
the same constraint copies (``deep_copy``), so an agent that resends its schema every turn compiles it
once. Compiles run on one worker thread (llguidance drops the GIL while it builds a grammar); a
request whose grammar is not ready waits in the queue while the others step.

Errors name the field: a JSON schema is first checked against its meta-schema with ``jsonschema``,
whose error path becomes the field (``response_format.json_schema.schema.properties.x.type``); what
llguidance refuses (an unresolvable ``$ref``, a bad regex, a Lark syntax error) names the constraint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import gbnf_to_lark

from kvreuse.errors import InvalidRequestError
from kvreuse.structured_outputs import StructuredOutputsParams
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse")

COMPILED_CAPACITY = 512  # distinct compiled constraints kept (least recently used go first)
# vLLM's disable_any_whitespace: the most compact JSON ("," and ":", no free whitespace). Tool calls use the
# chat templates' own style instead (kvreuse.tool_parsers.TEMPLATE_JSON_STYLE: ", " and ": ").
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass
class CompiledGrammar:
    key: str
    template: llguidance.LLMatcher  # never advanced itself: each sequence gets a deep copy
    compile_seconds: float

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


@dataclass
class CompilerStats:
    compiled: int = 0  # constraints compiled
    cache_hits: int = 0  # requests whose constraint was already compiled (or compiling)
    compile_seconds: float = 0.0


class GrammarCompiler:
    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: list[int],
                 capacity: int = COMPILED_CAPACITY) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.eos_token_ids = sorted(eos_token_ids)  # all allowed where the grammar may end
        self.capacity = capacity
        self.stats = CompilerStats()
        self._compiled: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # submit is called from the engine thread and the server's loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreuse-grammar")
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on the worker thread only

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of ``params``: cached, being compiled, or queued now. The future raises
        InvalidRequestError (naming the field) when the constraint is refused."""
        key = params.key
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._compiled.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            future = self._executor.submit(self._compile, params)
            self._compiled[key] = future
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """``submit`` and wait (the offline API checks a constraint before the request is queued)."""
        return self.submit(params).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- the worker thread ------------------------------------------------------------------------
    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            # Its own tokenizer object: a Hugging Face fast tokenizer must not be used by two threads.
            hf = Tokenizer(self.tokenizer_path).hf_tokenizer
            self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                                eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        started = time.perf_counter()
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{params.where} cannot be compiled: {matcher.get_error()}", params.where)
        seconds = time.perf_counter() - started
        self.stats.compiled += 1
        self.stats.compile_seconds += seconds
        logger.debug("compiled a %s constraint in %.1f ms", params.kind, seconds * 1e3)
        return CompiledGrammar(params.key, matcher, seconds)


# --- StructuredOutputsParams -> llguidance grammar ----------------------------------------------------
def grammar_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, dict):
            check_json_schema(schema, params.where)
            schema = dict(schema)
            if params.disable_additional_properties:
                schema = _close_objects(schema)
        options: dict[str, Any] = {}
        if params.disable_any_whitespace:
            options.update(COMPACT)
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        except ValueError as error:
            raise InvalidRequestError(f"{params.where} is not a usable JSON schema: {error}", params.where) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice or []))
    if kind == "grammar":
        text = params.grammar or ""
        if "::=" in text:  # GBNF (llama.cpp's, and what vLLM's xgrammar backend takes): llguidance converts it
            try:
                text = gbnf_to_lark(text)
            except Exception as error:  # its converter raises plain exceptions on syntax errors
                raise InvalidRequestError(f"{params.where} is not a valid GBNF grammar: {error}", params.where) from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    return _structural_tag_grammar(params.structural_tag or "", params.where)


def check_json_schema(schema: dict[str, Any], where: str) -> None:
    """Refuse a schema its own meta-schema refuses, naming the place (``where.properties.x.type``)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.path)
        raise InvalidRequestError(f"{where}{path}: {error.message}", f"{where}{path}") from None


def _close_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without ``additionalProperties`` gets
    ``false``."""
    if isinstance(schema, dict):
        closed = {key: _close_objects(value) for key, value in schema.items()}
        if closed.get("type") == "object" and "additionalProperties" not in closed:
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    return schema


def _structural_tag_grammar(text: str, where: str) -> str:
    """vLLM's structural tag (xgrammar's format): ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``: free text, and where a trigger starts a structure, its schema between
    ``begin`` and ``end``."""
    try:
        tag = json.loads(text)
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for index, structure in enumerate(structures):
            begin = structure["begin"]
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise InvalidRequestError(f"{where}.structures[{index}].begin {begin!r} starts with no trigger",
                                          f"{where}.structures[{index}].begin")
            schema = structure.get("schema", {})
            check_json_schema(schema, f"{where}.structures[{index}].schema")
            tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=structure["end"]))
    except InvalidRequestError:
        raise
    except (ValueError, KeyError, TypeError, AssertionError) as error:
        raise InvalidRequestError(f"{where} must be JSON with 'structures' (begin, schema, end) and 'triggers': "
                                  f"{error}", where) from None
    if not tags:
        raise InvalidRequestError(f"{where} has no structures", where)
    return llguidance.StructTag.to_grammar(tags)

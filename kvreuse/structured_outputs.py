"""StructuredOutputsParams: what a request's output must match, with vLLM's names and meanings.

Exactly one constraint: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of these strings), ``grammar`` (a Lark grammar in llguidance's
dialect, which also takes ``%json`` and lazy lexemes; a GBNF grammar, recognised by its ``::=``, is
converted) or ``structural_tag`` (vLLM's / xgrammar's JSON: ``{"structures": [{"begin", "schema",
"end"}], "triggers": [...]}``, free text until a trigger, then the tag's schema). The JSON options
follow vLLM: ``disable_any_whitespace`` (compact separators, no free whitespace),
``disable_additional_properties`` (objects without ``additionalProperties`` get ``false``),
``whitespace_pattern``.

This module only checks the form (a leaf: ``SamplingParams`` holds one); compiling and enforcing the
constraint is ``kvreuse.grammar``'s. Constraints act on the logits, never on the prompt.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import InvalidRequestError

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A schema or grammar text larger than this is refused: compiling it would take the engine's time
# for what is almost certainly a mistake (OpenAI caps a schema at ~15k characters of property names).
MAX_CONSTRAINT_CHARS = 1_000_000
MAX_CHOICES = 4096


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Where the constraint came from, for errors: a server sets it to the request's own field (e.g.
    # "response_format.json_schema.schema"), so a 400 names what the client sent. Default:
    # "structured_outputs.<kind>".
    field: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINTS)}; got "
                f"{', '.join(given) if given else 'none'}", self.field or "structured_outputs")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as error:
                raise InvalidRequestError(f"{self.where} is not valid JSON: {error}", self.where) from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"{self.where} must be a JSON schema (an object), got "
                                      f"{type(self.json).__name__}", self.where)
        if self.json_object not in (None, True, False):
            raise InvalidRequestError("structured_outputs.json_object must be a bool", "structured_outputs.json_object")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                where = self.where if name == self.kind else f"structured_outputs.{name}"
                raise InvalidRequestError(f"{where} must be a non-empty string", where)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(item, str) and item for item in self.choice)):
                raise InvalidRequestError(f"{self.where} must be a list of 1..{MAX_CHOICES} non-empty strings",
                                          self.where)
            self.choice = list(self.choice)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured_outputs.{name} must be a bool", f"structured_outputs.{name}")
        if len(self.key) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"{self.where} is {len(self.key)} characters, over the limit of "
                                      f"{MAX_CONSTRAINT_CHARS}", self.where)

    @property
    def where(self) -> str:
        """The field errors about the constraint name."""
        return self.field or f"structured_outputs.{self.kind}"

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> str:
        """The canonical text of the constraint and its options: equal keys compile to the same grammar (an
        agent resending the same schema every turn compiles it once). Keys keep their order: the order of a
        schema's properties is the order the output writes them in."""
        value = getattr(self, self.kind)
        return _json.dumps({
            "kind": self.kind, "value": value, "disable_any_whitespace": self.disable_any_whitespace,
            "disable_additional_properties": self.disable_additional_properties,
            "whitespace_pattern": self.whitespace_pattern,
        }, separators=(",", ":"), ensure_ascii=False)

"""Structured outputs in the engine (kvreuse.grammar): every sample matches its constraint, the mask is
replayed right through preemption and prefix hits, EAGLE stays lossless under a grammar, compiled
grammars are cached and compiled off the engine thread, and bad constraints fail naming the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import jsonschema
import pytest
from test_spec import make_agreeing_pair, run_checked, tokens_of

from kvreuse import LLM, SamplingParams
from kvreuse.errors import InvalidRequestError
from kvreuse.grammar import compiler as compiler_module
from kvreuse.model_tools.make_draft import make_random_draft
from kvreuse.sampling import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "manager": {"anyOf": [{"$ref": "#/$defs/ref"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "tags", "manager"],
    "additionalProperties": False,
    "$defs": {"ref": {"type": "object", "properties": {"id": {"type": "integer", "maximum": 99}},
                      "required": ["id"], "additionalProperties": False}},
}
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7, max_tokens=120)
GREEDY_SO = dict(temperature=0.0, max_tokens=48)


def constrained(so: StructuredOutputsParams, **fields) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=1.0, seed=3, max_tokens=120), **fields, "structured_outputs": so})


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), dtype="float32", kv_cache_memory="16MiB", block_size=4)


def test_every_sample_matches_its_constraint(llm):
    """JSON schema ($defs/$ref, anyOf with null, enum, additionalProperties false), choice, regex and any JSON
    object, sampled with temperature, top-k, top-p and min-p and n = 3: each finished sample matches."""
    cases = [
        (StructuredOutputsParams(json=PERSON), lambda text: jsonschema.validate(json.loads(text), PERSON)),
        (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda text: text in ("red", "green", "blue")),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ]
    for so, check in cases:
        outputs = llm.generate(["Tell me something:", "Another prompt"],
                               SamplingParams(**{**SAMPLED.__dict__, "n": 3, "max_tokens": 400, "structured_outputs": so}))
        for output in outputs:
            assert len(output.outputs) == 3
            for sample in output.outputs:
                assert sample.finish_reason == "stop", (so.kind, sample.text)
                assert check(sample.text) is not False, (so.kind, sample.text)
    # Any JSON object, without free whitespace: a random model may write one string forever, so the check is
    # that what it wrote is an object's start whose structure has no whitespace outside strings.
    compact = llm.generate(["{}"], SamplingParams(**{**SAMPLED.__dict__, "n": 3, "max_tokens": 24, "structured_outputs":
                                                    StructuredOutputsParams(json_object=True, disable_any_whitespace=True)}))
    for sample in compact[0].outputs:
        outside_strings = re.sub(r'"(\\.|[^"\\])*"?', "", sample.text)
        assert sample.text.startswith("{") and not re.search(r"\s", outside_strings), sample.text
    assert llm.engine.check_integrity() is None and not llm.engine.has_unfinished_requests()


def test_unconstrained_rows_are_untouched_and_eos_comes_only_where_the_grammar_ends(llm):
    """The same prompt without a constraint gives the same greedy text as before; with a choice, the only
    way out is a whole choice (EOS is masked until the grammar accepts)."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = llm.generate(["Colour:"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["Colour:", "Colour:"], [free, constrained(StructuredOutputsParams(choice=["cyan", "teal"]),
                                                                     **GREEDY_SO)])
    assert mixed[0].outputs[0].token_ids == before
    assert mixed[1].outputs[0].text in ("cyan", "teal") and mixed[1].outputs[0].finish_reason == "stop"


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate(["x"], constrained(StructuredOutputsParams(regex=r"a{50}"), max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and out.text and set(out.text) == {"a"}


def test_preemption_and_prefix_hits_replay_the_mask(tiny_model):
    """A pool so small that requests are preempted and recomputed mid-generation, then the same prompts
    again (prefix hits): greedy constrained outputs equal an uncrowded run's, cache invariants every step."""
    prompts = [[5 + i, 17, 23, 42, 9, 11, 13, 90 + i] for i in range(4)]
    params = constrained(StructuredOutputsParams(json=PERSON), temperature=0.0, max_tokens=60)
    roomy = LLM(str(tiny_model), dtype="float32", kv_cache_memory="16MiB", block_size=4).engine
    expected = tokens_of(run_checked(roomy, prompts, params, prefix="roomy"))
    tight = LLM(str(tiny_model), dtype="float32", block_size=4, max_model_len=72, max_num_seqs=4,
                kv_cache_memory=_bytes_for_tokens(tiny_model, 4 * 40)).engine
    got = tokens_of(run_checked(tight, prompts, params, prefix="tight"))
    assert tight.stats().num_preemptions > 0, "the pool was meant to force preemptions"
    assert got == expected
    again = run_checked(roomy, prompts, params, prefix="again")  # the roomy pool still holds every prompt
    assert tokens_of(again) == expected and all(output.num_cached_tokens > 0 for output in again)


def _bytes_for_tokens(model_dir, tokens: int) -> int:
    import torch

    from kvreuse.models.config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).kv_bytes_per_token(torch.float32) * tokens


@pytest.mark.parametrize("k", [1, 3])
def test_eagle_with_a_grammar_is_lossless(tmp_path, k):
    """Greedy with EAGLE + a schema equals greedy without EAGLE, with a draft that agrees with the target
    and with a random one. The agreeing draft proposes the target's own choices; the grammar refuses most
    of the unconstrained ones, so only because the draft's logits are masked too is every draft accepted.
    The random draft's proposals are mostly refused by verification, and the output is still the same."""
    target, agreeing = make_agreeing_pair(tmp_path)
    random_draft = make_random_draft(target, tmp_path / "random", seed=5)
    params = constrained(StructuredOutputsParams(json=PERSON), temperature=0.0, max_tokens=64)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    base = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", block_size=4).engine
    expected = tokens_of(run_checked(base, prompts, params))
    for draft in (agreeing, random_draft):
        spec = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", block_size=4, speculative_config={
            "method": "eagle", "model": str(draft), "num_speculative_tokens": k}).engine
        assert tokens_of(run_checked(spec, prompts, params)) == expected
        stats = spec.stats().spec_decode
        if draft is agreeing:
            assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_compiled_grammars_are_cached_by_the_canonical_schema(llm):
    compiler = llm.engine.structured.compiler
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"]}
    before = compiler.stats.compiled
    for _ in range(3):  # an agent resending its schema every turn, as a fresh dict each time
        llm.generate(["turn"], constrained(StructuredOutputsParams(json=json.loads(json.dumps(schema))), max_tokens=30))
    assert compiler.stats.compiled == before + 1


def test_a_slow_compile_does_not_stall_other_requests(tiny_model, monkeypatch):
    """While one request's grammar compiles (held on an event here), the engine keeps stepping the others
    to completion; released, the constrained one finishes too."""
    release = threading.Event()
    real = compiler_module.GrammarCompiler._compile

    def slow(self, params):
        release.wait(30)
        return real(self, params)

    monkeypatch.setattr(compiler_module.GrammarCompiler, "_compile", slow)
    engine = LLM(str(tiny_model), dtype="float32", kv_cache_memory="8MiB", block_size=4).engine
    engine.add_request("slow", {"prompt_token_ids": [5, 6, 7]},
                       constrained(StructuredOutputsParams(choice=["yes", "no"]), **GREEDY_SO))
    engine.add_request("free", {"prompt_token_ids": [8, 9, 10]}, SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    while "free" not in finished:
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert "slow" not in finished and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.tokenizer.decode(finished["slow"].outputs[0].token_ids) in ("yes", "no")


def test_bad_constraints_fail_naming_the_field_and_queue_nothing(llm):
    bad = [
        (dict(json={"type": "object", "properties": {"x": {"type": "strin"}}}), "structured_outputs.json.properties.x.type"),
        (dict(json={"type": "object", "properties": {"x": {"$ref": "#/$defs/none"}}}), "structured_outputs.json"),
        (dict(regex="(unclosed"), "structured_outputs.regex"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    ]
    for fields, param in bad:
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate(["x", "y"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
        assert caught.value.param == param, (fields, caught.value)
    assert not llm.engine.has_unfinished_requests()
    where = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": 3}}},
                                    field="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as caught:
        llm.engine.structured.compiler.compile(where)
    assert caught.value.param == "response_format.json_schema.schema.properties.x.type"


def test_serving_does_not_import_torch_dynamo():
    """The server's imports stay clear of torch._dynamo (and its sympy / networkx), which llguidance.torch
    pulls in: some 120 MB of resident memory and seconds of start-up that a server never uses (the masks are
    filled through llguidance.numpy on the tensor's memory)."""
    code = "import sys, kvreuse.server.app; print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

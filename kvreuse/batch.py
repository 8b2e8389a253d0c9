"""``kvreuse run INPUT.json``: the batch runner, in the system prompt cache's file format.

    {"requests": [{"messages": [...], "save_system_prompt_kv_cache": true, "lora_name": null,
                   "max_tokens": 64, "temperature": 0.0}],
     "available_lora_weights": {}, "apply_chat_template": true}

Every request runs through one engine with continuous batching; a request that saves its system
prompt pins it, and later requests with the same system prompt reuse it with no flag. The output
has, per request, the text and its metrics (prompt, reused, computed and output tokens, TTFT,
end-to-end time, error if any) and a summary (with speculative decoding, the draft's acceptance
figures too: ``spec_decode_*``, as ``LLM.stats()`` names them). A malformed file gets one message
that points at the bad field (``requests[3].messages[0].role``); a bad request fails alone and the
rest run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvreuse.cache.pins import PinSpec
from kvreuse.engine import LLMEngine
from kvreuse.engine_args import add_engine_arguments, llm_from_args
from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor, TokenizedPrompt, validate_messages
from kvreuse.lora.request import LoRARequest
from kvreuse.output_processor import OutputProcessor, step_and_process
from kvreuse.sampling import SamplingParams
from kvreuse.spec.stats import SpecDecodeStats
from kvreuse.system_prompt import leading_system_messages, system_prompt_pin

logger = logging.getLogger("kvreuse")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class BatchMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[BatchMessage] = Field(min_length=1)
    save_system_prompt_kv_cache: bool = False
    lora_name: str | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None


class BatchFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[BatchRequest] = Field(min_length=1)
    available_lora_weights: dict[str, str] = Field(default_factory=dict)
    apply_chat_template: bool = True


class BatchFileError(ValueError):
    """The input file is malformed; the message names the field, e.g. requests[3].messages[0].role."""


def field_path(location: tuple[Any, ...]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[TextPart]", "function-after", "literal_error"):
            continue  # pydantic's union branch names are not fields
        else:
            path += f".{part}" if path else str(part)
    return path


def load_batch_file(path: str | Path) -> BatchFile:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BatchFileError(f"{path}: no such file") from None
    except json.JSONDecodeError as error:
        raise BatchFileError(f"{path}: not valid JSON: {error}") from None
    try:
        return BatchFile.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        raise BatchFileError(f"{path}: {field_path(first['loc'])}: {first['msg']}") from None


def _prompt_of(inputs: InputProcessor, messages: list[dict[str, Any]], apply_chat_template: bool) -> TokenizedPrompt:
    if apply_chat_template:
        return inputs.from_messages(messages)
    # Without the template the messages' texts are joined, and encoded as plain text (bos included).
    return inputs.from_text("\n".join(m["content"] for m in validate_messages(messages)))


def run_batch(engine: LLMEngine, batch: BatchFile) -> dict[str, Any]:
    """Run every request of ``batch``; returns {"results": [...], "summary": {...}}."""
    results: list[dict[str, Any]] = [{"index": i, "error": None} for i in range(len(batch.requests))]
    loras = {name: LoRARequest(name, number, path)
             for number, (name, path) in enumerate(sorted(batch.available_lora_weights.items()), start=1)}
    started = time.monotonic()
    spec_before = _spec_counts(engine.stats().spec_decode)
    pending: dict[str, int] = {}
    outputs = OutputProcessor(engine.tokenizer)  # the batch runs on this thread, like the engine
    for index, request in enumerate(batch.requests):
        where = f"requests[{index}]"
        try:
            lora = None
            if request.lora_name is not None:
                lora = loras.get(request.lora_name)
                if lora is None:
                    raise InvalidRequestError(f"lora_name {request.lora_name!r} is not in available_lora_weights "
                                              f"({', '.join(sorted(loras)) or 'none given'})", "lora_name")
            adapter = engine.adapter_digest(lora)  # a refused adapter fails this request only
            if request.save_system_prompt_kv_cache:  # the specific error first: "must be text only"
                leading_system_messages([m.model_dump(exclude_none=True) for m in request.messages])
            messages = [message.model_dump(exclude_none=True) for message in request.messages]
            prompt = _prompt_of(engine.inputs, messages, batch.apply_chat_template)
            pins: list[PinSpec] = []
            if request.save_system_prompt_kv_cache:
                pins.append(system_prompt_pin(engine.tokenizer, messages, prompt.token_ids, adapter=adapter,
                                              apply_chat_template=batch.apply_chat_template))
            params = SamplingParams(
                temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                max_tokens=request.max_tokens, stop=request.stop, ignore_eos=request.ignore_eos,
            )
            engine.add_request(f"batch-{index}", prompt.as_engine_prompt(), params,
                               cache_salt=request.cache_salt, pins=pins, lora_request=lora)
            outputs.add_request(f"batch-{index}", prompt.token_ids, params)
            pending[f"batch-{index}"] = index
        except ValueError as error:
            results[index]["error"] = f"{where}: {error}"
            logger.warning("%s failed: %s", where, error)

    while engine.has_unfinished_requests():
        for output in step_and_process(engine, outputs):
            if not output.finished or output.request_id not in pending:
                continue
            index = pending.pop(output.request_id)
            completion = output.outputs[0]
            metrics = output.metrics
            results[index].update({
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "metrics": {
                    "prompt_tokens": len(output.prompt_token_ids),
                    "reused_tokens": output.num_cached_tokens,
                    "computed_tokens": len(output.prompt_token_ids) - output.num_cached_tokens,
                    "output_tokens": len(completion.token_ids),
                    "ttft_s": metrics.time_to_first_token,
                    "e2e_s": metrics.e2e_latency,
                },
                "saved_entries": output.pins_saved,
                "hit_entries": output.pins_hit,
            })
            for pin_id in output.pins_saved:
                logger.debug("requests[%d]: saved the system prompt as %s", index, pin_id)
            for pin_id in output.pins_hit:
                logger.debug("requests[%d]: reused saved entry %s", index, pin_id)

    done = [r for r in results if r["error"] is None]
    prompt_tokens = sum(r["metrics"]["prompt_tokens"] for r in done)
    reused = sum(r["metrics"]["reused_tokens"] for r in done)
    summary = {
        "requests": len(results),
        "errors": len(results) - len(done),
        "prompt_tokens": prompt_tokens,
        "reused_tokens": reused,
        "computed_tokens": prompt_tokens - reused,
        "hit_rate": reused / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens": sum(r["metrics"]["output_tokens"] for r in done),
        "elapsed_s": time.monotonic() - started,
        "pins": [pin.as_dict() for pin in engine.list_pins()],
    }
    spec = engine.stats().spec_decode
    if spec is not None and spec_before is not None:  # this batch's share of the engine's counters
        drafts, draft_tokens, per_position = spec_before
        per_position = [now - then for now, then in zip(spec.accepted_per_position, per_position)]
        summary.update(SpecDecodeStats(
            spec.num_speculative_tokens, num_drafts=spec.num_drafts - drafts,
            num_draft_tokens=spec.num_draft_tokens - draft_tokens, num_accepted_tokens=sum(per_position),
            accepted_per_position=per_position,
        ).as_dict())
    return {"results": results, "summary": summary}


def _spec_counts(spec: SpecDecodeStats | None) -> tuple[int, int, list[int]] | None:
    """(drafts, draft tokens, accepted per position) of the engine's speculative decoding so far."""
    if spec is None:
        return None
    return spec.num_drafts, spec.num_draft_tokens, list(spec.accepted_per_position)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvreuse run``: the batch file, where results go, and the engine's options."""
    parser.add_argument("input", help="the batch file (JSON)")
    parser.add_argument("--output", default=None, help="where to write results (default: print them)")
    add_engine_arguments(parser)


def run_command(args: argparse.Namespace) -> int:
    """``kvreuse run``: run the batch file; returns the exit status (2 on a bad file or options)."""
    try:
        batch = load_batch_file(args.input)
        if batch.available_lora_weights:
            args.enable_lora = True  # the file names adapters: LoRA support is implied
        llm = llm_from_args(args)
        result = run_batch(llm.engine, batch)
    except ValueError as error:
        print(f"kvreuse run: error: {error}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text)
        summary = result["summary"]
        acceptance = (f", speculative acceptance rate {summary['spec_decode_acceptance_rate']:.1%}"
                      if "spec_decode_acceptance_rate" in summary else "")
        print(f"{summary['requests']} requests, {summary['errors']} errors, hit rate {summary['hit_rate']:.1%}"
              f"{acceptance}; results in {args.output}")
    else:
        print(text)
    return 0

"""One way out: token ids from the engine become text, stop strings and stream deltas here.

The engine returns token ids and the finishes it can see alone (an eos or stop token, the length
limit). On the caller's side, `OutputProcessor` detokenizes (one `IncrementalDetokenizer` per
sample), finds stop strings, and reports the samples a stop string ended so the caller finishes
them in the engine. The offline API, the batch runner, the OpenAI stream and the Anthropic stream all
read the same processed outputs, so a stop string is cut the same way everywhere.

Streams cannot take back a delta: ``text_delta`` of a processed output holds back the longest end of
the text that could still be the start of a stop string, until the next token shows whether the
stop string follows or the sample finishes.

The processor holds a `Tokenizer` and must stay on one thread (the caller's): Hugging Face fast
tokenizers raise "Already borrowed" when two threads use one object at once. The engine thread
has its own tokenizer object.

Engine outputs are cumulative (all token ids so far), so a consumer that skipped some outputs
still processes every token: the processor remembers how many it has seen.

With a `GenerationMemory` (shared with the thread's `InputProcessor`), every finished sample's text is
recorded with the ids that produced it, less the eos or stop token that ended it, so the next turn of the
conversation encodes that text as those ids and hits the cache through it (kvreuse.inputs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreuse.inputs import GenerationMemory
from kvreuse.outputs import CompletionOutput, RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from kvreuse.engine import LLMEngine


@dataclass
class _SampleText:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_tokens: int = 0  # engine output tokens consumed
    num_released: int = 0  # characters of ``text`` handed out as stream deltas
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_at_stop: int | None = None  # set when a stop string ended the sample here

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _RequestText:
    samples: list[_SampleText]
    memory_scope: str = ""  # its cache salt: the generation memory's scope for its samples


@dataclass
class ProcessedOutput:
    """An engine output with its text, and the samples that a stop string has just ended."""

    output: RequestOutput
    # (sample index, stop string): the caller must finish these in the engine, which cannot see text.
    stopped: list[tuple[int, str]] = field(default_factory=list)


class OutputProcessor:
    """Detokenizes and applies stop strings for the requests of one caller thread."""

    def __init__(self, tokenizer: Tokenizer, generation_memory: GenerationMemory | None = None) -> None:
        self.tokenizer = tokenizer
        self.generation_memory = generation_memory
        self._requests: dict[str, _RequestText] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    memory_scope: str = "") -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already being processed")
        self._requests[request_id] = _RequestText([
            _SampleText(params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                       skip_special_tokens=params.skip_special_tokens))
            for _ in range(params.n)
        ], memory_scope)

    def abort(self, request_id: str) -> None:
        """Forget a request (aborted, or its caller went away)."""
        self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, output: RequestOutput) -> ProcessedOutput:
        state = self._requests[output.request_id]
        stopped: list[tuple[int, str]] = []
        completions: list[CompletionOutput] = []
        for completion in output.outputs:
            sample = state.samples[completion.index]
            was_finished = sample.finished
            delta_ids = self._consume(sample, completion)
            if not was_finished and sample.num_tokens_at_stop is not None:
                stopped.append((completion.index, str(sample.stop_reason)))
            processed_completion = self._completion(sample, completion, delta_ids)
            if not was_finished and sample.finished and self.generation_memory is not None:
                self._remember(processed_completion, state.memory_scope)
            completions.append(processed_completion)
        finished = all(sample.finished for sample in state.samples)
        if finished:
            del self._requests[output.request_id]
        processed = dataclasses.replace(output, outputs=completions, finished=finished)
        return ProcessedOutput(processed, stopped)

    def _remember(self, completion: CompletionOutput, scope: str) -> None:
        """Record a finished sample in the generation memory: its ids less the eos / stop token that ended
        it, when they decode to exactly its text (not when a stop string cut the text, or skipped special
        tokens are missing from it: the text a client sends back would not hold those ids)."""
        assert self.generation_memory is not None
        token_ids = list(completion.token_ids)
        if token_ids and completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
            token_ids.pop()
        if token_ids and self.tokenizer.decode(token_ids, skip_special_tokens=False) == completion.text:
            self.generation_memory.record(completion.text, token_ids, scope)

    def _consume(self, sample: _SampleText, completion: CompletionOutput) -> list[int]:
        """Detokenize the tokens not seen yet; returns them (up to a stop string, if one ends them)."""
        if sample.finished:
            return []
        params = sample.params
        token_ids = completion.token_ids
        consumed: list[int] = []
        while sample.num_tokens < len(token_ids):
            token_id = token_ids[sample.num_tokens]
            sample.num_tokens += 1
            consumed.append(token_id)
            engine_finish = completion.finish_reason if sample.num_tokens == len(token_ids) else None
            delta = sample.detokenizer.add(token_id)
            stopped_by_token = engine_finish == "stop" and isinstance(completion.stop_reason, int)
            if stopped_by_token and not params.include_stop_str_in_output:
                delta = ""  # an eos or stop token ends the text without showing itself
            if engine_finish is not None and not stopped_by_token:
                delta += sample.detokenizer.finish()  # text held back for an incomplete character
            if delta and not stopped_by_token and sample.num_tokens >= params.min_tokens:
                stop_hit = find_stop_string(sample.text, delta, params.stop)
                if stop_hit is not None:
                    stop_string, start = stop_hit
                    end = start + (len(stop_string) if params.include_stop_str_in_output else 0)
                    sample.text = (sample.text + delta)[:end]
                    sample.finish_reason, sample.stop_reason = "stop", stop_string
                    sample.num_tokens_at_stop = sample.num_tokens
                    return consumed
            sample.text += delta
            if engine_finish is not None:
                sample.finish_reason, sample.stop_reason = engine_finish, completion.stop_reason
        return consumed

    def _completion(self, sample: _SampleText, completion: CompletionOutput, delta_ids: list[int]) -> CompletionOutput:
        end = sample.num_tokens_at_stop if sample.num_tokens_at_stop is not None else len(completion.token_ids)
        released_end = len(sample.text) if sample.finished else \
            len(sample.text) - partial_stop_length(sample.text, sample.params.stop)
        text_delta = ""
        if released_end > sample.num_released:
            text_delta = sample.text[sample.num_released:released_end]
            sample.num_released = released_end
        return CompletionOutput(
            index=completion.index, text=sample.text, token_ids=list(completion.token_ids[:end]),
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
            logprobs=list(completion.logprobs[:end]) if completion.logprobs is not None else None,
            text_delta=text_delta, token_ids_delta=delta_ids,
        )


def step_and_process(engine: LLMEngine, processor: OutputProcessor) -> list[RequestOutput]:
    """One engine step with its outputs processed, for callers that run the engine on their own thread
    (LLM, the batch runner); samples ended by a stop string are finished in the engine at once.
    Outputs of requests the processor does not know (added without it) are left out."""
    processed_outputs = []
    last_timing = engine.step_timings[-1] if engine.step_timings else None
    outputs = engine.step()
    start = time.perf_counter()
    for output in outputs:
        if not processor.has_request(output.request_id):
            continue
        processed = processor.process(output)
        for index, stop_string in processed.stopped:
            engine.finish_sequence(output.request_id, index, stop_string)
        processed_outputs.append(processed.output)
    if engine.step_timings and engine.step_timings[-1] is not last_timing:  # a step ran: add its output time
        engine.step_timings[-1].output_s = time.perf_counter() - start
    return processed_outputs


def find_stop_string(text: str, delta: str, stops: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends inside ``delta``: (stop, its index in text + delta)."""
    if not stops:
        return None
    full = text + delta
    best: tuple[str, int] | None = None
    for stop in stops:
        # Only occurrences that end in the new text are new; earlier ones were checked before.
        index = full.find(stop, max(0, len(text) - len(stop) + 1))
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string (held back)."""
    longest = max((len(stop) for stop in stops), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) for stop in stops):
            return length
    return 0

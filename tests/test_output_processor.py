"""The output processor on its own: engine token ids in, text, stop strings and stream deltas out."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.output_processor import (
    OutputProcessor,
    find_stop_string,
    partial_stop_length,
)
from kvreuse.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


def engine_output(request_id: str, token_ids: list[list[int]], finish: list[tuple[str | None, object]] | None = None,
                  ) -> RequestOutput:
    """What the engine returns: cumulative token ids per sample, no text."""
    finish = finish or [(None, None)] * len(token_ids)
    outputs = [CompletionOutput(index=i, token_ids=list(ids), finish_reason=f[0], stop_reason=f[1])  # type: ignore[arg-type]
               for i, (ids, f) in enumerate(zip(token_ids, finish))]
    return RequestOutput(request_id, None, [1, 2, 3], outputs, all(f[0] for f in finish), 0, RequestMetrics(0.0))


def ids_of(tokenizer: Tokenizer, pieces: list[str]) -> list[int]:
    return [token for piece in pieces for token in tokenizer.encode(piece, add_special_tokens=False)]


def test_holdback_and_stop_across_tokens(tokenizer: Tokenizer):
    token_ids = ids_of(tokenizer, ["Hello", " w", "or", "ld", " again"])
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1, 2, 3], SamplingParams(stop=["world"], max_tokens=50))
    deltas, stopped_at = [], None
    for count in range(1, len(token_ids) + 1):
        processed = processor.process(engine_output("r", [token_ids[:count]]))
        deltas.append(processed.output.outputs[0].text_delta)
        if processed.stopped:
            stopped_at = count
            assert processed.stopped == [(0, "world")]
            break
    final = processed.output.outputs[0]
    assert final.text == "Hello " and final.finish_reason == "stop" and final.stop_reason == "world"
    assert "".join(deltas) == "Hello "  # " w" and "or" were held back, then dropped with the stop string
    assert processed.output.finished and stopped_at is not None
    assert final.token_ids == token_ids[:stopped_at]


def test_skipped_outputs_and_extra_tokens_after_a_stop(tokenizer: Tokenizer):
    """A consumer that only saw the newest output, which already has tokens past the stop string."""
    token_ids = ids_of(tokenizer, ["abc", " STOP", " more", " text"])
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(stop=["STOP"], logprobs=None, max_tokens=50))
    processed = processor.process(engine_output("r", [token_ids]))
    completion = processed.output.outputs[0]
    assert completion.text == "abc " and processed.stopped == [(0, "STOP")]
    stop_end = len(ids_of(tokenizer, ["abc", " STOP"]))
    assert completion.token_ids == token_ids[:stop_end]  # tokens after the stop are not the output's


def test_stop_token_hides_itself_and_length_flushes(tokenizer: Tokenizer):
    token_ids = ids_of(tokenizer, ["one", " two"])
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", [1], SamplingParams(max_tokens=50))
    out = processor.process(engine_output("a", [token_ids], [("stop", token_ids[-1])])).output
    without_last = tokenizer.decode(token_ids[:-1])
    assert out.finished and out.outputs[0].text == without_last and out.outputs[0].stop_reason == token_ids[-1]
    processor.add_request("b", [1], SamplingParams(max_tokens=50, include_stop_str_in_output=True))
    out = processor.process(engine_output("b", [token_ids], [("stop", token_ids[-1])])).output
    assert out.outputs[0].text == "one two"
    # A multi-byte character cut by the length limit is flushed (as the replacement character).
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1
    processor.add_request("c", [1], SamplingParams(max_tokens=1))
    out = processor.process(engine_output("c", [emoji[:1]], [("length", None)])).output
    assert out.finished and out.outputs[0].finish_reason == "length" and out.outputs[0].text != ""


def test_one_sample_of_two_stops(tokenizer: Tokenizer):
    stopping = ids_of(tokenizer, ["x", " END", " y"])
    running = ids_of(tokenizer, ["a", " b"])
    processor = OutputProcessor(tokenizer)
    processor.add_request("n2", [1], SamplingParams(n=2, stop=["END"], max_tokens=50))
    processed = processor.process(engine_output("n2", [stopping, running]))
    assert processed.stopped == [(0, "END")] and not processed.output.finished
    later = processor.process(engine_output("n2", [stopping + running, running + running[:1]],
                                            [(None, None), ("length", None)]))
    assert later.stopped == []  # reported once
    assert later.output.finished and later.output.outputs[0].text == "x "
    assert not processor.has_request("n2")


def test_min_tokens_delays_stop_strings(tokenizer: Tokenizer):
    token_ids = ids_of(tokenizer, ["END", " a", " END", " b"])
    processor = OutputProcessor(tokenizer)
    # The first "END" is out before min_tokens: the stop string counts only from there on.
    min_tokens = len(ids_of(tokenizer, ["END"])) + 1
    processor.add_request("m", [1], SamplingParams(stop=["END"], min_tokens=min_tokens, max_tokens=50))
    out = processor.process(engine_output("m", [token_ids])).output.outputs[0]
    assert out.text.startswith("END a ") and out.stop_reason == "END"


def test_text_helpers():
    assert find_stop_string("Hello w", "orld!", ["world", "lo"]) == ("world", 6)
    assert find_stop_string("Hello", " there", ["lo"]) is None  # ended in text already checked
    assert partial_stop_length("abcS", ["STOP", "xy"]) == 1
    assert partial_stop_length("abcST", ["STOP", "xy"]) == 2
    assert partial_stop_length("abcSTa", ["STOP", "xy"]) == 0
    assert partial_stop_length("abc", []) == 0

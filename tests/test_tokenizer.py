"""Tokenizer wrapper, chat template handling and the streaming detokenizer."""

from __future__ import annotations

import json
import shutil
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import cold_cache_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvreuse.inputs
from kvreuse.messages import validate_messages
from kvreuse.model_tools.make_model import ENDOFTEXT, IM_END, IM_START, make_model
from kvreuse.tokenizer import IncrementalDetokenizer, Tokenizer

MIXED_TEXT = (
    "Hello, world! The price is $12.50 (about 11 €).\n"
    "def add(a: int, b: int) -> int:\n    return a + b  # 100% sure\n\n"
    "Café naïve résumé — Zürich, 東京, Привет 🙂🚀 👍🏽 🇯🇵\t{\"k\": [1, 2, 3]}\n"
)
PIECES = ["🙂", "👍🏽", "🇯🇵", "é", "e\u0301", "ß", "東京", "Привет", "—", "…", " ", "\n", "\t", "42", "def x():",
          "{\"a\": 1}", "hello", " world", "<", "|", "'s", "\u00a0", "€"]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", autouse=True)
def kvreuse_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh (cold) kvreuse cache for this module's tests (the session's built kernels linked in), and no
    network for transformers; the session's cache again after them."""
    with cold_cache_env(tmp_path_factory.mktemp("kvreuse-cache")) as cache:
        yield cache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok-model") / "tiny", preset="tiny", write_weights=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def stream(tokenizer: Tokenizer, output_ids: Sequence[int], prompt_ids: Sequence[int] = (),
           skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in output_ids]
    return deltas, detokenizer.finish()


# ----------------------------------------------------------------------------------------------
# Tokenizer


def test_round_trip_on_mixed_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MIXED_TEXT)
    assert tokenizer.decode(ids) == MIXED_TEXT
    assert len(ids) < len(MIXED_TEXT.encode("utf-8"))  # merges happen: a trained BPE, not raw bytes
    # No bos/eos added: this tokenizer's config does not ask for them.
    special_ids = {tokenizer.hf_tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)}
    assert not special_ids & set(ids)


@HYPOTHESIS
@given(text=st.one_of(st.text(max_size=80), st.lists(st.sampled_from(PIECES), max_size=20).map("".join)))
def test_round_trip_any_text_up_to_nfc(tokenizer: Tokenizer, text: str) -> None:
    # Qwen-style tokenizers normalise to NFC; everything else must survive byte-exactly.
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_special_tokens_are_single_ids_and_skippable(tokenizer: Tokenizer) -> None:
    im_start = tokenizer.hf_tokenizer.convert_tokens_to_ids(IM_START)
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == im_start and len([i for i in ids if i == im_start]) == 1
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"{IM_START}user\nhi{IM_END}"


def test_vocab_and_eos_ids(tokenizer: Tokenizer, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert tokenizer.vocab_size == config["vocab_size"]
    im_end = tokenizer.hf_tokenizer.convert_tokens_to_ids(IM_END)
    endoftext = tokenizer.hf_tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    assert tokenizer.eos_token_ids == {im_end, endoftext}


def test_eos_ids_union_with_generation_config(model_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (copy / "config.json").write_text(json.dumps({**json.loads((copy / "config.json").read_text()),
                                                  "eos_token_id": 11}))
    im_end = Tokenizer(copy).hf_tokenizer.convert_tokens_to_ids(IM_END)
    assert Tokenizer(copy).eos_token_ids == {im_end, 7, 9, 11}


def test_out_of_range_ids_decode_to_empty(tokenizer: Tokenizer) -> None:
    hello = tokenizer.encode("hello world")
    vocab = tokenizer.vocab_size
    assert tokenizer.decode([vocab, vocab + 1, 10**9, -1]) == ""
    assert tokenizer.decode([hello[0], vocab + 5, -7, *hello[1:]]) == "hello world"
    assert tokenizer.decode([]) == ""


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template_ids(messages)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    im_start = tokenizer.hf_tokenizer.convert_tokens_to_ids(IM_START)
    assert ids.count(im_start) == 3 and ids[0] == im_start
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_text_parts_are_flattened(tokenizer: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    plain = [{"role": "user", "content": "first\nsecond"}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(plain)
    # Other fields survive, null content becomes "".
    flattened = validate_messages([{"role": "assistant", "content": None, "name": "bot"}])
    assert flattened == [{"role": "assistant", "content": "", "name": "bot"}]
    # The check lives in the leaf module kvreuse.messages; kvreuse.inputs keeps the name for its callers.
    assert kvreuse.inputs.validate_messages is validate_messages


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": "a"},
          {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "image_url", "image_url": {}}]}],
         r"messages\[1\]\.content\[1\].*'image_url'"),
        ([{"content": "no role"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\]\.content\[0\]\.text"),
        (["just a string"], r"messages\[0\]"),
        ([], "at least 1 message"),
        ("hello", "messages must be a list"),
    ],
)
def test_bad_messages_raise_naming_the_place(tokenizer: Tokenizer, messages: object, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_missing_chat_template_raises(model_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(model_dir, tmp_path / "no-template"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(copy).apply_chat_template([{"role": "user", "content": "hi"}])


def test_encode_rejects_non_string(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="text must be a string"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Incremental detokenizer


def test_multibyte_characters_are_held_back_until_complete(tokenizer: Tokenizer) -> None:
    text = "ok 👍🏽🇯🇵 café"
    ids = tokenizer.encode(text)
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == text and tail == ""
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some emoji spans several tokens, so some steps must emit nothing


@HYPOTHESIS
@given(
    text=st.one_of(st.text(max_size=60), st.lists(st.sampled_from(PIECES), max_size=25).map("".join)),
    prompt=st.lists(st.sampled_from(PIECES), max_size=4).map("".join),
)
def test_streaming_text_equals_the_text(tokenizer: Tokenizer, text: str, prompt: str) -> None:
    ids = tokenizer.encode(text)
    deltas, tail = stream(tokenizer, ids, prompt_ids=tokenizer.encode(prompt))
    assert "".join(deltas) + tail == tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert tail == ""  # the text is complete, nothing may stay held back
    assert not any("\ufffd" in delta for delta in deltas)


@HYPOTHESIS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_streaming_random_ids_equals_full_decode(tokenizer: Tokenizer, data: st.DataObject,
                                                 skip_special_tokens: bool) -> None:
    # Random ids produce invalid UTF-8, lone continuation bytes, special tokens and unknown ids.
    id_strategy = st.integers(min_value=-3, max_value=tokenizer.vocab_size + 10)
    output_ids = data.draw(st.lists(id_strategy, max_size=40), label="output")
    prompt_ids = data.draw(st.lists(id_strategy, max_size=10), label="prompt")
    deltas, tail = stream(tokenizer, output_ids, prompt_ids, skip_special_tokens)
    assert "".join(deltas) + tail == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("see 🙂🚀👍🏽 there")
    splits = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert splits, "the emoji must span several tokens for this test to mean anything"
    for k in splits:
        deltas, tail = stream(tokenizer, ids[k:], prompt_ids=ids[:k])
        assert "".join(deltas) + tail == tokenizer.decode(ids[k:])


class DecodeLengthSpy:
    """Stands in for a Tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_output_length(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MIXED_TEXT * 20)
    assert len(ids) > 1000
    spy = DecodeLengthSpy(tokenizer)
    detokenizer = IncrementalDetokenizer(spy, tokenizer.encode("prompt text"))  # type: ignore[arg-type]
    text = "".join(detokenizer.add(token_id) for token_id in ids) + detokenizer.finish()
    assert text == MIXED_TEXT * 20
    # Each step decodes a short window, never the whole output so far.
    assert max(spy.lengths) <= 16
    assert len(spy.lengths) <= 3 * len(ids) + 2

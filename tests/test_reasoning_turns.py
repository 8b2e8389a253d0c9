"""Reasoning turns (issue 39): a template that drops the earlier turns' thinking, and chunk reuse moving the answer.

Qwen3's and DeepSeek-R1's templates render an earlier assistant turn without its ``<think>...</think>``, so
turn N+1's prompt leaves turn N's cached sequence right after the assistant header: its next tokens are turn N's
answer, which the cache holds further along (after the thinking). With ``chunk_reuse`` those tokens are found
there and their K/V moved earlier (``KVCacheManager.match_moved``).

The model is the ``tiny-qwen3-think`` preset (random weights, float32, CPU). Random weights cannot write a
thinking turn, so turn N's cache entry is made the honest way the test can: a prefill of exactly the tokens the
model would have produced (the rendered prompt, then ``<think>...</think>`` and the answer, then
``<|im_end|>``). Every expected count is computed from the token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.model_tools.make_model import (
    CHATML_TEMPLATE,
    IM_END,
    PRESETS,
    QWEN3_THINKING_TEMPLATE,
)

SYSTEM = "You are a careful assistant. Think before you answer."
QUESTION = "Which planet in the solar system is the largest, and how much bigger is it than the Earth?"
THINKING = ("The question asks about the largest planet. Jupiter is the largest by far; its radius is about eleven "
            "times the Earth's and its mass about three hundred times.")
ANSWER = ("Jupiter is the largest planet: about eleven times the Earth's radius and three hundred and eighteen times "
          "its mass.")
OTHER_ANSWER = "Saturn comes second, with rings of ice and rock that reach far beyond its clouds and moons."
FOLLOW_UP = "And which one is the smallest?"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvreuse.model_tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("think") / "tiny-qwen3-think", preset="tiny-qwen3-think",
                      dtype="float32", seed=1)


def make(model: Path, **options) -> LLM:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB")
    settings.update(options)
    return LLM(str(model), **settings)


def greedy(max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generated(thinking: str, answer: str) -> str:
    """What a reasoning model writes after the assistant header (Qwen3's shape)."""
    return f"<think>\n{thinking}\n</think>\n\n{answer}"


def history() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def next_turn(answer: str = ANSWER) -> list[dict]:
    return [*history(), {"role": "assistant", "content": generated(THINKING, answer)},
            {"role": "user", "content": FOLLOW_UP}]


def cache_turn(llm: LLM, answer: str = ANSWER, cache_salt: str | None = None) -> list[int]:
    """Put turn N's whole sequence in the cache (prompt, thinking, answer, <|im_end|>); returns its ids."""
    tokenizer = llm.engine.tokenizer
    prompt = llm.inputs.from_messages(history()).token_ids
    written = tokenizer.encode(generated(THINKING, answer))
    answer_ids = tokenizer.encode(answer)
    assert written[-len(answer_ids):] == answer_ids, "the answer's tokens are the same after the thinking"
    ids = prompt + written + [tokenizer.encode(IM_END)[-1]]
    llm.generate([ids], greedy(), use_tqdm=False, cache_salt=cache_salt)
    llm.engine.check_integrity()
    return ids


def expected_counts(llm: LLM, turn: list[int], answer: str = ANSWER) -> tuple[int, int]:
    """(the prefix turn N+1 shares with turn N, the answer span after it: the answer's ids and <|im_end|>)."""
    following = llm.inputs.from_messages(next_turn(answer)).token_ids
    prefix = next(i for i, (a, b) in enumerate(zip(turn, following)) if a != b)
    answer_ids = llm.engine.tokenizer.encode(answer) + [turn[-1]]
    assert following[prefix:prefix + len(answer_ids)] == answer_ids, "turn N+1 goes on with turn N's answer"
    return prefix, len(answer_ids)


# --- the preset and its template ---------------------------------------------------------------------------------


def test_the_preset_is_qwen3_with_the_thinking_template(think_model: Path) -> None:
    import json

    preset = PRESETS["tiny-qwen3-think"]
    assert preset.arch == "qwen3" and preset.num_hidden_layers >= 3 and preset.thinking_template
    config = json.loads((think_model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == QWEN3_THINKING_TEMPLATE
    assert not any(p.thinking_template for name, p in PRESETS.items() if "think" not in name)


def test_the_template_drops_earlier_thinking_and_nothing_else(think_model: Path) -> None:
    llm = make(think_model, enable_prefix_caching=False)
    tokenizer = llm.engine.tokenizer
    rendered = tokenizer.apply_chat_template(next_turn(), add_generation_prompt=True)
    assert "<think>" not in rendered and THINKING not in rendered
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    # The assistant messages after the last user message (a tool loop within the turn) keep it, as in Qwen3.
    in_turn = [*history(), {"role": "assistant", "content": generated(THINKING, ANSWER)}]
    assert generated(THINKING, ANSWER) in tokenizer.apply_chat_template(in_turn, add_generation_prompt=False)
    # User and system messages are left as they are, <think> and all.
    asked = [{"role": "system", "content": "<think>\nsys\n</think>\n\nS"},
             {"role": "user", "content": "<think>\nx\n</think>\n\nQ"}]
    assert tokenizer.apply_chat_template(asked, add_generation_prompt=True) == (
        "<|im_start|>system\n<think>\nsys\n</think>\n\nS<|im_end|>\n<|im_start|>user\n<think>\nx\n</think>\n\nQ"
        "<|im_end|>\n<|im_start|>assistant\n")
    # Without thinking anywhere, it renders as plain ChatML does.
    plain = [*history(), {"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}]
    hf = tokenizer.hf_tokenizer
    assert (hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, chat_template=CHATML_TEMPLATE)
            == tokenizer.apply_chat_template(plain, add_generation_prompt=True))


# --- turn N+1 reuses turn N's answer -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_reuse", [True, False])
def test_turn_n_plus_1_caches_the_prefix_and_turn_ns_answer(think_model: Path, chunk_reuse: bool) -> None:
    llm = make(think_model, chunk_reuse=chunk_reuse)
    turn = cache_turn(llm)
    prefix, answer = expected_counts(llm, turn)
    out = llm.chat(next_turn(), greedy(4), use_tqdm=False)[0]
    llm.engine.check_integrity()
    if chunk_reuse:
        # The prefix up to the assistant header, and the answer moved in from after the thinking.
        assert out.num_moved_tokens == answer
        assert out.num_cached_tokens == prefix + answer
        assert 0 < out.num_recomputed_tokens < answer  # the blend's default 15%
    else:
        assert out.num_moved_tokens == 0 and out.num_cached_tokens == prefix
    assert len(out.prompt_token_ids) > prefix + answer  # the follow-up question is computed


def test_a_fully_recomputed_moved_turn_gives_full_prefills_tokens(think_model: Path) -> None:
    want = make(think_model, enable_prefix_caching=False).chat(next_turn(), greedy(12), use_tqdm=False)[0]
    llm = make(think_model, chunk_reuse=True, chunk_recompute_fraction=1.0)
    turn = cache_turn(llm)
    prefix, answer = expected_counts(llm, turn)
    got = llm.chat(next_turn(), greedy(12), use_tqdm=False)[0]
    llm.engine.check_integrity()
    assert got.num_moved_tokens == answer and got.num_recomputed_tokens == answer
    assert got.num_cached_tokens == prefix + answer
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_the_answer_is_found_after_the_prompt_was_sent_alone_first(think_model: Path) -> None:
    """Turn N's prompt sent on its own first leaves a prompt-only tail that ties with the block that goes on into
    the turn; the turn is still found, also by a request that copied that tail (which makes it the most recently
    used sibling)."""
    llm = make(think_model, chunk_reuse=True)
    llm.chat(history(), greedy(), use_tqdm=False)
    turn = cache_turn(llm)
    prefix, answer = expected_counts(llm, turn)
    out = llm.chat(next_turn(), greedy(), use_tqdm=False)[0]
    llm.engine.check_integrity()
    assert out.num_moved_tokens == answer and out.num_cached_tokens == prefix + answer
    # Again: the first one's blend was cached under blend keys, so the prompt now continues into it.
    again = llm.chat(next_turn(), greedy(), use_tqdm=False)[0]
    llm.engine.check_integrity()
    assert again.num_cached_tokens >= prefix + answer and again.num_moved_tokens >= answer


def test_an_answer_that_is_not_cached_moves_nothing(think_model: Path) -> None:
    llm = make(think_model, chunk_reuse=True)
    turn = cache_turn(llm, answer=OTHER_ANSWER)  # turn N said something else than the history now holds
    prefix = next(i for i, (a, b) in enumerate(zip(turn, llm.inputs.from_messages(next_turn()).token_ids)) if a != b)
    out = llm.chat(next_turn(), greedy(), use_tqdm=False)[0]
    llm.engine.check_integrity()
    assert out.num_moved_tokens == 0 and out.num_recomputed_tokens == 0
    assert out.num_cached_tokens == prefix


def test_another_tenants_turn_is_never_moved(think_model: Path) -> None:
    llm = make(think_model, chunk_reuse=True)
    turn = cache_turn(llm, cache_salt="tenant-a")
    prefix, answer = expected_counts(llm, turn)
    other = llm.chat(next_turn(), greedy(), use_tqdm=False, cache_salt="tenant-b")[0]
    llm.engine.check_integrity()
    assert other.num_moved_tokens == 0 and other.num_cached_tokens == 0
    unsalted = llm.chat(next_turn(), greedy(), use_tqdm=False)[0]
    llm.engine.check_integrity()
    assert unsalted.num_moved_tokens == 0 and unsalted.num_cached_tokens == 0
    same = llm.chat(next_turn(), greedy(), use_tqdm=False, cache_salt="tenant-a")[0]
    llm.engine.check_integrity()
    assert same.num_moved_tokens == answer and same.num_cached_tokens == prefix + answer


def test_turn_n_plus_2_caches_at_least_what_prefix_caching_alone_does(think_model: Path) -> None:
    cached = {}
    for chunk_reuse in (False, True):
        llm = make(think_model, chunk_reuse=chunk_reuse)
        cache_turn(llm)
        tokenizer = llm.engine.tokenizer
        # Turn N+1 written in full (its prompt holds turn N's answer, moved with chunk reuse), then turn N+2.
        written = tokenizer.encode(generated("Mercury is the smallest planet.", "Mercury is the smallest planet, a "
                                             "little larger than the Moon.")) + [tokenizer.encode(IM_END)[-1]]
        llm.generate([llm.inputs.from_messages(next_turn()).token_ids + written], greedy(), use_tqdm=False)
        third = [*next_turn(), {"role": "assistant", "content": tokenizer.decode(written[:-1])},
                 {"role": "user", "content": "Which of the two is closer to the Sun?"}]
        cached[chunk_reuse] = llm.chat(third, greedy(), use_tqdm=False)[0].num_cached_tokens
        llm.engine.check_integrity()
    assert cached[True] >= cached[False], cached

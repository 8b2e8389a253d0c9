"""Tests for SamplingParams validation and the batched Sampler (CPU, fixed seeds, loose statistics)."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.sampling import Sampler, SamplingParams, SamplingState

DEVICE = torch.device("cpu")


def make_states(params_list: list[SamplingParams], **kwargs) -> list[SamplingState]:
    return [SamplingState.create(params, DEVICE, **kwargs) for params in params_list]


def draw_counts(logits_row: list[float], params: SamplingParams, num_draws: int, rng_seed: int = 0) -> torch.Tensor:
    """Token frequencies from num_draws unseeded rows of the same logits, under a fixed global seed."""
    logits = torch.tensor(logits_row).repeat(num_draws, 1)
    states = make_states([params] * num_draws)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        tokens = Sampler()(logits, states).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits_row)).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens of 16
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1, 2.0]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_value_raises_naming_the_field(field_name: str, value: object) -> None:
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**{field_name: value})


def test_valid_params_are_normalised() -> None:
    params = SamplingParams(stop="###", top_k=-1, temperature=0, logprobs=20)
    assert params.stop == ["###"]
    assert params.stop_token_ids == []
    assert params.top_k == 0
    assert params.greedy
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]
    assert SamplingParams.max_logprobs == 20
    # Boundaries are allowed.
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, min_tokens=16, seed=-5)


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=5e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


# --------------------------------------------------------------------------- greedy and truncation


def logits_with_ties(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    # Row 0 ties its maximum at ids 5 and 9: argmax picks the lowest id.
    logits[0] = 0.0
    logits[0, 5] = logits[0, 9] = 4.0
    return logits


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = logits_with_ties(8, 50, seed=1)
    tokens = Sampler()(logits, make_states([SamplingParams(temperature=0.0)] * 8)).token_ids
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[0] == 5


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)])
def test_extreme_truncation_equals_greedy(params: SamplingParams) -> None:
    logits = logits_with_ties(16, 64, seed=2)
    expected = logits.argmax(dim=-1).tolist()
    for rng_seed in range(3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng_seed)
            tokens = Sampler()(logits, make_states([params] * 16)).token_ids
        if params.min_p == 1.0:  # min_p keeps every tied maximum, so only compare rows without ties
            assert tokens[1:] == expected[1:] and tokens[0] in (5, 9)
        else:
            assert tokens == expected


def test_temperature_sampling_follows_softmax() -> None:
    logits_row = [2.0, 1.0, 0.5, 0.0, -1.0]
    for temperature in (0.7, 2.0):
        counts = draw_counts(logits_row, SamplingParams(temperature=temperature), 20000, rng_seed=3)
        probs = torch.softmax(torch.tensor(logits_row) / temperature, dim=-1)
        # df = 4; 18.5 is the 0.1% critical value. A wrong temperature (e.g. ignoring it) gives hundreds.
        assert chi_square(counts, probs) < 18.5
        assert chi_square(counts, torch.softmax(torch.tensor(logits_row), dim=-1)) > 100


def test_top_k_and_top_p_keep_the_right_tokens_and_renormalise() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits_row = probs.log().tolist()

    counts = draw_counts(logits_row, SamplingParams(top_k=2), 8000, rng_seed=4)
    assert counts[2:].sum() == 0
    assert chi_square(counts[:2], probs[:2] / probs[:2].sum()) < 10.8  # df = 1, 0.1%

    # Mass before token 1 is 0.5 < 0.6 (kept); before token 2 it is 0.8 >= 0.6 (dropped).
    counts = draw_counts(logits_row, SamplingParams(top_p=0.6), 8000, rng_seed=5)
    assert counts[2:].sum() == 0
    assert chi_square(counts[:2], probs[:2] / probs[:2].sum()) < 10.8

    # top-p applies to what top-k left, renormalised: top_k=3 gives [.526, .316, .158]; 0.8 keeps 2.
    counts = draw_counts(logits_row, SamplingParams(top_k=3, top_p=0.8), 8000, rng_seed=6)
    assert counts[2:].sum() == 0


def test_min_p_masks_tokens_below_fraction_of_max() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # Threshold 0.2 * 0.5 = 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    counts = draw_counts(probs.log().tolist(), SamplingParams(min_p=0.2), 10000, rng_seed=7)
    assert counts[3] == 0
    kept = probs[:3] / probs[:3].sum()
    assert chi_square(counts[:3], kept) < 13.8  # df = 2, 0.1%
    # Without min_p token 3 does show up (about 500 times).
    counts = draw_counts(probs.log().tolist(), SamplingParams(), 10000, rng_seed=7)
    assert counts[3] > 300


def test_mixed_batch_each_row_follows_its_params() -> None:
    vocab_size = 40
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
        SamplingParams(seed=1, top_p=0.3),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=1.5),
    ]
    for rng_seed in range(20):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng_seed)
            tokens = Sampler()(logits, make_states(params)).token_ids
        assert tokens[0] == logits[0].argmax()
        assert tokens[3] == logits[3].argmax()
        assert tokens[1] in logits[1].topk(3).indices.tolist()
        assert logits[4, tokens[4]] >= logits[4].max() + math.log(0.5) - 1e-6


# --------------------------------------------------------------------------- seeds


def run_seeded_request(position: int, batch_params: list[SamplingParams], steps: list[torch.Tensor]) -> list[int]:
    """Tokens of the request at `position` (fresh state) over the steps, in a batch with others."""
    states = make_states(batch_params)
    sampler = Sampler()
    tokens = []
    for step_logits in steps:
        batch_logits = torch.randn(len(batch_params), step_logits.shape[0])  # noise for the other rows
        batch_logits[position] = step_logits
        output = sampler(batch_logits, states)
        for state, token in zip(states, output.token_ids):
            state.append(token)
        tokens.append(output.token_ids[position])
    return tokens


def test_seeded_request_is_independent_of_batch_composition_and_position() -> None:
    vocab_size = 200
    generator = torch.Generator().manual_seed(9)
    steps = [torch.randn(vocab_size, generator=generator) for _ in range(12)]
    request = SamplingParams(seed=1234, top_p=0.9, temperature=0.8)

    alone = run_seeded_request(0, [request], steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        crowded = run_seeded_request(
            2,
            [
                SamplingParams(),
                SamplingParams(temperature=0),
                request,
                SamplingParams(seed=99, top_k=5),
                SamplingParams(presence_penalty=1.0, logprobs=3),
            ],
            steps,
        )
        others = [SamplingParams(seed=1), SamplingParams(min_p=0.1), SamplingParams()]
        last = run_seeded_request(3, [*others, request], steps)
    assert alone == crowded == last
    # The draw is really random: a different seed gives a different sequence.
    other_seed = run_seeded_request(0, [SamplingParams(seed=4321, top_p=0.9, temperature=0.8)], steps)
    assert other_seed != alone


def test_sequence_index_offsets_the_seed() -> None:
    logits = torch.zeros(1, 1000)  # uniform: identical draws would be a coincidence
    params = SamplingParams(seed=5)
    first = [Sampler()(logits, [SamplingState.create(params, DEVICE, sequence_index=0)]).token_ids[0] for _ in range(3)]
    assert len(set(first)) == 1  # a fresh state with the same seed repeats itself
    second = Sampler()(logits, [SamplingState.create(params, DEVICE, sequence_index=1)]).token_ids[0]
    third = Sampler()(logits, [SamplingState.create(params, DEVICE, sequence_index=2)]).token_ids[0]
    assert len({first[0], second, third}) == 3


# --------------------------------------------------------------------------- penalties


def all_logprobs(logits_row: list[float], state: SamplingState) -> torch.Tensor:
    """The processed distribution, read back through logprobs covering the whole (tiny) vocabulary."""
    vocab_size = len(logits_row)
    output = Sampler()(torch.tensor([logits_row]), [state])
    result = torch.empty(vocab_size)
    for token_id, logprob in output.logprobs[0].top_logprobs:
        result[token_id] = logprob
    return result


def test_penalties_change_logits_exactly_as_specified() -> None:
    logits_row = [2.0, -1.0, 0.5, 0.0, 3.0]
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=5
    )
    state = SamplingState.create(params, DEVICE, prompt_token_ids=[0, 1])
    for token in (2, 2, 4):
        state.append(token)
    # repetition over prompt+output {0, 1, 2, 4}: positives halve, negatives double;
    # frequency 0.5 * count and presence 0.25 over output tokens only {2: 2, 4: 1}.
    expected = torch.tensor([1.0, -2.0, 0.25 - 1.0 - 0.25, 0.0, 1.5 - 0.5 - 0.25])
    torch.testing.assert_close(all_logprobs(logits_row, state), expected.log_softmax(-1))

    # Incremental counts: one more 4 and a new token 3.
    state.append(4)
    state.append(3)
    expected = torch.tensor([1.0, -2.0, -1.0, 0.0 - 0.5 - 0.25, 1.5 - 1.0 - 0.25])
    torch.testing.assert_close(all_logprobs(logits_row, state), expected.log_softmax(-1))


def test_penalties_only_touch_their_rows_and_not_the_input() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    original = logits.clone()
    penalized = SamplingState.create(SamplingParams(temperature=0, presence_penalty=0.5), DEVICE)
    penalized.append(0)
    plain = SamplingState.create(SamplingParams(temperature=0), DEVICE)
    plain.append(0)
    assert Sampler()(logits, [penalized, plain]).token_ids == [1, 0]
    assert torch.equal(logits, original)


def test_repetition_penalty_covers_prompt_but_presence_does_not() -> None:
    logits_row = [1.0, 1.0, 1.0]
    repetition = SamplingState.create(SamplingParams(repetition_penalty=2.0, logprobs=3), DEVICE, prompt_token_ids=[0])
    presence = SamplingState.create(SamplingParams(presence_penalty=1.0, logprobs=3), DEVICE, prompt_token_ids=[0])
    torch.testing.assert_close(all_logprobs(logits_row, repetition), torch.tensor([0.5, 1.0, 1.0]).log_softmax(-1))
    torch.testing.assert_close(all_logprobs(logits_row, presence), torch.tensor([1.0, 1.0, 1.0]).log_softmax(-1))


def test_prompt_token_outside_vocabulary_is_rejected() -> None:
    state = SamplingState.create(SamplingParams(repetition_penalty=1.1), DEVICE, prompt_token_ids=[0, 7])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler()(torch.zeros(1, 5), [state])


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    eos, stop_id = 3, 1
    logits = torch.tensor([[0.0, 4.0, 1.0, 5.0, 2.0]])  # eos best, stop id second
    state = SamplingState.create(
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop_id]), DEVICE, eos_token_ids=[eos]
    )
    sampler = Sampler()
    tokens = []
    for _ in range(3):
        token = sampler(logits, [state]).token_ids[0]
        state.append(token)
        tokens.append(token)
    assert tokens == [4, 4, eos]
    assert state.is_plain_greedy  # the mask is gone, so the fast path applies again


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0, 5.0, 2.0]])
    state = SamplingState.create(
        SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[3], ignore_eos=True), DEVICE, eos_token_ids=[1]
    )
    assert Sampler()(logits, [state]).token_ids == [1]


def test_min_tokens_mask_holds_for_random_sampling() -> None:
    logits = torch.tensor([[0.0, 0.0, 6.0]]).repeat(500, 1)  # eos (2) would win ~99% of draws
    states = make_states([SamplingParams(min_tokens=1)] * 500, eos_token_ids=[2])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10)
        assert 2 not in Sampler()(logits, states).token_ids


# --------------------------------------------------------------------------- logprobs


def test_logprobs_of_sampled_token_and_sorted_top_k() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(11))
    params = [
        SamplingParams(temperature=0.5, logprobs=5, seed=3),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=20),
    ]
    output = Sampler()(logits, make_states(params))
    log_softmax = logits.log_softmax(-1)  # raw: temperature does not change the reported numbers
    assert output.logprobs[2] is None
    for row in (0, 1, 3):
        entry = output.logprobs[row]
        token = output.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(log_softmax[row, token].item(), abs=1e-5)
        assert entry.rank == int((log_softmax[row] > log_softmax[row, token]).sum()) + 1
        assert len(entry.top_logprobs) == params[row].logprobs
        values = [value for _, value in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        expected_top = log_softmax[row].topk(params[row].logprobs)
        assert [token_id for token_id, _ in entry.top_logprobs] == expected_top.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), expected_top.values)
    assert output.logprobs[3].rank == 1  # greedy picks the most likely token


# --------------------------------------------------------------------------- fast path and inputs


def test_all_greedy_fast_path_matches_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = logits_with_ties(10, 100, seed=12)
    fast_states = make_states([SamplingParams(temperature=0)] * 10)
    assert all(state.is_plain_greedy for state in fast_states)
    # Logprobs on one row force the general path; the tokens must not change.
    general_states = make_states([SamplingParams(temperature=0, logprobs=1)] + [SamplingParams(temperature=0)] * 9)
    general = Sampler()(logits, general_states).token_ids

    def fail(*args, **kwargs):
        raise AssertionError("the all-greedy batch must not reach the general path")

    monkeypatch.setattr(Sampler, "_apply_penalties", fail)
    fast = Sampler()(logits, fast_states)
    assert fast.token_ids == general == logits.argmax(-1).tolist()
    assert fast.logprobs == [None] * 10


def test_bad_shapes_are_rejected_and_empty_batch_is_fine() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), make_states([SamplingParams()]))
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(5), make_states([SamplingParams()]))
    assert Sampler()(torch.zeros(0, 5), []) == ([], [])


def test_half_precision_logits_are_accepted() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0, logprobs=2), SamplingParams()]
    output = Sampler()(logits, make_states(params))
    assert output.token_ids[1] == logits[1].float().argmax()


def test_more_logprobs_than_vocabulary_returns_the_whole_vocabulary() -> None:
    output = Sampler()(torch.tensor([[0.0, 1.0, 2.0]]), make_states([SamplingParams(logprobs=20)]))
    assert [token_id for token_id, _ in output.logprobs[0].top_logprobs] == [2, 1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_and_seeded_rows() -> None:
    device = torch.device("cuda")
    logits = torch.randn(4, 1000, device=device)
    seeded = SamplingParams(seed=7, top_p=0.9)
    params = [SamplingParams(temperature=0), seeded, SamplingParams(), seeded]
    states = [SamplingState.create(p, device) for p in params]
    output = Sampler()(logits, states)
    assert output.token_ids[0] == logits[0].argmax().item()
    # Same seed, same logits, different rows: same token.
    logits[3] = logits[1]
    states = [SamplingState.create(p, device) for p in params]
    output = Sampler()(logits, states)
    assert output.token_ids[1] == output.token_ids[3]
    alone = Sampler()(logits[1:2], [SamplingState.create(params[1], device)]).token_ids[0]
    assert alone == output.token_ids[1]


def test_stop_list_is_capped_and_errors_carry_the_field():
    from kvreuse.errors import InvalidRequestError
    from kvreuse.sampling import MAX_STOP_STRINGS

    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS}") as error:
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert error.value.param == "stop"
    with pytest.raises(ValueError) as error:
        SamplingParams(top_p=0)
    assert isinstance(error.value, InvalidRequestError) and error.value.param == "top_p"

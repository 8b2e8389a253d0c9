"""Prefix-sharing workloads: pure functions of (tokenizer, options, seed).

Every prompt is random words drawn from the tokenizer's own vocabulary, built so that its token
count is exact: the words are single tokens that encode back to themselves and start with a space,
so a byte-level BPE tokenizer splits the text at every word and the concatenation of segments is
the concatenation of their token ids. A tokenizer for which that does not hold (SentencePiece, odd
pre-tokenizers) still gets exact lengths: the final segment of each prompt is grown or shrunk until
the re-encoded prompt has the requested length, so the shared part stays byte-identical.

A workload is a list of ``BenchRequest`` in send order. Multi-turn requests name their conversation
and turn: turn t+1 is sent only after turn t finished, and its prompt holds the real reply text, so
it can only be composed at run time (``compose_prompt`` in the client).

Agent requests (workload ``agent``, parts in agent.py) are chat turns of one agent: the system prompt,
the task and the tool list are fixed by the workload, each later turn also carries the synthetic
result the client returns for the previous turn's tool call; the calls themselves come from the
replies at run time.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from kvreuse.bench.agent import (
    CATALOGUE,
    build_tool_list,
    tools_as_system_text,
    tools_json_text,
)
from kvreuse.inputs import common_prefix_length

WORKLOAD_NAMES = ("shared-prefix", "multi-turn", "rag", "random", "hot-prefix", "agent")

# A word token: a leading space and letters only, so the pre-tokenizer splits text at each one.
_SPACED_WORD = re.compile(r" [A-Za-z]{2,}")
_BARE_WORD = re.compile(r"[A-Za-z]{2,}")
# Below this many word tokens the texts would repeat too often to look like distinct prompts.
MIN_WORD_POOL = 64
# Attempts to reach an exact length by re-encoding (one is enough for byte-level BPE).
MAX_FIT_ROUNDS = 32


class TextTokenizer(Protocol):
    """What the workloads need from a tokenizer (kvreuse.tokenizer.Tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# --------------------------------------------------------------------------------------------------
# Requests and workloads


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    The prompt is ``prefix_text + user_text`` (completions) or a system message ``prefix_text``
    and a user message ``user_text`` (chat). For a multi-turn request the earlier turns of its
    conversation (their user texts and real replies) go between the two.
    """

    request_id: str
    group: str  # the sharing unit: a prefix group, a conversation, a RAG chunk set
    prefix_text: str
    user_text: str
    max_tokens: int
    # Tokens of the prompt as the server counts them (special tokens included); None for turns
    # after the first, whose length depends on the replies.
    prompt_tokens: int | None
    # Tokens this request is built to share with an earlier request (0: none by design; None: a
    # later turn, which shares its whole history, known once the replies are).
    designed_shared_tokens: int | None
    conversation: str | None = None
    turn: int = 0
    # Agent turns: ``prefix_text`` is the system prompt, ``user_text`` the task; the tool list as JSON
    # (None: it is written into the system prompt and no ``tools`` are sent) and the result this turn
    # returns for the previous turn's tool call ("" on turn 0).
    agent: bool = False
    tools_json: str | None = None
    tool_result_text: str = ""

    @property
    def depends_on(self) -> tuple[str, int] | None:
        """(conversation, turn) that must finish before this one is sent."""
        if self.conversation is None or self.turn == 0:
            return None
        return self.conversation, self.turn - 1


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    options: dict[str, Any]
    requests: tuple[BenchRequest, ...]

    def describe(self) -> str:
        settings = ", ".join(f"{key}={value}" for key, value in self.options.items())
        return f"{self.name} ({settings}), {len(self.requests)} requests, seed {self.seed}"


# --------------------------------------------------------------------------------------------------
# Options (defaults: a few minutes on 2 CPU cores with the smollm2-135m preset)


@dataclass(frozen=True)
class SharedPrefixOptions:
    """SGLang's generated-shared-prefix dataset: G groups x P prompts, system S, question Q, output O."""

    num_groups: int = 4
    prompts_per_group: int = 8
    system_prompt_len: int = 1024
    question_len: int = 32
    output_len: int = 16


@dataclass(frozen=True)
class MultiTurnOptions:
    """C conversations x T turns; every turn resends the whole history plus a new user message.
    All conversations start with the same system prompt (0 tokens: none)."""

    num_conversations: int = 4
    num_turns: int = 4
    system_prompt_len: int = 256
    user_len: int = 64
    output_len: int = 32


@dataclass(frozen=True)
class RagOptions:
    """A pool of D chunks of L tokens; each request takes k distinct chunks, Zipf(a) by rank, in the
    order picked (most relevant first), after an optional shared instruction prefix, then a question."""

    num_chunks: int = 32
    chunk_len: int = 256
    top_k: int = 4
    zipf_a: float = 1.2
    question_len: int = 32
    output_len: int = 16
    system_prompt_len: int = 0
    num_requests: int = 48


@dataclass(frozen=True)
class RandomOptions:
    """No sharing at all: the control that shows caching costs nothing."""

    input_len: int = 1024
    output_len: int = 16
    num_requests: int = 32


@dataclass(frozen=True)
class HotPrefixOptions:
    """One hot prefix takes ``hot_fraction`` of the requests, the rest spread over cold prefixes."""

    num_cold_prefixes: int = 4
    hot_fraction: float = 0.8
    prefix_len: int = 1024
    question_len: int = 32
    output_len: int = 16
    num_requests: int = 40


@dataclass(frozen=True)
class AgentOptions:
    """N agents x T turns: a system prompt and a tool list of about ``tools_len`` tokens (shared by all
    agents, or one list per agent group with ``num_tool_sets`` > 1), a task, then T requests that each
    resend the whole history with the previous turn's tool call and a result of ``result_len`` tokens.
    ``no_tools``: the tool list goes into the system prompt and no ``tools`` are sent (a baseline for
    servers without tool calling)."""

    num_agents: int = 4
    num_turns: int = 6
    tools_len: int = 2000
    result_len: int = 300
    output_len: int = 128
    system_prompt_len: int = 128
    task_len: int = 48
    num_tool_sets: int = 1
    no_tools: bool = False


WorkloadOptions = (SharedPrefixOptions | MultiTurnOptions | RagOptions | RandomOptions | HotPrefixOptions
                   | AgentOptions)

OPTIONS_CLASSES: dict[str, type] = {
    "shared-prefix": SharedPrefixOptions,
    "multi-turn": MultiTurnOptions,
    "rag": RagOptions,
    "random": RandomOptions,
    "hot-prefix": HotPrefixOptions,
    "agent": AgentOptions,
}


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Exact-length text


@dataclass(frozen=True)
class Segment:
    token_ids: tuple[int, ...]
    text: str


@dataclass
class PromptBuilder:
    """Random-word text of exact token length for one tokenizer."""

    tokenizer: TextTokenizer
    word_ids: tuple[int, ...]
    word_texts: tuple[str, ...]
    # True when word texts concatenate token-exactly (checked on a sample when built).
    concatenation_is_exact: bool
    # Tokens the tokenizer adds to every encoded text (a bos), counted in every prompt's length.
    special_prefix: tuple[int, ...]
    _word_text_of: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def for_tokenizer(cls, tokenizer: TextTokenizer) -> PromptBuilder:
        ids, texts, spaced = _word_tokens(tokenizer)
        if len(ids) < MIN_WORD_POOL:
            raise ValueError(f"the tokenizer has only {len(ids)} single-token words; at least {MIN_WORD_POOL} "
                             "are needed to build random prompts")
        special_prefix = tuple(tokenizer.encode("", add_special_tokens=True))
        builder = cls(tokenizer, ids, texts, False, special_prefix)
        builder._word_text_of = dict(zip(ids, texts))
        if spaced:
            sample_rng = random.Random(0)
            sample = [sample_rng.choice(ids) for _ in range(512)]
            text = "".join(builder._word_text_of[token_id] for token_id in sample)
            builder.concatenation_is_exact = tokenizer.encode(text, add_special_tokens=False) == sample
        return builder

    def segment(self, rng: random.Random, num_tokens: int) -> Segment:
        """``num_tokens`` random word tokens (exact on their own when concatenation is exact)."""
        token_ids = tuple(rng.choice(self.word_ids) for _ in range(num_tokens))
        return Segment(token_ids, self._text(token_ids))

    def _text(self, token_ids: Sequence[int]) -> str:
        if self.concatenation_is_exact:
            return "".join(self._word_text_of[token_id] for token_id in token_ids)
        # Bare words need separators; a leading space keeps segments apart when concatenated.
        return "".join(" " + self._word_text_of[token_id].strip() for token_id in token_ids)

    def count(self, text: str) -> int:
        """Tokens of ``text`` as a server counts a prompt (special tokens included)."""
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def prompt_segments(self, rng: random.Random, fixed: Sequence[Segment], tail_tokens: int) -> tuple[Segment, int]:
        """A tail segment such that ``fixed + tail`` encodes to exactly
        len(special prefix) + sum(fixed lengths) + tail_tokens tokens; returns (tail, total)."""
        _check_int("tail length", tail_tokens, 1)
        fixed_text = "".join(segment.text for segment in fixed)
        target = len(self.special_prefix) + sum(len(segment.token_ids) for segment in fixed) + tail_tokens
        words = list(self.segment(rng, tail_tokens).token_ids)
        for _ in range(MAX_FIT_ROUNDS):
            tail = Segment(tuple(words), self._text(words))
            total = self.count(fixed_text + tail.text)
            if total == target:
                return tail, total
            if total > target and len(words) > 1:
                del words[-max(1, min(len(words) - 1, total - target)):]
            else:
                words.extend(rng.choice(self.word_ids) for _ in range(max(1, target - total)))
        raise ValueError(f"could not build a prompt of exactly {target} tokens with this tokenizer "
                         f"(last try: {total}); use --prompt-format ids")


def _word_tokens(tokenizer: TextTokenizer) -> tuple[tuple[int, ...], tuple[str, ...], bool]:
    """(ids, texts, spaced): single tokens that are words and encode back to themselves.

    Prefers words with a leading space (byte-level BPE); falls back to bare words (SentencePiece
    decodes a single token without its leading space)."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or (len(hf) if hf is not None else 0))
    if vocab_size <= 0:
        raise ValueError("the tokenizer does not tell its vocabulary size")
    all_ids = list(range(vocab_size))
    if hf is not None:
        texts = hf.batch_decode([[token_id] for token_id in all_ids], skip_special_tokens=True)
    else:
        texts = [tokenizer.decode([token_id]) for token_id in all_ids]
    for pattern, spaced in ((_SPACED_WORD, True), (_BARE_WORD, False)):
        candidates = [(token_id, text) for token_id, text in zip(all_ids, texts) if pattern.fullmatch(text)]
        if not candidates:
            continue
        if hf is not None:
            encoded = hf([text for _, text in candidates], add_special_tokens=False)["input_ids"]
        else:
            encoded = [tokenizer.encode(text, add_special_tokens=False) for _, text in candidates]
        kept = [(token_id, text) for (token_id, text), ids in zip(candidates, encoded) if list(ids) == [token_id]]
        if len(kept) >= MIN_WORD_POOL:
            return tuple(token_id for token_id, _ in kept), tuple(text for _, text in kept), spaced
    return (), (), False


# --------------------------------------------------------------------------------------------------
# Generators


def generate_workload(name: str, tokenizer: TextTokenizer, options: WorkloadOptions, seed: int,
                      num_requests: int | None = None) -> Workload:
    """The workload ``name`` with ``options``; ``num_requests`` truncates a fixed-size workload
    (shared-prefix, multi-turn) or sets the size of the others."""
    if name not in OPTIONS_CLASSES:
        raise ValueError(f"workload must be one of {list(WORKLOAD_NAMES)}, got {name!r}")
    expected_class = OPTIONS_CLASSES[name]
    if not isinstance(options, expected_class):
        raise ValueError(f"workload {name!r} needs {expected_class.__name__}, got {type(options).__name__}")
    _check_int("seed", seed, 0)
    if num_requests is not None:
        _check_int("num_requests", num_requests, 1)
        if hasattr(options, "num_requests"):
            options = replace(options, num_requests=num_requests)
    builder = PromptBuilder.for_tokenizer(tokenizer)
    generator = {
        "shared-prefix": shared_prefix_requests,
        "multi-turn": multi_turn_requests,
        "rag": rag_requests,
        "random": random_requests,
        "hot-prefix": hot_prefix_requests,
        "agent": agent_requests,
    }[name]
    # The name is part of the seed: two workloads with the same --seed must not share text, or a
    # server that ran one would find the other in its cache.
    requests = generator(builder, options, random.Random(f"{name}:{seed}"))  # type: ignore[operator]
    if num_requests is not None and not hasattr(options, "num_requests"):
        if num_requests > len(requests):
            raise ValueError(f"num_requests must be at most {len(requests)} for workload {name!r} "
                             f"(its options make {len(requests)} requests), got {num_requests}")
        requests = requests[:num_requests]
    return Workload(name, seed, asdict(options), tuple(requests))


def _check_prefix_len(name: str, value: int, builder: PromptBuilder) -> None:
    """A shared prefix holds the tokenizer's special prefix (a bos) plus at least one word."""
    _check_int(name, value, len(builder.special_prefix) + 1)


def shared_prefix_requests(builder: PromptBuilder, options: SharedPrefixOptions,
                           rng: random.Random) -> list[BenchRequest]:
    _check_int("gsp_num_groups", options.num_groups, 1)
    _check_int("gsp_prompts_per_group", options.prompts_per_group, 1)
    _check_prefix_len("gsp_system_prompt_len", options.system_prompt_len, builder)
    _check_int("gsp_question_len", options.question_len, 1)
    _check_int("gsp_output_len", options.output_len, 1)
    requests: list[BenchRequest] = []
    for group in range(options.num_groups):
        system = builder.segment(rng, options.system_prompt_len - len(builder.special_prefix))
        for index in range(options.prompts_per_group):
            question, total = builder.prompt_segments(rng, [system], options.question_len)
            requests.append(BenchRequest(
                request_id=f"g{group}-p{index}", group=f"g{group}", prefix_text=system.text,
                user_text=question.text, max_tokens=options.output_len, prompt_tokens=total,
                designed_shared_tokens=options.system_prompt_len,
            ))
    rng.shuffle(requests)
    return _first_sender_shares_nothing(requests, lambda request: request.group)


def _first_sender_shares_nothing(requests: list[BenchRequest], key: Any) -> list[BenchRequest]:
    """The first request of each sharing key *in send order* has nothing to share yet."""
    seen: set[Any] = set()
    marked: list[BenchRequest] = []
    for request in requests:
        if request.designed_shared_tokens is None or key(request) in seen:
            marked.append(request)
        else:
            seen.add(key(request))
            marked.append(replace(request, designed_shared_tokens=0))
    return marked


def multi_turn_requests(builder: PromptBuilder, options: MultiTurnOptions, rng: random.Random) -> list[BenchRequest]:
    _check_int("mt_num_conversations", options.num_conversations, 1)
    _check_int("mt_num_turns", options.num_turns, 1)
    _check_int("mt_system_prompt_len", options.system_prompt_len, 0)
    _check_int("mt_user_len", options.user_len, 1)
    _check_int("mt_output_len", options.output_len, 1)
    fixed: list[Segment] = []
    if options.system_prompt_len:
        _check_prefix_len("mt_system_prompt_len", options.system_prompt_len, builder)
        fixed = [builder.segment(rng, options.system_prompt_len - len(builder.special_prefix))]
    system_text = "".join(segment.text for segment in fixed)
    turns: list[list[BenchRequest]] = [[] for _ in range(options.num_turns)]
    for conversation in range(options.num_conversations):
        for turn in range(options.num_turns):
            if turn == 0:
                message, total = builder.prompt_segments(rng, fixed, options.user_len)
                prompt_tokens: int | None = total
                shared: int | None = options.system_prompt_len
            else:
                # Exact on its own; the whole prompt's length depends on the replies before it, and
                # so does what it shares (the whole history).
                message = builder.segment(rng, options.user_len)
                prompt_tokens = None
                shared = None
            turns[turn].append(BenchRequest(
                request_id=f"c{conversation}-t{turn}", group=f"c{conversation}", prefix_text=system_text,
                user_text=message.text, max_tokens=options.output_len, prompt_tokens=prompt_tokens,
                designed_shared_tokens=shared, conversation=f"c{conversation}", turn=turn,
            ))
    # Turn-major order, conversations shuffled within each turn: the first turns go out together.
    ordered: list[BenchRequest] = []
    for turn_requests in turns:
        rng.shuffle(turn_requests)
        ordered.extend(turn_requests)
    # Only the conversation that starts first has no system prompt to share.
    return _first_sender_shares_nothing(ordered, lambda request: "first turns")


def sample_zipf_without_replacement(rng: random.Random, num_items: int, k: int, a: float) -> list[int]:
    """``k`` distinct items from 0..num_items-1, item i weighted (i + 1) ** -a, in the order drawn."""
    _check_int("rag_top_k", k, 1)
    if k > num_items:
        raise ValueError(f"rag_top_k must be at most rag_num_chunks ({num_items}), got {k}")
    if not a >= 0:
        raise ValueError(f"rag_zipf_a must be >= 0, got {a}")
    remaining = list(range(num_items))
    weights = [(item + 1) ** -a for item in remaining]
    picked: list[int] = []
    for _ in range(k):
        position = rng.choices(range(len(remaining)), weights=weights)[0]
        picked.append(remaining.pop(position))
        weights.pop(position)
    return picked


def rag_requests(builder: PromptBuilder, options: RagOptions, rng: random.Random) -> list[BenchRequest]:
    _check_int("rag_num_chunks", options.num_chunks, 1)
    _check_int("rag_chunk_len", options.chunk_len, 1)
    _check_int("rag_question_len", options.question_len, 1)
    _check_int("rag_output_len", options.output_len, 1)
    _check_int("rag_system_prompt_len", options.system_prompt_len, 0)
    _check_int("num_requests", options.num_requests, 1)
    if options.system_prompt_len:
        _check_prefix_len("rag_system_prompt_len", options.system_prompt_len, builder)
        instructions = [builder.segment(rng, options.system_prompt_len - len(builder.special_prefix))]
    else:
        instructions = []
    chunks = [builder.segment(rng, options.chunk_len) for _ in range(options.num_chunks)]
    requests: list[BenchRequest] = []
    seen_prefixes: list[tuple[int, ...]] = []
    for index in range(options.num_requests):
        picked = sample_zipf_without_replacement(rng, options.num_chunks, options.top_k, options.zipf_a)
        fixed = instructions + [chunks[chunk] for chunk in picked]
        question, total = builder.prompt_segments(rng, fixed, options.question_len)
        # Shared by design: the instructions plus the longest run of leading chunks seen before.
        shared_chunks = max((common_prefix_length(picked, earlier) for earlier in seen_prefixes), default=0)
        shared = (options.system_prompt_len if index > 0 else 0) + shared_chunks * options.chunk_len
        if shared and not options.system_prompt_len:
            shared += len(builder.special_prefix)
        seen_prefixes.append(tuple(picked))
        requests.append(BenchRequest(
            request_id=f"r{index}", group="chunks-" + "-".join(str(chunk) for chunk in picked),
            prefix_text="".join(segment.text for segment in fixed), user_text=question.text,
            max_tokens=options.output_len, prompt_tokens=total, designed_shared_tokens=shared,
        ))
    return requests


def random_requests(builder: PromptBuilder, options: RandomOptions, rng: random.Random) -> list[BenchRequest]:
    _check_int("random_input_len", options.input_len, len(builder.special_prefix) + 1)
    _check_int("random_output_len", options.output_len, 1)
    _check_int("num_requests", options.num_requests, 1)
    requests = []
    for index in range(options.num_requests):
        text, total = builder.prompt_segments(rng, [], options.input_len - len(builder.special_prefix))
        requests.append(BenchRequest(
            request_id=f"r{index}", group=f"r{index}", prefix_text="", user_text=text.text,
            max_tokens=options.output_len, prompt_tokens=total, designed_shared_tokens=0,
        ))
    return requests


def hot_prefix_requests(builder: PromptBuilder, options: HotPrefixOptions, rng: random.Random) -> list[BenchRequest]:
    _check_int("hot_num_cold_prefixes", options.num_cold_prefixes, 0)
    if not 0.0 < options.hot_fraction <= 1.0:
        raise ValueError(f"hot_fraction must be in (0, 1], got {options.hot_fraction}")
    if options.num_cold_prefixes == 0 and options.hot_fraction < 1.0:
        raise ValueError("hot_num_cold_prefixes must be >= 1 when hot_fraction < 1")
    _check_prefix_len("hot_prefix_len", options.prefix_len, builder)
    _check_int("hot_question_len", options.question_len, 1)
    _check_int("hot_output_len", options.output_len, 1)
    _check_int("num_requests", options.num_requests, 1)
    prefixes = {"hot": builder.segment(rng, options.prefix_len - len(builder.special_prefix))}
    for cold in range(options.num_cold_prefixes):
        prefixes[f"cold{cold}"] = builder.segment(rng, options.prefix_len - len(builder.special_prefix))
    # An exact share of the traffic, not a coin per request: the figure the router is tested on.
    num_hot = round(options.hot_fraction * options.num_requests)
    labels = ["hot"] * num_hot + [f"cold{index % max(1, options.num_cold_prefixes)}"
                                  for index in range(options.num_requests - num_hot)]
    rng.shuffle(labels)
    requests = []
    seen: set[str] = set()
    for index, label in enumerate(labels):
        question, total = builder.prompt_segments(rng, [prefixes[label]], options.question_len)
        requests.append(BenchRequest(
            request_id=f"r{index}-{label}", group=label, prefix_text=prefixes[label].text,
            user_text=question.text, max_tokens=options.output_len, prompt_tokens=total,
            designed_shared_tokens=options.prefix_len if label in seen else 0,
        ))
        seen.add(label)
    return requests


def agent_tool_lists(builder: PromptBuilder, options: AgentOptions, rng: random.Random) -> list[list[dict[str, Any]]]:
    """``num_tool_sets`` tool lists of about ``tools_len`` tokens of JSON each: the catalogue in a
    different order per set, so two sets share no prefix."""
    order = list(range(len(CATALOGUE)))
    lists = []
    for _ in range(options.num_tool_sets):
        rng.shuffle(order)
        lists.append(build_tool_list(order, options.tools_len,
                                     lambda text: len(builder.tokenizer.encode(text, add_special_tokens=False)),
                                     lambda num_tokens: builder.segment(rng, num_tokens).text))
    return lists


def agent_requests(builder: PromptBuilder, options: AgentOptions, rng: random.Random) -> list[BenchRequest]:
    _check_int("agent_num_agents", options.num_agents, 1)
    _check_int("agent_num_turns", options.num_turns, 1)
    _check_int("agent_tools_len", options.tools_len, 1)
    _check_int("agent_result_len", options.result_len, 1)
    _check_int("agent_output_len", options.output_len, 1)
    _check_int("agent_system_prompt_len", options.system_prompt_len, 1)
    _check_int("agent_task_len", options.task_len, 1)
    _check_int("agent_num_tool_sets", options.num_tool_sets, 1)
    if options.num_tool_sets > options.num_agents:
        raise ValueError(f"agent_num_tool_sets must be at most agent_num_agents ({options.num_agents}), "
                         f"got {options.num_tool_sets}")
    system = builder.segment(rng, options.system_prompt_len).text
    tool_lists = agent_tool_lists(builder, options, rng)
    turns: list[list[BenchRequest]] = [[] for _ in range(options.num_turns)]
    for agent in range(options.num_agents):
        tools = tool_lists[agent % options.num_tool_sets]
        system_text = system + tools_as_system_text(tools) if options.no_tools else system
        task = builder.segment(rng, options.task_len).text
        for turn in range(options.num_turns):
            turns[turn].append(BenchRequest(
                request_id=f"a{agent}-t{turn}", group=f"tools{agent % options.num_tool_sets}",
                prefix_text=system_text, user_text=task, max_tokens=options.output_len,
                # Both depend on the chat template (and the tool list's rendering) and on the replies.
                prompt_tokens=None, designed_shared_tokens=None, conversation=f"a{agent}", turn=turn, agent=True,
                tools_json=None if options.no_tools else tools_json_text(tools),
                tool_result_text=builder.segment(rng, options.result_len).text if turn else "",
            ))
    # Turn-major order, agents shuffled within each turn (as multi-turn).
    ordered: list[BenchRequest] = []
    for turn_requests in turns:
        rng.shuffle(turn_requests)
        ordered.extend(turn_requests)
    return ordered

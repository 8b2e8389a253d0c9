"""Request: the engine's state for one sequence being generated.

One scheduling model covers every phase: ``num_computed_tokens`` catches up with
``len(all_token_ids)``. A prefix hit starts it higher; a prefill chunk advances it by many tokens; a
decode step by one. Preemption sets it back to 0 (its computed blocks stay cached, so re-admission
hits them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvreuse.cache.chunks import ChunkMissReason, MovedSpan
from kvreuse.cache.prefix import CacheNode
from kvreuse.cache.state_snapshots import SnapshotHit
from kvreuse.sampling import SamplingParams, SamplingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    namespace: bytes  # key of (cache_salt, adapter, model)
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    parent_id: str | None = None  # the user-visible request when n > 1
    index: int = 0  # which of the n completions this is
    sampling_state: SamplingState | None = None  # built by the engine in add_request
    adapter: str | None = None  # digest of the LoRA adapter's weights (None: the base model)
    # Where the prompt's chunks lie, (start, end) token positions in order (kvreuse.inputs, issue 39): with
    # chunk reuse on, each is recorded once computed and looked up at any position in later prompts.
    chunk_spans: tuple[tuple[int, int], ...] = ()
    chunks_recorded: int = 0  # chunk spans already looked at for the chunk index
    # Spans this request's next step reads from elsewhere in the pool (set at admission, taken by the batch
    # builder), and the position from which its K/V is a blend, cached under blend keys only (None: all exact).
    moved_spans: list[MovedSpan] = field(default_factory=list)
    exact_tokens: int | None = None
    # Marked chunks (or their rests) this admission left to compute, and why (issue 64): (start, end, reason).
    chunk_misses: list[tuple[int, int, ChunkMissReason]] = field(default_factory=list)
    num_moved_tokens: int = 0  # prompt tokens whose K/V was moved in from elsewhere (counted as cached)
    num_recomputed_tokens: int = 0  # of those, the ones the blend recomputed

    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Drafted tokens to verify in the next step (speculative decoding). They are not part of
    # all_token_ids: only the ones the target accepts are appended.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafted tokens verified for it (speculative decoding)
    num_accepted_draft_tokens: int = 0  # of those, the ones the target accepted
    num_drafts: int = 0  # verifications of at least one drafted token
    status: RequestStatus = RequestStatus.WAITING

    # KV blocks: block_ids[i] holds tokens [i*bs, (i+1)*bs). The first len(cached_nodes) of them are
    # in the prefix index (hit on admission or inserted when they filled).
    block_ids: list[int] = field(default_factory=list)
    cached_nodes: list[CacheNode] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # chained keys of the full blocks

    # A hybrid's per-sequence recurrent state (Qwen3.5, cache/state_slots.py): its slot in the state pool while it
    # runs; the snapshot lookup of its last match (why fewer tokens than the blocks matched are reused); and where its
    # first prefill chunk stops so its state there is kept as a branch snapshot (None: nowhere).
    state_slot: int | None = None
    state_hit: SnapshotHit | None = None
    branch_at: int | None = None
    # ... and the ends of the prefixes it pins (explicit caching), where its state is kept as a pin snapshot, which
    # retention leaves alone while the pin holds.
    state_marks: list[int] = field(default_factory=list)

    num_cached_tokens: int = -1  # prompt tokens reused at first admission (-1: not admitted yet)
    # KV tiers: blocks below this index were already looked up there; tokens loaded from each tier.
    tier_checked_blocks: int = 0
    tier_checked_state: int = 0  # issue 66: positions up to this one were looked up for a state in the KV tiers
    tier_tokens: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    # Structured outputs: its grammar is still compiling (kvreuse.grammar); the scheduler leaves it waiting.
    waiting_for_grammar: bool = False
    num_times_passed_over: int = 0  # for lpm aging
    arrival_order: int = 0

    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

"""Chunks reused at any position (issue 39, part two): the chunk index, moved K/V, the blend, isolation, reporting.

The engine tests run the tiny float32 models with the cache invariants checked after every step. The
yardsticks of correctness:

- a blend that recomputes every moved token (fraction 1.0) gives the greedy tokens of full prefill, so the
  moves, the narrowed steps and the listed-position attention lose nothing;
- layer 0's K/V depends only on a token and its position, so after a pure shift the moved layer-0 K/V equals
  full prefill's there (the slots, the rotation and the deltas are right);
- no chunk is ever served across tenants, adapters or models, and blended K/V is never reached by exact matching.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

from kvreuse import LLM, SamplingParams
from kvreuse.attention.blend import default_check_layer, resolved_check_layer
from kvreuse.cache.blocks import BlockPool
from kvreuse.cache.chunks import ChunkIndex
from kvreuse.cache.hashing import extend_block_keys, namespace_key
from kvreuse.cache.prefix import PrefixIndex
from kvreuse.lora.request import LoRARequest

MARK = {"type": "ephemeral", "scope": "chunk"}
DOCS = [
    "Orders ship within two working days of payment, from the warehouse nearest to the delivery address, and a "
    "tracking number is sent by email as soon as the parcel leaves.",
    "Gift cards never expire, can be used for any product in the shop, and are refunded to the card, not in cash, "
    "when an order paid with one is returned.",
    "Returns are accepted for thirty days after delivery when the product is unused and in its original box; the "
    "label is free for members and costs five euros otherwise.",
    "Support answers by chat from eight to eight on weekdays and by email at any time, usually within a day, and "
    "phone calls are returned when a ticket asks for one.",
]


def rag(order: list[int], question: str) -> list[dict]:
    parts = [{"type": "text", "text": DOCS[i] + "\n\n", "cache_control": MARK} for i in order]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def checked(llm: LLM) -> LLM:
    """Check the cache core's invariants (chunk index included) after every engine step."""
    engine = llm.engine
    step = engine.step

    def step_and_check():
        outputs = step()
        engine.check_integrity()
        return outputs

    engine.step = step_and_check
    return llm


def make(model: Path, **options) -> LLM:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB")
    settings.update(options)
    return checked(LLM(str(model), **settings))


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> LLM:
    return make(tiny_model, enable_prefix_caching=False)


SEEN, MEASURED = ([0, 1, 2], "Which of these is the longest?"), ([2, 0, 1], "How long does shipping take?")


def seen_then_measured(llm: LLM, **chat) -> object:
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False, **chat)
    return llm.chat(rag(*MEASURED), greedy(), use_tqdm=False, **chat)[0]


def chunk_tokens(llm: LLM, order: list[int], question: str) -> tuple[int, int]:
    """(tokens of the chunks after the first one, start of the second chunk) of that prompt."""
    spans = llm.inputs.from_messages(rag(order, question)).chunk_spans
    return sum(end - start for start, end in spans[1:]), spans[1][0]


# --- the engine -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_recomputing_every_moved_token_gives_full_prefills_tokens(tiny_model: Path, reference: LLM, backend: str) -> None:
    want = reference.chat(rag(*MEASURED), greedy(), use_tqdm=False)[0]
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0, chunk_recompute_fraction=1.0,
               attention_backend=backend)
    got = seen_then_measured(llm)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    spans = llm.inputs.from_messages(rag(*MEASURED)).chunk_spans
    moved = sum(end - start for start, end in spans)  # every section was seen: all three move
    assert got.num_moved_tokens == moved and got.num_recomputed_tokens == moved
    # The template's header before the first section is a prefix hit; the moved sections are cached tokens too.
    assert got.num_cached_tokens == spans[0][0] + moved


def test_the_sliding_window_model_blends_exactly_too(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["gemma3"]  # 16-token windows on five layers of six, a local rope table
    want = make(model, enable_prefix_caching=False).chat(rag(*MEASURED), greedy(), use_tqdm=False)[0]
    got = seen_then_measured(make(model, chunk_reuse=True, chunk_recompute_fraction=1.0))
    assert got.num_moved_tokens > 0 and got.outputs[0].token_ids == want.outputs[0].token_ids


def capture_steps(llm: LLM) -> list:
    """Every ForwardBatch the runner runs, with the layer-0 K/V at its moved slots right after the step."""
    runner = llm.engine.runner
    run = runner.run
    seen: list = []

    def recording(batch, aux_layers=()):
        result = run(batch, aux_layers)
        moved = None
        if batch.moves is not None:
            moved = runner.kv_cache.gather(0, batch.moves.dst, torch.float32)
        seen.append((batch, moved))
        return result

    runner.run = recording
    return seen


def test_a_pure_shift_moves_layer_zero_kv_to_what_full_prefill_computes_there(tiny_model: Path, reference: LLM) -> None:
    full_steps = capture_steps(reference)
    reference.chat(rag(*MEASURED), greedy(1), use_tqdm=False)
    full_batch = full_steps[-1][0]
    full_k, full_v = reference.engine.runner.kv_cache.gather(0, full_batch.slot_mapping, torch.float32)

    llm = make(tiny_model, chunk_reuse=True, chunk_recompute_fraction=0.0)
    steps = capture_steps(llm)
    out = seen_then_measured(llm)
    assert out.num_recomputed_tokens == 0 and out.num_moved_tokens > 0
    batch, (moved_k, moved_v) = next((b, m) for b, m in steps if b.moves is not None)
    # Where each moved token sits in the prompt: full prefill's row for it (one fresh prefill: row = position).
    positions = batch.positions[batch.blend.moved_rows]
    assert bool((batch.moves.deltas != 0).any()), "the sections moved"
    torch.testing.assert_close(moved_v, full_v[positions], rtol=0, atol=0)  # V carries no position
    torch.testing.assert_close(moved_k, full_k[positions], rtol=1e-5, atol=1e-5)  # one more rounding of the turn


def test_a_pure_shift_narrows_the_step_to_the_rows_it_computes(tiny_model: Path) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_recompute_fraction=0.0, chunk_recompute_first=3)
    out = seen_then_measured(llm)
    spans = llm.inputs.from_messages(rag(*MEASURED)).chunk_spans
    assert out.num_moved_tokens == sum(end - start for start, end in spans)
    assert out.num_recomputed_tokens == 3 * len(spans)  # EPIC-style: the first 3 tokens of each moved section


def test_blended_kv_is_cached_apart_and_chunks_come_from_exact_blocks(tiny_model: Path) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0)
    first = seen_then_measured(llm)
    prompt = llm.inputs.from_messages(rag(*MEASURED))
    spans = prompt.chunk_spans
    kv = llm.engine.kv
    # Exact matching never reaches the blend's blocks: they are keyed under their own chain, sent to no router.
    blended = [node for node in kv.index.iter_nodes() if node.blended]
    assert blended
    namespace = next(iter(kv.index.roots))  # the one namespace of this engine's requests
    keys: list[bytes] = []
    extend_block_keys(keys, namespace, prompt.token_ids, kv.block_size)
    exact = kv.index.match(namespace, prompt.token_ids, keys, len(prompt.token_ids) - 1)
    assert exact.num_tokens <= spans[0][0] and not any(node.blended for node in exact.nodes)
    assert exact.partial is None or not exact.partial.node.blended
    stored = {event.key for event in kv.index.events._events if event.type == "stored"}
    assert stored and not stored & {node.key for node in blended}
    hits_before, moved_before = kv.hit_tokens, kv.moved_tokens
    again = llm.chat(rag(*MEASURED), greedy(), use_tqdm=False)[0]
    # The same prompt again: its exact hit stops where the blend began, and it continues into the blended blocks.
    assert kv.hit_tokens - hits_before <= spans[0][0]
    assert again.num_cached_tokens >= first.num_cached_tokens - 1 and kv.moved_tokens > moved_before
    assert again.num_moved_tokens == again.num_cached_tokens - (kv.hit_tokens - hits_before)
    assert len(kv.chunks) == 3  # the seen prompt's three sections; none recorded from the blended prompts


def test_a_chunk_seen_only_after_a_blend_is_computed_and_a_new_one_is_not_moved(tiny_model: Path) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0)
    llm.chat(rag([0, 1], "First?"), greedy(2), use_tqdm=False)
    out = llm.chat(rag([1, 3, 0], "Second?"), greedy(2), use_tqdm=False)[0]
    spans = llm.inputs.from_messages(rag([1, 3, 0], "Second?")).chunk_spans
    moved = [spans[0], spans[2]]  # sections 1 and 0 were seen; section 3 is new and computed
    assert out.num_moved_tokens == sum(end - start for start, end in moved)


# Issue 64: RAG prompts whose documents are labelled in unmarked parts ("Document 2:") and marked as chunks, each
# document seen alone first, under its own label. The documents begin alike ("Section: ..."), so a prompt whose
# first document is not document 1 still hits document 1's alone prompt through "Document 1:\nSection:", a few
# tokens into its own first document. That document's rest must be read from its chunk source all the same.
SECTIONS = [f"Section: {title}\n\n{text}" for title, text in zip(("shipping", "gift cards", "returns", "support"), DOCS)]
COMBINED = ([3, 2, 1, 0], [1, 0, 3, 2])  # the first starts with another document than "Document 1:" held alone


def labelled(items: list[tuple[int, int]], question: str) -> list[dict]:
    """A user message of (label, section) pairs: "Document N:" in an unmarked part, the section in a marked one."""
    parts = []
    for label, i in items:
        parts += [{"type": "text", "text": f"Document {label}:\n"},
                  {"type": "text", "text": SECTIONS[i] + "\n\n", "cache_control": MARK}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def combined(order: list[int]) -> list[dict]:
    return labelled(list(enumerate(order, 1)), "Which one is about returns?")


def seen_alone(llm: LLM) -> None:
    for i in range(len(SECTIONS)):
        llm.chat(labelled([(i + 1, i)], "Summarize."), greedy(1), use_tqdm=False)


def test_documents_seen_alone_are_reused_whole_when_the_prefix_hit_ends_inside_one(tiny_model: Path,
                                                                                    reference: LLM) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0, chunk_recompute_fraction=1.0)
    seen_alone(llm)
    for order in COMBINED:
        messages = combined(order)
        spans = llm.inputs.from_messages(messages).chunk_spans
        moved_before = dict(llm.engine.drift_report()["moved"]["chunk"])
        out = llm.chat(messages, greedy(), use_tqdm=False)[0]
        hit = out.num_cached_tokens - out.num_moved_tokens  # the prefix cache's share
        assert spans[0][0] < hit < spans[0][1], "the prefix hit ends inside the first document (the case)"
        # Every document is reused: the template's header and the first document's first tokens from the
        # prefix cache, the rest of every document moved from where it was computed alone. Only the labels
        # between them and the question are computed.
        documents = sum(end - start for start, end in spans)
        assert out.num_cached_tokens == spans[0][0] + documents, order
        report = llm.engine.drift_report()
        moved = report["moved"]["chunk"]
        assert moved["spans"] - moved_before["spans"] == len(spans)  # from the chunk index, none as a moved turn
        assert report["chunk_misses"]["not_indexed"]["spans"] == len(SECTIONS)  # the alone prompts' only
        # The promise a blend keeps: recomputing every moved token gives full prefill's greedy tokens.
        want = reference.chat(messages, greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids, order


def test_the_rest_of_a_document_the_hit_ran_into_is_moved_from_the_same_offset(tiny_model: Path,
                                                                              reference: LLM) -> None:
    messages = combined(COMBINED[0])
    full_steps = capture_steps(reference)
    reference.chat(messages, greedy(1), use_tqdm=False)
    full_k, full_v = reference.engine.runner.kv_cache.gather(0, full_steps[-1][0].slot_mapping, torch.float32)

    llm = make(tiny_model, chunk_reuse=True, chunk_recompute_fraction=0.0)  # a pure shift: nothing recomputed
    seen_alone(llm)
    steps = capture_steps(llm)
    out = llm.chat(messages, greedy(1), use_tqdm=False)[0]
    spans = llm.inputs.from_messages(messages).chunk_spans
    assert out.num_recomputed_tokens == 0 and out.num_cached_tokens == spans[0][0] + sum(e - s for s, e in spans)
    batch, (moved_k, moved_v) = next((b, m) for b, m in steps if b.moves is not None)
    positions = batch.positions[batch.blend.moved_rows]
    assert spans[0][0] < int(positions.min()) < spans[0][1]  # the first document's rest is among the moved tokens
    # Layer 0's K/V depends only on the token and its position: read from the right source slots and turned by
    # the right delta, it is full prefill's there.
    torch.testing.assert_close(moved_v, full_v[positions], rtol=0, atol=0)
    torch.testing.assert_close(moved_k, full_k[positions], rtol=1e-5, atol=1e-5)


def test_evicted_sources_are_misses_not_stale_reads(tiny_model: Path) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0)
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False)
    llm.reset_prefix_cache()  # every idle block evicted: the chunk entries' sources are gone
    out = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False)[0]
    assert out.num_moved_tokens == 0 and out.num_cached_tokens == 0
    assert len(llm.engine.kv.chunks) == 3  # the measured prompt's own sections, computed in full and recorded
    # The drift report says why the sections were computed (issue 64).
    spans = llm.inputs.from_messages(rag(*MEASURED)).chunk_spans
    misses = llm.engine.drift_report()["chunk_misses"]
    assert misses["evicted"] == {"spans": 3, "tokens": sum(end - start for start, end in spans)}
    assert misses["not_indexed"]["spans"] == 3  # the seen prompt's, before anything was recorded


def test_a_prompt_past_one_steps_budget_runs_without_moves_and_says_so(tiny_model: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # A blend runs the rest of its prompt in one step (docs/chunks.md, Limits); a smaller budget takes no moves.
    spans = make(tiny_model).inputs.from_messages(rag(*MEASURED)).chunk_spans
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0, max_num_batched_tokens=spans[-1][0])
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False)
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        out = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False)[0]
    assert out.num_moved_tokens == 0 and out.num_cached_tokens < spans[0][0] + 1
    misses = llm.engine.drift_report()["chunk_misses"]["step_budget"]
    assert misses == {"spans": 3, "tokens": sum(end - start for start, end in spans)}
    lines = [record.getMessage() for record in caplog.records if " computed: " in record.getMessage()]
    assert len(lines) == 3 and all("--max-num-batched-tokens" in line for line in lines)


def test_off_by_default(tiny_model: Path) -> None:
    llm = make(tiny_model)
    out = seen_then_measured(llm)
    assert out.num_moved_tokens == 0 and len(llm.engine.kv.chunks) == 0


# --- isolation ------------------------------------------------------------------------------------------------


def test_no_chunk_hit_across_tenants(tiny_model: Path) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0)
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False, cache_salt="tenant-a")
    other = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False, cache_salt="tenant-b")[0]
    assert other.num_moved_tokens == 0 and other.num_cached_tokens == 0
    same = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False, cache_salt="tenant-a")[0]
    assert same.num_moved_tokens > 0  # the control: the tenant that saw the sections hits


def test_no_chunk_hit_across_adapters(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from test_lora import make_adapter

    model = tiny_models["llama"]
    adapter = make_adapter(model, tmp_path / "adapter", seed=1)
    llm = make(model, chunk_reuse=True, chunk_check_layer=0, enable_lora=True, max_lora_rank=16)
    lora = LoRARequest("a", 1, str(adapter))
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False, lora_request=lora)
    base = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False)[0]
    assert base.num_moved_tokens == 0
    adapted = llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False, lora_request=lora)[0]
    assert adapted.num_moved_tokens > 0  # the control: the same adapter hits (and blends with its deltas)


def test_the_chunk_index_verifies_tokens_namespaces_and_liveness() -> None:
    pool = BlockPool(8)
    index = PrefixIndex(pool, 4)
    ns = namespace_key(model="model-a")
    tokens = list(range(100, 110))  # positions 2..11: blocks 0, 1, 2 of a 12-token sequence
    sequence = [1, 2, *tokens]
    nodes, parent = [], None
    for block in range(3):
        block_id = pool.allocate(1)[0]
        parent = index.insert(ns, parent, bytes([block]) * 16, sequence[block * 4:(block + 1) * 4], block_id)
        nodes.append(parent)
        pool.release(block_id)
    index.release(nodes)  # idle: evictable, leaf first
    chunks = ChunkIndex(4)
    chunks.record(ns, tokens, 2, nodes)
    source = chunks.lookup(ns, tokens)
    assert source is not None and source.slots(4)[:3] == [nodes[0].block_id * 4 + 2, nodes[0].block_id * 4 + 3,
                                                         nodes[1].block_id * 4]
    assert chunks.lookup(namespace_key(model="model-b"), tokens) is None  # another model (or tenant, adapter)
    assert chunks.lookup(ns, tokens[:-1] + [7]) is None
    with pytest.raises(ValueError, match="needs 3 cached blocks"):
        chunks.record(ns, tokens, 2, nodes[:2])
    with pytest.raises(ValueError, match="holding its tokens"):
        chunks.record(ns, [9] * 10, 2, nodes)
    index.evict(3)  # the chain's blocks go: the entry is dead, dropped at its next lookup
    assert chunks.lookup(ns, tokens) is None and len(chunks) == 0 and chunks.num_dead == 1


def test_token_verification_catches_a_key_collision(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvreuse.cache.chunks as chunks_module

    pool = BlockPool(4)
    index = PrefixIndex(pool, 4)
    block_id = pool.allocate(1)[0]
    node = index.insert(b"ns", None, b"k" * 16, [1, 2, 3, 4], block_id)
    monkeypatch.setattr(chunks_module, "chunk_key", lambda namespace, tokens: b"same")
    chunks = ChunkIndex(4)
    chunks.record(b"ns", [1, 2, 3, 4], 0, [node])
    assert chunks.lookup(b"ns", [5, 6, 7, 8]) is None  # the same key, other tokens: a miss
    assert chunks.lookup(b"ns", [1, 2, 3, 4]) is not None


# --- configuration and reporting --------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"chunk_recompute_fraction": 1.5}, "chunk_recompute_fraction must be between 0 and 1"),
    ({"chunk_check_layer": -1}, "chunk_check_layer must be >= 0"),
    ({"chunk_recompute_first": -2}, "chunk_recompute_first must be >= 0"),
    ({"enable_prefix_caching": False}, "chunk_reuse needs prefix caching"),
    ({"chunk_check_layer": 1}, "chunk_check_layer must be below 1"),  # the tiny model has 2 layers
])
def test_bad_settings_are_refused_naming_the_field(tiny_model: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="16MiB", chunk_reuse=True, **options)


@pytest.mark.parametrize(("layers", "expected"), [(30, 3), (24, 2), (64, 6), (2, 0), (3, 0), (1, 0)])
def test_the_default_check_layer_is_a_tenth_of_the_depth_below_the_last_layer(layers: int, expected: int) -> None:
    assert default_check_layer(layers) == expected
    assert resolved_check_layer(None, layers) == expected and resolved_check_layer(5, layers) == 5


def test_an_engine_left_to_the_defaults_resolves_its_check_layer_from_its_model(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="16MiB", chunk_reuse=True)
    assert llm.engine.config.cache.chunk_check_layer is None
    assert llm.engine.blend.check_layer == 0 and llm.engine.blend.recompute_fraction == 0.3  # 2 layers


def test_debug_log_names_chunk_hits(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    llm = make(tiny_model, chunk_reuse=True, chunk_check_layer=0)
    llm.chat(rag(*SEEN), greedy(2), use_tqdm=False)
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        llm.chat(rag(*MEASURED), greedy(2), use_tqdm=False)
    lines = [record.getMessage() for record in caplog.records if "chunk hit" in record.getMessage()]
    assert len(lines) == 3 and all("moved in from position" in line for line in lines)
    report = llm.engine.drift_report()
    assert report["moved"]["chunk"]["spans"] == 3 and report["moved"]["chunk"]["tokens"] > 0
    counters = llm.engine.hit_counters()["shared"]
    assert counters["moved_tokens"] == report["moved"]["chunk"]["tokens"]


@pytest.fixture(scope="module")
def chunk_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("chunk-reuse") / "server.log", "--stats-log-interval",
                           "0", "--chunk-reuse", "--chunk-check-layer", "0", "--chunk-recompute-fraction", "0.5")
    yield running
    stop_server(running)


def test_openai_usage_counts_moved_and_recomputed_tokens(chunk_server: RunningServer, tiny_model: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{chunk_server.base_url}/v1", api_key="none")
    ask = lambda order, question: client.chat.completions.create(  # noqa: E731
        model=MODEL_NAME, messages=rag(order, question), max_tokens=2, temperature=0, extra_body={"cache_salt": "openai"})
    ask(*SEEN)
    usage = ask(*MEASURED).usage
    details = usage.prompt_tokens_details.model_extra
    moved, recomputed = details["kvreuse_moved_tokens"], details["kvreuse_recomputed_tokens"]
    assert moved > 0 and 0 < recomputed <= moved // 2 + 3  # ceil(0.5 x each sequence's moved rows)
    assert moved <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    metrics = httpx.get(f"{chunk_server.base_url}/metrics", timeout=30).text
    assert f'kvreuse:prompt_tokens_moved_total{{model_name="{MODEL_NAME}"}} {float(moved)}' in metrics


def test_anthropic_usage_counts_moved_document_tokens(chunk_server: RunningServer) -> None:
    from anthropic import Anthropic

    client = Anthropic(base_url=chunk_server.base_url, api_key="none")

    def ask(order: list[int], question: str):
        blocks = [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": DOCS[i]},
                   "cache_control": MARK} for i in order]
        return client.messages.create(model=MODEL_NAME, max_tokens=2,
                                      messages=[{"role": "user", "content": [*blocks, {"type": "text", "text": question}]}])

    ask(*SEEN)
    usage = ask(*MEASURED).usage
    extra = usage.model_extra
    assert extra["kvreuse_moved_input_tokens"] > 0
    assert 0 < extra["kvreuse_recomputed_input_tokens"] <= extra["kvreuse_moved_input_tokens"]
    assert usage.cache_read_input_tokens >= extra["kvreuse_moved_input_tokens"]

"""The recurrent-state snapshots' index (kvreuse/cache/state_snapshots.py, issue 66): a snapshot ends exactly the
prefix it was taken on (anchored at a block's node, its tail compared token by token), a lookup resumes from the
deepest one at or before a match and explains the tokens it leaves to recompute, the budget holds, and the
``saved`` policy keeps what many requests hit where LRU keeps what came last. The invariants are checked after
every change."""

from __future__ import annotations

import pytest

from kvreuse.cache.blocks import BlockPool
from kvreuse.cache.hashing import block_key
from kvreuse.cache.prefix import CacheNode, PrefixIndex
from kvreuse.cache.state_snapshots import StateSnapshots

BLOCK = 4
STATE = 100  # bytes a snapshot


def cache(index: PrefixIndex, namespace: bytes, tokens: list[int]) -> tuple[CacheNode, list[CacheNode]]:
    """Insert ``tokens``' full blocks; returns the namespace's root and the path's nodes."""
    parent, key, nodes = None, namespace, []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        block = tokens[start:start + BLOCK]
        key = block_key(key, block)
        held = parent if parent is not None else index.roots.get(namespace)
        node = held.children.get(key) if held is not None else None
        if node is None:
            node = index.insert(namespace, parent, key, block, index.pool.allocate(1)[0])
        nodes.append(node)
        parent = node
    return index.roots[namespace], nodes


def anchor_of(root: CacheNode, nodes: list[CacheNode], position: int) -> CacheNode:
    return nodes[position // BLOCK - 1] if position >= BLOCK else root


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(BlockPool(512), BLOCK)


def test_a_lookup_resumes_from_the_deepest_snapshot_at_or_before_the_match(index):
    tokens = list(range(10, 30))
    root, nodes = cache(index, b"ns", tokens)
    snapshots = StateSnapshots(BLOCK, 10 * STATE)
    for position in (6, 13):  # inside the second block, inside the fourth
        kept, dropped = snapshots.add(anchor_of(root, nodes, position), tokens[position // BLOCK * BLOCK:position],
                                      STATE, f"slot-{position}", "chunk")
        assert kept is not None and kept.position == position and not dropped
        snapshots.check_integrity()
    hit = snapshots.lookup(root, nodes, tokens, 13)
    assert (hit.resume, hit.explanation) == (13, None)
    hit = snapshots.lookup(root, nodes[:3], tokens, 12)  # the match ends before 13: 6 is the deepest before it
    assert hit.snapshot is not None and hit.snapshot.handle == "slot-6"
    assert hit.explanation == "state not kept at token 12: nearest snapshot at 6, 6 tokens recomputed"
    assert snapshots.lookup(root, nodes[:1], tokens, 5).explanation == \
        "no state kept on this prefix: 5 matched tokens recomputed"


def test_a_snapshot_serves_only_the_prefix_it_ends(index):
    tokens = list(range(10, 30))
    root, nodes = cache(index, b"ns", tokens)
    other = tokens[:13] + [99] + tokens[14:]  # the same blocks up to 12, another token at 13
    snapshots = StateSnapshots(BLOCK, 10 * STATE)
    snapshots.add(nodes[2], tokens[12:14], STATE, "after-14", "finish")  # the state after tokens[:14]
    assert snapshots.lookup(root, nodes, tokens, 16).resume == 14
    assert snapshots.lookup(root, nodes[:3], other, 13).resume == 0  # its tail differs at 13
    # Another namespace's root never reaches this anchor, even with the same tokens.
    other_root, other_nodes = cache(index, b"other", tokens)
    assert snapshots.lookup(other_root, other_nodes, tokens, 16).snapshot is None


def test_the_budget_holds_and_lru_drops_the_least_recently_used(index):
    tokens = list(range(100, 140))
    root, nodes = cache(index, b"ns", tokens)
    snapshots = StateSnapshots(BLOCK, 2 * STATE, policy="lru")
    snapshots.add(nodes[0], [], STATE, "a", "chunk")
    second, _ = snapshots.add(nodes[1], [], STATE, "b", "chunk")
    snapshots.lookup(root, nodes[:1], tokens, 4)  # the first is used again
    third, dropped = snapshots.add(nodes[2], [], STATE, "c", "chunk")
    assert dropped == [second] and third is not None
    assert snapshots.num_bytes == 2 * STATE
    snapshots.check_integrity()
    assert snapshots.add(nodes[3], [], 3 * STATE, "d", "chunk") == (None, [])  # larger than the whole budget
    assert snapshots.add(nodes[0], [], STATE, "a again", "chunk") == (None, [])  # already kept: the caller frees
    with pytest.raises(ValueError, match="shorter than a block"):
        snapshots.add(nodes[0], tokens[4:8], STATE, "e", "chunk")


def test_saved_keeps_the_shared_system_prompt_where_lru_keeps_the_last_answers(index):
    """A 12-token system prompt and questions of 24 tokens after it; each request leaves snapshots at two chunk ends
    and where it ended. With room for three, LRU drops the system prompt's end as soon as one request's three came
    after it; ``saved`` keeps it, because every question hit it and it saves more tokens than any other."""
    system = list(range(200, 212))
    hits = {}
    for policy in ("lru", "saved"):
        namespace = b"ns-" + policy.encode()
        snapshots = StateSnapshots(BLOCK, 3 * STATE, policy=policy)
        root, nodes = cache(index, namespace, system)
        snapshots.add(nodes[-1], [], STATE, "system", "pin")
        hits[policy] = 0
        for question in range(6):
            tokens = system + [300 + question + step for step in range(24)]
            root, path = cache(index, namespace, tokens)
            hits[policy] += snapshots.lookup(root, path, tokens, 12).resume == 12
            for position, reason in ((20, "chunk"), (28, "chunk"), (36, "finish")):
                snapshots.add(path[position // BLOCK - 1], [], STATE, f"{question}@{position}", reason)
                snapshots.check_integrity()
    assert hits == {"lru": 1, "saved": 6}


def test_an_evicted_nodes_snapshots_go_with_it(index):
    tokens = list(range(40, 52))
    _, nodes = cache(index, b"ns", tokens)
    snapshots = StateSnapshots(BLOCK, 10 * STATE)
    snapshots.add(nodes[1], [48, 49], STATE, "x", "branch")
    nodes[2].evicted = True  # as PrefixIndex._remove marks a node it gives up
    snapshots.check_integrity()  # nothing anchored there
    nodes[1].evicted = True
    with pytest.raises(RuntimeError, match="evicted node"):
        snapshots.check_integrity()
    assert [snapshot.handle for snapshot in snapshots.drop_node(nodes[1])] == ["x"]
    snapshots.check_integrity()
    assert snapshots.num_bytes == 0


def test_a_state_read_back_from_a_tier_takes_a_free_slot_and_its_bytes_go_in_order_with_the_copies(index):
    """StateSlots.load (issue 66, the KV tiers): the state becomes a snapshot (reason "tier") in a free slot, its bytes
    queued as a copy after the ones asked for before it; with the snapshot budget all held by pinned prefixes'
    states, nothing is loaded and no slot is taken."""
    from kvreuse.cache.state_slots import StateCopy, StateSlots

    tokens = list(range(10, 30))
    root, nodes = cache(index, b"ns", tokens)
    slots = StateSlots(BLOCK, num_slots=3, max_running=2, slot_bytes=STATE)  # room for one snapshot
    running = slots.start(None)
    loaded = slots.load(nodes[1], tokens[8:9], b"state-bytes")
    assert loaded is not None and (loaded.reason, loaded.position) == ("tier", 9) and slots.num_loaded == 1
    assert slots.take_copies() == [StateCopy(None, running), StateCopy(None, loaded.handle, b"state-bytes")]
    assert slots.load(nodes[1], tokens[8:9], b"again") is None  # kept already: the caller resumes from it
    slots.check_integrity([running])

    index.pin(nodes[:2])  # a pinned prefix's state takes the one snapshot's room and is never dropped for a load
    slots.clear()
    slots.branch(nodes[1], [], running, "pin")
    other = slots.start(None)  # both running: no slot is lent to the snapshots
    assert slots.load(nodes[2], tokens[12:13], b"state-bytes") is None
    assert slots.num_free == 0 and slots.num_loaded == 1
    slots.check_integrity([running, other])


def test_a_loan_lets_more_snapshots_in_and_calling_it_back_drops_the_policys_victims(index):
    """StateSnapshots.lend: bytes beyond the budget for a while. Snapshots fill them; calling the loan back drops
    what the policy values least (LRU here), never a pinned prefix's, whose snapshots stay within the budget itself
    even while a loan would have room."""
    tokens = list(range(100, 140))
    root, nodes = cache(index, b"ns", tokens)
    snapshots = StateSnapshots(BLOCK, 2 * STATE, policy="lru")
    assert snapshots.lend(2 * STATE) == []
    kept = [snapshots.add(nodes[i], [], STATE, i, "finish")[0] for i in range(4)]
    assert None not in kept and snapshots.num_bytes == 4 * STATE
    snapshots.check_integrity()
    snapshots.lookup(root, nodes[:1], tokens, 4)  # the first is used again
    assert snapshots.lend(STATE) == [kept[1]]
    assert snapshots.lend(0) == [kept[2]]
    snapshots.check_integrity()
    with pytest.raises(ValueError, match="lent_bytes must be >= 0"):
        snapshots.lend(-1)

    index.pin(nodes[:6])
    snapshots.lend(4 * STATE)
    assert snapshots.add(nodes[4], [], STATE, "p1", "pin")[0] is not None
    assert snapshots.add(nodes[5], [], STATE, "p2", "pin")[0] is not None
    assert snapshots.add(nodes[5], tokens[24:25], STATE, "p3", "pin") == (None, [])  # the budget is the pins'
    dropped = snapshots.lend(0)  # only the two pins' snapshots stay
    assert {snapshot.handle for snapshot in snapshots.snapshots()} == {"p1", "p2"} and len(dropped) == 2
    snapshots.check_integrity()


def test_idle_request_slots_hold_every_conversations_end_and_come_back_when_requests_start(index):
    """StateSlots lends the snapshots the slots of requests not running (as llama-server's idle slots keep their
    state): four conversations' ends are all kept beside a budget of one, and each admission takes a slot back,
    taking over its own conversation's end where one must go, else dropping the end ``saved`` values least. Every
    slot is free, running or one snapshot's after each change."""
    from kvreuse.cache.state_slots import StateCopy, StateSlots

    slots = StateSlots(BLOCK, num_slots=5, max_running=4, slot_bytes=STATE)
    ends = []
    for chat in range(4):
        tokens = [1000 * (chat + 1) + i for i in range(13)]
        root, nodes = cache(index, f"chat{chat}".encode(), tokens)
        running = slots.start(None)
        ends.append(slots.keep(nodes[2], tokens[12:13], running, "finish"))
        slots.check_integrity([])
    assert None not in ends and len(slots.snapshots) == 4 and slots.num_free == 1
    slots.take_copies()
    first = slots.start(ends[0])  # the first conversation's next turn resumes at its end: a copy into a free slot
    assert len(slots.snapshots) == 4 and slots.num_free == 0
    # The second's slot must come back from the snapshots: its own conversation's end is handed over (its next turn
    # goes on past it), not another conversation's end dropped.
    second = slots.start(ends[1])
    assert second == ends[1].handle and ends[1] not in slots.snapshots.snapshots() and slots.num_handed_over == 1
    third = slots.start(ends[2])
    assert third == ends[2].handle and slots.take_copies() == [StateCopy(ends[0].handle, first)]
    slots.check_integrity([first, second, third])
    fourth = slots.start(None)  # all four run: only the budget's one snapshot stays, the policy's choice
    assert slots.snapshots.snapshots() == [ends[0]] and slots.snapshots.lent_bytes == 0
    assert slots.take_copies() == [StateCopy(None, ends[3].handle)]  # the unused end gave its slot back
    slots.check_integrity([first, second, third, fourth])
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.start(None)
    slots.release(fourth)
    slots.check_integrity([first, second, third])
    assert slots.snapshots.lent_bytes == STATE and slots.num_free == 1


@pytest.mark.parametrize("client", ["token ids", "text"])
def test_a_prompts_end_gives_way_once_a_next_turn_resumed_from_its_answers_end(index, client):
    """``saved`` keeps a prompt's end (reason "prompt") for a next turn that matches the prompt but not the answer's
    tokens (a text client whose answer a tokenizer splits otherwise). Where the next turn resumes from the answer's
    end below it instead (a token-id client; a chat client whose answer the server renders as the ids it generated),
    the prompt's end serves a retry of its turn only: it is worth nothing then, and the next answer's end gets in over
    it though the budget is full. Where the next turn resumed from the prompt's end, the unused answer's end goes."""
    tokens = list(range(500, 540))
    root, nodes = cache(index, b"ns", tokens)
    snapshots = StateSnapshots(BLOCK, 3 * STATE, policy="saved")
    prompt_end, _ = snapshots.add(nodes[2], [], STATE, "P", "prompt")  # a 12-token prompt, a 8-token answer
    answer_end, _ = snapshots.add(nodes[4], [], STATE, "F", "finish")
    resumed = snapshots.lookup(root, nodes, tokens, 20 if client == "token ids" else 19).snapshot
    assert resumed is (answer_end if client == "token ids" else prompt_end)
    snapshots.check_integrity()
    if client == "text":
        assert snapshots.saved_per_byte(prompt_end) > snapshots.saved_per_byte(answer_end) > 0
        assert snapshots.add(nodes[6], [], STATE, "P2", "prompt")[1] == []  # room for it
        assert snapshots.add(nodes[8], [], STATE, "F2", "finish")[1] == [answer_end]
        return
    assert snapshots.saved_per_byte(prompt_end) == 0
    snapshots.add(nodes[6], [], STATE, "P2", "prompt")  # the next turn's prompt end, below the answer's
    kept, dropped = snapshots.add(nodes[8], [], STATE, "F2", "finish")
    assert kept is not None and dropped == [prompt_end]
    snapshots.check_integrity()

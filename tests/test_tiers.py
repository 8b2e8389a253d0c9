"""KV tiers behind the device pool (host memory, disk, Redis), end to end on a tiny float32 model, CPU.

What must hold whatever the tiers do: greedy output equals a cold run (an engine without tiers);
``cached_tokens_by_tier`` names the tier a prefix came from; the cache core's invariants hold after
every engine step; a block is served only to an engine with the same model fingerprint (weights,
dtype, block size, tokenizer), across processes with different hash seeds; a corrupted or misnamed
record is a counted miss and is removed; byte caps and protected (pinned) disk entries hold; a Redis
tier is shared between engines, separated by tenant, and a Redis that stops never hangs a request.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.cache.tiers import backends, record
from kvreuse.cache.tiers.backends import DiskTier, HostTier, RedisTier
from kvreuse.cache.tiers.store import DEFAULT_WRITE_QUEUE_BYTES, BlockRef, TieredStore
from kvreuse.engine import LLMEngine
from kvreuse.outputs import RequestOutput

MAX_NEW = 8
BLOCK = 4
PROMPT_LEN = 40
# Tokens a tier can serve for a whole prompt: every full block before the last prompt token.
TIER_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 32 blocks of 4 tokens (2 KiB each for the tiny model): four 48-token requests cannot all stay.
SMALL_POOL = "64KiB"
SERVED_NAME = "tiny"  # one model name for every folder, so block keys agree and only the fingerprint differs


def prompt_ids(seed: int, length: int = PROMPT_LEN, vocab: int = 300) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


PROMPTS = [prompt_ids(1000 + i) for i in range(6)]


def make_llm(model_dir: Path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", kv_cache_memory=SMALL_POOL, block_size=BLOCK,
                   served_model_name=SERVED_NAME)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
                cache_salt: str | None = None) -> list[RequestOutput]:
    """Drive the engine step by step, checking the cache invariants after every step; the final outputs."""
    ids = []
    for i, prompt in enumerate(prompts):
        request_id = f"req-{id(prompts)}-{i}-{time.monotonic_ns()}"
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, cache_salt=cache_salt)
        ids.append(request_id)
    done: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    stats = engine.stats().cache
    assert stats.blocks_in_use == 0, "a finished workload left blocks in use"
    assert stats.blocks_free + stats.blocks_idle == stats.num_blocks
    return [done[request_id] for request_id in ids]


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def cold(tiny_model: Path):
    """Greedy tokens of an engine without tiers (a big pool, nothing evicted), per prompt."""
    llm = make_llm(tiny_model, kv_cache_memory="8MiB")
    assert llm.engine.tier_store is None
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            llm.engine.reset_prefix_cache()
            memo[key] = tokens_of(run_checked(llm.engine, [prompt]))[0]
        return memo[key]

    return reference


def fill_and_evict(engine: LLMEngine, cold) -> None:
    """Run PROMPTS[0], then three more prompts that push every one of its blocks out of the pool."""
    first = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(first) == [cold(PROMPTS[0])]
    assert first[0].cached_tokens_by_tier is not None and sum(first[0].cached_tokens_by_tier.values()) == 0
    for prompt in PROMPTS[1:4]:
        assert tokens_of(run_checked(engine, [prompt])) == [cold(prompt)]
    assert engine.stats().cache.evicted_blocks >= (PROMPT_LEN + MAX_NEW - 1) // BLOCK
    engine.flush_tiers()


def disk_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"*{DiskTier.SUFFIX}"))


def read_header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = record._LENGTH.unpack_from(data, len(record.MAGIC))
    start = len(record.MAGIC) + record._LENGTH.size
    return json.loads(data[start:start + length])


def file_of_block(directory: Path, tokens: list[int]) -> Path:
    matches = [path for path in disk_files(directory) if read_header(path)["tokens"] == list(tokens)]
    assert len(matches) == 1, f"expected one record for tokens {tokens}, found {len(matches)}"
    return matches[0]


# --- 1. evicted from the device pool, served from a tier -------------------------------------------
@pytest.mark.parametrize("tiers, expected_tier", [
    ({"kv_disk_dir": True}, "disk"),
    ({"kv_host_memory": "1MiB"}, "host"),
    ({"kv_host_memory": "1MiB", "kv_disk_dir": True}, "host"),  # host is looked up before disk
], ids=["disk", "host", "host-before-disk"])
def test_evicted_prefix_hits_from_tier(tiny_model: Path, tmp_path: Path, cold, tiers, expected_tier):
    options = dict(tiers)
    if options.get("kv_disk_dir"):
        options["kv_disk_dir"] = str(tmp_path / "disk")
    llm = make_llm(tiny_model, **options)
    engine = llm.engine
    fill_and_evict(engine, cold)

    again = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(again) == [cold(PROMPTS[0])]
    expected = {name: 0 for name in ["device", *(t.name for t in engine.tier_store.tiers)]}
    expected[expected_tier] = TIER_TOKENS
    assert again[0].cached_tokens_by_tier == expected
    assert again[0].num_cached_tokens == TIER_TOKENS
    stats = llm.stats()["kv_tiers"]
    assert stats[expected_tier]["hits"] == TIER_TOKENS // BLOCK
    assert stats[expected_tier]["hit_bytes"] == TIER_TOKENS // BLOCK * engine.kv_cache.block_bytes
    assert all(not tier["verify_failures"] for tier in stats.values())

    # Loaded blocks are ordinary device blocks now: the same prompt again is a device hit.
    device = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(device) == [cold(PROMPTS[0])]
    assert device[0].cached_tokens_by_tier["device"] == PROMPT_LEN - 1  # full blocks, then a partial copy
    assert device[0].cached_tokens_by_tier[expected_tier] == 0

    # One batch: a tier hit that stops mid-prompt (the same 30-token head, then other tokens) beside a
    # cold prompt; the device pool is emptied first.
    engine.reset_prefix_cache(("device",))
    engine.flush_tiers()
    head = PROMPTS[0][:30] + prompt_ids(77, 14)
    batch = [head, PROMPTS[4]]
    outputs = run_checked(engine, batch)
    assert tokens_of(outputs) == [cold(prompt) for prompt in batch]
    assert outputs[0].cached_tokens_by_tier[expected_tier] == 28  # the 7 full blocks inside the head
    assert outputs[0].num_cached_tokens == 28
    assert outputs[1].num_cached_tokens == 0


@pytest.mark.parametrize("arch, block_kib", [("gemma3", 12), ("qwen3_moe", 4)])
def test_windowed_and_moe_models_hit_from_the_host_tier(tiny_models, arch, block_kib):
    """Gemma 3's windowed layers and Qwen3-MoE's experts change nothing the tiers see: an evicted prefix comes
    back from the host tier and the greedy tokens are those of an engine that never evicted (the prompts run
    past tiny-gemma3's 16-token window)."""
    model = tiny_models[arch]
    reference = make_llm(model, kv_cache_memory="8MiB")
    expected = {tuple(prompt): tokens_of(run_checked(reference.engine, [prompt]))[0] for prompt in PROMPTS[:4]}
    llm = make_llm(model, kv_cache_memory=f"{32 * block_kib}KiB", kv_host_memory="4MiB")
    engine = llm.engine
    assert engine.kv_cache.block_bytes == block_kib * 1024
    for prompt in PROMPTS[:4]:
        assert tokens_of(run_checked(engine, [prompt])) == [expected[tuple(prompt)]]
    assert engine.stats().cache.evicted_blocks >= (PROMPT_LEN + MAX_NEW - 1) // BLOCK
    engine.flush_tiers()
    again = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(again) == [expected[tuple(PROMPTS[0])]]
    assert again[0].cached_tokens_by_tier["host"] == TIER_TOKENS


# --- 2. across processes, and only for the same fingerprint ---------------------------------------
PROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from kvreuse import LLM, SamplingParams

    model, disk, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory="64KiB", block_size=4,
              served_model_name="tiny", kv_disk_dir=disk)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = [llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for prompt in prompts]
    llm.engine.flush_tiers()
    print("RESULT " + json.dumps({
        "fingerprint": llm.engine.tier_store.fingerprint,
        "tokens": [output.outputs[0].token_ids for output in outputs],
        "by_tier": [output.cached_tokens_by_tier for output in outputs],
        "disk": llm.stats()["kv_tiers"]["disk"],
    }))
""")


def run_process(script: Path, model: Path, disk: Path, prompts: list[list[int]], hash_seed: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(script), str(model), str(disk), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def changed_weight_copy(model: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(out / "model.safetensors")
    name = sorted(name for name in tensors if "k_proj.weight" in name)[0]
    tensors[name] = tensors[name] + 0.05
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def other_vocab_tokenizer(model: Path, out: Path) -> Path:
    """The same tokenizer files with two ordinary tokens' ids swapped: another vocab, same strings."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).is_file():
            shutil.copy(model / name, out / name)
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    by_id = {index: token for token, index in vocab.items()}
    first, second = by_id[500], by_id[501]
    vocab[first], vocab[second] = 501, 500
    (out / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return out


def test_disk_tier_across_processes_and_fingerprint_variants(tiny_model: Path, tmp_path: Path, cold):
    script = tmp_path / "tiers_process.py"
    script.write_text(PROCESS_SCRIPT, encoding="utf-8")
    disk = tmp_path / "disk"
    prompts = PROMPTS[:2]

    first = run_process(script, tiny_model, disk, prompts, hash_seed=1)
    assert first["tokens"] == [cold(prompt) for prompt in prompts]
    assert [by_tier["disk"] for by_tier in first["by_tier"]] == [0, 0]
    assert first["disk"]["stores"] > 0
    root = disk / first["fingerprint"][:32]
    assert len(disk_files(root)) == first["disk"]["stores"]

    second = run_process(script, tiny_model, disk, prompts, hash_seed=2)
    assert second["fingerprint"] == first["fingerprint"]
    assert second["tokens"] == [cold(prompt) for prompt in prompts]
    assert [by_tier for by_tier in second["by_tier"]] == [{"device": 0, "disk": TIER_TOKENS}] * 2
    assert second["disk"]["verify_failures"] == {}

    records = {path.name: path.read_bytes() for path in disk_files(root)}
    variants = {
        "weight": (changed_weight_copy(tiny_model, tmp_path / "weight"), {}),
        "dtype": (tiny_model, {"dtype": "bfloat16"}),
        "block_size": (tiny_model, {"block_size": 8}),
        "kv_cache_dtype": (tiny_model, {"kv_cache_dtype": "int8"}),
        "tokenizer": (tiny_model, {"tokenizer": str(other_vocab_tokenizer(tiny_model, tmp_path / "tok"))}),
    }
    for name, (model, options) in variants.items():
        llm = make_llm(model, kv_disk_dir=str(disk), **options)
        engine = llm.engine
        assert engine.tier_store.fingerprint != first["fingerprint"], name
        tier = engine.tier_store.tier("disk")
        assert tier.root != root and tier.num_bytes == 0, name
        outputs = run_checked(engine, prompts)
        assert all(output.cached_tokens_by_tier["disk"] == 0 for output in outputs), name
        assert llm.stats()["kv_tiers"]["disk"]["hits"] == 0, name
        if name in ("weight", "kv_cache_dtype"):
            # Records of the first model put under this model's folder are read and refused.
            engine.flush_tiers()
            engine.reset_prefix_cache(("device", "disk"))
            for key_name, data in records.items():
                tier.put(bytes.fromhex(key_name.removesuffix(DiskTier.SUFFIX)), data)
            again = run_checked(engine, prompts)
            assert tokens_of(again) == tokens_of(outputs)
            assert all(output.num_cached_tokens == 0 for output in again)
            assert llm.stats()["kv_tiers"]["disk"]["verify_failures"] == {"fingerprint": 2}
        if name in ("block_size", "tokenizer"):  # the same weights and dtype: the same greedy tokens
            assert tokens_of(outputs) == [cold(prompt) for prompt in prompts], name
        del llm, engine, tier
    # The first model's folder is untouched by the others.
    assert {path.name for path in disk_files(root)} == set(records)


# --- 3. corrupted and misnamed records --------------------------------------------------------------
def test_corrupt_and_misnamed_records_are_rejected_and_removed(tiny_model: Path, tmp_path: Path, cold):
    disk = tmp_path / "disk"
    llm = make_llm(tiny_model, kv_disk_dir=str(disk))
    engine = llm.engine
    tier = engine.tier_store.tier("disk")
    assert tokens_of(run_checked(engine, PROMPTS[:2])) == [cold(p) for p in PROMPTS[:2]]
    engine.flush_tiers()
    engine.reset_prefix_cache(("device",))

    # A flipped payload byte in block 2 of prompt 0; block 0's record of prompt 1 copied over block 1's.
    flipped = file_of_block(disk, PROMPTS[0][2 * BLOCK:3 * BLOCK])
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 0x40
    flipped.write_bytes(bytes(data))
    misnamed = file_of_block(disk, PROMPTS[1][BLOCK:2 * BLOCK])
    shutil.copy(file_of_block(disk, PROMPTS[1][:BLOCK]), misnamed)

    removed: dict[bytes, bool] = {}
    delete = tier.delete

    def watched_delete(key: bytes) -> None:
        delete(key)
        removed[key] = tier._path(key).exists()

    tier.delete = watched_delete
    outputs = run_checked(engine, PROMPTS[:2])
    assert tokens_of(outputs) == [cold(p) for p in PROMPTS[:2]]
    # The run stops at the bad record: two good blocks of prompt 0, one of prompt 1.
    assert [output.cached_tokens_by_tier["disk"] for output in outputs] == [2 * BLOCK, BLOCK]
    failures = llm.stats()["kv_tiers"]["disk"]["verify_failures"]
    assert failures == {"checksum": 1, "key": 1}
    bad_keys = {bytes.fromhex(path.name.removesuffix(DiskTier.SUFFIX)) for path in (flipped, misnamed)}
    assert set(removed) == bad_keys and not any(removed.values()), "a rejected record was not removed"

    # The recomputed blocks were written again, now intact.
    engine.flush_tiers()
    for path, tokens in ((flipped, PROMPTS[0][2 * BLOCK:3 * BLOCK]), (misnamed, PROMPTS[1][BLOCK:2 * BLOCK])):
        key = bytes.fromhex(path.name.removesuffix(DiskTier.SUFFIX))
        record.decode(path.read_bytes(), engine.tier_store.fingerprint, key, tokens, engine.tier_store.layout)


def test_truncated_record_is_rejected_as_truncated_and_removed(tiny_model: Path, tmp_path: Path, cold):
    disk = tmp_path / "disk"
    llm = make_llm(tiny_model, kv_disk_dir=str(disk))
    engine = llm.engine
    assert tokens_of(run_checked(engine, [PROMPTS[0]])) == [cold(PROMPTS[0])]
    engine.flush_tiers()
    engine.reset_prefix_cache(("device",))

    # Block 3's record cut short inside its payload, as a copy that stopped or a damaged disk leaves it.
    cut = file_of_block(disk, PROMPTS[0][3 * BLOCK:4 * BLOCK])
    whole = cut.read_bytes()
    cut.write_bytes(whole[:len(whole) - 100])
    outputs = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(outputs) == [cold(PROMPTS[0])]
    assert outputs[0].cached_tokens_by_tier["disk"] == 3 * BLOCK  # the run stops before the cut record
    stats = llm.stats()["kv_tiers"]["disk"]
    assert stats["verify_failures"] == {"truncated": 1} and stats["hits"] == 3

    # It was dropped from the tier (a record still listed is never written again), so the recomputed block
    # was written anew, whole.
    engine.flush_tiers()
    key = bytes.fromhex(cut.name.removesuffix(DiskTier.SUFFIX))
    record.decode(cut.read_bytes(), engine.tier_store.fingerprint, key, PROMPTS[0][3 * BLOCK:4 * BLOCK],
                  engine.tier_store.layout)


def test_record_cut_anywhere_is_truncated_and_other_damage_keeps_its_reason():
    layout = record.BlockLayout(shape=(2, 8), dtype="float32", num_bytes=64)
    key, tokens = b"k" * 16, [5, 6, 7, 8]
    data = record.encode("fp", key, b"n" * 16, tokens, layout, bytes(range(64)))
    assert bytes(record.decode(data, "fp", key, tokens, layout)) == bytes(range(64))
    header_end = len(data) - layout.num_bytes
    # Empty, inside the magic, inside the header's length, inside the header, one payload byte short.
    for length in (0, 2, len(record.MAGIC) + 1, header_end - 5, header_end, len(data) - 1):
        with pytest.raises(record.RecordMismatch) as info:
            record.decode(data[:length], "fp", key, tokens, layout)
        assert info.value.reason == "truncated", (length, str(info.value))
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    for damaged, reason in ((bytes(flipped), "checksum"), (data + b"\0", "format"), (b"XXXX" + data[4:], "format"),
                            (b"KV", "truncated"), (b"XY", "format")):
        with pytest.raises(record.RecordMismatch) as info:
            record.decode(damaged, "fp", key, tokens, layout)
        assert info.value.reason == reason, (damaged[:8], str(info.value))


# --- 4. byte caps and protected entries ---------------------------------------------------------------
def test_disk_and_host_byte_caps_hold(tiny_model: Path, tmp_path: Path, cold):
    disk = tmp_path / "disk"
    cap = 48 * 1024  # about 20 records of 2 KiB; five prompts write about 55
    llm = make_llm(tiny_model, kv_disk_dir=str(disk), kv_disk_size=cap, kv_host_memory=cap)
    engine = llm.engine
    for prompt in PROMPTS[:5]:
        assert tokens_of(run_checked(engine, [prompt])) == [cold(prompt)]
        engine.flush_tiers()
        files = disk_files(disk)
        assert files and sum(path.stat().st_size for path in files) <= cap
    assert engine.tier_store.tier("disk").num_bytes <= cap
    assert 0 < engine.tier_store.tier("host").num_bytes <= cap
    stats = llm.stats()["kv_tiers"]["disk"]
    assert stats["store_bytes"] > cap  # more was written than fits: the cap dropped the oldest
    # The newest prompt's blocks are the ones kept, the oldest one's are gone.
    assert file_of_block(disk, PROMPTS[4][:BLOCK]).is_file()
    assert not [path for path in disk_files(disk) if read_header(path)["tokens"] == PROMPTS[0][:BLOCK]]

    # A restart with a smaller cap over the same folder holds the new cap too.
    smaller = DiskTier(disk, cap // 2, engine.tier_store.fingerprint)
    assert smaller.num_bytes <= cap // 2
    assert sum(path.stat().st_size for path in disk_files(disk)) <= cap // 2


def test_host_tier_lru_within_capacity():
    host = HostTier(capacity_bytes=250)
    for index in range(5):
        host.put(bytes([index]), bytes(100))
        assert host.num_bytes <= 250
    assert host.get_many([bytes([0]), bytes([3]), bytes([4])]) == [None, bytes(100), bytes(100)]
    host.put(b"big", bytes(251))  # larger than the whole tier: not kept, nothing dropped for it
    assert host.get_many([b"big", bytes([3])]) == [None, bytes(100)]


def test_disk_tier_never_drops_protected_entries(tmp_path: Path):
    tier = DiskTier(tmp_path, capacity_bytes=300, fingerprint="f" * 32)
    keys = [bytes([index]) * 16 for index in range(8)]
    tier.put(keys[0], b"a" * 100)
    tier.protect([keys[0]])
    tier.protect([keys[0]])  # protected twice: needs two unprotects
    for key in keys[1:6]:
        tier.put(key, b"b" * 100)
        assert tier.num_bytes <= 300
        assert tier.get_many([keys[0]]) == [b"a" * 100], "a protected entry was dropped"
    assert tier._path(keys[0]).is_file()
    assert tier.clear() == 2 and tier.get_many([keys[0]]) == [b"a" * 100]  # clear keeps protected entries
    tier.put(keys[1], b"b" * 100)
    tier.put(keys[2], b"b" * 100)
    tier.unprotect([keys[0]])
    tier.put(keys[3], b"b" * 100)
    assert tier.get_many([keys[0]]) == [b"a" * 100], "still protected once"
    tier.unprotect([keys[0]])  # now an ordinary LRU entry: three more puts push it out
    for key in keys[4:7]:
        tier.put(key, b"b" * 100)
        assert tier.num_bytes <= 300
    assert tier.get_many([keys[0]]) == [None] and not tier._path(keys[0]).exists()
    # A restart finds what is on disk, and protection still wins over the cap.
    again = DiskTier(tmp_path, capacity_bytes=300, fingerprint="f" * 32)
    assert again.num_bytes == tier.num_bytes == 300
    again.protect(keys[4:7])
    again.put(keys[7], b"c" * 100)  # no room and nothing else may go: the new entry is the one dropped
    assert again.get_many(keys[4:7]) == [b"b" * 100] * 3
    assert again.get_many([keys[7]]) == [None] and again.num_bytes <= 300


# --- 4b. the writer thread: a full disk, a bounded queue, errors, flush -------------------------------------
LAYOUT = record.BlockLayout(shape=(2, 8), dtype="float32", num_bytes=64)


def block_ref(index: int) -> BlockRef:
    return BlockRef(key=bytes([index]) * 16, namespace=b"n" * 16, tokens=[index] * BLOCK)


def block_payload(index: int) -> bytes:
    return bytes([index]) * LAYOUT.num_bytes


class GatedTier:
    """A write-through tier whose writes wait for ``gate`` (a disk or Redis slower than the engine) and then
    call ``fail(index)`` (raise to fail that block's write)."""

    name = "remote"

    def __init__(self, fail=lambda index: None, open_gate: bool = True) -> None:
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.fail = fail
        self.records: dict[bytes, bytes] = {}
        self.reads = 0  # records read (get_many's keys)

    def get_many(self, keys):
        self.reads += len(keys)
        return [self.records.get(key) for key in keys]

    def has_many(self, keys):
        return [key in self.records for key in keys]

    def put(self, key: bytes, data: bytes) -> bool:
        assert self.gate.wait(30), "the test never opened the gate"
        self.fail(key[0])
        self.records[key] = data
        return True

    def delete(self, key: bytes) -> None:
        self.records.pop(key, None)

    def clear(self) -> int:
        count = len(self.records)
        self.records.clear()
        return count


def flush_within(store: TieredStore, seconds: float = 30, **kwargs) -> int:
    """``store.flush()`` from another thread, failing the test (not hanging it) if it does not return."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(store.flush(**kwargs)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"flush() did not return within {seconds} s"
    return result[0]


def test_full_disk_write_leaves_no_temporary_file_and_is_counted(tmp_path: Path, monkeypatch, caplog):
    # A simulation: a real full disk cannot be made here, so the disk tier's file writes write half the
    # record and then fail with ENOSPC, as a write on a disk that fills does.
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, fingerprint="f" * 32)
    store = TieredStore("fp", LAYOUT, [tier])
    partial: list[Path] = []
    real_open = open

    class FullDiskFile:
        def __init__(self, path, mode):
            self.handle = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.handle.close()

        def write(self, data: bytes) -> int:
            self.handle.write(data[:len(data) // 2])
            self.handle.flush()
            partial.append(Path(self.handle.name))
            assert partial[-1].stat().st_size == len(data) // 2 > 0  # the half-written temporary file is there
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.handle.name)

    monkeypatch.setattr(backends, "open", FullDiskFile, raising=False)
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        store.store(block_ref(1), block_payload(1))
        store.store(block_ref(2), block_payload(2))
        assert flush_within(store) == 0
    assert len(partial) == 2 and ".tmp-" in partial[0].name
    assert list(tier.root.iterdir()) == [], "a failed write left a file behind"
    assert tier.num_bytes == 0 and tier.get_many([block_ref(1).key]) == [None]
    disk = store.snapshot()["disk"]
    assert (disk["write_errors"], disk["stores"], disk["store_bytes"]) == (2, 0, 0)
    warnings = [entry for entry in caplog.records if entry.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()  # once, then counted

    # Space again: the writer is still there and the next block is stored.
    monkeypatch.undo()
    store.store(block_ref(3), block_payload(3))
    assert flush_within(store) == 0
    assert [path.name for path in tier.root.iterdir()] == [tier._path(block_ref(3).key).name]
    assert store.snapshot()["disk"]["stores"] == 1 and store.snapshot()["disk"]["write_errors"] == 2


def test_write_queue_is_bounded_and_a_full_queue_drops_without_waiting():
    slow = GatedTier(open_gate=False)
    record_bytes = len(record.encode("fp", block_ref(0).key, block_ref(0).namespace, block_ref(0).tokens, LAYOUT,
                                     block_payload(0)))
    assert TieredStore("fp", LAYOUT, [slow]).max_queue_bytes == DEFAULT_WRITE_QUEUE_BYTES
    with pytest.raises(ValueError, match="kv_write_queue_size"):
        TieredStore("fp", LAYOUT, [slow], max_queue_bytes=0)
    store = TieredStore("fp", LAYOUT, [slow], max_queue_bytes=3 * record_bytes)

    # Ten blocks while the writer is stuck on the first: three fit in the queue, seven are dropped, and the
    # engine's side (store) never waits for the writer.
    stored = threading.Event()

    def engine_step() -> None:
        for index in range(10):
            store.store(block_ref(index), block_payload(index))
        stored.set()

    threading.Thread(target=engine_step, daemon=True).start()
    assert stored.wait(30), "store() waited for the writer"
    assert store.snapshot()["remote"]["write_drops"] == 7
    # A bounded flush returns with what is still unwritten.
    assert flush_within(store, timeout_s=0.05) == 3

    slow.gate.set()
    assert flush_within(store) == 0
    assert sorted(slow.records) == [block_ref(index).key for index in range(3)]
    assert store.snapshot()["remote"]["stores"] == 3
    store.store(block_ref(10), block_payload(10))  # written blocks leave the queue: room again
    assert flush_within(store) == 0
    assert block_ref(10).key in slow.records
    assert (store.snapshot()["remote"]["stores"], store.snapshot()["remote"]["write_drops"]) == (4, 7)


def test_write_queue_size_reaches_the_store(tiny_model: Path, tmp_path: Path):
    llm = make_llm(tiny_model, kv_disk_dir=str(tmp_path / "disk"), kv_write_queue_size="64KiB")
    assert llm.engine.tier_store.max_queue_bytes == 64 * 1024
    with pytest.raises(ValueError, match="kv_write_queue_size"):
        make_llm(tiny_model, kv_disk_dir=str(tmp_path / "disk"), kv_write_queue_size=0)


def test_writer_survives_any_error_per_record(caplog):
    def fail(index: int) -> None:
        if index in (1, 3):
            raise RuntimeError(f"a bug writing block {index}")

    tier = GatedTier(fail)
    store = TieredStore("fp", LAYOUT, [tier])
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        for index in range(5):
            store.store(block_ref(index), block_payload(index))
        assert flush_within(store) == 0
    assert sorted(tier.records) == [block_ref(index).key for index in (0, 2, 4)]
    remote = store.snapshot()["remote"]
    assert (remote["stores"], remote["write_errors"], remote["write_drops"]) == (3, 2, 0)
    # Logged once with its traceback; the second is counted (and at debug level only).
    warnings = [entry for entry in caplog.records if entry.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError" in warnings[0].getMessage() and warnings[0].exc_info


class WriterKiller(BaseException):
    """Not an Exception (as SystemExit or KeyboardInterrupt): the writer does not catch it, its thread ends."""


def test_flush_does_not_wait_for_a_writer_that_ended(monkeypatch, caplog):
    def fail(index: int) -> None:
        if index == 1:
            raise WriterKiller()

    ended: list[type] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.exc_type))
    tier = GatedTier(fail, open_gate=False)
    store = TieredStore("fp", LAYOUT, [tier])
    for index in range(4):  # all queued while the writer waits on block 0
        store.store(block_ref(index), block_payload(index))
    with caplog.at_level(logging.WARNING, logger="kvreuse"):
        tier.gate.set()  # block 0 is written; block 1 ends the writer thread
        assert flush_within(store) == 3  # blocks 1 to 3 were not written, and flush says so
        store.store(block_ref(4), block_payload(4))  # no writer to queue for: dropped, counted
        assert flush_within(store) == 3
    assert ended == [WriterKiller] and list(tier.records) == [block_ref(0).key]
    assert store.snapshot()["remote"]["write_drops"] == 1
    messages = [entry.getMessage() for entry in caplog.records]
    assert any("3 queued block(s)" in message and "writer thread has ended" in message for message in messages)


EXIT_SCRIPT = textwrap.dedent("""
    from kvreuse.cache.tiers.record import BlockLayout
    from kvreuse.cache.tiers.store import BlockRef, TieredStore

    class Broken:
        name = "disk"

        def put(self, key, data):
            if key[0] == 0:
                raise RuntimeError("a bug in this write")  # ended the old writer thread
            if key[0] == 1:
                raise KeyboardInterrupt  # ends any writer thread
            return True

    layout = BlockLayout(shape=(2, 8), dtype="float32", num_bytes=64)
    store = TieredStore("fp", layout, [Broken()])
    for index in range(4):
        store.store(BlockRef(bytes([index]) * 16, b"n" * 16, [index] * 4), bytes(64))
    print("queued", flush=True)
""")


def test_exit_does_not_hang_when_the_writer_failed(tmp_path: Path):
    """The interpreter's exit-time flush: before, a write that raised anything but OSError ended the writer and
    the exit waited forever for its queue."""
    import kvreuse

    script = tmp_path / "exit_after_failed_writes.py"
    script.write_text(EXIT_SCRIPT, encoding="utf-8")
    source = str(Path(kvreuse.__file__).parents[1])  # the kvreuse this test imports, not an installed one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "queued" in done.stdout, done.stderr[-3000:]
    assert "RuntimeError" in done.stderr  # logged, and the writer went on to the next record
    assert "queued block(s)" in done.stderr and "writer thread has ended" in done.stderr, done.stderr[-3000:]


# --- 5. Redis --------------------------------------------------------------------------------------
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real redis-server on 127.0.0.1 with no persistence; yields (url, process); killed at teardown."""
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.skip(f"no redis-server binary at {REDIS_SERVER}: the Redis tier tests need one")
    redis = pytest.importorskip("redis", reason="redis-py is not installed")
    port = _free_port()
    folder = tmp_path / "redis"
    folder.mkdir()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=10)


def test_redis_tier_shared_between_engines_and_separated_by_tenant(tiny_model: Path, redis_server, cold):
    url, _ = redis_server
    first = make_llm(tiny_model, kv_remote_url=url)
    second = make_llm(tiny_model, kv_remote_url=url)
    assert first.engine.tier_store.fingerprint == second.engine.tier_store.fingerprint

    assert tokens_of(run_checked(first.engine, [PROMPTS[0]])) == [cold(PROMPTS[0])]
    assert tokens_of(run_checked(first.engine, [PROMPTS[1]], cache_salt="tenant-a")) == [cold(PROMPTS[1])]
    first.engine.flush_tiers()
    assert first.stats()["kv_tiers"]["remote"]["stores"] > 0

    shared = run_checked(second.engine, [PROMPTS[0]])
    assert tokens_of(shared) == [cold(PROMPTS[0])]
    assert shared[0].cached_tokens_by_tier == {"device": 0, "remote": TIER_TOKENS}

    other_tenant = run_checked(second.engine, [PROMPTS[1]], cache_salt="tenant-b")
    assert tokens_of(other_tenant) == [cold(PROMPTS[1])]
    assert other_tenant[0].cached_tokens_by_tier == {"device": 0, "remote": 0}
    no_tenant = run_checked(second.engine, [PROMPTS[1]])
    assert no_tenant[0].cached_tokens_by_tier["remote"] == 0

    same_tenant = run_checked(second.engine, [PROMPTS[1]], cache_salt="tenant-a")
    assert tokens_of(same_tenant) == [cold(PROMPTS[1])]
    assert same_tenant[0].cached_tokens_by_tier == {"device": 0, "remote": TIER_TOKENS}
    assert second.stats()["kv_tiers"]["remote"]["verify_failures"] == {}

    # reset_prefix_cache(tiers=("remote",)) empties this model's keys on the server.
    second.engine.flush_tiers()
    assert second.reset_prefix_cache(tiers=("device", "remote")) > 0
    cleared = run_checked(second.engine, [PROMPTS[0]])
    assert cleared[0].num_cached_tokens == 0


def test_redis_stopped_mid_run_requests_still_succeed(tiny_model: Path, redis_server, cold):
    url, process = redis_server
    llm = make_llm(tiny_model, kv_remote_url=url)
    engine = llm.engine
    remote = engine.tier_store.tier("remote")
    assert tokens_of(run_checked(engine, [PROMPTS[0]])) == [cold(PROMPTS[0])]
    engine.flush_tiers()

    # A frozen server (SIGSTOP: it accepts connections and never answers), stopped mid-batch.
    batch = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    engine.reset_prefix_cache(("device",))
    started = time.monotonic()
    for i, prompt in enumerate(batch[:2]):
        engine.add_request(f"frozen-{i}", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    engine.check_integrity()
    process.send_signal(signal.SIGSTOP)
    # If a lookup ever waited on the server without a bound, this thaws it after 30 s, so the test
    # fails on the time below instead of hanging.
    watchdog = threading.Timer(30, lambda: process.poll() is None and process.send_signal(signal.SIGCONT))
    watchdog.daemon = True
    watchdog.start()
    done: dict[str, list[int]] = {}
    engine.add_request("frozen-2", {"prompt_token_ids": batch[2]}, GREEDY)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
                if output.request_id == "frozen-2":
                    assert output.cached_tokens_by_tier["remote"] == 0  # a miss, not an error
        engine.check_integrity()
        assert time.monotonic() - started < 20, "a request hung on a stopped Redis"
    engine.flush_tiers()
    assert time.monotonic() - started < 20, "flushing to a stopped Redis hung"
    assert [done[f"frozen-{i}"] for i in range(3)] == [cold(prompt) for prompt in batch]
    assert remote.num_errors >= 1
    watchdog.cancel()

    # Killed outright: refused connections, each retried after retry_s, still only misses.
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not remote.available:  # the back-off after the freeze (retry_s) ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    remote.retry_s = 0.1
    for prompt in (PROMPTS[3], PROMPTS[4]):
        time.sleep(0.2)  # past the back-off: the tier really tries the dead server
        errors = remote.num_errors
        started = time.monotonic()
        outputs = run_checked(engine, [prompt])
        engine.flush_tiers()
        assert time.monotonic() - started < 10, "a request hung on a dead Redis"
        assert tokens_of(outputs) == [cold(prompt)]
        assert outputs[0].cached_tokens_by_tier["remote"] == 0
        assert remote.num_errors > errors


class SlowLink:
    """A TCP proxy to a Redis server whose answers come back at ``rate`` bytes/s in 64 KiB pieces, or, with
    ``stall_s`` set, after that long a pause: a slow network link, and one that stops."""

    def __init__(self, port: int, rate: float) -> None:
        self.target, self.rate, self.stall_s = port, rate, 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        try:
            while piece := source.recv(1 << 16):
                if slow:
                    time.sleep(self.stall_s or len(piece) / self.rate)
                sink.sendall(piece)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


def test_a_record_slower_to_move_than_the_timeout_is_read_and_a_stalled_link_is_a_miss(redis_server):
    """The Redis tier's timeout bounds a wait for the next bytes, not a whole transfer: a hybrid's state record
    (megabytes) over a link that takes longer than timeout_s to carry it still reads, verified as written; a link
    that stops for longer than timeout_s is a miss, counted, and the tier backs off."""
    url, _ = redis_server
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    direct = RedisTier(url, "fp")
    record_bytes = os.urandom(3 << 20)
    assert direct.put(b"k" * 16, record_bytes)
    link = SlowLink(port, rate=6e6)  # 3 MiB in ~0.5 s, twice the timeout; 11 ms between pieces
    try:
        slow = RedisTier(f"redis://127.0.0.1:{link.port}/0", "fp", timeout_s=0.25)
        started = time.monotonic()
        assert slow.get_many([b"k" * 16]) == [record_bytes]
        assert time.monotonic() - started > 0.25 and slow.num_errors == 0
        link.stall_s = 0.6
        assert slow.get_many([b"k" * 16]) == [None]
        assert slow.num_errors == 1 and not slow.available
    finally:
        link.close()


# --- 6. reset_prefix_cache(tiers=...) -------------------------------------------------------------
def test_reset_prefix_cache_empties_named_tiers(tiny_model: Path, tmp_path: Path, cold):
    disk = tmp_path / "disk"
    llm = make_llm(tiny_model, kv_disk_dir=str(disk), kv_host_memory="1MiB")
    engine = llm.engine
    fill_and_evict(engine, cold)
    assert disk_files(disk) and engine.tier_store.tier("host").num_bytes > 0
    count = len(disk_files(disk))

    assert llm.reset_prefix_cache(tiers=("disk",)) == count
    assert disk_files(disk) == [] and engine.tier_store.tier("disk").num_bytes == 0
    assert engine.tier_store.tier("host").num_bytes > 0  # the other tiers are untouched
    llm.reset_prefix_cache(tiers=("device", "host"))
    assert engine.tier_store.tier("host").num_bytes == 0
    assert engine.stats().cache.cached_blocks == 0

    outputs = run_checked(engine, [PROMPTS[0]])
    assert tokens_of(outputs) == [cold(PROMPTS[0])]
    assert outputs[0].num_cached_tokens == 0

    with pytest.raises(ValueError) as info:
        llm.reset_prefix_cache(tiers=("disk", "gpu"))
    assert getattr(info.value, "param", None) == "tiers"
    assert "gpu" in str(info.value) and "tiers" in str(info.value)


# --- 6. Redis Cluster --------------------------------------------------------------------------------
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def _cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus port (port + 10000) is free too, so below 55536."""
    ports: list[int] = []
    candidate = 20000 + os.getpid() % 20000
    while len(ports) < count:
        candidate += 1
        try:
            with socket.socket() as first, socket.socket() as bus:
                first.bind(("127.0.0.1", candidate))
                bus.bind(("127.0.0.1", candidate + 10000))
        except OSError:
            continue
        ports.append(candidate)
    return ports


@pytest.fixture
def redis_cluster(tmp_path: Path):
    """Six real redis-server processes in cluster mode (three masters, one replica each) on 127.0.0.1,
    joined by ``redis-cli --cluster create``; yields (the first node's port, {port: process})."""
    if not (os.access(REDIS_SERVER, os.X_OK) and os.access(REDIS_CLI, os.X_OK)):
        pytest.skip(f"no redis-server / redis-cli at {REDIS_SERVER} / {REDIS_CLI}: the Redis Cluster test needs both")
    redis = pytest.importorskip("redis", reason="redis-py is not installed")
    ports = _cluster_ports(6)
    processes: dict[int, subprocess.Popen] = {}
    try:
        for port in ports:
            folder = tmp_path / f"node-{port}"
            folder.mkdir()
            processes[port] = subprocess.Popen(
                [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                 "--cluster-node-timeout", "1000", "--dir", str(folder)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        for port in ports:
            while True:
                try:
                    redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                    break
                except redis.RedisError:
                    assert time.monotonic() < deadline, f"redis-server did not start on port {port}"
                    time.sleep(0.05)
        created = subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{port}" for port in ports],
                                  "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True,
                                 timeout=60)
        assert created.returncode == 0, created.stdout + created.stderr
        client = redis.RedisCluster(host="127.0.0.1", port=ports[0])
        while client.cluster_info().get("cluster_state") != "ok":
            assert time.monotonic() < deadline + 30, "the cluster did not come up"
            time.sleep(0.1)
        # A replica that has not synced with its master once would refuse to take over from it.
        for port in ports:
            node = redis.Redis(host="127.0.0.1", port=port)
            while (info := node.info("replication"))["role"] == "slave" and info.get("master_link_status") != "up":
                assert time.monotonic() < deadline + 60, f"replica {port} did not sync"
                time.sleep(0.1)
        yield ports[0], processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


def test_redis_cluster_url_lists_nodes_and_a_bad_one_is_named():
    pytest.importorskip("redis", reason="redis-py is not installed")
    url = "redis+cluster://user:secret@10.0.0.1:7000,10.0.0.2,10.0.0.3:7002"
    assert RedisTier(url, "fp")._cluster_nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("10.0.0.3", 7002)]
    for bad in ("10.0.0.1:port", "10.0.0.1:7000,:7001", "10.0.0.1:70000"):
        with pytest.raises(ValueError, match="kv_remote_url: cluster node .* is not HOST:PORT"):
            RedisTier(f"redis+cluster://{bad}", "fp")


def test_redis_cluster_tier_shared_and_a_master_failing_over_costs_only_misses(tiny_model: Path, redis_cluster,
                                                                               cold):
    import redis

    port, processes = redis_cluster
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{node}" for node in processes)  # every node: any may die
    first = make_llm(tiny_model, kv_remote_url=url)
    second = make_llm(tiny_model, kv_remote_url=url)
    for prompt in PROMPTS:
        assert tokens_of(run_checked(first.engine, [prompt])) == [cold(prompt)]
    first.engine.flush_tiers()
    assert first.stats()["kv_tiers"]["remote"]["stores"] >= len(PROMPTS) * TIER_TOKENS // BLOCK
    # The records spread over the three masters (one key each, in its own slot).
    cluster = redis.RedisCluster(host="127.0.0.1", port=port)
    masters = [node for node in cluster.get_primaries()]
    per_master = [cluster.dbsize(target_nodes=node) for node in masters]
    assert len(masters) == 3 and all(count > 0 for count in per_master), per_master

    # Another engine hits every prompt from the cluster.
    for prompt in PROMPTS:
        shared = run_checked(second.engine, [prompt])
        assert tokens_of(shared) == [cold(prompt)]
        assert shared[0].cached_tokens_by_tier == {"device": 0, "remote": TIER_TOKENS}

    # One master killed mid-run: requests still succeed with the same tokens; lookups of its slots are
    # misses (or, once its replica is promoted, hits of what had replicated), never wrong KV.
    prefix = first.engine.tier_store.tier("remote").prefix
    stored = [bytes.fromhex(name[len(prefix):].decode()) for node in masters
              for name in cluster.scan_iter(match=prefix + b"*", target_nodes=node)]
    # Which keys exist (a hybrid's state lookup asks this before reading one): pipelined across the slots.
    assert first.engine.tier_store.tier("remote").has_many([*stored[:5], b"\x00" * 16]) == [True] * 5 + [False]
    victim = masters[0].port
    processes[victim].kill()
    processes[victim].wait(timeout=10)
    # A client made right now learns a slot map that still names the dead master.
    fresh = RedisTier(url, first.engine.tier_store.fingerprint, retry_s=0.2)
    assert fresh.get_many(stored) == [None] * len(stored)
    third = make_llm(tiny_model, kv_remote_url=url)
    remote = third.engine.tier_store.tier("remote")
    remote.retry_s = 0.2
    started = time.monotonic()
    hits: list[int] = []
    while hits != [TIER_TOKENS] * len(PROMPTS):  # rounds through the failover (cluster-node-timeout 1 s)
        assert time.monotonic() - started < 30, f"no full round of hits after the failover: {hits}"
        hits = []
        for prompt in PROMPTS:
            outputs = run_checked(third.engine, [prompt])
            assert tokens_of(outputs) == [cold(prompt)]
            hits.append(outputs[0].cached_tokens_by_tier["remote"])
            third.reset_prefix_cache(tiers=("device",))
        time.sleep(0.1)
    # Lookups of the dead master's slots failed first (misses), and after the replica's promotion every
    # prompt hit again, the dead master's slots included; nothing read back failed its checks.
    assert remote.num_errors > 0
    assert third.stats()["kv_tiers"]["remote"]["verify_failures"] == {}
    # So does the client made during the outage, whose first slot map named the dead master.
    while None in fresh.get_many(stored):
        assert time.monotonic() - started < 30, "a client made during the outage kept its stale slot map"
        time.sleep(0.3)


def test_state_records_go_to_every_tier_and_the_deepest_verified_one_is_found():
    """Issue 66: a hybrid's kept state (and the block holding its tail's K/V) is written to every tier, host included;
    a lookup over a request's positions returns the deepest whose record verifies, and a record under another key,
    with other tail tokens or from another model is a counted miss, removed, and the next deepest serves."""
    from kvreuse.cache.hashing import state_keys
    from kvreuse.cache.tiers.store import StateRef

    state = record.BlockLayout(shape=(6,), dtype="state:float32", num_bytes=24)
    host, remote = HostTier(1 << 20), GatedTier()
    store = TieredStore("model-a", LAYOUT, [remote, host], state=state)
    tokens = [5, 6, 7]
    keys = state_keys(b"a" * 16, tokens)
    refs = [StateRef(keys[length], b"n" * 16, tokens[:length]) for length in range(len(tokens) + 1)]
    payload = {length: (bytes([length]) * state.num_bytes, bytes([9 + length]) * LAYOUT.num_bytes if length else None)
               for length in range(len(tokens) + 1)}
    for length in (0, 2):
        store.store_state(refs[length], *payload[length])
    assert flush_within(store) == 0
    assert set(host._records) == set(remote.records) == {keys[0], keys[2]}
    assert len(set(keys)) == 4 and not set(keys) & {block_ref(i).key for i in range(4)}

    found = store.lookup_state(refs)
    assert (found.tier, found.index, bytes(found.state), bytes(found.tail_block)) == ("host", 2, *payload[2])
    assert remote.reads == 0  # only the deepest record is read, from the first tier that holds it
    assert store.snapshot()["host"]["state_hits"] == 1
    assert store.lookup_state(refs[:2]).index == 0 and store.lookup_state(refs[:2]).tail_block is None

    # Position 2's record under position 3's key (a misnamed copy), in both tiers: refused as the wrong key; then
    # position 2 itself is found, then with it damaged in host memory, the remote copy.
    for tier in (host, remote):
        tier.put(keys[3], (host._records if tier is host else remote.records)[keys[2]])
    assert store.lookup_state(refs).index == 2
    assert store.snapshot()["host"]["verify_failures"] == {"key": 1}
    assert store.snapshot()["remote"]["verify_failures"] == {"key": 1}
    assert keys[3] not in host._records and keys[3] not in remote.records
    host._records[keys[2]] = host._records[keys[2]][:-1] + b"\x00"
    found = store.lookup_state(refs)
    assert (found.tier, found.index) == ("remote", 2) and keys[2] not in host._records
    # Other tail tokens under the same key, and another model's reader: misses.
    assert store.lookup_state([StateRef(keys[2], b"n" * 16, [5, 8])]) is None
    assert TieredStore("model-b", LAYOUT, [remote], state=state).lookup_state(refs[:1]) is None

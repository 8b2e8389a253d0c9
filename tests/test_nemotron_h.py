"""Nemotron-H (issue 66's third hybrid): Mamba-2, attention and MLP blocks by its pattern.

Logits and greedy float32 output equal transformers' ``NemotronHForCausalLM`` (prefill, chunked prefill, decode, mixed
batches, preemption); the native selective scan equals its PyTorch reference, and a state scanned in pieces is the bits
of one scanned whole. Each sequence's Mamba-2 state lives in a slot of the state pool beside the Gated DeltaNet's, and a
hit resumes from a snapshot of it exactly as on Qwen3.5 (tests/test_qwen3_5.py): at the end of a chat's last turn, and
at a shared 40-token prefix once a request branched there, without changing a bit of the output in batch-invariant
mode.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_engine import reference_greedy
from test_engine import run_checked as run_greedy_checked
from test_qwen3_5 import (
    BLOCK,
    logits_match_transformers_in_steps,
    make_llm,
    native_mixer_matches_its_reference_in_any_step,
    prompt_ids,
    randomize_mixer_and_states,
)
from test_tiers import read_header, redis_server, run_checked  # noqa: F401 (redis_server: a fixture)

from kvreuse import SamplingParams
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.kernels import mamba2_scan as scan_kernel
from kvreuse.layers.mamba2 import selective_scan_reference
from kvreuse.layers.recurrent import StateInputs
from kvreuse.model_tools.make_model import count_parameters, make_model
from kvreuse.models.config import MAMBA, MLP_BLOCK, ModelConfig
from kvreuse.server.metrics import ServerMetrics


def random_nemotron_h(folder: Path) -> Path:
    """The tiny preset (Mamba-2 blocks before and after its attention block) with transformers' own random init at a
    larger scale, norms drawn around one, saved over make-model's weights in transformers' spellings (its
    ``layers_block_type``; make-model writes the released files' ``hybrid_override_pattern``)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    folder = make_model(folder, preset="tiny-nemotron-h", dtype="float32", seed=3)
    written = json.loads((folder / "config.json").read_text())
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**{**written, "initializer_range": 0.2})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory) -> Path:
    return random_nemotron_h(tmp_path_factory.mktemp("nemotron_h") / "tiny")


def test_the_native_selective_scan_equals_its_reference_and_resumes_to_the_same_bits():
    if not scan_kernel.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    generator = torch.Generator().manual_seed(0)
    rows, heads, head_dim, groups, state_size = 13, 4, 8, 2, 16
    x = torch.randn(rows, heads, head_dim, generator=generator)
    dt = torch.randn(rows, heads, generator=generator) * 3  # softplus' x > 20 too, below
    dt[0, 0] = 25.0
    b, c = (torch.randn(rows, groups, state_size, generator=generator) for _ in range(2))
    a_log, dt_bias, d = (torch.randn(heads, generator=generator) for _ in range(3))
    states = torch.randn(4, 2, heads, head_dim, state_size, generator=generator)
    # Three sequences: 5 rows in slot 3, one decode row in slot 0, 7 rows in slot 1 (layer 1 of 2), the time step
    # clamped to [0.01, 4].
    inputs = StateInputs([3, 0, 1], [0, 5, 6], [5, 1, 7], None)  # type: ignore[arg-type]
    limit = (0.01, 4.0)
    initial, expected_states = states.clone(), states.clone()
    expected = selective_scan_reference(x, dt, b, c, a_log, dt_bias, d, expected_states, 1, inputs, limit)
    out = scan_kernel.selective_scan(x, dt, b, c, a_log, dt_bias, d, states, 1, inputs.slots, inputs.starts,
                                     inputs.lens, limit)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(states[2], initial[2]) and torch.equal(states[:, 0], initial[:, 0])  # nothing else touched
    # The third sequence's 7 rows as 3 + 1 + 3 steps: the same bits as in one (a resumed state is a cold run's).
    pieces = initial.clone()
    parts = [scan_kernel.selective_scan(x, dt, b, c, a_log, dt_bias, d, pieces, 1, [1], [start], [length], limit)
             for start, length in ((6, 3), (9, 1), (10, 3))]
    assert torch.equal(torch.cat([part[start:start + length] for part, (start, length)
                                  in zip(parts, ((6, 3), (9, 1), (10, 3)))]), out[6:13])
    assert torch.equal(pieces[1], states[1])


def test_the_config_reads_transformers_and_the_released_spellings():
    from transformers import NemotronHConfig

    theirs = NemotronHConfig(architectures=["NemotronHForCausalLM"],
                             layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"])
    config = ModelConfig.from_dict(theirs.to_dict())
    assert config.layer_types == (MAMBA, MLP_BLOCK, "full_attention", MAMBA)
    assert config.state_layers == [0, 3] and config.num_kv_layers == 1 and config.kv_layer_of(2) == 0
    assert config.state_matrix_shape == (128, 64, 128) and config.mamba_groups == 8 and not config.attention_rope
    # A snapshot: per Mamba-2 layer 128 heads of 64 x 128 float32 and 3 conv inputs of 8192 + 2 x 8 x 128.
    assert config.state_bytes == 2 * 4 * (128 * 64 * 128 + 3 * (8192 + 2048))
    assert config.mamba_dt_limit == (0.0, math.inf) and config.conv_bias and config.hidden_act == "relu2"
    # The released files: hybrid_override_pattern, the older mamba_ spellings, an infinite bound as JSON writes it.
    released = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
                "num_attention_heads": 4, "num_key_value_heads": 2, "attention_head_dim": 64, "vocab_size": 1000,
                "hybrid_override_pattern": "M-M*-", "mamba_num_heads": 8, "mamba_head_dim": 64,
                "mamba_n_groups": 2, "ssm_state_size": 32, "mamba_d_conv": 3, "mamba_conv_bias": False,
                "time_step_limit": [0.0, {"__float__": "Infinity"}], "layer_norm_epsilon": 1e-6}
    config = ModelConfig.from_dict(released)
    assert (config.num_hidden_layers, config.head_dim, config.conv_kernel, config.mamba_groups) == (5, 64, 3, 2)
    assert not config.conv_bias and config.rms_norm_eps == 1e-6 and config.mamba_dt_limit[1] == math.inf
    for change, words in (({"hybrid_override_pattern": "M-E*"}, "layer 2 is a mixture-of-experts block"),
                          ({"hybrid_override_pattern": "M-X*"}, "must name each layer"),
                          ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' is not supported"),
                          ({"mlp_bias": True}, "mlp_bias is set"),
                          ({"mamba_num_heads": 7}, r"mamba_heads \(7\) must be a multiple of mamba_groups")):
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_dict({**released, **change})


def test_logits_match_transformers_in_prefill_chunks_decode_and_mixed_batches(nemotron_h):
    logits_match_transformers_in_steps(nemotron_h)


def test_greedy_matches_transformers_alone_batched_chunked_and_preempted(nemotron_h):
    prompts = [prompt_ids(seed, length) for seed, length in ((1, 37), (2, 5), (3, 1), (4, 23))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [reference_greedy(nemotron_h, prompt, max_new_tokens=12) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) == 4 and all(len(set(tokens)) > 2 for tokens in expected)
    llm = make_llm(nemotron_h, enable_prefix_caching=False)
    assert llm.engine.kv_cache.num_layers == 1 and llm.engine.kv_cache.states is not None
    assert run_greedy_checked(llm.engine, prompts, greedy) == expected
    chunked = make_llm(nemotron_h, max_num_batched_tokens=8)
    assert run_greedy_checked(chunked.engine, prompts, greedy) == expected
    config = ModelConfig.from_pretrained(nemotron_h)
    tight = make_llm(nemotron_h, kv_cache_memory=16 * config.kv_bytes_per_token(torch.float32) * BLOCK
                     + 8 * config.state_bytes + 1, max_num_seqs=4, state_snapshot_fraction=0.5)
    assert run_greedy_checked(tight.engine, prompts, greedy) == expected
    assert tight.engine.stats().num_preemptions > 0


def test_hits_resume_from_snapshots_and_change_no_bit(nemotron_h):
    """Batch-invariant mode: every run below gives the tokens and logprobs a cache-free engine gives."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    shared = prompt_ids(30, 40)
    first, second, third = (shared + prompt_ids(seed, 6) for seed in (31, 32, 33))
    plain = make_llm(nemotron_h, batch_invariant=True, enable_prefix_caching=False)
    cached = make_llm(nemotron_h, batch_invariant=True)

    def run(llm, prompts: list[list[int]]) -> list[tuple]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.num_cached_tokens) for o in outputs]

    def same(warm: list[tuple], prompts: list[list[int]]) -> list[int]:
        assert [r[:2] for r in warm] == [r[:2] for r in run(plain, prompts)]
        return [r[2] for r in warm]

    out_first = run(cached, [first])
    assert same(out_first, [first]) == [0]
    assert same(run(cached, [second]), [second]) == [0]  # recomputes the 40 shared tokens, keeps its state at 40
    assert same(run(cached, [third]), [third]) == [40]  # a 40-token shared prefix hits to its last token
    assert same(run(cached, [first, second]), [first, second]) == [40, 40]
    turn2 = first + list(out_first[0][0]) + prompt_ids(34, 7)  # the next turn: all the first one computed
    assert same(run(cached, [turn2]), [turn2]) == [len(first) + 10 - 1]
    snapshots = cached.engine.kv.states.snapshots
    assert 0 < snapshots.num_bytes <= snapshots.budget_bytes
    cached.engine.check_integrity()


def test_four_conversations_at_once_reuse_all_of_each_previous_turn_beside_a_one_state_budget(nemotron_h):
    """Issue 66's chat goal where conversations outnumber the snapshot budget: four conversations take their turns at
    once (each turn its history, the answer's generated ids and new tokens), the budget holds one state and four
    requests run. The running requests' slots that no request holds between turns keep the conversations' ends (lent
    to the snapshots), and each next turn takes its conversation's end over as its slot: every turn after the first
    reuses all its previous turn computed (the prompt and the answer but its last token, which is sampled, not fed),
    with the tokens and logprobs a cache-free engine gives, the invariants checked after every step."""
    config = ModelConfig.from_pretrained(nemotron_h)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    cached = make_llm(nemotron_h, batch_invariant=True, max_num_seqs=4,
                      state_snapshot_fraction=1.5 * config.state_bytes / 2**22)
    plain = make_llm(nemotron_h, batch_invariant=True, enable_prefix_caching=False)
    states = cached.engine.kv.states
    assert states.snapshots.budget_bytes < 2 * config.state_bytes and states.num_slots == 4 + 1
    histories = [prompt_ids(90 + chat, 11 + 3 * chat) for chat in range(4)]
    reused = [0] * 4
    for turn in range(3):
        outputs = run_checked(cached.engine, histories, params)
        expected = plain.generate([{"prompt_token_ids": history} for history in histories], params)
        assert [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in outputs] == [
            (o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in expected]
        assert [o.num_cached_tokens for o in outputs] == reused
        assert len(states.snapshots) == 5  # the four ends beside the budget's one
        reused = [len(history) + 6 - 1 for history in histories]
        histories = [history + list(output.outputs[0].token_ids) + prompt_ids(100 + 4 * turn + chat, 5)
                     for chat, (history, output) in enumerate(zip(histories, outputs))]
    assert states.num_handed_over == 8
    # What they hold, reported: the stats and the server's gauges (the budget's one state, four idle slots lent).
    stats = cached.stats()
    assert (stats["state_snapshots"], stats["state_snapshot_bytes"], stats["state_snapshot_lent_bytes"]) == (
        5, 5 * config.state_bytes, 4 * config.state_bytes)
    assert config.state_bytes <= stats["state_snapshot_budget_bytes"] < 2 * config.state_bytes
    metrics = ServerMetrics("m", cached.engine.stats).render()[0].decode()
    assert f'kvreuse:state_snapshot_bytes{{model_name="m"}} {float(5 * config.state_bytes)}' in metrics
    assert 'kvreuse:state_snapshots{model_name="m"} 5.0' in metrics
    # Without prefix caching no snapshot is kept: the gauge says so.
    assert 'kvreuse:state_snapshots{model_name="m"} 0.0' in ServerMetrics("m", plain.engine.stats).render()[0].decode()


def test_snapshots_go_to_the_host_disk_and_redis_tiers_and_come_back_verified(nemotron_h, tmp_path, redis_server):
    """A kept state goes to every tier with the block holding its tail's K/V; a fresh engine (another process's view of
    the disk or Redis) resumes a chat's next turn from it, to the token the last turn computed, with the bits a
    cache-free engine gives. A damaged state record is a counted miss, removed, and the next deepest one serves; a state
    is never served to another tenant."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = prompt_ids(40, 42)
    plain = make_llm(nemotron_h, batch_invariant=True, enable_prefix_caching=False)

    def run(llm, prompts: list[list[int]], cache_salt: str | None = None):
        outputs = run_checked(llm.engine, prompts, params, cache_salt=cache_salt)
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.cached_tokens_by_tier) for o in outputs]

    def same(outputs, prompts: list[list[int]]) -> list[dict[str, int]]:
        assert [r[:2] for r in outputs] == [r[:2] for r in run_greedy_plain(prompts)]
        return [r[2] for r in outputs]

    def run_greedy_plain(prompts):
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in plain.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]

    disk = tmp_path / "disk"
    writer = make_llm(nemotron_h, batch_invariant=True, kv_disk_dir=str(disk))
    first = run(writer, [prompt])
    writer.engine.flush_tiers()
    assert writer.stats()["kv_tiers"]["disk"]["state_stores"] == 2  # the prompt's end (42) and the request's (51)
    finish = len(prompt) + 10 - 1  # the last computed token: the answer's last token is sampled, not computed
    turn2 = prompt + list(first[0][0]) + prompt_ids(41, 7)
    # A fresh engine holds nothing: the blocks come from disk (12 full ones, 48 tokens) and the state at 51 with the
    # K/V of its 3-token tail.
    assert same(run(make_llm(nemotron_h, batch_invariant=True, kv_disk_dir=str(disk)), [turn2]), [turn2]) == [
        {"device": 0, "disk": finish}]

    # Damage the state record at 51: the next engine counts the checksum failure, removes it, resumes at 42.
    damaged, = (path for path in disk.rglob("*.kvb") if read_header(path)["dtype"].startswith("state")
                and read_header(path)["tokens"] == turn2[finish // BLOCK * BLOCK:finish])  # its tail's tokens
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x40
    damaged.write_bytes(bytes(data))
    reader = make_llm(nemotron_h, batch_invariant=True, kv_disk_dir=str(disk))
    assert same(run(reader, [turn2]), [turn2]) == [{"device": 0, "disk": len(prompt)}]
    assert reader.stats()["kv_tiers"]["disk"]["verify_failures"] == {"checksum": 1} and not damaged.exists()

    # The host tier: the device pool emptied, its blocks went to host memory and its states were already there.
    host = make_llm(nemotron_h, batch_invariant=True, kv_host_memory="64MiB")
    run(host, [prompt])
    host.engine.flush_tiers()
    assert host.reset_prefix_cache() > 0 and not host.engine.kv.states.snapshots.snapshots()
    assert same(run(host, [turn2]), [turn2]) == [{"device": 0, "host": finish}]

    # Redis, shared by two engines: a tenant's state serves that tenant only.
    url, _ = redis_server
    sharer = make_llm(nemotron_h, batch_invariant=True, kv_remote_url=url)
    run(sharer, [prompt], cache_salt="tenant-a")
    sharer.engine.flush_tiers()
    other = make_llm(nemotron_h, batch_invariant=True, kv_remote_url=url)
    assert same(run(other, [turn2], cache_salt="tenant-b"), [turn2]) == [{"device": 0, "remote": 0}]
    assert same(run(other, [turn2], cache_salt="tenant-a"), [turn2]) == [{"device": 0, "remote": finish}]
    assert other.stats()["kv_tiers"]["remote"]["state_hits"] == 1
    metrics = ServerMetrics("m", other.engine.stats, tier_stats=other.engine.tier_store.snapshot).render()[0].decode()
    assert 'kvreuse:kv_tier_state_hits_total{model_name="m",tier="remote"} 1.0' in metrics


def test_what_nemotron_h_cannot_do_yet_is_refused_by_name(nemotron_h):
    for options, words in (({"speculative_config": {"method": "cache"}}, "Mamba-2 layers' state would take in"),
                           ({"chunk_reuse": True}, r"chunk_reuse on a hybrid model \(NemotronHForCausalLM: 2 of its 5"),
                           ({"enable_lora": True}, "enable_lora on a hybrid model")):
        with pytest.raises(ValueError, match=words):
            make_llm(nemotron_h, **options)
    # Where the default 64 running requests' states and the snapshots' share (a quarter: 10 here) would not fit, fewer
    # run at once, within half the pool (a warning says so), instead of a refusal; a caller's value that fits stays.
    state = ModelConfig.from_pretrained(nemotron_h).state_bytes
    assert make_llm(nemotron_h, kv_cache_memory=40 * state).engine.config.scheduler.max_num_seqs == 10
    assert make_llm(nemotron_h, kv_cache_memory=40 * state, max_num_seqs=8).engine.config.scheduler.max_num_seqs == 8


def test_make_model_writes_nemotron_h_shapes_transformers_loads(tmp_path):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    folder = make_model(tmp_path / "nemotron-h-0.5b", preset="nemotron-h-0.5b", write_weights=False)
    written = json.loads((folder / "config.json").read_text())
    ours = ModelConfig.from_pretrained(folder)
    assert ours.layer_types.count(MAMBA) == 12 and ours.num_kv_layers == 2 and ours.mamba_inner_size == 3072
    with torch.device("meta"):
        real = NemotronHForCausalLM(NemotronHConfig(**written))
    assert count_parameters("nemotron-h-0.5b", vocab_size=written["vocab_size"]) == sum(
        p.numel() for p in real.parameters())


def test_a_gguf_file_as_llama_cpp_writes_nemotron_h_runs_as_its_folder(nemotron_h, tmp_path):
    """llama.cpp's layout: the layer kinds by the per-layer KV heads and MLP widths, the Mamba-2 heads by the ssm.*
    keys, A_log stored as -exp(A_log) and D as [heads, 1], the grouped norm as [groups, inner / groups], the depthwise
    kernel as [C, K]. A float32 file runs as its folder; a Q8_0 file runs quantized."""
    from test_qwen3_5 import gguf_files_run_as_their_folder

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    types = gguf_files_run_as_their_folder(nemotron_h, tmp_path / "nemotron_h", [prompt_ids(7, 21), prompt_ids(8, 3)],
                                           greedy)
    assert types["model.layers.0.mixer.in_proj.weight"] == "Q8_0" and types["model.layers.1.mixer.up_proj.weight"] == "Q8_0"
    assert types["model.layers.0.mixer.A_log"] == "F32"


def test_the_kv_event_log_says_where_states_are_kept(nemotron_h):
    """A router credits a hybrid server only up to the blocks that anchor a state (cache/events.py): a finished
    request's state at its end is a state_stored on its last full block, and a state dropped by retention while its
    block stays is a state_removed."""
    config = ModelConfig.from_pretrained(nemotron_h)
    llm = make_llm(nemotron_h, max_num_seqs=1, state_snapshot_fraction=1.5 * config.state_bytes / 2**22)
    assert len(llm.engine.kv.states.snapshots) == 0 and llm.engine.kv.states.snapshots.budget_bytes < 2 * config.state_bytes
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = prompt_ids(60, 21)  # 21 + 3 tokens, 23 computed: its states anchor on block 5 (tokens 16-19)
    llm.generate([{"prompt_token_ids": first}], params)
    events = [(event.type, event.key) for event in llm.engine.kv_events.read(0, 1000).events]
    stored_states = [key for kind, key in events if kind == "state_stored"]
    assert stored_states and all(key in {k for kind, k in events if kind == "stored"} for key in stored_states)
    # A second request elsewhere: the one snapshot's room goes to it, the first one's state is dropped, its blocks stay.
    llm.generate([{"prompt_token_ids": prompt_ids(61, 21)}], params)
    later = [(event.type, event.key) for event in llm.engine.kv_events.read(0, 1000).events][len(events):]
    assert ("state_removed", stored_states[-1]) in later
    assert ("removed", stored_states[-1]) not in later


@pytest.mark.parametrize("head_dim, state_size", [(8, 16), (6, 37)])
def test_the_native_mixer_equals_the_op_by_op_path_and_gives_a_row_the_same_bits_in_any_step(head_dim, state_size):
    """The Mamba-2 mixer between its projections in one native call (convolution, scan, gate and grouped norm):
    the op-by-op PyTorch path's values, and for a sequence's rows the same bits whether they come in one prefill
    chunk, in pieces, or beside other sequences' rows (what a snapshot hit needs). Widths that fill the sums' 16
    lanes exactly, and widths with a tail after them (a state of 37, groups of 12 channels)."""
    if not scan_kernel.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    from kvreuse.layers.mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    heads, groups, kernel, hidden = 4, 2, 4, 32
    mixer = Mamba2Mixer(hidden, heads, head_dim, groups, state_size, kernel, True, False, (0.0, math.inf), 1e-5, 1,
                        torch.float32, torch.device("cpu"))
    pool = RecurrentStatePool(4, 2, heads, head_dim, state_size, mixer.conv_dim, kernel)
    randomize_mixer_and_states(mixer, pool)
    with torch.no_grad():
        z, xbc, dt = mixer.in_proj(torch.randn(12, hidden)).split([mixer.inner_size, mixer.conv_dim, heads], dim=-1)

    def mix(pick: torch.Tensor, inputs: StateInputs, native: bool) -> torch.Tensor:
        if native:
            return scan_kernel.mixer(xbc[pick], z[pick], dt[pick], mixer.conv1d.weight, mixer.conv1d.bias, pool.conv,
                                     mixer.A_log, mixer.dt_bias, mixer.D, mixer.norm.weight, pool.ssm, 1, inputs.slots,
                                     inputs.starts, inputs.lens, heads, groups, 1e-5)
        with torch.no_grad():
            return mixer.reference(len(pick), z[pick], xbc[pick], dt[pick], inputs, torch.float32)

    native_mixer_matches_its_reference_in_any_step(pool, mix, dict(atol=1e-4, rtol=1e-4))

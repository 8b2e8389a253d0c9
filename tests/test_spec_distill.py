"""kvreuse.model_tools.distill: a distilled EAGLE draft is accepted far more often than a random one, never
changes greedy outputs, trains the function the engine runs, and ``kvreuse distill-eagle`` writes a
folder the engine loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvreuse.llm import LLM
from kvreuse.loading.loader import load_model
from kvreuse.model_tools.distill import (
    _chained_forward,
    _TrainingAttention,
    corpus_prompts,
    target_features,
)
from kvreuse.model_tools.make_draft import make_random_draft
from kvreuse.sampling import SamplingParams
from kvreuse.spec.eagle import load_eagle_draft
from kvreuse.tokenizer import Tokenizer

# Small enough for ~15 s on two cores, big enough that the tiny target's draft clearly learns.
TRAINING = dict(num_sequences=160, seq_len=96, gen_tokens=48, batch_size=16, steps=300, depth=2, seed=0)
MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory, _offline_and_private_cache):
    from kvreuse.model_tools.distill import distill_eagle_draft
    from kvreuse.model_tools.make_model import make_model

    root = tmp_path_factory.mktemp("distill")
    target = make_model(root / "m", preset="tiny", dtype="float32")
    draft = root / "draft"
    figures = distill_eagle_draft(target, draft, log=None, **TRAINING)
    return target, draft, figures


def _held_out_prompts(target: Path) -> list[list[int]]:
    """Prompts from the corpus region training never reads, plus text of no corpus at all."""
    tokenizer = Tokenizer(target)
    prompts = corpus_prompts(tokenizer, 6, 64, seed=7, split="heldout")
    prompts += [tokenizer.encode(text, add_special_tokens=False) for text in (
        "Quantum gardeners of Reykjavik rarely forget their umbrellas on Tuesdays.",
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")]
    return prompts


def _generate(target: Path, prompts: list[list[int]], draft: Path | None, k: int = 2):
    spec = None if draft is None else {"method": "eagle", "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(str(target), dtype="float32", kv_cache_memory="64MiB", speculative_config=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm.stats()


def test_distilled_draft_is_accepted_far_more_than_a_random_one(distilled, tmp_path: Path):
    target, draft, figures = distilled
    assert figures["engine_agreement"] == 1.0  # the feature pass reproduces the engine's greedy tokens
    assert figures["train_top1"] > 0.15
    assert figures["best_step"] > 0  # training improved on the initial copy for this target
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]

    prompts = _held_out_prompts(target)
    plain, _ = _generate(target, prompts, None)
    random_draft = make_random_draft(target, tmp_path / "random")
    for k in (1, 3):
        trained_out, trained = _generate(target, prompts, draft, k)
        random_out, random = _generate(target, prompts, random_draft, k)
        assert trained_out == plain and random_out == plain  # speculation never changes greedy outputs
        rate, random_rate = trained["spec_decode_acceptance_rate"], random["spec_decode_acceptance_rate"]
        assert rate > 0.05 and rate > 5 * random_rate, (k, rate, random_rate)
        assert trained["spec_decode_mean_acceptance_length"] > random["spec_decode_mean_acceptance_length"]


def test_training_forward_is_the_engines_draft(distilled):
    """Replay k=1 speculation from the training forward (token p + f_{p-1} -> token p+1) over the engine's
    own greedy outputs: the acceptance rate it predicts is the engine's."""
    target, draft_dir, _ = distilled
    prompts = corpus_prompts(Tokenizer(target), 8, 64, seed=3, split="heldout")
    plain, _ = _generate(target, prompts, None)
    _, engine = _generate(target, prompts, draft_dir, k=1)

    model, _ = load_model(target, torch.float32, "cpu")
    draft = load_eagle_draft(draft_dir, "eagle", model, 0, torch.float32, torch.device("cpu"))
    draft.attention_backend = _TrainingAttention()
    sequences = torch.tensor([p + o for p, o in zip(prompts, plain)])
    features, labels = target_features(model, sequences)
    with torch.no_grad():
        rows = _chained_forward(draft, sequences, features, 1)[0]
        predicted = draft.compute_logits(rows.reshape(-1, rows.shape[-1])).argmax(-1).view(sequences.shape)
    accepted = drafts = 0
    for row in range(len(prompts)):
        position = len(prompts[row])  # the first generated token: the first draft entry
        while position < sequences.shape[1] - 1:
            drafts += 1
            if predicted[row, position] == labels[row, position]:
                accepted, position = accepted + 1, position + 2  # accepted plus the bonus token
            else:
                position += 1
    assert accepted > 0
    assert abs(accepted / drafts - engine["spec_decode_acceptance_rate"]) < 0.03


def test_cli_writes_a_draft_the_engine_loads(tmp_path: Path, _offline_and_private_cache):
    from kvreuse.model_tools.make_model import make_model

    target = make_model(tmp_path / "m", preset="tiny", dtype="bfloat16")
    out = tmp_path / "draft"
    script = Path(sys.executable).with_name("kvreuse")
    command = [str(script)] if script.exists() else [shutil.which("kvreuse") or "kvreuse"]
    done = subprocess.run(
        [*command, "distill-eagle", str(target), str(out), "--steps", "30", "--num-sequences", "16",
         "--seq-len", "48", "--gen-tokens", "16", "--depth", "2", "--seed", "3"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    assert "train_top1" in done.stdout and str(out) in done.stdout
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        assert handle.get_tensor("fc.weight").dtype == torch.bfloat16  # saved in the target's dtype
    model, _ = load_model(target, torch.bfloat16, "cpu")
    draft = load_eagle_draft(out, "eagle", model, 0, torch.bfloat16, torch.device("cpu"))
    assert draft.digest
    llm = LLM(str(target), dtype="bfloat16", kv_cache_memory="64MiB",
              speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 2})
    output = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8
    assert llm.stats()["spec_decode_num_drafts"] > 0

    bad = subprocess.run([*command, "distill-eagle", str(tmp_path / "missing"), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a model folder" in bad.stderr


def test_a_gguf_target_gets_a_draft_its_quantized_engine_uses(tmp_path: Path, _offline_and_private_cache):
    """distill-eagle takes a GGUF file (config and tokenizer from its metadata, its blocks dequantized for
    training); the draft loads beside the file served from its quantized blocks, and greedy output is
    the same with and without it."""
    from gguf_files import write_gguf

    from kvreuse.model_tools.distill import distill_eagle_draft
    from kvreuse.model_tools.make_model import make_model

    gguf_file = write_gguf(make_model(tmp_path / "m", preset="tiny", dtype="float32"), tmp_path / "m.gguf", "Q8_0")
    out = tmp_path / "draft"
    figures = distill_eagle_draft(gguf_file, out, log=None, num_sequences=16, seq_len=48, gen_tokens=16,
                                  batch_size=8, steps=10, depth=2, seed=0)
    assert figures["engine_agreement"] > 0.95  # the feature pass computes what the engine generated
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] > 0

    prompts = _held_out_prompts(tmp_path / "m")[:2]
    plain, _ = _generate(gguf_file, prompts, None)
    speculated, stats = _generate(gguf_file, prompts, out)
    assert speculated == plain
    assert stats["spec_decode_num_drafts"] > 0

    with pytest.raises(ValueError, match="missing.gguf' does not exist"):
        distill_eagle_draft(tmp_path / "missing.gguf", out, log=None)

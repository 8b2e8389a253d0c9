"""bfloat16 on CPU: prepacked oneDNN weights must give exactly the numbers of plain F.linear."""

from __future__ import annotations

import json
import shutil

import pytest
from kvreuse import LLM, SamplingParams
from kvreuse.models import layers

pytestmark = pytest.mark.skipif(not layers.cpu_weight_packing_available(), reason="no oneDNN on this build")


@pytest.fixture(scope="module")
def tied_model(tiny_models, tmp_path_factory):
    """The tiny qwen2 folder with tie_word_embeddings on (its lm_head.weight is then ignored)."""
    folder = tmp_path_factory.mktemp("tied") / "qwen2-tied"
    shutil.copytree(tiny_models["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("tied", [True, False])
def test_packed_weights_match_plain_linear(tiny_models, tied_model, monkeypatch, tied):
    folder = tied_model if tied else tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 21, 40)]
    packed_llm = LLM(str(folder), dtype="bfloat16", device="cpu", kv_cache_memory="8MiB")
    model = packed_llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, layers.Linear)]
    assert linears and all(m.packed_weight is not None and m.weight is None for m in linears)
    assert (model.lm_head is None) == tied and (model._packed_tied_head is not None) == tied
    packed = packed_llm.generate(prompts, params, use_tqdm=False)

    monkeypatch.setattr(layers, "cpu_weight_packing_available", lambda: False)
    plain_llm = LLM(str(folder), dtype="bfloat16", device="cpu", kv_cache_memory="8MiB")
    assert all(m.packed_weight is None for m in plain_llm.engine.model.modules() if isinstance(m, layers.Linear))
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(packed, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]

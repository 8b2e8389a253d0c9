"""CPU linear kernels (models/kernels.py): the measured choice per row count, and outputs that agree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kvreuse import LLM, SamplingParams
from kvreuse.models import kernels
from kvreuse.models.kernels import ALWAYS, LinearKernel, LinearPlan, PlanBook, decide
from kvreuse.models.layers import Linear

needs_onednn = pytest.mark.skipif(not kernels.packing_available(torch.float32), reason="no oneDNN on this build")


def test_decide_finds_the_crossover_and_ignores_one_noisy_probe():
    plain = {1: 100.0, 2: 100.0, 4: 100.0, 8: 100.0, 256: 100.0, 512: 100.0}
    # Packed wins at 2-8 rows; the 1-row probe was hit by noise; 256 and up lose.
    packed = {1: 120.0, 2: 50.0, 4: 50.0, 8: 50.0, 256: 130.0, 512: 140.0}
    plan = decide(plain, packed)
    assert plan.packed_max_rows == 8 and plan.keep_plain
    # Slower everywhere: never packed.
    assert decide({1: 1.0, 2: 2.0}, {1: 1.5, 2: 2.5}).packed_max_rows == 0
    # Faster everywhere but 10% slower at the largest size: packed up to the size before, plain kept.
    edge = decide({1: 100.0, 64: 100.0, 512: 100.0, 2048: 100.0}, {1: 50.0, 64: 50.0, 512: 50.0, 2048: 110.0})
    assert edge.packed_max_rows == 512 and edge.keep_plain
    # Faster, or within the tolerance at the largest sizes: the plain weight is released.
    tied = decide({1: 100.0, 512: 1000.0, 2048: 4000.0},
                  {1: 50.0, 512: 1000.0 * kernels.DROP_PLAIN_TOLERANCE, 2048: 4000.0})
    assert tied.packed_max_rows == ALWAYS and not tied.keep_plain


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0, 8, ALWAYS])
def test_kernel_matches_f_linear_at_every_row_count(dtype, threshold):
    if not kernels.packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(0)
    weight = torch.randn(96, 80).to(dtype)
    bias = torch.randn(96).to(dtype)
    plan = LinearPlan(threshold, keep_plain=threshold != ALWAYS)
    kernel = LinearKernel(weight, bias, plan)
    assert (kernel.packed is None) == (threshold == 0)
    assert (kernel.weight is None) == (threshold == ALWAYS)
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, 80).to(dtype)
        # Same product, another summation order: equal within float tolerance (bfloat16 exactly).
        expected = F.linear(x, weight, bias)
        got = kernel(x)
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_plans_are_measured_once_and_read_back(tmp_path, monkeypatch):
    path = tmp_path / "linear-kernels.json"
    book = PlanBook(path)
    plan = book.plan_for(torch.float32, (64, 32))
    assert book.measured == 1 and set(plan.plain_us) == set(plan.packed_us) == set(kernels.PROBE_ROWS)
    book.save()
    stored = json.loads(path.read_text())
    assert stored["version"] == kernels.PLAN_VERSION and len(stored["plans"]) == 1
    (key,) = stored["plans"]
    assert "float32 | 64x32" in key and f"torch {torch.__version__}" in key
    # A second book (another process would do the same) reads the verdict instead of measuring.
    monkeypatch.setattr(kernels, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = PlanBook(path).plan_for(torch.float32, (64, 32))
    assert (again.packed_max_rows, again.keep_plain) == (plan.packed_max_rows, plan.keep_plain)


def test_environment_override_and_bad_value(tmp_path, monkeypatch):
    book = PlanBook(tmp_path / "plans.json")
    monkeypatch.setenv(kernels.KERNEL_ENV, "plain")
    assert book.plan_for(torch.float32, (8, 8)) == kernels.PLAIN
    monkeypatch.setenv(kernels.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="KVREUSE_LINEAR_KERNEL must be auto, plain or packed"):
        book.plan_for(torch.float32, (8, 8))


@pytest.fixture(scope="module")
def tied_model(tiny_models, tmp_path_factory):
    """The tiny qwen2 folder with tie_word_embeddings on (its lm_head.weight is then ignored)."""
    folder = tmp_path_factory.mktemp("tied") / "qwen2-tied"
    shutil.copytree(tiny_models["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _generate(folder, monkeypatch, kernel: str):
    monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 21, 40)]
    return llm, llm.generate(prompts, params, use_tqdm=False)


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_engine_on_packed_kernels_matches_plain(tiny_models, tied_model, monkeypatch, tied):
    folder = tied_model if tied else tiny_models["llama"]
    packed_llm, packed = _generate(folder, monkeypatch, "packed")
    model = packed_llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.kernel is not None and m.weight is None for m in linears)
    assert (model.lm_head is None) == tied and (model._tied_head_kernel is not None) == tied
    plain_llm, plain = _generate(folder, monkeypatch, "plain")
    assert all(m.kernel is None for m in plain_llm.engine.model.modules() if isinstance(m, Linear))
    for a, b in zip(packed, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        a_lp = [lp.logprob for lp in a.outputs[0].logprobs]
        b_lp = [lp.logprob for lp in b.outputs[0].logprobs]
        assert a_lp == pytest.approx(b_lp, abs=1e-4)


@needs_onednn
def test_measured_plan_is_used_by_the_engine_and_kept_in_the_cache_dir(tiny_models, tmp_path):
    """A fresh cache dir: the engine measures each shape once, writes the plans, and a second process
    with the same cache dir starts from them."""
    code = (
        "import json, sys\n"
        "from kvreuse import LLM\n"
        "from kvreuse.models.layers import Linear\n"
        "llm = LLM(sys.argv[1], dtype='float32', device='cpu', kv_cache_memory='8MiB')\n"
        "kinds = sorted({(m.kernel.plan.packed_max_rows if m.kernel else 0) for m in llm.engine.model.modules()"
        " if isinstance(m, Linear)})\n"
        "print(json.dumps(kinds))\n"
    )
    env = {**__import__("os").environ, "KVREUSE_CACHE_DIR": str(tmp_path), "KVREUSE_LINEAR_KERNEL": "auto"}
    first = subprocess.run([sys.executable, "-c", code, str(tiny_models["llama"])], env=env,
                           capture_output=True, text=True, check=True)
    plans = json.loads((tmp_path / "linear-kernels.json").read_text())["plans"]
    assert len(plans) >= 3  # qkv, o, gate_up, down, lm_head shapes of the tiny model
    mtime = (tmp_path / "linear-kernels.json").stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code, str(tiny_models["llama"])], env=env,
                            capture_output=True, text=True, check=True)
    assert first.stdout == second.stdout  # the same verdicts, read back
    assert (tmp_path / "linear-kernels.json").stat().st_mtime_ns == mtime  # nothing measured again

"""CPU linear kernels (layers/plan_book.py): the measured choice per row count, and outputs that agree."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kvreuse import LLM, SamplingParams
from kvreuse.layers import plan_book
from kvreuse.layers.linear import Linear
from kvreuse.layers.plan_book import ALWAYS, LinearKernel, LinearPlan, PlanBook, decide, monotone_in_rows


def _times(**by_kernel: dict[int, float]) -> dict[str, dict[int, float]]:
    return {name: dict(values) for name, values in by_kernel.items()}


def test_decide_takes_the_best_single_kernel_unless_a_split_clearly_pays():
    sizes = (1, 8, 64, 512, 2048)
    flat = {n: 100.0 for n in sizes}
    # Packed wins everywhere but at one probe, by less than SPLIT_MARGIN: still one kernel, one layout.
    noisy = decide(_times(plain=flat, packed={1: 108.0, 8: 50.0, 64: 50.0, 512: 60.0, 2048: 90.0}))
    assert noisy.segments == ((ALWAYS, "packed"),)
    assert noisy.kernels == {"packed"}
    # Slower everywhere: plain stays.
    assert decide(_times(plain=flat, packed={n: 150.0 for n in sizes})).kernels == {"plain"}
    # Transposed wins the memory-bound sizes by far, plain the compute-bound ones: a split at 64.
    split = decide(_times(plain=flat, transposed={1: 40.0, 8: 40.0, 64: 60.0, 512: 150.0, 2048: 160.0}))
    assert split.segments == ((64, "transposed"), (ALWAYS, "plain"))
    assert split.kernel_for(64) == "transposed" and split.kernel_for(65) == "plain"
    # Three ranges over two layouts: split_in (transposed copy) for one row, packed for a few, transposed
    # for many; a row count between two probes takes the kernel of the probe above it.
    mixed = decide(_times(plain={n: 200.0 for n in sizes}, packed={1: 100.0, 8: 50.0, 64: 50.0, 512: 150.0, 2048: 150.0},
                          transposed={1: 100.0, 8: 100.0, 64: 100.0, 512: 100.0, 2048: 100.0},
                          split_in={1: 60.0, 8: 100.0, 64: 100.0, 512: 100.0, 2048: 100.0}))
    assert mixed.segments == ((1, "split_in"), (64, "packed"), (ALWAYS, "transposed"))
    assert [mixed.kernel_for(n) for n in (1, 2, 64, 65, 10**6)] == [
        "split_in", "packed", "packed", "transposed", "transposed"]
    assert mixed.layouts == {"transposed", "packed"} and mixed.describe() == (
        "split_in<=1, packed<=64, transposed above")
    # Limited to one layout per weight, the same measurements give the best single kernel.
    assert decide(split.times_us, max_layouts=1).kernels == {"transposed"}
    # A split that gains less than SPLIT_MARGIN is not worth a second copy of the weight.
    slight = decide(_times(plain=flat, transposed={1: 95.0, 8: 100.0, 64: 100.0, 512: 101.0, 2048: 101.0}))
    assert len(slight.kernels) == 1
    # Two kernels over one layout cost no memory: any gain takes them (split_in reads the transposed copy).
    shared = decide(_times(plain={n: 200.0 for n in sizes}, transposed=flat,
                           split_in={1: 95.0, 8: 101.0, 64: 101.0, 512: 101.0, 2048: 101.0}))
    assert shared.segments == ((1, "split_in"), (ALWAYS, "transposed"))
    assert shared.layouts == {"transposed"}
    # Ties go to plain.
    assert decide(_times(plain=flat, transposed=flat)).kernels == {"plain"}


def test_a_quantized_kernel_s_time_at_few_rows_is_capped_by_its_time_at_more():
    """Timings stored on this VM for a 1024 x 2048 Q8_0 weight while another process held both cores: qdot8's
    1-row probe took 2.1 ms against 0.13 ms at 2 rows, and the plan ran every decode step's product through qtile."""
    inf = float("inf")
    noisy = {"qdot": {1: 7700.0, 2: 185.6, 4: 553.7, 8: 993.3, 128: inf},
             "qdot8": {1: 2096.2, 2: 128.3, 4: 167.5, 8: 231.7, 128: 7716.7},
             "qtile": {1: 1446.6, 2: 1153.2, 4: 1175.4, 8: 1491.8, 128: 6941.7},
             "qtile_bf16": {1: inf, 2: inf, 4: inf, 8: inf, 128: 5000.0}}
    assert decide(noisy, 1).kernel_for(1) == "qtile"
    capped = monotone_in_rows(noisy)
    assert capped["qdot8"] == {1: 128.3, 2: 128.3, 4: 167.5, 8: 231.7, 128: 7716.7}
    assert capped["qtile_bf16"][1] == inf and capped["qdot"][128] == inf  # unprobed counts stay unprobed
    assert decide(capped, 1).kernel_for(1) == "qdot8"
    assert monotone_in_rows(capped) == capped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan", [LinearPlan.single("packed"), LinearPlan.single("transposed"),
                                  LinearPlan.single("split_in"), LinearPlan.single("split_out"),
                                  LinearPlan(((8, "packed"), (ALWAYS, "plain"))),
                                  LinearPlan(((3, "transposed"), (ALWAYS, "packed"))),
                                  LinearPlan(((1, "split_in"), (8, "packed"), (ALWAYS, "transposed"))),
                                  LinearPlan(((2, "split_out"), (ALWAYS, "packed"))),
                                  LinearPlan.single("rowdot"), LinearPlan.single("rowdot8"),
                                  LinearPlan(((1, "rowdot"), (4, "rowdot8"), (ALWAYS, "packed")))],
                         ids=lambda plan: plan.describe())
def test_kernel_matches_f_linear_at_every_row_count(dtype, plan):
    if "packed" in plan.kernels and not plan_book.packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    if plan.kernels & {"rowdot", "rowdot8"} and not plan_book.rowdot_runs(dtype):
        pytest.skip(f"the row-dot kernel did not build here, or does not run {dtype}")
    torch.manual_seed(0)
    weight = torch.randn(96, 80).to(dtype)
    bias = torch.randn(96).to(dtype)
    kernel = LinearKernel(weight, bias, plan)
    # Only the layouts the plan uses are held (split_in reads the transposed copy).
    assert set(kernel.layouts) == plan.layouts and (kernel.weight is not None) == ("plain" in plan.layouts)
    assert kernel.layout_bytes == len(plan.layouts) * weight.numel() * weight.element_size()
    # bfloat16: split_in rounds each thread's partial product before summing them, so an output can be
    # off by one bf16 step at the outputs' magnitude (~10 here: 0.0625), however small the output itself.
    tolerance = 6.25e-2 if dtype == torch.bfloat16 else 1e-5
    for rows in (0, 1, 2, 3, 8, 9, 40):
        x = torch.randn(rows, 80).to(dtype)
        # Same product, another summation order: equal within float tolerance.
        torch.testing.assert_close(kernel(x), F.linear(x, weight, bias), rtol=tolerance, atol=tolerance)
    x = torch.randn(2, 5, 80).to(dtype)  # leading batch dimensions count as rows
    torch.testing.assert_close(kernel(x), F.linear(x, weight, bias), rtol=tolerance, atol=tolerance)


@pytest.fixture
def quick_probes(monkeypatch):
    """Fewer probe sizes and weight copies: the same code path, a fraction of the start-up time."""
    monkeypatch.setattr(plan_book, "PROBE_ROWS", (1, 16, 128))
    monkeypatch.setattr(plan_book, "MAX_COPIES", 2)


def test_plans_are_measured_once_and_read_back(tmp_path, monkeypatch, quick_probes):
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    path = tmp_path / "linear-kernels.json"
    book = PlanBook(path)
    assert book.plan_for(torch.float32, (64, 32)) == plan_book.PLAIN and book.measured == 0  # too small to matter
    plan = book.plan_for(torch.float32, (512, 512))
    expected = {"plain", "transposed", *plan_book.split_kernels_fit((512, 512), torch.get_num_threads())}
    expected |= {"packed"} if plan_book.packing_available(torch.float32) else set()
    expected |= {"rowdot", "rowdot8"} if plan_book.rowdot_runs(torch.float32) else set()
    assert book.measured == 1 and set(plan.times_us) == expected
    assert all(set(times) == set(plan_book.PROBE_ROWS) for times in plan.times_us.values())
    # The row-dot kernels are GEMVs: probed up to ROWDOT_MAX_ROWS rows, never chosen above.
    for name in expected & {"rowdot", "rowdot8"}:
        assert plan.times_us[name][128] == float("inf") and plan.times_us[name][16] < float("inf")
    assert all(kernel not in ("rowdot", "rowdot8") for limit, kernel in plan.segments if limit > 64)
    book.save()
    stored = json.loads(path.read_text())
    assert stored["version"] == plan_book.PLAN_VERSION and len(stored["plans"]) == 1
    (key,) = stored["plans"]
    assert "float32 | 512x512" in key and f"torch {torch.__version__}" in key
    # The file keeps the timings; the verdict is decided from them on reading.
    assert set(stored["plans"][key]["times_us"]) == expected
    # A second book (another process would do the same) reads the verdict instead of measuring.
    monkeypatch.setattr(plan_book, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = PlanBook(path).plan_for(torch.float32, (512, 512))
    assert again.segments == plan.segments


@pytest.mark.parametrize("entry", [{}, {"times_us": "fast"}, {"times_us": {"plain": {"1": "x"}}},
                                   {"times_us": {"warp": {"1": 1.0}}},
                                   {"times_us": {"plain": {"1": 1.0}, "transposed": {"2": 1.0}}}],
                         ids=["no-times", "not-a-dict", "not-a-number", "unknown-kernel", "other-rows"])
def test_a_malformed_entry_is_measured_again(tmp_path, monkeypatch, quick_probes, entry):
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    path = tmp_path / "linear-kernels.json"
    book = PlanBook(path)
    key = book._key(torch.float32, (512, 512))
    path.write_text(json.dumps({"version": plan_book.PLAN_VERSION, "plans": {key: entry}}))
    book = PlanBook(path)
    plan = book.plan_for(torch.float32, (512, 512))
    assert book.measured == 1 and set(plan.times_us["plain"]) == set(plan_book.PROBE_ROWS)
    book.save()
    assert PlanBook(path)._stored_times(key) is not None  # the new measurement replaced the bad entry


def test_environment_override_and_bad_value(tmp_path, monkeypatch):
    book = PlanBook(tmp_path / "plans.json")
    monkeypatch.setenv(plan_book.KERNEL_ENV, "transposed")
    assert book.plan_for(torch.float32, (8, 8)) == LinearPlan.single("transposed")
    monkeypatch.setenv(plan_book.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="KVREUSE_LINEAR_KERNEL must be auto, plain, packed, transposed"):
        book.plan_for(torch.float32, (8, 8))
    assert book.measured == 0


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
    monkeypatch.setenv(plan_book.KERNEL_ENV, kernel)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 21, 40)]
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("kernel", ["packed", "transposed", "split_in", "split_out", "rowdot", "rowdot8"])
@pytest.mark.parametrize("tied", [True, False])
def test_engine_on_other_kernels_matches_plain(tiny_models, tied_model, monkeypatch, tied, kernel):
    if kernel == "packed" and not plan_book.packing_available(torch.float32):
        pytest.skip("no oneDNN on this build")
    if kernel.startswith("rowdot") and not plan_book.rowdot_runs(torch.float32):
        pytest.skip("the row-dot kernel did not build here (no compiler)")
    folder = tied_model if tied else tiny_models["llama"]
    other_llm, other = _generate(folder, monkeypatch, kernel)
    model = other_llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # The plain weight is released unless the kernel reads it (the row-dot kernels do, in place).
    assert linears and all(m.kernel is not None and m.kernel.plan.kernels == {kernel}
                           and (m.weight is None) == (plan_book.LAYOUT[kernel] != "plain") for m in linears)
    assert (model.lm_head is None) == tied and (model._tied_head_kernel is not None) == tied
    plain_llm, plain = _generate(folder, monkeypatch, "plain")
    assert all(m.kernel is None for m in plain_llm.engine.model.modules() if isinstance(m, Linear))
    for a, b in zip(other, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        a_lp = [lp.logprob for lp in a.outputs[0].logprobs]
        b_lp = [lp.logprob for lp in b.outputs[0].logprobs]
        assert a_lp == pytest.approx(b_lp, abs=1e-4)


def test_engine_measures_each_shape_once_and_reads_the_verdicts_back(tiny_models, tmp_path, monkeypatch,
                                                                     quick_probes):
    """A fresh cache dir: the engine measures each of the model's shapes once (the tiny model's weights
    are below the size worth measuring, so the threshold is lowered), follows the verdicts, and keeps
    them in the cache dir; a second engine starts from the file without measuring."""
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    monkeypatch.setattr(plan_book, "MIN_MEASURED_ELEMENTS", 0)
    measured: list[tuple[int, int]] = []
    real_measure = plan_book.measure

    def counting_measure(out_features, in_features, *args, **kwargs):
        measured.append((out_features, in_features))
        return real_measure(out_features, in_features, *args, **kwargs)

    monkeypatch.setattr(plan_book, "measure", counting_measure)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    shapes = {(sum(m.output_sizes), m.input_size) for m in linears}
    assert sorted(measured) == sorted(shapes)  # each distinct shape once, not once per layer
    plans = json.loads((tmp_path / "linear-kernels.json").read_text())["plans"]
    assert len(plans) == len(shapes)
    for module in linears:  # every layer runs what the file's timings decide for its shape
        key = next(k for k in plans if k.endswith(f"| {sum(module.output_sizes)}x{module.input_size}"))
        times = {name: {int(rows): us for rows, us in by_rows.items()} for name, by_rows in plans[key]["times_us"].items()}
        verdict = decide(times)
        plan = module.kernel.plan if module.kernel is not None else plan_book.PLAIN
        assert plan.segments == verdict.segments
    monkeypatch.setattr(plan_book, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 30))}
    assert (again.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def _plant_timings(path, shapes, times_us) -> None:
    """A plans file as PlanBook writes it, with the same timings for every shape."""
    machine = plan_book._machine_key()
    plans = {f"{machine} | float32 | {o}x{i}": {"times_us": times_us} for o, i in shapes}
    path.write_text(json.dumps({"version": plan_book.PLAN_VERSION, "plans": plans}))


@pytest.mark.parametrize("budget", [0, 2**40])
def test_second_layouts_only_within_the_memory_budget(tiny_models, tmp_path, monkeypatch, budget):
    """Timings where one row is fastest on split_in (the transposed copy) and more rows packed: with
    memory to spare every layer keeps both layouts; with no budget for second copies every layer gets its
    best one-layout plan, and the outputs agree either way."""
    if not plan_book.packing_available(torch.float32):
        pytest.skip("no oneDNN on this build")
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    monkeypatch.setattr(plan_book, "MIN_MEASURED_ELEMENTS", 0)
    monkeypatch.setattr(plan_book, "second_layout_budget", lambda: budget)
    monkeypatch.setattr(plan_book, "measure", lambda *a, **k: pytest.fail("the planted timings cover every shape"))
    llama = LlamaConfig.from_pretrained(tiny_models["llama"])
    hidden, inter, vocab = llama.hidden_size, llama.intermediate_size, llama.vocab_size
    qkv = hidden + 2 * llama.num_key_value_heads * (hidden // llama.num_attention_heads)
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter), (vocab, hidden)]
    rows = (1, 8, 64)
    _plant_timings(tmp_path / "linear-kernels.json", shapes, {
        "plain": {n: 100.0 for n in rows}, "packed": {1: 100.0, 8: 50.0, 64: 50.0},
        "transposed": {n: 100.0 for n in rows}, "split_in": {1: 40.0, 8: 100.0, 64: 100.0},
        "split_out": {n: 100.0 for n in rows}})
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    expected = {"packed", "transposed"} if budget else {"packed"}
    assert linears and all(m.kernel is not None and m.kernel.plan.layouts == expected for m in linears)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 30)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv(plan_book.KERNEL_ENV, "plain")
    plain = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]

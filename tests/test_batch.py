"""``kvreuse run``: the system prompt cache seed's examples end to end, and malformed files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvreuse import LLM
from kvreuse.batch import BatchFileError, load_batch_file, run_batch

SYSTEM = "You are a helpful Python programming assistant. Answer with short code examples. " * 3


def seed_examples() -> dict:
    """The seed's three examples in one file: save, automatic reuse, a LoRA adapter request."""
    return {
        "available_lora_weights": {"french": "/path/to/french_adapter.safetensors"},
        "requests": [
            {"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "How do I read a CSV file?"}],
             "save_system_prompt_kv_cache": True, "max_tokens": 4},
            {"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "How do I write JSON?"}], "max_tokens": 4},
            {"messages": [{"role": "system", "content": "Translate the following to French."},
                          {"role": "user", "content": "Hello"}],
             "lora_name": "french", "save_system_prompt_kv_cache": True, "max_tokens": 4},
            {"messages": [{"role": "system", "content": [{"type": "text", "text": "Look at this."},
                                                         {"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "user", "content": "What is it?"}],
             "save_system_prompt_kv_cache": True, "max_tokens": 4},
        ],
    }


def test_seed_examples_save_reuse_and_per_request_errors(tiny_model, tmp_path):
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(seed_examples()))
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB", enable_lora=True)
    result = run_batch(llm.engine, load_batch_file(path))
    saved, reused, lora, multimodal = result["results"]
    assert saved["error"] is None and len(saved["saved_entries"]) == 1
    pin_id = saved["saved_entries"][0]
    # The second request names no flag and still reuses the saved system prompt.
    assert reused["error"] is None and reused["hit_entries"] == [pin_id]
    pin = result["summary"]["pins"][0]
    assert pin["id"] == pin_id and pin["kind"] == "system_prompt" and pin["hits"] == 1
    assert reused["metrics"]["reused_tokens"] >= pin["tokens"]
    assert reused["metrics"]["computed_tokens"] == reused["metrics"]["prompt_tokens"] - reused["metrics"]["reused_tokens"]
    # The seed's adapter path does not exist here: that request fails alone, naming the path
    # (tests/test_lora.py runs the same example with a real adapter).
    assert "requests[2]" in lora["error"] and "french_adapter.safetensors' does not exist" in lora["error"]
    assert "requests[3]" in multimodal["error"] and "text only" in multimodal["error"]
    assert result["summary"]["errors"] == 2 and result["summary"]["requests"] == 4
    for item in (saved, reused):
        metrics = item["metrics"]
        assert metrics["output_tokens"] == 4 and 0 <= metrics["ttft_s"] <= metrics["e2e_s"]


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["requests"][1]["messages"][0].update(role="robot"), "requests[1].messages[0].role"),
    (lambda d: d["requests"][0].update(max_tokens=0), "requests[0].max_tokens"),
    (lambda d: d["requests"][0].update(temprature=0.5), "requests[0].temprature"),
    (lambda d: d.update(requests=[]), "requests"),
    (lambda d: d["requests"][0].pop("messages"), "requests[0].messages"),
])
def test_malformed_files_point_at_the_field(tmp_path, mutate, field):
    data = seed_examples()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BatchFileError) as caught:
        load_batch_file(path)
    assert f": {field}:" in str(caught.value)


def test_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{requests: ")
    with pytest.raises(BatchFileError, match="not valid JSON"):
        load_batch_file(path)


def test_cli_run_writes_results(tiny_model, tmp_path):
    path, out = tmp_path / "batch.json", tmp_path / "out.json"
    data = seed_examples()
    data["requests"] = data["requests"][:2]
    path.write_text(json.dumps(data))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "kvreuse.cli", "run", str(path), "--model", str(tiny_model),
                           "--output", str(out), "--dtype", "float32", "--device", "cpu",
                           "--kv-cache-memory", "8MiB", "--debug"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(Path(out).read_text())
    assert result["summary"]["errors"] == 0 and result["results"][1]["hit_entries"]
    assert "saved the system prompt as pin-" in done.stderr and "reused saved entry pin-" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "kvreuse.cli", "run", str(tmp_path / "missing.json"), "--model",
                          str(tiny_model)], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr

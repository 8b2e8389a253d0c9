"""LoRA through a real server: "model" selects the adapter (vLLM's convention), /v1/models lists adapters
with their parent and digest, load / unload need an admin key and a path inside --lora-dir, metrics
count requests per adapter, and the cache keeps adapters and the base model apart."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server
from test_lora import make_adapter

from kvreuse import LLM, LoRARequest, SamplingParams

TENANT, ADMIN = "lora-tenant", "lora-admin"
SYSTEM = "You translate English into French. Keep names and numbers as they are. " * 4


@pytest.fixture(scope="module")
def lora_root(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-dir")
    make_adapter(tiny_model, root / "french", seed=11)
    make_adapter(tiny_model, root / "german", seed=12, targets=["q_proj", "v_proj"])
    return root


@pytest.fixture(scope="module")
def server(tiny_model: Path, lora_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("lora-server") / "server.log",
                           "--enable-lora", "--lora-modules", f"french={lora_root / 'french'}",
                           "--lora-dir", str(lora_root), "--api-key", TENANT, "--admin-key", ADMIN,
                           "--stats-log-interval", "0")
    yield running
    stop_server(running)


def client(server: RunningServer, key: str = TENANT) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def ask(server: RunningServer, model: str, question: str):
    return client(server).chat.completions.create(
        model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def post(server: RunningServer, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_models_list_adapters_with_parent_and_digest(server: RunningServer):
    models = {model.id: model for model in client(server).models.list().data}
    assert set(models) == {MODEL_NAME, "french"}
    french = models["french"].model_dump()
    assert french["parent"] == MODEL_NAME and len(french["adapter_digest"]) == 32


def test_adapter_output_equals_offline_and_the_cache_keeps_it_apart(server: RunningServer, tiny_model: Path,
                                                                    lora_root: Path):
    first = ask(server, "french", "Good morning, Anna.")
    assert first.model == "french" and first.usage.prompt_tokens_details.cached_tokens == 0
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="32MiB", enable_lora=True)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Good morning, Anna."}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    offline = llm.chat(messages, params, use_tqdm=False,
                       lora_request=LoRARequest("french", 1, str(lora_root / "french")))[0]
    assert first.choices[0].message.content == offline.outputs[0].text
    base = ask(server, MODEL_NAME, "Good morning, Anna.")
    assert base.usage.prompt_tokens_details.cached_tokens == 0  # the adapter's KV is not the base model's
    assert base.choices[0].message.content == llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    again = ask(server, "french", "Good morning, Anna.")
    assert again.usage.prompt_tokens_details.cached_tokens > 40
    assert again.choices[0].message.content == first.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        ask(server, "klingon", "Hello")
    # The Anthropic route follows the same "model" rule.
    messages_client = anthropic.Anthropic(base_url=server.base_url, api_key=TENANT, max_retries=0, timeout=60)
    reply = messages_client.messages.create(model="french", max_tokens=6, system=SYSTEM, extra_body={"temperature": 0},
                                            messages=[{"role": "user", "content": "Good morning, Anna."}])
    assert reply.usage.cache_read_input_tokens > 40


def test_load_and_unload_need_an_admin_key_and_a_path_inside_lora_dir(server: RunningServer, lora_root: Path,
                                                                       tmp_path: Path):
    german = str(lora_root / "german")
    denied = post(server, "/v1/load_lora_adapter", {"lora_name": "german", "lora_path": german}, key=TENANT)
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    outside = tmp_path / "outside"
    shutil.copytree(lora_root / "german", outside)
    refused = post(server, "/v1/load_lora_adapter", {"lora_name": "german", "lora_path": str(outside)})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"
    sneaky = post(server, "/v1/load_lora_adapter", {"lora_name": "german", "lora_path": f"{lora_root}/../outside"})
    assert sneaky.status_code == 400 and sneaky.json()["error"]["param"] == "lora_path"
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "german", "lora_path": str(lora_root / "nope")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"

    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "german", "lora_path": german})
    assert loaded.status_code == 200, loaded.text
    assert "german" in {model.id for model in client(server).models.list().data}
    assert ask(server, "german", "Hello").choices[0].finish_reason == "length"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "german"}, key=TENANT).status_code == 403
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "german"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        ask(server, "german", "Hello")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "german"}).status_code == 404


def test_metrics_count_requests_per_adapter(server: RunningServer):
    def scrape() -> str:
        return httpx.get(f"{server.base_url}/metrics").text

    def count(text: str, lora_name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvreuse:lora_requests_total" and sample.labels.get("lora_name") == lora_name:
                    return sample.value
        return 0.0

    before = scrape()
    ask(server, "french", "One more.")
    ask(server, MODEL_NAME, "One more.")
    after = scrape()
    assert count(after, "french") == count(before, "french") + 1
    assert count(after, "") == count(before, "") + 1
    assert "kvreuse:lora_resident_adapters" in after


def test_vllm_lora_requests_info_names_running_adapters(server: RunningServer):
    """vllm:lora_requests_info (what the Gateway API Inference Extension's LoRA affinity reads) names the
    adapters of the running requests and the most that run at once."""
    from prometheus_client.parser import text_string_to_metric_families

    def info() -> dict[str, str]:
        text = httpx.get(f"{server.base_url}/metrics").text
        (sample,) = [sample for family in text_string_to_metric_families(text) for sample in family.samples
                     if sample.name == "vllm:lora_requests_info"]
        assert sample.value > 1e9  # the snapshot's time, as vLLM reports it
        return sample.labels

    seen: list[dict[str, str]] = []
    with ThreadPoolExecutor(1) as pool:  # poll while one adapter request runs
        request = pool.submit(client(server).completions.create, model="french", prompt="A long story:",
                              max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        while not request.done():
            seen.append(info())
        assert request.result().choices[0].finish_reason == "length"
    running = {labels["running_lora_adapters"] for labels in seen}
    assert "french" in running and running <= {"french", ""}, running
    assert {labels["max_lora"] for labels in seen} == {"4"}  # --max-loras' default
    assert info()["running_lora_adapters"] == ""  # finished: no longer running

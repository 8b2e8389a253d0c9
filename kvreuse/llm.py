"""The offline API, named as vLLM's so users can switch: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvreuse.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory_size,
)
from kvreuse.engine import LLMEngine
from kvreuse.inputs import (
    GenerationMemory,
    InputProcessor,
    PromptInput,
    TokenizedPrompt,
)
from kvreuse.lora.request import LoRARequest
from kvreuse.output_processor import OutputProcessor, step_and_process
from kvreuse.outputs import RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.system_prompt import pin_prompt_now

ChatMessage = dict[str, Any]

# A bar is worth drawing only when a batch takes a while.
PROGRESS_BAR_MIN_REQUESTS = 16


class LLM:
    """Load a model once, then generate for many prompts with continuous batching and prefix reuse."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        quantization: str | None = None,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        kv_cache_memory: int | str = "1GiB",
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        scheduling_policy: str = "lpm",
        seed: int = 0,
        served_model_name: str | None = None,
        max_pinned_fraction: float = 0.5,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        speculative_config: dict[str, Any] | str | None = None,
        kv_host_memory: int | str = 0,
        kv_disk_dir: str | None = None,
        kv_disk_size: int | str = "20GiB",
        kv_remote_url: str | None = None,
        kv_write_queue_size: int | str = "1GiB",
        enable_torch_compile: bool = False,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        batch_invariant: bool | None = None,
        chunk_reuse: bool = False,
        chunk_recompute_fraction: float = 0.3,
        chunk_check_layer: int | None = None,
        chunk_recompute_first: int = 0,
        state_snapshot_fraction: float = 0.25,
        state_snapshot_policy: str = "saved",
    ) -> None:
        """``speculative_config``: vLLM's dict (or its JSON text): ``{"method": "eagle" | "eagle3", "model": DRAFT_DIR,
        "num_speculative_tokens": k}`` (an EAGLE draft); ``{"method": "cache", ...}`` (the cache drafter, with
        ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``, ``namespace_tokens``; "ngram": the
        request's own tokens only); ``{"method": "none"}``: no drafting. None: the cache drafter where
        batch-invariant mode is on (exact verification), none elsewhere.
        KV tiers behind the device pool: ``kv_host_memory`` (bytes or "4GiB"; 0: none), ``kv_disk_dir``
        with ``kv_disk_size``, ``kv_remote_url`` ("redis://host:port/0"); ``kv_write_queue_size``: the most
        bytes of blocks waiting to be written to disk and Redis (beyond it a block is not written, and counted).
        ``enable_torch_compile``: retired; True raises ValueError saying why (the native CPU step and CUDA graphs
        are the decode paths).
        ``quantization`` (vLLM's name): "gguf" keeps a GGUF file's quantized weights in memory and runs on
        them (the default for a .gguf model on CPU), "int8" quantizes a folder's linear layers at load
        (weight-only), "none" holds every weight in ``dtype``.
        ``kv_cache_dtype`` (vLLM's name): "auto" stores K and V in ``dtype``; "bfloat16" in bfloat16 under a
        float32 model (half the bytes to read per decode step); "int8", "fp8" (= "fp8_e4m3") and
        "fp8_e5m2" store one byte per value with a scale per token and KV head (about 1.9x the tokens of
        bfloat16 in the same ``kv_cache_memory``).
        ``attention_backend`` (vLLM's name): "auto" attends in place with the C++ kernel on CPU
        (attention/cpu_paged.py) and with Triton kernels on CUDA (attention/triton_paged.py), "cpu_paged" and
        "triton" insist on theirs, "torch" gathers and runs SDPA (the reference).
        ``enforce_eager`` (vLLM's name): no CUDA graphs (on CUDA, pure decode steps otherwise replay one captured
        graph per padded batch size: runner/decode/cuda_graphs.py).
        ``batch_invariant`` (vLLM's and SGLang's name): a token's logits and K/V are the same bits however it was
        computed (cold, after a prefix hit, alone or batched, in any prefill chunk): one product kernel per weight
        format at every row count and every attention row in the paged kernel over fixed partitions (CPU). None
        (the default): on where it costs little (a q8_0 / q4_0 / q4_1 GGUF file on a CPU with
        AVX512-VNNI), off elsewhere; the log says which and why.
        ``chunk_reuse`` (issue 39, docs/chunks.md): chunks marked ``"scope": "chunk"`` are reused at any position,
        and an earlier turn's tokens found moved earlier; their K/V is moved and the ``chunk_recompute_fraction``
        of it that deviates most after layer ``chunk_check_layer`` (None: a tenth of the model's layers) is
        recomputed, with the first
        ``chunk_recompute_first`` tokens of each moved span. Reused tokens count as cached.
        ``state_snapshot_fraction`` (a hybrid with Gated DeltaNet layers, issue 66): the share of ``kv_cache_memory``
        its recurrent-state snapshots may hold; ``state_snapshot_policy``: which goes first when they are full,
        "saved" (the least compute saved per byte) or "lru"."""
        config = EngineConfig(
            model=str(model),
            served_model_name=served_model_name,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            load_format=load_format,
            quantization=quantization,
            seed=seed,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=parse_memory_size(kv_cache_memory),
                kv_host_memory=parse_memory_size(kv_host_memory, "kv_host_memory") if kv_host_memory else 0,
                kv_disk_dir=str(kv_disk_dir) if kv_disk_dir else None,
                kv_disk_size=parse_memory_size(kv_disk_size, "kv_disk_size"),
                kv_remote_url=kv_remote_url,
                kv_write_queue_size=parse_memory_size(kv_write_queue_size, "kv_write_queue_size"),
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                max_pinned_fraction=max_pinned_fraction,
                chunk_reuse=chunk_reuse,
                chunk_recompute_fraction=chunk_recompute_fraction,
                chunk_check_layer=chunk_check_layer,
                chunk_recompute_first=chunk_recompute_first,
                state_snapshot_fraction=state_snapshot_fraction,
                state_snapshot_policy=state_snapshot_policy,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                scheduling_policy=scheduling_policy,
            ),
            lora=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank),
            max_model_len=max_model_len,
            speculative=SpeculativeConfig.from_value(speculative_config),
            enable_torch_compile=enable_torch_compile,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            batch_invariant=batch_invariant,
        )
        self.engine = LLMEngine(config)
        # LLM runs the engine on the caller's thread, so it shares the engine's tokenizer. Its outputs and
        # inputs share a generation memory: a chat that replays a generated turn encodes it as the ids that
        # were generated, so every turn of an agent loop starts with the previous prompt and generation.
        self.generation_memory = GenerationMemory()
        self.inputs = InputProcessor(self.engine.tokenizer, self.engine.max_model_len,
                                     self.engine.model_config.vocab_size, generation_memory=self.generation_memory)
        self._outputs = OutputProcessor(self.engine.tokenizer, self.generation_memory)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, ``{"prompt_token_ids": [...]}`` or a list of token ids. Every prompt is
        validated before any is queued, so a bad one raises ValueError and nothing runs.
        ``lora_request``: one adapter for every prompt, or a list with one (or None) per prompt.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        # Validate everything first: a bad prompt must not leave half a batch queued.
        tokenized = [self.inputs.from_prompt(prompt) for prompt in prompts]
        return self._run(tokenized, params_list, use_tqdm, cache_salt, self._loras_per_prompt(lora_request, len(prompts)))

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        ``tools`` (OpenAI's shape) are listed in the prompt by the template; assistant messages may carry
        ``tool_calls`` and ``role: "tool"`` messages answer them (kvreuse.messages). Enforcing a
        ``tool_choice`` is the sampling params' grammar (kvreuse.tool_parsers ``structured_outputs``).
        A text part with ``"cache_control": {"type": "ephemeral", "scope": "chunk"}`` marks a chunk: its text is
        encoded on its own, the same ids at any position, and its span goes to the engine with the prompt
        (issue 39: the reuse of a chunk's KV at another position is not built yet)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.inputs.from_messages(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                             memory_scope=cache_salt or "")
                   for conversation in conversations]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm, cache_salt, self._loras_per_prompt(lora_request, len(prompts)))

    @staticmethod
    def _loras_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                          count: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"lora_request has {len(loras)} entries but there are {count} prompts")
        return loras

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(
                f"sampling_params has {len(params_list)} entries but there are {count} prompts"
            )
        return params_list

    def _run(
        self, prompts: list[TokenizedPrompt], params_list: list[SamplingParams], use_tqdm: bool,
        cache_salt: str | None, loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.engine
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            engine.adapter_digest(lora)  # a refused adapter fails the call before anything is queued
        for constraint in {params.structured_outputs.key: params.structured_outputs for params in params_list
                           if params.structured_outputs is not None}.values():
            engine.structured.compiler.compile(constraint)  # so is a refused constraint (compiled once, cached)
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, params, lora in zip(request_ids, prompts, params_list, loras):
            engine.add_request(request_id, prompt.as_engine_prompt(), params, cache_salt=cache_salt,
                               lora_request=lora)
            self._outputs.add_request(request_id, prompt.token_ids, params, memory_scope=cache_salt or "")
        finished: dict[str, RequestOutput] = {}
        show_bar = use_tqdm and len(prompts) >= PROGRESS_BAR_MIN_REQUESTS
        with tqdm(total=len(prompts), desc="requests", disable=not show_bar, unit="req") as bar:
            while len(finished) < len(request_ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests of this batch unfinished")
                for output in step_and_process(engine, self._outputs):
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    # --- explicit caching -------------------------------------------------------------------------
    def pin(
        self,
        prompt: str | list[int] | list[ChatMessage],
        *,
        ttl: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> dict[str, Any]:
        """Compute and pin the KV of a prompt (a string, token ids, or a conversation whose system
        prompt is pinned), so LRU never evicts it. Returns the pin's description (see ``pins()``)."""
        return pin_prompt_now(self.engine, prompt, ttl=ttl, cache_salt=cache_salt,
                              request_id=f"pin-{next(self._ids)}", lora_request=lora_request).as_dict()

    def unpin(self, pin_id: str) -> None:
        """Remove a pin; its blocks stay cached as ordinary (evictable) entries."""
        try:
            self.engine.unpin(pin_id)
        except KeyError:
            raise ValueError(f"no pin with id {pin_id!r}") from None

    def pins(self) -> list[dict[str, Any]]:
        """Pins in creation order: id, kind, tokens, blocks, adapter, created, last_used, hits, ttl, expires."""
        return [pin.as_dict() for pin in self.engine.list_pins()]

    def stats(self) -> dict[str, Any]:
        """Prefix-cache queries and hits (tokens), hit rate, evictions, blocks used / idle / free; with
        speculative decoding also drafts, draft tokens, accepted tokens (total and per position) and
        the acceptance rate (``spec_decode_*``); the pool's ``kv_cache_dtype`` and ``kv_tokens_per_gib``."""
        kv_cache = self.engine.kv_cache
        return {**self.engine.stats().as_dict(), "kv_cache_dtype": kv_cache.kv_cache_dtype,
                "kv_tokens_per_gib": kv_cache.tokens_per_gib}

    def drift_report(self, top: int = 10) -> dict[str, Any]:
        """Why recent prompts missed the cache: misses grouped by (namespace, template start, divergence
        position), most tokens lost first, each with a sentence, the volatile spans found where the text
        changes (dates, times, ids, whitespace, reordered blocks) and advice. See docs/observatory.md."""
        return self.engine.drift_report(top=top)

    def reset_prefix_cache(self, tiers: Sequence[str] = ("device",)) -> int:
        """Drop every idle cached block of the device pool and of the other ``tiers`` named (host, disk,
        remote); returns how many blocks were dropped."""
        return self.engine.reset_prefix_cache(tuple(tiers))

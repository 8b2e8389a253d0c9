"""Reference runner: plain transformers behind the same streaming OpenAI subset, for comparisons.

It serves requests one at a time with ``model.generate`` and reuses prompt caches the way
transformers users usually do: it keeps the ``DynamicCache`` of recent prompts (an LRU bounded in
entries and tokens), and for a new request deep-copies the one that shares the longest prefix with
it, crops the copy to the shared part and lets ``generate`` compute only the rest. Shared prefixes
shorter than ``min_reuse_tokens`` are not worth the copy and are computed again. Usage reports the
reused tokens as ``prompt_tokens_details.cached_tokens``.

    python -m kvreuse.bench.reference_server --model DIR --port 8001 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger("kvreuse.bench.reference")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _CacheEntry:
    token_ids: torch.Tensor  # 1-D, the prompt the cache holds
    cache: Any  # transformers DynamicCache of exactly those tokens


@dataclass(frozen=True)
class GenerationResult:
    output_ids: list[int]
    cached_tokens: int
    finish_reason: str


class ReferenceRunner:
    """transformers ``generate`` with an LRU of copied prompt caches (not thread-safe: one at a time)."""

    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto", max_entries: int = 32,
                 max_cached_tokens: int = 65536, min_reuse_tokens: int = 16) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from kvreuse.loading.loader import resolve_tokenizer_path
        from kvreuse.tokenizer import Tokenizer

        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if min_reuse_tokens < 1:
            raise ValueError(f"min_reuse_tokens must be >= 1, got {min_reuse_tokens}")
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        # A GGUF file: transformers reads it from its folder by name (and dequantizes it).
        gguf = {"gguf_file": Path(model_dir).name} if Path(model_dir).suffix.lower() == ".gguf" else {}
        location = str(Path(model_dir).parent) if gguf else model_dir
        config = AutoConfig.from_pretrained(location, **gguf)
        if dtype == "auto":
            torch_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            torch_dtype = DTYPES.get(str(torch_dtype).replace("torch.", ""), torch.float32) \
                if not isinstance(torch_dtype, torch.dtype) else torch_dtype
        elif dtype in DTYPES:
            torch_dtype = DTYPES[dtype]
        else:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
        has_weights = bool(gguf) or any(Path(model_dir).glob("*.safetensors"))
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, **gguf)
        else:  # a config-only folder: random weights, as kvreuse's dummy load format
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        self.model = model.to(self.device).eval()
        self.dtype = torch_dtype
        self.tokenizer = Tokenizer(resolve_tokenizer_path(model_dir))
        self.max_entries = max_entries
        self.max_cached_tokens = max_cached_tokens
        self.min_reuse_tokens = min_reuse_tokens
        self.entries: OrderedDict[int, _CacheEntry] = OrderedDict()
        self._next_entry = 0

    # --- prompt caches ------------------------------------------------------------------------------
    def _best_entry(self, prompt: torch.Tensor) -> tuple[int | None, int]:
        """(key of the entry sharing the longest prefix with ``prompt``, the shared length)."""
        best_key, best_length = None, 0
        for key, entry in self.entries.items():
            length = min(len(entry.token_ids), len(prompt))
            mismatches = (entry.token_ids[:length] != prompt[:length]).nonzero()
            shared = int(mismatches[0]) if len(mismatches) else length
            if shared > best_length:
                best_key, best_length = key, shared
        return best_key, best_length

    def _remember(self, prompt: torch.Tensor, cache: Any) -> None:
        self.entries[self._next_entry] = _CacheEntry(prompt, cache)
        self._next_entry += 1
        # Least recently used first; the newest entry always stays.
        while len(self.entries) > 1 and (len(self.entries) > self.max_entries
                                         or self._cached_tokens() > self.max_cached_tokens):
            self.entries.popitem(last=False)

    def _cached_tokens(self) -> int:
        return sum(len(entry.token_ids) for entry in self.entries.values())

    # --- generation -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 ignore_eos: bool = False, on_token: Callable[[int], None] | None = None,
                 cancelled: threading.Event | None = None) -> GenerationResult:
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        if not prompt_ids:
            raise ValueError("prompt must hold at least 1 token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        key, shared = self._best_entry(prompt)
        # The last prompt token is always computed: its logits give the first output token.
        reuse = min(shared, len(prompt_ids) - 1)
        cache = None
        if key is not None and reuse >= self.min_reuse_tokens:
            self.entries.move_to_end(key)
            cache = copy.deepcopy(self.entries[key].cache)  # the saved cache must not grow in place
            _crop_to(cache, reuse)
        else:
            reuse = 0

        class TokenStreamer(BaseStreamer):
            def __init__(self) -> None:
                self.saw_prompt = False

            def put(self, value: torch.Tensor) -> None:
                if not self.saw_prompt:  # generate first pushes the prompt
                    self.saw_prompt = True
                    return
                if on_token is not None:
                    for token_id in value.reshape(-1).tolist():
                        on_token(int(token_id))

            def end(self) -> None:
                pass

        class StopWhenCancelled(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                stop = cancelled is not None and cancelled.is_set()
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

        input_ids = prompt.unsqueeze(0).to(self.device)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if seed is not None:
                torch.manual_seed(seed)
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else 0,
                streamer=TokenStreamer(), stopping_criteria=StoppingCriteriaList([StopWhenCancelled()]),
                return_dict_in_generate=True, use_cache=True, pad_token_id=self.tokenizer.pad_token_id,
                **sampling,
            )
        output_ids = output.sequences[0, len(prompt_ids):].tolist()
        final_cache = output.past_key_values
        _crop_to(final_cache, len(prompt_ids))  # keep the prompt's part: that is what later prompts share
        self._remember(prompt, final_cache)
        finish_reason = "length" if len(output_ids) >= max_tokens else "stop"
        return GenerationResult(output_ids, reuse, finish_reason)


def _crop_to(cache: Any, length: int) -> None:
    """Keep the first ``length`` tokens. A negative argument means "remove this many" both in
    transformers 4 (where a positive one is the length to keep) and in 5 (which refuses positive ones)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


# --- HTTP ---------------------------------------------------------------------------------------------


class _BadRequest(ValueError):
    pass


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def build_app(runner: ReferenceRunner, model_name: str) -> FastAPI:
    # FastAPI resolves the handlers' annotations (Request) from this module's globals.
    from kvreuse.tokenizer import IncrementalDetokenizer

    app = FastAPI(title="kvreuse reference (transformers)", docs_url=None, redoc_url=None)
    lock = asyncio.Lock()  # one generation at a time, in arrival order

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "transformers"}]}

    def parse(body: dict[str, Any], chat: bool) -> tuple[list[int], int, dict[str, Any]]:
        tokenizer = runner.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a non-empty list")
            prompt_ids = tokenizer.apply_chat_template_ids(messages)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                prompt_ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = list(prompt)
            else:
                raise _BadRequest("prompt must be a non-empty string or a list of token ids")
            max_tokens = body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise _BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        options = {"temperature": float(body.get("temperature") or 0.0), "seed": body.get("seed"),
                   "ignore_eos": bool(body.get("ignore_eos", False))}
        return prompt_ids, max_tokens, options

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            prompt_ids, max_tokens, options = parse(body, chat)
        except (ValueError, json.JSONDecodeError) as error:
            return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error"}}, status_code=400)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        header = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                  "created": int(time.time()), "model": model_name}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | GenerationResult | BaseException] = asyncio.Queue()
        cancelled = threading.Event()

        def work() -> None:
            try:
                result = runner.generate(prompt_ids, max_tokens, cancelled=cancelled,
                                         on_token=lambda token: loop.call_soon_threadsafe(queue.put_nowait, token),
                                         **options)
                loop.call_soon_threadsafe(queue.put_nowait, result)
            except BaseException as error:  # handed to the event loop, raised there
                loop.call_soon_threadsafe(queue.put_nowait, error)

        async def events() -> AsyncIterator[tuple[str, GenerationResult | None]]:
            """Text deltas, then ("", result) once generation ended."""
            async with lock:
                worker = asyncio.get_running_loop().run_in_executor(None, work)
                detokenizer = IncrementalDetokenizer(runner.tokenizer, prompt_ids)
                try:
                    while True:
                        item = await queue.get()
                        if isinstance(item, BaseException):
                            raise item
                        if isinstance(item, GenerationResult):
                            yield detokenizer.finish(), item
                            return
                        yield detokenizer.add(item), None
                finally:
                    cancelled.set()
                    await worker

        def usage(result: GenerationResult) -> dict[str, Any]:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(result.output_ids),
                    "total_tokens": len(prompt_ids) + len(result.output_ids),
                    "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

        def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
            return {"index": 0, "text": text, "finish_reason": finish_reason}

        if not body.get("stream"):
            parts: list[str] = []
            final: GenerationResult | None = None
            async for text, result in events():
                parts.append(text)
                final = result or final
            assert final is not None
            text = "".join(parts)
            answer = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text})
            answer["finish_reason"] = final.finish_reason
            return JSONResponse({**header, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [answer], "usage": usage(final)})

        async def stream() -> AsyncIterator[bytes]:
            # One chunk per token, text or not (as vLLM streams), so clients can time every token;
            # a chat stream opens with the role when the first token exists.
            opened = not chat
            async for text, result in events():
                if not opened:
                    opened = True
                    yield _sse({**header, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "finish_reason": None}]})
                if result is None:
                    yield _sse({**header, "choices": [choice(text, None)]})
                    continue
                yield _sse({**header, "choices": [choice(text, result.finish_reason)]})
                if include_usage:
                    yield _sse({**header, "choices": [], "usage": usage(result)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvreuse.bench.reference_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (transformers loads it)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-cache-entries", type=int, default=32)
    parser.add_argument("--max-cached-tokens", type=int, default=65536)
    parser.add_argument("--min-reuse-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    import uvicorn

    started = time.monotonic()
    runner = ReferenceRunner(args.model, dtype=args.dtype, device=args.device, max_entries=args.max_cache_entries,
                             max_cached_tokens=args.max_cached_tokens, min_reuse_tokens=args.min_reuse_tokens)
    logger.info("transformers reference: %s loaded in %.1f s (%s on %s)", args.model, time.monotonic() - started,
                runner.dtype, runner.device)
    app = build_app(runner, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

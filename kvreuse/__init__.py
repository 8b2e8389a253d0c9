"""kvreuse: an LLM inference engine whose defining feature is reuse of the attention KV cache.

The public names are imported lazily so that ``import kvreuse.cache`` (the torch-free cache core)
stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvreuse.llm",
    "SamplingParams": "kvreuse.sampling",
    "RequestOutput": "kvreuse.outputs",
    "CompletionOutput": "kvreuse.outputs",
    "LoRARequest": "kvreuse.lora.request",
}

if TYPE_CHECKING:
    from kvreuse.llm import LLM
    from kvreuse.lora.request import LoRARequest
    from kvreuse.outputs import CompletionOutput, RequestOutput
    from kvreuse.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvreuse' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)

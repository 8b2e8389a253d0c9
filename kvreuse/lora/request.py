"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` is what clients say; ``lora_path`` is a PEFT folder or a .safetensors file.

    ``lora_int_id`` is kept for vLLM compatibility only: the cache keys an adapter by the digest of
    its weights, never by its name or id, so two ids of the same weights share KV and one name with
    new weights does not.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")

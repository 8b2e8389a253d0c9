"""LoRA adapters: loading and checking (adapter.py), names and residency (manager.py), applying several
in one batch (batch.py). An adapter's identity in the KV cache is the digest of its weights."""

from kvreuse.lora.request import LoRARequest

__all__ = ["LoRARequest"]

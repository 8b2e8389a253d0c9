"""Model code: the architectures kvreuse runs (config.SUPPORTED_ARCHITECTURES: the Llama family, Qwen3-MoE, Gemma 3,
gpt-oss), their layers and CPU kernels, their config and their loader.

Exports what the engine and CLI need: the parsed config, the model class, and the helpers that
find a model, pick a dtype and load weights.
"""

from kvreuse.models.config import SUPPORTED_ARCHITECTURES, Llama3RopeScaling, ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.models.loader import load_model, resolve_dtype, resolve_model_path

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Llama3RopeScaling",
    "LlamaFamilyForCausalLM",
    "ModelConfig",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
]

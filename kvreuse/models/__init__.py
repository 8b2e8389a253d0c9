"""The architecture graphs and their configs: the Llama family (Llama, Qwen2/3, Mistral, SmolLM), Qwen3-MoE,
Gemma 3 and gpt-oss (config.SUPPORTED_ARCHITECTURES), composed of kvreuse.layers' blocks. Loading a model
(folders, GGUF files) is kvreuse.loading's; the kernels the layers run are kvreuse.kernels'.
"""

from kvreuse.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaFamilyForCausalLM", "ModelConfig"]

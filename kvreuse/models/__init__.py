"""The architecture graphs and their configs: the Llama family (Llama, Qwen2/3, Mistral, SmolLM), Qwen3-MoE,
Gemma 3 and gpt-oss (config.SUPPORTED_ARCHITECTURES), composed of kvreuse.layers' blocks, and the hybrid LFM2
(lfm2.py: short convolutions among the family's attention layers). Loading a model (folders, GGUF files) is
kvreuse.loading's; the kernels the layers run are kvreuse.kernels'.
"""

from kvreuse.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvreuse.models.lfm2 import Lfm2ForCausalLM
from kvreuse.models.llama import LlamaFamilyForCausalLM


def model_class(config: ModelConfig) -> type[LlamaFamilyForCausalLM]:
    """The class that runs ``config``'s architecture."""
    return Lfm2ForCausalLM if config.architecture == "Lfm2ForCausalLM" else LlamaFamilyForCausalLM


__all__ = ["SUPPORTED_ARCHITECTURES", "Lfm2ForCausalLM", "LlamaFamilyForCausalLM", "ModelConfig", "model_class"]

"""The architecture graphs and their configs: the Llama family (Llama, Qwen2/3, Mistral, SmolLM), Qwen3-MoE,
Gemma 3 and gpt-oss (config.SUPPORTED_ARCHITECTURES), composed of kvreuse.layers' blocks, and the hybrids LFM2
(lfm2.py: short convolutions among the family's attention layers) and Qwen3.5, Qwen3.5-MoE and Qwen3-Next
(qwen3_5.py: Gated DeltaNet layers among gated attention layers) and Nemotron-H (nemotron_h.py: Mamba-2, attention
and MLP blocks by its pattern). Loading a model (folders, GGUF files) is
kvreuse.loading's; the kernels the layers run are kvreuse.kernels'.
"""

from kvreuse.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvreuse.models.lfm2 import Lfm2ForCausalLM
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.models.nemotron_h import NemotronHForCausalLM
from kvreuse.models.qwen3_5 import Qwen3_5ForCausalLM

_CLASSES: dict[str, type[LlamaFamilyForCausalLM]] = {
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,  # the same layers with experts for MLPs (ModelConfig.moe)
    "Qwen3NextForCausalLM": Qwen3_5ForCausalLM,  # and Qwen3-MoE's, its fused projections split at load
    "NemotronHForCausalLM": NemotronHForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaFamilyForCausalLM]:
    """The class that runs ``config``'s architecture."""
    return _CLASSES.get(config.architecture, LlamaFamilyForCausalLM)


__all__ = ["SUPPORTED_ARCHITECTURES", "Lfm2ForCausalLM", "LlamaFamilyForCausalLM", "ModelConfig", "NemotronHForCausalLM",
           "Qwen3_5ForCausalLM", "model_class"]

"""A mixture-of-experts layer's shape and switches (Qwen3-MoE's, gpt-oss's and Qwen3.5-MoE's shared expert), as the
experts layer takes them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: each token's router picks ``num_experts_per_tok`` of ``num_experts`` gated MLPs of
    ``moe_intermediate_size`` and sums their outputs weighted by the router's probabilities."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the chosen experts' probabilities to sum to 1 (Qwen3-MoE's switch)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    # gpt-oss's switches (Qwen3-MoE has none of them): the router's bias; the softmax taken over the top k
    # logits only (Qwen3-MoE: over all experts, then the top k); biases on every expert projection; and the
    # experts' clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: the MLP's own activation (hidden_act)
    swiglu_alpha: float = 1.702
    # Qwen3.5-MoE's (and Qwen3-Next's): a dense SwiGLU of this width that every token runs beside its routed
    # experts, its output scaled by sigmoid(x . shared_expert_gate) and added; 0: none.
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be 0 (none) or positive, got "
                             f"{self.shared_expert_intermediate_size}")
        if not self.swiglu_alpha > 0:
            raise ValueError(f"swiglu_alpha must be positive, got {self.swiglu_alpha}")

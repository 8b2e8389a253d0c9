"""A mixture-of-experts MLP (Qwen3-MoE's): a router picks each token's top-k experts, and each expert runs
once per step for every row routed to it.

Every expert is a ``GatedMLP`` of ``Linear`` layers, so its weights take the same paths as a dense model's:
float, or held quantized from a GGUF file (each expert's rows of the file's stacked tensor) or by
``quantization="int8"``, run by the kernel the plan book measured fastest for the expert's shape and the
row count it gets. The router stays float (it is small, and rounding it would move tokens between
experts).

Cost follows the active parameters: a decode row reads only its k experts' weights. A step's rows are
grouped by expert (one stable sort of the (row, choice) pairs), so an expert routed to by several rows of
a batched decode or a prefill reads its weights once for all of them. The experts run in ascending index
order and add into the output with ``index_add_``, the order transformers uses, so float32 outputs match
its token for token.
"""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.models.config import MoEConfig
from kvreuse.models.layers import GatedMLP, Linear


class SparseMoE(nn.Module):
    """The experts of one layer and their router (HF names: ``mlp.gate``, ``mlp.experts.{e}.*``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, activation: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(hidden_size, [moe.num_experts], False, dtype, device)
        self.gate.keep_float = True  # quantize_int8 leaves the router as it is
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.moe_intermediate_size, dtype, device, activation)
            for _ in range(moe.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]): softmax over all experts in float32, the top k,
        renormalised where the config says so (transformers' Qwen3MoeTopKRouter)."""
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on mixture-of-experts layers are not supported")
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # a single row: its k experts in ascending order, no sort
            order = torch.argsort(experts[0])
            for expert, weight in zip(experts[0, order].tolist(), weights[0, order].unbind()):
                out.add_(self.experts[expert](x) * weight)
            return out
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, choice) pairs grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        pair_weights = weights.reshape(-1).index_select(0, order)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            expert_rows = rows[start:start + count]
            y = self.experts[expert](x.index_select(0, expert_rows))
            out.index_add_(0, expert_rows, y.mul_(pair_weights[start:start + count, None]))
            start += count
        return out

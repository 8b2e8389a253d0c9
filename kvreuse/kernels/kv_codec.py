"""The quantized KV pool's write and gather as C++ on CPU (csrc/kv_quant.cpp), loaded as ``torch.ops.kvreuse_kv``.

In PyTorch ops, quantizing one token's K and V into the pool and dequantizing a context back costs about
a dozen small ops per tensor per layer: measured on a 2-core AVX-512 CPU, ~8.5 ms more per decode step
than a model-dtype pool for int8 and ~25 ms for fp8 (PyTorch's float8 casts on CPU are scalar), with 30
layers and a 576-token context. The kernels do each layer's K and V in one call each, and equal the
PyTorch reference (kvreuse/cache/kv_quant.py) value for value, which tests/test_kv_quant.py checks.
Built and cached like the row-dot GEMV (kernels/rowdot.py: ``-march=native``, named by a digest of the
source, flags, torch and CPU); where it cannot be built, the pool keeps the PyTorch path.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvreuse.kernels.build import build_name, load_extension

SOURCE = Path(__file__).with_name("csrc") / "kv_quant.cpp"
SCHEME_INDEX = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> Path | None:
    built = load_extension(SOURCE, build_name(SOURCE, "kvreuse_kv_quant"), "the quantized KV kernels",
                           "a quantized KV pool runs on PyTorch ops")
    if built is not None:
        _register_fake()
    return built


def _register_fake() -> None:
    @torch.library.register_fake("kvreuse_kv::kv_quant_write")
    def _(codes_k, codes_v, scales_k, scales_v, slots, k, v, scheme) -> None:
        return None

    @torch.library.register_fake("kvreuse_kv::kv_quant_gather")
    def _(codes_k, codes_v, scales_k, scales_v, slots, scheme, dtype):
        shape = (slots.shape[0], codes_k.shape[1], codes_k.shape[2])
        return codes_k.new_empty(shape, dtype=dtype), codes_k.new_empty(shape, dtype=dtype)


class CpuKVCodec:
    """A quantized pool layer's write and gather on the C++ kernels (CPU tensors, float32 or bfloat16 K/V), for
    the scheme named ``scheme`` (int8, fp8_e4m3, fp8_e5m2); kvreuse.cache.kv.KVCache calls it where built."""

    def handles(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPES

    def write(self, codes: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
              slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str) -> None:
        torch.ops.kvreuse_kv.kv_quant_write(codes[0], codes[1], scales[0], scales[1], slots, k, v,
                                            SCHEME_INDEX[scheme])

    def gather(self, codes: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
               slots: torch.Tensor, scheme: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.kvreuse_kv.kv_quant_gather(codes[0], codes[1], scales[0], scales[1], slots,
                                                    SCHEME_INDEX[scheme], dtype)


def cpu_kv_codec() -> CpuKVCodec | None:
    """The kernels, built or loaded for this CPU; None where they cannot be (the PyTorch path serves)."""
    return CpuKVCodec() if library() is not None else None

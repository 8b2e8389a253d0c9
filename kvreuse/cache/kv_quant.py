"""Quantized KV: K and V stored as one byte per value with a bfloat16 scale per token and KV head.

``kv_cache_dtype`` (vLLM's option and values) picks the scheme: ``auto`` stores the model's dtype and
``bfloat16`` stores bfloat16 under any model dtype (no scheme: ``kv_float_dtype``), ``int8`` rounds each token's head vector to integers in [-127, 127] times ``amax / 127``,
``fp8`` / ``fp8_e4m3`` and ``fp8_e5m2`` cast ``x / (amax / max)`` to that 8-bit float (max 448 and
57344). The scale is per (token, KV head) because K and V are written a token at a time (decode
appends one): a token's bytes never change once written, so a block can be copied, stored in a tier
and read back as bytes with its scales; a per-block scale would have to re-round a block's earlier
tokens whenever a later one raised its amax. One bfloat16 per ``head_dim`` bytes costs 2 / head_dim of
the codes (3% at 64): a token takes 0.516x of bfloat16's bytes (1.94x the tokens) and 0.258x of
float32's (3.88x). The scale is bfloat16, not float16: small heads (amax below ~0.008) would put a float16
scale among its subnormals, a few bits of precision; it is rounded up (at most 2^-8 over amax / max), so
no code is clipped. Attention dequantizes what it gathers to the compute dtype (`dequantize`).

fp8 codes are kept as uint8 bytes: PyTorch's CPU index_copy_ / index_select have no float8 kernels,
and a byte is a byte (`codes_view` reads them as the float8 type).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.config import KV_CACHE_DTYPES

SCALE_DTYPE = torch.bfloat16
_SCALE_MIN = float(torch.finfo(SCALE_DTYPE).tiny)  # a zero vector gets this; its codes are 0
_ROUND_UP = 1.0 + 2.0 ** -8  # bfloat16 rounds to nearest within 2^-9: scaled first, it never lands below


@dataclass(frozen=True)
class KVQuantScheme:
    name: str  # "int8", "fp8_e4m3", "fp8_e5m2"
    storage_dtype: torch.dtype  # what the pool's tensor holds: int8, or uint8 (fp8 bytes)
    code_dtype: torch.dtype  # what the bytes mean: int8, float8_e4m3fn, float8_e5m2
    max_code: float  # the largest magnitude a code holds

    @property
    def bytes_per_value(self) -> int:
        return 1

    def describe(self) -> str:
        return f"{self.name} (one byte per value, a bfloat16 scale per token and KV head)"


UNQUANTIZED = ("auto", "bfloat16")
_SCHEMES = {
    "int8": KVQuantScheme("int8", torch.int8, torch.int8, 127.0),
    "fp8_e4m3": KVQuantScheme("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
    "fp8_e5m2": KVQuantScheme("fp8_e5m2", torch.uint8, torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max)),
}


def resolve_kv_cache_dtype(name: str) -> KVQuantScheme | None:
    """The scheme of a ``kv_cache_dtype`` value (None for ``auto`` and ``bfloat16``, which store floats);
    an unknown value raises ValueError."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    if name in UNQUANTIZED:
        return None
    return _SCHEMES["fp8_e4m3" if name == "fp8" else name]


def kv_float_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The float dtype an unquantized pool stores under a ``dtype`` model: ``dtype`` for ``auto``, bfloat16 for
    ``bfloat16`` (half a float32 pool's bytes, what llama.cpp's default f16 cache reads; attention widens each
    value as it reads it). Quantized values: ``dtype`` (their codes' dtype is the scheme's)."""
    return torch.bfloat16 if name == "bfloat16" else dtype


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       scheme: KVQuantScheme | None) -> int:
    """Bytes one token's K and V take in the pool (and in a tier record) across ``num_layers``."""
    if scheme is None:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    scale_bytes = torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * num_layers * num_kv_heads * (head_dim * scheme.bytes_per_value + scale_bytes)


def quantize(x: torch.Tensor, scheme: KVQuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] -> (codes [..., head_dim] in the scheme's storage dtype, scales [...] bfloat16)."""
    values = x.float()
    scales = (values.abs().amax(dim=-1) * (_ROUND_UP / scheme.max_code)).clamp_min(_SCALE_MIN).to(SCALE_DTYPE)
    scaled = values / scales.float().unsqueeze(-1)  # rounded with the scale that is stored
    if scheme.code_dtype == torch.int8:
        codes = scaled.round_().clamp_(-scheme.max_code, scheme.max_code).to(torch.int8)
    else:
        codes = scaled.clamp_(-scheme.max_code, scheme.max_code).to(scheme.code_dtype).view(torch.uint8)
    return codes, scales


def codes_view(codes: torch.Tensor, scheme: KVQuantScheme) -> torch.Tensor:
    return codes if scheme.code_dtype == torch.int8 else codes.view(scheme.code_dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, scheme: KVQuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., head_dim] and their scales [...] back to ``dtype``."""
    return codes_view(codes, scheme).to(dtype) * scales.to(dtype).unsqueeze(-1)

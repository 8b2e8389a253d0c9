"""Quantized weights in memory: the internal layouts, lossless repacking from GGUF blocks, int8 quantization.

A quantized weight stays quantized in memory, and the linear layers read it directly (layers/quantized_linear.py,
kernels/csrc/quant.cpp), so a model takes about its file's bytes, not 4-8x them as dequantized floats. A
weight is one uint8 tensor [out, row_bytes]. Each output row is self-contained (the kernels split output
rows between threads) and is a sequence of records, "spans", of 256 values (the last one shorter where
``in`` is not a multiple of 256), each holding its fp16 scales, 8-bit codes, high-bit planes and values,
in that order, so a row streams from memory as one sequential run:

=======  ======================================  ==================================================
layout   per span of up to 256 values             value of element i of group g (super-block s)
=======  ======================================  ==================================================
q8_0     fp16 scale / 32, int8 values             scale[g] * q
q4_0     fp16 scale / 32, 4-bit values            scale[g] * (q - 8)
q4_1     fp16 scale and offset / 32, 4-bit        scale[g] * q + offset[g]
q5_0     as q4_0, plus one high-bit plane         scale[g] * (q - 16), q of 5 bits
q5_1     as q4_1, plus one high-bit plane         scale[g] * q + offset[g], q of 5 bits
q4_k     fp16 d, dmin; u8 code and min / 32;      (d[s] * code[g]) * q - dmin[s] * min[g]
         4-bit values
q5_k     as q4_k, plus one high-bit plane         as q4_k, q of 5 bits
q6_k     fp16 d; i8 code / 16; 4-bit values,      (d[s] * code[g]) * (q - 32)
         two high-bit planes
mxfp4    E8M0 byte e / 32, 4-bit codes            2^(e - 128) * (level[q] - 12)
=======  ======================================  ==================================================

MXFP4 (gpt-oss's experts) stores E2M1 floats: doubled, its 16 codes are the integers 0, 1, 2, 3, 4, 6, 8,
12 and their negatives, held here as ``MXFP4_LEVELS`` (that value plus 12, 0..24) so the kernels run them
as q4_0-like unsigned codes with zero 12 through one 16-entry table; its scale is a power of two, so the
products are exact as for the other formats.

Every layout has one nibble order (in each group of 32 values, byte i holds value i in its low half and
value i + 16 in its high half) and one plane order (a 32-bit word per 32 values and plane, bit i for
value i), so the kernels have one decoder of 4-bit values for six formats, plus the high bits. The
K-quants' 6-bit packed scales are unpacked to one byte each, and their values' interleaving is undone;
nothing is rounded, so the layouts hold exactly GGUF's values: in every format ``a * q`` is exact in
float32 (an fp16 times an integer of at most 14 bits) and ``b`` is exact too, so the kernels' ``fma(q,
a, b)`` and this module's ``dequantize`` equal gguf's own ``a * q + b`` bit for bit
(tests/test_quant_kernels.py).

Why the K-quants keep their two-level scales rather than one float32 scale and offset per 32 values
(which would make one layout of all 4-bit formats): those two floats cost 2 bits per value, a Q4_K weight
would take 6 bits per value against the file's 4.5 (1.33x), and the issue asks for resident weights
about the file's size. Unpacked, the K scales cost 4.63 bits per value for Q4_K (1.03x its 4.5), 5.63 for
Q5_K (1.02x), 6.56 for Q6_K (1.0x); the other formats keep their size (q8_0 8.5 bits, q4_0 4.5, q4_1 5,
q5_0 5.5, q5_1 6). Q5_0 and Q5_1 are llama.cpp's fallbacks for Q4_K and Q5_K in rows that are not a
multiple of 256 values (most tensors of a Q4_K_M / Q5_K_M qwen2.5-0.5b, whose width is 896).

Why spans rather than one run of each array per row (all scales, then all values): a row then streams as
two to six interleaved runs, which the CPU's prefetchers follow badly (Q5_K, six runs: 16.5 G values/s
on the AVX-512 EPYC; docs/benchmarks.md has the span figures).

``quantize_int8`` makes the q8_0 layout from float weights (per group of 32 values, the scale the
group's largest magnitude over 127, rounded to fp16): ``quantization="int8"`` runs on the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # values per nibble group and per plane word, in every layout
SUPER = 256  # values per span, and per K-quant super-block
SPAN_GROUPS = SUPER // GROUP


@dataclass(frozen=True)
class QuantFormat:
    """One internal layout; ``code`` is its number in csrc/quant.cpp (keep the two in step)."""

    name: str
    code: int
    bits: int  # value bits: 8 (int8 values), else 4 low bits plus bits - 4 high-bit planes
    group: int  # values per scale
    k_quant: bool  # scales are 8-bit codes times an fp16 per super-block of 256 (else fp16 per group)
    has_min: bool  # an offset per group (else the constant ``-zero * scale``)
    zero: int  # subtracted from q where there is no offset
    block: int  # values per GGUF block: in_features must be a multiple of it
    gguf_block_bytes: int  # bytes per GGUF block
    mx: bool = False  # an E8M0 byte per group for scale, the 4-bit codes read through MXFP4_LEVELS

    def sections(self, groups: int = SPAN_GROUPS) -> list[tuple[str, int]]:
        """(array, bytes) of a span of ``groups`` groups of 32 values (8, but fewer in a short last
        span), in storage order."""
        codes = groups * GROUP // self.group
        parts: list[tuple[str, int]] = []
        if self.k_quant:
            parts.append(("d", 2))
            if self.has_min:
                parts.append(("dmin", 2))
            parts.append(("scales", codes))
            if self.has_min:
                parts.append(("mins", codes))
        else:
            parts.append(("scales", (1 if self.mx else 2) * codes))
            if self.has_min:
                parts.append(("mins", 2 * codes))
        if 4 < self.bits < 8:
            parts.append(("planes", 4 * (self.bits - 4) * groups))
        parts.append(("values", groups * (GROUP if self.bits == 8 else GROUP // 2)))
        return parts

    def span_bytes(self, groups: int = SPAN_GROUPS) -> int:
        return sum(size for _, size in self.sections(groups))

    def spans(self, in_features: int) -> tuple[int, int]:
        """(full spans of 256 values, groups of 32 in the short last span) of a row."""
        return in_features // SUPER, in_features % SUPER // GROUP

    def row_bytes(self, in_features: int) -> int:
        full, tail = self.spans(in_features)
        return full * self.span_bytes() + (self.span_bytes(tail) if tail else 0)

    def bits_per_value(self) -> float:
        return 8 * self.span_bytes() / SUPER

    def check_in_features(self, in_features: int) -> None:
        if in_features <= 0 or in_features % self.block:
            raise ValueError(f"{self.name} needs in_features a positive multiple of {self.block}, got {in_features}")


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("q8_0", 0, 8, 32, False, False, 0, 32, 34),
        QuantFormat("q4_0", 1, 4, 32, False, False, 8, 32, 18),
        QuantFormat("q4_1", 2, 4, 32, False, True, 0, 32, 20),
        QuantFormat("q5_0", 3, 5, 32, False, False, 16, 32, 22),
        QuantFormat("q5_1", 4, 5, 32, False, True, 0, 32, 24),
        QuantFormat("q4_k", 5, 4, 32, True, True, 0, 256, 144),
        QuantFormat("q5_k", 6, 5, 32, True, True, 0, 256, 176),
        QuantFormat("q6_k", 7, 6, 16, True, False, 32, 256, 210),
        QuantFormat("mxfp4", 8, 4, 32, False, False, 12, 32, 17, mx=True),
    )
}
# MXFP4's codes as integer levels: 12 + twice the E2M1 value (ggml's kvalues_mxfp4 plus 12).
MXFP4_LEVELS = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
# GGML type names (gguf.GGMLQuantizationType) of the tensor types held quantized.
GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k",
              "Q5_K": "q5_k", "Q6_K": "q6_k", "MXFP4": "mxfp4"}


class QuantizedTensor:
    """A quantized [out, in] weight in one of FORMATS: ``data`` uint8 [out, row_bytes]."""

    def __init__(self, fmt: QuantFormat | str, data: torch.Tensor, in_features: int) -> None:
        fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
        fmt.check_in_features(in_features)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != fmt.row_bytes(in_features):
            raise ValueError(f"{fmt.name} data for {in_features} features must be uint8 [out, "
                             f"{fmt.row_bytes(in_features)}], got {data.dtype} {tuple(data.shape)}")
        self.format = fmt
        self.data = data.contiguous()
        self.in_features = in_features

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.format.name}, {self.shape[0]}x{self.shape[1]})"

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Output rows [start, stop) (a view)."""
        return QuantizedTensor(self.format, self.data[start:stop], self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], GGUF's values exactly (plain torch; the kernels have a faster one)."""
        return dequantize(self)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Weights of one format and width stacked by output rows (q, k, v into one fused projection)."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one format and width stack into one")
    return QuantizedTensor(first.format, torch.cat([p.data for p in parts]), first.in_features)


# ---- the arrays of a row ---------------------------------------------------------------------------


def _split(fmt: QuantFormat, data: torch.Tensor, in_features: int) -> dict[str, torch.Tensor]:
    """The named arrays of every row, [out, bytes] each: the spans' pieces of each array, in order."""
    out_features = data.shape[0]
    full, tail = fmt.spans(in_features)
    pieces: dict[str, list[torch.Tensor]] = {}
    if full:
        spans = data[:, :full * fmt.span_bytes()].reshape(out_features, full, -1)
        offset = 0
        for name, size in fmt.sections():
            pieces.setdefault(name, []).append(spans[:, :, offset:offset + size].reshape(out_features, -1))
            offset += size
    if tail:
        offset = full * fmt.span_bytes()
        for name, size in fmt.sections(tail):
            pieces.setdefault(name, []).append(data[:, offset:offset + size])
            offset += size
    return {name: torch.cat(parts, dim=1) for name, parts in pieces.items()}


def _join(fmt: QuantFormat, arrays: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """Rows of spans from the named arrays ([out, ...] each, of any dtype: their bytes count)."""
    as_bytes = {}
    for name, array in arrays.items():
        array = array.contiguous()
        as_bytes[name] = array.view(torch.uint8).reshape(array.shape[0], -1)
    out_features = next(iter(as_bytes.values())).shape[0]
    full, tail = fmt.spans(in_features)
    columns = []
    if full:
        columns.append(torch.cat([as_bytes[name][:, :full * size].reshape(out_features, full, size)
                                  for name, size in fmt.sections()], dim=2).reshape(out_features, -1))
    if tail:
        full_sizes = dict(fmt.sections())
        columns.extend(as_bytes[name][:, full * full_sizes[name]:] for name, _ in fmt.sections(tail))
    data = torch.cat(columns, dim=1)
    if data.shape[1] != fmt.row_bytes(in_features):
        raise AssertionError(f"{fmt.name}: {data.shape[1]} bytes per row, the layout has {fmt.row_bytes(in_features)}")
    return data


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (uint8, < 16) -> [out, in/2]: in each group of 32, byte i = q[i] | q[i+16] << 4."""
    grouped = q.reshape(q.shape[0], -1, 2, GROUP // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    grouped = packed.reshape(packed.shape[0], -1, 1, GROUP // 2)
    return torch.cat((grouped & 15, grouped >> 4), dim=2).reshape(packed.shape[0], -1)


def pack_planes(high: torch.Tensor, planes: int) -> torch.Tensor:
    """High bits [out, in] (q >> 4) -> [out, in/32 * planes] int32 words: word (group, p) has bit i set
    to bit p of the group's value i."""
    out_features = high.shape[0]
    groups = high.reshape(out_features, -1, 1, GROUP).to(torch.int64)
    bits = (groups >> torch.arange(planes).view(1, 1, planes, 1)) & 1  # [out, groups, planes, 32]
    words = (bits << torch.arange(GROUP)).sum(-1)  # < 2**32
    return words.reshape(out_features, -1).to(torch.uint32).view(torch.int32)


def unpack_planes(words: torch.Tensor, planes: int) -> torch.Tensor:
    out_features = words.shape[0]
    w = words.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (w.reshape(out_features, -1, planes, 1) >> torch.arange(GROUP)) & 1  # [out, groups, planes, 32]
    high = (bits << torch.arange(planes).view(1, 1, planes, 1)).sum(2)  # [out, groups, 32]
    return high.reshape(out_features, -1).to(torch.uint8)


def _half(array: torch.Tensor) -> torch.Tensor:
    return array.contiguous().view(torch.float16).float()


def values_of(qt: QuantizedTensor) -> torch.Tensor:
    """The quantized values q [out, in] (uint8; int8 for q8_0; MXFP4's levels, not its codes)."""
    return _values(qt.format, _split(qt.format, qt.data, qt.in_features))


def _values(fmt: QuantFormat, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt.bits == 8:
        return arrays["values"].view(torch.int8)
    q = unpack_nibbles(arrays["values"])
    if fmt.mx:
        return torch.tensor(MXFP4_LEVELS, dtype=torch.uint8)[q.long()]
    if fmt.bits > 4:
        q |= unpack_planes(arrays["planes"], fmt.bits - 4) << 4
    return q


def scales_of(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) float32 [out, in/group]: value = a * q + b. Both exact: an fp16 times an integer code."""
    return _scales(qt.format, _split(qt.format, qt.data, qt.in_features))


def _scales(fmt: QuantFormat, arrays: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    per_super = SUPER // fmt.group
    if fmt.k_quant:
        code = arrays["scales"].view(torch.uint8 if fmt.has_min else torch.int8).float()
        a = _half(arrays["d"]).repeat_interleave(per_super, dim=1) * code
    elif fmt.mx:
        a = e8m0_half(arrays["scales"])
    else:
        a = _half(arrays["scales"])
    if not fmt.has_min:
        b = -float(fmt.zero) * a
    elif fmt.k_quant:
        b = -(_half(arrays["dmin"]).repeat_interleave(per_super, dim=1) * arrays["mins"].float())
    else:
        b = _half(arrays["mins"])
    return a, b


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as MXFP4 scales its doubled levels: float32 2^(e - 128), exact (ggml's
    GGML_E8M0_TO_FP32_HALF: e < 2 gives the subnormals 2^-128 and 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """float32 [out, in]: a * q + b per group, or a * (q - zero) without an offset, which is gguf's
    dequantization bit for bit, signed zeros included (a * q is exact)."""
    fmt = qt.format
    arrays = _split(fmt, qt.data, qt.in_features)
    a, b = _scales(fmt, arrays)
    q = _values(fmt, arrays).float().reshape(qt.shape[0], -1, fmt.group)
    if fmt.has_min:
        return (q * a.unsqueeze(-1) + b.unsqueeze(-1)).reshape(qt.shape)
    return ((q - fmt.zero) * a.unsqueeze(-1)).reshape(qt.shape)


# ---- from GGUF blocks ------------------------------------------------------------------------------


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of Q4_K / Q5_K super-blocks: [..., 12] bytes -> two [..., 8] uint8.
    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take their low
    4 bits from bytes 8-11 (low / high half) and their top 2 bits from the top of bytes 0-3 / 4-7."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((low & 63, (rest & 15) | ((low >> 6) << 4)), dim=-1)
    mins = torch.cat((high & 63, (rest >> 4) | ((high >> 6) << 4)), dim=-1)
    return scales, mins


# Rows repacked at a time: about this many values (the plane packing's int64 intermediates are 8 bytes each).
REPACK_VALUES = 2**22


def repack_gguf(raw: np.ndarray | torch.Tensor, ggml_type: str, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF tensor's blocks (uint8, [out, in / block * block bytes] or flat) as a QuantizedTensor.

    ``ggml_type`` is the GGML type's name (``gguf.GGMLQuantizationType.Q4_K.name``); ``shape`` is [out, in]
    (GGUF lists it the other way round). Lossless: the values dequantize to gguf's bit for bit.
    """
    if ggml_type not in GGUF_TYPES:
        raise ValueError(f"GGML type {ggml_type} is not held quantized; supported: {', '.join(GGUF_TYPES)}")
    fmt = FORMATS[GGUF_TYPES[ggml_type]]
    out_features, in_features = shape
    if in_features % fmt.block:
        raise ValueError(f"a {ggml_type} tensor's rows must be a multiple of {fmt.block} values, got {in_features}")
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw.contiguous()
    blocks_per_row = in_features // fmt.block
    expected = out_features * blocks_per_row * fmt.gguf_block_bytes
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"a {ggml_type} tensor of shape {out_features}x{in_features} has {expected} bytes, "
                         f"got {data.numel()} ({data.dtype})")
    data = data.reshape(out_features, -1)
    step = max(1, REPACK_VALUES // in_features)
    rows = [_repack_rows(fmt, data[start:start + step], in_features) for start in range(0, out_features, step)]
    return QuantizedTensor(fmt, rows[0] if len(rows) == 1 else torch.cat(rows), in_features)


def _repack_rows(fmt: QuantFormat, data: torch.Tensor, in_features: int) -> torch.Tensor:
    out_features = data.shape[0]
    blocks_per_row = in_features // fmt.block
    blocks = data.reshape(out_features, blocks_per_row, fmt.gguf_block_bytes)
    arrays: dict[str, torch.Tensor] = {}
    if fmt.name == "q8_0":
        arrays["scales"], arrays["values"] = blocks[..., :2], blocks[..., 2:]
    elif fmt.name == "q4_0":
        arrays["scales"], arrays["values"] = blocks[..., :2], blocks[..., 2:]  # GGUF's nibble order is ours
    elif fmt.name == "mxfp4":
        arrays["scales"], arrays["values"] = blocks[..., :1], blocks[..., 1:]  # e, then q4_0's nibble order
    elif fmt.name == "q4_1":
        arrays["scales"], arrays["mins"], arrays["values"] = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:]
    elif fmt.name in ("q5_0", "q5_1"):
        # d (and m), then a 32-bit word whose bit i is value i's fifth bit (our plane word), then 16 bytes.
        words = 2 if fmt.name == "q5_0" else 4
        arrays["scales"], arrays["planes"], arrays["values"] = (blocks[..., :2], blocks[..., words:words + 4],
                                                                blocks[..., words + 4:])
        if fmt.name == "q5_1":
            arrays["mins"] = blocks[..., 2:4]
    elif fmt.name in ("q4_k", "q5_k"):
        arrays["d"], arrays["dmin"] = blocks[..., 0:2], blocks[..., 2:4]
        arrays["scales"], arrays["mins"] = _k_scales(blocks[..., 4:16])
        if fmt.name == "q4_k":
            qh, qs = None, blocks[..., 16:144]
        else:
            qh, qs = blocks[..., 16:48], blocks[..., 48:176]
        # Each 32 bytes of qs hold two groups of 32: the first in the low halves, the next in the high halves.
        pairs = qs.reshape(out_features, blocks_per_row, 4, 1, 32)
        q = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(out_features, in_features)
        if qh is not None:
            # Q5_K: bit g of qh[i] is the fifth bit of value i of the super-block's group g.
            bits = (qh.reshape(out_features, blocks_per_row, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1
            q = q | (bits.reshape(out_features, in_features) << 4)
        arrays.update(_values_and_planes(fmt, q))
    else:  # q6_k: ql[128], qh[64], scales[16] int8, d fp16
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        arrays["scales"], arrays["d"] = blocks[..., 192:208], blocks[..., 208:210]
        # Per half of 128 values: 64 bytes of ql give values 0-63 (low halves) and 64-127 (high halves);
        # 32 bytes of qh give two high bits of values 32k + i at bits 2k, 2k + 1 of byte i.
        low = ql.reshape(out_features, blocks_per_row, 2, 1, 64)
        low = torch.cat((low & 15, low >> 4), dim=3).reshape(out_features, blocks_per_row, 2, 128)
        high = qh.reshape(out_features, blocks_per_row, 2, 1, 32) >> (
            2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
        high = (high & 3).reshape(out_features, blocks_per_row, 2, 128)
        q = (low | (high << 4)).reshape(out_features, in_features)
        arrays.update(_values_and_planes(fmt, q))
    flat = {name: array.reshape(out_features, -1) for name, array in arrays.items()}
    return _join(fmt, flat, in_features)


def _values_and_planes(fmt: QuantFormat, q: torch.Tensor) -> dict[str, torch.Tensor]:
    arrays = {"values": pack_nibbles(q & 15)}
    if fmt.bits > 4:
        arrays["planes"] = pack_planes(q >> 4, fmt.bits - 4)
    return arrays


# ---- int8 weight-only quantization -----------------------------------------------------------------
# ---- int8 weight-only quantization -----------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """A float [out, in] weight as q8_0: per group of 32 values the scale is the largest magnitude / 127,
    rounded to fp16, and q = round(w / scale) (in float32). in_features must be a multiple of 32."""
    out_features, in_features = weight.shape
    fmt = FORMATS["q8_0"]
    fmt.check_in_features(in_features)
    groups = weight.detach().float().reshape(out_features, -1, GROUP)
    scale = (groups.abs().amax(-1) / 127).clamp(max=65504.0).to(torch.float16)
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale.float())
    q = torch.round(groups * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    arrays = {"scales": scale, "values": q.reshape(out_features, in_features)}
    return QuantizedTensor(fmt, _join(fmt, arrays, in_features), in_features)


def random_quantized(fmt: QuantFormat | str, out_features: int, in_features: int,
                     generator: torch.Generator | None = None, scale: float = 0.02) -> QuantizedTensor:
    """Random codes and values in layout ``fmt``, with fp16 scales that keep values near ``scale``: for
    measuring kernels and for tests (every byte pattern of the codes and values is a valid weight)."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    fmt.check_in_features(in_features)
    largest = 127 if fmt.bits == 8 else (1 << fmt.bits) - 1

    def uniform(count: int, step: float) -> torch.Tensor:
        return ((torch.rand(out_features, count, generator=generator) + 0.5) * step).to(torch.float16)

    def random_bytes(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (out_features, count), dtype=torch.uint8, generator=generator)

    supers, groups, chunks = in_features // SUPER, in_features // fmt.group, in_features // GROUP
    arrays: dict[str, torch.Tensor] = {}
    if fmt.k_quant:
        arrays["d"] = uniform(supers, scale / largest / 63)
        arrays["scales"] = random_bytes(groups)
        if fmt.has_min:
            arrays["dmin"], arrays["mins"] = uniform(supers, scale / 63), random_bytes(groups)
    elif fmt.mx:  # exponents about scale / 12 (the largest level magnitude), give or take a factor of 4
        centre = 128 + int(np.floor(np.log2(scale / 12)))
        arrays["scales"] = torch.randint(centre - 2, centre + 3, (out_features, groups), dtype=torch.uint8,
                                         generator=generator)
    else:
        arrays["scales"] = uniform(groups, scale / largest)
        if fmt.has_min:
            arrays["mins"] = -uniform(groups, scale)
    if 4 < fmt.bits < 8:
        arrays["planes"] = random_bytes(4 * (fmt.bits - 4) * chunks)
    arrays["values"] = random_bytes(in_features if fmt.bits == 8 else in_features // 2)
    return QuantizedTensor(fmt, _join(fmt, arrays, in_features), in_features)

"""Batch-invariant products of quantized weights on AMX's int8 tiles (csrc/amx_int8.cpp), as ``torch.ops.kvreuse_amx``.

Batch-invariant mode (``--batch-invariant``) runs every product of a row count on one arithmetic. On CPUs
without AMX that is the int8 GEMV (``qdot8``) at every row count, which re-decodes the weight for every 8
input rows and makes a fresh prompt's prefill 1.5-2.7x slower than the default's library GEMM. Where the
CPU has AMX-INT8 and Linux grants its tiles, q8_0, q4_0 and q4_1 weights run here instead: the inputs
rounded to int8 per 32 values, one tile instruction per chunk of 32 for 16 rows x 16 outputs, exact int32
sums whatever the tiling, then the same float instructions per row whatever the row count (the source's
header says which). A decode row and a prefill chunk run the same kernel, so their bits agree by
construction, and the tests hold them to it.

The weights are repacked once (``pack``) into the tiles' layout, per 16 output rows and chunk of 32 inputs:
the same bytes per value as the file. The arithmetic is not qdot8's (its float sums run per lane of the
VNNI instruction), so K/V computed here are another engine's to one on qdot8: ``ARITHMETIC`` names it in
the KV fingerprint.

Built like the other kernels (models/rowdot.py's ``load_extension``: ``-march=native``, cached by a digest
of source, flags, torch and CPU flags). ``available()`` is True only where the build has AMX-INT8 and the
probe (``kvreuse_amx::amx_probe``: ask Linux for the tile state, run one tile product, compare it with a
scalar sum) passes: a CPU may advertise AMX and not grant it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.models import rowdot
from kvreuse.models.quant import QuantizedTensor, scales_of, values_of

SOURCE = Path(__file__).with_name("csrc") / "amx_int8.cpp"
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # csrc/amx_int8.cpp's kQ8_0, kQ4_0, kQ4_1
TILE = 16  # output rows per packed block
CHUNK = 32  # input values per scale and per tile product
# The arithmetic's name in the KV fingerprint (raise the number if its float part ever changes).
ARITHMETIC = "amx-int8-1"


def build_name() -> str:
    return rowdot.build_name(SOURCE, "kvreuse_amx")


@functools.cache
def library() -> Path | None:
    built = rowdot.load_extension(SOURCE, build_name(), "the AMX int8 kernel",
                                  "batch-invariant mode keeps its quantized products on qdot8")
    if built is not None:
        @torch.library.register_fake("kvreuse_amx::qlinear_amx")
        def _(x: torch.Tensor, packed: torch.Tensor, format: int, out_features: int) -> torch.Tensor:
            return x.new_empty((x.shape[0], out_features))
    return built


@functools.cache
def available() -> bool:
    """Whether the AMX kernel runs here: built with AMX-INT8 and its probe passed (once per process)."""
    return library() is not None and bool(torch.ops.kvreuse_amx.amx_probe())


def runs(weight: QuantizedTensor | torch.Tensor) -> bool:
    """Whether ``weight`` can run here: a quantized format the kernel knows, whole chunks, AMX available."""
    return (isinstance(weight, QuantizedTensor) and weight.format.name in FORMAT_CODES
            and weight.in_features % CHUNK == 0 and available())


@dataclass(frozen=True)
class AmxWeight:
    """A quantized weight repacked for the tiles: ``data`` uint8 [ceil(out / 16), in / 32, block bytes]."""

    format: str
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight's values (a * q + b, a * (q - 8) for q4_0), the file's exactly."""
        blocks, chunks, _ = self.data.shape
        codes_bytes = 512 if self.format == "q8_0" else 256
        codes = self.data[..., :codes_bytes]
        if self.format != "q8_0":
            codes = torch.cat((codes & 15, codes >> 4), dim=-1)
        q = codes.view(torch.int8) if self.format == "q8_0" else codes
        # [block, chunk, k4, n, byte] -> [block, n, chunk, k4, byte]
        q = q.reshape(blocks, chunks, CHUNK // 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(blocks * TILE, chunks, CHUNK)

        def scales(at: int) -> torch.Tensor:  # fp16 bytes [block, chunk, 32] -> float32 [out, chunk, 1]
            half = self.data[..., at:at + 32].contiguous().view(torch.float16).float()
            return half.transpose(1, 2).reshape(blocks * TILE, chunks, 1)

        a = scales(codes_bytes)
        values = q.float() * a if self.format != "q4_0" else (q.float() - 8) * a
        if self.format == "q4_1":
            values = values + scales(codes_bytes + 32)
        return values.reshape(blocks * TILE, self.in_features)[:self.out_features]


def pack(weight: QuantizedTensor) -> AmxWeight:
    """``weight`` in the tiles' layout (csrc/amx_int8.cpp's header): per block of 16 outputs and chunk of 32
    inputs, the codes as TDPBSSD reads them (4-bit codes two to a byte), the fp16 scales, q4_1's fp16 offsets."""
    name = weight.format.name
    if name not in FORMAT_CODES or weight.in_features % CHUNK:
        raise ValueError(f"the AMX kernel runs {', '.join(FORMAT_CODES)} weights of whole {CHUNK}-value chunks, "
                         f"not {name} with {weight.in_features} inputs")
    if not available():
        raise RuntimeError("the AMX kernel does not run here (no AMX-INT8, tiles not granted, or the build failed: "
                           "see the log)")
    out_features, in_features = weight.shape
    blocks, chunks = math.ceil(out_features / TILE), in_features // CHUNK
    pad = blocks * TILE - out_features
    q = values_of(weight).view(torch.uint8)
    a, b = scales_of(weight)  # fp16 values as float32 (exact), per output row and chunk
    if pad:  # zero codes and scales: the padded outputs add nothing and are never written
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        a, b = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (a, b))
    # [block, n, chunk, k4, byte] -> [block, chunk, k4, n, byte]: row k4 of a tile holds each output's 4 codes.
    codes = q.reshape(blocks, TILE, chunks, CHUNK // 4, 4).permute(0, 2, 3, 1, 4).reshape(blocks, chunks, 512)
    if name != "q8_0":  # code i in the low nibble of byte i, code 256 + i in its high nibble
        codes = codes[..., :256] | (codes[..., 256:] << 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, chunks] -> fp16 bytes [block, chunk, 32]
        return t.half().reshape(blocks, TILE, chunks).transpose(1, 2).contiguous().view(torch.uint8)

    arrays = [codes, per_block(a)] + ([per_block(b)] if name == "q4_1" else [])
    return AmxWeight(name, torch.cat(arrays, dim=-1).contiguous(), out_features, in_features)


def qlinear_amx(x: torch.Tensor, weight: AmxWeight) -> torch.Tensor:
    """x [rows, in] (float32 or bfloat16) @ weight^T, in x's dtype."""
    return torch.ops.kvreuse_amx.qlinear_amx(x, weight.data, FORMAT_CODES[weight.format], weight.out_features)

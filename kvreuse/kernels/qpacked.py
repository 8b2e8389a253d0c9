"""Quantized products over weights packed in blocks of 16 outputs (csrc/qpacked.cpp), as ``torch.ops.kvreuse_qpacked``.

Batch-invariant mode (``--batch-invariant``) runs a row through one arithmetic whatever the number of rows in its
step. For q8_0, q4_0 and q4_1 weights it runs this kernel (plan name ``qpacked8``): the inputs rounded to int8
per 32 values (as llama.cpp rounds its activations), each chunk's integer sum exact, then one float part per row
and chunk, in chunk order (the source's header says which instructions). The integer sums come from
AVX512-VNNI for up to 4 rows (decode) and from AMX's tiles above that where the CPU grants them: two
instruction sets, the same exact sums, the same float part, so the same bits, and the tests hold them to it.
On the 2-core Xeon of docs/benchmarks.md this is faster than qdot8 at every row count (a decode row streams at
the memory's speed; a 600-row prefill 4x faster) and within 25% of the library's bf16 GEMM on dequantized tiles.

The weights are packed once (``pack``): per block of 16 outputs and chunk of 32 inputs, the codes in the rows
that TDPBSSD and vpdpbusd read (4-bit codes two to a byte), then the block's fp16 scales (and q4_1's offsets):
the same bytes per value as the file. The arithmetic is not qdot8's, so K/V computed here are another engine's
to one on qdot8: ``ARITHMETIC`` names it in the KV fingerprint. It is the same on any CPU that runs it, AMX or
not (integer sums are exact, the float part is the same IEEE operations).

Built like the other kernels (kernels/rowdot.py's ``load_extension``: ``-march=native``, cached by a digest of
source, flags, torch and CPU flags). ``available()``: the build has AVX512-VNNI (and F16C, AVX512-BF16).
``tiles()``: AMX-INT8 built and its probe passed (``kvreuse_qpacked::amx_probe``: ask Linux for the tile
state, run one tile product, compare it with a scalar sum): a CPU may advertise AMX and not grant it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.kernels import build
from kvreuse.kernels.quant import QuantizedTensor, scales_of, values_of

SOURCE = Path(__file__).with_name("csrc") / "qpacked.cpp"
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # csrc/qpacked.cpp's kQ8_0, kQ4_0, kQ4_1
TILE = 16  # outputs per packed block
CHUNK = 32  # input values per scale and per integer sum
CODES_BYTES = {"q8_0": 512, "q4_0": 256, "q4_1": 256}  # a block's codes per chunk
# The arithmetic's name in the KV fingerprint (raise the number if its float part ever changes).
ARITHMETIC = "int8 packed (qpacked8) 1"


def build_name() -> str:
    return build.build_name(SOURCE, "kvreuse_qpacked")


@functools.cache
def library() -> Path | None:
    built = build.load_extension(SOURCE, build_name(), "the packed int8 kernel",
                                  "batch-invariant mode keeps its quantized products on qdot8")
    if built is not None:
        @torch.library.register_fake("kvreuse_qpacked::qlinear_packed")
        def _(x: torch.Tensor, packed: torch.Tensor, format: int, out_features: int, tiles: bool = True) -> torch.Tensor:
            return x.new_empty((x.shape[0], out_features))
    return built


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: built, with AVX512-VNNI (once per process)."""
    return library() is not None and bool(torch.ops.kvreuse_qpacked.packed_built())


@functools.cache
def tiles() -> bool:
    """Whether its many-row products run on AMX's tiles here (built with AMX-INT8, and the probe passed)."""
    return available() and bool(torch.ops.kvreuse_qpacked.amx_probe())


def runs(weight: QuantizedTensor | torch.Tensor) -> bool:
    """Whether ``weight`` can run here: a format the kernel knows, whole chunks, the kernel available."""
    return (isinstance(weight, QuantizedTensor) and weight.format.name in FORMAT_CODES
            and weight.in_features % CHUNK == 0 and available())


@dataclass(frozen=True)
class PackedWeight:
    """A quantized weight packed for the kernel: ``data`` uint8 [ceil(out / 16), in / 32, block bytes]."""

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
        """float32 [out, in]: the weight's values (a * q + b; a * (q - 8) for q4_0), the file's exactly."""
        blocks, chunks, _ = self.data.shape
        size = CODES_BYTES[self.format]
        codes = self.data[..., :size]
        if self.format != "q8_0":
            codes = torch.cat((codes & 15, codes >> 4), dim=-1)
        q = (codes.view(torch.int8) if self.format == "q8_0" else codes).float()
        # [block, chunk, k4, n, byte] -> [block, n, chunk, k4, byte]
        q = q.reshape(blocks, chunks, CHUNK // 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(blocks * TILE, chunks, CHUNK)

        def scales(at: int) -> torch.Tensor:  # fp16 bytes [block, chunk, 32] -> float32 [out, chunk, 1]
            half = self.data[..., at:at + 32].contiguous().view(torch.float16).float()
            return half.transpose(1, 2).reshape(blocks * TILE, chunks, 1)

        values = (q - 8 if self.format == "q4_0" else q) * scales(size)
        if self.format == "q4_1":
            values = values + scales(size + 32)
        return values.reshape(blocks * TILE, self.in_features)[:self.out_features]


def pack(weight: QuantizedTensor) -> PackedWeight:
    """``weight`` in the kernel's layout (csrc/qpacked.cpp's header): per block of 16 outputs and chunk of 32
    inputs, the codes in rows of 16 outputs x 4 codes (4-bit codes two to a byte), the fp16 scales, q4_1's fp16
    offsets. Outputs past the last are zero codes and scales (never written)."""
    name = weight.format.name
    if name not in FORMAT_CODES or weight.in_features % CHUNK:
        raise ValueError(f"the packed int8 kernel runs {', '.join(FORMAT_CODES)} weights of whole {CHUNK}-value "
                         f"chunks, not {name} with {weight.in_features} inputs")
    if not available():
        raise RuntimeError("the packed int8 kernel does not run here (no AVX512-VNNI, or the build failed: see the log)")
    out_features, in_features = weight.shape
    blocks, chunks = math.ceil(out_features / TILE), in_features // CHUNK
    pad = blocks * TILE - out_features
    q = values_of(weight).view(torch.uint8)
    a, b = scales_of(weight)  # fp16 values as float32 (exact), per output and chunk
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        a, b = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (a, b))
    # [block, n, chunk, k4, byte] -> [block, chunk, k4, n, byte]: row k4 holds each output's 4 codes.
    codes = q.reshape(blocks, TILE, chunks, CHUNK // 4, 4).permute(0, 2, 3, 1, 4).reshape(blocks, chunks, 512)
    if name != "q8_0":  # code i in the low nibble of byte i, code 256 + i in its high nibble
        codes = codes[..., :256] | (codes[..., 256:] << 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, chunks] -> fp16 bytes [block, chunk, 32]
        return t.half().reshape(blocks, TILE, chunks).transpose(1, 2).contiguous().view(torch.uint8)

    arrays = [codes, per_block(a)] + ([per_block(b)] if name == "q4_1" else [])
    return PackedWeight(name, torch.cat(arrays, dim=-1).contiguous(), out_features, in_features)


def qlinear_packed(x: torch.Tensor, weight: PackedWeight, use_tiles: bool = True) -> torch.Tensor:
    """x [rows, in] (float32 or bfloat16) @ weight^T, in x's dtype. ``use_tiles=False``: AVX512-VNNI at every row
    count, never AMX (the same bits; the tests compare the two)."""
    return torch.ops.kvreuse_qpacked.qlinear_packed(x, weight.data, FORMAT_CODES[weight.format], weight.out_features,
                                                    use_tiles)

"""The native decoder layer (csrc/decoder_layer.cpp), registered as ``kvreuse_step``: a decode step's
layers in one call, each calling the other kernels (row-dot, quantized linear, packed int8, fused ops, paged
attention) from C++. Which weights and kernels it runs is the decode path's choice (runner/decode/native_step.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvreuse.kernels import build, fused_ops, paged_attention, quant_ops, rowdot

SOURCE = Path(__file__).with_name("csrc") / "decoder_layer.cpp"


@functools.cache
def library() -> Path | None:
    """The op, built and loaded with the kernels it calls (None where any of them cannot be)."""
    if not all(module.library() is not None for module in (quant_ops, rowdot, fused_ops, paged_attention)):
        return None
    return build.load_extension(SOURCE, build.build_name(SOURCE, "kvreuse_decoder_layer"),
                                 "the native decoder layer", "decode steps run the layers op by op")

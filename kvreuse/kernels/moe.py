"""The native mixture-of-experts layer (csrc/moe.cpp, csrc/moe.h), loaded as ``torch.ops.kvreuse_moe``: a
decode step's routed experts in one call, with the quantized linear and fused kernels called from C++.
Which experts' products it runs is the experts layer's choice (layers/experts.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvreuse.kernels import build, fused_ops, quant_ops

SOURCE = Path(__file__).with_name("csrc") / "moe.cpp"


@functools.cache
def library() -> Path | None:
    """The native layer, built and loaded with the kernels it calls (None where any of them cannot be)."""
    if quant_ops.library() is None or fused_ops.library() is None:
        return None
    return build.load_extension(SOURCE, build.build_name(SOURCE, "kvreuse_moe"), "the native MoE layer",
                                 "mixture-of-experts layers run from Python")

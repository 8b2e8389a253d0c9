"""The row-dot GEMV (csrc/rowdot.cpp): built for this CPU on first use, loaded as ``torch.ops.kvreuse_cpu``.

One decode row through a linear layer reads the whole weight once; on CPU that is a race for memory
bandwidth, which the BLAS paths behind ``F.linear`` lose by 20-60% for the row counts decoding uses
(layers/plan_book.py). ``rowdot`` computes each output as the dot product of one weight row with the input
row, over the weight's own [out, in] layout (no second copy), split over torch's threads; float32, or
bfloat16 accumulated in float32 (AVX512-BF16's dot instruction where the CPU has it).

It is C++ built at run time with ``torch.utils.cpp_extension`` and ``-march=native``, so it needs a C++
compiler (the one inductor uses for ``torch.compile`` on CPU). Where the build fails, ``available``
says so once in the log and the kernel planner simply never picks it: nothing else depends on it.
The build (about 10 s on 2 cores) lands in ``<cache dir>/kernels/<name>``, named by a digest of the
source, the compiler flags, the torch version and the CPU's flags, so a cache dir shared between
different CPUs never runs code compiled for another instruction set, and a library found under that
name is this build: later starts load it directly (~0.2 s), without the compiler.

It is registered as a real operator (``kvreuse_cpu::rowdot``) with a fake implementation, so
``torch.compile`` traces it and inductor's C++ wrapper calls it directly.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvreuse.kernels.build import build_name as _build_name
from kvreuse.kernels.build import load_extension

SOURCE = Path(__file__).with_name("csrc") / "rowdot.cpp"
GROUPS = (1, 8)  # weight rows per pass the C++ kernel is instantiated for
DTYPES = (torch.float32, torch.bfloat16)  # bf16: float32 accumulation, the output rounded once


def build_name() -> str:
    return _build_name(SOURCE, "kvreuse_rowdot")


def available() -> bool:
    """Whether ``torch.ops.kvreuse_cpu.rowdot`` runs here, building it first if needed (once per process).

    False on platforms other than Linux on x86-64 or aarch64, or where the build fails (no compiler,
    no ninja): logged once, and the linear layers fall back to the library kernels.
    """
    return library() is not None


@functools.cache
def library() -> Path | None:
    """The built library this process loaded (built now if the cache dir has none), or None."""
    built = load_extension(SOURCE, build_name(), "the row-dot GEMV",
                           "CPU linear layers use the library kernels only")
    if built is not None:
        _register_fake()
    return built


def _register_fake() -> None:
    @torch.library.register_fake("kvreuse_cpu::rowdot")
    def _(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))


def rowdot(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T -> [rows, out], float32 or bfloat16 on CPU, ``group`` (1 or 8)
    weight rows per pass. ``available()`` must have returned True."""
    return torch.ops.kvreuse_cpu.rowdot(x, weight, group)

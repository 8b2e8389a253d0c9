"""The row-dot GEMV (csrc/rowdot.cpp): built for this CPU on first use, loaded as ``torch.ops.kvreuse_cpu``.

One decode row through a linear layer reads the whole weight once; on CPU that is a race for memory
bandwidth, which the BLAS paths behind ``F.linear`` lose by 20-60% for the row counts decoding uses
(models/kernels.py). ``rowdot`` computes each output as the dot product of one weight row with the input
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
import hashlib
import logging
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from kvreuse.config import cache_dir
from kvreuse.models.cpu import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "rowdot.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for is inline OpenMP code
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)
GROUPS = (1, 8)  # weight rows per pass the C++ kernel is instantiated for
DTYPES = (torch.float32, torch.bfloat16)  # bf16: float32 accumulation, the output rounded once


def build_name(source: Path = SOURCE, stem: str = "kvreuse_rowdot") -> str:
    """The extension's name: a digest of what decides the binary (source and the headers beside it that it
    includes, flags, torch, the CPU's flags)."""
    digest = hashlib.sha256()
    text = source.read_bytes()
    headers = [source.with_name(name.decode()) for name in re.findall(rb'^#include "([^"/]+)"', text, re.MULTILINE)]
    for part in (text, *(header.read_bytes() for header in headers), " ".join(CFLAGS + LDFLAGS).encode(),
                 torch.__version__.encode(), platform.machine().encode(), " ".join(sorted(cpu_flags() or ())).encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"{stem}_{digest.hexdigest()[:16]}"


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


def load_extension(source: Path, name: str, what: str, fallback: str) -> Path | None:
    """Load the C++ extension ``name`` built from ``source`` for this CPU (building it into the cache dir
    first if no library of that name is there); None, with one warning naming ``what`` failed and the
    ``fallback``, where it cannot be built or loaded or the platform is not Linux on x86-64 / aarch64."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    from torch.utils import cpp_extension

    directory = cache_dir() / "kernels" / name
    built = directory / f"{name}.so"
    try:
        if built.exists():
            # The name digests the source, flags, torch and CPU: a library under it is this build, so it
            # loads without asking ninja (a second per engine start otherwise).
            torch.ops.load_library(str(built))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            logger.info("building %s for this CPU in %s (once per machine, ~10 s)", what, directory)
            cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                               is_python_module=False, verbose=False)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]  # the compiler's last line
        logger.warning("%s could not be built or loaded (%s); %s", what, reason, fallback)
        return None
    return built


def _register_fake() -> None:
    @torch.library.register_fake("kvreuse_cpu::rowdot")
    def _(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))


def rowdot(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T -> [rows, out], float32 or bfloat16 on CPU, ``group`` (1 or 8)
    weight rows per pass. ``available()`` must have returned True."""
    return torch.ops.kvreuse_cpu.rowdot(x, weight, group)

"""How every native kernel is built: C++ compiled at run time for this CPU, cached, loaded as a torch op library.

``torch.utils.cpp_extension`` with ``-march=native``, so it needs a C++ compiler (the one inductor uses on
CPU). A build (about 10 s on 2 cores) lands in ``<cache dir>/kernels/<name>``, named by a digest of the
source and the headers it includes, the compiler flags, the torch version and the CPU's flags, so a cache
dir shared between different CPUs never runs code compiled for another instruction set, and a library found
under that name is this build: later starts load it directly (~0.2 s), without the compiler. Where a build
fails, ``load_extension`` says so once in the log and returns None; each kernel's module names its fallback.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from kvreuse.config import cache_dir
from kvreuse.kernels.cpu import cpu_flags

logger = logging.getLogger(__name__)


CFLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for is inline OpenMP code


LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)


def build_name(source: Path, stem: str) -> str:
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

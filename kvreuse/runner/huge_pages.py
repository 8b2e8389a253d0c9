"""Large weights on 2 MiB pages (Linux transparent huge pages), so a decode step's streaming reads miss the TLB less.

A decode row reads every weight byte once, straight from memory. On 4 KiB pages a 127 MB output projection
is 31,000 pages, each a TLB miss and a page walk in the middle of the stream. Measured on a 2-core Xeon VM
(avx512_vnni, avx512_bf16; THP "madvise"; kernel 6.18), qwen3-moe-1b Q4_K_M: its Q6_K output projection
[151,936 x 1,024] took 10.6 ms a token on 4 KiB pages and 6.3 ms on 2 MiB pages (12 -> 20 GB/s), and the
decode step 22.9 -> 17.7 ms. Weights under 2 MiB (a small model's projections, one expert's matrices) gained
nothing measurable there: their streams are short, and the huge page does not shorten them.

What this does, after loading (the weights are then final and in place): for each weight tensor's memory
of at least 2 MiB, ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned range inside it (later faults and
khugepaged use huge pages there), then ``MADV_COLLAPSE`` (Linux 6.1+), which rebuilds the range's
present pages as huge pages at once. Nothing moves: the tensors keep their addresses, so the kernels and
the native step that hold them see the same memory. Where the kernel refuses (THP set to "never", an
older kernel, memory too fragmented, a file mapping), the pages stay as they were and the report says how
much was collapsed. ``KVREUSE_HUGE_PAGES=0`` leaves the pages alone. PyTorch's own switch
(``THP_MEM_ALLOC_ENABLE=1``) does the same for every allocation over 2 MiB, but only when set before
torch is imported; this works whatever the import order, and only on the weights.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ENV = "KVREUSE_HUGE_PAGES"  # "0": leave the weights' pages alone
HUGE_PAGE = 2 * 2**20
# <sys/mman.h> (Linux): the advice values.
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass(frozen=True)
class HugePageReport:
    """What ``back_weights_with_huge_pages`` did: the bytes in 2 MiB-aligned ranges of large weights, and of
    those the bytes now on huge pages (collapsed); ``reason`` says why none were tried, or why some failed."""

    eligible_bytes: int = 0
    collapsed_bytes: int = 0
    tensors: int = 0
    reason: str | None = None


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def thp_mode() -> str | None:
    """The system's transparent huge page setting (always, madvise or never), or None where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as file:
            text = file.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def aligned_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned (start, length) inside each distinct CPU storage of these tensors that holds one."""
    seen: set[int] = set()
    ranges = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue  # a oneDNN packed weight (the "packed" layout) is opaque: no storage to advise
        storage = tensor.untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if pointer in seen:
            continue
        seen.add(pointer)
        start = -(-pointer // HUGE_PAGE) * HUGE_PAGE
        end = (pointer + size) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            ranges.append((start, end - start))
    return ranges


def back_weights_with_huge_pages(tensors: Iterable[torch.Tensor]) -> HugePageReport:
    """Put the large ones of these (loaded, final) weight tensors on 2 MiB pages where the kernel allows;
    see the module docstring. Raises ValueError for a ``KVREUSE_HUGE_PAGES`` other than 0 or 1."""
    setting = os.environ.get(ENV, "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (leave the weights' pages alone) or 1 (the default), got {setting!r}")
    if setting == "0":
        return HugePageReport(reason=f"{ENV}=0")
    libc = _libc()
    mode = thp_mode()
    if libc is None or mode is None:
        return HugePageReport(reason="no transparent huge pages here (Linux only)")
    if mode == "never":
        return HugePageReport(reason="transparent huge pages are off on this system (never)")
    ranges = aligned_ranges(tensors)
    eligible = sum(length for _, length in ranges)
    collapsed, failure = 0, None
    for start, length in ranges:
        libc.madvise(start, length, MADV_HUGEPAGE)  # refused only where MADV_COLLAPSE is refused too
        if libc.madvise(start, length, MADV_COLLAPSE) == 0:
            collapsed += length
        else:
            code = ctypes.get_errno()
            failure = failure or (f"MADV_COLLAPSE: {errno.errorcode.get(code, code)}"
                                  + (" (Linux 6.1+)" if code == errno.EINVAL else ""))
    return HugePageReport(eligible, collapsed, len(ranges), failure)


def log_weight_pages(report: HugePageReport) -> None:
    if report.eligible_bytes == 0:
        logger.info("CPU weights: on the system's pages (%s)", report.reason or "none of 2 MiB or more")
        return
    logger.info("CPU weights: %.0f of %.0f MiB in %d large tensors on 2 MiB pages%s; %s=0 leaves them alone",
                report.collapsed_bytes / 2**20, report.eligible_bytes / 2**20, report.tensors,
                f" ({report.reason})" if report.reason else "", ENV)

"""What the CPU can do, read from /proc/cpuinfo: its feature flags and whether it does bfloat16 natively.

The lowest of the kernels: the dtype policy (loading/loader.py), the plan book (layers/plan_book.py) and every
kernel's build (kernels/build.py) read these facts, so they live below all three.
"""

from __future__ import annotations

from pathlib import Path

# CPU features that make bfloat16 matmuls native. Without them oneDNN still runs bf16 (its probe
# ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` says True on plain AVX-512), but emulated: 2-4x
# slower than float32. x86 names from /proc/cpuinfo "flags"; aarch64 names from its "Features".
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (or the given text); None where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def cpu_bfloat16_support(flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(whether this CPU does bfloat16 natively, the reason in words), from its feature flags."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return False, "the CPU's features cannot be read (no /proc/cpuinfo), so bfloat16 may be emulated"
    native = sorted(flags & NATIVE_BF16_CPU_FLAGS)
    if native:
        return True, f"the CPU has native bfloat16 ({', '.join(native)})"
    return False, "the CPU has no native bfloat16 (no AVX512_BF16 or AMX): bf16 would be emulated, 2-4x slower"


def cpu_supports_bfloat16() -> bool:
    """True when this CPU does bfloat16 matmuls natively (AVX512-BF16, AMX, Arm BF16)."""
    return cpu_bfloat16_support()[0]

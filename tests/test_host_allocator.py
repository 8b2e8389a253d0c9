"""kvreuse/runner/host_allocator.py: a CPU engine makes glibc keep large activations in the heap.

Each case runs in a fresh interpreter: the setting is process-wide, and this test process has built
CPU engines already. glibc's own statistics (``mallinfo2``) tell whether an allocation was mmapped.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from test_engine import make_llm

from kvreuse.runner import host_allocator

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

PROBE = """
import ctypes, json, torch
from kvreuse.runner.host_allocator import keep_activations_in_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
applied = keep_activations_in_heap()
moved = {}
for mib in (64, 512):  # an activation of a long prefill; something bigger than any activation (a KV pool)
    before = libc.mallinfo2().hblkhd
    tensor = torch.empty(mib << 20, dtype=torch.uint8)
    moved[mib] = (libc.mallinfo2().hblkhd - before) >> 20
    del tensor
print(json.dumps({"applied": applied, "mmapped_mib": moved}))
"""


def probe(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_large_activations_come_from_the_heap_once_applied():
    tuned = probe()
    assert tuned["applied"] is True
    assert tuned["mmapped_mib"] == {"64": 0, "512": 512}  # a 64 MiB tensor from the heap; huge ones still mmapped
    # glibc's default: anything above 32 MiB is a fresh mmap (page-faulted again after every free).
    untouched = probe(KVREUSE_CPU_MALLOC="0")
    assert untouched["applied"] is False
    assert untouched["mmapped_mib"] == {"64": 64, "512": 512}


def test_a_cpu_engine_applies_it(tiny_models):
    llm = make_llm(tiny_models["llama"])
    assert llm.engine.runner.activations_in_heap is True


def test_a_malformed_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(host_allocator.ENV, "off")
    with pytest.raises(ValueError, match="KVREUSE_CPU_MALLOC must be 0 .* got 'off'"):
        host_allocator.keep_activations_in_heap()

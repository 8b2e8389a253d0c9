"""The CPU paged attention kernel (csrc/paged_attention.cpp), loaded as ``torch.ops.kvreuse_attn``: its build, the
row layout it reads (``PagedRows``) and its instruction-set probe. The backend that runs it for a step
(``NativePagedAttention``) is attention/cpu_paged.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.kernels.build import build_name, load_extension

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"


SCHEME_INDEX = {None: -1, "int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}


Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def library() -> Path | None:
    built = load_extension(SOURCE, build_name(SOURCE, "kvreuse_paged_attention"), "the paged attention kernel",
                           "attention gathers the context and runs SDPA (TorchPagedAttention)")
    if built is not None:
        @torch.library.register_fake("kvreuse_attn::paged_attention")
        def _(out, q, k_pool, v_pool, k_scales, v_scales, block_tables, query_start, query_lens, context_lens,
              block_size, scheme, scale, window, sinks, partition_size, k_new, v_new, slot_mapping) -> None:
            return None
    return built


def available() -> bool:
    """Whether the kernel runs here (built now if this machine's cache has no build of it)."""
    return library() is not None


def has_bf16_dot() -> bool:
    """Whether the build here holds the kernel for bf16 pools and bf16 queries that scores with AVX512_BF16's
    dot products (csrc/paged_attention.cpp, chosen per call where head_dim is a multiple of 32)."""
    return available() and bool(torch.ops.kvreuse_attn.has_bf16_dot())


def use_bf16_dot(on: bool) -> None:
    """Whether the kernel's calls from now on use the AVX512_BF16 layout where it applies (on from load). Off, a bf16
    pool is read through float32 rows like every other dtype: the tests (a fixture) and the benchmark compare the
    two layouts; a user never needs it."""
    torch.ops.kvreuse_attn.use_bf16_dot(on)


@dataclass
class PagedRows:
    """The sequences the kernel attends for, as the tensors it reads (int64, on the CPU)."""

    block_tables: torch.Tensor  # [seqs, width]: block ids, padded with block 0 past a sequence's own
    query_start: torch.Tensor  # [seqs]: each sequence's first row in the step's q
    query_lens: torch.Tensor  # [seqs]
    context_lens: torch.Tensor  # [seqs]: cached + new tokens


def paged_rows(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], starts: list[int],
               block_size: int) -> PagedRows:
    """The kernel's view of the given sequences (their rows start at ``starts``); each table is cut to the
    blocks its context uses and padded to the longest."""
    used = [table[: -(-length // block_size)] for table, length in zip(block_tables, context_lens)]
    width = max(len(table) for table in used)
    tables = torch.tensor([table + [0] * (width - len(table)) for table in used], dtype=torch.int64)
    return PagedRows(tables, torch.tensor(starts, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64),
                     torch.tensor(context_lens, dtype=torch.int64))

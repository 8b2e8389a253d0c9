"""Large CPU weights on 2 MiB pages (runner/huge_pages.py): collapsed in place, values and addresses unchanged;
the switch and its refusals; the model lists every tensor its weights are held in."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kvreuse.runner import huge_pages
from kvreuse.runner.huge_pages import (
    HUGE_PAGE,
    aligned_ranges,
    back_weights_with_huge_pages,
    thp_mode,
)

THP_USABLE = thp_mode() in ("always", "madvise")


def anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``tensor``'s memory (/proc/self/smaps), in KiB."""
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    inside, total = False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start < last and first < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_aligned_ranges_are_the_whole_huge_pages_inside_each_storage_once():
    big = torch.empty(5 * HUGE_PAGE, dtype=torch.uint8)
    small = torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)
    ranges = aligned_ranges([big, big[10:], big.view(torch.int32), small])
    assert len(ranges) == 1  # the views share big's storage; small holds no whole huge page
    assert aligned_ranges([torch.randn(2048, 1024).to_mkldnn()]) == []  # oneDNN's opaque layout: no storage
    start, length = ranges[0]
    assert start % HUGE_PAGE == 0 and length % HUGE_PAGE == 0 and length >= 4 * HUGE_PAGE
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel()


@pytest.mark.skipif(not THP_USABLE, reason=f"transparent huge pages are {thp_mode()} here")
def test_a_large_weight_is_collapsed_in_place_with_its_values(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    # A fresh anonymous mapping, on 4 KiB pages until advised (the heap may hold ranges an engine advised).
    mapping = mmap.mmap(-1, 12 * HUGE_PAGE + 12345, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    weight = torch.frombuffer(mapping, dtype=torch.uint8)[12345:]
    weight.copy_(torch.randint(0, 255, weight.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    before, address = weight.clone(), weight.data_ptr()
    assert anon_huge_kib(weight) == 0 or thp_mode() == "always"
    report = back_weights_with_huge_pages([weight])
    if report.reason is not None and "EINVAL" in report.reason:
        pytest.skip(f"this kernel has no MADV_COLLAPSE ({report.reason})")
    assert report.tensors == 1 and report.eligible_bytes >= 10 * HUGE_PAGE
    assert report.collapsed_bytes == report.eligible_bytes, report.reason
    assert anon_huge_kib(weight) * 1024 >= report.collapsed_bytes
    assert weight.data_ptr() == address and torch.equal(weight, before)


def test_the_switch_leaves_pages_alone_and_names_itself(monkeypatch):
    weight = torch.ones(6 * HUGE_PAGE, dtype=torch.uint8)
    monkeypatch.setenv(huge_pages.ENV, "0")
    report = back_weights_with_huge_pages([weight])
    assert report.collapsed_bytes == 0 and report.reason == f"{huge_pages.ENV}=0"
    monkeypatch.setenv(huge_pages.ENV, "yes")
    with pytest.raises(ValueError, match=huge_pages.ENV):
        back_weights_with_huge_pages([weight])


def test_a_system_without_huge_pages_is_reported_not_failed(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    report = back_weights_with_huge_pages([torch.ones(6 * HUGE_PAGE, dtype=torch.uint8)])
    assert report.collapsed_bytes == 0 and "never" in report.reason


def storages_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize(("arch", "quantization"), [("qwen2", None), ("qwen2", "int8"), ("qwen3_moe", "int8")])
def test_weight_tensors_hold_every_byte_the_model_counts(tiny_models: dict[str, Path], arch: str,
                                                         quantization: str | None):
    from kvreuse import LLM

    llm = LLM(model=str(tiny_models[arch]), dtype="float32", quantization=quantization, kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    tensors = model.weight_tensors()
    # Every byte weight_memory_bytes counts is in one of these storages (a storage may hold a little more: a
    # view's parent), and every parameter is among them.
    assert storages_bytes(tensors) >= model.weight_memory_bytes() > 0
    pointers = {tensor.untyped_storage().data_ptr() for tensor in tensors}
    assert all(p.untyped_storage().data_ptr() in pointers for p in model.parameters())
    runner_report = llm.engine.runner.weight_pages
    assert runner_report.eligible_bytes == sum(length for _, length in aligned_ranges(tensors))

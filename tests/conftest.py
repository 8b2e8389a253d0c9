"""Shared fixtures: tiny model folders made by ``kvreuse make-model`` (no network, ever)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session", autouse=True)
def _offline_and_private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Tests never reach a hub, and trained tokenizers / models go to a throwaway cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("KVREUSE_CACHE_DIR", str(tmp_path_factory.mktemp("kvreuse-cache")))
    yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, _offline_and_private_cache) -> dict[str, Path]:
    """One float32 tiny model folder per supported architecture."""
    from kvreuse.models.make import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, preset="tiny", arch=arch, dtype="float32", seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]

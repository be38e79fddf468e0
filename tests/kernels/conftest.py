"""Kernel-test fixtures: a cache root of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    """An empty cache root (`BATCHGEN_CACHE_DIR`) for this test alone; the deprecated variable unset."""
    root = tmp_path / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    return root


"""Remote checkpoints are copied once into the cache root that the kernels share (BATCHGEN_CACHE_DIR)."""

from __future__ import annotations

import fsspec
import pytest

from batchgen.engine.loader.source import resolve_model


@pytest.fixture
def remote_gguf():
    fs = fsspec.filesystem("memory")
    fs.pipe("/batchgen-test/tiny.gguf", b"GGUF")  # resolve_model copies it; nothing parses it here
    yield "memory://batchgen-test/tiny.gguf"
    fs.rm("/batchgen-test", recursive=True)


def test_remote_models_land_under_batchgen_cache_dir(remote_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    source = resolve_model(remote_gguf)
    assert source.folder.parent == tmp_path / "cache" / "models"
    assert (source.folder / source.gguf_file).read_bytes() == b"GGUF"


def test_the_old_batchgen_cache_variable_still_places_them_with_a_deprecation_warning(remote_gguf, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.delenv("BATCHGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="BATCHGEN_CACHE_DIR"):
        source = resolve_model(remote_gguf)
    assert source.folder.parent == tmp_path / "old" / "models"

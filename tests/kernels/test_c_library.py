"""The C-kernel loader: sources from the installed package, a private build cache, planted or altered
libraries never loaded, and every failure a logged fallback instead of a crash."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import stat
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from setuptools.config.pyprojecttoml import read_configuration

import batchgen.kernels
from batchgen.kernels import (
    cpu_elementwise,
    cpu_kv_store,
    cpu_paged_attention,
    cpu_sampling,
    cpu_token_bitmask,
)
from batchgen.kernels.c_library import kernel_cache_dir, read_source
from tests.kernels.helpers import fresh_library, plant_library

MODULES = (cpu_paged_attention, cpu_kv_store, cpu_elementwise, cpu_sampling, cpu_token_bitmask)
SAMPLING = cpu_sampling._LIBRARY  # the smallest library: the loader's tests build it
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_source_is_package_data_found_from_the_installed_package():
    csrc = importlib.resources.files("batchgen.kernels").joinpath("csrc")
    on_disk = {entry.name for entry in csrc.iterdir()}
    used = {name for module in MODULES for name in module._LIBRARY.sources}
    assert used == {name for name in on_disk if name.endswith(".c")}  # no orphan, none missing
    assert {"paged_decode.c", "paged_prefill.c", "kv_store.c"} <= used  # one file each
    package_dir = Path(batchgen.kernels.__file__).parent
    for name in used:
        assert read_source(name) == (package_dir / "csrc" / name).read_text()
    # What an installed (non-editable) package ships: setuptools' own reading of its package-data.
    patterns = read_configuration(PYPROJECT)["tool"]["setuptools"]["package-data"]["batchgen.kernels"]
    for name in on_disk:
        assert any(fnmatch(f"csrc/{name}", pattern) for pattern in patterns), name


def test_the_cache_folder_is_created_private_and_the_library_recorded(cache_root, monkeypatch):
    library = fresh_library(SAMPLING)
    assert library.is_available()
    for folder in (cache_root, cache_root / "kernels"):
        st = folder.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    path = library.cache_path(cache_root / "kernels")
    assert Path(f"{path}.sha256").read_text().strip() == sha256_of(path)
    # A second process finds it verified in the cache: no compiler needed.
    monkeypatch.setenv("CC", str(cache_root / "no-such-compiler"))
    assert fresh_library(SAMPLING).is_available()


def test_without_a_compiler_require_names_the_library_and_the_fallback(cache_root, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(cache_root / "no-such-compiler"))
    library = fresh_library(SAMPLING)
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert library.load() is None
        assert not library.is_available()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1  # logged once
    with pytest.raises(RuntimeError, match=r"'sampling' is not available .*no-such-compiler.*torch's argmax"):
        library.require()
    monkeypatch.setattr(cpu_sampling, "_LIBRARY", library)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_sampling.argmax(torch.zeros(2, 8))


def _plant(path: Path, marker: Path, how: str) -> None:
    """A planted library at the cached library's path, in one of the ways the loader must see through."""
    if how == "symlink":
        target = path.parent / "elsewhere.so"
        plant_library(target, marker, exports=tuple(SAMPLING.functions))
        path.symlink_to(target)
        Path(f"{path}.sha256").write_text(sha256_of(target))
        return
    plant_library(path, marker, exports=tuple(SAMPLING.functions))
    if how == "no record":
        return
    if how == "wrong record":
        Path(f"{path}.sha256").write_text("0" * 64)
    elif how == "unreadable record":
        Path(f"{path}.sha256").write_bytes(b"\xff\xfe" * 1000)
    elif how == "writable by others":  # its record matches, but anyone could have rewritten it
        Path(f"{path}.sha256").write_text(sha256_of(path))
        os.chmod(path, 0o777)


@pytest.mark.parametrize("how", ["no record", "wrong record", "unreadable record", "writable by others", "symlink"])
def test_a_planted_library_in_the_cache_is_rebuilt_never_loaded(cache_root, tmp_path, monkeypatch, how):
    library = fresh_library(SAMPLING)
    path = library.cache_path(kernel_cache_dir())
    marker = tmp_path / "constructor-ran"
    _plant(path, marker, how)
    assert library.is_available()
    assert not marker.exists()  # the planted constructor never ran
    assert path.is_file() and not path.is_symlink()
    assert Path(f"{path}.sha256").read_text().strip() == sha256_of(path)
    monkeypatch.setattr(cpu_sampling, "_LIBRARY", library)
    logits = torch.randn(3, 100)
    assert torch.equal(cpu_sampling.argmax(logits), logits.argmax(dim=-1))  # the rebuilt kernel, working


def _pretend_another_user_owns_it(monkeypatch) -> None:
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)


@pytest.mark.parametrize("unsafe", ["writable by others", "owned by another user"])
def test_an_unsafe_cache_folder_is_refused_and_nothing_in_it_loaded(cache_root, tmp_path, monkeypatch, caplog,
                                                                   unsafe):
    library = fresh_library(SAMPLING)
    folder = kernel_cache_dir()
    path = library.cache_path(folder)
    marker = tmp_path / "constructor-ran"
    plant_library(path, marker, exports=tuple(SAMPLING.functions))
    Path(f"{path}.sha256").write_text(sha256_of(path))  # recorded as if built here
    planted = path.read_bytes()
    if unsafe == "writable by others":
        os.chmod(folder, 0o777)
        expected = "writable by group or others"
    else:
        _pretend_another_user_owns_it(monkeypatch)
        expected = "owned by uid"
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert not library.is_available()
    assert expected in caplog.text and "torch's argmax" in caplog.text  # refused, with the fallback named
    assert not marker.exists()
    assert path.read_bytes() == planted  # refused, not rebuilt into a folder others control
    with pytest.raises(RuntimeError, match=expected):
        library.require()
    monkeypatch.undo()
    ctypes.CDLL(str(path))  # the control: loading the planted file does run its constructor
    assert marker.read_text() == "ran"


def test_a_library_without_a_kernel_falls_back_logged_once(cache_root, monkeypatch, caplog):
    library = fresh_library(SAMPLING, no_such_kernel=(None, []))  # builds fine, lacks one export
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert library.load() is None
        assert library.load() is None
    records = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(records) == 1 and "no_such_kernel" in records[0].getMessage()
    monkeypatch.setattr(cpu_sampling, "_LIBRARY", library)
    assert not cpu_sampling.is_available()
    with pytest.raises(RuntimeError, match="AttributeError.*no_such_kernel"):  # not an AttributeError crash
        cpu_sampling.argmax_log_z(torch.zeros(2, 8))


def test_a_recorded_library_that_fails_to_load_falls_back(cache_root, caplog):
    library = fresh_library(SAMPLING)
    path = library.cache_path(kernel_cache_dir())
    path.write_bytes(b"not an ELF file")
    Path(f"{path}.sha256").write_text(sha256_of(path))
    os.chmod(path, 0o700)
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert not library.is_available()
    assert "OSError" in caplog.text and "torch's argmax" in caplog.text

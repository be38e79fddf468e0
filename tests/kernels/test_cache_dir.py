"""The cache root: one variable, the old name still read with a deprecation note; private folders."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from batchgen.kernels import cache_dir
from batchgen.kernels.cache_dir import UnsafeCacheDirError, cache_root, private_dir


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("BATCHGEN_CACHE_DIR", "BATCHGEN_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_root_is_batchgen_cache_dir_else_xdg_else_home(clean_env, tmp_path):
    assert cache_root() == tmp_path / "home" / ".cache" / "batchgen"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "batchgen"
    clean_env.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    clean_env.setenv("BATCHGEN_CACHE", str(tmp_path / "old"))
    assert cache_root() == tmp_path / "mine"  # the one variable wins over the old name


def test_the_old_variable_still_works_with_a_deprecation_note(clean_env, tmp_path, caplog):
    clean_env.setenv("BATCHGEN_CACHE", str(tmp_path / "old"))
    clean_env.setattr(cache_dir, "_is_deprecation_logged", False)
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        with pytest.warns(DeprecationWarning, match="BATCHGEN_CACHE_DIR"):
            assert cache_root() == tmp_path / "old"
        with pytest.warns(DeprecationWarning):
            cache_root()
    assert caplog.text.count("BATCHGEN_CACHE is deprecated") == 1  # the log line once per process


def test_private_dir_creates_0700_and_refuses_what_others_could_write(tmp_path, monkeypatch):
    folder = private_dir(tmp_path / "root" / "kernels")
    for path in (folder, folder.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    os.chmod(folder, 0o755)  # readable by others is fine: only writing matters
    assert private_dir(folder) == folder
    os.chmod(folder, 0o770)
    with pytest.raises(UnsafeCacheDirError, match="writable by group or others"):
        private_dir(folder)
    os.chmod(folder, 0o700)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(UnsafeCacheDirError, match="owned by uid"):
        private_dir(folder)
    monkeypatch.undo()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UnsafeCacheDirError, match="not a folder"):
        private_dir(Path(tmp_path / "a-file"))

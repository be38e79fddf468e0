"""Where batchgen caches things for this user (downloaded models, compiled kernels), and how a
folder that will hold code is made private.

One variable names the root, `BATCHGEN_CACHE_DIR`; the engine's model cache and the kernels'
build cache both resolve it here (the engine imports this module, kernels never import the
engine). `BATCHGEN_CACHE`, the model cache's old name for it, is still read when the new one is
unset, with a deprecation note.
"""

from __future__ import annotations

import logging
import os
import stat
import warnings
from pathlib import Path

log = logging.getLogger("batchgen.kernels")

CACHE_DIR_VARIABLE = "BATCHGEN_CACHE_DIR"
DEPRECATED_CACHE_VARIABLE = "BATCHGEN_CACHE"

# The log line once per process; the DeprecationWarning itself follows the warnings filters.
_is_deprecation_logged = False


class UnsafeCacheDirError(OSError):
    """A cache folder that someone else could write (not ours, or writable by group or others)."""


def cache_root() -> Path:
    """$BATCHGEN_CACHE_DIR, else the deprecated $BATCHGEN_CACHE, else $XDG_CACHE_HOME/batchgen,
    else ~/.cache/batchgen. Nothing is created here."""
    global _is_deprecation_logged
    root = os.environ.get(CACHE_DIR_VARIABLE)
    old = os.environ.get(DEPRECATED_CACHE_VARIABLE)
    if old and not root:
        message = f"{DEPRECATED_CACHE_VARIABLE} is deprecated; set {CACHE_DIR_VARIABLE} instead (using {old})"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        if not _is_deprecation_logged:
            _is_deprecation_logged = True
            log.warning(message)
        root = old
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchgen")
    return Path(root)


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can write: created with mode 0700 (the cache root above
    it too, when this creates it), or, when it exists, checked to be a folder owned by this user
    that neither group nor others may write. Raises UnsafeCacheDirError otherwise; returns `path`."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first: checked below like any other
            pass
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Raise UnsafeCacheDirError unless `path` is a folder owned by this user that neither group
    nor others may write (what a cache of code to load must be)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDirError(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise UnsafeCacheDirError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                                  f"set {CACHE_DIR_VARIABLE} to a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        raise UnsafeCacheDirError(f"{path} is writable by group or others (mode {mode:o}); "
                                  f"`chmod go-w {path}` once you trust what is in it")

"""Small C kernels for the CPU, compiled on first use with the system compiler and loaded with ctypes.

No torch headers, so a kernel builds in well under a second. The shared library is cached per
user (`$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`, under kernels/) keyed by source, flags and
the CPU's feature flags (-march=native code only runs on the CPU that built it). OpenMP comes from
torch's own libgomp (same soname, already loaded), so a kernel's parallel region runs on torch's
worker threads and no second pool competes with them. Without a compiler, or off Linux, `load()`
returns None once, logged, and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("batchgen.kernels")

# -ffast-math only when compiling (vectorized reductions, libmvec expf); linking without it keeps
# GCC's crtfastmath out of the library, whose constructor would switch the loading thread to
# flush-to-zero.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp")
LINK_FLAGS = ("-shared", "-fopenmp")


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchgen")
    return Path(root) / "kernels"


class CLibrary:
    """One C source built into one shared library; `functions` maps each exported name to
    (restype, argtypes) for ctypes. `fallback` says what callers do without it (for the log)."""

    def __init__(self, name: str, source: str, functions: dict[str, tuple], fallback: str):
        self.name, self.source, self.functions, self.fallback = name, source, functions, fallback
        self._library: ctypes.CDLL | None = None
        self._is_tried = False

    def reset(self) -> None:
        """Forget the loaded library (tests: try again under other settings)."""
        self._library, self._is_tried = None, False

    def load(self) -> ctypes.CDLL | None:
        if self._is_tried:
            return self._library
        self._is_tried = True
        if not sys.platform.startswith("linux"):
            return None
        flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
        key = hashlib.sha256((self.source + flags + _cpu_fingerprint()).encode()).hexdigest()[:16]
        path = cache_dir() / f"{self.name}-{key}.so"
        try:
            if not path.exists():
                self._build(path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("CPU kernel %s unavailable (%s %s); %s", self.name, exc, detail.decode()[:200], self.fallback)
            return None
        for fn_name, (restype, argtypes) in self.functions.items():
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = restype, argtypes
        self._library = lib
        return lib

    def _build(self, path: Path) -> None:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            source, obj = Path(tmp) / f"{self.name}.c", Path(tmp) / f"{self.name}.o"
            built = Path(tmp) / path.name
            source.write_text(self.source)
            subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(built, path)  # atomic: concurrent builders never load a half-written file

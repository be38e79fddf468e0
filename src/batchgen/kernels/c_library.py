"""Small C kernels for the CPU, compiled on first use with the system compiler and loaded with ctypes.

The sources are package data (kernels/csrc/*.c) and use no torch headers, so a build is quick. Each built library is cached in a private folder under the cache root (see
cache_dir.py: `$BATCHGEN_CACHE_DIR/kernels`, created with mode 0700 and refused when another user
owns it or group or others may write it), named by the hash of its sources, the compiler flags and
the CPU's feature flags (-march=native code only runs on the CPU that built it). The -march flags
follow cpu_isa.py: -march=native, or the level `BATCHGEN_CPU_ISA` forces (e.g. avx2 on an AVX-512
machine), each level its own cached file. Next to it a
`.sha256` file records the library's own hash, written after the build; a cached library is loaded
only when it is a regular file owned by this user whose content matches that record, otherwise it
is rebuilt. The check and the load read the same open file, so the file cannot be swapped between
them.

OpenMP comes from torch's own libgomp (same soname, already loaded), so a kernel's parallel region
runs on torch's worker threads and no second pool competes with them. Whatever goes wrong (no
compiler, not Linux, an unsafe cache folder, a library that fails to load or lacks a symbol),
`load()` returns None, logged once, and callers keep their torch path; `require()` raises a
RuntimeError naming the library and that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from batchgen.kernels import cpu_isa
from batchgen.kernels.cache_dir import cache_root, private_dir

log = logging.getLogger("batchgen.kernels")

# -ffast-math only when compiling (vectorized reductions, libmvec expf); linking without it keeps
# GCC's crtfastmath out of the library, whose constructor would switch the loading thread to
# flush-to-zero.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-fopenmp")  # plus compile_flags()'s -march
LINK_FLAGS = ("-shared", "-fopenmp")
SOURCE_PACKAGE = "batchgen.kernels"  # csrc/ is package data of this package


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def compile_flags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler's flags for the kernels at `isa` (default: cpu_isa.selected_isa())."""
    isa = cpu_isa.selected_isa() if isa is None else isa
    return (COMPILE_FLAGS[0], *cpu_isa.march_flags(isa), *COMPILE_FLAGS[1:])


def read_source(file_name: str) -> str:
    """The text of csrc/<file_name>, read from the installed package."""
    return importlib.resources.files(SOURCE_PACKAGE).joinpath("csrc", file_name).read_text()


def kernel_cache_dir() -> Path:
    """The private folder compiled kernels are cached in (created 0700, or checked; see cache_dir.py)."""
    return private_dir(cache_root() / "kernels")


def _file_sha256(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _is_own_file(fd: int) -> bool:
    st = os.fstat(fd)
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class CLibrary:
    """One shared library built from C sources in csrc/ (`sources`: file names, compiled and linked
    together; `headers`: csrc/ headers they include, hashed with them); `functions` maps each exported
    name to (restype, argtypes) for ctypes. `fallback` says what callers do without it (for the log
    and require()'s error)."""

    def __init__(self, name: str, sources: tuple[str, ...], functions: dict[str, tuple], fallback: str,
                 headers: tuple[str, ...] = ()):
        self.name, self.sources, self.functions, self.fallback = name, tuple(sources), functions, fallback
        self.headers = tuple(headers)
        self._library: ctypes.CDLL | None = None
        self._is_tried = False
        self._reason = ""  # why load() returned None
        self.isa: str | None = None  # the level it was built for, once loaded (cpu_isa.py)

    def is_available(self) -> bool:
        """True once the library is built (or found verified in the cache) and loaded."""
        return self.load() is not None

    def require(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError naming it, why it is missing and the fallback otherwise."""
        lib = self.load()
        if lib is None:
            raise RuntimeError(f"the CPU kernel library {self.name!r} is not available ({self._reason}); "
                               f"callers check is_available() and fall back: {self.fallback}")
        return lib

    def read_sources(self) -> dict[str, str]:
        """File name -> text of each of the library's sources and headers, from the installed package."""
        return {file_name: read_source(file_name) for file_name in self.sources + self.headers}

    def cache_path(self, directory: Path, sources: dict[str, str] | None = None,
                   flags: tuple[str, ...] | None = None) -> Path:
        """The library's file in `directory`, named by the hash of its sources, flags and CPU."""
        key = hashlib.sha256()
        for file_name, text in (sources or self.read_sources()).items():
            key.update(f"{file_name}\0{text}\0".encode())
        key.update((" ".join((flags or compile_flags()) + LINK_FLAGS) + _cpu_fingerprint()).encode())
        return Path(directory) / f"{self.name}-{key.hexdigest()[:16]}.so"

    def load(self) -> ctypes.CDLL | None:
        """Build or find the library once per process; None (logged once) when it cannot be used."""
        if self._is_tried:
            return self._library
        self._is_tried = True
        if not sys.platform.startswith("linux"):
            self._reason = f"C kernels are built on Linux only, not {sys.platform}"
            log.info("CPU kernel %s unavailable (%s); %s", self.name, self._reason, self.fallback)
            return None
        try:
            isa = cpu_isa.selected_isa()
        except ValueError as exc:  # a BATCHGEN_CPU_ISA this CPU cannot run
            self._reason = str(exc)
            log.warning("CPU kernel %s unavailable (%s); %s", self.name, self._reason, self.fallback)
            return None
        try:
            sources = self.read_sources()
            flags = compile_flags(isa)
            path = self.cache_path(kernel_cache_dir(), sources, flags)
            fd = self._open_verified(path)
            if fd is None:
                fd = self._build(path, sources, flags)
            lib = self._load_fd(fd, path)
            for fn_name, (restype, argtypes) in self.functions.items():
                fn = getattr(lib, fn_name)  # AttributeError: the library lacks it
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[:200]
            self._reason = f"{type(exc).__name__}: {exc} {detail}".strip()
            log.warning("CPU kernel %s unavailable (%s); %s", self.name, self._reason, self.fallback)
            return None
        self._library, self.isa = lib, isa
        return lib

    @staticmethod
    def _open_verified(path: Path) -> int | None:
        """An open descriptor of the cached library when it is this user's regular file and matches
        its recorded hash; None (logged) when it is absent or must be rebuilt."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. a symlink planted in its place (O_NOFOLLOW)
            log.warning("cached CPU kernel %s cannot be opened safely (%s); rebuilding it", path, exc)
            return None
        try:
            with open(f"{path}.sha256", "rb") as f:
                recorded = f.read(128).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            recorded = ""
        if _is_own_file(fd) and recorded and _file_sha256(fd) == recorded:
            return fd
        os.close(fd)
        log.warning("cached CPU kernel %s is not this user's or does not match its recorded hash; "
                    "rebuilding it", path)
        return None

    @staticmethod
    def _load_fd(fd: int, path: Path) -> ctypes.CDLL:
        """dlopen the very file that was verified, through its descriptor. The descriptor stays open
        for the life of the process once the load succeeds: the dynamic loader knows the library by
        this /proc name, and a reused descriptor number would make it hand back this library again."""
        proc_path = f"/proc/self/fd/{fd}"
        try:
            return ctypes.CDLL(proc_path if os.path.exists(proc_path) else str(path))
        except OSError:
            os.close(fd)
            raise

    @staticmethod
    def _build(path: Path, sources: dict[str, str], flags: tuple[str, ...]) -> int:
        """Compile and link into `path` (atomically) and record its hash; returns an open descriptor
        of the built file."""
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
        if os.sep in compiler:  # a path: it must still name the compiler from inside the temp folder
            compiler = os.path.abspath(compiler)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            objects = []
            for file_name, text in sources.items():
                (Path(tmp) / file_name).write_text(text)
            for file_name in sources:
                if not file_name.endswith(".c"):
                    continue  # a header, included by the sources
                # Relative names, compiled in the temp folder: the library's bytes do not depend on
                # the temp folder's name.
                objects.append(Path(file_name).with_suffix(".o").name)
                subprocess.run([compiler, *flags, "-c", file_name, "-o", objects[-1]],
                               cwd=tmp, check=True, capture_output=True, timeout=120)
            subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", path.name, "-lm"],
                           cwd=tmp, check=True, capture_output=True, timeout=120)
            built = Path(tmp) / path.name
            os.chmod(built, 0o700)
            fd = os.open(built, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                digest = Path(tmp) / "digest"
                digest.write_text(_file_sha256(fd) + "\n")
                os.replace(built, path)  # atomic: concurrent builders never load a half-written file
                # The record after the library: a reader between the two sees a mismatch and rebuilds.
                os.replace(digest, f"{path}.sha256")
            except OSError:
                os.close(fd)
                raise
        return fd

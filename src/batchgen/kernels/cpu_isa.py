"""Which x86 vector instruction set the CPU kernels are built for, found at run time.

The C kernels (c_library.py) are compiled on the machine that runs them, for the ISA chosen here;
oneDNN (the packed GEMMs) dispatches on the same CPU by itself. The levels, each a superset of the
one before:

- `avx2`: AVX2 + FMA (x86-64-v3), the floor for the vectorized kernels' 256-bit paths;
- `avx512`: AVX-512 F/BW/VL/DQ (x86-64-v4): 512-bit vectors, and bf16 conversion in oneDNN;
- `avx512_bf16`: AVX-512 BF16 (vdpbf16ps): bf16 dot products at twice the float32 rate;
- `amx`: AMX BF16 tiles, which oneDNN's bf16 GEMMs use where present.

`BATCHGEN_CPU_ISA` (avx2 | avx512 | avx512_bf16 | amx | native) forces a lower level than the CPU has,
e.g. `BATCHGEN_CPU_ISA=avx2` on an AVX-512 machine builds the kernels with `-march=x86-64-v3` and caps
oneDNN and MKL at the same level (`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`, each unless set
already; both are read at the library's first GEMM, so set BATCHGEN_CPU_ISA before the process
starts); asking for more than the CPU has is an error. torch's own vectorized ops read
`ATEN_CPU_CAPABILITY` (e.g. avx2) when torch starts: set it on the command line too to emulate an
AVX2 machine whole. Unset (or `native`): the CPU's own level and `-march=native`. Other
architectures (arm) report `native`.
"""

from __future__ import annotations

import os
import platform

ISA_VARIABLE = "BATCHGEN_CPU_ISA"
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")  # lowest first
# The /proc/cpuinfo flags each level needs (on top of the level below it).
_LEVEL_FLAGS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
# Compiler flags per level (the kernels use GCC vector types; -march picks the widths).
_MARCH = {"avx2": ("-march=x86-64-v3",), "avx512": ("-march=x86-64-v4",),
          "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
          "amx": ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")}
_ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}
_MKL_ISA = {"avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512_E1", "amx": "AVX512_E4"}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def detect_isa(flags: frozenset[str] | None = None) -> str:
    """The highest level in ISA_LEVELS whose flags (and those of every level below) the CPU has;
    `native` off x86 or below AVX2."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64") and not flags & {"avx2"}:
        return "native"
    found = "native"
    for level in ISA_LEVELS:
        if not all(flag in flags for flag in _LEVEL_FLAGS[level]):
            break
        found = level
    return found


def selected_isa(flags: frozenset[str] | None = None) -> str:
    """The level the kernels run at: BATCHGEN_CPU_ISA when set (at most the CPU's), else the CPU's.
    ValueError for an unknown value or a level the CPU lacks."""
    found = detect_isa(flags)
    requested = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if requested in ("", "native"):
        return found
    if requested not in ISA_LEVELS:
        raise ValueError(f"{ISA_VARIABLE}={requested!r}: must be one of native, {', '.join(ISA_LEVELS)}")
    if found not in ISA_LEVELS or ISA_LEVELS.index(requested) > ISA_LEVELS.index(found):
        raise ValueError(f"{ISA_VARIABLE}={requested}: this CPU supports at most {found}")
    return requested


def is_forced() -> bool:
    """True when BATCHGEN_CPU_ISA names a level (not unset or native)."""
    return os.environ.get(ISA_VARIABLE, "").strip().lower() not in ("", "native")


def march_flags(isa: str) -> tuple[str, ...]:
    """Compiler flags for the kernels at `isa`: -march=native unless a level is forced."""
    if not is_forced() or isa not in _MARCH:
        return ("-march=native",)
    return (*_MARCH[isa], "-mtune=native")


def cap_libraries(isa: str) -> None:
    """With a forced level, cap oneDNN and MKL at it too (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS,
    unless already set): each reads its variable at its first GEMM, so this must run before any."""
    if is_forced() and isa in _ONEDNN_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[isa])
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", _MKL_ISA[isa])


def has_bf16_units(isa: str) -> bool:
    """bf16 dot products in hardware (AVX-512 BF16 or AMX) at this level."""
    return isa in ("avx512_bf16", "amx")

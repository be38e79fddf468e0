"""Keep glibc malloc from handing large CPU tensors back to the kernel after every use.

glibc serves allocations above its mmap threshold (dynamic, at most 32 MiB) with a fresh mmap and
unmaps them on free, and it trims the heap top above its trim threshold. A prefill step of a few
thousand tokens allocates and frees tens of MiB per layer (the gate/up activations alone are
T x 2 x intermediate x 4 bytes), so without this every layer page-faults its activations in again
(the same reason vLLM's CPU backend asks for tcmalloc; the measured gain is in
docs/benchmarks/history/cpu-throughput.md). It is process-wide: anything else in the process (the bench's HF
peer included) runs under the same allocator settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("batchgen.engine")

# mallopt(3) parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused; 1 GiB keeps every activation of a
# max_num_batched_tokens step there while the KV pool (allocated once) is unaffected either way.
_THRESHOLD_BYTES = 1 << 30

_is_tuned = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where there is no glibc."""
    global _is_tuned
    if _is_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    is_ok = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD_BYTES))
    if is_ok:
        _is_tuned = True
        # debug: an allocator setting is no news at start-up; `--verbose` shows it
        log.debug("glibc malloc: mmap and trim thresholds raised to %d MiB", _THRESHOLD_BYTES >> 20)
    return is_ok

"""Greedy picks and log-normalizers of a step's logits on the CPU in one C pass per row (csrc/sampling.c).

torch's argmax and log_softmax are two passes over the logits, mostly on one thread, plus a clone
for the raw log-probabilities. This kernel reads each row (L2-resident after its first pass) for its
max, its sum of exp(x - max) and the first index holding the max: the token greedy decoding takes
(torch's tie rule: the first maximum) and log Z for the chosen token's log-probability. The torch
reference is kernels/reference.py's argmax_log_z_ref. Built on first use (kernels/c_library.py);
without a compiler the sampler stays in torch.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_LIBRARY = CLibrary("sampling", ("sampling.c",), {
    "argmax_log_z": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int]),
}, fallback="sampling with torch's argmax and log_softmax")


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def _run(logits: torch.Tensor, log_z: torch.Tensor | None) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1 or logits.dim() != 2:
        raise ValueError(f"expected (N, V) float32 CPU logits with contiguous rows, got {logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    argmax = torch.empty(num_rows, dtype=torch.long)
    _LIBRARY.require().argmax_log_z(logits.data_ptr(), logits.stride(0), num_rows, vocab, argmax.data_ptr(),
                                    None if log_z is None else log_z.data_ptr(), torch.get_num_threads())
    return argmax


def argmax_log_z(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (N, V) float32 on the CPU with contiguous rows. Returns (argmax (N,) int64, log Z (N,))."""
    log_z = torch.empty(logits.shape[0], dtype=torch.float32)
    return _run(logits, log_z), log_z


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax_log_z's argmax alone, without the exp pass: (N,) int64."""
    return _run(logits, None)

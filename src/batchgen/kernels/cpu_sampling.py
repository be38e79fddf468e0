"""Greedy picks, top-k candidates and log-normalizers of a step's logits on the CPU, one C pass per
row (csrc/sampling.c).

torch's argmax and log_softmax are two passes over the logits, mostly on one thread, plus a clone
for the raw log-probabilities. This kernel reads each row (L2-resident after its first pass) for its
max, its sum of exp(x - max) and the first index holding the max: the token greedy decoding takes
(torch's tie rule: the first maximum) and log Z for the chosen token's log-probability. The torch
reference is kernels/reference.py's argmax_log_z_ref. Built on first use (kernels/c_library.py);
without a compiler the sampler stays in torch.

`top_k_log_z` gives the sampler each row's k largest logits (its candidates) in the pass the greedy
pick makes anyway: torch.topk copies and partially sorts every row; this keeps a sorted list of k
and skips the 64-value chunks whose maximum does not reach the list's last entry (most of them once
the list has filled), with the tempered log Z of the row when asked. Its reference is torch.topk
(equal values: the earlier index first, a stable descending sort's order).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_LIBRARY = CLibrary("sampling", ("sampling.c",), {
    "argmax_log_z": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int]),
    "top_k_log_z": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
}, fallback="sampling with torch's argmax, topk and log_softmax")


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def _check(logits: torch.Tensor) -> None:
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1 or logits.dim() != 2:
        raise ValueError(f"expected (N, V) float32 CPU logits with contiguous rows, got {logits.dtype} {tuple(logits.shape)}")


def _run(logits: torch.Tensor, log_z: torch.Tensor | None) -> torch.Tensor:
    _check(logits)
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


def top_k_log_z(logits: torch.Tensor, k: int, inv_temperature: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits: (N, V) float32 on the CPU with contiguous rows; 1 <= k <= V. Returns each row's k largest
    values (N, k) descending, their indices (N, k) int64 and, given `inv_temperature` (N,) float32,
    log sum exp(logits * inv_temperature) per row (N,) (else None)."""
    _check(logits)
    num_rows, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    values = torch.empty(num_rows, k, dtype=torch.float32)
    ids = torch.empty(num_rows, k, dtype=torch.long)
    log_z = None
    if inv_temperature is not None:
        if inv_temperature.shape != (num_rows,) or inv_temperature.dtype != torch.float32:
            raise ValueError(f"inv_temperature must be ({num_rows},) float32, got {inv_temperature.dtype} "
                             f"{tuple(inv_temperature.shape)}")
        inv_temperature = inv_temperature.contiguous()
        log_z = torch.empty(num_rows, dtype=torch.float32)
    _LIBRARY.require().top_k_log_z(logits.data_ptr(), logits.stride(0), num_rows, vocab, k, values.data_ptr(),
                                   ids.data_ptr(), None if log_z is None else inv_temperature.data_ptr(),
                                   None if log_z is None else log_z.data_ptr(), torch.get_num_threads())
    return values, ids, log_z

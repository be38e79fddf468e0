"""Greedy picks and log-normalizers of a step's logits on the CPU in one C pass per row.

A 64-row decode step samples from (64, 49152) float32 logits; torch's argmax and log_softmax each
take 1.2-1.5 ms there on the 2-core CI machine (mostly one thread), plus a clone for the raw
log-probabilities. This kernel reads each row (192 KB, L2-resident after the first pass) for its
max, its sum of exp(x - max) and the first index holding the max: the token greedy decoding takes
(torch's tie rule: the first maximum) and log Z for the chosen token's log-probability.
Built on first use (kernels/c_library.py); without a compiler the sampler stays in torch.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_SOURCE = r"""
#include <math.h>

#define CHUNK 64
#define PARALLEL_MIN 65536

/* argmax[r]: first index of row r's maximum; log_z[r] = log(sum(exp(x[r]))), skipped (the exp
   pass is most of the cost) when log_z is NULL. */
void argmax_log_z(const float *x, long row_stride, int num_rows, int vocab, long *argmax, float *log_z,
                  int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if ((long)num_rows * vocab >= PARALLEL_MIN)
    for (int r = 0; r < num_rows; r++) {
        const float *row = x + r * row_stride;
        float m = -INFINITY;
        for (int v = 0; v < vocab; v++) m = row[v] > m ? row[v] : m;
        if (log_z) {
            float sum = 0.f;
            for (int v = 0; v < vocab; v++) sum += expf(row[v] - m);
            log_z[r] = m + logf(sum);
        }
        long first = 0;
        for (int c = 0; c < vocab; c += CHUNK) {  /* the first chunk holding the max, then its index */
            const int end = c + CHUNK < vocab ? c + CHUNK : vocab;
            float chunk_max = -INFINITY;
            for (int v = c; v < end; v++) chunk_max = row[v] > chunk_max ? row[v] : chunk_max;
            if (chunk_max == m) {
                int v = c;
                while (v < end - 1 && row[v] != m) v++;
                first = v;
                break;
            }
        }
        argmax[r] = first;
    }
}
"""

_LIBRARY = CLibrary("sampling", _SOURCE, {
    "argmax_log_z": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int]),
}, fallback="sampling with torch's argmax and log_softmax")


def is_available() -> bool:
    return _LIBRARY.load() is not None


def _run(logits: torch.Tensor, log_z: torch.Tensor | None) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1 or logits.dim() != 2:
        raise ValueError(f"expected (N, V) float32 CPU logits with contiguous rows, got {logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    argmax = torch.empty(num_rows, dtype=torch.long)
    _LIBRARY.load().argmax_log_z(logits.data_ptr(), logits.stride(0), num_rows, vocab, argmax.data_ptr(),
                                 None if log_z is None else log_z.data_ptr(), torch.get_num_threads())
    return argmax


def argmax_log_z(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (N, V) float32 on the CPU with contiguous rows. Returns (argmax (N,) int64, log Z (N,))."""
    log_z = torch.empty(logits.shape[0], dtype=torch.float32)
    return _run(logits, log_z), log_z


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax_log_z's argmax alone, without the exp pass: (N,) int64."""
    return _run(logits, None)

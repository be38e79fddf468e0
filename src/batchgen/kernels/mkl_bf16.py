"""bf16 x bf16 -> float32 GEMM through MKL's `cblas_gemm_bf16bf16f32`, found in torch's own CPU library.

torch's x86 wheels link MKL into libtorch_cpu.so and export its CBLAS symbols. MKL's bf16 GEMM
dispatches on the CPU at run time (AVX-512 BF16 where present, AVX2 / AVX-512 kernels that widen
the operands while packing elsewhere) and accumulates in float32, writing float32: the widening of
a bf16 weight happens inside the GEMM's own packing, with no float32 copy of the weight in memory.
`MKL_ENABLE_INSTRUCTIONS=AVX2` caps it like `ONEDNN_MAX_CPU_ISA` caps oneDNN.

Where the symbol is missing (a torch build without MKL, other architectures) `is_available()` is
False and callers widen the weight themselves. Imports only torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

log = logging.getLogger("batchgen.kernels")

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enums


@functools.cache
def _gemm():
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError) as exc:
        log.info("MKL's bf16 GEMM is not in this torch build (%s); bf16 weights are widened before the GEMM", exc)
        return None
    fn.restype = None
    fn.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    return fn


def is_available() -> bool:
    """True when torch's CPU library exports MKL's bf16 GEMM."""
    return _gemm() is not None


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bfloat16 times weight (N, K) bfloat16 transposed -> (M, N) float32, accumulated in
    float32. Both contiguous on the CPU; `out`, when given, a contiguous (M, N) float32 to write."""
    fn = _gemm()
    if fn is None:
        raise RuntimeError("MKL's cblas_gemm_bf16bf16f32 is not available in this torch build")
    num_rows, k = x.shape
    n = weight.shape[0]
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.shape[1] != k:
        raise ValueError(f"need x (M, K) and weight (N, K) in bfloat16, got {x.dtype} {tuple(x.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if not (x.is_contiguous() and weight.is_contiguous()) or x.device.type != "cpu":
        raise ValueError("x and weight must be contiguous CPU tensors")
    if out is None:
        out = torch.empty(num_rows, n, dtype=torch.float32)
    elif out.shape != (num_rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({num_rows}, {n}) float32 tensor")
    if num_rows:
        fn(_ROW_MAJOR, _NO_TRANS, _TRANS, num_rows, n, k, 1.0, x.data_ptr(), k, weight.data_ptr(), k, 0.0,
           out.data_ptr(), n)
    return out

"""The model's elementwise passes for the CPU in float32 or bfloat16, fused in C (csrc/elementwise.c):
one pass and one call each. bfloat16 rows are widened to float32 in the kernel, computed there and
rounded to nearest even where the eager bfloat16 ops round.

In a decode step each of these ops works on a few hundred KB, so torch's per-op dispatch and its
multi-kernel compositions (RMSNorm is pow, mean, add, rsqrt and two muls; rotary a roll, a mul and
an addcmul) cost more than the arithmetic. Here each is one loop over rows: residual add + RMSNorm,
SiLU(gate) * up, and rotary applied in place on the q/k block. Rows are split over torch's OpenMP
threads from 4096 elements on (a 64 x 576 decode norm included: torch's worker is still spinning
after the GEMM before it, so waking it costs less than it saves); tinier ops run on the calling
thread.

Results equal the torch references (kernels/reference.py, the engine's eager ops) to within a few
ulp (summation order, libmvec's expf); tests/kernels/test_cpu_elementwise.py checks them against
those and against HF's own modules. Built on first use (kernels/c_library.py); without a compiler
the model keeps its torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_LIBRARY = CLibrary("elementwise", ("elementwise.c",), {
    "add_rms_norm": (None, [_P, _L, _P, _L, _P, _P, _L, _I, _I, _F, _I, _I]),
    "silu_mul": (None, [_P, _L, _P, _L, _I, _I, _I]),
    "rotary": (None, [_P, _L, _P, _P, _L, _I, _I, _I, _I]),
    "add_rms_norm_bf16": (_I, [_P, _L, _P, _L, _P, _P, _L, _I, _I, _F, _I, _I]),
    "silu_mul_bf16": (None, [_P, _L, _P, _L, _I, _I, _I]),
    "rotary_bf16": (None, [_P, _L, _P, _P, _L, _I, _I, _I, _I]),
}, fallback="using torch's elementwise ops", headers=("bf16.h",))
DTYPES = (torch.float32, torch.bfloat16)


def is_available() -> bool:
    """True once the kernels are built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def _check_rows(*tensors: torch.Tensor) -> bool:
    """All float32 or all bfloat16 CPU tensors with contiguous rows; returns True for bfloat16."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype not in DTYPES or t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"expected float32 or bfloat16 CPU tensors of one dtype with contiguous rows, "
                             f"got {t.dtype} {tuple(t.stride())} beside {dtype}")
    return dtype == torch.bfloat16


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                  add: int, is_bf16: bool) -> None:
    lib = _LIBRARY.require()
    args = (x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0) if add else 0, weight.data_ptr(),
            out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps, add, torch.get_num_threads())
    if not is_bf16:
        lib.add_rms_norm(*args)
    elif lib.add_rms_norm_bf16(*args) != 0:
        raise MemoryError("CPU add_rms_norm kernel: out of memory for its row buffers")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, hidden) with contiguous rows. Returns weight * x / rms(x), a new (T, hidden)."""
    is_bf16 = _check_rows(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype)
    _add_rms_norm(x, x, weight, out, eps, 0, is_bf16)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is written into `residual`, which is returned."""
    is_bf16 = _check_rows(x, residual, weight)
    out = torch.empty(x.shape, dtype=x.dtype)
    _add_rms_norm(x, residual, weight, out, eps, 1, is_bf16)
    return out, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * inter) with contiguous rows. Returns silu(gate) * up, (T, inter)."""
    is_bf16 = _check_rows(gate_up)
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype)
    kernel = _LIBRARY.require().silu_mul_bf16 if is_bf16 else _LIBRARY.require().silu_mul
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), num_rows, inter,
           torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """In place on x: (T, heads, D) with contiguous heads (rows may be strided, e.g. the q/k block
    of a fused qkv output); cos, signed_sin: (T, 1, D) contiguous. Returns x."""
    is_bf16 = _check_rows(x, cos, signed_sin)
    num_rows, num_heads, head_dim = x.shape
    if x.stride(1) != head_dim or cos.stride(0) != head_dim or signed_sin.stride(0) != head_dim:
        raise ValueError("rotary needs contiguous heads and (T, 1, D) contiguous tables")
    kernel = _LIBRARY.require().rotary_bf16 if is_bf16 else _LIBRARY.require().rotary
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), head_dim, num_rows, num_heads,
           head_dim, torch.get_num_threads())
    return x

"""Weight-only integer matmuls off the CPU: the Triton W4A16/W8A16 GEMM, or dequantize-then-GEMM.

The Triton kernel is probed once per process on the device (compiles and matches its reference);
where it cannot run, the dequantizing kernel does (it needs only torch ops).
"""

from __future__ import annotations

import functools
import logging

import torch

from batchgen.engine.quant.int_formats.int_weight import IntWeight
from batchgen.engine.quant.int_matmul_cpu import DequantKernel

log = logging.getLogger("batchgen.engine")


class TritonIntKernel:
    name = "triton"

    @staticmethod
    def can_run(w: IntWeight) -> bool:
        # Float minima (GGUF Q4_1) fold into a float zero, (q - (z - m / s)) * s = (q - z) s + m, except in
        # groups whose scale is 0 but minimum is not (all weights equal m): those use the dequant kernel.
        return w.bits in (4, 8) and (w.offsets is None or not bool(((w.scales == 0) & (w.offsets != 0)).any()))

    def __init__(self, w: IntWeight, device: torch.device, shared: dict | None = None):
        from batchgen.kernels.triton_int_matmul import pack_codes

        self.bits, self.group_size = w.bits, w.group_size
        self.codes = pack_codes(w.qweight, w.bits).to(device)  # (N, K) or (N, ceil(K / 2)) uint8
        # Scales as stored (float16 / bfloat16 checkpoints, float32 when quantized for a float32 model);
        # zeros in the scales' width: 0..256 is exact in float16 and bfloat16. None: symmetric.
        side = w.scales.dtype if w.scales.dtype in (torch.float16, torch.bfloat16) else torch.float32
        self.scales = w.scales.to(side).contiguous().to(device)  # (N, G)
        if w.offsets is not None:  # float zeros in float32: m / s needs more than 16 bits
            safe = torch.where(w.scales == 0, torch.ones_like(w.scales), w.scales).float()
            zeros = w.zero_points().float() - w.offsets.float() / safe
            self.scales = self.scales.float()
            self.zeros = zeros.contiguous().to(device)  # (N, G) float32
        else:
            self.zeros = None if w.zeros is None else w.zeros.to(side).contiguous().to(device)  # (N, G)
        self.g_idx = None if w.g_idx is None else w.g_idx.to(device)  # (K,) int32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from batchgen.kernels.triton_int_matmul import int_weight_matmul

        return int_weight_matmul(x, self.codes, self.scales, self.zeros, self.bits, self.group_size, self.g_idx)

    def num_bytes(self) -> int:
        extra = 0 if self.g_idx is None else self.g_idx.numel() * 4
        zeros = 0 if self.zeros is None else self.zeros.numel() * self.zeros.element_size()
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + zeros + extra


class DeviceDequantKernel(DequantKernel):
    """DequantKernel with its tensors on the device; activations in any float dtype."""

    def __init__(self, w: IntWeight, device: torch.device, shared: dict | None = None):
        super().__init__(w, shared)
        self.codes, self.scale = self.codes.to(device), self.scale.to(device)
        self.neg_zs = None if self.neg_zs is None else self.neg_zs.to(device)
        self.groups = None if self.groups is None else self.groups.to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x.float()).to(x.dtype)


def make_cuda_plan(weight: IntWeight, device: torch.device, kernel: str | None = None) -> list:
    """[(None, kernel)]: one kernel for every row count (the Triton kernel picks its tiles by M itself)."""
    use_triton = kernel == "triton" or (kernel is None and TritonIntKernel.can_run(weight) and can_use_triton(device))
    if kernel not in (None, "triton", "dequant"):
        raise ValueError(f"kernel {kernel!r} does not run on {device}")
    if use_triton:
        return [(None, TritonIntKernel(weight, device))]
    return [(None, DeviceDequantKernel(weight, device))]


@functools.lru_cache(maxsize=None)
def can_use_triton(device: torch.device) -> bool:
    """Whether the Triton kernel compiles and matches its reference here (CUDA only)."""
    if device.type != "cuda":
        return False
    try:
        from batchgen.engine.quant.int_formats.rtn import quantize_int4_groups
        from batchgen.kernels.reference import int_weight_matmul_ref

        gen = torch.Generator().manual_seed(0)
        w = quantize_int4_groups(torch.randn(96, 200, generator=gen), group_size=64)
        x = torch.randn(5, 200, generator=gen).to(device, torch.float16)
        out = TritonIntKernel(w, device)(x).float()
        ref = int_weight_matmul_ref(x, w.qweight.to(device), w.scales.to(device), w.zero_points().to(device),
                                    w.group_size).float()
        is_ok = bool(((out - ref).norm() / ref.norm()) < 1e-2)
    except Exception as exc:
        log.warning("int weights: Triton kernel unavailable (%s: %s); using dequantize-then-matmul",
                    type(exc).__name__, exc)
        return False
    if not is_ok:
        log.warning("int weights: Triton kernel disagrees with its reference here; using dequantize-then-matmul")
    return is_ok

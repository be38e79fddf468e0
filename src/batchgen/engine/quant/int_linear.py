"""IntLinear: a drop-in for nn.Linear whose weight is an IntWeight (int8 / int4 codes, scales, zeros).

The matmul is chosen once, at construction, from the device and the weight's layout, as a short
plan of (largest row count, kernel) pairs; forward only looks up the row count in it:
- CPU: the kernels of int_matmul_cpu. The plan is the measured winner per row count on float32
  activations (docs/benchmarks/history/quantization.md, "Integer weights on the CPU"; bench/int_matmul.py
  measures it); kernels that cannot hold a layout (torch's int4 kernel needs N % 16 == 0 and groups of 32-256)
  drop out of the plan.
- CUDA: the Triton W4A16/W8A16 GEMM (batchgen.kernels.triton_int_matmul) when it can hold the weight,
  else dequantize-then-GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.quant.hadamard import block_hadamard, can_rotate, hadamard_matrix
from batchgen.engine.quant.int_formats.int_weight import IntWeight
from batchgen.engine.quant.int_matmul_cpu import CPU_KERNELS, DequantKernel, Int8PackKernel

# Per bit width, the CPU kernel to use up to a number of rows, best first; measured on float32
# activations (docs/benchmarks/history/quantization.md). A kernel that cannot hold the weight is skipped.
# int8: torch's kernel for one row, dequant from two (both read the same int8 codes: one copy);
# int4: dequant at every size (torch's int4 kernel wins at M = 1 but keeps a second, opaque copy).
CPU_PLAN = {
    8: [(1, Int8PackKernel), (None, DequantKernel)],
    4: [(None, DequantKernel)],
}


class IntLinear(nn.Module):
    """y = rotate(x * pre_quant_scale) @ dequantize(weight)^T + bias with integer weights kept as integers.

    pre_quant_scale (K,), in the activations' dtype, or None: the per-input-channel factor of an
    activation-aware weight (int_calibration: activation_aware) whose codes hold W / pre_quant_scale.
    hadamard_size: 0, or the block size of the Hadamard rotation R (quant/hadamard.py) the codes were
    taken in (they hold (W / pre_quant_scale) R; activation-aware int4); rotate(x) = x R.
    """

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None = None, *,
                 device: torch.device | str = "cpu", kernel: str | None = None,
                 pre_quant_scale: torch.Tensor | None = None, hadamard_size: int = 0):
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        self.is_symmetric, self.is_act_order = weight.is_symmetric, weight.is_act_order
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        self.pre_quant_scale: torch.Tensor | None
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None
                             else pre_quant_scale.detach().reshape(-1).to(device), persistent=False)
        self.hadamard_size = hadamard_size
        if hadamard_size and not can_rotate(self.in_features, hadamard_size):
            raise ValueError(f"a Hadamard rotation of {hadamard_size} columns needs K divisible by it, not {self.in_features}")
        device = torch.device(device)
        self.plan = _make_plan(weight, device, kernel)  # [(max rows or None, kernel object)]
        # The kernels' tensors as (non-persistent) buffers: the model's storage count sees them, and
        # tensors two kernels share count once.
        for i, (_, k) in enumerate(self.plan):
            for name, value in vars(k).items():
                if isinstance(value, torch.Tensor):
                    self.register_buffer(f"plan{i}_{name}", value, persistent=False)
        if hadamard_size:  # built now, not inside a CUDA graph capture on the first forward
            hadamard_matrix(hadamard_size, torch.float32 if pre_quant_scale is None else pre_quant_scale.dtype,
                            str(next(self.buffers()).device))

    @property
    def kernel_names(self) -> list[str]:
        return [k.name for _, k in self.plan]

    def num_weight_bytes(self) -> int:
        """Bytes the kernels hold for the weight (codes, scales, zeros, permutations), bias excluded;
        a tensor two kernels share counts once."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.buffers()}
        return sum(storages.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale
        if self.hadamard_size:
            x2 = block_hadamard(x2, self.hadamard_size)
        y = self._kernel_for(x2.shape[0])(x2)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _kernel_for(self, num_rows: int):
        return next(k for max_rows, k in self.plan if max_rows is None or num_rows <= max_rows)

    @torch.no_grad()
    def dequantized_weight(self, chunk_rows: int = 1024) -> torch.Tensor:
        """(N, K) float32: the weight this layer multiplies by, read back through its own kernels
        applied to rows of the identity (exact in float32: each output is one weight times 1 plus
        zeros), bias left out, rotated back (deq R^T: x R deq^T = x (deq R^T)^T) and times pre_quant_scale
        per column when there are those. For float references of a quantized model (the quality bench)."""
        device = next(self.buffers()).device
        columns = []
        for lo in range(0, self.in_features, chunk_rows):
            hi = min(self.in_features, lo + chunk_rows)
            eye = torch.zeros(hi - lo, self.in_features, dtype=torch.float32, device=device)  # (rows, K)
            eye[:, lo:hi] = torch.eye(hi - lo, dtype=torch.float32, device=device)
            columns.append(self._kernel_for(hi - lo)(eye).float())  # (rows, N): W^T's rows lo..hi
        weight = torch.cat(columns).t().contiguous()
        if self.hadamard_size:
            weight = block_hadamard(weight, self.hadamard_size)  # R is symmetric: R^T = R
        return weight if self.pre_quant_scale is None else weight * self.pre_quant_scale.float()

    def extra_repr(self) -> str:
        layout = "symmetric" if self.is_symmetric else "zero points"
        order = ", act-order" if self.is_act_order else ""
        order += ", pre-quant scale" if self.pre_quant_scale is not None else ""
        order += f", Hadamard {self.hadamard_size}" if self.hadamard_size else ""
        plan = ", ".join(f"{k.name}{'' if m is None else f' (M <= {m})'}" for m, k in self.plan)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int{self.bits} group {self.group_size}, {layout}{order}, kernels: {plan}")


def _make_plan(weight: IntWeight, device: torch.device, kernel: str | None) -> list:
    shared: dict = {}  # tensors the kernels of one plan share (the int8 codes)
    if device.type == "cpu":
        candidates = {k.name: k for k in CPU_KERNELS.values() if weight.bits in k.supported_bits}
        if kernel is not None:  # tests and the benchmark pin one kernel
            if kernel not in candidates or not candidates[kernel].can_run(weight):
                raise ValueError(f"kernel {kernel!r} cannot run this int{weight.bits} weight on the CPU")
            return [(None, candidates[kernel](weight, shared))]
        plan = [(rows, k(weight, shared)) for rows, k in CPU_PLAN[weight.bits] if k.can_run(weight)]
        return plan
    from batchgen.engine.quant.int_matmul_cuda import make_cuda_plan

    return make_cuda_plan(weight, device, kernel)

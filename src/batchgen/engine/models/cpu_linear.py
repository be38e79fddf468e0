"""float32 and bfloat16 linear layers on the CPU through oneDNN with prepacked weights (bfloat16 where
the CPU has BF16 units: oneDNN's bf16 GEMMs run on them).

oneDNN with a prepacked (blocked) weight runs the model's GEMMs faster than the default MKL path
(docs/benchmarks/history/cpu-throughput.md, change 4), and its rows do not depend on the batch size (batch
invariance holds). The packed weight replaces the plain one (no second copy); `weight` unpacks on demand for
code that wants to read it. Whether packing runs is decided at load (engine/capabilities.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("batchgen.engine")


class PackedLinear(nn.Linear):
    """A drop-in nn.Linear whose weight lives in oneDNN's blocked layout (CPU, float32 or bfloat16)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        # A bias that requires grad sends oneDNN's linear through another path than the fused bias
        # add (its results differ in the last bit); inference never needs the grad.
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # (out, in), dense
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # Opaque oneDNN tensors cannot be deep-copied; repack from the dense weight instead.
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return PackedLinear(plain)


class PackedSiluMulLinear(nn.Linear):
    """An MLP's fused gate_up_proj (out_features = 2 x intermediate) that also applies the SiLU(gate) * up
    after it: two oneDNN GEMMs on the packed halves, SiLU in the gate GEMM's epilogue and the
    multiply in the up GEMM's, so the (T, 2 x intermediate) product never goes through memory.
    forward returns (T, intermediate); GatedMLP.forward sees `applies_silu_mul` and skips its own
    (docs/benchmarks/history/cpu-throughput.md, change 17).
    """

    applies_silu_mul = True

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        gate, up = linear.weight.detach().chunk(2, dim=0)
        self.register_buffer("packed_gate", torch.ops.mkldnn._reorder_linear_weight(gate.contiguous(), None))
        self.register_buffer("packed_up", torch.ops.mkldnn._reorder_linear_weight(up.contiguous(), None))
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:  # (out, in), dense: gate rows then up rows
        return torch.cat([self.packed_gate.to_dense(), self.packed_up.to_dense()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.ops.mkldnn._linear_pointwise(x, self.packed_gate, None, "swish", [], "")  # silu(x W_gate^T)
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.packed_up, None, "mul")  # (x W_up^T) * gate

    def __deepcopy__(self, memo: dict) -> PackedSiluMulLinear:
        plain = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(self.weight, requires_grad=False)
        return PackedSiluMulLinear(plain)


class OneDNNLinear(nn.Linear):
    """nn.Linear (same parameters, e.g. a tied lm_head sharing the embedding) computed by oneDNN on
    the dense weight: no packed copy, and still faster than MKL for a tied lm_head
    (docs/benchmarks/history/cpu-throughput.md, change 7)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# Probe tolerances: float32 must match F.linear to rounding; bfloat16 outputs are rounded to 8 bits.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is available in `dtype` (float32, or bfloat16 where oneDNN can run bf16 GEMMs
    here) and gives F.linear's results on a small probe."""
    if device.type != "cpu" or dtype not in _PROBE_TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        probe = nn.Linear(24, 40, dtype=dtype)
        x = torch.randn(5, 24, dtype=dtype)
        expected = probe(x).float()
        got = PackedLinear(probe)(x).float()
        tol = _PROBE_TOLERANCE[dtype]
        return bool(torch.allclose(got, expected, rtol=tol, atol=tol))
    except (RuntimeError, AttributeError) as exc:  # op missing in this torch build
        log.info("oneDNN packed linear unavailable (%s); using torch's default", exc)
        return False


def can_fuse_silu_mul(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's swish and binary-mul epilogues are there and give SiLU(gate) * up on a small probe."""
    try:
        probe = nn.Linear(24, 80, bias=False, dtype=dtype)
        x = torch.randn(5, 24, dtype=dtype)
        gate, up = (x.float() @ probe.weight.float().t()).chunk(2, dim=-1)
        got = PackedSiluMulLinear(probe)(x).float()
        tol = 4 * _PROBE_TOLERANCE[dtype]  # bfloat16: gate, SiLU and the product each rounded
        return bool(torch.allclose(got, torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol))
    except (RuntimeError, AttributeError) as exc:  # post-ops missing in this torch build
        log.info("oneDNN SiLU*up epilogues unavailable (%s); the MLP multiplies separately", exc)
        return False


def pack_linears(model: nn.Module, can_fuse: bool) -> int:
    """Swap every plain nn.Linear for a PackedLinear (an MLP's bias-free gate_up_proj for a
    PackedSiluMulLinear when `can_fuse`: oneDNN's epilogues work here, see can_fuse_silu_mul); a
    tied lm_head keeps the embedding's dense weight (packing it would copy it) and runs through
    oneDNN unpacked. Returns how many layers it swapped."""
    tied = getattr(model, "lm_head", None) if getattr(getattr(model, "cfg", None), "tie_word_embeddings", False) else None
    # The epilogue is SiLU's: a GeGLU model (Gemma) keeps its own activation.
    can_fuse = can_fuse and getattr(getattr(model, "cfg", None), "hidden_act", "silu") == "silu"
    num_packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child is tied:
                packed = OneDNNLinear(child)
            elif name == "gate_up_proj" and child.bias is None and can_fuse:
                packed = PackedSiluMulLinear(child)
            else:
                packed = PackedLinear(child)
            setattr(parent, name, packed)
            num_packed += 1
    for module in list(model.modules()):  # MoE experts (layers/moe.py) hold (E, ...) tensors, not nn.Linear
        if hasattr(module, "pack_for_onednn"):
            num_packed += module.pack_for_onednn(can_fuse)
    return num_packed

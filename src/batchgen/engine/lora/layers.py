"""LoRALinear: a targeted projection (qkv_proj, o_proj, gate_up_proj, down_proj) with the step's
adapters added to its output, and the step's token -> adapter-slot mapping it reads.

The base layer runs as it would without adapters (whatever it is: oneDNN-packed, bfloat16, FP8, integer
or GGUF blocks); then, per adapter segment of the step (the tokens of one slot), the shrink
`x_seg @ A[slot]` (n, R) and the expand `@ B[slot]` (R, out), scale folded into B, are added to those
tokens' rows. Base tokens' rows are left as the base layer wrote them. On CUDA the two products run as
Triton SGMV kernels over all segments at once (kernels/triton_lora.py); elsewhere as one pair of
matmuls per segment (`add_lora_torch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRAStepMapping:
    """Which of a step's tokens run which adapter slot.

    `segments`: (slot, start, end) into `token_order`, one per slot present, in slot order;
    `token_order` (T',) int32 on the device: the flat-batch rows of the tokens that run an adapter,
    grouped by slot (base tokens are in no segment). `rows[i]`: segment i's rows for indexing, a slice
    where they are one contiguous run of the flat batch (no gather), else a long index tensor.
    `seg_starts` (S + 1,), `seg_slots` (S,) int32 on the device, for the Triton kernels."""

    segments: list[tuple[int, int, int]]
    token_order: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    rows: list[slice | torch.Tensor] = field(default_factory=list)
    max_segment_len: int = 0


class LoRAStepState:
    """Shared by every LoRALinear of a model: the mapping of the step being run (None: a base-only
    step, and while CUDA graphs are captured), set by the model runner right before the forward."""

    def __init__(self, use_triton: bool = False):
        self.mapping: LoRAStepMapping | None = None
        self.use_triton = use_triton


class LoRALinear(nn.Module):
    """`base` plus the adapters of the step's slots. Slot weights: `lora_a` (S, in, R_max) and `lora_b`
    (S, R_max, out) in the activations' dtype; `slot_ranks[s]` (host) / `slot_ranks_t` (device): the
    columns of slot s in use (0: its adapter does not target this module)."""

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, state: LoRAStepState,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.state = state
        self.register_buffer("lora_a", torch.zeros(num_slots, self.in_features, max_rank, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, max_rank, self.out_features, dtype=dtype,
                                                   device=device))
        self.slot_ranks = [0] * num_slots
        self.register_buffer("slot_ranks_t", torch.zeros(num_slots, dtype=torch.int32, device=device))

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's (out, in) weight (code that reads a linear's weight sees through the wrapper)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    @torch.no_grad()
    def install(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (A (in, R), B (R, out)) for this module into `slot` (None: it targets no part
        of this module)."""
        if weights is None:
            rank = 0
        else:
            a, b = weights
            rank = a.shape[1]
            self.lora_a[slot, :, :rank].copy_(a)
            self.lora_b[slot, :rank].copy_(b)
        self.slot_ranks[slot] = rank
        self.slot_ranks_t[slot] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (T, out)
        mapping = self.state.mapping
        if mapping is None:
            return out
        if self.state.use_triton:
            from batchgen.kernels.triton_lora import sgmv_expand, sgmv_shrink

            shrunk = sgmv_shrink(x, self.lora_a, mapping.token_order, mapping.seg_starts, mapping.seg_slots,
                                 self.slot_ranks_t, mapping.max_segment_len)  # (T', R_max) float32
            sgmv_expand(shrunk, self.lora_b, out, mapping.token_order, mapping.seg_starts, mapping.seg_slots,
                        self.slot_ranks_t, mapping.max_segment_len)
            return out
        return add_lora_torch(x, out, self.lora_a, self.lora_b, mapping, self.slot_ranks)


class LoRASiluMulLinear(LoRALinear):
    """An MLP's gate_up_proj whose base applies SiLU(gate) * up in its GEMMs' epilogues (oneDNN,
    models/cpu_linear.PackedSiluMulLinear; `applies_silu_mul`, so the MLP skips its own). A step without
    adapter tokens runs that fused layer (`fused`), as a base engine does; a step with some runs `base`, a
    plain packed copy of the same weight (one GEMM: the fused layer's two halves without their epilogues
    took twice as long at batch 64 here), adds the deltas to gate and up before the activation, then applies
    SiLU * up with the model's kernel (`silu_mul`). The price is a second packed copy of gate_up's weight."""

    applies_silu_mul = True

    def __init__(self, fused: nn.Module, num_slots: int, max_rank: int, state: LoRAStepState, dtype: torch.dtype,
                 device: torch.device, silu_mul):
        from batchgen.engine.models.cpu_linear import PackedLinear

        plain = nn.Linear(fused.in_features, fused.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(fused.weight, requires_grad=False)
        super().__init__(PackedLinear(plain), num_slots, max_rank, state, dtype, device)
        self.fused = fused
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if mapping is None:
            return self.fused(x)  # (T, intermediate), SiLU * up in the epilogues
        gate_up = self.base(x)  # (T, 2 x intermediate), gate columns first
        return self.silu_mul(add_lora_torch(x, gate_up, self.lora_a, self.lora_b, mapping, self.slot_ranks))


def add_lora_torch(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   mapping: LoRAStepMapping, slot_ranks: list[int]) -> torch.Tensor:
    """out[rows of segment] += (x[rows] @ A[slot][:, :r]) @ B[slot][:r] for each segment: one shrink and
    one expand per adapter present (grouped by segment, not per token). In place; returns `out`."""
    for (slot, _, _), rows in zip(mapping.segments, mapping.rows):
        rank = slot_ranks[slot]
        if rank == 0:
            continue
        shrunk = x[rows] @ lora_a[slot, :, :rank]  # (n, r)
        delta = shrunk @ lora_b[slot, :rank]  # (n, out)
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
    return out


# The engine's modules that take adapters, per decoder layer; fused ones hold several HF targets' ranks.
LORA_MODULE_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def wrap_lora_modules(model: nn.Module, num_slots: int, max_lora_rank: int, state: LoRAStepState,
                      dtype: torch.dtype, device: torch.device) -> dict[str, LoRALinear]:
    """Swap every decoder layer's targetable projection for a LoRALinear over it (in place); returns
    them by module name. A model another engine wrapped gets new wrappers over the same base layers (the
    other engine's manager puts its own back at its next adapter step). An MLP whose gate_up_proj applies
    SiLU * up inside its GEMMs (the oneDNN epilogue layer, models/cpu_linear.py) keeps it under a
    LoRASiluMulLinear: the adapter's delta must join gate and up before the activation, so only steps
    without adapter tokens run the fused epilogues."""
    from batchgen.kernels.reference import silu_mul_ref

    silu_mul = getattr(getattr(model, "ops", None), "silu_mul", silu_mul_ref)
    wrapped = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name not in LORA_MODULE_PARTS or ".layers." not in f".{name}.":
                continue
            if isinstance(child, LoRALinear):
                child = getattr(child, "fused", child.base)
            max_rank = max_lora_rank * LORA_MODULE_PARTS[child_name]
            if getattr(child, "applies_silu_mul", False):
                layer = LoRASiluMulLinear(child, num_slots, max_rank, state, dtype, device, silu_mul)
            else:
                layer = LoRALinear(child, num_slots, max_rank, state, dtype, device)
            setattr(module, child_name, layer)
            wrapped[f"{name}.{child_name}"] = layer
    return wrapped

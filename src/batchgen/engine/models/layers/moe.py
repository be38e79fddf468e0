"""The mixture-of-experts block: a router, the routed experts (SwiGLU MLPs held as (E, ...) tensors), an
optional shared expert; and the decoder block that holds it in place of the dense MLP.

The router's variants are data on ModelConfig (`moe_router`, `moe_renormalize`, `moe_router_bias`):
- softmax_topk: softmax over all experts in float32, the top k, optionally divided by their sum
  (Mixtral always; Qwen3-MoE with norm_topk_prob);
- topk_softmax: the top k logits (bias added), softmax over those k (gpt-oss).

The experts' math is kernels/fused_moe.py (tokens sorted by expert, one GEMM per expert segment and
projection, one weighted combine) on the CPU, kernels/triton_fused_moe.py on CUDA.

Checkpoints: the published per-expert tensors (`experts.N.w1/w2/w3.weight`: Mixtral;
`experts.N.gate_proj/up_proj/down_proj.weight`: Qwen-MoE, what transformers 5.x's save_pretrained
writes) and the fused (E, 2I, H) / (E, H, I) tensors transformers 5.x holds in memory
(`experts.gate_up_proj`, `experts.down_proj`) both load; see `ExpertCheckpoint`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.models.layers.decoder import DecoderLayer
from batchgen.engine.models.layers.mlp import GatedMLP
from batchgen.kernels.fused_moe import clamped_swiglu_rows, fused_moe_modules, fused_moe_torch, silu_mul_rows

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.models.config import ModelConfig

ROUTERS = ("softmax_topk", "topk_softmax")


def route(logits: torch.Tensor, top_k: int, router: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64)."""
    if router == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if router == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    raise ValueError(f"moe_router {router!r} is not one of {', '.join(ROUTERS)}")


class Router(nn.Module):
    """`gate.weight` (E, H) [and `gate.bias` (E,)]: not an nn.Linear, so no quantizer or packer swaps
    it (its logits decide which experts run; it is E x H, small)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.moe_router_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, E) logits in x's dtype."""
        return nn.functional.linear(x, self.weight, self.bias)


class Experts(nn.Module):
    """Every routed expert's weights: gate_up_proj (E, 2I, H), gate rows then up rows; down_proj (E, H, I);
    with cfg.moe_expert_bias their biases gate_up_proj_bias (E, 2I) and down_proj_bias (E, H) (gpt-oss, whose
    clamped SwiGLU cfg.moe_swiglu_limit selects). Under tensor parallelism I is the rank's slice of every
    expert's channels."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        num, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num, 2 * inter)) if cfg.moe_expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num, hidden)) if cfg.moe_expert_bias else None
        self.swiglu = None if cfg.moe_swiglu_limit is None else (cfg.moe_swiglu_alpha, cfg.moe_swiglu_limit)
        # FP8 at load (quantize_fp8): (E, 2I) and (E, H) float32 scales beside E4M3 gate_up_proj / down_proj
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None

        self.packed: nn.ModuleList | None = None  # per expert (gate_up, down) oneDNN layers (pack_for_onednn)

    @property
    def is_fp8(self) -> bool:
        """Whether the weight stacks are E4M3 codes with per-(expert, channel) scales (quantize_fp8)."""
        return self.gate_up_proj_scale is not None

    @torch.no_grad()
    def quantize_fp8(self) -> tuple[int, int]:
        """gate_up_proj and down_proj to E4M3, one float32 scale per (expert, output channel) (quant/fp8_experts.py);
        biases stay. Returns (bytes before, bytes after with the scales)."""
        from batchgen.engine.quant.fp8_experts import quantize_expert_stack

        before = after = 0
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            codes, scales = quantize_expert_stack(weight)
            before += weight.numel() * weight.element_size()
            after += codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scales, requires_grad=False))
        return before, after

    def pack_for_onednn(self, can_fuse_silu_mul: bool) -> int:
        """CPU: each expert's two projections as prepacked oneDNN layers (models/cpu_linear.py; SiLU * up in
        the GEMMs' epilogues when `can_fuse_silu_mul`); the (E, ...) tensors are dropped (no second copy).
        Returns the layers made (none for biased or clamped-SwiGLU experts: the grouped torch GEMMs run
        them). Called by cpu_linear.pack_linears."""
        from batchgen.engine.models.cpu_linear import PackedLinear, PackedSiluMulLinear

        if self.gate_up_proj_bias is not None or self.swiglu is not None or self.is_fp8:
            return 0
        pairs = []
        for gate_up, down in zip(self.gate_up_proj.detach(), self.down_proj.detach()):
            up_linear = _linear(gate_up)
            pairs.append(nn.ModuleList([PackedSiluMulLinear(up_linear) if can_fuse_silu_mul else _SiluMulAfter(
                PackedLinear(up_linear)), PackedLinear(_linear(down))]))
        self.packed = nn.ModuleList(pairs)
        del self.gate_up_proj, self.down_proj
        return 2 * len(pairs)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """x (T, H), weights (T, k) float32, ids (T, k) -> (T, H)."""
        if self.packed is not None:
            return fused_moe_modules(x, [(up, down) for up, down in self.packed], weights, ids)
        if self.swiglu is None:
            activation = silu_mul_rows if x.is_cuda else ops.silu_mul
        else:
            alpha, limit = self.swiglu
            activation = lambda gate_up: clamped_swiglu_rows(gate_up, alpha, limit)  # noqa: E731
        if x.is_cuda:
            from batchgen.kernels.triton_fused_moe import fused_moe_triton

            return fused_moe_triton(x, self.gate_up_proj, self.down_proj, weights, ids, activation=activation,
                                    gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                    gate_up_scale=self.gate_up_proj_scale, down_scale=self.down_proj_scale)
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.is_fp8:  # each expert widened as its rows are projected
            from batchgen.engine.quant.fp8_experts import Fp8ExpertStack

            gate_up = Fp8ExpertStack(gate_up, self.gate_up_proj_scale, x.dtype)
            down = Fp8ExpertStack(down, self.down_proj_scale, x.dtype)
        return fused_moe_torch(x, gate_up, down, weights, ids, activation, self.gate_up_proj_bias, self.down_proj_bias)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding `weight` (out, in) as it is (no copy)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class _SiluMulAfter(nn.Module):
    """A packed gate_up projection followed by SiLU(gate) * up (where oneDNN's epilogues do not work)."""

    def __init__(self, packed: nn.Module):
        super().__init__()
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_rows(self.packed(x))


class SparseMoE(nn.Module):
    """`gate` (the router), `experts`, and with shared_expert_intermediate_size a `shared_expert` (a gated
    MLP every token runs) scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = cfg.moe_router
        self.renormalize = cfg.moe_renormalize
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size))
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """(T, H) normed -> (T, H) (partial sums under tensor parallelism, as the dense MLP's)."""
        weights, ids = route(self.gate(x), self.top_k, self.router, self.renormalize)  # (T, k) each
        out = self.experts(x, weights, ids, ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out


class MoEDecoderLayer(DecoderLayer):
    """The pre-norm block with the experts in place of the dense MLP where cfg.is_moe_layer(layer_index)
    (built on the meta device: the dense MLP made by DecoderLayer costs nothing before it is replaced)."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        if cfg.is_moe_layer(layer_index):
            self.mlp = SparseMoE(cfg)


# ---- checkpoints ----------------------------------------------------------------------------------

# layers.L.<mlp|block_sparse_moe>.experts.N.<projection>.weight (the `model.` prefix removed)
_PER_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(r"^(layers\.\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight$")
# projection -> (our parameter, part: 0 gate rows, 1 up rows, None the whole expert)
_PROJECTIONS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


class ExpertCheckpoint:
    """Places a checkpoint's expert tensors (and a shared expert's gate/up, whose width is not the dense
    MLP's) into the model's parameters and says which it has not seen. The model's load_weights passes
    every other tensor on (`others`)."""

    def __init__(self, params: dict[str, torch.Tensor], where: str, channels: tuple[int, int] | None = None):
        """`channels` (tensor parallelism): the [start, end) of every expert's channels this rank holds; a
        checkpoint's fused expert tensors arrive whole and are cut here (per-expert ones arrive cut)."""
        self.params = params
        self.where = where
        self.channels = channels
        self.loaded: set[tuple[str, int | None, int | None]] = set()

    @staticmethod
    def is_placed_here(param_name: str) -> bool:
        """Parameters this class fills (the decoder's own loading neither fills nor expects them)."""
        return ".experts." in param_name or ".shared_expert.gate_up_proj." in param_name

    def others(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in weights:
            if not self.place(hf_name.removeprefix("model."), tensor):
                yield hf_name, tensor

    def place(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one tensor into its place if it is an expert's; False: not an expert tensor."""
        if match := _PER_EXPERT.match(name):
            layer, expert, projection = match.group(1), int(match.group(2)), match.group(3)
            if projection not in _PROJECTIONS:
                raise ValueError(f"{self.where}: checkpoint tensor {name!r}: unknown expert projection {projection!r}")
            param_name, part = _PROJECTIONS[projection]
            target = f"{layer}.mlp.experts.{param_name}"
            dest = self._param(target, name)[expert]
            self._copy(_part(dest, part), tensor, name)
            self.loaded.add((target, expert, part))
            return True
        if match := _FUSED_EXPERTS.match(name):
            target = f"{match.group(1)}.mlp.experts.{match.group(2)}"
            self._copy(self._param(target, name), self._rank_channels(tensor, match.group(2)), name)
            self.loaded.add((target, None, None))
            return True
        if match := _SHARED.match(name):
            target = f"{match.group(1)}.mlp.shared_expert.gate_up_proj.weight"
            part = 0 if match.group(2) == "gate_proj" else 1
            self._copy(_part(self._param(target, name), part), tensor, name)
            self.loaded.add((target, None, part))
            return True
        return False

    def check_complete(self) -> None:
        """ValueError naming the first expert tensors the checkpoint lacked."""
        missing = []
        for target, param in self.params.items():
            if not self.is_placed_here(target):
                continue
            if (target, None, None) in self.loaded:
                continue
            if target.endswith("shared_expert.gate_up_proj.weight"):
                missing += [f"{target} part {p}" for p in (0, 1) if (target, None, p) not in self.loaded]
                continue
            parts = (0, 1) if target.endswith("gate_up_proj") else (None,)
            missing += [f"{target} expert {e}" + ("" if p is None else f" part {p}")
                        for e in range(param.shape[0]) for p in parts if (target, e, p) not in self.loaded]
        if missing:
            raise ValueError(f"{self.where}: checkpoint is missing expert tensors: {', '.join(missing[:8])}")

    def _rank_channels(self, tensor: torch.Tensor, param_name: str) -> torch.Tensor:
        """A whole fused expert tensor cut to this rank's channels: gate_up (E, 2I, H) -> its gate rows and its
        up rows; down (E, H, I) -> its columns. As it is without tensor parallelism."""
        if self.channels is None:
            return tensor
        start, end = self.channels
        if param_name == "down_proj":
            return tensor[:, :, start:end]
        inter = tensor.shape[1] // 2
        return torch.cat((tensor[:, start:end], tensor[:, inter + start:inter + end]), dim=1)

    def _param(self, target: str, name: str) -> torch.Tensor:
        if target not in self.params:
            raise ValueError(f"{self.where}: checkpoint tensor {name!r} has no place in the model "
                             f"(no experts in that layer: a dense layer, or a layer index past num_hidden_layers)")
        return self.params[target]

    def _copy(self, dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{self.where}: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))


def gpt_oss_expert_tensors(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                           down_bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's expert tensors as transformers holds them (gate_up_proj (E, H, 2I) with gate and up
    interleaved along the last dim, gate_up_proj_bias (E, 2I) likewise, down_proj (E, I, H), down_proj_bias
    (E, H)) -> the Experts module's (gate rows then up rows; weights out x in)."""
    gate_up_rows = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2)
    return {"gate_up_proj": gate_up_rows.contiguous(), "down_proj": down.transpose(1, 2).contiguous(),
            "gate_up_proj_bias": torch.cat((gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]), dim=-1),
            "down_proj_bias": down_bias.clone()}


def gpt_oss_mxfp4_expert_tensors(gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                                 gate_up_bias: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                                 down_bias: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as its checkpoints publish them (`*_blocks` / `*_scales` MXFP4, quant/mxfp4.py: the
    gate_up rows (E, 2I, H / 32, 16) interleaved gate, up, gate, ...; down (E, H, I / 32, 16); the biases as
    stored, gate_up_proj_bias interleaved) -> the Experts module's tensors in `dtype`, dequantized exactly."""
    from batchgen.engine.quant.mxfp4 import dequantize_mxfp4

    gate_up = dequantize_mxfp4(gate_up_blocks, gate_up_scales, dtype)  # (E, 2I, H), rows interleaved
    return {"gate_up_proj": torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1).contiguous(),
            "down_proj": dequantize_mxfp4(down_blocks, down_scales, dtype),
            "gate_up_proj_bias": torch.cat((gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]), dim=-1).to(dtype),
            "down_proj_bias": down_bias.to(dtype)}


def _part(dest: torch.Tensor, part: int | None) -> torch.Tensor:
    """The gate (0) or up (1) half of a gate_up tensor's rows (its first dim), or the whole (None)."""
    if part is None:
        return dest
    half = dest.shape[0] // 2
    return dest[part * half:(part + 1) * half]

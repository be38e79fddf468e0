"""The mixture-of-experts block's expert half: tokens sorted by expert, one GEMM per expert segment for
each projection, SiLU(gate) * up over all segments at once, the weighted sum back in token order.

Shapes (the engine's layout, as transformers 5.x holds experts in memory):
  x          (T, H)        the tokens
  gate_up    (E, 2I, H)    each expert's gate rows, then its up rows
  down       (E, H, I)
  weights    (T, k)        the router's weight of each chosen expert (float32)
  ids        (T, k) int64  the chosen experts

`sort_by_expert` is the token-to-expert sort every path shares (this torch path, the Triton kernel's
block padding in triton_fused_moe.py). `fused_moe_torch` is the CPU path: after one stable sort the
rows of an expert are one contiguous slice, so an expert costs two `mm` calls into preallocated
buffers (HF's block builds a mask, gathers, projects, scales and scatters per expert: ten ops),
the activation is one pass over every routed row, and the combine is one batched (1, k) x (k, H)
product per token, in a fixed order (no atomics: the same sums whatever the batch).
`fused_moe_per_expert_ref` is the plain per-expert loop the tests and the benchmark hold it to.

Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) -> (N, I): SiLU(gate) * up (the default activation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def clamped_swiglu_rows(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(N, 2I) -> (N, I): gpt-oss's SwiGLU: gate clamped above at `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (order (T*k,) int64: the flat (token, slot) indices grouped by expert, tokens in
    their order within an expert; counts (E,) int64: the rows each expert receives)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def fused_moe_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul_rows,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """(T, H) -> (T, H): sum over each token's k experts of weight x down(act(gate_up(x))).
    `activation`: (N, 2I) -> (N, I), e.g. the model's ops.silu_mul (a C kernel on the CPU).
    `gate_up_bias` (E, 2I) / `down_bias` (E, H): each expert's biases (gpt-oss), added after its GEMMs.
    `gate_up` and `down` may be any stack indexed per expert to an (N, K) tensor in x's dtype, with a
    `shape` (FP8 experts: engine/quant/fp8_experts.Fp8ExpertStack, widened one expert at a time)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    order, counts = sort_by_expert(ids, num_experts)
    rows = x.index_select(0, order // top_k)  # (T*k, H), grouped by expert
    bounds = counts.cumsum(0).tolist()  # the one host sync of the block
    starts = [0] + bounds[:-1]
    projected = torch.empty(num_tokens * top_k, gate_up.shape[1], dtype=x.dtype, device=x.device)
    for expert, (start, end) in enumerate(zip(starts, bounds)):
        if end > start:
            torch.mm(rows[start:end], gate_up[expert].t(), out=projected[start:end])
            if gate_up_bias is not None:
                projected[start:end] += gate_up_bias[expert]
    act = activation(projected)  # (T*k, I)
    out_rows = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    for expert, (start, end) in enumerate(zip(starts, bounds)):
        if end > start:
            torch.mm(act[start:end], down[expert].t(), out=out_rows[start:end])
            if down_bias is not None:
                out_rows[start:end] += down_bias[expert]
    return combine(out_rows, order, weights)


def fused_moe_modules(x: torch.Tensor, experts: Sequence[tuple[Callable, Callable]], weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """(T, H) -> (T, H) as fused_moe_torch, each expert's projections given as callables:
    `experts[e] = (up, down)` with up (n, H) -> (n, I) (the activation applied: oneDNN's SiLU and multiply
    epilogues, models/cpu_linear.py) and down (n, I) -> (n, H) (prepacked oneDNN GEMMs on the CPU)."""
    num_tokens, top_k = ids.shape
    order, counts = sort_by_expert(ids, len(experts))
    rows = x.index_select(0, order // top_k)  # (T*k, H), grouped by expert
    out_rows = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for (up, down), count in zip(experts, counts.tolist()):
        if count:
            out_rows[start:start + count] = down(up(rows[start:start + count]))
            start += count
    return combine(out_rows, order, weights)


def combine(out_rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out_rows (T*k, H) in expert order, order (T*k,), weights (T, k) -> (T, H): each token's rows back
    in slot order, summed with their router weights (float32 weights cast to the rows' dtype)."""
    num_tokens, top_k = weights.shape
    by_slot = torch.empty_like(out_rows)
    by_slot[order] = out_rows
    # (T, 1, k) @ (T, k, H) -> (T, 1, H)
    return torch.bmm(weights.to(out_rows.dtype).unsqueeze(1), by_slot.view(num_tokens, top_k, -1)).squeeze(1)


def fused_moe_per_expert_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                             ids: torch.Tensor) -> torch.Tensor:
    """The plain reference: for each expert, its tokens' rows through its two projections, scaled and
    added into the output (float32 accumulation, returned in x's dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = silu_mul_rows(x[token].float() @ gate_up[expert].float().t())
        y = h @ down[expert].float().t()
        out.index_add_(0, token, y * weights[token, slot].float().unsqueeze(1))
    return out.to(x.dtype)

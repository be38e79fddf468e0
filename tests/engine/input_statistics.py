"""Test helpers for activation-aware quantization: a layer's InputStatistics computed directly from
its inputs (independently of gather_input_statistics), and the relative output error of a weight."""

from __future__ import annotations

import torch

from batchgen.engine.quant.calibrate.activation_aware import InputStatistics


def hessian_blocks(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """(G, group, group): the diagonal blocks of x^T x / T, the last block zero-padded."""
    h = x.t() @ x / x.shape[0]
    k = h.shape[0]
    blocks = torch.zeros(-(-k // group), group, group)
    for g in range(blocks.shape[0]):
        cols = slice(g * group, min(k, (g + 1) * group))
        width = cols.stop - cols.start
        blocks[g, :width, :width] = h[cols, cols]
    return blocks


def statistics_of(x: torch.Tensor) -> InputStatistics:
    return InputStatistics(mean_abs=x.abs().mean(0), mean_square=(x * x).mean(0), hessian_blocks=hessian_blocks(x))


def output_error(w: torch.Tensor, w_eff: torch.Tensor, x: torch.Tensor) -> float:
    """||x (W_eff - W)^T|| / ||x W^T||."""
    return ((x @ (w_eff - w).t()).norm() / (x @ w.t()).norm()).item()

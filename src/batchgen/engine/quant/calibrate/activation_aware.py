"""`int_calibration: activation_aware`: int8 / int4 weights at load chosen from the layers' inputs.

Round to nearest spends the same precision on every input channel, but a few channels carry most
of the activation energy; their weight errors dominate the output error. As AWQ (Lin et al., 2023),
each linear layer gets a per-input-channel scale s = mean|x|^alpha (alpha searched on a grid) and
stores Q(W diag(s)) with the activations multiplied by p = 1/s at run time (IntLinear's
pre_quant_scale, TensorRT-LLM's name for the same vector): exact in float, while the quantization
grid now favours the loud channels. int4 then also rotates the scaled weight's columns by a block
Hadamard matrix R (quant/hadamard.py; the layer rotates its input the same way), which spreads the
outliers left in a group of 128 over its columns, and shrinks each group's range where that lowers
the output error (AWQ's clipping search). The rotation comes after the scale, not instead of it: alone
it also spreads the loud channels that the scale favours (docs/benchmarks/history/quantization.md, "Hadamard
rotation for int4", has the measured figures).

Both searches minimise the layer's output error on the calibration inputs without a forward pass:
E[(D x)^2] for D = W_eff - W. int8's scale search weighs each column by E[x_k^2] (the diagonal of
H = E[x x^T], llama.cpp's importance matrix); int4's (whose rotated errors are not independent
per column) and the clipping search use each group's own (g, g) block of H (cross-group terms left
out, as AWQ's: the full H in the scale search measured no better, at twice the load time; see
docs/benchmarks/history/quantization.md, "Activation-aware int8 / int4"). Only the diagonal and those blocks
are gathered, so a layer costs K x (2 + group) floats however large the model: one calibration pass.

The calibration inputs are the bundled text (calibration_text.txt, sampled from the bundled model
by bench/calibration_text.py: no dataset ships or downloads) run through the float model once,
the statistics gathered by forward hooks on the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from batchgen.engine.quant.hadamard import HADAMARD_SIZE, block_hadamard, can_rotate
from batchgen.engine.quant.int_formats.int_weight import IntWeight
from batchgen.engine.quant.int_formats.rtn import (
    INT4_GROUP_SIZE,
    int4_fake_quantized_groups,
    int4_from_ranges,
    int4_group_ranges,
    int8_fake_quantized,
    padded_groups,
    quantize_int8_per_channel,
)

CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
DOCUMENT_SEPARATOR = "\n\n\f"
# 8 windows of 512 tokens: more tokens measured no better (docs/benchmarks/history/quantization.md), and
# gathering the statistics is most of the load time.
NUM_CALIBRATION_TOKENS = 4096
CALIBRATION_WINDOW = 512
NUM_ALPHAS = 11  # alpha in 0, 0.1, ..., 1 (a finer grid measured no better)
CLIP_SHRINKS = tuple(1 - 0.05 * i for i in range(11))  # the share of the range kept: 100% down to 50%


class ActivationAwareWeight(NamedTuple):
    """What one layer holds: codes of rotate(W / pre_quant_scale), the scale (K,), the rotation's
    block size (0: none)."""

    weight: IntWeight
    pre_quant_scale: torch.Tensor
    hadamard_size: int


@dataclass
class InputStatistics:
    """What the searches need of one layer's inputs x (K,): E|x| and E[x^2] (K,) each, and the
    (G, group, group) diagonal blocks of H = E[x x^T] over groups of INT4_GROUP_SIZE columns
    (the last one zero-padded)."""

    mean_abs: torch.Tensor
    mean_square: torch.Tensor
    hessian_blocks: torch.Tensor


def calibration_windows(tokenizer, max_model_len: int, vocab_size: int | None = None,
                        num_tokens: int = NUM_CALIBRATION_TOKENS, window: int = CALIBRATION_WINDOW) -> list[list[int]]:
    """The bundled text's first `num_tokens` tokens, as windows of min(window, max_model_len) tokens;
    ids the model has no embedding for (>= vocab_size, a tokenizer larger than the model) left out."""
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    ids = [t for doc in text.split(DOCUMENT_SEPARATOR) for t in tokenizer.encode(doc)
           if vocab_size is None or t < vocab_size][:num_tokens]
    size = max(2, min(window, max_model_len))
    return [ids[i:i + size] for i in range(0, len(ids) - 1, size)]


@torch.no_grad()
def gather_input_statistics(model: nn.Module, layers: dict[str, nn.Module], windows: list[list[int]],
                            batch_windows: int = 8) -> dict[str, InputStatistics]:
    """Each named layer's InputStatistics over the calibration windows run through `model` (float)."""
    from batchgen.engine.quant.calibrate.sequence_runner import SequenceRunner

    sums: dict[str, list] = {name: [0.0, 0.0, 0.0] for name in layers}
    counts = dict.fromkeys(layers, 0)

    def hook(name):
        def record(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()  # (T, K)
            groups = padded_groups(x, INT4_GROUP_SIZE).transpose(0, 1)  # (G, T, g)
            for i, value in enumerate((x.abs().sum(0), (x * x).sum(0), groups.transpose(1, 2) @ groups)):
                sums[name][i] = sums[name][i] + value
            counts[name] += x.shape[0]
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        for lo in range(0, len(windows), batch_windows):
            batch = windows[lo:lo + batch_windows]
            SequenceRunner(model, len(batch), max(map(len, batch))).forward(batch, [0] * len(batch))
    finally:
        for handle in handles:
            handle.remove()
    return {n: InputStatistics(*(total / counts[n] for total in sums[n])) for n in layers}


def group_errors(delta_groups: torch.Tensor, hessian_blocks: torch.Tensor) -> torch.Tensor:
    """(N, G, g) weight errors -> (N, G) output errors d H_g d^T, H_g = hessian_blocks[g] (G, g, g)."""
    d = delta_groups.transpose(0, 1)  # (G, N, g)
    return (torch.bmm(d, hessian_blocks) * d).sum(2).t()


def output_error(delta: torch.Tensor, stats: InputStatistics, by_blocks: bool) -> float:
    """E[(D x)^2] summed over the rows of D (N, K): from H's group blocks, or its diagonal only."""
    if not by_blocks:
        return ((delta * delta).sum(0) @ stats.mean_square).item()
    return group_errors(padded_groups(delta, INT4_GROUP_SIZE), stats.hessian_blocks).sum().item()


def search_input_scale(weight: torch.Tensor, stats: InputStatistics, fake_quantize,
                       input_dtype: torch.dtype, by_blocks: bool = False) -> torch.Tensor:
    """The pre-quant scale p = 1/s (K,) in input_dtype minimising the output error (output_error) of
    D = fake_quantize(W / p) * p - W, over s = mean|x|^alpha normalised to a geometric mean range of 1.

    fake_quantize: (N, K) float32 -> (N, K) float32 dequantized. alpha = 0 (p = 1) is plain round to
    nearest, so the result is never worse than it by this measure. p is rounded to input_dtype
    before the weight is divided by it: what runs is exactly what was searched.
    """
    w = weight.float()
    activity = stats.mean_abs.float().clamp(min=1e-5)
    best_p, best_error = None, None
    for i in range(NUM_ALPHAS):
        s = activity ** (i / (NUM_ALPHAS - 1))
        p = ((s.max() * s.min()).sqrt() / s).to(input_dtype).float()  # 1/s, normalised
        error = output_error(fake_quantize(w / p) * p - w, stats, by_blocks)
        if best_error is None or error < best_error:
            best_p, best_error = p, error
    return best_p.to(input_dtype)


def clip_int4_groups(weight: torch.Tensor, hessian_blocks: torch.Tensor, group_size: int,
                     scale_dtype: torch.dtype) -> IntWeight:
    """Asymmetric int4 groups whose ranges are the round-to-nearest ones shrunk by the factor in
    CLIP_SHRINKS that gives each (row, group) the least output error d H_g d^T, with d the group's
    row error and H_g (hessian_blocks[g]) that group's block of the inputs' second moment."""
    w = weight.float()
    lo, hi = int4_group_ranges(w, group_size)  # (N, G) each
    groups = padded_groups(w, group_size)  # (N, G, g)
    best_shrink, best_error = torch.ones_like(lo), None
    for shrink in CLIP_SHRINKS:
        delta = int4_fake_quantized_groups(w, lo * shrink, hi * shrink, group_size, scale_dtype) - groups
        error = group_errors(delta, hessian_blocks)  # (N, G)
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_shrink = torch.where(better, torch.full_like(best_shrink, shrink), best_shrink)
    return int4_from_ranges(w, lo * best_shrink, hi * best_shrink, group_size, scale_dtype)


def quantize_activation_aware(weight: torch.Tensor, stats: InputStatistics, bits: int, scale_dtype: torch.dtype,
                              input_dtype: torch.dtype, hadamard_size: int = HADAMARD_SIZE) -> ActivationAwareWeight:
    """(N, K) float W -> the codes of rotate(W / p) with scales in scale_dtype, the pre_quant_scale p (K,)
    in input_dtype (the activations' dtype), and the rotation: the layer computes rotate(x * p) @ deq^T
    ~= x @ W^T. int4 rotates when K is a multiple of hadamard_size (0: never); int8 never does."""
    w = weight.detach().float()
    n, k = w.shape
    rotation = hadamard_size if bits == 4 and hadamard_size and can_rotate(k, hadamard_size) else 0

    def rotate(x):  # x R; R is its own inverse
        return block_hadamard(x, rotation) if rotation else x

    def fake_quantize(x):  # round to nearest in the rotated basis, the scale search's inner quantizer
        if bits == 8:
            return int8_fake_quantized(x, scale_dtype)
        x = rotate(x)
        lo, hi = int4_group_ranges(x, INT4_GROUP_SIZE)
        return rotate(int4_fake_quantized_groups(x, lo, hi, INT4_GROUP_SIZE, scale_dtype).reshape(n, -1)[:, :k])

    p = search_input_scale(w, stats, fake_quantize, input_dtype, by_blocks=bits == 4)  # (K,)
    scaled = rotate(w / p.float())
    if bits == 8:
        return ActivationAwareWeight(quantize_int8_per_channel(scaled, scale_dtype), p, 0)
    # The layer's codes see inputs (x * p) R: each block of H scales by p_g p_g^T (padding: p = 0) and
    # turns into R_g^T H_g R_g, R_g the rotation's (g, g) diagonal block (groups hold whole blocks).
    p_groups = padded_groups(p.float()[None, :], INT4_GROUP_SIZE)[0]  # (G, g)
    blocks = stats.hessian_blocks * p_groups[:, :, None] * p_groups[:, None, :]
    if rotation:
        r_group = block_hadamard(torch.eye(INT4_GROUP_SIZE), rotation)  # symmetric
        blocks = r_group @ blocks @ r_group
    return ActivationAwareWeight(clip_int4_groups(scaled, blocks, INT4_GROUP_SIZE, scale_dtype), p, rotation)

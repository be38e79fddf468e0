"""FP8 weights with block scales (DeepSeek-V3 and the Qwen3 FP8 checkpoints: `weight_block_size` [128, 128]):
dequantization.

The checkpoint holds `weight` float8_e4m3fn (..., N, K) and `weight_scale_inv` float32 (..., ceil(N / bn),
ceil(K / bk)): the value of element (n, k) is weight[n, k] x weight_scale_inv[n // bn, k // bk] (the name
says "inverse": the quantizer divided by it). Edge blocks may be partial.

Such a checkpoint loads dequantized (`dequantizing_fp8_blocks` on the stream of tensors, the engine's
loader; under tensor parallelism each weight is dequantized whole, then cut to the rank's slice): its
layers are held in the model dtype, or re-quantized per channel by `quantization: fp8`;
methods.declared_quantization reports no declared quantization for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., N, K) float8 weights and their (..., ceil(N / bn), ceil(K / bk)) scales -> (..., N, K) in
    `dtype` (the product formed in float32). ValueError naming the shapes that do not fit the blocks."""
    block_rows, block_cols = block_size
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"an FP8 weight of shape {tuple(weight.shape)} in blocks of {block_rows} x {block_cols} "
                         f"needs scales of shape {expected}; got {tuple(scale_inv.shape)}")
    scale = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return (weight.to(torch.float32) * scale[..., :rows, :cols]).to(dtype)


def fp8_block_size(hf_config: dict, where: str) -> tuple[int, int] | None:
    """The (rows, columns) of a block-scaled FP8 checkpoint's blocks (quantization_config quant_method fp8
    with weight_block_size); None for any other config. ValueError naming `where` for a malformed size
    or a format other than e4m3."""
    qcfg = hf_config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "fp8" or not qcfg.get("weight_block_size"):
        return None
    size = qcfg["weight_block_size"]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, got {size!r}")
    if qcfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: block-scaled FP8 format {qcfg['fmt']!r} is not supported (e4m3)")
    return size[0], size[1]


def dequantizing_fp8_blocks(weights: Iterable[tuple[str, torch.Tensor]], block_size: tuple[int, int], where: str
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-scaled FP8 checkpoint's tensors with each float8 `<layer>.weight` and its
    `<layer>.weight_scale_inv` replaced by the dequantized float32 weight (the pair meets in any order;
    the other tensors pass as they are). ValueError naming the tensors left without their pair."""
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            weight_name = name.removesuffix("_scale_inv")
            if weight_name in pending_weights:
                yield weight_name, dequantize_fp8_block(pending_weights.pop(weight_name), tensor, block_size)
            else:
                pending_scales[weight_name] = tensor
        elif name.endswith(".weight_scale"):
            raise ValueError(f"{where}: its quantization_config declares FP8 in blocks (weight_block_size), "
                             f"which hold weight_scale_inv tensors; {name} is a per-tensor or per-channel scale")
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in pending_scales:
                yield name, dequantize_fp8_block(tensor, pending_scales.pop(name), block_size)
            else:
                pending_weights[name] = tensor
        else:
            yield name, tensor
    if pending_weights or pending_scales:
        unpaired = [f"{n} (no weight_scale_inv)" for n in pending_weights] + [
            f"{n}_scale_inv (no FP8 weight)" for n in pending_scales]
        raise ValueError(f"{where}: block-scaled FP8 checkpoint tensors without their pair: {', '.join(unpaired[:6])}")

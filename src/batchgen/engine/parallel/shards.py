"""Reading only a rank's slice of each checkpoint tensor: no rank holds the whole model.

- safetensors: `get_slice` reads the slice's bytes from the file, nothing else.
- GGUF: a row slice (column-parallel layers, the vocabulary) is dequantized from the rows' own
  blocks; a column slice (row-parallel layers) from its own blocks when it starts and ends on a block
  boundary (every quantized type stores whole blocks along a row), else the tensor's rows are
  dequantized and cut, one tensor at a time (file pages are mapped, not read, until touched).
- integer weights (GPTQ, AWQ, compressed-tensors, GGUF blocks kept): codes and per-row tables slice
  by rows; a column slice must start on a group boundary and end on one (or at the row's end), since
  a group's scale and zero cover its columns on one rank. A per-channel weight (one group per row)
  slices anywhere: each rank keeps the row's scale. Anything else is refused, naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from batchgen.engine.parallel.layout import Shard, pad_rows
from batchgen.engine.quant.int_formats.int_weight import IntWeight

# (HF tensor name, whole shape) -> this rank's slice, or None: the tensor is held whole.
ShardFn = Callable[[str, tuple[int, ...]], Shard | None]


def read_safetensors(handle, name: str, shard: ShardFn | None) -> torch.Tensor:
    """The tensor `name` of an open safetensors file (safe_open), only this rank's slice of it."""
    if shard is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    spec = shard(name, tuple(view.get_shape()))
    if spec is None:
        return handle.get_tensor(name)
    part = view[spec.start:spec.end] if spec.dim == 0 else view[:, spec.start:spec.end]
    return pad_rows(part, spec.size) if spec.dim == 0 else part.contiguous()


def shard_tensors(weights: Iterable[tuple[str, torch.Tensor]], shard: ShardFn) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors (name, tensor) cut to this rank's slice of each, as read_safetensors cuts them (for
    tensors that must be read whole first: a block-scaled FP8 weight is dequantized before it is split)."""
    for name, tensor in weights:
        spec = shard(name, tuple(tensor.shape))
        if spec is None:
            yield name, tensor
            continue
        part = tensor[spec.start:spec.end] if spec.dim == 0 else tensor[:, spec.start:spec.end]
        yield name, pad_rows(part, spec.size) if spec.dim == 0 else part.contiguous()


def gguf_shard_array(tensor, spec: Shard | None) -> np.ndarray:
    """A GGUF tensor (gguf.ReaderTensor) dequantized to float32 (rows, columns), only `spec`'s slice."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    raw = tensor.data  # (rows, bytes per row) for block types; (rows, columns) for F32 / F16 / BF16
    shape = [int(d) for d in reversed(tensor.shape)]
    if spec is None:
        return np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if spec.dim == 0:
        rows = dequantize(raw[spec.start:spec.end], tensor.tensor_type)
        return np.asarray(rows, dtype=np.float32).reshape(spec.end - spec.start, *shape[1:])
    block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    if spec.start % block == 0 and spec.end % block == 0:
        if raw.dtype == np.uint8 and block > 1:  # whole blocks: their bytes only
            raw = raw[:, spec.start // block * block_bytes:spec.end // block * block_bytes]
        else:
            raw = raw[:, spec.start:spec.end]
        return np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(
            shape[0], spec.end - spec.start)
    whole = np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(shape)
    return np.ascontiguousarray(whole[:, spec.start:spec.end])


def gguf_block_bytes(raw: np.ndarray, spec: Shard | None, block: int, block_bytes: int, num_columns: int,
                     where: str) -> np.ndarray:
    """A block-quantized tensor's raw (rows, bytes per row) cut to `spec`: rows, or whole blocks of columns."""
    if spec is None:
        return raw
    if spec.dim == 0:
        return raw[spec.start:spec.end]
    check_group_boundaries(spec, block, num_columns, where, "GGUF block")
    return raw[:, spec.start // block * block_bytes:-(-spec.end // block) * block_bytes]


def check_group_boundaries(spec: Shard, group_size: int, num_columns: int, where: str, what: str = "group") -> None:
    """A column slice of grouped weights must start on a group boundary and end on one (or at the row's end)."""
    if spec.start % group_size or (spec.end % group_size and spec.end != num_columns):
        raise ValueError(
            f"{where}: this rank's input columns {spec.start}..{spec.end} cut a {what} of {group_size} "
            f"columns; with this tensor_parallel_size the row-parallel slices do not fall on {what} "
            f"boundaries (use a tensor_parallel_size whose slices are multiples of {group_size}, or "
            f"a checkpoint with smaller groups)")


def shard_int_weight(w: IntWeight, spec: Shard | None, where: str) -> IntWeight:
    """This rank's slice of an integer weight: output rows (codes and per-row tables), or input
    columns on group boundaries (per-channel weights anywhere; act-order weights keep every group's
    table and their slice of the column -> group index)."""
    if spec is None:
        return w
    if spec.dim == 0:
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[spec.start:spec.end].contiguous()

        return IntWeight(qweight=rows(w.qweight), scales=rows(w.scales), zeros=rows(w.zeros),
                         group_size=w.group_size, bits=w.bits, g_idx=w.g_idx, offsets=rows(w.offsets))
    columns = slice(spec.start, spec.end)
    qweight = w.qweight[:, columns].contiguous()
    if w.g_idx is not None:  # act-order: a column's group is looked up, not computed from its index
        return IntWeight(qweight=qweight, scales=w.scales, zeros=w.zeros, group_size=w.group_size, bits=w.bits,
                         g_idx=w.g_idx[columns].contiguous(), offsets=w.offsets)
    if w.num_groups == 1:  # one scale per output row: every rank keeps it
        return IntWeight(qweight=qweight, scales=w.scales, zeros=w.zeros, group_size=spec.end - spec.start,
                         bits=w.bits, offsets=w.offsets)
    check_group_boundaries(spec, w.group_size, w.in_features, where)
    groups = slice(spec.start // w.group_size, -(-spec.end // w.group_size))

    def group_columns(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, groups].contiguous()

    return IntWeight(qweight=qweight, scales=group_columns(w.scales), zeros=group_columns(w.zeros),
                     group_size=w.group_size, bits=w.bits, offsets=group_columns(w.offsets))

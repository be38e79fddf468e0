"""Damaged weights are an error naming the tensor, never silent NaN output.

A file whose tensor data was overwritten (a bad disk, a truncated copy patched with 0xFF, a broken
conversion) still parses: only the values are wrong. A float16 0xFFFF is NaN, so such damage shows up
as non-finite values in the float tensors, or in the scales and minima of integer blocks (a GGUF Q4_1
block's float16 d and m). Every tensor is checked as it streams in (one read of each, memory-bound:
docs/guides/cpu.md has the cost), and `batchgen validate --weights` runs the same check without
building the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# Elements checked at once: bounds the temporary a float8 tensor's widening needs (64 MB of float32).
CHUNK_ELEMENTS = 1 << 24


class NonFiniteWeightError(ValueError):
    """A weight holds NaN or infinity; the message names the file and the tensor."""


def count_non_finite(tensor: torch.Tensor) -> int:
    """How many NaN or infinite values a floating tensor holds (0 for integer tensors)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    flat = tensor.reshape(-1)
    # float8 has no sum or isfinite kernel; widening a chunk at a time keeps the check's memory bounded.
    is_narrow = tensor.element_size() == 1
    count = 0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start:start + CHUNK_ELEMENTS]
        if is_narrow:
            chunk = chunk.float()
        # A finite sum proves every value finite (a NaN or an infinity makes the sum NaN or infinite) in
        # one streaming read with no temporary; only a non-finite sum (damage, or a sum that overflowed)
        # pays for the exact count.
        if not torch.isfinite(chunk.sum(dtype=torch.float32)):
            count += chunk.numel() - int(torch.isfinite(chunk).sum())
    return count


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raise NonFiniteWeightError naming `where` (the file) and `name` when `tensor` is not all finite."""
    bad = count_non_finite(tensor)
    if bad:
        raise NonFiniteWeightError(
            f"{where}: tensor {name} holds {bad:,} non-finite value(s) (NaN or infinity) of {tensor.numel():,}; "
            f"the file is damaged (re-download or re-convert it)")


def finite_weights(weights: Iterable[tuple[str, torch.Tensor]], where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they are, each (name, tensor) checked before it is passed on."""
    for name, tensor in weights:
        check_finite(name, tensor, where)
        yield name, tensor


def check_int_weights_finite(weights: dict, where: str) -> None:
    """The float parts (scales, GGUF minima) of integer weights {layer name: IntWeight} are finite."""
    for name, weight in weights.items():
        check_finite(f"{name} scales", weight.scales, where)
        if weight.offsets is not None:
            check_finite(f"{name} minima", weight.offsets, where)

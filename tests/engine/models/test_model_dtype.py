"""The model is allocated once, in its target dtype: no float32 copy of the weights before a cast."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchgen.engine.loader.model_loader import build_empty_model
from tests.engine.step_fixtures import TINY


class AllocationLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.allocations: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and result.device.type == "cpu":
            self.allocations.append((func.overloadpacket.__name__, tuple(result.shape), result.dtype))
        return result


def test_weights_are_allocated_in_bfloat16_only():
    with AllocationLog() as log:
        model = build_empty_model(TINY, 64, None, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    embed_shape = (TINY.vocab_size, TINY.hidden_size)
    assert [dtype for _, shape, dtype in log.allocations if shape == embed_shape] == [torch.bfloat16, torch.bfloat16]
    assert not [a for a in log.allocations if a[0] == "_to_copy"]
    assert torch.get_default_dtype() == torch.float32  # restored

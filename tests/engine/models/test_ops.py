"""The model's op sets: the eager ops are the kernels' torch references and the CPU set routes to the
C kernels (tests/kernels/ checks both against HF's modules)."""

from __future__ import annotations

import torch

from batchgen.engine.models import ops
from batchgen.kernels import cpu_elementwise, reference


def test_the_eager_ops_are_the_kernels_references():
    eager = ops.eager_ops()
    assert eager.rms_norm is reference.rms_norm_ref
    assert eager.add_rms_norm is reference.add_rms_norm_ref
    assert eager.rotary is reference.rotary_ref
    assert eager.silu_mul is reference.silu_mul_ref


def test_the_cpu_set_runs_row_norms_in_c_and_per_head_norms_eager():
    torch.manual_seed(0)
    cpu = ops.cpu_kernel_ops()
    assert cpu.add_rms_norm is cpu_elementwise.add_rms_norm and cpu.silu_mul is cpu_elementwise.silu_mul
    assert cpu.rotary is cpu_elementwise.rotary
    weight = torch.randn(64)
    rows = torch.randn(5, 64)  # (T, hidden): the C kernel
    assert torch.equal(cpu.rms_norm(rows, weight, 1e-6), cpu_elementwise.rms_norm(rows, weight, 1e-6))
    heads = torch.randn(5, 3, 64)  # (T, heads, D), Qwen3's q/k norms: the eager op
    assert torch.equal(cpu.rms_norm(heads, weight, 1e-6), reference.rms_norm_ref(heads, weight, 1e-6))


def test_the_cpu_float32_model_runs_the_c_kernels(llm):
    """So that the HF parity and greedy-identity tests cover them."""
    assert llm.engine.runner.model.ops.silu_mul is cpu_elementwise.silu_mul

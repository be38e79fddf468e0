"""bfloat16 weights on a CPU without BF16 units: stored in bfloat16, multiplied in float32.

Where the CPU has no bf16 dot-product instructions (AVX2, AVX-512 without BF16), a bf16 GEMM in
oneDNN or torch either refuses or runs a slow reference path. Here the weights stay in bfloat16
(half the memory, half the bytes a decode step streams) and the activations in float32. Two ways
to multiply, by row count:
- few rows (decode steps, up to MKL_MAX_ROWS): MKL's bf16 GEMM (kernels/mkl_bf16.py), which widens
  the weight inside its own packing: the rows are rounded to bfloat16 first (the GEMM's inputs, as
  on the bf16_units path), the products accumulate in float32;
- more rows (prefill): the weight widened by a 16-bit shift into a float32 scratch shared by every
  layer of that shape (one layer's weight at a time, so it stays in cache), then oneDNN's float32
  GEMM on it: one pass over the weight per call, which a GEMM of many rows hides.

`widen_bf16_model` turns a model loaded in bfloat16 into this form in place: nn.Linear layers become
Bf16WeightLinear (same bf16 parameter, a tied lm_head still shares the embedding's), the embedding
returns float32 rows, and the norms' weights become float32 (small). The KV cache stays bfloat16:
the C kernels round into it and widen out of it.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from batchgen.kernels import mkl_bf16

# Measured crossover (docs/benchmarks/history/cpu-vs-vllm.md, "bfloat16 on the CPU"): MKL's bf16 GEMM beats
# widen + oneDNN float32 on decode-sized row counts; on prefill-sized ones the widening is hidden.
MKL_MAX_ROWS = 256
_SCRATCH = threading.local()  # per thread: (out, in) -> the float32 scratch of that shape


def _scratch(shape: torch.Size) -> torch.Tensor:
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(shape)
    if buffer is None:
        buffer = buffers[shape] = torch.empty(shape, dtype=torch.float32)
    return buffer


class Bf16WeightLinear(nn.Linear):
    """nn.Linear with a bfloat16 weight and float32 inputs and outputs (CPU): the weight is widened
    into a shared float32 scratch, then oneDNN multiplies in float32."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # bfloat16, shared (a tied lm_head keeps the embedding's)
        if linear.weight.dtype != torch.bfloat16:
            raise TypeError(f"Bf16WeightLinear takes a bfloat16 weight, got {linear.weight.dtype}")
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, in) float32 -> (T, out) float32
        if x.shape[0] <= MKL_MAX_ROWS and mkl_bf16.is_available():
            out = mkl_bf16.bf16_linear(x.to(torch.bfloat16), self.weight)
            return out if self.bias is None else out.add_(self.bias)
        weight = _scratch(self.weight.shape).copy_(self.weight)  # (out, in) float32, exact
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")


class Bf16Embedding(nn.Embedding):
    """nn.Embedding over a bfloat16 table that returns float32 rows (exact)."""

    def __init__(self, embedding: nn.Embedding):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = embedding.padding_idx, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight).float()  # (T, hidden)


def widen_bf16_model(model: nn.Module) -> int:
    """In place: a bfloat16 model's plain linears to Bf16WeightLinear, its embedding to Bf16Embedding
    and every other parameter (norm weights, biases) to float32. Returns how many linears it swapped."""
    num_swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Bf16WeightLinear(child))
                num_swapped += 1
            elif type(child) is nn.Embedding:
                setattr(parent, name, Bf16Embedding(child))
    keep = {id(m.weight) for m in model.modules() if isinstance(m, (Bf16WeightLinear, Bf16Embedding))}
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in keep and param.dtype == torch.bfloat16:
                    setattr(module, name, nn.Parameter(param.float(), requires_grad=False))
    return num_swapped

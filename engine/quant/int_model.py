"""`quantization: int8 | int4`: every linear layer of the decoder re-quantized at load (round to nearest).

int8: symmetric, one scale per output channel (W8A16); int4: asymmetric groups of 128 (W4A16).
lm_head only with `quantize_lm_head` (on tied models such as SmolLM2 a copy would add bytes, as for
FP8). Scales are float32 for a float32 model (the CPU kernels' own width) and float16 otherwise
(the GPU kernel reads 16-bit tables: 2 bytes per scale and zero).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from batchgen.engine.config import EngineConfig
from batchgen.engine.quant.int_formats import quantize_int4_groups, quantize_int8_per_channel
from batchgen.engine.quant.int_linear import IntLinear

log = logging.getLogger("batchgen.engine")

AT_LOAD_BITS = {"int8": 8, "int4": 4}


def side_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of scales (and zeros) quantized at load for a model of `model_dtype`."""
    return torch.float32 if model_dtype == torch.float32 else torch.float16


@torch.no_grad()
def quantize_model_int(model: nn.Module, config: EngineConfig, method: str) -> int:
    """Replace the decoder's nn.Linear layers (and lm_head with quantize_lm_head) by IntLinear; returns how many."""
    bits = AT_LOAD_BITS[method]
    scale_dtype = side_dtype(config.torch_dtype)
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (name == "lm_head" and not config.quantize_lm_head):
            continue
        weight = module.weight.detach().float()  # (N, K); packed oneDNN layers unpack here
        w = quantize_int8_per_channel(weight, scale_dtype) if bits == 8 else quantize_int4_groups(weight,
                                                                                                 scale_dtype=scale_dtype)
        bias = None if module.bias is None else module.bias.detach()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                IntLinear(w, bias, device=config.torch_device))
        count += 1
    log.info("%s: %d linear layers quantized at load (%s)", method, count,
             "symmetric per channel" if bits == 8 else "asymmetric, groups of 128")
    return count

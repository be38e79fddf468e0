"""`quantization: int8 | int4`: every linear layer of the decoder re-quantized at load.

int8: symmetric, one scale per output channel (W8A16); int4: asymmetric groups of 128 (W4A16).
`int_calibration` chooses the values: `activation_aware` (the default; activation_aware.py: AWQ-style
per-input-channel scales, and for int4 a block Hadamard rotation and clipped group ranges, searched
on the bundled calibration text's inputs) or `none` (round to nearest from each row's / group's own range, no data).
lm_head only with `quantize_lm_head` (on tied models such as SmolLM2 a copy would add bytes, as for
FP8). Scales are float32 for a float32 model (the CPU kernels' own width) and float16 otherwise
(the GPU kernel reads 16-bit tables: 2 bytes per scale and zero); a pre-quant scale is in the model dtype.
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


def quantizable_linears(model: nn.Module, config: EngineConfig) -> dict[str, nn.Linear]:
    """The nn.Linear layers `quantization: int8 | int4` replaces, by module name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (name != "lm_head" or config.quantize_lm_head)}


def calibration_statistics(model: nn.Module, config: EngineConfig, calibration_windows: list[list[int]]) -> dict:
    """The float model's InputStatistics for every layer activation_aware searches, by module name.

    lm_head (quantize_lm_head) is left out and stays round to nearest: the calibration forward
    computes logits for each window's last token only, too few rows to search on.
    """
    from batchgen.engine.quant.calibrate.activation_aware import gather_input_statistics

    if not calibration_windows:
        raise ValueError("int_calibration activation_aware needs calibration windows")
    decoder = {name: m for name, m in quantizable_linears(model, config).items() if name != "lm_head"}
    return gather_input_statistics(model, decoder, calibration_windows)


@torch.no_grad()
def quantize_model_int(model: nn.Module, config: EngineConfig, method: str,
                       calibration_windows: list[list[int]] | None = None, *, statistics: dict | None = None) -> int:
    """Replace the decoder's nn.Linear layers (and lm_head with quantize_lm_head) by IntLinear; returns how many.

    calibration_windows: token windows for `int_calibration: activation_aware` (activation_aware.
    calibration_windows); required then, unused with `none`. statistics: calibration_statistics
    already gathered on this model while float, instead of the windows (the quality bench quantizes
    int8 and int4 copies of one float model).
    """
    bits = AT_LOAD_BITS[method]
    scale_dtype = side_dtype(config.torch_dtype)
    layers = quantizable_linears(model, config)
    is_activation_aware = config.int_calibration == "activation_aware"
    if is_activation_aware:
        from batchgen.engine.quant.calibrate.activation_aware import quantize_activation_aware

        if statistics is None:
            statistics = calibration_statistics(model, config, calibration_windows)
    for name, module in layers.items():
        weight = module.weight.detach().float()  # (N, K); packed oneDNN layers unpack here
        pre_quant_scale, hadamard_size = None, 0
        if is_activation_aware and name in statistics:
            w, pre_quant_scale, hadamard_size = quantize_activation_aware(weight, statistics[name], bits, scale_dtype,
                                                                          config.torch_dtype)
        elif bits == 8:
            w = quantize_int8_per_channel(weight, scale_dtype)
        else:
            w = quantize_int4_groups(weight, scale_dtype=scale_dtype)
        bias = None if module.bias is None else module.bias.detach()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                IntLinear(w, bias, device=config.torch_device, pre_quant_scale=pre_quant_scale,
                          hadamard_size=hadamard_size))
    log.info("%s: %d linear layers quantized at load (%s, %s)", method, len(layers),
             "symmetric per channel" if bits == 8 else "asymmetric, groups of 128",
             "activation-aware scales" + ("" if bits == 8 else ", Hadamard rotation and clipping")
             + " on the bundled calibration text"
             if is_activation_aware else "round to nearest")
    return len(layers)

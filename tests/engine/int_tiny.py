"""Tiny random Llama checkpoints in GPTQ / AWQ / compressed-tensors layout, written by the test packers.

Each decoder linear weight is replaced by random integer codes, zeros and float16 scales
(int_packers.Quantized); the HF model gets the dequantized float weights (the reference), and the
folder gets the packed tensors plus the float embeddings, norms and lm_head, with a config.json that
declares the format as its writers do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.engine.fp8_tiny import write_tiny_llama
from tests.engine.int_packers import Quantized, pack_awq, pack_ct, pack_gptq

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# name: (quantization_config, bits, group_size, act_order, symmetric)
VARIANTS = {
    # AutoGPTQ's original format: zeros stored minus one, act-order with a shuffled g_idx per layer
    # (q/k/v differ, so the fused layer keeps its parts apart).
    "gptq-v1-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                           "checkpoint_format": "gptq"}, 4, 32, True, False),
    "gptq-v2-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": False,
                      "checkpoint_format": "gptq_v2"}, 8, 64, False, False),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            4, 32, False, False),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                "group_size": 32}}}}, 4, 32, False, False),
}


def write_int_checkpoint(root: Path, variant: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """(quantized folder, HF model holding the dequantized float weights) for one VARIANTS entry."""
    qcfg, bits, group_size, act_order, symmetric = VARIANTS[variant]
    float_dir, hf_model = write_tiny_llama(root / f"{variant}-float", seed=seed)
    folder = root / variant
    folder.mkdir(parents=True, exist_ok=True)
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    tensors: dict[str, torch.Tensor] = {}
    state = hf_model.state_dict()
    quantized_names = set()
    for layer in range(hf_model.config.num_hidden_layers):
        for i, linear in enumerate(LINEARS):
            prefix = f"model.layers.{layer}.{linear}"
            n, k = state[f"{prefix}.weight"].shape
            v1 = qcfg.get("checkpoint_format") == "gptq"
            w = Quantized(n, k, bits, group_size, seed=seed * 1000 + layer * 10 + i, act_order=act_order,
                          zero_range=(1, (1 << bits) - 1) if v1 else None, symmetric=symmetric)
            if bits == 8:  # keep 8-bit weights at the 4-bit ones' size: (q - z) spans 16x more steps
                w.s = (w.s.astype(np.float32) / 16).astype(np.float16)
            with torch.no_grad():
                hf_model.get_submodule(prefix).weight.copy_(w.float_weight())
            tensors.update({f"{prefix}.{name}": t for name, t in _pack(variant, w).items()})
            quantized_names.add(f"{prefix}.weight")
    for name, t in hf_model.state_dict().items():
        if name not in quantized_names:
            tensors[name] = t.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(config))
    return folder, hf_model


def _pack(variant: str, w: Quantized) -> dict[str, torch.Tensor]:
    if variant.startswith("gptq"):
        return pack_gptq(w, "gptq" if "v1" in variant else "gptq_v2")
    if variant == "awq":
        return pack_awq(w)
    return pack_ct(w, with_zero_point=True)

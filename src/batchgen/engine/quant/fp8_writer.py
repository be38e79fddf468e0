"""Write an FP8 copy of an HF checkpoint folder in the AutoFP8 / llm-compressor tensor layout.

Per linear layer of the decoder: `<layer>.weight` as float8_e4m3fn, `<layer>.weight_scale` (shape ()
per tensor as AutoFP8 writes it, (N, 1) per channel as llm-compressor writes it), and with static
activation scales `<layer>.input_scale` (shape ()). config.json gains
`quantization_config: {quant_method: fp8, activation_scheme, ignored_layers}`. Embeddings, norms
and lm_head are copied unchanged. Other files (tokenizer, generation config) are copied as is.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

from batchgen.engine.quant.fp8_tensor import quantize_fp8

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


def write_fp8_checkpoint(src: str | Path, dst: str | Path, layout: str = "channel",
                         input_scales: Mapping[str, float] | None = None) -> Path:
    """Quantize `src`'s decoder linear weights into `dst` (a new folder); returns dst.

    layout: "channel" (one scale per output channel) or "tensor" (one scale per weight).
    input_scales: HF layer name (e.g. "model.layers.0.self_attn.q_proj") -> calibrated static
    activation scale; None writes a dynamic-activation checkpoint.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from batchgen.engine.loader.hf_loader import safetensors_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=False)
    tensors = {}
    for file in safetensors_files(src):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not is_linear_weight(name):
                    tensors[name] = tensor.contiguous()
                    continue
                layer = name.removesuffix(".weight")
                q, scale = quantize_fp8(tensor, layout)
                tensors[name] = q
                tensors[f"{layer}.weight_scale"] = scale.reshape(-1, 1) if layout == "channel" else scale.reshape(())
                if input_scales is not None:
                    tensors[f"{layer}.input_scale"] = scale.new_tensor(input_scales[layer]).reshape(())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                   "model.safetensors.index.json"):
            shutil.copy2(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8",
                                     "activation_scheme": "static" if input_scales is not None else "dynamic",
                                     "ignored_layers": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

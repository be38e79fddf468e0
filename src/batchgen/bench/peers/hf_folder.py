"""A GGUF checkpoint as an HF safetensors folder (float32), for peers that load only HF folders.

transformers dequantizes the GGUF on load (the same float32 weights batchgen's GGUF loader gets) and
marks the model as GGUF-quantized; that quantizer and the config's quantization_config are cleared
before `save_pretrained`, or the folder would claim a format it no longer has. The tokenizer (and its
chat template) is saved beside the weights. Written to a temporary folder, then renamed: a folder
with a config.json is complete.

    python -m batchgen.bench.peers.hf_folder smollm2-135m-instruct OUT_DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch


def convert_to_hf_folder(model: str, out_dir: Path) -> Path:
    """Write `model` (an alias, a .gguf file or an HF folder) as float32 safetensors + tokenizer to
    `out_dir`; returns it. An existing complete folder is left as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.engine.loader.source import resolve_model

    out_dir = Path(out_dir).expanduser()
    if (out_dir / "config.json").exists():
        return out_dir
    source = resolve_model(model)
    kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
    hf_model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(source.folder), **kwargs)
    hf_model.hf_quantizer = None  # the weights are dequantized float32 now
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.config.dtype = torch.float32
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF checkpoint to an HF safetensors folder.")
    parser.add_argument("model", help="model alias, .gguf file or HF folder")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    print(convert_to_hf_folder(args.model, args.out_dir))


if __name__ == "__main__":
    main()

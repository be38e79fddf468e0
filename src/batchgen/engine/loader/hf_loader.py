"""HF model folders: config.json and (sharded) safetensors. Never pickle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from batchgen.engine.loader.safetensors_header import check_safetensors_header
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.parallel.shards import ShardFn, read_safetensors


def read_hf_config_dict(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def read_hf_config(folder: Path, is_plan_only: bool = False) -> ModelConfig:
    """`is_plan_only`: also the architectures `batchgen plan` reads but the engine does not run
    (ModelConfig.from_hf_dict)."""
    cfg = read_hf_config_dict(folder)
    gen_path = folder / "generation_config.json"
    model_cfg = ModelConfig.from_hf_dict(cfg, is_plan_only=is_plan_only)
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            ids = tuple(dict.fromkeys(model_cfg.eos_token_ids + extra))
            model_cfg = ModelConfig(**{**model_cfg.__dict__, "eos_token_ids": ids})
    return model_cfg


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's .safetensors files, each header checked against its file before anyone reads it."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise ValueError(f"{folder} holds only pickle checkpoints (.bin/.pt); batchgen loads safetensors only")
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    for file in files:
        check_safetensors_header(file)
    return files


def iter_hf_weights(folder: Path, shard: ShardFn | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder; `shard` (tensor parallelism): only this rank's
    slice of each tensor is read (engine/parallel/layout.py says which)."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, read_safetensors(f, name, shard)

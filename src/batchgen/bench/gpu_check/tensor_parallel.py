"""Part 4, `--tensor-parallel-size N`: tp=N against tp=1 on the same HF folders (greedy tokens, then
bf16 decode speed at both sizes)."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from batchgen.bench.gpu_check.models import (
    engine_config,
    engine_greedy,
    free_device_memory,
    hf_llama,
    llama3_8b_config,
    random_prompts,
    save_hf_folder,
    small_config,
    tiny_config,
)
from batchgen.bench.gpu_check.speed import SpeedConfig, run_speed_config
from batchgen.engine.core.llm_engine import LLMEngine


def check_tensor_parallel(args: argparse.Namespace, device: torch.device, record) -> dict:
    """tp=N against tp=1 on the same folder: greedy tokens (float32 identical, bfloat16 agreement), then
    the speed model's bf16 decode at 64 sequences (completion tok/s) at both sizes."""
    size = args.tensor_parallel_size
    cfg = tiny_config() if args.tiny else small_config()
    num_tokens = 4 if args.tiny else 32
    prompts = random_prompts(2 if args.tiny else 8, (5, 40), cfg.vocab_size, seed=3)
    result: dict = {"tensor_parallel_size": size, "num_prompts": len(prompts), "num_tokens": num_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_folder(hf_llama(cfg, torch.float32, torch.device("cpu"), seed=0), Path(tmp) / "small")
        for dtype in (torch.float32, torch.bfloat16):
            tokens = {}
            for tp in (1, size):
                config = engine_config(device, dtype, 256, attention_backend=args.attention_backend,
                                       max_num_seqs=len(prompts), tensor_parallel_size=tp,
                                       kv_cache_memory="1GiB" if device.type == "cuda" else "auto",
                                       num_kv_blocks=None if device.type == "cuda" else 64).replace(model=str(folder))
                engine = LLMEngine(config)
                tokens[tp] = engine_greedy(engine, prompts, num_tokens)
                engine.shutdown()
                del engine  # no name keeps its pool (free_device_memory's rule)
                free_device_memory()
            pairs = list(zip(tokens[1], tokens[size]))
            result[str(dtype).removeprefix("torch.")] = {
                "identical_requests": sum(a == b for a, b in pairs),
                "matching_tokens": sum(x == y for a, b in pairs for x, y in zip(a, b)),
                "num_tokens": len(prompts) * num_tokens}
            record()
        result["ok"] = result["float32"]["identical_requests"] == len(prompts)
        speed_cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        folder = save_hf_folder(hf_llama(speed_cfg, dtype, device, seed=0), Path(tmp) / "speed")
        free_device_memory()
        sc = SpeedConfig("decode x64", 64, 64, (128, 128), 128) if not args.tiny else \
            SpeedConfig("decode x4", 4, 4, (8, 8), 8)
        max_model_len = 64 if args.tiny else 4096
        result["speed"] = []
        for tp in (1, size):
            config = engine_config(device, dtype, max_model_len, attention_backend=args.attention_backend,
                                   max_num_seqs=sc.max_num_seqs, tensor_parallel_size=tp,
                                   num_kv_blocks=None if device.type == "cuda"
                                   else sc.max_num_seqs * (-(-max_model_len // 16)) + 1).replace(model=str(folder))
            try:
                engine = LLMEngine(config)
            except ValueError as exc:  # tp=1 of a model that needs more than one GPU
                result["speed"].append({"tensor_parallel_size": tp, "skipped": str(exc)})
                continue
            row = run_speed_config(engine, dataclasses.replace(sc, name=f"{sc.name} tp={tp}"), seed=1,
                                   clock=args.clock)
            result["speed"].append({"tensor_parallel_size": tp, **row})
            engine.shutdown()
            del engine
            free_device_memory()
            record()
    return result

"""Part 1, correctness: the engine against HF transformers on the same weights (float32 greedy tokens
identical, bfloat16 agreement), and FP8 matmul errors at the speed model's layer shapes."""

from __future__ import annotations

import argparse

import torch

from batchgen.bench.gpu_check.models import (
    engine_config,
    engine_greedy,
    free_device_memory,
    hf_llama,
    random_prompts,
    small_config,
    tiny_config,
)
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.loader.model_loader import build_loaded_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.quant.fp8_linear import Fp8Linear

# Rounding to E4M3 moves a weight by <= 2**-4 of itself, RMS <= 2**-4/sqrt(3); activations too: x sqrt(2).
W8A16_REL_BOUND = 2.0**-4 / 3**0.5
W8A8_REL_BOUND = 2**0.5 * W8A16_REL_BOUND


@torch.inference_mode()
def hf_greedy_each(hf_model, prompts: list[list[int]], max_tokens: int, device: torch.device) -> list[list[int]]:
    """HF generate one prompt at a time (no padding: the plainest reference), EOS off like the engine's
    ignore_eos (min_new_tokens would instead ban the EOS token, which greedy may pick)."""
    hf_model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def check_correctness(args: argparse.Namespace, device: torch.device) -> dict:
    """Engine vs HF on the same weights, float32 (identical greedy tokens) and bfloat16 (agreement)."""
    cfg = tiny_config() if args.tiny else small_config()
    num_tokens = 4 if args.tiny else 32
    prompts = random_prompts(2 if args.tiny else 8, (5, 40), cfg.vocab_size, seed=3)
    result = {"model": args.model or "random small llama", "num_prompts": len(prompts), "num_tokens": num_tokens}
    for dtype in (torch.float32, torch.bfloat16):
        result[str(dtype).removeprefix("torch.")] = _compare_with_hf(args, cfg, dtype, device, prompts, num_tokens)
        free_device_memory()  # the engine, its model and HF's died with the call's frame
    result["ok"] = result["float32"]["identical_requests"] == len(prompts)
    return result


def _compare_with_hf(args: argparse.Namespace, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     prompts: list[list[int]], num_tokens: int) -> dict:
    config = engine_config(device, dtype, 256, attention_backend=args.attention_backend,
                           max_num_seqs=len(prompts), kv_cache_memory="1GiB" if device.type == "cuda" else "auto",
                           num_kv_blocks=None if device.type == "cuda" else 64)
    if args.model:
        from transformers import AutoModelForCausalLM

        from batchgen.engine.loader.model_loader import load_model

        config = config.replace(model=args.model)
        loaded = load_model(config)
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    else:
        hf = hf_llama(cfg, dtype, device, seed=0)
        state = hf.state_dict()
        loaded = build_loaded_model(config, cfg, 256, lambda model: model.load_weights(state.items()))
    engine = LLMEngine(config, loaded=loaded)
    ours = engine_greedy(engine, prompts, num_tokens)
    reference = hf_greedy_each(hf, prompts, num_tokens, device)
    same = sum(a == b for a, b in zip(ours, reference))
    matching = sum(x == y for a, b in zip(ours, reference) for x, y in zip(a, b))
    return {"attention_backend": engine.capabilities.attention_backend, "identical_requests": same,
            "matching_tokens": matching, "num_tokens": len(prompts) * num_tokens}


@torch.inference_mode()
def check_fp8_matmuls(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, num_tokens: int = 64) -> list[dict]:
    """Relative error vs a float32 matmul: the model dtype, w8a8 and w8a16 at every layer shape."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in cfg.linear_shapes().items():
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.float32)
        linear.weight.normal_(0, 0.02, generator=gen)
        x = torch.randn(num_tokens, k, device=device, generator=gen)
        ref = linear(x)
        linear = linear.to(dtype)
        row = {"layer": name, "shape": [num_tokens, k, n], "dtype": rel_error(linear(x.to(dtype)), ref)}
        fp8 = Fp8Linear.from_linear(linear)
        for mode in ("w8a8", "w8a16"):
            fp8.set_mode(mode)
            row[mode] = rel_error(fp8(x.to(dtype)), ref)
        row["ok"] = row["w8a8"] < W8A8_REL_BOUND and row["w8a16"] < W8A16_REL_BOUND * 1.1  # dtype rounding on top
        rows.append(row)
    return rows


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()

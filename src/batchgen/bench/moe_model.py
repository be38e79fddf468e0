"""`batchgen bench --workload moe`: a small mixture-of-experts model end to end, the random workload
(64 prompts of 100-200 tokens -> 64 greedy tokens) through the engine and a peer (HF transformers
`generate`, or vLLM's CPU build with `--peer vllm`), plus the fused MoE layers' share of the engine's run.

The model is a Qwen3-MoE made by transformers' own class with seeded random weights (no download):
hidden 512, 8 layers, 16 experts, top 4 (renormalised), experts 512 channels wide, 8 query / 4 KV
heads of 64, a 32,000-word vocabulary with a word-level tokenizer ("t0", "t1", ...). It is written
once as an HF folder (safetensors, per-expert tensors as published checkpoints hold them) under
batchgen's cache root, so the engine, HF and vLLM all load the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from batchgen.kernels.cache_dir import cache_root

# The benchmark model: 16 experts top 4, hidden 512, 8 layers (Qwen3-MoE's field names).
MOE_BENCH_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 8, "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 2048, "norm_topk_prob": True,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 1,
}
FOLDER_VARIABLE = "BATCHGEN_MOE_BENCH_MODEL_DIR"


def moe_folder_name(config: dict, seed: int) -> str:
    return (f"qwen3-moe-e{config['num_experts']}-top{config['num_experts_per_tok']}-h{config['hidden_size']}"
            f"-l{config['num_hidden_layers']}-seed{seed}")


def default_moe_folder(config: dict = MOE_BENCH_CONFIG, seed: int = 0) -> Path:
    """`BATCHGEN_MOE_BENCH_MODEL_DIR`, else <cache root>/bench-models/<name from the shape and seed>."""
    return Path(os.environ.get(FOLDER_VARIABLE) or cache_root() / "bench-models" / moe_folder_name(config, seed))


def make_moe_folder(out_dir: Path, config: dict = MOE_BENCH_CONFIG, seed: int = 0) -> Path:
    """Write a random-weight Qwen3-MoE (transformers' class, `seed`) with its tokenizer to `out_dir`; a
    folder already holding the same config (and a config.json) is left as it is. Written to a temporary
    folder, then renamed: a folder with a config.json is complete."""
    import torch
    import transformers

    out_dir = Path(out_dir).expanduser()
    marker = out_dir / "batchgen_bench.json"
    if (out_dir / "config.json").exists() and marker.exists() and json.loads(marker.read_text()) == {
            "config": config, "seed": seed}:
        return out_dir
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3MoeConfig(**config)
    model = transformers.Qwen3MoeForCausalLM(hf_config).to(torch.float32).eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        _save_word_tokenizer(config["vocab_size"], tmp)
        (tmp / "batchgen_bench.json").write_text(json.dumps({"config": config, "seed": seed}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save_word_tokenizer(vocab_size: int, folder: Path) -> None:
    """A word-level tokenizer of the whole vocabulary ("t0" ... "t<vocab - 1>"; t0 unknown, t1 EOS): the
    bench feeds token ids, so only the files every loader asks for matter."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(folder)


class MoEClock:
    """Wall seconds inside the model's MoE layers (router, expert GEMMs, combine) while installed."""

    def __init__(self):
        self.seconds = 0.0
        self.num_calls = 0

    def timed(self, forward):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.num_calls += 1
        return wrapper


@contextmanager
def timing_moe_layers(model: nn.Module) -> Iterator[MoEClock]:
    """Time every SparseMoE of `model` (an instance-level forward wrapper; two perf_counter calls per
    layer per step, nothing synchronised: the CPU runs eagerly) until the block exits."""
    from batchgen.engine.models.layers.moe import SparseMoE

    clock = MoEClock()
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        raise ValueError("the model has no MoE layer to time")
    for layer in layers:
        layer.forward = clock.timed(layer.forward)
    try:
        yield clock
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def moe_summary(model_cfg, moe_seconds: float, num_moe_calls: int, run_seconds: float) -> dict:
    """The MoE figures of a run: the layers' share of the engine's wall time, and the model's total and
    active parameters (a token reads the router and its top-k experts of each MoE layer)."""
    from batchgen.bench.roofline import num_layer_flops_per_token

    hidden, inter, experts = model_cfg.hidden_size, model_cfg.moe_intermediate_size, model_cfg.num_experts
    num_moe_layers = sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.num_layers))
    expert_params = 3 * hidden * inter
    return {
        "num_experts": experts, "num_experts_per_tok": model_cfg.num_experts_per_tok, "hidden_size": hidden,
        "moe_intermediate_size": inter, "num_layers": model_cfg.num_layers, "num_moe_layers": num_moe_layers,
        "num_expert_params": num_moe_layers * experts * expert_params,
        "num_active_layer_params_per_token": num_layer_flops_per_token(model_cfg) // 2,
        "moe_seconds": moe_seconds, "num_moe_calls": num_moe_calls,
        "moe_share_of_run": moe_seconds / run_seconds if run_seconds > 0 else 0.0,
    }

"""The GPU check's models and helpers: Llama shapes, seeded random weights (ours and HF's), engine configs,
greedy runs, freeing device memory between engines."""

from __future__ import annotations

import dataclasses
import gc
import random
from pathlib import Path

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.sampling.sampling_params import SamplingParams


def llama3_8b_config(num_layers: int = 32) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=num_layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


def small_config() -> ModelConfig:
    """The correctness model: Llama-shaped (GQA 4:1, head_dim 64), small enough to run in seconds."""
    return ModelConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def tiny_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=False)


def seeded_init(seed: int, device: torch.device):
    def fill(model: torch.nn.Module) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02, generator=gen)
    return fill


def hf_llama(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int):
    """HF transformers' LlamaForCausalLM of this shape, seeded random weights, built in `dtype` on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def engine_config(device: torch.device, dtype: torch.dtype, max_model_len: int, **overrides) -> EngineConfig:
    return EngineConfig(model="random", device=str(device), dtype=str(dtype).removeprefix("torch."),
                        max_model_len=max_model_len, **overrides)


def supported_overrides(overrides: dict) -> tuple[dict, list[str]]:
    """The overrides this build's EngineConfig has, and the names it lacks."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in overrides.items() if k in fields}, [k for k in overrides if k not in fields]


def free_device_memory() -> None:
    """Collect what the callers' dropped references left (an engine holds reference cycles, so its KV
    pool outlives its last name until the collector runs) and hand torch's cached blocks back, so the
    next engine's pool sizing sees the memory free. Callers drop every reference first: a name still
    bound to the previous engine (a loop variable, a frame kept by a traceback) keeps its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(num: int, length: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(num)]


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=prompt)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"c{i}"] for i in range(len(prompts))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_hf_folder(hf_model, folder: Path) -> Path:
    """The HF model as an HF folder (config.json, safetensors) with a word-level tokenizer of its
    vocabulary ("t0", "t1", ...): what every tensor-parallel rank loads its shard from."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf_model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(hf_model.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(folder)
    return folder

"""The peer side of the bench: HF transformers `generate`, run the way a careful user would run it.

Batched, prompts sorted by length so batches carry little padding, left padding, sdpa attention,
the engine's dtype (float32 unless the bench asks for bfloat16), inference_mode, greedy, min_new_tokens = max_new_tokens so every request yields exactly
its output length. The peer gets its best batch size (several are tried, the fastest is reported).
"""

from __future__ import annotations

import importlib.util
import time

import torch

from batchgen.bench.result import TimedRun
from batchgen.bench.workloads import BenchRequest, Workload

DEFAULT_BATCH_SIZES = (16, 32, 64)
PEER_NAME = "hf-transformers"


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (a missing optional dependency); the message says what to install."""


def require_peer_dependencies() -> None:
    if importlib.util.find_spec("accelerate") is None:
        raise PeerUnavailable(
            "the HF transformers peer needs `accelerate` to load GGUF checkpoints: "
            "pip install 'batchgen[bench]' (or run without the peer: --peer none)")


def load_peer_model(model: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the same checkpoint, in `dtype`, sdpa attention, eval mode."""
    require_peer_dependencies()
    from transformers import AutoModelForCausalLM

    from batchgen.engine.loader.source import resolve_model

    source = resolve_model(model)
    kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
    hf_model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype,
                                                    attn_implementation="sdpa", trust_remote_code=False,
                                                    **kwargs)
    return hf_model.eval()


def _batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Longest prompts first, one output length per batch (generate takes one max_new_tokens)."""
    ordered = sorted(requests, key=lambda r: (r.output_len, -len(r.prompt_token_ids)))
    batches: list[list[BenchRequest]] = []
    for r in ordered:
        if batches and len(batches[-1]) < batch_size and batches[-1][0].output_len == r.output_len:
            batches[-1].append(r)
        else:
            batches.append([r])
    return batches


def _left_padded(batch: list[BenchRequest], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        input_ids[row, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        attention_mask[row, width - n:] = 1
    return input_ids, attention_mask  # (B, W) each


def _num_generated(row: list[int], eos_token_ids: set[int]) -> int:
    """Tokens this row really generated: generate pads a row after it stops at an EOS."""
    return next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))


def _generation_config(hf_model, output_len: int, pad_token_id: int, eos_token_ids: list[int]):
    from transformers import GenerationConfig

    # A fresh config so nothing from the checkpoint's defaults (sampling, penalties) leaks in.
    return GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                            num_beams=1, pad_token_id=pad_token_id, eos_token_id=eos_token_ids,
                            bos_token_id=hf_model.config.bos_token_id, use_cache=True)


def warm_up_peer(hf_model, pad_token_id: int, eos_token_ids: list[int]) -> None:
    """One tiny generate so thread-pool and first-call costs stay out of the timed runs."""
    batch = [BenchRequest("warmup-0", list(range(100, 116)), 2), BenchRequest("warmup-1", list(range(200, 208)), 2)]
    input_ids, attention_mask = _left_padded(batch, pad_token_id)
    with torch.inference_mode():
        hf_model.generate(input_ids=input_ids, attention_mask=attention_mask,
                          generation_config=_generation_config(hf_model, 2, pad_token_id, eos_token_ids))


def run_peer_once(hf_model, workload: Workload, batch_size: int, pad_token_id: int,
                  eos_token_ids: list[int]) -> TimedRun:
    """One timed pass at one batch size; padding is built before the clock starts (it is tokenizing)."""
    prepared = [(batch, *_left_padded(batch, pad_token_id),
                 _generation_config(hf_model, batch[0].output_len, pad_token_id, eos_token_ids))
                for batch in _batches(workload.requests, batch_size)]
    eos = set(eos_token_ids)
    token_ids: dict[str, list[int]] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        generated = [hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
                     for _, ids, mask, gen in prepared]
    seconds = time.perf_counter() - start
    num_prompt = num_completion = 0
    for (batch, ids, mask, _), out in zip(prepared, generated):
        new_tokens = out[:, ids.shape[1]:].tolist()  # (B, output_len)
        num_prompt += int(mask.sum())
        for r, row in zip(batch, new_tokens):
            n = _num_generated(row, eos)
            num_completion += n
            token_ids[r.request_id] = row[:n]
    return TimedRun(f"{PEER_NAME} (batch {batch_size})", num_prompt, num_completion, seconds, token_ids,
                     {"batch_size": batch_size, "num_batches": len(prepared)})


def run_peer(hf_model, workload: Workload, batch_sizes: list[int], pad_token_id: int,
             eos_token_ids: list[int]) -> tuple[TimedRun, list[TimedRun]]:
    """Every batch size once; returns the fastest run and all runs."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"peer batch sizes must be >= 1, got {batch_sizes}")
    runs = [run_peer_once(hf_model, workload, b, pad_token_id, eos_token_ids) for b in batch_sizes]
    best = max(runs, key=lambda r: r.completion_tokens_per_s)
    best.details["runs"] = [{"batch_size": r.details["batch_size"], "seconds": r.seconds,
                             "completion_tokens_per_s": r.completion_tokens_per_s} for r in runs]
    return best, runs

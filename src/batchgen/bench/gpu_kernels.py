"""The GPU check's kernel-level figures: decode paged attention alone against the device's bandwidth
(split-KV off and on, and each tile candidate), and one sampler step (top-k/top-p, top-p alone)
against a greedy one. Part of `python -m batchgen.bench.gpu_check`; at toy sizes anywhere the Triton
kernels run (the CPU under TRITON_INTERPRET=1, where the timings mean nothing).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from batchgen.bench.sampling_rate import language_model_logits
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.sampling_batch import PenaltyState, sampling_batch_for
from batchgen.engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class AttentionCase:
    name: str
    num_seqs: int
    context_len: int


def attention_cases(tiny: bool) -> list[AttentionCase]:
    if tiny:
        return [AttentionCase("S=2 at 64", 2, 64), AttentionCase("S=1 at 96", 1, 96)]
    return [AttentionCase("S=256 at 4k", 256, 4096), AttentionCase("S=1 at 32k", 1, 32768)]


def _time(fn, device: torch.device, reps: int, warmups: int = 2) -> float:
    """Median seconds of fn() over `reps` calls after `warmups` (CUDA events on the GPU)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_attention_figures(device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int,
                             head_size: int, hbm_bytes_per_s: float, tiny: bool, reps: int = 10,
                             warmups: int = 2) -> list[dict]:
    """Per case: the decode step's paged attention alone, split off and on (the engine's split size), its
    K/V bytes read per second against the device's bandwidth, whether both modes gave the same bits,
    and (full size, first case) each tile candidate's rate."""
    from batchgen.engine.attention.triton import SPLIT_SIZE
    from batchgen.kernels.triton_paged_attention import paged_attention, workspace_shape
    from batchgen.kernels.triton_tuning import attention_candidates

    block_size = 16
    split_size = 32 if tiny else SPLIT_SIZE
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for index, case in enumerate(attention_cases(tiny)):
        blocks_per_seq = -(-case.context_len // block_size)
        num_blocks = case.num_seqs * blocks_per_seq
        # Every sequence's blocks, scattered over the pool as a running engine's are.
        order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        tables = order.view(case.num_seqs, blocks_per_seq)
        cache_shape = (num_blocks * block_size, num_kv_heads, head_size)
        k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
        v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
        q = torch.randn(case.num_seqs, num_q_heads, head_size, generator=gen, device=device).to(dtype)
        seq_lens = torch.full((case.num_seqs,), case.context_len, dtype=torch.int32, device=device)
        cu = torch.arange(case.num_seqs + 1, dtype=torch.int32, device=device)
        splits = -(-case.context_len // split_size)
        acc = torch.empty(workspace_shape(case.num_seqs, num_q_heads, head_size, splits), device=device)
        workspace = (acc, torch.empty(acc.shape[:3], device=device), torch.empty(acc.shape[:3], device=device))
        args = (q, k_cache, v_cache, tables, cu, seq_lens, head_size ** -0.5, block_size)
        tiles = attention_candidates(head_size, num_q_heads // num_kv_heads, dtype)
        if tiny:
            tiles = [t for t in tiles if t.tile_n <= split_size][:1]
        kv_bytes = 2 * case.num_seqs * case.context_len * num_kv_heads * head_size * k_cache.element_size()
        row = {"case": case.name, "num_seqs": case.num_seqs, "context_len": case.context_len,
               "kv_bytes": kv_bytes, "tiles": str(tiles[0]), "split_size": split_size, "num_splits": splits}
        outs = {}
        for mode, ws in (("unsplit", None), ("split", workspace)):
            out = torch.empty_like(q)
            seconds = _time(partial(paged_attention, *args, split_size=split_size, workspace=ws, out=out,
                                    tiles=tiles[0]), device, reps, warmups)
            outs[mode] = out
            row[f"{mode}_ms"] = 1e3 * seconds
            row[f"{mode}_gb_per_s"] = kv_bytes / seconds / 1e9
            row[f"{mode}_fraction_of_hbm"] = kv_bytes / seconds / hbm_bytes_per_s
        row["split_equals_unsplit_bitwise"] = bool(torch.equal(outs["split"], outs["unsplit"]))
        if index == 0 and not tiny:  # the tile candidates at the batch-256 shape (unsplit)
            row["candidates"] = {}
            for t in tiles:
                try:
                    seconds = _time(partial(paged_attention, *args, split_size=split_size, tiles=t), device, reps)
                    row["candidates"][str(t)] = round(kv_bytes / seconds / 1e9, 1)
                except Exception as exc:  # noqa: BLE001 - recorded: a candidate this GPU cannot compile
                    row["candidates"][str(t)] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        del k_cache, v_cache, workspace, acc, outs
    return rows


def _sample_once(sampler: Sampler, logits: torch.Tensor, batch, seqs, penalties) -> None:
    sampler.sample(logits.clone(), batch, seqs, penalties).tokens.cpu()  # the read-back waits for it


SAMPLER_SETTINGS = {
    "greedy": {"temperature": 0.0},
    "top-k 50 + top-p 0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
}


def sampler_step_figures(device: torch.device, vocab: int, num_rows: int, reps: int = 10, warmups: int = 2) -> dict:
    """Milliseconds of one Sampler.sample over `num_rows` rows of language-model-shaped logits per setting,
    and each random setting's time over greedy's."""
    logits = language_model_logits(num_rows, vocab).to(device)
    sampler = Sampler(eos_token_ids=(0,))
    result = {"num_rows": num_rows, "vocab": vocab, "ms": {}}
    for name, settings in SAMPLER_SETTINGS.items():
        params = SamplingParams(max_tokens=16, seed=0, **settings)
        seqs = [Sequence(f"r{i}", 0, [1, 2, 3], params, 0.0, 1 << 20) for i in range(num_rows)]
        penalties = PenaltyState(vocab, device)
        batch = sampling_batch_for(seqs, sampler.eos_token_ids, vocab, penalties, device)
        seconds = _time(partial(_sample_once, sampler, logits, batch, seqs, penalties), device, reps, warmups)
        result["ms"][name] = 1e3 * seconds
    greedy = result["ms"]["greedy"]
    result["over_greedy"] = {name: ms / greedy for name, ms in result["ms"].items() if name != "greedy"}
    return result

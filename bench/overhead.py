"""`batchgen bench --workload overhead`: the engine's host time per step, with a null model.

The null model runs no forward: it hands the sampler fixed logits whose argmax is one token, so a
step costs only what the host does around the model: schedule, prepare the inputs (pack them, the
one copy, the attention metadata) and process the outputs (read-back unpacking, appending tokens,
stop checks). On an H200 an 8B decode step at batch 256 takes ~8-10 ms of GPU time, so this host
side must stay well below it. `forward` (the null model, the sampler's argmax over the fixed
logits and the read-back) is reported apart: on a GPU it is device work the host waits for.

Each batch size gets a fresh engine whose every sequence is decoding: its prompts are prefilled
first (untimed), then `steps` decode steps are timed with the engine's own StepTimings; each part's
figure is its median over the steps (`mean_host` is the plain mean of the host total).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from batchgen.engine import EngineConfig, LLMEngine, SamplingParams
from batchgen.engine.capabilities import detect_capabilities
from batchgen.engine.loader.model_loader import LoadedModel
from batchgen.engine.models.config import ModelConfig

BATCH_SIZES = (1, 64, 256)
NULL_VOCAB = 2048  # the logits' width: sampler work, not host work, so kept small
NEXT_TOKEN = 7  # the null model's only output (never EOS: the model has none)
WARMUP_STEPS = 4


def null_model_config() -> ModelConfig:
    """A one-layer shape for the KV pool the scheduler allocates from (its bytes are never read)."""
    return ModelConfig(model_type="llama", vocab_size=NULL_VOCAB, hidden_size=64, intermediate_size=64,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=1 << 16, tie_word_embeddings=False)


class NullModel(torch.nn.Module):
    """No forward: logits (N, V) whose argmax is NEXT_TOKEN, for the N rows the step samples."""

    def __init__(self, backend, max_rows: int, vocab: int, device: torch.device):
        super().__init__()
        self.backend = backend
        logits = torch.zeros(max_rows, vocab, device=device)
        logits[:, NEXT_TOKEN] = 1.0
        self.register_buffer("logits", logits, persistent=False)

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        return self.logits[:logits_indices.shape[0]]


def null_engine(batch_size: int, max_model_len: int, device: str = "cpu") -> LLMEngine:
    cfg = null_model_config()
    blocks_per_seq = -(-max_model_len // 16)
    config = EngineConfig(model="null", dtype="float32", device=device, max_num_seqs=batch_size,
                          max_num_batched_tokens=max(batch_size * max_model_len, 4096),
                          num_kv_blocks=batch_size * blocks_per_seq + 1, max_model_len=max_model_len,
                          enforce_eager=True)
    capabilities = detect_capabilities(config, cfg, has_fp8_layers=False)
    from batchgen.engine.attention import ATTENTION_BACKENDS

    backend = ATTENTION_BACKENDS[capabilities.attention_backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    model = NullModel(backend, batch_size, cfg.vocab_size, config.torch_device)
    loaded = LoadedModel(source=None, model_cfg=cfg, model=model, max_model_len=max_model_len, weight_bytes=0,
                         capabilities=capabilities)
    return LLMEngine(config, loaded=loaded)


def measure_overhead(batch_size: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    """Host milliseconds per decode step at `batch_size` running sequences."""
    max_model_len = prompt_len + WARMUP_STEPS + steps + 8
    engine = null_engine(batch_size, max_model_len)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + steps + 4, ignore_eos=True)
    for i in range(batch_size):
        prompt = [rng.randrange(8, NULL_VOCAB) for _ in range(prompt_len)]
        engine.add_request(f"o{i}", None, params, prompt_token_ids=prompt)
    engine.step()  # every prompt in one prefill step (the step budget holds them all)
    for _ in range(WARMUP_STEPS):
        engine.step()
    assert len(engine.scheduler.running) == batch_size and not engine.scheduler.waiting
    timings = engine.timings
    parts = ("schedule", "prepare", "forward", "process")
    per_step: dict[str, list[float]] = {name: [] for name in parts}
    start = time.perf_counter()
    for _ in range(steps):
        timings.reset()
        engine.step()
        for name in parts:
            per_step[name].append(1e3 * getattr(timings, name))
    wall = time.perf_counter() - start
    stats = engine.stats
    assert stats["num_preemptions"] == 0 and all(len(s.token_ids) > prompt_len for s in engine.scheduler.running)
    # Medians: the machine is shared, and a neighbour's burst lands in a few steps, not in the median.
    result = {name: round(statistics.median(values), 4) for name, values in per_step.items()}
    result["host"] = round(result["schedule"] + result["prepare"] + result["process"], 4)
    result["mean_host"] = round(sum(sum(per_step[n]) for n in ("schedule", "prepare", "process")) / steps, 4)
    result.update(batch_size=batch_size, steps=steps, wall_ms_per_step=round(1e3 * wall / steps, 4))
    return result


def run_overhead(prompt_len: int = 128, steps: int = 64, batch_sizes=BATCH_SIZES, seed: int = 0) -> dict:
    """The overhead figures at each batch size (one fresh null engine each).

    One torch thread: the host side is single-threaded Python, and the null forward's argmax on two
    OpenMP threads waits at barriers whenever a neighbour holds the other core (~20x on a shared VM)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [measure_overhead(b, prompt_len, steps, seed) for b in batch_sizes]
    finally:
        torch.set_num_threads(threads)
    return {"workload": "overhead", "prompt_len": prompt_len, "null_vocab": NULL_VOCAB, "torch_threads": 1,
            "runs": runs}


def format_overhead(result: dict) -> str:
    lines = [f"batchgen bench: workload overhead (null model, prompts {result['prompt_len']} tokens, "
             f"host ms per decode step)",
             f"  {'running':>8} {'schedule':>9} {'prepare':>9} {'process':>9} {'host':>9} {'forward*':>9}"]
    for r in result["runs"]:
        lines.append(f"  {r['batch_size']:>8} {r['schedule']:>9.3f} {r['prepare']:>9.3f} {r['process']:>9.3f} "
                     f"{r['host']:>9.3f} {r['forward']:>9.3f}")
    lines.append("  host = schedule + prepare + process; *forward: the null model, the sampler over "
                 f"{result['null_vocab']}-wide logits and the read-back (device work on a GPU)")
    return "\n".join(lines)

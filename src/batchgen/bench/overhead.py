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

Critical path: the host time per step during which a GPU would sit idle. In order it is the whole
host part (the read-back's processing, schedule, prepare: `host`). With async scheduling the same
steps run again on a stand-in GPU (engine/runner/device_stream.py ThreadStream: the device work on a thread
of its own, `device_ms` per step, as an 8B decode step at batch 256 takes on an H200), and
`async_ms` is the device's measured idle time per step (median): what of the host's work for the next
step did not fit inside this one. (The stand-in's in-order idle time is not used: on a loaded CPU it
adds the two threads' wake-ups, which a GPU's event wait does not have.)
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
from batchgen.engine.runner.device_stream import ThreadStream

BATCH_SIZES = (1, 64, 256)
NULL_VOCAB = 2048  # the logits' width: sampler work, not host work, so kept small
NEXT_TOKEN = 7  # the null model's only output (never EOS: the model has none)
WARMUP_STEPS = 4
DEVICE_MS = 8.0  # the stand-in GPU's time per decode step (an 8B model at batch 256 on an H200: ~8-10 ms)


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


def null_engine(batch_size: int, max_model_len: int, device: str = "cpu",
                is_async: bool = False) -> LLMEngine:
    cfg = null_model_config()
    blocks_per_seq = -(-max_model_len // 16)
    config = EngineConfig(model="null", dtype="float32", device=device, max_num_seqs=batch_size,
                          max_num_batched_tokens=max(batch_size * max_model_len, 4096),
                          num_kv_blocks=batch_size * blocks_per_seq + 1, max_model_len=max_model_len,
                          enforce_eager=True, async_scheduling=is_async)
    capabilities = detect_capabilities(config, cfg, has_fp8_layers=False)
    from batchgen.engine.attention import ATTENTION_BACKENDS

    backend = ATTENTION_BACKENDS[capabilities.attention_backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    model = NullModel(backend, batch_size, cfg.vocab_size, config.torch_device)
    loaded = LoadedModel(source=None, model_cfg=cfg, model=model, max_model_len=max_model_len, weight_bytes=0,
                         capabilities=capabilities)
    return LLMEngine(config, loaded=loaded)


def measure_overhead(batch_size: int, prompt_len: int, steps: int, seed: int = 0, is_async: bool = False,
                     device_ms: float | None = None) -> dict:
    """Host milliseconds per decode step at `batch_size` running sequences; with `device_ms`, on a stand-in
    GPU of that many milliseconds a step, also the device's idle time per step (`critical_ms`)."""
    max_model_len = prompt_len + WARMUP_STEPS + steps + 8
    engine = null_engine(batch_size, max_model_len, is_async=is_async)
    stream = None
    if device_ms is not None:
        engine.runner.stream = stream = ThreadStream(device_ms / 1e3)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + steps + 4, ignore_eos=True)
    for i in range(batch_size):
        prompt = [rng.randrange(8, NULL_VOCAB) for _ in range(prompt_len)]
        engine.add_request(f"o{i}", None, params, prompt_token_ids=prompt)
    engine.step()  # every prompt in one prefill step (the step budget holds them all)
    for _ in range(WARMUP_STEPS):
        engine.step()
    assert len(engine.scheduler.running) == batch_size and not engine.scheduler.waiting
    if stream is not None:
        stream.reset()
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
    if stream is not None:
        gaps = stream.idle_gaps()
        result.update(is_async=is_async, device_ms=device_ms,
                      critical_ms=round(1e3 * statistics.median(gaps), 4) if gaps else 0.0)
        stream.close()
    return result


def run_overhead(prompt_len: int = 128, steps: int = 64, batch_sizes=BATCH_SIZES, seed: int = 0,
                 device_ms: float | None = DEVICE_MS) -> dict:
    """The overhead figures at each batch size (one fresh null engine each); with `device_ms`, the
    critical path on a stand-in GPU, in order and with async scheduling.

    One torch thread: the host side is single-threaded Python, and the null forward's argmax on two
    OpenMP threads waits at barriers whenever a neighbour holds the other core (~20x on a shared VM)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [measure_overhead(b, prompt_len, steps, seed) for b in batch_sizes]
        critical = []
        if device_ms is not None:
            for run in runs:
                ahead = measure_overhead(run["batch_size"], prompt_len, steps, seed, is_async=True,
                                         device_ms=device_ms)
                critical.append({"batch_size": run["batch_size"], "device_ms": device_ms,
                                 "in_order_ms": run["host"], "async_ms": ahead["critical_ms"],
                                 "async_host_ms": ahead["host"], "async_wall_ms": ahead["wall_ms_per_step"]})
    finally:
        torch.set_num_threads(threads)
    return {"workload": "overhead", "prompt_len": prompt_len, "null_vocab": NULL_VOCAB, "torch_threads": 1,
            "runs": runs, "critical": critical}


def format_overhead(result: dict) -> str:
    lines = [(f"batchgen bench: workload overhead (null model, prompts {result['prompt_len']} tokens, "
              f"host ms per decode step)"),
             f"  {'running':>8} {'schedule':>9} {'prepare':>9} {'process':>9} {'host':>9} {'forward*':>9}"]
    for r in result["runs"]:
        lines.append(f"  {r['batch_size']:>8} {r['schedule']:>9.3f} {r['prepare']:>9.3f} {r['process']:>9.3f} "
                     f"{r['host']:>9.3f} {r['forward']:>9.3f}")
    lines.append("  host = schedule + prepare + process; *forward: the null model, the sampler over "
                 f"{result['null_vocab']}-wide logits and the read-back (device work on a GPU)")
    if result.get("critical"):
        lines.append("  critical path: host ms per step a GPU waits for (in order: host; async: the idle "
                     f"time measured on a stand-in GPU of {result['critical'][0]['device_ms']:g} ms a step)")
        lines.append(f"  {'running':>8} {'in order':>9} {'async':>9} {'async host':>11} {'async wall':>11}")
        for r in result["critical"]:
            lines.append(f"  {r['batch_size']:>8} {r['in_order_ms']:>9.3f} {r['async_ms']:>9.3f} "
                         f"{r['async_host_ms']:>11.3f} {r['async_wall_ms']:>11.3f}")
    return "\n".join(lines)

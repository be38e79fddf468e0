"""The sampler's cost: per step on synthetic logits, and sampled against greedy decoding on a model.

    python -m batchgen.bench.sampling_rate sampler [--rows 256] [--vocab 49152,128256] [--reps 5]
    python -m batchgen.bench.sampling_rate engine [--rounds 3] [--requests 64] [--output-len 64]

`sampler`: `Sampler.sample` alone, milliseconds per step (median of --reps) over N rows of one
vocabulary width, for greedy rows and the random settings a job uses (temperature alone; top-k with
top-p; top-p alone; min-p). The logits are shaped like a language model's (a Zipf-like fall-off
by rank, shuffled per row), so a nucleus of top-p 0.9 holds tens to hundreds of tokens, not the
whole vocabulary as it would for Gaussian noise.

`engine`: the bundled model decodes the same random prompts (bench/workloads.py's random workload)
greedily and sampled (temperature 0.8, top-k 50, top-p 0.9), alternating, --rounds times each,
prefix caching off so every round recomputes alike; completion tokens/s per round and the median
ratio sampled / greedy. On a shared machine the alternation keeps both sides under the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.runner.cpu_allocator import keep_freed_memory
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.sampling_batch import PenaltyState, sampling_batch_for
from batchgen.engine.sampling.sampling_params import SamplingParams

SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k 50 + top-p 0.9": SAMPLED,
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
}


def language_model_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(N, V) float32: logit = -1.5 log(rank) + noise, each row's ranks shuffled over the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    by_rank = -1.5 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))  # (V,)
    rows = by_rank + 0.5 * torch.randn(num_rows, vocab, generator=gen)  # (N, V)
    order = torch.argsort(torch.rand(num_rows, vocab, generator=gen), dim=-1)
    return torch.empty_like(rows).scatter_(-1, order, rows)


def time_sampler(num_rows: int, vocab: int, settings: dict, reps: int) -> float:
    """Median milliseconds of Sampler.sample over `num_rows` rows with these SamplingParams fields."""
    keep_freed_memory()  # as an engine on the CPU does: no page faults on every large temporary
    logits = language_model_logits(num_rows, vocab)
    params = SamplingParams(max_tokens=16, seed=0, **settings)
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3], params, 0.0, 1 << 20) for i in range(num_rows)]
    sampler = Sampler(eos_token_ids=(0,), is_c_sampling=_has_c_sampling())
    penalties = PenaltyState(vocab, logits.device)
    batch = sampling_batch_for(seqs, sampler.eos_token_ids, vocab, penalties, logits.device)
    times = []
    for _ in range(reps + 1):  # the first call is a warm-up
        work = logits.clone()
        start = time.perf_counter()
        sampler.sample(work, batch, seqs, penalties)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def _has_c_sampling() -> bool:
    from batchgen.kernels import cpu_sampling

    return cpu_sampling.is_available()


def run_sampler(args: argparse.Namespace) -> dict:
    rows = []
    for vocab in args.vocab:
        for name, settings in SETTINGS.items():
            ms = time_sampler(args.rows, vocab, settings, args.reps)
            rows.append({"num_rows": args.rows, "vocab": vocab, "setting": name, "ms_per_step": round(ms, 2)})
            print(f"N={args.rows} V={vocab} {name:<22} {ms:8.2f} ms", flush=True)
    return {"part": "sampler", "threads": torch.get_num_threads(), "rows": rows}


def run_engine(args: argparse.Namespace) -> dict:
    from batchgen.bench.options import DEFAULT_MODEL
    from batchgen.bench.workloads import random_workload, special_token_ids
    from batchgen.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model or DEFAULT_MODEL, dtype="float32", device="cpu",
                                    max_num_seqs=args.requests, enable_prefix_caching=False, kv_cache_memory="1GiB",
                                    num_threads=args.threads))
    work = random_workload(args.requests, 100, 200, args.output_len, 0, engine.model_cfg.vocab_size,
                           special_token_ids(engine.tokenizer.hf))
    modes = {"greedy": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
             "sampled": SamplingParams(**SAMPLED, seed=0, max_tokens=args.output_len, ignore_eos=True)}

    def generate(params: SamplingParams, tag: str) -> float:
        for r in work.requests:
            engine.add_request(f"{tag}-{r.request_id}", None, params, prompt_token_ids=r.prompt_token_ids)
        start = time.perf_counter()
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
        return tokens / (time.perf_counter() - start)

    generate(modes["greedy"], "warm")  # untimed
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for round_index in range(args.rounds):
        for name, params in modes.items():
            rates[name].append(generate(params, f"{name}{round_index}"))
            print(f"round {round_index} {name:<8} {rates[name][-1]:8.1f} tok/s", flush=True)
    ratios = [s / g for s, g in zip(rates["sampled"], rates["greedy"])]
    result = {"part": "engine", "num_requests": args.requests, "output_len": args.output_len, "sampled": SAMPLED,
              "tokens_per_s": rates, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    print(f"sampled / greedy: median {result['median_ratio']:.3f} over {args.rounds} rounds", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    sampler = parts.add_parser("sampler", help="Sampler.sample alone on synthetic logits")
    sampler.add_argument("--rows", type=int, default=256)
    sampler.add_argument("--vocab", type=lambda s: [int(v) for v in s.split(",")], default=[49152, 128256])
    sampler.add_argument("--reps", type=int, default=5)
    engine = parts.add_parser("engine", help="sampled vs greedy decoding on a model, alternating rounds")
    engine.add_argument("--model", default=None, help="default: the bundled model")
    engine.add_argument("--rounds", type=int, default=3)
    engine.add_argument("--requests", type=int, default=64)
    engine.add_argument("--output-len", type=int, default=64)
    engine.add_argument("--threads", type=int, default=None)
    for sub in (sampler, engine):
        sub.add_argument("--out", default=None, help="also write the JSON result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_sampler(args) if args.part == "sampler" else run_engine(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

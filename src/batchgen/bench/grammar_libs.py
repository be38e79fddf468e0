"""Grammar libraries for structured output, measured side by side: xgrammar and llguidance.

`python -m batchgen.bench.grammar_libs [--batch 64] [--threads 2] [--repeats 3]` loads the bundled
model's tokenizer (SmolLM2, vocabulary 49152) and, for each library that is installed, measures:

- tokenizer info: building the library's view of the vocabulary (once per engine);
- compile: the 30-field schema (bench/structured_schemas.py WIDE_SCHEMA) compiled cold (a fresh
  compiler, nothing cached) and again (the library's own cache, or a copy of a compiled matcher);
  the first mask after a compile is timed apart (llguidance builds its lexer lazily);
- a decode run at batch B: B matchers, each walked through the tokens of its own valid record
  (json.dumps of wide_instance, then EOS); per step every row's bitmask row is filled, the packed
  (B, V/32) int32 mask is applied to a (B, V) float32 logits tensor on the CPU, and each matcher
  accepts its next token (checked to be allowed by the mask just filled). Reported per step, for
  the steps where all B rows are still running (medians): the fill one row after another, the fill through
  the library's own batch call with `--threads` threads, the apply (the library's own CPU apply and
  batchgen's torch ops, engine/decoding/structured/bitmask.py), and the accepts;
- whether the fill releases the GIL (two Python threads filling at once vs one);
- the installed size of the library and what it requires.

Then it prints the choice: the library whose worse case per constrained row is cheaper, a schema shared
by every row (fill + accept only) or a schema per row (a cold compile too). The
machine is shared with other work while these run: figures are indicative, rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared CPU, spinning threads wait on descheduled
# peers at every barrier and torch's 2-thread ops ran 5-10x slower (read when torch is first imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from batchgen.bench.structured_schemas import WIDE_SCHEMA, wide_instance
from batchgen.engine.decoding.structured.bitmask import apply_token_bitmask

VOCAB_SIZE = 49152  # the bundled SmolLM2's; the bench checks the tokenizer agrees


def _seconds(fn, repeats: int) -> tuple[float, object]:
    """Best of `repeats` wall times of fn(), and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


@dataclass
class LibFigures:
    name: str
    version: str = ""
    license: str = ""
    requires: list[str] = field(default_factory=list)
    installed_mb: float = 0.0
    tokenizer_info_s: float = 0.0
    compile_cold_s: float = 0.0
    compile_cached_s: float = 0.0
    first_mask_s: float = 0.0
    num_steps: int = 0
    fill_ms: float = 0.0  # per step, all rows, one after another
    fill_batch_ms: float = 0.0  # per step, the library's batch call
    apply_lib_ms: float = 0.0
    apply_torch_ms: float = 0.0
    accept_ms: float = 0.0
    gil_speedup: float = 0.0  # two threads' fill rate over one thread's

    @property
    def step_ms(self) -> float:
        """The host cost a constrained batch adds per step: the faster fill, the faster apply, accepts."""
        return min(self.fill_ms, self.fill_batch_ms) + min(self.apply_lib_ms, self.apply_torch_ms) + self.accept_ms


def _installed(dist: str, packages: list[str]) -> tuple[str, str, list[str], float]:
    meta = metadata.metadata(dist)
    license_ = meta.get("License-Expression") or meta.get("License") or "?"
    requires = [r for r in (meta.get_all("Requires-Dist") or []) if "extra ==" not in r]
    files = metadata.files(dist) or []
    size = 0
    for f in files:
        path = Path(f.locate())
        if path.is_file() and any(str(f).startswith(p) for p in packages):
            size += path.stat().st_size
    return meta["Version"], license_, requires, size / 1e6


class Walk:
    """B rows of token ids: each a valid record's tokens and EOS; the bench steps through them."""

    def __init__(self, hf_tokenizer, eos_token_id: int, batch: int, seed: int = 0):
        rng = random.Random(seed)
        self.rows = [hf_tokenizer.encode(json.dumps(wide_instance(rng)), add_special_tokens=False) + [eos_token_id]
                     for _ in range(batch)]
        self.num_steps = min(len(r) for r in self.rows)  # steps with every row running


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """batchgen's torch ops (engine/decoding/structured/bitmask.py), every row constrained."""
    apply_token_bitmask(logits, bitmask, torch.arange(logits.shape[0]))


def _time_steps(walk: Walk, matchers, fill_row, fill_batch, apply_lib, accept, is_allowed, vocab: int):
    """Per-step median milliseconds (medians: the shared machine's stalls hit single steps): fill (rows
    in turn), fill (batch call), apply (library), apply (batchgen's torch ops), accept."""
    batch = len(matchers)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch, vocab)
    times: list[list[float]] = [[] for _ in range(5)]
    for step in range(walk.num_steps):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            fill_row(m, bitmask, i)
        t1 = time.perf_counter()
        fill_batch(matchers, bitmask)
        t2 = time.perf_counter()
        masked = logits.clone()
        t3 = time.perf_counter()
        apply_lib(masked, bitmask)
        t4 = time.perf_counter()
        masked2 = logits.clone()
        t5 = time.perf_counter()
        apply_torch(masked2, bitmask)
        t6 = time.perf_counter()
        if not torch.equal(masked, masked2):
            raise AssertionError("the library's apply and the torch apply disagree")
        tokens = [row[step] for row in walk.rows]
        for i, token in enumerate(tokens):
            if not is_allowed(bitmask, i, token) or masked[i, token] == float("-inf"):
                raise AssertionError(f"row {i} step {step}: token {token} is valid but masked")
        t7 = time.perf_counter()
        for m, token in zip(matchers, tokens):
            accept(m, token)
        t8 = time.perf_counter()
        for k, dt in enumerate((t1 - t0, t2 - t1, t4 - t3, t6 - t5, t8 - t7)):
            times[k].append(dt)
    return [1000 * statistics.median(t) for t in times]


def _bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _gil_speedup(fill_one, matchers, rounds: int = 40) -> float:
    """Fills per second with two Python threads over one: ~1 holds the GIL, ~2 releases it (2 free cores)."""
    half = len(matchers) // 2

    def work(ms, bitmask):
        for _ in range(rounds):
            for i, m in enumerate(ms):
                fill_one(m, bitmask, i)

    masks = [torch.zeros((half, VOCAB_SIZE // 32), dtype=torch.int32) for _ in range(2)]
    start = time.perf_counter()
    work(matchers[:half], masks[0])
    work(matchers[half:2 * half], masks[1])
    serial = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(matchers[k * half:(k + 1) * half], masks[k])) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - start)


def bench_xgrammar(hf_tokenizer, eos: int, walk: Walk, threads: int, repeats: int) -> LibFigures:
    import xgrammar as xgr

    f = LibFigures("xgrammar")
    f.version, f.license, f.requires, f.installed_mb = _installed("xgrammar", ["xgrammar/"])
    tvm_mb = _installed("apache-tvm-ffi", ["tvm_ffi/"])[3]
    f.installed_mb += tvm_mb  # its required native runtime
    f.tokenizer_info_s, info = _seconds(
        lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[eos]), repeats)
    schema = json.dumps(WIDE_SCHEMA)

    def cold():
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        return compiler, compiler.compile_json_schema(schema, any_whitespace=True)

    f.compile_cold_s, (compiler, compiled) = _seconds(cold, repeats)
    f.compile_cached_s, _ = _seconds(lambda: compiler.compile_json_schema(schema, any_whitespace=True), repeats)
    mask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    f.first_mask_s, _ = _seconds(lambda: xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0), repeats)

    matchers = [xgr.GrammarMatcher(compiled) for _ in walk.rows]
    batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def accept(m, token):
        if not m.accept_token(token):
            raise AssertionError(f"xgrammar refused token {token}")

    def apply_lib(logits, bitmask):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB_SIZE)

    ms = _time_steps(walk, matchers, lambda m, b, i: m.fill_next_token_bitmask(b, i),
                     lambda ms_, b: batcher.batch_fill_next_token_bitmask(ms_, b), apply_lib, accept, _bit, VOCAB_SIZE)
    f.fill_ms, f.fill_batch_ms, f.apply_lib_ms, f.apply_torch_ms, f.accept_ms = ms
    f.num_steps = walk.num_steps
    if not all(m.is_terminated() for m, row in zip(matchers, walk.rows) if len(row) == walk.num_steps):
        raise AssertionError("xgrammar: a row that accepted its whole record and EOS is not terminated")
    fresh = [xgr.GrammarMatcher(compiled) for _ in walk.rows]
    f.gil_speedup = _gil_speedup(lambda m, b, i: m.fill_next_token_bitmask(b, i), fresh)
    return f


def bench_llguidance(hf_tokenizer, eos: int, walk: Walk, threads: int, repeats: int) -> LibFigures:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    f = LibFigures("llguidance")
    f.version, f.license, f.requires, f.installed_mb = _installed("llguidance", ["llguidance/"])
    f.tokenizer_info_s, lltok = _seconds(lambda: llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB_SIZE),
                                         repeats)
    defaults = {"whitespace_flexible": True}

    def cold():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(WIDE_SCHEMA), defaults=defaults)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise AssertionError(matcher.get_error())
        return matcher

    # llguidance has no compiled-grammar object: a compile is a matcher's construction, and a cached
    # grammar is a matcher kept as a template and deep-copied per request.
    f.compile_cold_s, template = _seconds(cold, repeats)
    f.compile_cached_s, _ = _seconds(template.deep_copy, repeats)
    mask = llguidance.torch.allocate_token_bitmask(1, VOCAB_SIZE)
    f.first_mask_s, _ = _seconds(lambda: llguidance.torch.fill_next_token_bitmask(cold(), mask, 0), repeats)

    matchers = [template.deep_copy() for _ in walk.rows]
    executor = llguidance.LLExecutor(num_threads=threads)

    def fill_batch(ms_, bitmask):
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms_)], bitmask)

    def accept(m, token):
        if not m.consume_token(token):
            raise AssertionError(f"llguidance refused token {token}: {m.get_error()}")

    def apply_lib(logits, bitmask):
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)

    ms = _time_steps(walk, matchers, lambda m, b, i: llguidance.torch.fill_next_token_bitmask(m, b, i), fill_batch,
                     apply_lib, accept, _bit, VOCAB_SIZE)
    f.fill_ms, f.fill_batch_ms, f.apply_lib_ms, f.apply_torch_ms, f.accept_ms = ms
    f.num_steps = walk.num_steps
    fresh = [template.deep_copy() for _ in walk.rows]
    f.gil_speedup = _gil_speedup(lambda m, b, i: llguidance.torch.fill_next_token_bitmask(m, b, i), fresh)
    return f


BENCHES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}


def format_figures(figures: list[LibFigures], batch: int, threads: int) -> str:
    rows = [
        ("version", lambda f: f.version),
        ("license", lambda f: f.license),
        ("installed MB (with native runtime)", lambda f: f"{f.installed_mb:.1f}"),
        ("requires", lambda f: ", ".join(r.split(";")[0].strip() for r in f.requires) or "nothing"),
        ("tokenizer info (s)", lambda f: f"{f.tokenizer_info_s:.3f}"),
        ("compile 30-field schema, cold (s)", lambda f: f"{f.compile_cold_s:.4f}"),
        ("compile, cached (s)", lambda f: f"{f.compile_cached_s:.6f}"),
        ("first mask after compile (s)", lambda f: f"{f.first_mask_s:.4f}"),
        (f"fill {batch} rows in turn (ms/step)", lambda f: f"{f.fill_ms:.2f}"),
        (f"fill {batch} rows, batch call {threads} threads (ms/step)", lambda f: f"{f.fill_batch_ms:.2f}"),
        (f"apply ({batch}, V) lib kernel (ms/step)", lambda f: f"{f.apply_lib_ms:.2f}"),
        (f"apply ({batch}, V) torch ops (ms/step)", lambda f: f"{f.apply_torch_ms:.2f}"),
        (f"accept {batch} tokens (ms/step)", lambda f: f"{f.accept_ms:.2f}"),
        ("host cost per step, best path (ms)", lambda f: f"{f.step_ms:.2f}"),
        ("fill: 2 threads / 1 thread rate (GIL)", lambda f: f"{f.gil_speedup:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{f.name:>14}" for f in figures)]
    for label, get in rows:
        lines.append(f"{label:{width}}  " + "  ".join(f"{get(f):>14}" for f in figures))
    return "\n".join(lines)


def row_costs(f: LibFigures, num_tokens: float, batch: int) -> tuple[float, float]:
    """Host milliseconds a constrained row of `num_tokens` tokens costs: with its schema shared by every
    row (compiled once: only its share of each step's fill + accept), and with a schema of its own
    (plus a cold compile and the first mask)."""
    shared = num_tokens * (min(f.fill_ms, f.fill_batch_ms) + f.accept_ms) / batch
    return shared, shared + 1000 * (f.compile_cold_s + f.first_mask_s)


def choose(figures: list[LibFigures], num_tokens: float, batch: int) -> str:
    """The library whose worse case is cheaper: a synthesis job may share one schema over every row or
    carry a schema per row (both are normal), so the pick must not blow up in either. The apply is not
    in it: batchgen applies the mask with its own torch ops whatever the library."""
    if len(figures) == 1:
        return f"only {figures[0].name} is installed"
    costs = {f.name: row_costs(f, num_tokens, batch) for f in figures}
    best = min(figures, key=lambda f: max(costs[f.name]))
    detail = "; ".join(f"{name}: {shared:.1f} ms per row with a shared schema, {own:.1f} ms with its own"
                       for name, (shared, own) in costs.items())
    return f"{best.name} (worse case cheaper; rows of {num_tokens:.0f} tokens at batch {batch}: {detail})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchgen.bench.grammar_libs", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and the libraries' batch threads")
    parser.add_argument("--repeats", type=int, default=3, help="best-of for the one-off timings")
    parser.add_argument("--libs", default="xgrammar,llguidance")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from batchgen.bench.options import DEFAULT_MODEL
    from batchgen.engine.loader.source import resolve_model
    from batchgen.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(DEFAULT_MODEL))
    if len(tokenizer.hf) != VOCAB_SIZE:
        raise SystemExit(f"the bundled tokenizer has {len(tokenizer.hf)} tokens, the bench expects {VOCAB_SIZE}")
    walk = Walk(tokenizer.hf, tokenizer.eos_token_id, args.batch)
    print(f"batch {args.batch}, {walk.num_steps} steps with every row running "
          f"(records of {min(map(len, walk.rows))}-{max(map(len, walk.rows))} tokens), "
          f"{args.threads} threads; a shared machine: indicative figures", flush=True)
    figures = []
    for name in args.libs.split(","):
        try:
            figures.append(BENCHES[name](tokenizer.hf, tokenizer.eos_token_id, walk, args.threads, args.repeats))
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
    if figures:
        print(format_figures(figures, args.batch, args.threads))
        num_tokens = sum(map(len, walk.rows)) / len(walk.rows)
        print("choice:", choose(figures, num_tokens, args.batch))


if __name__ == "__main__":
    main()

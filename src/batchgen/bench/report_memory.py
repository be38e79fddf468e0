"""`batchgen report` on a synthetic output folder of N rows: its time and peak memory growth.

    python -m batchgen.bench.report_memory --rows 1000000 [--against] [--keep DIR]

Builds a folder with the real output schema (batchgen.pipeline.schema) and a `_SUCCESS` counted by
the pipeline's own summary code: 100 parts of rows_per_unit rows, null completions, 8-token
completion_token_ids, random latencies, a kept `category` column (20 values). With --against a second
folder of the same ids differs in 10% of the rows' tokens and lacks 1% of them. The report then runs in
a fresh subprocess, which measures its resident memory after its imports and its peak at the end
(VmRSS and VmHWM): the growth is what reading, joining and plotting the rows cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NUM_CATEGORIES = 20
TOKENS_PER_ROW = 8


def write_synthetic_run(folder: str, num_rows: int, num_parts: int = 100, seed: int = 0,
                        changed_share: float = 0.0, dropped_share: float = 0.0) -> dict:
    """A complete output folder of `num_rows` rows (ids 0..num_rows-1): `changed_share` of the rows get
    another token at a random position, `dropped_share` are left out. Returns its _SUCCESS record and
    the numbers of changed (and kept) and dropped rows."""
    from batchgen.pipeline.run_record import EngineReport, RunRecord
    from batchgen.pipeline.schema import output_schema
    from batchgen.pipeline.summary import Totals

    os.makedirs(folder, exist_ok=True)
    schema = output_schema(pa.field("id", pa.int64()), [pa.field("category", pa.string())], False)
    rng = np.random.default_rng(seed)
    ids = np.arange(num_rows, dtype=np.int64)
    keep = np.random.default_rng(1).random(num_rows) >= dropped_share
    changed = np.random.default_rng(2).random(num_rows) < changed_share
    totals = Totals()
    bounds = np.linspace(0, num_rows, num_parts + 1).astype(np.int64)
    for p in range(num_parts):
        rows = np.arange(bounds[p], bounds[p + 1])
        rows = rows[keep[rows]]
        n = rows.size
        tokens = (ids[rows, None] * 31 + np.arange(TOKENS_PER_ROW)[None, :]) % 49_152  # (n, 8), same in both runs
        where = np.random.default_rng(3 + p).integers(0, TOKENS_PER_ROW, n)
        tokens[changed[rows], where[changed[rows]]] += 1
        ttft = rng.gamma(2.0, 0.05, n)
        tpot = rng.gamma(4.0, 0.005, n)
        columns = {
            "id": pa.array(ids[rows]),
            "sample_index": pa.array(np.zeros(n, np.int32)),
            "completion": pa.nulls(n, pa.string()),
            "completion_token_ids": pa.ListArray.from_arrays(
                pa.array(np.arange(n + 1, dtype=np.int32) * TOKENS_PER_ROW), pa.array(tokens.ravel().astype(np.int32))),
            "finish_reason": pa.array(np.where(ids[rows] % 10 < 3, "length", "stop")),
            "prompt_tokens": pa.array(20 + ids[rows] * 7 % 380),  # a row's prompt: the same in both runs
            "cached_tokens": pa.array(np.zeros(n, np.int64)),
            "completion_tokens": pa.array(np.full(n, TOKENS_PER_ROW, np.int64)),
            "cumulative_logprob": pa.nulls(n, pa.float64()),
            "queue_s": pa.array(rng.gamma(1.0, 0.01, n)),
            "ttft_s": pa.array(ttft),
            "tpot_s": pa.array(tpot),
            "e2e_s": pa.array(ttft + tpot * (TOKENS_PER_ROW - 1)),
            "num_accepted_tokens": pa.nulls(n, pa.int64()),
            "error": pa.nulls(n, pa.string()),
            "category": pa.array([f"category-{c:02d}" for c in rows % NUM_CATEGORIES]),
        }
        table = pa.table(columns).cast(schema)
        pq.write_table(table, os.path.join(folder, f"part-{p:05d}.parquet"))
        totals.add_table(table)
    record = RunRecord.of_run("synthetic", "0" * 64, whole=totals, this_run=totals, generation_seconds=100.0,
                              resumed=False, engine=EngineReport(model="synthetic-model"))
    with open(os.path.join(folder, "_SUCCESS"), "w") as f:
        f.write(record.to_json())
    return {"success": record, "num_changed": int((changed & keep).sum()), "num_dropped": int((~keep).sum())}


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (the peak) of this process, from /proc/self/status. Not getrusage's
    ru_maxrss: Linux carries it across exec, so a child started by a big parent reports the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(out: str, against: str | None, by: str | None, page: str) -> dict:
    """In this process: the report's seconds and its peak memory over the resident size after imports."""
    import matplotlib.figure  # noqa: F401

    import batchgen.report  # noqa: F401  (imports counted before the baseline)
    from batchgen.report import ReportConfig, write_report

    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    write_report(ReportConfig(out=out, against=against, by=by, output=page))
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    return {"seconds": seconds, "rss_before_mb": before / 2**20, "peak_rss_mb": peak / 2**20,
            "growth_mb": (peak - before) / 2**20, "page_bytes": os.path.getsize(page)}


def run_measured(out: str, against: str | None, by: str | None, page: str) -> dict:
    """`measure` in a fresh interpreter (the folder building above does not count)."""
    command = [sys.executable, "-m", "batchgen.bench.report_memory", "--measure", out, "--page", page]
    if against:
        command += ["--against", against]
    if by:
        command += ["--by", by]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measured report failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--against", nargs="?", const="", default=None,
                        help="also report against a second synthetic run (or, with --measure, this folder)")
    parser.add_argument("--by", default="category")
    parser.add_argument("--keep", help="build the folders here and keep them (default: a temporary folder)")
    parser.add_argument("--measure", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--page", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.against or None, args.by or None, args.page)))
        return
    with tempfile.TemporaryDirectory(prefix="batchgen-report-bench-") as scratch:
        root = args.keep or scratch
        start = time.perf_counter()
        write_synthetic_run(os.path.join(root, "run"), args.rows)
        results = {"rows": args.rows, "build_seconds": time.perf_counter() - start}
        results["report"] = run_measured(os.path.join(root, "run"), None, args.by, os.path.join(root, "report.html"))
        if args.against is not None:
            write_synthetic_run(os.path.join(root, "baseline"), args.rows, seed=1, changed_share=0.1,
                                dropped_share=0.01)
            results["report_against"] = run_measured(os.path.join(root, "run"), os.path.join(root, "baseline"),
                                                     args.by, os.path.join(root, "report-against.html"))
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

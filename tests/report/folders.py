"""Output folders written by hand with the pipeline's own schema and `_SUCCESS` code, for report tests
that need rows no model would write (markup in a completion, chosen tokens, repeated ids, chosen metric
verdicts)."""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.metrics import MetricSpec, metric_field
from batchgen.pipeline.run_record import EngineReport, RunRecord
from batchgen.pipeline.schema import output_schema
from batchgen.pipeline.summary import Totals


def row(id_, completion: str | None = "text", tokens: list[int] | None = None, **fields) -> dict:
    """One output row; fields not given get plausible values."""
    tokens = [ord(c) for c in completion or ""] if tokens is None else tokens
    base = {"id": id_, "sample_index": 0, "completion": completion, "completion_token_ids": tokens,
            "finish_reason": "stop", "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": len(tokens),
            "cumulative_logprob": None, "queue_s": 0.001, "ttft_s": 0.01, "tpot_s": 0.002,
            "e2e_s": 0.01 + 0.002 * max(0, len(tokens) - 1), "num_accepted_tokens": None, "error": None}
    return {**base, **fields}


INT64 = pa.int64()


def write_run(url: str, rows: list[dict], rows_per_part: int = 4, id_type: pa.DataType = INT64,
              keep: tuple[pa.Field, ...] = (), model: str | None = "test-model", job: str = "hand-made",
              with_success: bool = True, metrics: dict[str, MetricSpec] | None = None,
              success_metrics: dict | None = None, is_scoring: bool = False) -> RunRecord | None:
    """Parts of `rows_per_part` rows and a `_SUCCESS` counted from them under `url` (any fsspec URL);
    returns the `_SUCCESS` record. `metrics`: verdict columns `metric_<name>` as a job's `metrics:` section
    writes them (the rows hold their values); `success_metrics`: `_SUCCESS`'s `metrics` key (None: none);
    `is_scoring`: a loglikelihood job's columns."""
    metric_fields = [metric_field(name, spec) for name, spec in (metrics or {}).items()]
    schema = output_schema(pa.field("id", id_type), [*keep, *metric_fields], False, is_scoring=is_scoring)
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    totals = Totals()
    for index, start in enumerate(range(0, len(rows), rows_per_part)):
        chunk = rows[start:start + rows_per_part]
        table = pa.Table.from_pylist([{name: r.get(name) for name in schema.names} for r in chunk], schema=schema)
        with fs.open(f"{root}/part-{index:05d}.parquet", "wb") as f:
            pq.write_table(table, f)
        totals.add_table(table)
    if not with_success:
        return None
    record = RunRecord.of_run(job, "ab" * 32, whole=totals, this_run=totals, generation_seconds=2.0, resumed=False,
                              engine=EngineReport(model=model, kernels={"device": "cpu"}))
    success = {k: v for k, v in record.to_dict().items() if k != "metrics"}  # only the metrics asked for
    if success_metrics is not None:
        success["metrics"] = success_metrics
    with fs.open(f"{root}/_SUCCESS", "w") as f:
        f.write(json.dumps(success, indent=2))
    return record

"""`batchgen card OUT`: a dataset card (README.md) for a finished output folder, as the Hugging Face Hub reads it.

The YAML front matter holds what the Hub's dataset viewer and `datasets` read: `configs` (the parts as the
default config's train split, by the glob `part-*.parquet`, so README.md and `_SUCCESS` beside them are
not read as data), `dataset_info` (the features in `datasets`' YAML form, the split's row count and
bytes) and `tags`; `license` is left for the user to set (the generating model's license and the input's
terms decide it, not batchgen). The body gives the counts, the finish reasons, the job's metrics and the
full provenance of `_SUCCESS` (every setting that made the rows).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchgen.pipeline.output import SUCCESS_NAME
from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.storage import Storage
from batchgen.report.config import ReportError

CARD_NAME = "README.md"
DATA_FILES = "part-*.parquet"
# Arrow type names that `datasets` spells otherwise.
_DTYPES = {"float": "float32", "double": "float64", "halffloat": "float16"}


def _inner(t: pa.DataType) -> Any:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"list": _inner(t.value_type)}
    if pa.types.is_struct(t):
        return [{"name": f.name, **_spec(f.type)} for f in t]
    return _DTYPES.get(str(t), str(t))


def _spec(t: pa.DataType) -> dict[str, Any]:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"list": _inner(t.value_type)}
    if pa.types.is_struct(t):
        return {"struct": _inner(t)}
    return {"dtype": _inner(t)}


def features_yaml(schema: pa.Schema) -> list[dict[str, Any]]:
    """The schema as `dataset_info.features` (the form `datasets.Features._to_yaml_list` writes)."""
    return [{"name": f.name, **_spec(f.type)} for f in schema]


def _part_names(storage: Storage) -> list[str]:
    return sorted(n for n in storage.list_names() if n.startswith("part-") and n.endswith(".parquet"))


def build_card(out: str, storage_options: dict | None = None) -> str:
    """The card's text for the finished output folder `out` (ReportError when it is not one)."""
    storage = Storage(out, storage_options)
    names = _part_names(storage)
    if not names:
        raise ReportError(f"{out}: no part-*.parquet files (not a batchgen output folder, or nothing ran)")
    try:
        record = RunRecord.from_json(storage.read_text(SUCCESS_NAME))
    except FileNotFoundError:
        raise ReportError(f"{out} has no {SUCCESS_NAME}: finish the job first (a card describes a whole output)") \
            from None
    reasons: Counter[str] = Counter()
    num_bytes = 0
    schema = None
    for name in names:
        with storage.fs.open(storage.join(name), "rb") as f:
            file = pq.ParquetFile(f)
            schema = schema or file.schema_arrow
            num_bytes += file.metadata.serialized_size + sum(
                file.metadata.row_group(i).total_byte_size for i in range(file.metadata.num_row_groups))
            for value, count in Counter(file.read(columns=["finish_reason"]).column(0).to_pylist()).items():
                reasons[str(value)] += count
    front = {
        "pretty_name": record.job,
        "tags": ["synthetic", "batchgen"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": DATA_FILES}]}],
        "dataset_info": {
            "features": features_yaml(pa.schema([f for f in schema])),  # the fields, without the metadata
            "splits": [{"name": "train", "num_bytes": num_bytes, "num_examples": record.num_rows}],
            "dataset_size": num_bytes,
        },
    }
    return _render(front, record, reasons)


def _render(front: dict, record: RunRecord, reasons: Counter) -> str:
    provenance = record.provenance
    model = (provenance.get("model") or {}) if provenance else {}
    lines = [
        "---",
        "# license: set the dataset's license here (the model's license and the input's terms decide it)",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {record.job}",
        "",
        f"Generated with batchgen {provenance.get('batchgen_version') or ''} from the model "
        f"`{record.model or model.get('path') or '?'}`. One row per (prompt, sample); the files are "
        f"`{DATA_FILES}` (rows in input order within each).",
        "",
        "## Counts",
        "",
        "| | |",
        "|---|---|",
        f"| requests | {record.num_requests:,} |",
        f"| rows | {record.num_rows:,} |",
        f"| failed requests | {record.num_errors:,} |",
        f"| prompt tokens | {record.prompt_tokens:,} |",
        f"| completion tokens | {record.completion_tokens:,} |",
        "",
        "## Finish reasons",
        "",
        "| finish_reason | rows | share |",
        "|---|---|---|",
        *[f"| {reason} | {count:,} | {count / max(record.num_rows, 1):.1%} |" for reason, count in reasons.most_common()],
        "",
    ]
    if record.error_reasons:  # why requests failed (the run's five most frequent messages, numbers as N)
        lines += ["## Error reasons", "", "| error | requests |", "|---|---|",
                  *[f"| {_cell(reason)} | {count:,} |" for reason, count in record.error_reasons.items()], ""]
    if record.metrics:
        lines += ["## Metrics", "", "| metric | value | stderr | n |", "|---|---|---|---|",
                  *[f"| {name} | {m.value} | {m.stderr} | {m.n:,} |" for name, m in record.metrics.items()], ""]
    lines += [
        "## Provenance",
        "",
        "Every setting that made these rows, as batchgen resolved it (also in `_SUCCESS` and in each part's "
        "Parquet metadata under `batchgen.provenance`):",
        "",
        "```json",
        json.dumps({"config_hash": record.config_hash, **provenance}, indent=1, default=str),
        "```",
        "",
        "## License",
        "",
        "Not set by batchgen: add `license:` to the front matter above.",
        "",
    ]
    return "\n".join(lines)


def write_card(out: str, path: str | None = None, storage_options: dict | None = None) -> str:
    """Write the card (default: README.md inside `out`) whole; returns where it went."""
    text = build_card(out, storage_options)
    if path is None:
        return Storage(out, storage_options).write_text_atomic(CARD_NAME, text)
    folder, _, name = path.replace("\\", "/").rpartition("/")
    return Storage(folder or ".", storage_options).write_text_atomic(name, text)


def _cell(text: str) -> str:
    """Text in a Markdown table cell: its pipes escaped, on one line."""
    return " ".join(text.split()).replace("|", "\\|")

"""The columns a judge stage parses out of its JSON answers (output.parse_json), known before it runs."""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.pipeline.json_columns import schema_fields


def judge_columns(stage: dict, base_dir: Path) -> list[str]:
    """The parsed columns of a stage mapping with output.parse_json: its sampling.structured schema's
    top-level properties (an inline `json`, or `json_file` relative to the job file); none without, or
    when the schema cannot be read (the stage's own validation names that problem)."""
    if not (stage.get("output") or {}).get("parse_json"):
        return []
    structured = (stage.get("sampling") or {}).get("structured") or {}
    schema = structured.get("json")
    try:
        if schema is None and isinstance(structured.get("json_file"), str):
            path = Path(structured["json_file"])
            schema = (path if path.is_absolute() else base_dir / path).read_text()
        if isinstance(schema, str):
            schema = json.loads(schema)
    except (OSError, ValueError):
        return []
    return [f.name for f in schema_fields(schema)] if isinstance(schema, dict) else []

"""A job's structured output: `sampling.structured` (one constraint for every row) and `input.schema_column`
(a JSON schema per row).

`sampling.structured` holds one of StructuredOutputsParams' constraints under its own name (`json`:
an inline schema, `regex`, `choice`, `grammar`, `json_object`), or `json_file`: a schema file, relative
to the job file, read when the job is loaded (the config hash covers its content, not its path); plus
`disable_any_whitespace`. A row's schema (the column's JSON text; null: the job's constraint, if any)
replaces the job's constraint for that row and keeps its `disable_any_whitespace`; a schema that cannot
be used is that row's error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.engine.decoding.structured import (
    StructuredOutputError,
    StructuredOutputsParams,
    StructuredOutputUnavailable,
)
from batchgen.engine.decoding.structured.params import CONSTRAINT_FIELDS
from batchgen.pipeline.errors import JobError

FILE_KEY = "json_file"
OPTION_KEYS = ("disable_any_whitespace",)
STRUCTURED_KEYS = (*CONSTRAINT_FIELDS, FILE_KEY, *OPTION_KEYS)


def check_keys(values: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what is wrong) for a `sampling.structured` mapping's keys (None: they are fine). Whether
    its values form a usable constraint is StructuredOutputsParams' to say."""
    unknown = [k for k in values if k not in STRUCTURED_KEYS]
    if unknown:
        return unknown[0], f"unknown key; allowed keys here: {', '.join(STRUCTURED_KEYS)}"
    if FILE_KEY in values:
        if not isinstance(values[FILE_KEY], str) or not values[FILE_KEY]:
            return FILE_KEY, "must be a path to a JSON schema file"
        given = [k for k in CONSTRAINT_FIELDS if values.get(k) is not None]
        if given:
            return FILE_KEY, f"set json_file or {given[0]}, not both (one constraint per job)"
    return None


def job_constraint(values: dict[str, Any] | None, file_schema: dict | None) -> StructuredOutputsParams | None:
    """The job's constraint (None: none). `file_schema`: json_file's content once read (before that a
    json_file constraint is None). StructuredOutputError naming the field when it cannot be used."""
    if not values:
        return None
    fields = {k: v for k, v in values.items() if k != FILE_KEY}
    if FILE_KEY in values:
        if file_schema is None:
            return None
        fields["json"] = file_schema
    if not any(fields.get(k) is not None for k in CONSTRAINT_FIELDS):
        return None  # options alone: they apply to the rows' schemas (input.schema_column)
    return StructuredOutputsParams.from_dict(fields)


def read_schema_file(path: str) -> dict:
    """A JSON schema file's content; JobError naming the key and the file when it cannot be used."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"sampling.structured.json_file: cannot read {path}: {exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobError(f"sampling.structured.json_file: {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise JobError(f"sampling.structured.json_file: {path} nests too deep to be a schema") from None
    if not isinstance(schema, dict):
        raise JobError(f"sampling.structured.json_file: {path} must hold a JSON schema object; got "
                       f"{type(schema).__name__}")
    return schema


def row_constraint(schema_text: str, job_values: dict[str, Any] | None) -> StructuredOutputsParams:
    """A row's schema (JSON text) as its constraint, with the job's options; StructuredOutputError
    naming the field when it is not a usable schema."""
    options = {k: v for k, v in (job_values or {}).items() if k in OPTION_KEYS}
    return StructuredOutputsParams(json=schema_text, **options)


def check_job_constraint(job, compile_grammar) -> None:
    """Compile the job's constraint (sampling.structured) with `compile_grammar` (an engine's, or one
    over the model's tokenizer alone): JobError naming the key when the library refuses it, before
    any row runs."""
    constraint = job.sampling.constraint()
    if constraint is None:
        return
    try:
        compile_grammar(constraint)
    except StructuredOutputUnavailable as exc:
        raise JobError(f"sampling.structured: {exc}") from None
    except StructuredOutputError as exc:
        values = job.sampling.structured
        key = FILE_KEY if exc.field == "json" and FILE_KEY in values else exc.field
        where = f" ({values[FILE_KEY]})" if key == FILE_KEY else ""
        raise JobError(f"sampling.structured.{key}{where}: {exc.reason}") from None


def check_job_constraint_before_load(job) -> None:
    """check_job_constraint over the model's tokenizer alone (`batchgen validate`: no weights load). A
    remote model is left to the run (its tokenizer would be copied first)."""
    path = job.model.path
    if job.sampling.constraint() is None or ("://" in path and not path.startswith("file://")):
        return
    check_job_constraint(job, tokenizer_compiler(path, job.model.revision).compile)


def tokenizer_compiler(model_path: str, revision: str | None = None):
    """A grammar compiler over the model's tokenizer and vocabulary, without its weights (`batchgen
    validate`): the tokenizer and the config's EOS ids, as the engine builds them."""
    from batchgen.engine.decoding.structured import GrammarCompiler
    from batchgen.engine.loader.source import resolve_model
    from batchgen.engine.text.tokenizer import Tokenizer
    from batchgen.pipeline.capacity_plan import read_model

    model_cfg, _, _ = read_model(model_path, revision)
    tokenizer = Tokenizer(resolve_model(model_path, revision))
    eos = set(model_cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    return GrammarCompiler(tokenizer.hf, model_cfg.vocab_size, sorted(eos))

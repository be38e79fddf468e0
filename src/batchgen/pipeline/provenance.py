"""Provenance: how an output was made, fully resolved, so a published dataset can say it.

`job_provenance` gathers the batchgen version, the model (its path as the job names it, where it was
loaded from, the revision asked for and the one a Hugging Face cache snapshot resolves to, every file's
size and sha256), every model and engine setting, every sampling key after model.generation_config
filled in its defaults, the input settings (system prompt, chat template options, columns), the chat
template's sha256 (the job's own or the tokenizer's) and the generation_config record. A run writes it
into `_SUCCESS` (`provenance`) and into every part's Parquet key-value metadata (key
`batchgen.provenance`, a JSON object); `batchgen report --against` diffs it key by key and
`batchgen card` writes it into the dataset card.

Hashing: a file up to `FULL_HASH_BYTES` is hashed whole; a bigger one that lives in a Hugging Face cache
(a symlink to a blob named by its sha256) takes the blob's name; any other big file records
`head_sha256` (its first `HEAD_BYTES`: for safetensors and GGUF, the header naming every tensor, its
dtype and offsets), its size and its modification time, so a run never spends minutes hashing weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.engine.loader.source import ModelSource
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.job_plan import JobPlan

PARQUET_KEY = b"batchgen.provenance"
FULL_HASH_BYTES = 1 << 30
HEAD_BYTES = 16 << 20
_CHUNK = 1 << 20
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def _sha256(path: Path, limit: int | None = None) -> str:
    digest = hashlib.sha256()
    left = limit if limit is not None else float("inf")
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(int(min(_CHUNK, left)))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def file_identity(path: Path) -> dict[str, Any]:
    """{size, sha256} of one model file (or {size, head_sha256, mtime} for a big file outside an HF cache)."""
    stat = path.stat()
    return dict(_file_identity(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=256)
def _file_identity(name: str, size: int, mtime_ns: int) -> tuple[tuple[str, Any], ...]:
    """Cached by (path, size, mtime): a process running many jobs on one model hashes it once."""
    path = Path(name)
    return tuple(_identify(path, size).items())


def _identify(path: Path, size: int) -> dict[str, Any]:
    if size <= FULL_HASH_BYTES:
        return {"size": size, "sha256": _sha256(path)}
    target = Path(os.path.realpath(path))
    if _SHA256_NAME.fullmatch(target.name) and target.parent.name == "blobs":
        return {"size": size, "sha256": target.name}
    return {"size": size, "head_sha256": _sha256(path, HEAD_BYTES), "mtime": int(path.stat().st_mtime)}


def model_files(folder: Path | None, gguf_file: str | None = None) -> dict[str, dict[str, Any]]:
    """Each file of a local model (a GGUF file alone, or a folder's top-level files) and its identity."""
    if folder is None:
        return {}
    if gguf_file is not None:
        return {gguf_file: file_identity(folder / gguf_file)}
    return {p.name: file_identity(p) for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".")}


def resolved_revision(folder: Path | None) -> str | None:
    """The commit a Hugging Face cache snapshot folder (`.../snapshots/<commit>/`) holds; None elsewhere."""
    if folder is not None and folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return folder.name
    return None


def _batchgen_version() -> str | None:
    try:
        return version("batchgen")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return None


def job_provenance(job: JobConfig, *, folder: Path | None, gguf_file: str | None = None,
                   location: str | None = None, chat_template: str | None = None) -> dict[str, Any]:
    """The fully resolved configuration of a run (see the module docstring). `folder`/`gguf_file`: where
    the local model's files are (None: a remote model, recorded by path only); `chat_template`: the
    model's own template text, when the job gives none of its own."""
    template = job.input.chat_template if job.input.chat_template is not None else chat_template
    return {
        "batchgen_version": _batchgen_version(),
        "model": {
            **job.model.model_dump(),
            "location": location,
            "resolved_revision": resolved_revision(folder),
            "files": model_files(folder, gguf_file),
        },
        "engine": job.engine.model_dump(),
        "task": job.task,
        "sampling": job.sampling.model_dump(),
        "sampling_columns": dict(sorted(job.sampling_columns.items())),
        "input": job.input.model_dump(exclude={"storage_options", "path", "chat_template"}),
        "chat_template_sha256": None if template is None else hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_source": "input.chat_template" if job.input.chat_template is not None
        else ("model" if chat_template is not None else None),
        "generation_config": job.generation_config_record,
    }


def plan_provenance(plan: JobPlan, engine: Any) -> dict[str, Any]:
    """`job_provenance` of a planned job run by `engine` (its tokenizer's chat template)."""
    return engine_provenance(plan.job, plan.model_source, engine)


def engine_provenance(job: JobConfig, source: ModelSource | None, engine: Any) -> dict[str, Any]:
    """`job_provenance` of `job` whose model `source` (None: remote) `engine` loaded: a local run's plan
    and a Ray replica (which resolves the model where it runs) both describe their rows this way."""
    template = getattr(getattr(getattr(engine, "tokenizer", None), "hf", None), "chat_template", None)
    if template is not None and not isinstance(template, str):  # named templates: {name: text}
        template = json.dumps(template, sort_keys=True)
    return job_provenance(job, folder=None if source is None else source.folder,
                          gguf_file=None if source is None else source.gguf_file,
                          location=job.model.path if source is None else source.display_name,
                          chat_template=template)


def with_provenance(schema: pa.Schema, provenance: dict[str, Any]) -> pa.Schema:
    """The part schema carrying the provenance in its (Parquet key-value) metadata."""
    text = json.dumps(provenance, sort_keys=True, default=str).encode()
    return schema.with_metadata({**(schema.metadata or {}), PARQUET_KEY: text})


def read_part_provenance(metadata: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    """A part's provenance from its key-value metadata (None: a part written without one)."""
    if not metadata or PARQUET_KEY not in metadata:
        return None
    return json.loads(metadata[PARQUET_KEY])

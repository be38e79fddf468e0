"""A job's LoRA adapters: model.lora_modules as the engine's LoRARequests, and which adapter a row runs.

Ids are 1, 2, ... in the order the job file lists the adapters; a row names its adapter in
input.lora_column (null: the base model), or the job's only adapter runs every row when there is no
such column.
"""

from __future__ import annotations

from batchgen.engine.lora.request import LoRARequest
from batchgen.pipeline.config import JobConfig


def job_lora_requests(job: JobConfig) -> dict[str, LoRARequest]:
    """{name: LoRARequest} for model.lora_modules (empty without adapters)."""
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(job.model.lora_modules.items())}


def job_adapter(job: JobConfig) -> str | None:
    """The adapter of every row: the only one in model.lora_modules when input.lora_column is not set."""
    modules = job.model.lora_modules
    return next(iter(modules)) if len(modules) == 1 and job.input.lora_column is None else None


def uses_lora(job: JobConfig) -> bool:
    """Whether the job runs adapters (its output rows then carry a lora_name column)."""
    return bool(job.model.lora_modules)

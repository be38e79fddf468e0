"""Job settings only the model can bound, checked from its config alone (no weights are read).

`sampling.max_tokens` must leave room for a prompt within the model's own context length when
`model.max_model_len` is null (a set one is checked with the job file), and `sampling.stop_token_ids`
must lie inside the vocabulary (the logits' width); `model.quantization` must agree with what the
checkpoint declares (a conflict names both). `batchgen validate` and `batchgen run` both pass here
before any weight loads.
"""

from __future__ import annotations

from batchgen.pipeline.capacity_plan import read_declared, read_model, resolve_plan_quantization
from batchgen.pipeline.config import JobConfig, max_tokens_rule
from batchgen.pipeline.errors import JobError


def check_model_limits(job: JobConfig) -> None:
    """JobError naming the key when a setting does not fit the model."""
    declared, is_gguf = read_declared(job.model.path, job.model.revision)  # config.json only: cheap
    try:
        resolve_plan_quantization(job.model.quantization, declared, is_gguf, job.model.path)
    except JobError as exc:
        raise JobError(f"model.quantization: {exc}") from None
    sampling = job.sampling
    if job.model.max_model_len is not None and not sampling.stop_token_ids:
        return  # nothing to ask the model (a GGUF's metadata takes seconds to read)
    model_cfg, _, _ = read_model(job.model.path, job.model.revision)
    if job.model.max_model_len is None and not job.is_scoring and not job.is_reward:  # a loglikelihood job generates nothing
        own_len = model_cfg.max_position_embeddings  # what the engine uses when max_model_len is null
        rule = max_tokens_rule(sampling.max_tokens, own_len, "the model's own context length")
        if rule:
            raise JobError(f"sampling.max_tokens: {rule} since model.max_model_len is null "
                           f"(got {sampling.max_tokens})")
    outside = [t for t in sampling.stop_token_ids if t >= model_cfg.vocab_size]
    if outside:
        raise JobError(f"sampling.stop_token_ids: {outside} outside the vocabulary of {job.model.path} "
                       f"(token ids 0..{model_cfg.vocab_size - 1})")

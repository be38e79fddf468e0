"""task: reward: each row's prompt (text or chat messages) and its completion, scored by a reward model
(a `*ForSequenceClassification` checkpoint: engine/models/layers/sequence_classifier.py).

What is scored is what HF reward models read (Skywork-Reward, TRL's RewardTrainer): chat messages with
the completion appended as the assistant's turn, rendered by the reward model's own chat template
without a generation prompt; a raw prompt with input.apply_chat_template true becomes a user message
first, as in generation; with apply_chat_template false the text is prompt + completion, tokenized as
the tokenizer does (its BOS included).

One output row per input row: `reward` (float32; a list of float32 per label when the head has several),
`sample_index` (the row's occurrence of its id in the input: the generate job's sample index when the
input is a generate job's output, whose n rows of an id come in sample order), the usual token counts
and times, and the kept columns. Rows that share a prompt are neighbours in the ordering window, so
the prefix cache computes their prompt once (`cached_tokens`).

This file holds the job-file rules (no engine import), the plan-time model check, the row's tokens and
its output rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.pipeline.errors import JobError

if TYPE_CHECKING:
    from batchgen.pipeline.config import JobConfig

DEFAULT_COMPLETION_COLUMN = "completion"
RULE = "task: reward scores the given completion: it samples nothing, leave it at its default"


def completion_column(job: JobConfig) -> str:
    """The column of completions a reward job scores."""
    return job.input.completion_column or DEFAULT_COMPLETION_COLUMN


def reward_job_errors(job: JobConfig) -> list[tuple[tuple[str, ...], str, Any]]:
    """(key path, rule, value) of every setting a reward job cannot take; for another task, the reward
    keys it cannot take."""
    inp, sampling = job.input, job.sampling
    if not job.is_reward:
        if inp.completion_column is not None:
            return [(("input", "completion_column"), "applies to task: reward only", inp.completion_column)]
        return []
    errors = []
    if inp.is_batch_file:
        errors.append((("input", "format"), "must be parquet with task: reward (an OpenAI batch line is a "
                       "generation request)", inp.format))
    if job.output.format != "parquet":
        errors.append((("output", "format"), "must be parquet with task: reward", job.output.format))
    for key in ("continuations_column", "continuation_column", "schema_column"):
        if getattr(inp, key) is not None:
            errors.append((("input", key), f"does not apply to task: reward ({RULE})", getattr(inp, key)))
    for key in ("n", "beam_width"):
        if getattr(sampling, key) != 1:
            errors.append((("sampling", key), f"must be 1 with task: reward ({RULE})", getattr(sampling, key)))
    if sampling.logprobs not in (None, False, 0):
        errors.append((("sampling", "logprobs"), f"must be false with task: reward ({RULE})", sampling.logprobs))
    if sampling.structured is not None:
        errors.append((("sampling", "structured"), f"does not apply to task: reward ({RULE})", sampling.structured))
    if job.sampling_columns:
        errors.append((("sampling_columns",), f"does not apply to task: reward ({RULE})", job.sampling_columns))
    if job.metrics:
        errors.append((("metrics",), "does not apply to task: reward (the metrics score a completion or "
                       "continuations; a reward job writes `reward`)", sorted(job.metrics)))
    if job.engine.tensor_parallel_size != 1:
        errors.append((("engine", "tensor_parallel_size"), "must be 1 with task: reward (sequence classifiers "
                       "are not implemented with tensor parallelism)", job.engine.tensor_parallel_size))
    if "allow_duplicate_ids" not in inp.model_fields_set:  # a prompt's n samples share its id
        inp.allow_duplicate_ids = True
    return errors


def check_model_task(job: JobConfig) -> int:
    """Before any weight loads: JobError naming the model and its architecture when the task and the
    model do not fit (task: reward needs a sequence classifier, the generating tasks a causal LM).
    Returns the classifier's number of labels (0 for a causal LM)."""
    from batchgen.engine.models.registry import is_classifier
    from batchgen.pipeline.capacity_plan import read_model

    try:
        model_cfg, _, _ = read_model(job.model.path, job.model.revision)  # config.json (a GGUF's header) only
    except ValueError as exc:
        raise JobError(f"model.path: {exc}") from None
    architecture = model_cfg.architecture or model_cfg.model_type
    if job.is_reward and not is_classifier(model_cfg.architecture):
        raise JobError(f"model.path: task: reward needs a reward model with a classification head "
                       f"(`*ForSequenceClassification`); {job.model.path} is {architecture}, which has none")
    if not job.is_reward and is_classifier(model_cfg.architecture):
        raise JobError(f"model.path: {job.model.path} is {architecture}, a sequence classifier (a reward "
                       f"model): it generates nothing; use it with task: reward (this job is task: {job.task})")
    return model_cfg.num_labels


def reward_type(num_labels: int) -> pa.DataType:
    """The `reward` column's type: float32, or a list of float32 (one per label) for several labels."""
    return pa.float32() if num_labels == 1 else pa.list_(pa.float32())


def reward_tokens(engine, prompt: str | list[dict], completion: str, allow_special_tokens: bool,
                  chat) -> list[int]:
    """The tokens the reward model reads for a prompt and its completion (see the module docstring);
    `chat`: the job's chat template options (the generation prompt is never added)."""
    from batchgen.engine.text.chat_template import ChatTemplateOptions

    if isinstance(prompt, list):  # messages (a raw prompt with apply_chat_template true became one)
        conversation = [*prompt, {"role": "assistant", "content": completion}]
        options = ChatTemplateOptions(chat.chat_template, add_generation_prompt=False,
                                      chat_template_kwargs=chat.chat_template_kwargs)
        return engine.encode(conversation, allow_special_tokens=allow_special_tokens, chat=options)
    return engine.encode(prompt + completion, allow_special_tokens=allow_special_tokens)


def reward_rows(out, num_labels: int, sample_index: int) -> list[dict]:
    """The one row of a scored (prompt, completion): a PoolingRequestOutput's logits as `reward`."""
    arrival = out.metrics.arrival_time
    values = out.outputs.data.tolist()
    return [{
        "sample_index": sample_index,
        "reward": values[0] if num_labels == 1 else values,
        "finish_reason": "stop",
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "completion_tokens": 0,
        "queue_s": None if out.metrics.first_scheduled_time is None else out.metrics.first_scheduled_time - arrival,
        "e2e_s": out.metrics.last_token_time - arrival,
        "error": None,
    }]


def reward_error_row(error: str, num_prompt_tokens: int | None, sample_index: int) -> list[dict]:
    """The row of a (prompt, completion) that could not be scored: finish_reason error, a null reward."""
    return [{"sample_index": sample_index, "reward": None, "finish_reason": "error", "prompt_tokens": num_prompt_tokens,
             "cached_tokens": 0, "completion_tokens": 0, "queue_s": None, "e2e_s": None, "error": error}]

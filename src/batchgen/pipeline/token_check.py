"""`batchgen validate --tokenize`: every input row made into a request as the run makes it (the same
RequestBuilder: chat template, system prompt, per-row settings, input.max_prompt_bytes and the overlong
rule), with the model's tokenizer alone. No weight is read, so rows too long for the context are counted
before a run meets them one error row at a time.

A row is overlong when its prompt tokens + max_tokens exceed max_model_len (a loglikelihood context with its
longest continuation, a reward prompt with its completion: the context alone). With
`input.on_overlong: truncate_left` those rows still run, cut to their last tokens; they are counted as
overlong all the same, since the run changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.pipeline.batch_lines import decode_batch_lines
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_plan import JobPlan
from batchgen.pipeline.parquet_rows import decode_batch
from batchgen.pipeline.reader import read_rows
from batchgen.pipeline.request_builder import OVERLONG, TOO_MANY_BYTES, RequestBuilder
from batchgen.pipeline.unit_loop import input_columns


class _TokenizerEngine:
    """What RequestBuilder asks of an engine, answered by the tokenizer alone."""

    encode = LLMEngine.encode  # the engine's own: raw text, chat messages or token ids, as a run encodes them

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def compile_grammar(self, constraint) -> None:
        """Grammars are not compiled here: validate compiles the job's own constraint (structured_job.py)."""


@dataclass
class TokenCheck:
    """What tokenizing every row found."""

    max_model_len: int
    on_overlong: str
    num_rows: int = 0
    num_overlong: int = 0  # prompt tokens + max_tokens over max_model_len (or the context alone for scoring)
    num_too_many_bytes: int = 0  # prompt text over input.max_prompt_bytes (never tokenized)
    num_other_errors: int = 0  # rows the run would write as errors for another reason
    first_other_error: str | None = None
    first_overlong: str | None = None  # the first overlong row's error message, as the run would write it
    num_prompt_tokens: int = 0  # over the rows that tokenized (overlong ones with their whole prompt)
    num_tokenized: int = 0
    longest_prompt: int = 0
    longest_id: str | None = None


def check_tokens(plan: JobPlan) -> TokenCheck:
    """Tokenize every planned row (units already done included: the whole input) with the model's tokenizer."""
    from batchgen.engine.text.tokenizer import Tokenizer
    from batchgen.pipeline.capacity_plan import read_model

    job = plan.job
    if plan.model_source is None:
        raise JobError("validate --tokenize: model.path is remote; its tokenizer is read when the run fetches "
                       "the model (copy the model locally to tokenize before a run)")
    model_cfg, _, _ = read_model(job.model.path, job.model.revision)  # config only
    max_model_len = job.model.max_model_len or model_cfg.max_position_embeddings
    try:
        tokenizer = Tokenizer(plan.model_source)
    except ValueError as exc:
        raise JobError(f"model.path: {exc}") from None
    checked_job = _counting_overlong(job)
    builder = RequestBuilder(checked_job, _TokenizerEngine(tokenizer, max_model_len))
    check = TokenCheck(max_model_len=max_model_len, on_overlong=job.input.on_overlong)
    decode = decode_batch_lines if job.input.is_batch_file else decode_batch
    columns = input_columns(job)
    for unit in plan.units:
        offset = 0
        for batch in read_rows(plan.input_storage, unit.file, unit.start, unit.stop, columns):
            for row in decode(batch, job):
                task = builder.build(row, unit.index, offset)
                offset += 1
                _count(check, task)
    return check


def _counting_overlong(job: JobConfig) -> JobConfig:
    """The job with input.on_overlong: error, so that each overlong row is named (truncate_left would cut it
    silently); nothing else changes."""
    if job.input.on_overlong == "error":
        return job
    checked = job.model_copy(deep=True)
    checked.input.on_overlong = "error"
    return checked


def _count(check: TokenCheck, task) -> None:
    check.num_rows += 1
    if task.error_kind == OVERLONG:
        check.num_overlong += 1
        # what happens to such rows the line says; the message names the error setting it was counted under
        message = task.error.removesuffix(" (input.on_overlong: error)")
        check.first_overlong = check.first_overlong or f"{task.request_id}: {message}"
    elif task.error_kind == TOO_MANY_BYTES:
        check.num_too_many_bytes += 1
    elif task.is_error:
        check.num_other_errors += 1
        check.first_other_error = check.first_other_error or f"{task.request_id}: {task.error}"
    if task.token_ids is not None:  # an overlong row keeps its whole prompt's tokens
        num = len(task.token_ids)
        check.num_tokenized += 1
        check.num_prompt_tokens += num
        if num > check.longest_prompt:
            check.longest_prompt, check.longest_id = num, task.request_id


def format_token_check(check: TokenCheck) -> list[str]:
    """validate's lines for it: the prompt lengths, then the rows a run would not generate as they are."""
    if check.num_tokenized:
        mean = check.num_prompt_tokens / check.num_tokenized
        lengths = f"prompt tokens mean {mean:,.0f}, longest {check.longest_prompt:,} (id {check.longest_id})"
    else:
        lengths = "no prompt tokenized"
    lines = [f"tokens   {check.num_rows:,} rows tokenized: {lengths}; max_model_len {check.max_model_len:,}"]
    if check.num_overlong:
        fate = ("error rows (input.on_overlong: error)" if check.on_overlong == "error"
                else "cut to their last tokens (input.on_overlong: truncate_left)")
        lines.append(f"         {check.num_overlong:,} overlong row(s), prompt tokens + max_tokens > max_model_len: "
                     f"{fate}; first: {check.first_overlong}")
    if check.num_too_many_bytes:
        lines.append(f"         {check.num_too_many_bytes:,} row(s) over input.max_prompt_bytes: error rows")
    if check.num_other_errors:
        lines.append(f"         {check.num_other_errors:,} other error row(s); first: {check.first_other_error}")
    if not (check.num_overlong or check.num_too_many_bytes or check.num_other_errors):
        lines.append("         every row fits: prompt tokens + max_tokens <= max_model_len")
    return lines

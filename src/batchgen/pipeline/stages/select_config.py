"""`task: select`: the `select` section of a stage that turns scored samples into training rows, no model.

    select: {rule: dpo_pairs, score_column: reward, min_margin: 0.5}
    select: {rule: best_of_n, score_column: score, where: "finish_reason = 'stop'"}
    select: {rule: filter, where: "reward > 0.5 AND finish_reason = 'stop'"}
"""

from __future__ import annotations

from typing import Literal

import polars as pl
from pydantic import Field, field_validator, model_validator

from batchgen.pipeline.job_sections import Section

RULES = ("dpo_pairs", "best_of_n", "filter")


class SelectSection(Section):
    """How a select stage picks its rows from the samples it reads."""

    rule: Literal["dpo_pairs", "best_of_n", "filter"]
    """dpo_pairs: per prompt (the rows sharing an id), chosen = the highest score, rejected = the lowest
    (TRL's preference format). best_of_n: the highest-scoring sample per prompt as `messages` with the
    assistant turn appended (rejection sampling for SFT). filter: the rows for which `where` holds."""
    score_column: str = "reward"
    """The column ranking a prompt's samples (dpo_pairs, best_of_n): a reward model's `reward`, or a
    judge's parsed field such as `score`. Rows whose score is null (failed samples) take no part."""
    completion_column: str = "completion"
    """The column holding each sample's text (dpo_pairs, best_of_n). After a reward stage it is the
    scored sample's `completion` (the default); after a judge stage, whose own `completion` is the
    verdict, the judged samples are kept as `<earlier stage>_completion`, e.g. `gen_completion`."""
    prompt_column: str | None = None
    """The raw-text prompt column; null: the prompt column the earlier stages carried (their
    input.prompt_column or input.messages_column)."""
    messages_column: str | None = None
    """The chat messages column, in place of prompt_column; null: as for prompt_column."""
    id_column: str = "id"
    """The column naming each prompt: its samples share it."""
    min_margin: float = Field(default=0.0, ge=0.0)
    """dpo_pairs: a pair whose chosen score minus rejected score is below this is dropped (and counted);
    ties are always dropped, so the default 0 drops only ties."""
    where: str | None = None
    """A predicate over the columns, as a polars SQL WHERE expression (e.g. `reward > 0.5 AND
    finish_reason = 'stop'`): the rows it holds for, before any rule picks (filter: required)."""
    keep_columns: list[str] = Field(default_factory=list)
    """Columns copied to every output row (dpo_pairs: from the chosen sample)."""

    @field_validator("where")
    @classmethod
    def _check_where(cls, value: str | None) -> str | None:
        if value is not None:
            predicate_columns(value)  # a ValueError naming the problem
        return value

    @model_validator(mode="after")
    def _check_rule(self) -> SelectSection:
        if self.rule == "filter" and self.where is None:
            raise ValueError("rule filter needs `where`: a predicate such as \"reward > 0.5\"")
        if self.prompt_column is not None and self.messages_column is not None:
            raise ValueError("set prompt_column or messages_column, not both")
        return self

    def columns_read(self) -> dict[str, str]:
        """{column: the key that names it} of every column this rule reads (validate checks them against
        the earlier stage's columns)."""
        names = {self.id_column: "select.id_column"}
        if self.rule != "filter":
            names.update({self.score_column: "select.score_column", self.completion_column: "select.completion_column"})
            for key in ("prompt_column", "messages_column"):
                if getattr(self, key) is not None:
                    names[getattr(self, key)] = f"select.{key}"
        for name in predicate_columns(self.where) if self.where else ():
            names.setdefault(name, "select.where")
        for name in self.keep_columns:
            names.setdefault(name, "select.keep_columns")
        return names


def predicate_columns(where: str) -> list[str]:
    """The columns a polars SQL predicate reads; ValueError when polars cannot parse it."""
    try:
        return sorted(set(pl.sql_expr(where).meta.root_names()))
    except pl.exceptions.PolarsError as exc:
        raise ValueError(f"cannot read {where!r} as a polars SQL predicate: {exc}") from None

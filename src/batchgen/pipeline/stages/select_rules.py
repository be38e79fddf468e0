"""The select rules over an earlier stage's rows (a polars DataFrame): DPO pairs, best of n, a filter.

Ties between samples of equal score are broken by input order (the first row wins), so a rule's output
depends on its input alone. Each rule returns its rows and what it counted (SelectCounts), the figures
`_SUCCESS` and the report show.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.stages.histogram import histogram
from batchgen.pipeline.stages.select_config import SelectSection

_ORDER = "__row_order"


@dataclass
class SelectCounts:
    """What a select rule counted (the `select` entry of `_SUCCESS`)."""

    rule: str
    num_input_rows: int = 0
    num_prompts: int = 0  # distinct ids in the input
    num_filtered_rows: int = 0  # rows `where` dropped
    num_unscored_rows: int = 0  # rows whose score is null or NaN (failed samples)
    num_output_rows: int = 0
    num_single_sample: int = 0  # dpo_pairs: prompts with fewer than two scored samples
    num_ties: int = 0  # dpo_pairs: prompts whose samples all scored the same
    num_below_margin: int = 0  # dpo_pairs: prompts whose best and worst differ by less than min_margin
    margin_percentiles: dict[str, float] | None = None  # dpo_pairs: p0/p50/p90/p100 of the kept margins
    score_histogram: dict[str, list] | None = None  # dpo_pairs, best_of_n: every scored row's score (histogram.py)
    margin_histogram: dict[str, list] | None = None  # dpo_pairs: the kept pairs' margins

    def to_dict(self) -> dict:
        return asdict(self)


def select_rows(frame: pl.DataFrame, section: SelectSection, prompt_column: str | None,
                is_messages: bool, system_prompt: str | None = None) -> tuple[pl.DataFrame, SelectCounts]:
    """The rule's output rows and counts. `prompt_column`/`is_messages`: where each row's prompt is
    (dpo_pairs and best_of_n copy it; filter keeps every column). `system_prompt`: the first stage's
    input.system_prompt, which the samples were generated with: dpo_pairs and best_of_n put it first in
    each prompt's messages (a row's own system message wins), so a raw prompt's pairs then take TRL's
    conversational format."""
    counts = SelectCounts(section.rule, num_input_rows=frame.height)
    if section.id_column in frame.columns:
        counts.num_prompts = frame[section.id_column].n_unique()
    frame = frame.with_row_index(_ORDER)
    if section.where is not None:
        kept = frame.filter(pl.sql_expr(section.where))
        counts.num_filtered_rows = frame.height - kept.height
        frame = kept
    if section.rule == "filter":
        out = frame.drop(_ORDER)
        counts.num_output_rows = out.height
        return out, counts
    if prompt_column is None:
        raise JobError("select: no prompt column: set select.prompt_column or select.messages_column")
    score = section.score_column
    if not frame.schema[score].is_numeric():
        raise JobError(f"select.score_column: column {score!r} has type {frame.schema[score]}; expected a number "
                       "per row")
    valid = pl.col(score).is_not_null() & ~pl.col(score).cast(pl.Float64).is_nan()
    scored = frame.filter(valid)
    counts.num_unscored_rows = frame.height - scored.height
    counts.score_histogram = histogram(scored[score].cast(pl.Float64).to_numpy())
    columns = [section.id_column, prompt_column, section.completion_column, score, *section.keep_columns]
    best = _ranked(scored, section.id_column, score, columns, descending=True)
    if section.rule == "best_of_n":
        out = _best_of_n(best, section, prompt_column, is_messages, system_prompt)
    else:
        worst = _ranked(scored, section.id_column, score, [section.completion_column, score], descending=False)
        out = _dpo_pairs(best, worst, section, prompt_column, is_messages, counts, system_prompt)
    counts.num_output_rows = out.height
    return out, counts


def _ranked(frame: pl.DataFrame, id_column: str, score: str, columns: list[str], *,
            descending: bool) -> pl.DataFrame:
    """Per id (in first-seen order): the values of `columns` at its highest (or lowest) score, the
    earliest row winning a tie, and how many scored rows the id has (`__n`)."""
    order = [pl.col(score), pl.col(_ORDER)]
    picks = [pl.col(c).sort_by(order, descending=[descending, False]).first().alias(c)
             for c in dict.fromkeys(columns) if c != id_column]
    return frame.group_by(id_column, maintain_order=True).agg(*picks, pl.len().alias("__n"))


def _messages(prompts: list, is_messages: bool, system_prompt: str | None = None) -> list[list[dict]]:
    """Each prompt as chat messages ({role, content} only): a raw prompt is one user turn; the system
    prompt first unless the prompt has its own (as the generating stage sent it)."""
    if not is_messages:
        chats = [[{"role": "user", "content": p}] for p in prompts]
    else:
        chats = [[{"role": m["role"], "content": m["content"]} for m in p] for p in prompts]
    if system_prompt is None:
        return chats
    return [c if c and c[0]["role"] == "system" else [{"role": "system", "content": system_prompt}, *c]
            for c in chats]


def _assistant(text: str | None) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _best_of_n(best: pl.DataFrame, section: SelectSection, prompt_column: str, is_messages: bool,
               system_prompt: str | None) -> pl.DataFrame:
    """One row per prompt: its messages with the best sample's turn appended, and that sample's score."""
    prompts = _messages(best[prompt_column].to_list(), is_messages, system_prompt)
    texts = best[section.completion_column].to_list()
    out = pl.DataFrame({"id": best[section.id_column],
                        "messages": [p + _assistant(t) for p, t in zip(prompts, texts)],
                        section.score_column: best[section.score_column]})
    return _with_kept(out, best, section.keep_columns)


def _dpo_pairs(best: pl.DataFrame, worst: pl.DataFrame, section: SelectSection, prompt_column: str,
               is_messages: bool, counts: SelectCounts, system_prompt: str | None) -> pl.DataFrame:
    """One pair per prompt with two or more scored samples whose best and worst scores differ by at
    least min_margin (never a tie); the others are counted by why they were dropped."""
    score = section.score_column
    chosen_score = best[score].cast(pl.Float64)
    rejected_score = worst[score].cast(pl.Float64)
    margin = (chosen_score - rejected_score).to_numpy()
    is_single = (best["__n"] < 2).to_numpy()
    is_tie = ~is_single & (margin <= 0)
    is_below = ~is_single & ~is_tie & (margin < section.min_margin)
    counts.num_single_sample = int(is_single.sum())
    counts.num_ties = int(is_tie.sum())
    counts.num_below_margin = int(is_below.sum())
    keep = ~(is_single | is_tie | is_below)
    mask = pl.Series(keep)
    best, chosen_score, rejected_score = best.filter(mask), chosen_score.filter(mask), rejected_score.filter(mask)
    rejected_text = worst[section.completion_column].filter(mask).to_list()
    chosen_text = best[section.completion_column].to_list()
    prompts = best[prompt_column].to_list()
    if is_messages or system_prompt is not None:  # TRL's conversational preference format
        columns = {"prompt": _messages(prompts, is_messages, system_prompt), "chosen": [_assistant(t) for t in chosen_text],
                   "rejected": [_assistant(t) for t in rejected_text]}
    else:  # TRL's standard preference format (a raw prompt)
        columns = {"prompt": prompts, "chosen": chosen_text, "rejected": rejected_text}
    out = pl.DataFrame({"id": best[section.id_column], **columns, "chosen_score": chosen_score,
                        "rejected_score": rejected_score})
    kept_margins = margin[keep]
    if kept_margins.size:
        p0, p50, p90, p100 = np.percentile(kept_margins, [0, 50, 90, 100])
        counts.margin_percentiles = {"p0": float(p0), "p50": float(p50), "p90": float(p90), "p100": float(p100)}
        counts.margin_histogram = histogram(kept_margins)
    return _with_kept(out, best, section.keep_columns)


def _with_kept(out: pl.DataFrame, source: pl.DataFrame, keep_columns: list[str]) -> pl.DataFrame:
    taken = [c for c in keep_columns if c not in out.columns]
    return out.with_columns(source.select(taken)) if taken else out

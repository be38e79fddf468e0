"""What changed in each metric between two runs of one prompt set: the two aggregates and their difference,
the rows whose verdict flipped (right -> wrong, wrong -> right) with both runs' answers, and McNemar's exact
test on the paired verdicts (rows joined by id and sample_index; a row scored in one run only is not a
pair). Fed partition by partition by the comparison's join; the lists of flipped rows stay bounded."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from batchgen.metrics import metric_column
from batchgen.metrics.paired import mcnemar_exact
from batchgen.report.config import ReportConfig
from batchgen.report.metric_scores import ShownScore
from batchgen.report.run_stats import clip

TOKENS = "_tokens"  # a joined row's output: completion_token_ids, or a loglikelihood row's continuation_logprob
TEXT = "_text"  # a joined row's completion (null for loglikelihood rows)


@dataclass
class FlippedRow:
    """A row right in one run and wrong in the other, with both runs' answers (cut to max_shown_chars)."""

    id: object
    sample_index: int
    is_now_right: bool  # wrong in the baseline, right in this run
    new_answer: str
    old_answer: str


@dataclass
class ScoreChange:
    """One metric of both runs: their aggregates and the paired verdicts of the rows both scored."""

    name: str
    new: ShownScore
    old: ShownScore
    num_paired: int = 0
    num_both_right: int = 0
    num_right_to_wrong: int = 0  # right in the baseline, wrong in this run
    num_wrong_to_right: int = 0
    flipped: list[FlippedRow] = field(default_factory=list)  # smallest (id, sample_index) first, bounded
    significance_level: float = 0.05

    @property
    def delta(self) -> float:
        return self.new.score.value - self.old.score.value

    @property
    def p_value(self) -> float:
        """McNemar's exact two-sided p-value over the discordant pairs."""
        return mcnemar_exact(self.num_right_to_wrong, self.num_wrong_to_right)

    @property
    def is_beyond_noise(self) -> bool:
        return self.p_value < self.significance_level

    def to_dict(self) -> dict:
        return {"this_run": self.new.to_dict(), "baseline": self.old.to_dict(),
                "delta": self.delta if np.isfinite(self.delta) else None, "num_paired": self.num_paired,
                "num_right_to_wrong": self.num_right_to_wrong, "num_wrong_to_right": self.num_wrong_to_right,
                "mcnemar_p": self.p_value, "is_beyond_noise": self.is_beyond_noise}


def answer_text(tokens: list | None, text: str | None, finish_reason: str | None, is_scoring: bool,
                max_chars: int) -> str:
    """A row's answer as the page shows it: its completion, or for a loglikelihood row which continuation
    was the most likely and every continuation's log-probability."""
    if is_scoring and tokens:
        best = int(np.argmax(np.asarray(tokens, np.float64)))
        shown = ", ".join(f"{v:.4f}" for v in tokens)
        return clip(f"continuation {best} of {len(tokens)} is the most likely (log-probabilities: {shown})",
                    max_chars)
    if text is None and (is_scoring or tokens is None or finish_reason == "error"):
        return f"(no answer: finish_reason {finish_reason})"
    return clip(text or "", max_chars)


class ChangeCounter:
    """Counts the paired verdicts of the metrics both runs have, partition by partition."""

    def __init__(self, names: list[str], config: ReportConfig, is_scoring: bool):
        self.names = names
        self.config = config
        self.is_scoring = is_scoring
        self.counts = {name: np.zeros(3, np.int64) for name in names}  # both right, right->wrong, wrong->right
        self.num_paired = dict.fromkeys(names, 0)
        self.flipped: dict[str, list[FlippedRow]] = {name: [] for name in names}

    def add(self, a: pa.Table, b: pa.Table) -> None:
        """Matched rows: `a` this run's, `b` the baseline's, row for row."""
        for name in self.names:
            new = a.column(metric_column(name)).to_numpy(zero_copy_only=False).astype(np.float64)
            old = b.column(metric_column(name)).to_numpy(zero_copy_only=False).astype(np.float64)
            paired = ~np.isnan(new) & ~np.isnan(old)
            new_right, old_right = paired & (new > 0.5), paired & (old > 0.5)
            to_wrong, to_right = old_right & ~new_right, new_right & ~old_right
            self.num_paired[name] += int(paired.sum())
            self.counts[name] += [int((new_right & old_right).sum()), int(to_wrong.sum()), int(to_right.sum())]
            self._keep_flipped(name, a, b, np.flatnonzero(to_wrong | to_right), new_right)

    def _keep_flipped(self, name: str, a: pa.Table, b: pa.Table, rows: np.ndarray, new_right: np.ndarray) -> None:
        if rows.size == 0:
            return
        limit = self.config.num_listed_ids
        ids, samples = a.column("id").to_pylist(), a.column("sample_index").to_pylist()
        kept = self.flipped[name]
        floor = (kept[-1].id, kept[-1].sample_index) if len(kept) >= limit else None
        order = sorted((int(i) for i in rows), key=lambda i: (ids[i], samples[i]))[:limit]
        for i in order:
            if floor is not None and (ids[i], samples[i]) >= floor:
                break
            kept.append(FlippedRow(ids[i], samples[i], bool(new_right[i]), self._answer(a, i), self._answer(b, i)))
        kept.sort(key=lambda r: (r.id, r.sample_index))
        del kept[limit:]

    def _answer(self, rows: pa.Table, i: int) -> str:
        return answer_text(rows.column(TOKENS)[i].as_py(), rows.column(TEXT)[i].as_py(),
                           rows.column("finish_reason")[i].as_py(), self.is_scoring, self.config.max_shown_chars)

    def changes(self, new: list[ShownScore], old: list[ShownScore]) -> list[ScoreChange]:
        new_by, old_by = {s.name: s for s in new}, {s.name: s for s in old}
        found = []
        for name in self.names:
            both, to_wrong, to_right = (int(x) for x in self.counts[name])
            found.append(ScoreChange(name, new_by[name], old_by[name], self.num_paired[name], both, to_wrong, to_right,
                                     self.flipped[name], self.config.significance_level))
        return found

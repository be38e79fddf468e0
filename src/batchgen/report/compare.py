"""Two runs of one prompt set, row by row: identical, different, missing; where tokens part; what changed.

`compare_runs` reads each run once (its figures and its join partitions from the same batches), then
joins partition by partition (join.py). Two runs are of one prompt set when their ids are of one kind,
they share at least one (id, sample_index), and (when both `_SUCCESS` name the same model, so one
tokenizer counted both) every shared row that ran in both has the same prompt length.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.join import KEYS, PartitionWriter, common_id_type, joined_pairs, num_partitions
from batchgen.report.run_stats import Codes, RunFigures, RunStats, clip, exact_match
from batchgen.report.source import RunFolder
from batchgen.report.text_diff import Segment, diff_texts
from batchgen.report.token_diff import SAME, first_difference

_BASE_JOIN_COLUMNS = ["id", "sample_index", "completion", "completion_token_ids", "finish_reason", "prompt_tokens"]
# _SUCCESS keys that are results, compared in the figures table rather than listed as configuration.
FIGURE_KEYS = ("num_requests", "num_rows", "num_errors", "prompt_tokens", "cached_tokens", "completion_tokens",
               "generation_seconds", "completion_tokens_per_s", "ttft_s", "tpot_s", "resumed", "speculative")
_NUM_PROMPT_EXAMPLES = 5


class _Absent:
    """A key one `_SUCCESS` has and the other lacks."""

    def __str__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


@dataclass
class DiffRow:
    """A row whose two runs differ: where their tokens part and how each run ended."""

    id: object
    sample_index: int
    first_token: int | None  # None: same tokens, other text or finish reason
    new_tokens: int
    old_tokens: int
    new_finish: str | None
    old_finish: str | None


@dataclass
class InlineDiff:
    id: object
    sample_index: int
    first_token: int | None
    new: list[Segment]
    old: list[Segment]


@dataclass
class CategoryCounts:
    name: str
    num_identical: int = 0
    num_different: int = 0
    num_missing: int = 0  # in one run only


@dataclass
class MatchChange:
    """Exact match against the reference, on the rows both runs have."""

    num_scored: int = 0
    num_right_new: int = 0
    num_right_old: int = 0
    num_newly_right: int = 0
    num_newly_wrong: int = 0


@dataclass
class Comparison:
    new: RunFigures
    old: RunFigures
    num_identical: int = 0
    num_different: int = 0
    num_only_new: int = 0  # rows the baseline lacks
    num_only_old: int = 0  # rows this run lacks
    different: list[DiffRow] = field(default_factory=list)  # smallest keys first, bounded
    only_new: list[tuple] = field(default_factory=list)
    only_old: list[tuple] = field(default_factory=list)
    first_token_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [position] -> rows
    diffs: list[InlineDiff] = field(default_factory=list)
    categories: list[CategoryCounts] = field(default_factory=list)
    match: MatchChange | None = None
    config_differences: list[tuple[str, object, object]] = field(default_factory=list)
    num_partitions: int = 1


def compare_runs(new: RunFolder, old: RunFolder, config: ReportConfig) -> Comparison:
    """Both runs' figures and their row-by-row comparison (ReportError for two different prompt sets)."""
    if new.schema is None or old.schema is None:
        raise ReportError(f"{new.url if new.schema is None else old.url} holds no part files: nothing to compare")
    id_type = common_id_type(new.schema.field("id").type, old.schema.field("id").type, new.url, old.url)
    stats_new, stats_old = RunStats(new, config), RunStats(old, config)
    join_columns = _join_columns(new, old, config)
    count = num_partitions(max(new.arrow_bytes([c for c in join_columns if c in new.column_names]),
                               old.arrow_bytes([c for c in join_columns if c in old.column_names])),
                           config.partition_bytes)
    with tempfile.TemporaryDirectory(prefix="batchgen-report-") as folder:
        paths = {}
        for side, run, stats in (("new", new, stats_new), ("old", old, stats_old)):
            schema = pa.schema([run.schema.field(c) if c in run.column_names else pa.field(c, pa.null())
                                for c in join_columns])
            writer = PartitionWriter(folder, side, count, schema, id_type)
            try:
                for part_index, batch in run.iter_batches(list(dict.fromkeys(stats.columns + [
                        c for c in join_columns if c in run.column_names])), config.batch_rows):
                    stats.add(part_index, batch.select(stats.columns))
                    writer.write(_with_columns(batch, schema))
            finally:
                writer.close()
            paths[side] = writer.paths
            pa.default_memory_pool().release_unused()  # the allocator keeps freed pages otherwise
        comparison = Comparison(stats_new.figures(), stats_old.figures(), num_partitions=count)
        builder = _Builder(comparison, config, check_prompts=_same_model(new, old), names=(new.url, old.url))
        for new_rows, old_rows, new_index, old_index in joined_pairs(paths["new"], paths["old"]):
            builder.add(new_rows, old_rows, new_index, old_index)
            del new_rows, old_rows
            pa.default_memory_pool().release_unused()
    if comparison.num_identical + comparison.num_different == 0 and new.num_rows and old.num_rows:
        raise ReportError(f"different prompt sets: no (id, sample_index) of {new.url} is in {old.url}")
    builder.finish()
    comparison.config_differences = config_differences(new, old)
    return comparison


def _join_columns(new: RunFolder, old: RunFolder, config: ReportConfig) -> list[str]:
    extra = []
    if config.by is not None:
        extra.append(config.by)
    if config.reference is not None:
        old.check_column(config.reference, "--reference")
        extra.append(config.reference)
    if config.by is not None:
        old.check_column(config.by, "--by")
    return list(dict.fromkeys(_BASE_JOIN_COLUMNS + extra))


def _with_columns(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """The batch's columns in the schema's order (a column the run lacks: all null)."""
    return pa.RecordBatch.from_arrays(
        [batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
         for f in schema], names=schema.names)


def _same_model(new: RunFolder, old: RunFolder) -> bool:
    if new.success is None or old.success is None:
        return False
    return new.success.model is not None and new.success.model == old.success.model


class _Builder:
    """Folds joined partitions into the Comparison, keeping every list bounded."""

    def __init__(self, comparison: Comparison, config: ReportConfig, check_prompts: bool, names: tuple[str, str]):
        self.c = comparison
        self.config = config
        self.check_prompts = check_prompts
        self.names = names
        self.categories = Codes(config.max_categories) if config.by else None
        self.category_counts: dict[int, CategoryCounts] = {}
        self.first_counts = np.zeros(0, np.int64)
        if config.reference is not None:
            self.c.match = MatchChange()

    def add(self, new: pa.Table, old: pa.Table, new_index: np.ndarray, old_index: np.ndarray) -> None:
        _refuse_repeated_keys(new, self.names[0])
        _refuse_repeated_keys(old, self.names[1])
        both = (new_index >= 0) & (old_index >= 0)
        only_new, only_old = new_index[(new_index >= 0) & (old_index < 0)], old_index[(old_index >= 0) & (new_index < 0)]
        self.c.num_only_new += only_new.size
        self.c.num_only_old += only_old.size
        self.c.only_new = _smallest_keys(self.c.only_new, new.take(pa.array(only_new)), self.config.num_listed_ids)
        self.c.only_old = _smallest_keys(self.c.only_old, old.take(pa.array(only_old)), self.config.num_listed_ids)

        a = new.take(pa.array(new_index[both]))  # (matched rows,) this run
        b = old.take(pa.array(old_index[both]))  # (matched rows,) the baseline, row for row
        if self.check_prompts:
            self._check_prompts(a, b)
        first = first_difference(a.column("completion_token_ids"), b.column("completion_token_ids"))
        same_text = _equal(a.column("completion"), b.column("completion"))
        same_finish = _equal(a.column("finish_reason"), b.column("finish_reason"))
        identical = (first == SAME) & same_text & same_finish
        self.c.num_identical += int(identical.sum())
        self.c.num_different += int((~identical).sum())
        positions = first[~identical & (first != SAME)]
        if positions.size:
            counts = np.bincount(positions)
            if counts.size > self.first_counts.size:
                self.first_counts = np.pad(self.first_counts, (0, counts.size - self.first_counts.size))
            self.first_counts[:counts.size] += counts
        self._keep_different(a, b, first, ~identical)
        if self.categories is not None:
            self._count_categories(new, old, new_index, old_index, both, identical)
        if self.c.match is not None:
            self._count_matches(a, b)

    def finish(self) -> None:
        self.c.first_token_counts = self.first_counts
        if self.categories is not None:
            self.c.categories = sorted(self.category_counts.values(),
                                       key=lambda r: (-(r.num_identical + r.num_different + r.num_missing), r.name))

    def _check_prompts(self, a: pa.Table, b: pa.Table) -> None:
        ran = pc.and_(pc.not_equal(a.column("finish_reason"), "error"),
                      pc.not_equal(b.column("finish_reason"), "error")).fill_null(False)
        other = pc.and_(ran, pc.not_equal(a.column("prompt_tokens"), b.column("prompt_tokens"))).fill_null(False)
        rows = np.flatnonzero(other.to_numpy(zero_copy_only=False))
        if rows.size:
            shown = "; ".join(f"id {a.column('id')[int(i)].as_py()!r}: {a.column('prompt_tokens')[int(i)].as_py()} "
                              f"prompt tokens vs {b.column('prompt_tokens')[int(i)].as_py()}"
                              for i in rows[:_NUM_PROMPT_EXAMPLES])
            raise ReportError(f"different prompt sets: {self.names[0]} and {self.names[1]} ran the same model but "
                              f"give rows of the same id prompts of different lengths ({shown}); compare runs of "
                              "one input with one chat template and system prompt")

    def _keep_different(self, a: pa.Table, b: pa.Table, first: np.ndarray, different: np.ndarray) -> None:
        rows = np.flatnonzero(different)
        if rows.size == 0:
            return
        limit = max(self.config.num_listed_ids, self.config.num_inline_diffs)
        keys = a.select(list(KEYS)).take(pa.array(rows))
        order = pc.sort_indices(keys, sort_keys=[(k, "ascending") for k in KEYS]).to_numpy()[:limit]
        candidates = []
        for i in rows[order]:
            i = int(i)
            pos = int(first[i])
            candidates.append(DiffRow(
                a.column("id")[i].as_py(), a.column("sample_index")[i].as_py(), None if pos == SAME else pos,
                len(a.column("completion_token_ids")[i].values or []),
                len(b.column("completion_token_ids")[i].values or []),
                a.column("finish_reason")[i].as_py(), b.column("finish_reason")[i].as_py()))
            if len(self.c.diffs) < self.config.num_inline_diffs or (
                    (candidates[-1].id, candidates[-1].sample_index) < (self.c.diffs[-1].id, self.c.diffs[-1].sample_index)):
                self._add_inline(candidates[-1], a.column("completion")[i].as_py(), b.column("completion")[i].as_py())
        merged = sorted(self.c.different + candidates, key=lambda r: (r.id, r.sample_index))
        self.c.different = merged[:self.config.num_listed_ids]

    def _add_inline(self, row: DiffRow, new_text: str | None, old_text: str | None) -> None:
        limit = self.config.max_shown_chars
        new_segments, old_segments = diff_texts(clip(new_text or "", limit), clip(old_text or "", limit))
        self.c.diffs.append(InlineDiff(row.id, row.sample_index, row.first_token, new_segments, old_segments))
        self.c.diffs.sort(key=lambda d: (d.id, d.sample_index))
        del self.c.diffs[self.config.num_inline_diffs:]

    def _count_categories(self, new: pa.Table, old: pa.Table, new_index: np.ndarray, old_index: np.ndarray,
                          both: np.ndarray, identical: np.ndarray) -> None:
        by = self.config.by
        mine = _take_or_null(new.column(by), new_index)  # (joined rows,) this run's value, null where absent
        theirs = _take_or_null(old.column(by), old_index)
        if mine.type != theirs.type:
            mine, theirs = pc.cast(mine, pa.string()), pc.cast(theirs, pa.string())
        values = pc.coalesce(mine, theirs)  # a row this run lacks takes the baseline's value
        codes = self.categories.encode(values)
        kind = np.full(len(codes), 2)  # 2: in one run only
        kind[np.flatnonzero(both)] = np.where(identical, 0, 1)
        for code in np.unique(codes):
            row = self.category_counts.setdefault(int(code), CategoryCounts(self.categories.names[code]))
            counts = np.bincount(kind[codes == code], minlength=3)
            row.num_identical += int(counts[0])
            row.num_different += int(counts[1])
            row.num_missing += int(counts[2])

    def _count_matches(self, a: pa.Table, b: pa.Table) -> None:
        m_new, m_old = exact_match(a, self.config.reference), exact_match(b, self.config.reference)
        scored = (m_new >= 0) & (m_old >= 0)
        m = self.c.match
        m.num_scored += int(scored.sum())
        m.num_right_new += int((m_new[scored] == 1).sum())
        m.num_right_old += int((m_old[scored] == 1).sum())
        m.num_newly_right += int(((m_new == 1) & (m_old == 0) & scored).sum())
        m.num_newly_wrong += int(((m_new == 0) & (m_old == 1) & scored).sum())


def _take_or_null(column: pa.ChunkedArray, index: np.ndarray) -> pa.Array:
    """column[index] with null where index is -1."""
    taken = column.take(pa.array(index, mask=index < 0))
    return taken.combine_chunks() if isinstance(taken, pa.ChunkedArray) else taken


def _equal(x: pa.ChunkedArray, y: pa.ChunkedArray) -> np.ndarray:
    """Row by row, nulls equal to nulls."""
    same = pc.equal(x, y).fill_null(False).to_numpy(zero_copy_only=False)
    both_null = pc.and_(pc.is_null(x), pc.is_null(y)).to_numpy(zero_copy_only=False)
    return same | both_null


def _refuse_repeated_keys(rows: pa.Table, name: str) -> None:
    if rows.num_rows and rows.group_by(list(KEYS)).aggregate([]).num_rows < rows.num_rows:
        raise ReportError(f"{name} has rows with a repeated (id, sample_index) (a job run with "
                          "input.allow_duplicate_ids): its rows cannot be matched by id")


def _smallest_keys(kept: list[tuple], rows: pa.Table, limit: int) -> list[tuple]:
    if rows.num_rows == 0:
        return kept
    order = pc.sort_indices(rows.select(list(KEYS)), sort_keys=[(k, "ascending") for k in KEYS])
    top = rows.select(list(KEYS)).take(order.slice(0, limit))
    keys = list(zip(top.column("id").to_pylist(), top.column("sample_index").to_pylist()))
    return sorted(kept + keys)[:limit]


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if isinstance(value, dict):
        flat: dict[str, object] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def config_differences(new: RunFolder, old: RunFolder) -> list[tuple[str, object, object]]:
    """Key by key, what the two `_SUCCESS` files (figures aside) and input manifests say differently."""
    def described(run: RunFolder) -> dict[str, object]:
        record = run.success.to_dict() if run.success is not None else {}
        success = {k: v for k, v in record.items() if k not in FIGURE_KEYS}
        flat = flatten(success)
        files = ((run.manifest or {}).get("input") or {}).get("files")
        if isinstance(files, list):
            flat["input files"] = ", ".join(f"{f.get('path')} ({f.get('num_rows')} rows)" for f in files
                                            if isinstance(f, dict))
        return flat

    a, b = described(new), described(old)
    return [(key, a.get(key, ABSENT), b.get(key, ABSENT)) for key in sorted(set(a) | set(b), key=_key_order)
            if a.get(key, ABSENT) != b.get(key, ABSENT)]


def _key_order(key: str) -> tuple[int, str]:
    top = ("job", "model", "config_hash", "input files")
    return (top.index(key), key) if key in top else (len(top), key)

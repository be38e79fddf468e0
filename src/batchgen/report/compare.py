"""Two runs of one prompt set, row by row: identical, different, missing; where tokens part; what changed.

`compare_runs` reads each run once (its figures, its verdicts and its join partitions from the same
batches), then joins partition by partition (join.py). Two runs are of one prompt set when their ids are
of one kind, they share at least one (id, sample_index), and (when both `_SUCCESS` name the same model,
so one tokenizer counted both) every shared row that ran in both has the same prompt length. A row's
output is its completion's tokens and text, or for a loglikelihood run its continuations'
log-probabilities; both runs must be of one task. The metrics both runs have are compared on the paired
rows (score_changes.py).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchgen.metrics import metric_column
from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.join import KEYS, PartitionWriter, common_id_type, joined_pairs, num_partitions
from batchgen.report.run_stats import Codes, RunFigures, RunStats, clip
from batchgen.report.score_changes import TEXT, TOKENS, ChangeCounter, ScoreChange, answer_text
from batchgen.report.source import RunFolder
from batchgen.report.text_diff import Segment, diff_texts
from batchgen.report.token_diff import SAME, first_difference

# _SUCCESS keys that are results, compared in the figures table rather than listed as configuration.
FIGURE_KEYS = ("num_requests", "num_rows", "num_errors", "prompt_tokens", "cached_tokens", "completion_tokens",
               "generation_seconds", "completion_tokens_per_s", "ttft_s", "tpot_s", "resumed", "speculative",
               "metrics")
# A run's output columns by task: (its tokens, its text), joined as TOKENS and TEXT.
_OUTPUT_COLUMNS = {"generate": ("completion_token_ids", "completion"), "loglikelihood": ("continuation_logprob", None)}
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
    score_changes: list[ScoreChange] = field(default_factory=list)  # the metrics both runs have
    is_scoring: bool = False  # loglikelihood runs: outputs are log-probabilities, not tokens
    config_differences: list[tuple[str, object, object]] = field(default_factory=list)
    num_partitions: int = 1


def compare_runs(new: RunFolder, old: RunFolder, config: ReportConfig) -> Comparison:
    """Both runs' figures and their row-by-row comparison (ReportError for two different prompt sets)."""
    if new.schema is None or old.schema is None:
        raise ReportError(f"{new.url if new.schema is None else old.url} holds no part files: nothing to compare")
    id_type = common_id_type(new.schema.field("id").type, old.schema.field("id").type, new.url, old.url)
    task = _common_task(new, old)
    if config.by is not None:
        old.check_column(config.by, "--by")
    stats_new, stats_old = RunStats(new, config), RunStats(old, config)
    shared = [name for name in stats_new.scores.names if name in stats_old.scores.names]
    count = num_partitions(max(new.arrow_bytes(_read_columns(new, task, config)),
                               old.arrow_bytes(_read_columns(old, task, config))), config.partition_bytes)
    with tempfile.TemporaryDirectory(prefix="batchgen-report-") as folder:
        paths = {}
        for side, run, stats in (("new", new, stats_new), ("old", old, stats_old)):
            schema = _partition_schema(run, task, config, shared)
            writer = PartitionWriter(folder, side, count, schema, id_type)
            try:
                columns = list(dict.fromkeys(stats.columns + _read_columns(run, task, config)))
                for part_index, batch in run.iter_batches(columns, config.batch_rows):
                    verdicts = stats.add(part_index, batch.select(stats.columns))
                    writer.write(_partition_batch(batch, schema, task, verdicts))
            finally:
                writer.close()
            paths[side] = writer.paths
            pa.default_memory_pool().release_unused()  # the allocator keeps freed pages otherwise
        comparison = Comparison(stats_new.figures(), stats_old.figures(), num_partitions=count,
                                is_scoring=task == "loglikelihood")
        changes = ChangeCounter(shared, config, comparison.is_scoring)
        builder = _Builder(comparison, config, check_prompts=_same_model(new, old), names=(new.url, old.url),
                           changes=changes)
        for new_rows, old_rows, new_index, old_index in joined_pairs(paths["new"], paths["old"]):
            builder.add(new_rows, old_rows, new_index, old_index)
            del new_rows, old_rows
            pa.default_memory_pool().release_unused()
    if comparison.num_identical + comparison.num_different == 0 and new.num_rows and old.num_rows:
        raise ReportError(f"different prompt sets: no (id, sample_index) of {new.url} is in {old.url}")
    builder.finish()
    comparison.score_changes = changes.changes(comparison.new.scores, comparison.old.scores)
    comparison.config_differences = config_differences(new, old)
    return comparison


def output_task(run: RunFolder) -> str:
    """generate or loglikelihood, from the run's columns."""
    for task, (tokens, _) in _OUTPUT_COLUMNS.items():
        if tokens in run.column_names:
            return task
    raise ReportError(f"{run.url} has neither completion_token_ids nor continuation_logprob: not the output of a "
                      "batchgen job")


def _common_task(new: RunFolder, old: RunFolder) -> str:
    task_new, task_old = output_task(new), output_task(old)
    if task_new != task_old:
        raise ReportError(f"different tasks: {new.url} is a {task_new} run and {old.url} a {task_old} run; their "
                          "rows cannot be compared")
    return task_new


def _read_columns(run: RunFolder, task: str, config: ReportConfig) -> list[str]:
    """The run's columns the partitions take (those it has)."""
    wanted = ["id", "sample_index", *(c for c in _OUTPUT_COLUMNS[task] if c), "finish_reason", "prompt_tokens"]
    if config.by is not None:
        wanted.append(config.by)
    return [c for c in dict.fromkeys(wanted) if c in run.column_names]


def _partition_schema(run: RunFolder, task: str, config: ReportConfig, metrics: list[str]) -> pa.Schema:
    """id, sample_index, TOKENS, TEXT, finish_reason, prompt_tokens, the --by column, a verdict per metric."""
    tokens, text = _OUTPUT_COLUMNS[task]

    def field_of(name: str | None, as_name: str, default: pa.DataType) -> pa.Field:
        return pa.field(as_name, run.schema.field(name).type if name in run.column_names else default)

    fields = [field_of("id", "id", pa.null()), field_of("sample_index", "sample_index", pa.int32()),
              field_of(tokens, TOKENS, pa.list_(pa.int32())), field_of(text, TEXT, pa.string()),
              field_of("finish_reason", "finish_reason", pa.string()),
              field_of("prompt_tokens", "prompt_tokens", pa.int64())]
    if config.by is not None:
        fields.append(run.schema.field(config.by))
    return pa.schema(fields + [pa.field(metric_column(name), pa.float64()) for name in metrics])


def _partition_batch(batch: pa.RecordBatch, schema: pa.Schema, task: str,
                     verdicts: dict[str, np.ndarray]) -> pa.RecordBatch:
    """The batch as the partition schema has it (a column the run lacks: all null)."""
    renamed = dict(zip((TOKENS, TEXT), _OUTPUT_COLUMNS[task]))
    arrays = []
    for f in schema:
        name = renamed.get(f.name, f.name)
        if f.name.startswith("metric_"):
            arrays.append(pa.array(verdicts[f.name.removeprefix("metric_")], pa.float64()))
        elif name is not None and name in batch.schema.names:
            arrays.append(batch.column(name))
        else:
            arrays.append(pa.nulls(batch.num_rows, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _same_model(new: RunFolder, old: RunFolder) -> bool:
    if new.success is None or old.success is None:
        return False
    return new.success.model is not None and new.success.model == old.success.model


class _Builder:
    """Folds joined partitions into the Comparison, keeping every list bounded."""

    def __init__(self, comparison: Comparison, config: ReportConfig, check_prompts: bool, names: tuple[str, str],
                 changes: ChangeCounter):
        self.c = comparison
        self.config = config
        self.check_prompts = check_prompts
        self.names = names
        self.changes = changes
        self.categories = Codes(config.max_categories) if config.by else None
        self.category_counts: dict[int, CategoryCounts] = {}
        self.first_counts = np.zeros(0, np.int64)

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
        first = first_difference(a.column(TOKENS), b.column(TOKENS))
        same_text = _equal(a.column(TEXT), b.column(TEXT))
        same_finish = _equal(a.column("finish_reason"), b.column("finish_reason"))
        identical = (first == SAME) & same_text & same_finish
        self.c.num_identical += int(identical.sum())
        self.c.num_different += int((~identical).sum())
        positions = first[~identical & (first != SAME)]
        if positions.size and not self.c.is_scoring:  # a loglikelihood row has no generated tokens
            counts = np.bincount(positions)
            if counts.size > self.first_counts.size:
                self.first_counts = np.pad(self.first_counts, (0, counts.size - self.first_counts.size))
            self.first_counts[:counts.size] += counts
        self._keep_different(a, b, first, ~identical)
        if self.categories is not None:
            self._count_categories(new, old, new_index, old_index, both, identical)
        self.changes.add(a, b)

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
                a.column("id")[i].as_py(), a.column("sample_index")[i].as_py(),
                None if pos == SAME or self.c.is_scoring else pos,
                len(a.column(TOKENS)[i].values or []), len(b.column(TOKENS)[i].values or []),
                a.column("finish_reason")[i].as_py(), b.column("finish_reason")[i].as_py()))
            if len(self.c.diffs) < self.config.num_inline_diffs or (
                    (candidates[-1].id, candidates[-1].sample_index) < (self.c.diffs[-1].id, self.c.diffs[-1].sample_index)):
                self._add_inline(candidates[-1], self._text(a, i), self._text(b, i))
        merged = sorted(self.c.different + candidates, key=lambda r: (r.id, r.sample_index))
        self.c.different = merged[:self.config.num_listed_ids]

    def _text(self, rows: pa.Table, i: int) -> str:
        """The row's completion, or a loglikelihood row's answer, as the side-by-side diff shows it."""
        if not self.c.is_scoring:
            return rows.column(TEXT)[i].as_py() or ""
        return answer_text(rows.column(TOKENS)[i].as_py(), None, rows.column("finish_reason")[i].as_py(), True,
                           self.config.max_shown_chars)

    def _add_inline(self, row: DiffRow, new_text: str, old_text: str) -> None:
        limit = self.config.max_shown_chars
        new_segments, old_segments = diff_texts(clip(new_text, limit), clip(old_text, limit))
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

"""The page: figures gathered from the folder(s), plots drawn, one HTML file written.

Rendered with jinja2 and autoescape on: every completion, error, id and category is untrusted text
and reaches the page escaped. The plots' SVG (made by matplotlib, which escapes its own text) is
the only markup inserted as is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import jinja2
import numpy as np

import batchgen.pipeline.run_record_text as record_text
import batchgen.report.formatting as fmt
import batchgen.report.plots as plots
from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.run_record_text import SummaryRow
from batchgen.report.compare import Comparison, compare_runs, output_task
from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.metric_scores import ShownScore
from batchgen.report.run_stats import RunFigures, RunStats
from batchgen.report.score_changes import ScoreChange
from batchgen.report.select_stage import select_figures, select_summary_rows
from batchgen.report.source import RunFolder
from batchgen.report.stages_page import is_stages_folder, render_stages_page

_LATENCY_TITLES = {"queue_s": "queue", "ttft_s": "time to first token", "tpot_s": "time per output token",
                   "e2e_s": "end to end"}
_MAX_CATEGORY_BARS = 20


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("batchgen.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(fmt.FILTERS)
    return env


@dataclass
class Report:
    """A rendered page and the scores it leads with (what `batchgen report` prints)."""

    html: str
    scores: list[ShownScore]
    score_changes: list[ScoreChange] = field(default_factory=list)  # with --against: the metrics both runs have
    path: str | None = None  # where write_report put the page
    # with --against: (key, this run's value, the baseline's) per configuration key that differs
    config_differences: list[tuple[str, object, object]] = field(default_factory=list)
    is_stages: bool = False  # a multi-stage job's page: its stages' own pages carry the scores

    def scores_dict(self) -> dict:
        """The scores as `batchgen report --json` prints them."""
        out: dict = {"scores": {s.name: s.to_dict() for s in self.scores}}
        if self.score_changes:
            out["against"] = {c.name: c.to_dict() for c in self.score_changes}
        if self.config_differences:
            out["config_differences"] = {key: {"new": _json_value(new), "old": _json_value(old)}
                                         for key, new, old in self.config_differences}
        return out


def _json_value(value: object) -> object:
    """A configuration value as JSON holds it (a key one run lacks: null)."""
    return None if type(value).__name__ == "_Absent" else value


def build_report(config: ReportConfig) -> str:
    """The page's HTML for `config.out` (and `config.against`)."""
    return render_report(config).html


def render_report(config: ReportConfig) -> Report:
    """The page for `config.out` (and `config.against`) with the scores it shows; a multi-stage job's
    output folder gets the page of its stages (stages_page.py)."""
    if config.against is None and is_stages_folder(config.out, config.storage_options):
        return Report(render_stages_page(config, _environment()), [], is_stages=True)
    new = RunFolder(config.out, config.storage_options)
    is_select = new.success is not None and new.success.select is not None
    comparison: Comparison | None = None
    if config.against is not None:
        old = RunFolder(config.against, config.storage_options)
        if is_select or (old.success is not None and old.success.select is not None):
            raise ReportError("--against compares two model runs' rows by (id, sample_index); a select stage's "
                              "output has one row per prompt (or per kept row) and no sample_index: compare the "
                              "folders of the stages it read, or report each select stage on its own")
        comparison = compare_runs(new, old, config)
        figures = comparison.new
    else:
        old = None
        stats = RunStats(new, config)
        for part_index, batch in new.iter_batches(stats.columns, config.batch_rows):
            stats.add(part_index, batch)
        figures = stats.figures()
    context = {
        "config": config,
        "run": new,
        "baseline": old,
        "figures": figures,
        "summary": select_summary_rows(new.success) if is_select else summary_rows(new.success),
        "select": select_figures(new.success),
        "is_select": is_select,  # no model ran: no tokens, latencies, finish reasons or plots of them
        "warnings": folder_warnings(new, figures) + (folder_warnings(old, comparison.old) if old else []),
        "latency": [(name, _LATENCY_TITLES[name], figures.latency[name]) for name in figures.latency_columns],
        "is_scoring": (new.schema is not None and (new.success is None or new.success.select is None)
                       and output_task(new) == "loglikelihood"),  # a select stage's rows: neither task's
        "batch_files": {name: new.count_lines(name) for name in new.batch_files},
        "comparison": comparison,
        "compare_rows": compare_rows(new, old, comparison) if comparison else [],
        "plots": [] if is_select else make_plots(new, figures, comparison, config),
        "generated": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "fmt": fmt,
    }
    html = _environment().get_template("report.html.j2").render(**context)
    return Report(html, figures.scores, comparison.score_changes if comparison else [],
                  config_differences=comparison.config_differences if comparison else [])


def write_report(config: ReportConfig) -> str:
    """Build the page and write it to `config.output` (a path or a URI) whole; returns where it went."""
    return publish_report(config).path


def publish_report(config: ReportConfig) -> Report:
    """Build the page, write it to `config.output` (a path or a URI) whole; the report with its path."""
    from batchgen.report.source import Storage

    report = render_report(config)
    folder, _, name = config.output.replace("\\", "/").rpartition("/")
    storage = Storage(folder or os.curdir, config.storage_options)
    report.path = storage.write_text_atomic(name, report.html)
    return report


def summary_rows(success: RunRecord | None) -> list[SummaryRow]:
    """The summary table: the rows `batchgen run` prints, each keyed by its `_SUCCESS` key."""
    return [] if success is None else record_text.summary_rows(success)


def folder_warnings(run: RunFolder, figures: RunFigures) -> list[str]:
    """Where the folder's parts and its `_SUCCESS` disagree, or it has no `_SUCCESS`."""
    if run.success is None:
        return [(f"{run.url} has no _SUCCESS: the run is not finished (or failed); the figures below come from "
                 f"the {len(run.parts)} part file(s) present")]
    warnings = []
    checks = (("num_rows", figures.num_rows), ("num_requests", figures.num_requests),
              ("num_errors", figures.num_error_requests), ("completion_tokens", figures.completion_tokens),
              ("prompt_tokens", figures.prompt_tokens), ("cached_tokens", figures.cached_tokens))
    for key, counted in checks:
        if key == "num_requests" and run.success.select is not None:
            continue  # a select stage's num_requests counts the prompts it read, not its rows
        recorded = getattr(run.success, key)
        if recorded != counted:
            warnings.append(f"{run.url}: _SUCCESS says {key} {recorded:,}, the part files hold {counted:,} "
                            "(files were added or removed after the run)")
    return warnings


def compare_rows(new: RunFolder, old: RunFolder, c: Comparison) -> list[tuple[str, str, str, str, str]]:
    """(key, label, this run, baseline, delta) for the figures both runs have."""
    rows = []

    def add(key: str, label: str, x, y, show, unit: str = "", scale: float = 1.0, digits: int = 1) -> None:
        rows.append((key, label, show(x), show(y), fmt.delta(x, y, unit, scale, digits)))

    add("num_rows", "output rows", c.new.num_rows, c.old.num_rows, fmt.count, digits=0)
    add("num_errors", "failed requests", c.new.num_error_requests, c.old.num_error_requests, fmt.count, digits=0)
    add("completion_tokens", "completion tokens", c.new.completion_tokens, c.old.completion_tokens, fmt.count,
        digits=0)
    add("mean_completion_tokens", "mean completion tokens", _mean(c.new), _mean(c.old), fmt.rate)
    add("completion_tokens_per_s", "completion tokens/s", _speed(new), _speed(old), fmt.rate)
    for name, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end to end")):
        if name not in c.new.latency_columns or name not in c.old.latency_columns:
            continue
        for q in ("p50", "p90", "p99"):
            add(f"{name}.{q}", f"{label} {q}", getattr(c.new.latency[name], q), getattr(c.old.latency[name], q),
                fmt.ms, " ms", 1000.0)
    for reason in sorted({r for r, _ in c.new.finish_reasons} | {r for r, _ in c.old.finish_reasons}):
        add(f"finish.{reason}", f"finish reason {reason}", dict(c.new.finish_reasons).get(reason, 0),
            dict(c.old.finish_reasons).get(reason, 0), fmt.count, digits=0)
    return rows


def _speed(run: RunFolder) -> float | None:
    return None if run.success is None else run.success.completion_tokens_per_s


def _mean(figures: RunFigures) -> float | None:
    return figures.completion_tokens / figures.num_rows if figures.num_rows else None


def make_plots(run: RunFolder, figures: RunFigures, c: Comparison | None,
               config: ReportConfig) -> list[plots.Plot]:
    """Every plot of the page, in order (the per-row arrays come with the figures)."""
    series = _latency_series(figures, c)
    made = [plots.histogram(name.removesuffix("_s"), f"{_LATENCY_TITLES[name]} (ms)", "milliseconds",
                            series[name], scale=1000.0) for name in ("ttft_s", "tpot_s", "e2e_s") if name in series]
    lengths = [("this run", figures.lengths)] + ([("baseline", c.old.lengths)] if c else [])
    if c is None:
        made.append(plots.stacked_lengths("lengths", "completion lengths by finish reason", figures.lengths,
                                          figures.finish_codes, figures.finish_names))
    else:
        made.append(plots.histogram("lengths", "completion lengths", "completion tokens", lengths, integer=True))
    made.append(_throughput_plot(run, figures))
    reasons = [r for r, _ in figures.finish_reasons]
    if c is None:
        made.append(plots.bars("finish", "finish reasons", reasons, [n for _, n in figures.finish_reasons], "rows"))
    else:
        reasons = sorted(set(reasons) | {r for r, _ in c.old.finish_reasons})
        made.append(plots.bars("finish", "finish reasons", reasons,
                               [dict(figures.finish_reasons).get(r, 0) for r in reasons], "rows",
                               second=("baseline", [dict(c.old.finish_reasons).get(r, 0) for r in reasons]),
                               first_label="this run"))
    if c is not None and not c.is_scoring:
        made.append(plots.position_histogram(
            "first_token", "where differing rows first differ", c.first_token_counts,
            "For greedy runs: the first token the two runs' models disagree on; for sampled runs, where the "
            "draws first part."))
    if config.by is not None:
        made.append(_category_plot(figures, c, config.by))
    return made


def _latency_series(figures: RunFigures, c: Comparison | None) -> dict[str, list[tuple[str, np.ndarray]]]:
    out = {}
    for name in figures.latency_columns:  # a loglikelihood run's rows have no token times
        out[name] = [("this run", figures.latency_values[name])]
        if c is not None and name in c.old.latency_columns:
            out[name].append(("baseline", c.old.latency_values[name]))
    return out


def _throughput_plot(run: RunFolder, figures: RunFigures) -> plots.Plot:
    times = np.array([t if t is not None else np.nan for t in figures.part_times], dtype=np.float64)
    tokens = np.array(figures.part_tokens, dtype=np.float64)
    known = ~np.isnan(times)
    caption = ("One point per part file, at the time the store last wrote it (its commit); "
               "the run's start is _SUCCESS's time minus generation_seconds.")
    start = None
    success = run.success
    if run.success_at is not None and success is not None and not success.resumed:
        start = run.success_at - success.generation_seconds
    if known.any():
        earliest = float(times[known].min())
        if start is None or start > earliest:
            start = earliest
            caption = ("One point per part file, at the time the store last wrote it (its commit), from the "
                       "first part's commit (the run's start is not known: resumed or no _SUCCESS).")
    return plots.throughput("throughput", "completion tokens over the run", times[known] - (start or 0.0),
                            tokens[known], caption)


def _category_plot(figures: RunFigures, c: Comparison | None, by: str) -> plots.Plot:
    if c is None:
        rows = figures.categories[:_MAX_CATEGORY_BARS]
        return plots.bars("categories", f"end to end p50 by {by} (ms)", [r.name for r in rows],
                          [(r.e2e.p50 or 0.0) * 1000 for r in rows], "milliseconds",
                          caption=f"The {len(rows)} most frequent values of {by}.")
    rows = c.categories[:_MAX_CATEGORY_BARS]
    return plots.bars("categories", f"rows that differ, by {by}", [r.name for r in rows],
                      [r.num_different / max(1, r.num_identical + r.num_different) for r in rows],
                      "share of the rows both runs have", caption=f"The {len(rows)} most frequent values of {by}.")

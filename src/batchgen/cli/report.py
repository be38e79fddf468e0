"""`batchgen report OUT [--against OTHER_OUT] [--metric NAME=SPEC ...]` and the page `batchgen run --report`
writes (the report package, which needs the report extra, is imported only when one of them runs)."""

from __future__ import annotations

import importlib.util
import json
from typing import Annotated

import typer

from batchgen.cli.console import EXIT_BAD_JOB, fail
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import REPORT_NAME

REPORT_FAILED = "batchgen: the run succeeded (see _SUCCESS); its report failed: "


def check_report_extra() -> None:
    """JobError naming the report extra's missing packages (before a run: it should not cost a whole run)."""
    missing = [name for name in ("matplotlib", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise JobError(f"--report needs {', '.join(missing)}: pip install 'batchgen[report]'")


def write_run_report(config) -> None:
    """The report of a finished run, beside its _SUCCESS, with the job's metrics (they are in its parts).
    A report that fails is said on stderr and changes nothing else: the run succeeded, and its exit code
    (0, or the threshold's) is the run's."""
    write_folder_report(config.output.path, config.output.storage_options or {})


def write_folder_report(out: str, storage_options: dict) -> None:
    """`out`/report.html: the page of a finished output folder (a run's, a select stage's, or a
    multi-stage job's, which lists its stages). A page that fails is said on stderr, as write_run_report's."""
    try:
        from batchgen.report import ReportConfig, write_report

        path = write_report(ReportConfig(out=out, output=out.rstrip("/") + "/" + REPORT_NAME,
                                         storage_options=storage_options))
    except Exception as exc:  # noqa: BLE001 - whatever broke the page, the run's outcome stands
        typer.echo(f"{REPORT_FAILED}{type(exc).__name__}: {exc}", err=True)
        return
    typer.echo(f"batchgen: report written to {path}", err=True)


def report(
    output: Annotated[str, typer.Argument(
        metavar="OUT", help="A finished run's output folder or URI; a select stage's folder (its counts, score "
                            "and margin histograms); or a multi-stage job's output.path (every stage, its "
                            "counts and state, linking the stages' own pages).", show_default=False)],
    against: Annotated[str | None, typer.Option(
        "--against", metavar="OTHER_OUT",
        help="A second run of the same prompts (the baseline): rows joined by (id, sample_index), "
             "identical / different / missing, where tokens first differ, figure and config deltas; for each "
             "metric both runs have, both values, the change, the rows that flipped and McNemar's exact "
             "test on the paired verdicts.")] = None,
    by: Annotated[str | None, typer.Option(
        "--by", metavar="COLUMN", help="A kept column whose values name categories: figures per category.")] = None,
    metric: Annotated[list[str] | None, typer.Option(
        "--metric", metavar="NAME=SPEC",
        help="Score the rows with a metric, as a job's `metrics:` entry (SPEC is YAML), e.g. --metric "
             "'em={type: exact_match, reference_column: answer, ignore_case: true}'; repeatable. With "
             "--against both runs are scored. One named like a run's own metric replaces it.")] = None,
    reference: Annotated[str | None, typer.Option(
        "--reference", metavar="COLUMN",
        help="A kept column with the expected completion: the same as --metric "
             "'exact_match={type: exact_match, reference_column: COLUMN}' (surrounding whitespace ignored, "
             "error rows wrong), except that rows whose COLUMN is null are not scored.")] = None,
    continuations_column: Annotated[str | None, typer.Option(
        "--continuations-column", metavar="COLUMN",
        help="A loglikelihood run's kept column of continuation texts, for --metric choice_accuracy_norm "
             "or labels given as text.")] = None,
    page: Annotated[str, typer.Option("-o", "--output", metavar="FILE",
                                      help="Where to write the page (a path or a URI).")] = REPORT_NAME,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the page's path and its scores (and their changes) as JSON.")] = False,
) -> None:
    """One self-contained HTML page about a finished run: scores first, then summary, plots, slowest and
    failed rows; prints the scores.

    Needs the report extra (pip install 'batchgen\\[report]'). Reads the parts batch by batch: a run of
    millions of rows reports in bounded memory. Exit 2 when the folder, a column or a metric is wrong, or
    when --against names a run of other prompts.
    """
    try:
        check_report_extra()
        from batchgen.report import ReportConfig, ReportError, publish_report
        from batchgen.report.metric_scores import parse_metric_option
    except JobError as exc:
        raise fail(exc) from None
    try:
        metrics = {}
        for text in metric or []:
            name, spec = parse_metric_option(text)
            if name in metrics:
                raise ReportError(f"--metric {name} is given twice")
            metrics[name] = spec
        done = publish_report(ReportConfig(out=output, against=against, by=by, reference=reference, metrics=metrics,
                                           continuations_column=continuations_column, output=page))
    except ReportError as exc:
        typer.echo(f"batchgen report: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    except Exception as exc:
        raise fail(exc) from None
    if json_out:
        typer.echo(json.dumps({"report": done.path, **done.scores_dict()}, indent=2))
        return
    typer.echo(f"batchgen: report written to {done.path}")
    if done.is_stages:
        typer.echo("a multi-stage job's page: each stage's scores are on its own page (batchgen report "
                   f"{output.rstrip('/')}/<stage>)")
        return
    typer.echo("\n".join(format_scores(done, against)))
    if against is not None:
        typer.echo("\n".join(format_config_differences(done.config_differences)))


def format_config_differences(differences: list[tuple[str, object, object]], max_chars: int = 120) -> list[str]:
    """What the two runs' configurations (`_SUCCESS` with its provenance, and the input manifests) say
    differently: a line per key, this run's value, then the baseline's."""
    if not differences:
        return ["configuration: no difference"]

    def shown(value: object) -> str:
        text = "(absent)" if type(value).__name__ == "_Absent" else json.dumps(value, default=str)
        return text if len(text) <= max_chars else text[:max_chars - 3] + "..."

    return ["configuration differences (this run vs --against)"] + [
        f"  {key}: {shown(new)} vs {shown(old)}" for key, new, old in differences]


def format_scores(done, against: str | None) -> list[str]:
    """The scores as text: one line per metric, then with --against one line per metric both runs have."""
    from batchgen.report import formatting as fmt

    if not done.scores:
        return ["scores   none: the run has no metric (score it with --metric NAME=SPEC)"]
    width = max(len(s.name) for s in done.scores)
    lines = ["scores"]
    for s in done.scores:
        low, high = s.interval
        lines.append(f"  {s.name:<{width}}  {fmt.score(s.score.value)}  95% {fmt.score(low)} to {fmt.score(high)}  "
                     f"n {s.score.n:,}  {s.type}{f' k={s.k}' if s.k else ''}, {fmt.score_source(s)}")
    if done.score_changes:
        lines.append(f"against {against}")
        for c in done.score_changes:
            lines.append(f"  {c.name:<{width}}  {fmt.score(c.new.score.value)} vs {fmt.score(c.old.score.value)}  "
                         f"change {fmt.score_delta(c.delta)}  right->wrong {c.num_right_to_wrong:,}  "
                         f"wrong->right {c.num_wrong_to_right:,} of {c.num_paired:,} paired  "
                         f"McNemar p {fmt.p_value(c.p_value)}: {'beyond' if c.is_beyond_noise else 'within'} noise")
    return lines

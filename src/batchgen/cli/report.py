"""`batchgen report OUT [--against OTHER_OUT]` and the page `batchgen run --report` writes (the report
package, which needs the report extra, is imported only when one of them runs)."""

from __future__ import annotations

import importlib.util
from typing import Annotated

import typer

from batchgen.cli.console import EXIT_BAD_JOB, fail
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import REPORT_NAME


def check_report_extra() -> None:
    """JobError naming the report extra's missing packages (before a run: it should not cost a whole run)."""
    missing = [name for name in ("matplotlib", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise JobError(f"--report needs {', '.join(missing)}: pip install 'batchgen[report]'")


def write_run_report(config) -> None:
    """The report of a finished run, beside its _SUCCESS."""
    from batchgen.report import ReportConfig, write_report

    try:
        out = config.output.path
        path = write_report(ReportConfig(out=out, output=out.rstrip("/") + "/" + REPORT_NAME,
                                         storage_options=config.output.storage_options or {}))
    except Exception as exc:
        raise fail(exc) from None
    typer.echo(f"batchgen: report written to {path}", err=True)


def report(
    output: Annotated[str, typer.Argument(metavar="OUT", help="A finished run's output folder or URI.",
                                          show_default=False)],
    against: Annotated[str | None, typer.Option(
        "--against", metavar="OTHER_OUT",
        help="A second run of the same prompts (the baseline): rows joined by (id, sample_index), "
             "identical / different / missing, where tokens first differ, figure and config deltas.")] = None,
    by: Annotated[str | None, typer.Option(
        "--by", metavar="COLUMN", help="A kept column whose values name categories: figures per category.")] = None,
    reference: Annotated[str | None, typer.Option(
        "--reference", metavar="COLUMN",
        help="A kept column with the expected completion: exact match (surrounding whitespace ignored).")] = None,
    page: Annotated[str, typer.Option("-o", "--output", metavar="FILE",
                                      help="Where to write the page (a path or a URI).")] = REPORT_NAME,
) -> None:
    """One self-contained HTML page about a finished run: summary, plots, slowest and failed rows.

    Needs the report extra (pip install 'batchgen\\[report]'). Reads the parts batch by batch: a run of
    millions of rows reports in bounded memory. Exit 2 when the folder or a column is wrong, or when
    --against names a run of other prompts.
    """
    try:
        check_report_extra()
        from batchgen.report import ReportConfig, ReportError, write_report
    except JobError as exc:
        raise fail(exc) from None
    try:
        path = write_report(ReportConfig(out=output, against=against, by=by, reference=reference, output=page))
    except ReportError as exc:
        typer.echo(f"batchgen report: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    except Exception as exc:
        raise fail(exc) from None
    typer.echo(f"batchgen: report written to {path}")

"""How the `batchgen` command ends and talks: exit codes, the one-line error, logging to stderr, help text."""

from __future__ import annotations

import logging
import sys
import traceback

import typer

from batchgen.pipeline.errors import JobError

EXIT_FAILURE = 1
EXIT_BAD_JOB = 2  # also click's code for usage errors
EXIT_BELOW_MINIMUM = 3  # the run finished (_SUCCESS written) but a metric is below its `min`


def check_metric_minimums(metrics: dict, scores: dict) -> None:
    """Exit 3 naming each metric whose value is below the job's `metrics.<name>.min` (`scores`: the run
    record's metrics), so that a scheduler sees a regression; the output stays complete."""
    below = [f"{name} {'nothing scored' if scores[name].value is None else f'{scores[name].value:.4f}'} "
             f"< min {spec.min}" for name, spec in metrics.items()
             if spec.min is not None and name in scores
             and (scores[name].value is None or scores[name].value < spec.min)]
    if below:
        typer.echo(f"batchgen: below the job's minimum: {'; '.join(below)} (exit {EXIT_BELOW_MINIMUM})", err=True)
        raise typer.Exit(EXIT_BELOW_MINIMUM)


def fail(exc: BaseException) -> typer.Exit:
    """The exit for an exception: 2 with one line for a bad job, 1 with the traceback for anything else."""
    if isinstance(exc, JobError):
        typer.echo(f"batchgen: bad job: {exc}", err=True)
        return typer.Exit(EXIT_BAD_JOB)
    traceback.print_exc()
    typer.echo(f"batchgen: failed: {type(exc).__name__}: {exc}", err=True)
    return typer.Exit(EXIT_FAILURE)


def setup_logging(verbose: bool = False) -> None:
    """The engine's and the pipeline's log lines on stderr, prefixed `batchgen:`. `verbose`: also
    batchgen's debug lines (the kernels chosen, the allocator setting, oneDNN packing), not other
    libraries' debug output."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="batchgen: %(message)s")
    logging.getLogger("batchgen").setLevel(logging.DEBUG if verbose else logging.NOTSET)


def help_text(doc: str) -> str:
    """A field docstring as one option's help: one paragraph, and no `[word]` that typer's rich markup
    would read as a style tag."""
    text = " ".join(doc.split())
    if typer.core.HAS_RICH:
        from rich.markup import escape

        return escape(text)
    return text

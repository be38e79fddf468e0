"""`batchgen card OUT [-o FILE]`: the dataset card (README.md) of a finished output folder."""

from __future__ import annotations

from typing import Annotated

import typer

from batchgen.cli.console import EXIT_BAD_JOB, fail


def card(
    out: Annotated[str, typer.Argument(metavar="OUT", help="A finished job's output folder or URI.")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", metavar="FILE",
        help="Where to write the card; default OUT/README.md (where the Hugging Face Hub reads it).")] = None,
) -> None:
    """Write a dataset card for OUT: YAML front matter as the Hugging Face Hub reads it (features, the
    parts as the train split, counts), the finish reasons and the run's full provenance; the license is
    left for you to set."""
    from batchgen.report.card import write_card
    from batchgen.report.config import ReportError

    try:
        path = write_card(out, output)
    except ReportError as exc:
        typer.echo(f"batchgen card: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    except Exception as exc:
        raise fail(exc) from None
    typer.echo(f"batchgen: dataset card written to {path}")

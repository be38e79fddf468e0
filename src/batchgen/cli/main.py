"""The `batchgen` command: one typer app whose commands live one family per module (jobs: run,
validate, finalize; plan; serve; report; bench). It imports the products; none of them imports it.
Exit codes: 0 done, 2 bad job or usage, 1 failure."""

from __future__ import annotations

import typer

from batchgen.cli import jobs
from batchgen.cli.bench import bench_command
from batchgen.cli.card import card
from batchgen.cli.plan import plan_command
from batchgen.cli.report import report
from batchgen.cli.serve import register_serve

app = typer.Typer(
    name="batchgen",
    help="Offline batch generation: Parquet prompts in, Parquet completions with TTFT/TPOT out.\n\n"
         "Start with `batchgen validate JOB.yaml` (checks the job, loads no weights), "
         "then `batchgen run JOB.yaml`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("run")(jobs.run)
app.command("finalize")(jobs.finalize)
app.command("validate")(jobs.validate)
register_serve(app)
app.command("bench")(bench_command)
app.command("report")(report)
app.command("plan")(plan_command)
app.command("card")(card)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

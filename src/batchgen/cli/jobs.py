"""The job commands: `batchgen run`, `batchgen validate` and `batchgen finalize`. Exit codes: 0 done,
2 bad job or usage, 1 failure, 3 done with a metric below the job's `metrics.<name>.min`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from batchgen.cli.console import EXIT_BAD_JOB, EXIT_FAILURE, check_metric_minimums, fail, setup_logging
from batchgen.cli.report import check_report_extra, write_folder_report, write_run_report
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import REPORT_NAME
from batchgen.pipeline.run_record import RunRecord

JobArg = Annotated[Path, typer.Argument(help="The job file (YAML); see the job file reference.",
                                        show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="SECTION.KEY=VALUE",
    help="Override a job key, e.g. --set sampling.temperature=0.7 (repeatable; the value is read as YAML; "
         "paths given here are relative to the current directory).")]
LimitOpt = Annotated[int | None, typer.Option(
    "--limit", min=1, help="Only the first N input rows; a later run with a larger N, or none, reuses their rows.")]


def run(
    job: JobArg,
    set_: SetOpt = None,
    limit: LimitOpt = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace the output of a different job config in output.path.")] = False,
    shard: Annotated[str | None, typer.Option(
        "--shard", metavar="I/N|auto",
        help="Run only the units k with k mod N == I (static shards on one output folder); auto: from "
             "SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX (with --num-shards).")] = None,
    num_shards: Annotated[int | None, typer.Option(
        "--num-shards", min=1, help="With --shard auto: the shard count (Kubernetes: the Job's completions).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the _SUCCESS JSON instead of the table.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")] = True,
    report: Annotated[bool, typer.Option(
        "--report", help=f"At the end, write `batchgen report`'s page as {REPORT_NAME} beside _SUCCESS "
                         "(needs the report extra).")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also log batchgen's debug lines (the kernels chosen, the allocator setting).")] = False,
) -> None:
    """Run a job: generate for every input row, write part-NNNNN.parquet files and _SUCCESS.

    Rerunning the same job resumes: finished units are skipped.
    """
    from batchgen.pipeline.job import run_job
    from batchgen.pipeline.run_record_text import format_summary
    from batchgen.pipeline.stages import StagedJob, load_any_job

    setup_logging(verbose)
    try:
        if report:
            check_report_extra()  # before the job: a missing package should not cost a whole run
        config = load_any_job(job, set_ or [], limit)
        if isinstance(config, StagedJob):
            results = _run_stages(config, shard, num_shards, overwrite, progress)
        is_shard = shard is not None or num_shards is not None
        if isinstance(config, StagedJob):
            pass
        elif is_shard:
            complete_record = _run_shard(config, shard, num_shards, limit, overwrite, json_out, progress)
        else:
            result = run_job(config, limit=limit, overwrite=overwrite, progress=progress)
    except Exception as exc:
        raise fail(exc) from None
    if isinstance(config, StagedJob):
        _report_stages(config, results, json_out, report)
        return
    if is_shard:
        if report and complete_record is not None:  # the shard that finds the job complete writes the page
            write_run_report(config)
        if complete_record is not None:
            check_metric_minimums(config.metrics, complete_record.metrics)
        return
    if json_out:
        typer.echo(json.dumps(result.record.to_dict(), indent=2))
        typer.echo(f"batchgen: {config.name} done: output in {config.output.path} ({result.success_path})", err=True)
    else:
        redone = f" ({len(result.redone)} of them run again: their part failed verification)" if result.redone else ""
        typer.echo(f"batchgen: {config.name} done: {result.num_units_run} unit(s) run{redone}, "
                   f"{result.num_units_skipped} already done"
                   + (f", {result.num_rows_generated:,} row(s) generated, {result.num_rows_reused:,} row(s) reused from "
                      "checkpoints" if result.num_rows_reused else ""))
        typer.echo(format_summary(result.record, result.success_path))
    if report:
        write_run_report(config)
    check_metric_minimums(config.metrics, result.record.metrics)


# Why static shards and stages do not mix: a later stage reads the earlier stage's whole committed output
# (a prompt's samples may sit in any shard's parts), and static shards neither know of nor wait for each
# other, so no shard can tell when it may start stage 2. Ray's driver can: it runs stage by stage.
SHARDED_STAGES = (
    "--shard: a multi-stage job does not run as static shards: each stage reads the whole committed output "
    "of the stage before it, and static shards do not wait for one another, so no shard could start a later "
    "stage before every shard had finished the earlier one. Spread its stages with cluster.backend: ray (each "
    "model stage's units over the replicas, stage after stage), or run the first stage as a job of its own "
    "with --shard (its output.keep_columns holding the prompt column) and start the multi-stage job from its "
    "output folder (input: {path: <that folder>, allow_duplicate_ids: true, ...})")


def _run_stages(staged, shard: str | None, num_shards: int | None, overwrite: bool, progress: bool) -> list:
    """A multi-stage job: every stage in order into <output.path>/<stage>/ (each resumes on its own)."""
    from batchgen.pipeline.stages.run import run_staged_job

    if shard is not None or num_shards is not None:
        raise JobError(SHARDED_STAGES)
    return run_staged_job(staged, overwrite=overwrite, progress=progress)


def _report_stages(staged, results: list, json_out: bool, report: bool) -> None:
    """Print each stage's outcome; write the report pages; exit 3 when a stage's metric is below its min."""
    from batchgen.pipeline.stages.text import format_stage_results

    if json_out:
        typer.echo(json.dumps({r.stage.name: r.record.to_dict() for r in results}, indent=2))
    else:
        typer.echo(format_stage_results(staged, results))
    if report:  # every stage's page (select stages too), then the job's page linking them
        for result in results:
            write_folder_report(result.stage.output_path, staged.storage_options)
        write_folder_report(staged.output_path, staged.storage_options)
    for result in results:
        if result.stage.job is not None:
            check_metric_minimums(result.stage.job.metrics, result.record.metrics)


def _run_shard(config, shard: str | None, num_shards: int | None, limit: int | None, overwrite: bool,
               json_out: bool, progress: bool) -> RunRecord | None:
    """Run one shard; the run record when the job is complete (_SUCCESS written by this shard or
    another), else None."""
    from batchgen.pipeline.run_record_text import format_summary
    from batchgen.pipeline.shards import parse_shard, run_shard

    if shard is None:
        raise JobError("--num-shards goes with --shard auto")
    if overwrite:
        raise JobError("--overwrite does not combine with --shard: one shard would delete the others' work; "
                       "clear the folder with a plain `batchgen run --overwrite`, or choose another output.path")
    spec = parse_shard(shard, num_shards)
    result = run_shard(config, spec, limit=limit, progress=progress)
    done = result.finalized
    if json_out:
        typer.echo(json.dumps(done.record.to_dict() if done.record else result.summary, indent=2))
        return done.record
    typer.echo(f"batchgen: {config.name} shard {spec.index}/{spec.count} (from {spec.source}) done: "
               f"{result.num_units_run} unit(s) run, {result.num_units_skipped} already done")
    if done.record is not None:
        typer.echo(("this shard wrote _SUCCESS:\n" if done.created else "the job is complete:\n")
                   + format_summary(done.record, config.output.path.rstrip("/") + "/_SUCCESS"))
    else:
        typer.echo(f"waiting for other shards: {len(done.missing)} unit(s) not committed yet; the shard that "
                   "commits the last one writes _SUCCESS (or run `batchgen finalize OUT` once all are done); "
                   f"this shard's parts are in {config.output.path}")
    return done.record


def finalize(
    output: Annotated[str, typer.Argument(metavar="OUT", help="The job's output folder or URI.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the _SUCCESS JSON instead of the table.")] = False,
) -> None:
    """Write _SUCCESS from the committed parts (after static shards), if every planned unit is committed.

    Exit 0 with _SUCCESS written or already there; 1 when units are missing (they are named).
    """
    from batchgen.pipeline.output import finalize_folder
    from batchgen.pipeline.run_record_text import format_summary
    from batchgen.pipeline.storage import Storage

    try:
        storage = Storage(output)
        done = finalize_folder(storage)
    except Exception as exc:
        raise fail(exc) from None
    if done.record is None:
        shown = ", ".join(done.missing[:20]) + (" ..." if len(done.missing) > 20 else "")
        typer.echo(f"batchgen: {output}: {len(done.missing)} unit(s) not committed: {shown}; run their "
                   "shards again (they resume)", err=True)
        raise typer.Exit(EXIT_FAILURE)
    if json_out:
        typer.echo(json.dumps(done.record.to_dict(), indent=2))
    else:
        typer.echo(("wrote _SUCCESS\n" if done.created else "_SUCCESS was already there\n")
                   + format_summary(done.record, storage.join("_SUCCESS")))


def validate(job: JobArg, set_: SetOpt = None, limit: LimitOpt = None,
             weights: Annotated[bool, typer.Option(
                 "--weights", help="Also read every weight tensor and check it is finite (a damaged file's "
                                   "NaN or infinity exits 2 naming the tensor); reads the whole file.")] = False,
             tokenize: Annotated[bool, typer.Option(
                 "--tokenize", help="Also make every row's prompt as the run will (chat template, per-row "
                                    "settings) with the tokenizer alone, and count the rows too long for "
                                    "max_model_len (prompt tokens + max_tokens) or input.max_prompt_bytes; "
                                    "loads no weights.")] = False,
             ) -> None:
    """Check a job without running it: the file, the model's files, every input's schema, the
    structured-output constraint (compiled over the model's tokenizer); print the plan.

    The model's files are read as the engine reads them before its weights (a GGUF's header and metadata
    with the loader's size checks, safetensors headers, config.json, the tokenizer, the chat template);
    loads no weights unless --weights asks for every tensor's values to be checked. A damaged or hostile
    file exits 2 naming it. --tokenize counts the overlong rows before any run (they are error rows, or
    cut with input.on_overlong: truncate_left; the exit code stays 0).
    """
    from batchgen.pipeline.job_plan import format_job_plan, plan_job
    from batchgen.pipeline.model_files import check_model_files, check_model_weights, needs_chat_template
    from batchgen.pipeline.stages import StagedJob, load_any_job
    from batchgen.pipeline.structured_job import check_job_constraint_before_load

    try:
        config = load_any_job(job, set_ or [], limit)
        if isinstance(config, StagedJob):
            from batchgen.pipeline.stages.validate import validate_staged_job

            if weights or tokenize:
                raise JobError(f"{'--weights' if weights else '--tokenize'} applies to a single-stage job: a "
                               "multi-stage job's validate reads each stage's model files (headers, tokenizer); "
                               "validate a stage's own job file for it")
            lines, is_refused = validate_staged_job(config)
    except Exception as exc:
        raise fail(exc) from None
    if isinstance(config, StagedJob):
        typer.echo("\n".join(lines))
        if is_refused:
            typer.echo("batchgen: bad job: a stage's output folder would be refused (see above)", err=True)
            raise typer.Exit(EXIT_BAD_JOB)
        typer.echo("ok")
        return
    try:
        plan = plan_job(config, limit)
        check_job_constraint_before_load(plan.job)
        source = plan.model_source
        files = None if source is None else check_model_files(source, needs_chat_template(plan.job))
        checked = None if source is None or not weights else check_model_weights(source)
        tokens = None
        if tokenize:
            from batchgen.pipeline.token_check import check_tokens

            tokens = check_tokens(plan)
    except Exception as exc:
        raise fail(exc) from None
    typer.echo(format_job_plan(plan))
    if files is None:
        typer.echo("files    the model is remote: its files are read when the run fetches them")
    else:
        read = "GGUF header and metadata" if source.is_gguf else "config.json, safetensors headers"
        typer.echo(f"files    {read}, tokenizer ({files.num_tokens:,} tokens), "
                   + ("chat template: renders" if files.has_chat_template else "no chat template"))
    if checked is not None:
        typer.echo(f"weights  {checked[0]:,} tensors read ({checked[1] / 1e6:,.0f} MB as float), every value finite")
    if tokens is not None:
        from batchgen.pipeline.token_check import format_token_check

        typer.echo("\n".join(format_token_check(tokens)))
    if plan.state.refusal:
        typer.echo("batchgen: bad job: the output folder would be refused (see above)", err=True)
        raise typer.Exit(EXIT_BAD_JOB)
    typer.echo("ok")

"""What `batchgen run` and `batchgen validate` print for a multi-stage job: one block per stage."""

from __future__ import annotations

from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.run_record_text import count, format_summary
from batchgen.pipeline.stages.histogram import format_histogram
from batchgen.pipeline.stages.spec import Stage, StagedJob


def describe_stage(stage: Stage) -> str:
    """One line: the stage, its task, what it reads and its identity."""
    reads = f"stage {stage.upstream}" if stage.upstream else (stage.input_path or stage.job.input.path)
    if stage.is_select:
        what = f"select {stage.select.rule}"
    else:
        what = f"{stage.task} with {stage.job.model.path}"
    return f"stage {stage.name}: {what}, reads {reads} (config_hash {stage.identity[:12]}) -> {stage.output_path}"


def select_lines(record: RunRecord) -> list[str]:
    """A select stage's counts, as the console and the report show them."""
    figures = record.select or {}
    lines = [f"  {figures.get('rule')}: {count(figures.get('num_input_rows'))} rows of "
             f"{count(figures.get('num_prompts'))} prompts -> {count(figures.get('num_output_rows'))} rows"]
    dropped = [f"{count(figures.get(key))} {what}" for key, what in (
        ("num_filtered_rows", "rows failed `where`"), ("num_unscored_rows", "rows unscored"),
        ("num_single_sample", "prompts with < 2 scored samples"), ("num_ties", "tied prompts"),
        ("num_below_margin", "prompts below min_margin")) if figures.get(key)]
    if dropped:
        lines.append("  dropped: " + ", ".join(dropped))
    if figures.get("score_histogram"):
        lines.append("  scores: " + format_histogram(figures["score_histogram"]))
    margins = figures.get("margin_percentiles")
    if margins:
        lines.append("  pair margins: " + ", ".join(f"{k} {v:.4g}" for k, v in margins.items()))
    if figures.get("margin_histogram"):
        lines.append("  margin histogram: " + format_histogram(figures["margin_histogram"]))
    return lines


def format_stage_results(staged: StagedJob, results) -> str:
    """Each stage's outcome: what ran, what was done already, its summary."""
    blocks = [f"batchgen: {staged.name}: {len(results)} stage(s) in {staged.output_path}/"]
    for result in results:
        stage = result.stage
        did = ("made again (its settings or an earlier stage changed)" if result.is_replaced
               else f"{result.num_units_run} unit(s) run, {result.num_units_skipped} already done")
        blocks.append(f"\n== {describe_stage(stage)}\n   {did}")
        if stage.is_select:
            blocks.append("\n".join(select_lines(result.record)))
        else:
            blocks.append(format_summary(result.record, result.success_path))
    return "\n".join(blocks)

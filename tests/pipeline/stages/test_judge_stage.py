"""An LLM-as-judge stage: each sample's prompt rendered from its columns by input.prompt_template, the
answer constrained to a JSON schema, its fields parsed into columns (output.parse_json) that a select
stage ranks by.

The judge here is the tiny random-weight model (the bundled model's tokenizer and chat template): left
to itself it never writes JSON, so every row that parses does so because the constraint held and the
parse read it; the bundled model judges in test_example_stage_jobs (jobs/judge_dpo.yaml). 200 judged
rows on the bundled model cost ~25 s of this suite; on the tiny one, a few."""

from __future__ import annotations

import json

import jsonschema
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from batchgen.pipeline.stages.text import select_lines
from tests.pipeline.conftest import write_parquet

NUM_PROMPTS, N = 50, 4  # 200 samples to judge
VERDICT = {"type": "object", "properties": {
    "score": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
    "reason": {"type": "string", "enum": ["right", "wrong", "unclear"]}}, "required": ["score", "reason"],
    "additionalProperties": False}
TEMPLATE = ("Rate from 1 to 5 how well the answer fits the question.\nQuestion: {{ messages[-1].content }}\n"
            "Answer: {{ completion }}\nReply in JSON.")


def _samples(tmp_path):
    """An earlier stage's output as a path: 4 samples per prompt (the judge reads `messages` and `completion`)."""
    rows = {"id": [], "sample_index": [], "messages": [], "completion": []}
    for prompt in range(NUM_PROMPTS):
        for sample in range(N):
            rows["id"].append(prompt)
            rows["sample_index"].append(sample)
            rows["messages"].append([{"role": "user", "content": f"What is {prompt} plus {sample}?"}])
            rows["completion"].append(str(prompt + sample) if sample % 2 == 0 else f"I do not know ({sample}).")
    write_parquet(tmp_path / "samples" / "part-00000.parquet", rows)
    return tmp_path / "samples"


def _job(tmp_path, model="smollm2-135m-instruct", **judge) -> str:
    job = {"name": "judged", "output": {"path": str(tmp_path / "out")},
           "model": {"path": str(model), "dtype": "float32", "max_model_len": 256},
           "engine": {"device": "cpu", "kv_cache_memory": "32MiB"},
           "stages": [
               {"name": "judge", "input": {"path": str(_samples(tmp_path)), "prompt_template": TEMPLATE,
                                           "allow_duplicate_ids": True},
                # the longest answer spelled a character a token (a random model may): 31 tokens, and EOS
                "sampling": {"max_tokens": 40, "seed": 5,
                             "structured": {"json": VERDICT, "disable_any_whitespace": True}},
                "output": {"parse_json": True, "keep_columns": ["sample_index", "messages", "completion"],
                           "rename_columns": {"sample_index": "candidate_index", "completion": "candidate"}},
                **judge},
               {"name": "pairs", "task": "select", "input": {"stage": "judge"},
                "select": {"rule": "dpo_pairs", "score_column": "score", "completion_column": "candidate",
                           "messages_column": "messages"}}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


@pytest.fixture(scope="module")
def judged(tmp_path_factory, tiny_model):
    tmp_path = tmp_path_factory.mktemp("judge")
    results = run_staged_job(load_any_job(_job(tmp_path, tiny_model)), progress=False)
    return tmp_path, {r.stage.name: r for r in results}


def test_every_finished_judge_row_parses_into_the_schema_columns(judged):
    tmp_path, results = judged
    table = pq.read_table(tmp_path / "out" / "judge" / "part-00000.parquet")
    assert table.num_rows == NUM_PROMPTS * N
    assert table.schema.field("score").type == "int64" and table.schema.field("reason").type == "string"
    finished = [row for row in table.to_pylist() if row["finish_reason"] == "stop"]
    assert len(finished) == table.num_rows  # 40 tokens are room enough for the schema's longest answer
    for row in finished:
        answer = json.loads(row["completion"])
        jsonschema.validate(answer, VERDICT)
        assert (row["score"], row["reason"]) == (answer["score"], answer["reason"])
    assert results["judge"].record.structured.num_constrained_requests == NUM_PROMPTS * N


def test_the_template_renders_each_rows_columns(judged, engine):  # the tiny judge shares its tokenizer
    tmp_path, _ = judged
    table = pq.read_table(tmp_path / "out" / "judge" / "part-00000.parquet")
    row = table.slice(5, 1).to_pylist()[0]  # prompt 1, sample 1
    rendered = TEMPLATE.replace("{{ messages[-1].content }}", "What is 1 plus 1?").replace(
        "{{ completion }}", "I do not know (1).")
    expected = engine.encode([{"role": "user", "content": rendered}])
    assert row["prompt_tokens"] == len(expected)


def test_a_select_stage_ranks_the_judges_scores(judged):
    tmp_path, results = judged
    judge = pq.read_table(tmp_path / "out" / "judge" / "part-00000.parquet").to_pylist()
    pairs = pq.read_table(tmp_path / "out" / "pairs" / "part-00000.parquet").to_pylist()
    by_id = {}
    for row in judge:
        by_id.setdefault(row["id"], []).append(row["score"])
    candidates = {(row["id"], row["candidate"]): row["score"] for row in judge}
    for pair in pairs:
        assert candidates[pair["id"], pair["chosen"][0]["content"]] == pair["chosen_score"]
        assert candidates[pair["id"], pair["rejected"][0]["content"]] == pair["rejected_score"]
        assert (pair["chosen_score"], pair["rejected_score"]) == (max(by_id[pair["id"]]), min(by_id[pair["id"]]))
    ties = sum(max(s) == min(s) for s in by_id.values())
    assert results["pairs"].record.select["num_ties"] == ties and len(pairs) == NUM_PROMPTS - ties
    scores = [row["score"] for row in judge if row["score"] is not None]
    hist = results["pairs"].record.select["score_histogram"]  # a bin per score of the 1-5 scale seen
    assert hist["counts"] == [scores.count(v) for v in range(min(scores), max(scores) + 1)]
    printed = "\n".join(select_lines(results["pairs"].record))
    assert "  scores: " + ", ".join(f"{v}: {scores.count(v)}" for v in sorted(set(scores))) in printed


def test_judge_settings_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(JobError, match=r"(?s)stage 'judge'.*input.prompt_template: is not a valid Jinja template"):
        load_any_job(_job(tmp_path, input={"path": "x", "prompt_template": "{{ completion"}))
    with pytest.raises(JobError, match=r"output.parse_json: needs a JSON schema in sampling.structured"):
        load_any_job(_job(tmp_path, sampling={"max_tokens": 8}))

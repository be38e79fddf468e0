"""task: reward: (chat prompt, completion) rows scored by a tiny random reward model equal HF
`AutoModelForSequenceClassification`'s float32 logits within 1e-4 (a one-label Llama; a two-label Qwen3,
written as a list per row); the completions of a prompt share
its blocks in the prefix cache; bad rows become error rows; a deleted part is redone on resume and two
static shards give the same rows; a model without a classification head, and the job file's impossible
combinations, are refused naming the model, its architecture or the key, before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from batchgen.pipeline.config import validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.shards import ShardSpec, run_shard
from tests.pipeline.conftest import read_output, write_parquet
from tests.tiny_reward import (  # noqa: F401  (tiny_reward_model: a fixture)
    conversation,
    hf_rewards,
    pairs,
    save_tiny_classifier,
    tiny_reward_model,
)

TOLERANCE = 1e-4
NUM_PAIRS = 40
ENGINE = {"device": "cpu", "kv_cache_memory": "16MiB"}


def reward_job(tmp: Path, model: Path, input_path: Path, **sections):
    raw = {"name": "rm", "task": "reward", "model": {"path": str(model), "dtype": "float32", "max_model_len": 128},
           "engine": ENGINE,
           "input": {"path": str(input_path), "messages_column": "messages", "rows_per_unit": 16,
                     **sections.pop("input", {})},
           "output": {"path": str(tmp / "out"), "keep_columns": ["completion"], **sections.pop("output", {})},
           **sections}
    return validate_job(raw, tmp)


@pytest.fixture(scope="module")
def rewarded(tmp_path_factory, tiny_reward_model):  # noqa: F811
    """40 pairs (10 prompts x 4 completions, ids repeating per prompt) and two bad rows, run once."""
    hf, folder = tiny_reward_model
    tmp = tmp_path_factory.mktemp("reward")
    data = pairs()
    messages = [m for m, _ in data] + [[{"role": "user", "content": "why"}]] * 2
    completions = [c for _, c in data] + [None, "word " * 300]
    ids = [i // 4 for i in range(NUM_PAIRS)] + [100, 101]
    path = write_parquet(tmp / "in.parquet", pa.table({"id": ids, "messages": messages, "completion": completions}))
    job = reward_job(tmp, folder, path)
    result = run_job(job, progress=False)
    return hf, folder, tmp, path, job, result, read_output(tmp / "out").to_pylist()


def test_rewards_equal_hf_logits_and_prompts_are_computed_once(rewarded, hf_tokenizer):
    hf, _, _, _, _, result, rows = rewarded
    token_lists = [hf_tokenizer.apply_chat_template(conversation(m, c), tokenize=True, return_dict=False)
                   for m, c in pairs()]
    reference = hf_rewards(hf, token_lists, batched=True)[:, 0]  # (40,)
    ours = torch.tensor([row["reward"] for row in rows[:NUM_PAIRS]])
    assert (ours - reference).abs().max().item() <= TOLERANCE
    assert [row["prompt_tokens"] for row in rows[:NUM_PAIRS]] == [len(ids) for ids in token_lists]
    assert [row["completion"] for row in rows[:NUM_PAIRS]] == [c for _, c in pairs()]  # kept, in input order
    assert [(row["id"], row["sample_index"]) for row in rows[:8]] == [(i // 4, i % 4) for i in range(8)]
    assert all(row["finish_reason"] == "stop" and row["error"] is None for row in rows[:NUM_PAIRS])
    assert sum(row["cached_tokens"] for row in rows[:NUM_PAIRS]) > 0  # shared prompts from the prefix cache
    assert result.record.num_errors == 2


def test_a_two_label_qwen3_model_writes_a_list_per_row_equal_to_hf(hf_tokenizer, tmp_path):
    hf = save_tiny_classifier("Qwen3ForSequenceClassification", hf_tokenizer, tmp_path / "qwen3-rm", num_labels=2,
                              seed=5)
    data = pairs()
    path = write_parquet(tmp_path / "in.parquet", {"id": [i // 4 for i in range(NUM_PAIRS)],
                                                    "messages": [m for m, _ in data],
                                                    "completion": [c for _, c in data]})
    run_job(reward_job(tmp_path, tmp_path / "qwen3-rm", path), progress=False)
    table = read_output(tmp_path / "out")
    assert table.schema.field("reward").type == pa.list_(pa.float32())
    token_lists = [hf_tokenizer.apply_chat_template(conversation(m, c), tokenize=True, return_dict=False)
                   for m, c in data]
    reference = hf_rewards(hf, token_lists, batched=True)  # (40, 2)
    ours = torch.tensor(table.column("reward").to_pylist())
    assert ours.shape == (NUM_PAIRS, 2) and (ours - reference).abs().max().item() <= TOLERANCE


def test_bad_rows_become_error_rows_naming_what_is_wrong(rewarded):
    rows = rewarded[6][NUM_PAIRS:]
    assert [(r["finish_reason"], r["reward"]) for r in rows] == [("error", None)] * 2
    assert rows[0]["error"] == "completion is null"
    assert rows[1]["error"].startswith("overlong prompt and completion") and "max_model_len 128" in rows[1]["error"]


def test_a_deleted_part_is_redone_and_two_shards_give_the_same_rows(rewarded):
    _, _, tmp, _, job, _, rows = rewarded
    (tmp / "out" / "part-00001.parquet").unlink()
    result = run_job(job, progress=False)
    assert (result.num_units_run, result.num_units_skipped) == (1, 2) and result.record.resumed
    assert _without_times(read_output(tmp / "out").to_pylist()) == _without_times(rows)

    sharded = job.model_copy(update={"output": job.output.model_copy(update={"path": str(tmp / "sharded")})})
    for index in (0, 1):
        run_shard(sharded, ShardSpec(index, 2), progress=False)
    success = json.loads((tmp / "sharded" / "_SUCCESS").read_text())
    assert success["num_rows"] == NUM_PAIRS + 2 and success["num_errors"] == 2
    assert _without_times(read_output(tmp / "sharded").to_pylist()) == _without_times(rows)


def _without_times(rows: list[dict]) -> list[dict]:
    """Rows without their latency columns, rewards to 1e-5 (a resumed unit's prompts may come from the
    cache or not: the same values to float32 rounding)."""
    return [{k: round(v, 5) if k == "reward" and v is not None else v for k, v in row.items()
             if k not in ("queue_s", "e2e_s", "cached_tokens")} for row in rows]


def test_a_model_without_a_classification_head_is_refused_before_weights_load(rewarded, tmp_path):
    _, folder, _, path, _, _, _ = rewarded
    job = reward_job(tmp_path, Path("smollm2-135m-instruct"), path)
    with pytest.raises(JobError, match=r"task: reward needs a reward model with a classification head "
                                       r"\(`\*ForSequenceClassification`\); smollm2-135m-instruct is LlamaForCausalLM"):
        plan_job(job)
    generate = validate_job({"name": "g", "model": {"path": str(folder)},
                             "input": {"path": str(path), "messages_column": "messages"}}, tmp_path)
    with pytest.raises(JobError, match=r"is LlamaForSequenceClassification, a sequence classifier"):
        plan_job(generate)


BASE = {"name": "t", "model": {"path": "rm"}, "task": "reward", "input": {"path": "in.parquet"}}


@pytest.mark.parametrize("changes, expected", [
    ({"sampling": {"n": 2, "temperature": 1.0}}, "sampling.n: must be 1 with task: reward"),
    ({"sampling": {"logprobs": True}}, "sampling.logprobs: must be false with task: reward"),
    ({"sampling_columns": {"temperature": "t"}}, "sampling_columns: does not apply to task: reward"),
    ({"input": {"path": "in.parquet", "continuations_column": "c"}},
     "input.continuations_column: does not apply to task: reward"),
    ({"task": "generate", "input": {"path": "in.parquet", "completion_column": "c"}},
     "input.completion_column: applies to task: reward only"),
    ({"engine": {"tensor_parallel_size": 2}}, "engine.tensor_parallel_size: must be 1 with task: reward"),
    ({"input": {"path": "in.jsonl"}}, "input.format: must be parquet with task: reward"),
    ({"metrics": {"em": {"type": "exact_match", "reference_column": "a"}}}, "metrics: does not apply to task: reward"),
])
def test_impossible_combinations_are_refused_naming_the_key(changes, expected):
    with pytest.raises(JobError) as info:
        validate_job({**BASE, **changes}, Path("."))
    assert expected in str(info.value)


def test_repeated_ids_are_allowed_by_default_and_the_completion_column_is_checked(rewarded, tmp_path):
    _, folder, _, path, _, _, _ = rewarded
    job = validate_job({**BASE, "model": {"path": str(folder)}, "input": {"path": str(path), "prompt_column": "x"}},
                       tmp_path)
    assert job.input.allow_duplicate_ids
    with pytest.raises(JobError, match=r"column 'x' \(input.prompt_column\) is missing"):
        plan_job(job)
    job = validate_job({**BASE, "model": {"path": str(folder)},
                        "input": {"path": str(path), "messages_column": "messages", "completion_column": "answer"}},
                       tmp_path)
    with pytest.raises(JobError, match=r"column 'answer' \(input.completion_column\) is missing"):
        plan_job(job)

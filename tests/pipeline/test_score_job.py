"""task: loglikelihood: 40 contexts x 4 continuations scored by a job equal HF transformers' float32
log-softmax (each sum within 1e-3, is_greedy as lm-evaluation-harness' argmax check); bad rows become
error rows, a deleted part is redone on resume, two static shards give the local rows and one _SUCCESS,
and the job file's impossible combinations are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from batchgen.pipeline.config import validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.shards import ShardSpec, run_shard
from tests.pipeline.conftest import make_job, read_output, write_parquet

SUBJECTS = ["The cat", "My neighbour", "A small boat", "The old king", "Our teacher", "The red car", "A tall tree",
            "The river"]
VERBS = ["sat on the", "looked at the", "ran towards the", "waited near the", "sang about the"]
ENDINGS = [" mat.", " door", " sea and the sky", " house"]
NUM_CONTEXTS = 40
SUM_TOLERANCE = 1e-3


def contexts() -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {VERBS[i % len(VERBS)]} {'big ' * (i % 3)}".rstrip()
            for i in range(NUM_CONTEXTS)]


def continuations(i: int) -> list[str]:
    return ENDINGS[i % 4:] + ENDINGS[:i % 4]


def score_job(tmp_path: Path, path: Path, **sections):
    return make_job(tmp_path, str(path), task="loglikelihood",
                    input={"continuations_column": "choices", "apply_chat_template": False, "rows_per_unit": 16,
                           **sections.pop("input", {})},
                    output={"keep_columns": ["subject"], **sections.pop("output", {})}, **sections)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, engine):
    """The 40 contexts plus three bad rows (an empty list, a null list, an empty continuation), run once."""
    tmp = tmp_path_factory.mktemp("score")
    texts = contexts() + ["Bad one", "Bad two", "Bad three"]
    choices = [continuations(i) for i in range(NUM_CONTEXTS)] + [[], None, [" fine", ""]]
    table = pa.table({"id": list(range(len(texts))), "prompt": texts, "choices": choices,
                      "subject": [t.split()[1] for t in texts]})
    path = write_parquet(tmp / "in.parquet", table)
    job = score_job(tmp, path, sampling={"logprobs": True})
    result = run_job(job, engine=engine, progress=False)
    return tmp, path, job, result, read_output(tmp / "out").to_pylist()


@torch.no_grad()
def test_forty_contexts_by_four_continuations_equal_hf(scored, engine, hf_model):
    _, _, _, result, rows = scored
    prefill_tokens = 0
    for row, context in zip(rows[:NUM_CONTEXTS], contexts()):
        assert row["error"] is None and row["finish_reason"] == "stop"
        context_ids = engine.tokenizer.encode(context)
        assert row["prompt_tokens"] == len(context_ids) and row["subject"] == context.split()[1]
        assert len(row["continuation_logprob"]) == 4
        # The four pairs in one batch, right-padded: a causal model's logits at a real position do not
        # see the padding after it.
        width = max(len(ids) for ids in row["continuation_token_ids"])
        batch = torch.tensor([context_ids + ids + [0] * (width - len(ids)) for ids in row["continuation_token_ids"]])
        all_logits = hf_model(batch).logits[:, len(context_ids) - 1:].float()  # (4, width + 1, V)
        for k, (total, num, greedy, ids, values) in enumerate(zip(
                row["continuation_logprob"], row["continuation_num_tokens"], row["is_greedy"],
                row["continuation_token_ids"], row["continuation_token_logprobs"])):
            log_softmax = torch.log_softmax(all_logits[k, :len(ids)], dim=-1)
            expected = log_softmax.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
            assert abs(total - expected.sum().item()) <= SUM_TOLERANCE, (context, ids)
            assert greedy == bool((log_softmax.argmax(-1) == torch.tensor(ids)).all())
            assert num == len(ids) == len(values) and values == pytest.approx(expected.tolist(), abs=1e-4)
        prefill_tokens += len(context_ids)
    assert sum(r["is_greedy"].count(True) for r in rows[:NUM_CONTEXTS]) > 0  # the check can say yes
    record = result.record
    assert record.num_requests == NUM_CONTEXTS + 3 and record.num_errors == 3
    assert record.completion_tokens == sum(sum(r["continuation_num_tokens"]) for r in rows[:NUM_CONTEXTS])


def test_bad_rows_become_error_rows_naming_what_is_wrong(scored):
    rows = scored[4]
    errors = [(r["finish_reason"], r["error"], r["continuation_logprob"]) for r in rows[NUM_CONTEXTS:]]
    assert errors[0][:2] == ("error", "continuations is empty: give at least one continuation to score")
    assert errors[1][:2] == ("error", "continuations is null")
    assert errors[2][:2] == ("error", "continuations[1] is empty: there is nothing to score")
    assert all(e[2] is None for e in errors)


def test_context_computed_once_for_its_continuations(tmp_path, engine):
    # A context of 40 tokens (2 full blocks and 8 tokens): its 4 continuations hold its blocks, the
    # partial one copied by all but the last to write; the context's tokens are computed once.
    context = " ".join(["word"] * 40)
    path = write_parquet(tmp_path / "in.parquet", {"id": [0], "prompt": [context], "choices": [ENDINGS]})
    before = engine.stats
    run_job(score_job(tmp_path, path, output={"keep_columns": []}), engine=engine, progress=False)
    after = engine.stats
    row = read_output(tmp_path / "out").to_pylist()[0]
    num_context = row["prompt_tokens"]
    scored_tokens = sum(row["continuation_num_tokens"])
    computed = after["num_prefill_tokens"] - before["num_prefill_tokens"]
    cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    # (context - 1) once (less what the cache held), then per continuation its context's last token and itself
    assert computed == num_context - 1 - cached + 4 + scored_tokens
    assert after["num_block_copies"] - before["num_block_copies"] == 3


def test_a_deleted_part_is_redone_and_two_shards_give_the_same_rows(scored, engine):
    tmp, _, job, _, rows = scored
    (tmp / "out" / "part-00001.parquet").unlink()
    result = run_job(job, engine=engine, progress=False)
    assert (result.num_units_run, result.num_units_skipped) == (1, 2) and result.record.resumed
    assert _without_times(read_output(tmp / "out").to_pylist()) == _without_times(rows)

    sharded = job.model_copy(update={"output": job.output.model_copy(update={"path": str(tmp / "sharded")})})
    for index in (0, 1):
        run_shard(sharded, ShardSpec(index, 2), engine=engine, progress=False)
    success = json.loads((tmp / "sharded" / "_SUCCESS").read_text())
    assert success["num_requests"] == NUM_CONTEXTS + 3 and success["num_errors"] == 3
    assert _without_times(read_output(tmp / "sharded").to_pylist()) == _without_times(rows)


def _without_times(rows: list[dict]) -> list[dict]:
    """The rows without their latency columns (the rest is equal run to run)."""
    return [{k: v for k, v in row.items() if k not in ("queue_s", "e2e_s")} for row in rows]


BASE = {"name": "t", "model": {"path": "smollm2-135m-instruct"}, "task": "loglikelihood",
        "input": {"path": "in.parquet", "continuations_column": "choices"}}


@pytest.mark.parametrize("changes, expected", [
    ({"input": {"path": "in.parquet"}}, "input.continuations_column: task: loglikelihood needs one of"),
    ({"sampling": {"n": 2, "temperature": 1.0}}, "sampling.n: must be 1 with task: loglikelihood"),
    ({"sampling": {"beam_width": 2}}, "sampling.beam_width: must be 1 with task: loglikelihood"),
    ({"sampling": {"logprobs": 3}}, "sampling.logprobs: must be false or true with task: loglikelihood"),
    ({"sampling_columns": {"temperature": "t"}}, "sampling_columns: does not apply to task: loglikelihood"),
    ({"task": "generate"}, "input.continuations_column: applies to task: loglikelihood only"),
    ({"task": "score"}, "task: Input should be 'generate', 'loglikelihood'"),
    ({"engine": {"tensor_parallel_size": 2}}, "engine.tensor_parallel_size: must be 1 with task: loglikelihood"),
    ({"sampling": {"structured": {"regex": "[ab]"}}}, "sampling.structured: does not apply to task: loglikelihood"),
    ({"input": {"path": "in.parquet", "continuations_column": "choices", "schema_column": "s"}},
     "input.schema_column: does not apply to task: loglikelihood"),
])
def test_impossible_combinations_are_refused_naming_the_key(changes, expected):
    raw = {**BASE, **changes}
    with pytest.raises(JobError) as info:
        validate_job(raw, Path("."))
    assert expected in str(info.value)


@pytest.mark.parametrize("sampling, expected", [
    ({"beam_width": 4, "temperature": 0.7}, "sampling.temperature: must be 0 with beam search"),
    ({"beam_width": 4, "n": 5}, "sampling.n: must be at most beam_width"),
    ({"length_penalty": 0.5}, "sampling.length_penalty: applies to beam search only"),
])
def test_beam_settings_are_checked_naming_the_key(sampling, expected):
    raw = {"name": "t", "model": {"path": "smollm2-135m-instruct"}, "input": {"path": "in.parquet"},
           "sampling": sampling}
    with pytest.raises(JobError) as info:
        validate_job(raw, Path("."))
    assert expected in str(info.value)


def test_beam_search_is_refused_with_tensor_parallelism_naming_the_key():
    raw = {"name": "t", "model": {"path": "smollm2-135m-instruct"}, "input": {"path": "in.parquet"},
           "sampling": {"beam_width": 2}, "engine": {"tensor_parallel_size": 2}}
    with pytest.raises(JobError, match=r"engine.tensor_parallel_size: must be 1 with sampling.beam_width > 1"):
        validate_job(raw, Path("."))


def test_a_scored_chat_context_renders_with_the_jobs_chat_template(tmp_path, engine):
    from batchgen.pipeline.parquet_rows import decode_batch
    from batchgen.pipeline.request_builder import RequestBuilder

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ greeting }}assistant:"
    table = pa.table({"id": [0], "prompt": ["The cat sat on the"], "choices": [ENDINGS]})
    job = score_job(tmp_path, write_parquet(tmp_path / "in.parquet", table),
                    input={"apply_chat_template": True, "chat_template": template,
                           "chat_template_kwargs": {"greeting": "Ahoy "}})
    [row] = decode_batch(table.to_batches()[0], job)
    task = RequestBuilder(job, engine).build(row, 0, 0)
    expected = engine.tokenizer.hf.encode("user: The cat sat on the\nAhoy assistant:", add_special_tokens=False)
    assert task.error is None and task.token_ids == expected

"""sampling.logprobs: N writes token_logprobs and top_logprobs (the N most likely per token), as the engine gives them."""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.job import run_job
from batchgen.pipeline.schema import TOP_LOGPROB, generated_fields
from tests.pipeline.conftest import make_job, read_output, write_parquet

PROMPTS = ["Name a colour.", "Count to three."]


def test_generated_columns_follow_the_logprobs_setting():
    def names(value):
        return [f.name for f in generated_fields(value)]

    assert "token_logprobs" not in names(False) and "top_logprobs" not in names(False)
    assert names(None) == names(False)
    assert "token_logprobs" in names(True) and "top_logprobs" not in names(True) and names(0) == names(True)
    assert names(3).index("top_logprobs") == names(3).index("token_logprobs") + 1


def test_job_with_logprobs_n_writes_the_engines_top_logprobs(tmp_path, engine):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": PROMPTS})
    job = make_job(tmp_path, str(path), sampling={"max_tokens": 3, "logprobs": 2})
    run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out")
    assert out.schema.field("top_logprobs").type.value_type.value_type == TOP_LOGPROB

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    for row, prompt in zip(out.to_pylist(), PROMPTS):
        engine.add_request(f"ref-{row['id']}", [{"role": "user", "content": prompt}], params)
        ref = None
        while engine.has_unfinished():
            ref = next((o for o in engine.step()), ref)
        c = ref.outputs[0]
        assert row["completion_token_ids"] == c.token_ids
        assert len(row["top_logprobs"]) == len(row["token_logprobs"]) == 3
        for position, expected in zip(row["top_logprobs"], c.top_logprobs):
            assert [t["token_id"] for t in position] == [t.token_id for t in expected]
            assert [t["token"] for t in position] == [t.token for t in expected]
            assert [t["logprob"] for t in position] == pytest.approx([t.logprob for t in expected], abs=1e-4)
        assert [p[0]["token_id"] for p in row["top_logprobs"]] == row["completion_token_ids"]  # greedy

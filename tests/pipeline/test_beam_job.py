"""sampling.beam_width in a job: the n best beams as rows (sample_index 0 the best), as the engine's beam
search gives them."""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import make_job, read_output, write_parquet

PROMPTS = ["Translate to French: thank you", "Name three fruits."]


def test_a_beam_job_writes_the_n_best_beams_of_each_prompt(tmp_path, engine):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": PROMPTS})
    job = make_job(tmp_path, str(path), sampling={"max_tokens": 6, "beam_width": 3, "n": 2, "logprobs": True})
    result = run_job(job, engine=engine, progress=False)
    rows = read_output(tmp_path / "out").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    params = SamplingParams(temperature=0, max_tokens=6, beam_width=3, n=2, logprobs=0)
    for prompt_id, prompt in enumerate(PROMPTS, start=1):
        engine.add_request(f"ref-{prompt_id}", [{"role": "user", "content": prompt}], params)
        ref = None
        while engine.has_unfinished():
            ref = next(iter(engine.step()), ref)
        mine = [r for r in rows if r["id"] == prompt_id]
        assert [r["completion_token_ids"] for r in mine] == [c.token_ids for c in ref.outputs]
        assert [r["cumulative_logprob"] for r in mine] == pytest.approx([c.cumulative_logprob for c in ref.outputs],
                                                                        abs=1e-4)  # another batch
        scores = [c.score for c in ref.outputs]
        assert scores == sorted(scores, reverse=True)
        assert all(len(r["token_logprobs"]) == len(r["completion_token_ids"]) for r in mine)
    assert result.record.num_rows == 4 and result.record.num_errors == 0

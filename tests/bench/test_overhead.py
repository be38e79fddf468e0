"""`batchgen bench --workload overhead` at toy size: the null model's engine decodes, the split adds up."""

from __future__ import annotations

from batchgen.bench.overhead import NEXT_TOKEN, format_overhead, null_engine, run_overhead
from batchgen.engine import SamplingParams


def test_null_engine_emits_its_fixed_token():
    engine = null_engine(batch_size=2, max_model_len=64)
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       prompt_token_ids=[9, 10, 11])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[0].outputs[0].token_ids == [NEXT_TOKEN] * 3
    assert engine.timings.num_steps == 3


def test_overhead_runs_report_each_part_per_step():
    result = run_overhead(prompt_len=20, steps=3, batch_sizes=(1, 4))
    assert [r["batch_size"] for r in result["runs"]] == [1, 4]
    for r in result["runs"]:
        assert r["steps"] == 3
        assert r["host"] == round(r["schedule"] + r["prepare"] + r["process"], 4)
        assert all(r[name] > 0 for name in ("schedule", "prepare", "process", "forward"))
    text = format_overhead(result)
    assert "schedule" in text and text.count("\n") == 4

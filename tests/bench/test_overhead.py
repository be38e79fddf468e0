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
    result = run_overhead(prompt_len=20, steps=3, batch_sizes=(1, 4), device_ms=None)
    assert [r["batch_size"] for r in result["runs"]] == [1, 4]
    for r in result["runs"]:
        assert r["steps"] == 3
        assert r["host"] == round(r["schedule"] + r["prepare"] + r["process"], 4)
        assert all(r[name] > 0 for name in ("schedule", "prepare", "process", "forward"))
    text = format_overhead(result)
    assert "schedule" in text and text.count("\n") == 4


def test_the_critical_path_on_a_stand_in_gpu_shrinks_with_async_scheduling():
    """20 ms of device time a step: in order the device idles for each step's host work; with the next
    step prepared during this one it idles (median) for less than half of it, and a step takes about
    the device's time."""
    result = run_overhead(prompt_len=20, steps=8, batch_sizes=(32,), device_ms=20.0)
    (row,) = result["critical"]
    assert row["in_order_ms"] > 0 and row["async_ms"] < 0.5 * row["in_order_ms"], row
    assert 20.0 <= row["async_wall_ms"] < 40.0, row  # in order it would be 20 ms + host + wake-ups
    assert "critical path" in format_overhead(result)

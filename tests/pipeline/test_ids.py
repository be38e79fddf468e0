"""Ids: one type across files (merged when lossless, else refused); repeated ids refused unless allowed."""

from __future__ import annotations

import time
from collections import Counter

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.feeder import Feeder
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.request_builder import RowTask
from tests.pipeline.conftest import FakeEngine, make_job, read_output, write_parquet


def test_ids_of_different_kinds_across_files_are_refused_naming_both(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": pa.array([1, 2], pa.int64()), "prompt": ["x", "y"]})
    write_parquet(tmp_path / "in" / "b.parquet", {"id": ["3", "4"], "prompt": ["z", "w"]})
    job = make_job(tmp_path, str(tmp_path / "in"))
    with pytest.raises(JobError) as info:
        plan_job(job)  # `batchgen validate`: before any weight is loaded
    message = str(info.value)
    for part in ("input.id_column", "'id'", "int64", "a.parquet", "string", "b.parquet"):
        assert part in message, message


def test_kept_columns_of_different_kinds_are_refused(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1], "prompt": ["x"], "label": [1.5]})
    write_parquet(tmp_path / "in" / "b.parquet", {"id": [2], "prompt": ["y"], "label": ["good"]})
    job = make_job(tmp_path, str(tmp_path / "in"), output={"keep_columns": ["label"]})
    with pytest.raises(JobError, match=r"output.keep_columns: column 'label' is double in .*a.parquet but string"):
        plan_job(job)


@pytest.mark.parametrize("types,merged", [((pa.int32(), pa.int64()), pa.int64()),
                                          ((pa.uint16(), pa.int8()), pa.int32()),
                                          ((pa.string(), pa.large_string()), pa.large_string())])
def test_lossless_id_types_are_merged_and_the_output_reads_as_one_dataset(tmp_path, types, merged):
    for name, t, ids in (("a", types[0], [1, 2]), ("b", types[1], [3, 4])):
        values = pa.array([str(i) if pa.types.is_large_string(t) or pa.types.is_string(t) else i for i in ids], t)
        write_parquet(tmp_path / "in" / f"{name}.parquet", {"id": values, "prompt": ["p", "q"]})
    job = make_job(tmp_path, str(tmp_path / "in"), input={"rows_per_unit": 1})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    out = tmp_path / "out"
    assert ds.dataset(out, format="parquet").to_table().schema.field("id").type == merged
    assert pl.scan_parquet(out / "*.parquet").collect().height == 4


def test_repeated_ids_are_a_bad_job_naming_the_id_and_both_rows(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": ["u", "v"], "prompt": ["p", "q"]})
    write_parquet(tmp_path / "in" / "b.parquet", {"id": ["w"] + ["v"] * 2999, "prompt": ["r"] * 3000})
    job = make_job(tmp_path, str(tmp_path / "in"))
    with pytest.raises(JobError) as info:
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    message = str(info.value)
    assert "id 'v' appears more than once: row 1 of " in message and "a.parquet and row 1 of " in message
    assert message.rstrip(")").endswith("request of its own") and "b.parquet" in message
    assert "allow_duplicate_ids" in message


def test_allowed_repeats_run_as_separate_requests_in_about_as_many_steps(tmp_path):
    num_rows = 3000
    prompts = [f"q{i}" for i in range(num_rows)]
    write_parquet(tmp_path / "same.parquet", {"id": ["x"] * num_rows, "prompt": prompts})
    write_parquet(tmp_path / "unique.parquet", {"id": list(range(num_rows)), "prompt": prompts})
    steps = {}
    for name in ("same", "unique"):
        job = make_job(tmp_path, str(tmp_path / f"{name}.parquet"), input={"allow_duplicate_ids": True},
                       output={"path": str(tmp_path / f"out-{name}")})
        engine = FakeEngine(job.engine_config())
        run_job(job, engine=engine, progress=False)
        steps[name] = engine.num_steps
        if name == "same":
            assert len(set(engine.added)) == num_rows  # one key per row: nobody waited for a twin
    assert steps["same"] <= steps["unique"] + 1, steps  # 3000 before this change
    out = read_output(tmp_path / "out-same")
    assert out.column("id").to_pylist() == ["x"] * num_rows  # the id as given, every row exactly once
    assert len(set(out.column("completion").to_pylist())) == num_rows


def test_repeated_prompts_draw_their_own_samples(tmp_path, engine):
    prompt = "Write one word."
    write_parquet(tmp_path / "in.parquet", {"id": ["r"] * 4, "prompt": [prompt] * 4})
    job = make_job(tmp_path, str(tmp_path / "in.parquet"), input={"allow_duplicate_ids": True},
                   sampling={"temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True})
    run_job(job, engine=engine, progress=False)
    tokens = [tuple(t) for t in read_output(tmp_path / "out").column("completion_token_ids").to_pylist()]
    assert len(set(tokens)) > 1
    # The first occurrence is keyed by the id itself: the same sample as a job with that row alone.
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    [alone] = engine_alone(engine, "r", prompt, params)
    assert tokens[0] == alone


def engine_alone(engine, request_id, prompt, params):
    engine.add_request(request_id, [{"role": "user", "content": prompt}], params)
    outs = []
    while engine.has_unfinished():
        outs += [tuple(c.token_ids) for out in engine.step() for c in out.outputs]
    return outs


def test_the_feeder_waits_for_a_twin_in_linear_time(fake_engine_for, tmp_path):
    # Keys collide only when an input id equals an internal repeat key; those requests wait in turn.
    job = make_job(tmp_path, str(tmp_path / "unused"))
    engine = fake_engine_for(job)
    num_tasks = 20_000
    tasks = (RowTask(0, i, "same", params=SamplingParams(max_tokens=1), token_ids=[1, 2]) for i in range(num_tasks))
    done = []
    feeder = Feeder(engine, tasks, window=8192, sort_by_length=False, max_in_flight=256,
                    on_output=lambda task, out: done.append(task.offset), on_error=lambda task: None)
    start = time.perf_counter()
    feeder.run()
    assert time.perf_counter() - start < 10  # quadratic before: ~25 s for 20,000 on this machine
    assert Counter(done) == Counter(range(num_tasks)) and engine.num_steps == num_tasks

"""Ordering within a window, the bounded engine queue, and input order restored in each unit file."""

from __future__ import annotations

import pyarrow.parquet as pq

from batchgen.pipeline.job import run_job
from batchgen.pipeline.ordering import order_window
from batchgen.pipeline.request_builder import RowTask
from tests.pipeline.conftest import make_job, read_output, write_parquet


def task(name: str, token_ids: list[int]) -> RowTask:
    return RowTask(0, 0, name, token_ids=token_ids)


def test_window_groups_shared_prefixes_and_sorts_by_length():
    header = list(range(100, 120))  # shared by all (a chat template header): not a reason to group
    shared = list(range(500, 540))  # a long few-shot prefix shared by three requests
    tasks = [
        task("long", header + [1] * 60),
        task("fewshot-b", header + shared + [7, 7, 7]),
        task("short", header + [2] * 5),
        task("fewshot-a", header + shared + [9]),
        task("mid", header + [3] * 30),
        task("fewshot-c", header + shared + [8] * 10),
    ]
    names = [t.request_id for t in order_window(tasks, sort_by_length=True, block_size=16)]
    few = [names.index(n) for n in ("fewshot-a", "fewshot-b", "fewshot-c")]
    assert max(few) - min(few) == 2  # the shared-prefix group sits together, shortest first
    assert names[min(few):max(few) + 1] == ["fewshot-a", "fewshot-b", "fewshot-c"]
    singles = [n for n in names if not n.startswith("fewshot")]
    assert singles == ["short", "mid", "long"]  # unrelated prompts: by length
    assert [t.request_id for t in order_window(tasks, sort_by_length=False)] == [t.request_id for t in tasks]


def test_rows_of_different_adapters_are_not_grouped_by_a_shared_prefix():
    """Blocks are never shared across LoRA adapters, so a prefix shared across them groups nothing; the
    window's common header is still measured over all rows."""
    header = list(range(100, 120))
    shared = list(range(500, 540))
    tasks = [task("a-long", header + shared + [1] * 30), task("b-short", header + shared + [2]),
             task("a-short", header + shared + [3]), task("base-mid", header + [4] * 20)]
    for t, adapter in zip(tasks, ["A", "B", "A", None]):
        t.lora_name = adapter
    names = [t.request_id for t in order_window(tasks, sort_by_length=True, block_size=16)]
    # A's two rows share the prefix and sit together; B's row is a group of its own, by its length.
    assert names.index("a-long") - names.index("a-short") == 1
    assert names == ["base-mid", "b-short", "a-short", "a-long"]  # groups by mean length


def test_queue_stays_bounded_and_files_keep_input_order(tmp_path, fake_engine_for):
    prompts = [("x" * (50 - i)) if i % 2 else f"shared prefix {i}" for i in range(40)]
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(100, 140)), "prompt": prompts})
    job = make_job(tmp_path, str(path), engine={"max_num_seqs": 3}, input={"rows_per_unit": 15},
                   batching={"window": 16})
    engine = fake_engine_for(job)
    run_job(job, engine=engine, progress=False)
    # The feeder keeps two times max_num_seqs in the engine: filled to the bound, never the whole input.
    assert engine.max_unfinished == 2 * 3
    assert engine.added != [str(i) for i in range(100, 140)]  # the window was reordered...
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    ids = [pq.read_table(p).column("id").to_pylist() for p in parts]
    assert ids == [list(range(100, 115)), list(range(115, 130)), list(range(130, 140))]  # ...the files were not


def test_allowed_duplicate_ids_are_all_written_in_input_order(tmp_path, fake_engine_for):
    path = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b", "a", "c"], "prompt": ["p1", "p2", "p3", "p4"]})
    job = make_job(tmp_path, str(path), engine={"max_num_seqs": 8}, input={"allow_duplicate_ids": True})
    engine = fake_engine_for(job)
    run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == ["a", "b", "a", "c"]
    assert out.column("error").null_count == 4
    assert engine.num_steps == 1  # the repeat has a key of its own: it did not wait for its twin

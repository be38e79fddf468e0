"""One run per output folder: a second run is refused naming the holder; leases expire and are taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import yaml

from batchgen.pipeline.job import run_job
from batchgen.pipeline.output import lease
from batchgen.pipeline.output.lock import lock_folder, lock_name
from batchgen.pipeline.output.lock_holder import Holder, LockHeld, LockLost
from batchgen.pipeline.storage import Storage, is_temp_name
from tests.pipeline.conftest import FakeEngine, GatedEngine, make_job, read_output, write_parquet

NUM_ROWS = 1200  # one unit; FakeEngine finishes 128 rows a step, so a temp part exists after 4 steps


def start_gated_run(tmp_path, **sections):
    """A run in a thread, stopped mid-unit with its temp part file open; returns (thread, engine, errors)."""
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(NUM_ROWS)), "prompt": ["p"] * NUM_ROWS})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": NUM_ROWS}, **sections)
    engine = GatedEngine(job.engine_config(), gate_step=6)
    errors = []

    def target():
        try:
            run_job(job, engine=engine, progress=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    assert engine.paused.wait(60), errors
    return job, thread, engine, errors


def temp_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temp_name(p.name))


@pytest.mark.parametrize("second", ["same config", "other config with --overwrite"])
def test_a_second_run_is_refused_naming_the_holder_and_touches_nothing(tmp_path, second):
    job, thread, engine, errors = start_gated_run(tmp_path)
    out = tmp_path / "out"
    temps = temp_files(out)
    assert temps, "the first run has a part open"
    if second == "same config":
        other, overwrite = job, False
    else:
        other, overwrite = make_job(tmp_path, job.input.path, input={"rows_per_unit": NUM_ROWS},
                                    sampling={"temperature": 0.5}), True
    try:
        with pytest.raises(LockHeld) as info:
            run_job(other, engine=FakeEngine(other.engine_config()), overwrite=overwrite, progress=False)
        message = str(info.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message and "started" in message
        assert "Wait for it to finish" in message
        assert temp_files(out) == temps  # the refused run deleted nothing
    finally:
        engine.gate.set()
        thread.join(60)
    assert not errors, errors
    rows = read_output(out)
    assert Counter(rows.column("id").to_pylist()) == Counter(range(NUM_ROWS))  # every row exactly once
    manifest = json.loads((out / "_batchgen.json").read_text())
    success = json.loads((out / "_SUCCESS").read_text())
    assert manifest["config_hash"] == success["config_hash"] == job.config_hash()
    assert not temp_files(out)


@pytest.mark.subprocess
def test_the_command_line_exits_2_naming_the_holder(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "prompt": ["p"]})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": "locked", "model": {"path": "smollm2-135m-instruct"},
                                        "input": {"path": "in.parquet"}, "output": {"path": "out"}}))
    with lock_folder(Storage(str(tmp_path / "out"))) as held:
        result = subprocess.run([sys.executable, "-m", "batchgen.cli.main", "run", str(job_file), "--no-progress"],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"pid {os.getpid()}" in result.stderr and held.holder.run_id in result.stderr
    assert "in use by another batchgen run" in result.stderr


@pytest.mark.parametrize("url", ["local", "memory://lock-modes/out"])
def test_shared_holders_coexist_and_exclude_an_exclusive_one(tmp_path, url):
    storage = Storage(str(tmp_path / "out") if url == "local" else url)
    first, second = lock_folder(storage, shared=True), lock_folder(storage, shared=True)
    with pytest.raises(LockHeld, match="shared holder pid"):
        lock_folder(storage)
    shard = lock_folder(storage, name=lock_name("0-of-2"))  # a shard's own lock, exclusive
    with pytest.raises(LockHeld):
        lock_folder(storage, name=lock_name("0-of-2"))
    for held in (shard, first, second):
        held.release()
    exclusive = lock_folder(storage)
    with pytest.raises(LockHeld):
        lock_folder(storage, shared=True)
    exclusive.release()
    if url != "local":
        assert storage.list_names() == []  # every lease object was removed on release


def lease_target(where: str, s3_options: dict, name: str) -> tuple[str, dict]:
    if where == "memory":
        return f"memory://lease-{name}/out", {}
    return f"s3://batchgen-test/lease-{name}/out", s3_options


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_live_lease_refuses_and_an_expired_one_is_taken_over(tmp_path, where, s3_options, caplog):
    url, options = lease_target(where, s3_options, "takeover")
    storage = Storage(url, options)
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3], "prompt": ["a", "b", "c"]})
    job = make_job(tmp_path, str(path), output={"path": url, "storage_options": options})
    now = time.time()
    live = Holder("otherrun", "elsewhere", 4242, now - 5, expires=now + 60)
    storage.fs.pipe_file(storage.join("_batchgen.lock"), live.to_json().encode())
    with pytest.raises(LockHeld, match=r"pid 4242 on host elsewhere.*remove .*_batchgen.lock"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    storage.fs.invalidate_cache()
    assert storage.list_names() == ["_batchgen.lock"]  # nothing written

    dead = Holder("deadrun", "elsewhere", 4242, now - 3600, expires=now - 600)  # its process died an hour ago
    storage.fs.pipe_file(storage.join("_batchgen.lock"), dead.to_json().encode())
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert result.record.num_rows == 3
    assert "took over the expired lease of pid 4242 on host elsewhere" in caplog.text
    storage.fs.invalidate_cache()
    assert "_batchgen.lock" not in storage.list_names()  # released at the end
    storage.fs.rm(storage.root, recursive=True)


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_holder_that_stops_refreshing_loses_its_lease_and_stops(where, s3_options, monkeypatch):
    monkeypatch.setattr(lease, "CLOCK_SKEW_SECONDS", 0.0)
    url, options = lease_target(where, s3_options, "lost")
    storage = Storage(url, options)
    paused = lock_folder(storage, lease_seconds=0.5)
    paused._stop.set()  # a process frozen (SIGSTOP, a VM pause): its lease is no longer refreshed
    with pytest.raises(LockHeld):
        lock_folder(storage, lease_seconds=0.5)
    time.sleep(0.7)
    taker = lock_folder(storage, lease_seconds=0.5)
    with pytest.raises(LockLost):
        paused.check()  # it must not commit anything more
    paused._refresh()
    assert paused.is_lost
    paused.release()  # must not remove the new holder's lease
    with pytest.raises(LockHeld):
        lock_folder(storage, lease_seconds=0.5)
    taker.check()
    taker.release()
    lock_folder(storage).release()
    storage.fs.invalidate_cache()
    assert storage.list_names() == []


def test_a_lease_is_refreshed_while_its_run_lives(monkeypatch):
    monkeypatch.setattr(lease, "CLOCK_SKEW_SECONDS", 0.0)
    storage = Storage("memory://lease-refresh/out")
    held = lock_folder(storage, lease_seconds=0.3)
    time.sleep(1.0)  # three lease lifetimes
    held.check()
    with pytest.raises(LockHeld):
        lock_folder(storage, lease_seconds=0.3)
    held.release()
    assert storage.list_names() == []


def test_racing_lease_takers_get_exactly_one_lock():
    storage = Storage("memory://lease-race/out")
    barrier = threading.Barrier(8)
    won, refused = [], []

    def take():
        barrier.wait()
        try:
            won.append(lock_folder(storage))
        except LockHeld:
            refused.append(1)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(refused)) == (1, 7)
    won[0].release()
    assert storage.list_names() == []


def test_the_probe_before_the_engine_loads_refuses_a_held_folder_and_creates_nothing(tmp_path):
    from batchgen.pipeline.output import raise_if_locked

    storage = Storage(str(tmp_path / "out"))
    raise_if_locked(storage)  # a folder that does not exist yet: nothing to refuse, nothing made
    assert not (tmp_path / "out").exists()
    with lock_folder(storage):
        with pytest.raises(LockHeld, match="in use by another batchgen run"):
            raise_if_locked(storage)
        with pytest.raises(LockHeld):
            raise_if_locked(storage, shared=True)  # a shard is refused by an exclusive run too
    with lock_folder(storage, shared=True):
        raise_if_locked(storage, shared=True)  # shards coexist
        with pytest.raises(LockHeld):
            raise_if_locked(storage)
    raise_if_locked(storage)  # released: free again, the probe left no lock behind
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_batchgen.lock"]

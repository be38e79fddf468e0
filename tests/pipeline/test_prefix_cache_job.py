"""A job whose prompts share a 300+ token system prompt: per-row cached_tokens and _SUCCESS agree."""

from __future__ import annotations

import json

from batchgen.pipeline.job import run_job
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.prefix_prompts import (
    NUM_SHARED_TOKENS,
    SYSTEM,
    chat,
    shared_prefix_blocks_tokens,
    user_message,
)
from tests.pipeline.conftest import make_job, read_output, write_parquet

NUM_PROMPTS = 16


def test_rows_and_summary_agree_on_cached_tokens(tmp_path, llm):
    users = [user_message(i) for i in range(NUM_PROMPTS)]
    path = write_parquet(tmp_path / "prompts.parquet", {"id": list(range(NUM_PROMPTS)), "prompt": users})
    # The session `llm` engine's settings (its longer context fits these prompts).
    job = make_job(tmp_path, str(path), model={"max_model_len": TEST_ENGINE_KWARGS["max_model_len"]},
                   input={"system_prompt": SYSTEM},
                   sampling={"n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 2})
    run_job(job, engine=llm.engine, progress=False)

    rows = read_output(tmp_path / "out").to_pylist()
    assert len(rows) == 2 * NUM_PROMPTS
    by_id = {}
    for row in rows:
        by_id.setdefault(row["id"], set()).add(row["cached_tokens"])
    assert all(len(values) == 1 for values in by_id.values()), "a request's n rows disagree on cached_tokens"
    cached = {i: values.pop() for i, values in by_id.items()}
    # The job's ordering decides which request goes first; every other one hits all the shared blocks
    # (the first may hit some or all too when an earlier test left the system prompt in the shared
    # engine's cache).
    prompt_ids = [llm.engine.encode(chat(u)) for u in users]
    assert shared_prefix_blocks_tokens(prompt_ids) == NUM_SHARED_TOKENS
    first, *others = sorted(cached.values())
    assert others == [NUM_SHARED_TOKENS] * (NUM_PROMPTS - 1) and 0 <= first <= NUM_SHARED_TOKENS, cached
    assert all(row["prompt_tokens"] == len(prompt_ids[row["id"]]) for row in rows)

    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert success["cached_tokens"] == sum(cached.values())
    assert success["prompt_tokens"] == sum(len(ids) for ids in prompt_ids)

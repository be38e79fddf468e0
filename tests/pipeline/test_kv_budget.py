"""Memory that fits: engine.kv_cache_memory auto on the CPU is sized from what the job can use (issue 40)."""

from __future__ import annotations

import pytest
import yaml

from batchgen.engine import EngineConfig, LLMEngine
from batchgen.engine.kv.capacity import auto_kv_bytes, cpu_kv_cap_bytes
from batchgen.pipeline.config import load_job
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.kv_budget import TEMPLATE_MARGIN_TOKENS, job_kv_budget
from tests.pipeline.conftest import read_output, write_parquet
from tests.pipeline.tiny_model import HIDDEN, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

BYTES_PER_TOKEN = 2 * NUM_LAYERS * NUM_KV_HEADS * (HIDDEN // NUM_HEADS) * 4  # float32
SYSTEM = "Réponds en une phrase."
PROMPTS = ["Hi", "Explain tides.", "日本の首都はどこですか？ 短く答えてください。", "Name a prime.", "Why?"]
MAX_TOKENS, N = 8, 2


def test_auto_takes_what_can_run_at_least_one_sequence_at_most_the_cap():
    bpt, block = 1000, 16
    assert auto_kv_bytes(4, 100, bpt, block, 256, 10**9) == 4 * 112 * bpt  # whole blocks per sequence
    assert auto_kv_bytes(1, 100, bpt, block, 512, 10**9) == 512 * bpt  # the engine's minimum: one max_model_len
    assert auto_kv_bytes(4, 1000, bpt, block, 512, 10**9) == 4 * 512 * bpt  # no sequence beyond max_model_len
    assert auto_kv_bytes(128, 512, bpt, block, 512, 7 * 10**6) == 7 * 10**6  # the cap
    assert cpu_kv_cap_bytes(8 * 2**30) == int(0.2 * 8 * 2**30)
    assert cpu_kv_cap_bytes(64 * 2**30) == 4 * 2**30


def test_an_engine_without_a_job_sizes_auto_for_max_num_seqs_of_max_model_len(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", max_model_len=64,
                                    max_num_seqs=3))
    assert engine.stats["kv_cache"]["num_tokens"] == 3 * 64
    assert engine.stats["kv_cache"]["bytes"] == 3 * 64 * BYTES_PER_TOKEN


def _job_file(tmp_path, tiny_model, **engine) -> str:
    data = tmp_path / "in.parquet"
    write_parquet(data, {"id": list(range(len(PROMPTS))), "prompt": PROMPTS})
    job = {"name": "kv", "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 256},
           "engine": {"device": "cpu", **engine},
           "input": {"path": str(data), "system_prompt": SYSTEM},
           "sampling": {"n": N, "temperature": 0.7, "seed": 1, "max_tokens": MAX_TOKENS},
           "output": {"path": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, allow_unicode=True))
    return str(path)


def test_a_job_gets_its_rows_times_n_sequences_of_its_longest_prompt_plus_max_tokens(tmp_path, tiny_model):
    job = load_job(_job_file(tmp_path, tiny_model))
    plan_job(job)
    budget = job.kv_budget
    longest = max(len(p.encode()) for p in PROMPTS)  # the Japanese prompt: 3 bytes a character
    assert budget.num_seqs == len(PROMPTS) * N
    assert budget.tokens_per_seq == longest + len(SYSTEM.encode()) + TEMPLATE_MARGIN_TOKENS + MAX_TOKENS
    assert budget.bytes_per_token == BYTES_PER_TOKEN
    per_seq = -(-budget.tokens_per_seq // 16) * 16
    assert budget.num_bytes == budget.num_seqs * per_seq * BYTES_PER_TOKEN
    # The bound holds against HF transformers' own tokenizer and chat template: every rendered prompt
    # is at most the bound's prompt tokens.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    for prompt in PROMPTS:
        ids = hf.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                     add_generation_prompt=True, tokenize=True)
        assert len(ids) <= budget.tokens_per_seq - MAX_TOKENS
    # The engine the run builds has that pool; _SUCCESS and the summary say how it was sized.
    result = run_job(job, progress=False)
    kv_cache = result.record.kv_cache
    assert kv_cache["bytes"] == budget.num_bytes and kv_cache["num_tokens"] == budget.num_tokens
    assert "the job's bound of 10 sequences" in kv_cache["sizing"]
    assert read_output(tmp_path / "out").num_rows == len(PROMPTS) * N


def test_max_num_seqs_the_minimum_and_a_set_size_bound_the_pool(tmp_path, tiny_model):
    few = load_job(_job_file(tmp_path, tiny_model, max_num_seqs=3))
    plan_job(few)
    assert few.kv_budget.num_seqs == 3
    one = load_job(_job_file(tmp_path, tiny_model, max_num_seqs=1))
    plan_job(one)  # one sequence of 234 tokens: below one of max_model_len (256), which the engine needs
    assert one.kv_budget.num_tokens == 256 and "the minimum" in one.kv_budget.describe()
    fixed = load_job(_job_file(tmp_path, tiny_model, kv_cache_memory="1MiB"))
    plan_job(fixed)
    assert fixed.kv_budget is None and fixed.engine_config().kv_cache_memory == "1MiB"


def test_a_draft_model_shares_the_budget_and_the_cap(tmp_path, tiny_model):
    job = load_job(_job_file(tmp_path, tiny_model))
    plan = plan_job(job)
    alone = job_kv_budget(job, plan.input_storage, plan.units, 256, BYTES_PER_TOKEN)
    shared = job_kv_budget(job, plan.input_storage, plan.units, 256, BYTES_PER_TOKEN, BYTES_PER_TOKEN)
    assert shared.num_tokens == alone.num_tokens  # room for the same sequences in each pool
    assert shared.num_pool_bytes == 2 * alone.num_bytes
    ram = 5 * alone.num_bytes  # a cap (20% of RAM) of one pool's bytes: both pools together stay under it
    capped = job_kv_budget(job, plan.input_storage, plan.units, 256, BYTES_PER_TOKEN, BYTES_PER_TOKEN, ram=ram)
    assert capped.num_pool_bytes <= cpu_kv_cap_bytes(ram) < capped.num_pool_bytes + 2 * 16 * BYTES_PER_TOKEN
    assert capped.num_tokens == pytest.approx(alone.num_tokens / 2, abs=16)
    drafted = load_job(_job_file(tmp_path, tiny_model), [
        f"engine.speculative={{method: draft_model, model: {tiny_model}, num_speculative_tokens: 2}}"])
    plan_job(drafted)
    assert drafted.kv_budget.draft_bytes_per_token == BYTES_PER_TOKEN
    assert drafted.kv_budget.num_tokens == alone.num_tokens

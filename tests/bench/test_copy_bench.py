"""`batchgen bench --workload copy`: the harness end to end on a tiny run (speculation off, ngram and
draft_model on the committed copy prompts, outputs checked against off; HF prompt lookup as the
peer) and its report. Speed itself is measured by hand (docs/benchmarks/history/speculative-decoding.md), not
here."""

from __future__ import annotations

import pytest

from batchgen.bench.copy_bench import copy_workload, format_copy_report, run_copy_bench
from batchgen.bench.copy_prompts import copy_prompts
from tests.conftest import MODEL


@pytest.mark.slow
def test_copy_bench_runs_every_mode_and_the_peer_with_identical_outputs(llm, hf_model):
    engine = llm.with_engine_settings(max_model_len=1024).engine
    result = run_copy_bench(engine, hf_model, num_speculative_tokens=3, draft_model=MODEL, max_tokens=12,
                            num_requests_at_batch_1=2, switch_output_len=4, say=lambda _: None, batches=(1,))
    runs = result["runs"]
    assert set(runs) == {"off@1", "ngram@1", "draft_model@1"}
    for mode in ("ngram@1", "draft_model@1"):
        same = runs[mode]["identical_to_off"]
        assert same["num_exact"] == same["num_requests"] == 2, mode
        assert runs[mode]["num_draft_tokens"] > 0 and runs[mode]["speedup_vs_off"] > 0
    assert runs["draft_model@1"]["acceptance_rate"] == 1.0  # the model drafting for itself
    peer = result["peer"]
    assert peer["prompt_lookup"]["identical_to_engine_off"]["num_exact"] == 2  # HF greedy: same tokens
    assert peer["ngram_vs_hf_prompt_lookup"] > 0 and result["batch_switch"] is None  # 64 not asked
    report = format_copy_report(result)
    assert "ngram@1" in report and "HF generate, prompt lookup 3" in report


def test_the_copy_prompts_are_committed_data_that_ask_for_copies(llm):
    prompts = copy_prompts()
    assert len(prompts) == 16 and len(set(prompts)) == 16
    workload = copy_workload(llm.engine, 20, 32)  # cycled past the 16, each under its own id
    assert workload.num_requests == 20 and len({r.request_id for r in workload.requests}) == 20
    assert workload.requests[16].prompt_token_ids == workload.requests[0].prompt_token_ids

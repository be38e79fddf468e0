"""Adapters beyond the host cache and the device slots: four adapters in one batch with max_cpu_loras 2
(adapters evicted from host memory and read again) and with max_loras 1 (one adapter per step) give the
same outputs as with room for all four; the scheduler never puts more than max_loras adapters in a step;
the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12)
ORDER = ["A", "B", "C", "D", "A", "B", "C", "D", None]


def _generate(llm, lora_requests, prompt_ids, record=None):
    requests = [lora_requests[name] if name else None for name in ORDER]
    manager = llm.engine.lora
    if record is not None:  # the distinct adapters of every step
        add = manager.add_step_sections

        def recording(packer, lora_ids, num_tokens):
            record.append({i for i in lora_ids if i})
            return add(packer, lora_ids, num_tokens)
        manager.add_step_sections = recording
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in range(len(ORDER))], PARAMS,
                               lora_request=requests)
    finally:
        manager.__dict__.pop("add_step_sections", None)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def reference(lora_llm, lora_requests, prompt_ids):
    """Room for every adapter: four slots, four in host memory."""
    return _generate(lora_llm.with_engine_settings(max_loras=4, max_cpu_loras=4), lora_requests, prompt_ids)


def test_evicted_adapters_are_read_again_with_the_same_outputs(lora_llm, lora_requests, prompt_ids, reference):
    llm = lora_llm.with_engine_settings(max_loras=2, max_cpu_loras=2)
    assert _generate(llm, lora_requests, prompt_ids) == reference
    stats = llm.engine.stats["lora"]
    assert stats["num_host_evictions"] >= 2 and stats["num_adapter_reads"] > 4
    assert stats["in_host_memory"] <= 2


def test_max_loras_1_runs_one_adapter_per_step_with_the_same_outputs(lora_llm, lora_requests, prompt_ids,
                                                                     reference):
    llm = lora_llm.with_engine_settings(max_loras=1, max_cpu_loras=1)
    steps: list[set[int]] = []
    assert _generate(llm, lora_requests, prompt_ids, steps) == reference
    assert max(len(s) for s in steps) == 1
    assert len(set().union(*steps)) == 4  # all four ran, one at a time
    assert llm.engine.stats["lora"]["num_slot_loads"] >= 4


def test_prefix_cache_never_shares_blocks_across_adapters(lora_llm, lora_requests, prompt_ids):
    llm = lora_llm.with_engine_settings(max_loras=2)
    prompt = {"prompt_token_ids": prompt_ids[0] * 3}  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate(prompt, params, lora_request=lora_requests["A"])[0]
    same = llm.generate(prompt, params, lora_request=lora_requests["A"])[0]
    other = llm.generate(prompt, params, lora_request=lora_requests["B"])[0]
    base = llm.generate(prompt, params)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens >= 32  # the same adapter reuses its blocks
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0

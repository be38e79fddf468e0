"""`batchgen bench --workload lora`: the adapters it writes are PEFT folders the engine reads over the
bundled model (every rank and target of the spec), and its report prints each side and its ratio."""

from __future__ import annotations

from batchgen.bench.lora_bench import ADAPTERS, SIDES, format_lora_report, write_adapters
from batchgen.engine import LoRARequest


def test_the_bench_adapters_are_peft_folders_the_engine_reads(lora_llm, tmp_path):
    engine = lora_llm.engine
    folders = write_adapters(engine.model_cfg, tmp_path, seed=0)
    assert write_adapters(engine.model_cfg, tmp_path, seed=0) == folders  # kept from the first run
    for i, (name, folder) in enumerate(folders.items()):
        adapter = engine.lora.add(LoRARequest(f"bench-{name}", 100 + i, str(folder)))
        rank, _, _, targets = ADAPTERS[name]
        assert adapter.rank == rank
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}
        assert {key.rsplit(".", 1)[-1] for key in adapter.weights} == {fused.get(t, t) for t in targets}
        assert len(adapter.weights) == engine.model_cfg.num_layers * len({fused.get(t, t) for t in targets})


def test_the_report_prints_every_side_over_the_base():
    rates = {"base": [100.0, 90.0], "mixed": [80.0, 85.0], "lora_engine_base_rows": [95.0, 97.0], "merged": [99.0, 98.0]}
    best = {name: max(values) for name, values in rates.items()}
    result = {"workload": {"name": "lora", "model": "m", "num_requests": 64, "prompt_len_min": 20, "prompt_len_max": 40,
                           "output_len": 32, "rounds": 2, "merged_adapter": "A"},
              "engine": {"tokens_per_s": best, "tokens_per_s_rounds": rates,
                         "over_base": {n: best[n] / best["base"] for n in SIDES if n != "base"}},
              "machine": {"cpu_busy_before": 0.5}}
    text = format_lora_report(result)
    assert "0.850x base" in text and "0.990x base" in text and "0.970x base" in text
    assert "4 adapters mixed" in text and "adapter A merged" in text and "50%" in text

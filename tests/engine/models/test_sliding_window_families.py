"""Mistral, Qwen2 and Qwen3 configs that set a sliding window run with it, as transformers' classes do.

Each model is built by transformers from a tiny config (tests/engine/models/test_registry.py's
tiny_hf_model: seeded random weights, float32, eager attention, saved beside the bundled tokenizer) with
a 12-token window: Mistral in every layer, Qwen2 / Qwen3 (use_sliding_window) from max_window_layers on,
as their configs' layer_types say. Prompts of 30 to 70 tokens prefill in 16-token chunks beside other
sequences' decodes; every sampled row's logits are within 1e-3 of HF's on the same tokens, and HF's own
logits move when the window is lifted, so a window the engine ignored would fail.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.models.config import ModelConfig
from tests.engine.helpers import captured_logits, relative_error, run_requests
from tests.engine.models.test_registry import hf_config, tiny_hf_model

WINDOW = 12
NUM_TOKENS = 6
LOGITS_TOLERANCE = 1e-3
PROMPT_LENGTHS = (30, 47, 70)
# architecture -> (config keys, each layer's window as the engine must read it); three layers.
FAMILIES = {
    "MistralForCausalLM": ({"sliding_window": WINDOW}, [WINDOW, WINDOW, WINDOW]),
    "Qwen2ForCausalLM": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
                         [None, WINDOW, WINDOW]),
    "Qwen3ForCausalLM": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
                         [None, None, WINDOW]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed(request, hf_tokenizer, tmp_path_factory):
    """(architecture, HF model, its saved folder)."""
    architecture = request.param
    keys, _ = FAMILIES[architecture]
    hf = tiny_hf_model(architecture, len(hf_tokenizer), num_hidden_layers=3, **keys)
    folder = tmp_path_factory.mktemp(architecture)
    hf.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return architecture, hf, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    return {f"p{n}": torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist() for n in PROMPT_LENGTHS}


def test_the_engine_reads_each_layers_window_as_hf_does(windowed):
    architecture, hf, folder = windowed
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    expected = FAMILIES[architecture][1]
    assert [cfg.layer_sliding_window(i) for i in range(cfg.num_layers)] == expected
    hf_windows = [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window) for layer in hf.model.layers]
    assert hf_windows == expected


@pytest.mark.parametrize("keys, expected", [
    ({"architectures": ["MistralForCausalLM"]}, 4096),  # MistralConfig's default for a missing key
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),  # Mistral 7B v0.2 on
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}, None),  # use_sliding_window false
    ({"architectures": ["Qwen3ForCausalLM"], "sliding_window": 32768, "use_sliding_window": False}, None),
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 64}, None),  # HF's Llama has no window
])
def test_published_configs_get_hfs_window(keys, expected):
    assert ModelConfig.from_hf_dict(hf_config(**keys)).sliding_window == expected


def test_qwen_layer_types_in_config_json_win_over_max_window_layers():
    cfg = ModelConfig.from_hf_dict(hf_config(
        architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8, max_window_layers=0,
        layer_types=["full_attention", "sliding_attention"]))
    assert [cfg.layer_sliding_window(i) for i in range(2)] == [None, 8]


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@torch.no_grad()
def test_windowed_logits_equal_hf_batched_and_chunked(windowed, prompts, backend):
    architecture, hf, folder = windowed
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=24,
              max_num_batched_tokens=16, attention_backend=backend)
    assert llm.engine.capabilities.attention_backend == backend
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with captured_logits(llm.engine) as records:
        outputs = run_requests(llm.engine, {rid: (ids, params) for rid, ids in prompts.items()})
    num_moved = 0
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt + outputs[rid].outputs[0].token_ids])
        reference = hf(ids).logits[0, len(prompt) - 1:-1]  # (NUM_TOKENS, V)
        for j in range(NUM_TOKENS):
            error = relative_error(records[(rid, 0, j)], reference[j])
            assert error <= LOGITS_TOLERANCE, f"{architecture} {rid} position {j}: {error:.2e}"
        hf.config.sliding_window = 4096  # HF's masks read it per forward: the window lifted
        try:
            num_moved += relative_error(hf(ids).logits[0, len(prompt) - 1:-1], reference) > 0.05
        finally:
            hf.config.sliding_window = WINDOW
    assert num_moved == len(prompts), "the window does not change HF's logits: the test shows nothing"

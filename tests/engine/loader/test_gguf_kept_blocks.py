"""`quantization: gguf` on the bundled SmolLM2 (Q4_1): the file's own 4-bit blocks, the float path's tokens.

Same weights as the default path (which dequantizes every block to float32 at load), only the
arithmetic order differs, so greedy tokens must agree; a flip is allowed only where the float path's
top-2 logit margin is below 1e-3, and each one is reported.
"""

from __future__ import annotations

import pytest

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.quant.int_linear import IntLinear
from tests.conftest import MODEL, TEST_ENGINE_KWARGS
from tests.engine.helpers import captured_logits, run_requests
from tests.engine.prompts import BOUNDARY_CHATS, CHAT_PROMPTS

NUM_TOKENS = 8
TIE_MARGIN = 1e-3
PROMPTS = (CHAT_PROMPTS + list(BOUNDARY_CHATS.values()))[:24]


@pytest.fixture(scope="module")
def gguf_llm():
    return LLM(MODEL, quantization="gguf", **TEST_ENGINE_KWARGS)


def test_kept_blocks_hold_at_most_20_percent_of_the_float32_linear_bytes(gguf_llm, llm):
    weights = gguf_llm.engine.stats["weights"]
    assert (weights["format"], weights["origin"], weights["num_linear_layers"]) == ("gguf", "GGUF blocks", 120)
    assert weights["linear_bytes_vs_float32"] <= 0.20, weights  # measured 0.1875: nibbles + 2 float32 per 32
    assert weights["float32_linear_bytes"] == llm.engine.stats["weights"]["linear_bytes"]
    layers = [m for m in gguf_llm.engine.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 120 and all(m.bits == 4 and m.group_size == 32 for m in layers)


def test_greedy_tokens_equal_the_float_path_on_24_prompts(gguf_llm, llm):
    assert len(PROMPTS) == 24
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    requests = {f"g{i}": (p, params) for i, p in enumerate(PROMPTS)}
    float_engine = llm.with_engine_settings().engine  # a fresh pool: both runs batch the same way
    with captured_logits(float_engine) as float_logits:
        float_out = run_requests(float_engine, requests)
    kept_out = run_requests(gguf_llm.engine, requests)
    flips = []
    for request_id in requests:
        ours, ref = kept_out[request_id].outputs[0].token_ids, float_out[request_id].outputs[0].token_ids
        if ours == ref:
            continue
        index = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        top = float_logits[(request_id, 0, index)].topk(2).values
        flips.append((request_id, index, (top[0] - top[1]).item()))
    for request_id, index, margin in flips:
        print(f"flip: {request_id} at output token {index}, float top-2 margin {margin:.3g}")
    assert all(margin < TIE_MARGIN for _, _, margin in flips), flips
